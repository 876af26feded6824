"""An on-disk cache of tokenised rows, so that a re-run on the same data skips tokenisation.

A dataset (:class:`~tunesmith.data.SFTDataset`, :class:`~tunesmith.data.PreferenceDataset`)
with a ``cache_dir`` looks up its rows under a key that hashes everything that decides the
tokens: the bytes of the data file, the tokenizer (its whole ``tokenizer.json`` pipeline,
special tokens and chat templates: :meth:`~tunesmith.data.Tokenizer.fingerprint`), every
dataset setting (format, columns, template variables, limits, ...) and the source of
tunesmith's data code (a new version that tokenises differently never reads an old entry).
Only a local data file is cached (a folder or a Hub dataset is tokenised every time).

An entry is one ``<key>.npz`` file (NumPy, read with ``allow_pickle=False``): each sample
field as one flat int64 array plus the per-sample lengths, the source row of each sample and
the data report as JSON. It is written to a temporary file and renamed into place, so a
reader (another rank, a second run) sees a whole entry or none. An entry that cannot be read
is ignored with a warning and rebuilt.

Example::

    cache = TokenCache("~/.cache/tunesmith/tokenized")
    key = cache.key("train.jsonl", tok, {"format": "messages"})
    cache.load(key) is None
    # -> True
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from tqdm import tqdm

from tunesmith.data.report import DataReport, OnBadRow, raise_if_empty, read_samples

__all__ = [
    "CachedRows",
    "TokenCache",
    "code_fingerprint",
    "file_sha256",
    "tokenize_rows",
    "tokenize_with_cache",
    "with_progress",
]

_FORMAT = 2  # bump when the entry layout changes (2: the report numbers rows as messages do)
_T = TypeVar("_T")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes (read in 1 MiB blocks).

    >>> len(file_sha256(__file__))
    64
    """
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def code_fingerprint() -> str:
    """A hash of the source of tunesmith's data code (``tunesmith/data``, its templates
    included): what turns rows into tokens.

    >>> len(code_fingerprint())
    64
    """
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("templates/*.jinja")]):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """Settings as JSON-able plain data (mappings, e.g. a config's, become dicts)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


@dataclasses.dataclass
class CachedRows:
    """What a dataset keeps of its tokenisation: the samples, the source row of each and the
    report. ``path`` is the cache entry it was read from or written to."""

    samples: list[dict[str, Any]]
    row_indices: list[int]
    report: DataReport
    path: Path | None = None


class TokenCache:
    """Tokenised rows on disk under ``cache_dir`` (``~`` expanded), one file per key.

    Example::

        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> _ = Path("train.jsonl").write_text('{"text": "hi"}\\n')
        >>> cache = TokenCache("cache")
        >>> key = cache.key("train.jsonl", tok, {"format": "text", "max_seq_len": 512})
        >>> samples = [{"input_ids": [1, 2], "labels": [2, -100]}]
        >>> cache.store(key, CachedRows(samples, [0], DataReport("train.jsonl", rows=1)))
        PosixPath('/.../cache/train-....npz')
        >>> cache.load(key).samples == samples
        True
        >>> cache.key("train.jsonl", tok, {"format": "text", "max_seq_len": 64}) == key
        False
    """

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(Path(cache_dir).expanduser()))  # `..` resolved

    def key(
        self, source: str | os.PathLike[str], tokenizer: Any, settings: Mapping[str, Any]
    ) -> str | None:
        """The key of ``source``'s rows tokenised by ``tokenizer`` with ``settings``; None when
        it cannot be cached (not a local file, or a tokenizer without ``fingerprint()``)."""
        path = Path(source).expanduser()
        fingerprint = getattr(tokenizer, "fingerprint", None)
        if not path.is_file() or not callable(fingerprint):
            return None
        parts = {
            "format": _FORMAT, "data": file_sha256(path), "tokenizer": fingerprint(),
            "settings": _plain(settings), "code": code_fingerprint(),
        }  # fmt: skip
        text = json.dumps(parts, sort_keys=True, ensure_ascii=True)
        return f"{path.stem[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:32]}"

    def path(self, key: str) -> Path:
        """The entry file of ``key``."""
        return self.root / f"{key}.npz"

    def load(self, key: str) -> CachedRows | None:
        """The rows stored under ``key``; None when there is no entry, or (with a warning
        naming the file) when it cannot be read: the caller tokenises and stores it again."""
        path = self.path(key)
        if not path.is_file():
            return None
        try:
            return _read(path)
        except Exception as error:  # a truncated, foreign or damaged file: rebuild it
            warnings.warn(
                f"tokenized data cache {path} cannot be read ({type(error).__name__}: {error}); "
                "tokenizing again and replacing it",
                stacklevel=2,
            )
            return None

    def store(self, key: str, rows: CachedRows) -> Path:
        """Write ``rows`` under ``key`` atomically (a temporary file renamed into place);
        returns the entry's path."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        arrays = _arrays(rows)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        rows.path = path
        return path


def _arrays(rows: CachedRows) -> dict[str, np.ndarray]:
    fields = list(rows.samples[0]) if rows.samples else []
    meta = {"fields": fields, "report": dataclasses.asdict(rows.report), "format": _FORMAT}
    arrays = {"meta": np.array(json.dumps(meta)), "rows": np.asarray(rows.row_indices, np.int64)}
    for i, name in enumerate(fields):
        values = [sample[name] for sample in rows.samples]
        if all(isinstance(v, list) for v in values):
            arrays[f"len{i}"] = np.asarray([len(v) for v in values], np.int64)
            arrays[f"val{i}"] = np.asarray([x for v in values for x in v], np.int64)
        else:  # one int per sample (e.g. a prompt length)
            arrays[f"val{i}"] = np.asarray(values, np.int64)
    return arrays


def _read(path: Path) -> CachedRows:
    with np.load(path, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        if meta.get("format") != _FORMAT:
            raise ValueError(f"entry format {meta.get('format')!r}, expected {_FORMAT}")
        rows = data["rows"].tolist()
        columns: list[Sequence[Any]] = []
        for i, _ in enumerate(meta["fields"]):
            values = data[f"val{i}"]
            if f"len{i}" in data.files:
                ends = np.cumsum(data[f"len{i}"]).tolist()
                if (ends[-1] if ends else 0) != len(values) or len(ends) != len(rows):
                    raise ValueError(f"field {meta['fields'][i]!r} has the wrong length")
                flat = values.tolist()
                columns.append([flat[a:b] for a, b in zip([0, *ends[:-1]], ends)])
            else:
                if len(values) != len(rows):
                    raise ValueError(f"field {meta['fields'][i]!r} has the wrong length")
                columns.append(values.tolist())
    samples = [dict(zip(meta["fields"], values)) for values in zip(*columns)]
    if not meta["fields"]:
        samples = []
    report = DataReport(**meta["report"])
    return CachedRows(samples, rows, report, path)


def with_progress(items: Sequence[_T], desc: str) -> Iterable[_T]:
    """``items`` with a tqdm progress bar on stderr when it is a terminal (none otherwise).

    >>> list(with_progress([1, 2], "tokenizing"))
    [1, 2]
    """
    return tqdm(items, total=len(items), desc=desc, unit=" rows", disable=None, leave=False)


def tokenize_rows(
    rows: Sequence[Any],
    make_sample: Callable[[Any], tuple[Any, bool]],
    on_bad_row: OnBadRow,
    add: Callable[[CachedRows, Any, int, bool], None],
    what: str = "samples",
) -> CachedRows:
    """Every row of ``rows`` (what :func:`~tunesmith.data.sources.load_rows` read: ``(index,
    where, row)`` items, named by its ``name``) through ``make_sample`` (-> ``(sample, truncated)``) under a progress bar, a bad
    row handled as ``on_bad_row`` says (:func:`~tunesmith.data.report.read_samples`), each kept
    sample put into the result by ``add(built, sample, row_index, truncated)`` (it updates the
    report's counts); a result with nothing kept is refused naming ``what``. The ``build`` of
    the datasets' :func:`tokenize_with_cache`.

    Example::

        >>> class Rows(list):
        ...     name = "a.jsonl"
        >>> def add(built, sample, index, cut):
        ...     built.samples.append(sample); built.row_indices.append(index)
        ...     built.report.samples += 1
        >>> rows = Rows([(0, "line 1", {"x": 1})])
        >>> built = tokenize_rows(rows, lambda r: ({"ids": [r["x"]]}, False), "error", add)
        >>> built.samples, built.row_indices
        ([{'ids': [1]}], [0])
    """
    built = CachedRows([], [], DataReport(source=rows.name))
    progress = with_progress(rows, f"tokenizing {Path(rows.name).name}")
    for index, sample, cut in read_samples(progress, make_sample, on_bad_row, built.report):
        add(built, sample, index, cut)
    raise_if_empty(built.report, what)
    return built


def tokenize_with_cache(
    cache_dir: str | os.PathLike[str] | None,
    source: str | os.PathLike[str],
    tokenizer: Any,
    settings: Mapping[str, Any],
    build: Callable[[], CachedRows],
) -> tuple[CachedRows, str | None]:
    """The rows ``build()`` makes, read from ``cache_dir`` when an entry for ``source``,
    ``tokenizer`` and ``settings`` is there, else built and stored (a store that fails, e.g. a
    full disk, is a warning). Returns them and the line to log (``tokenized data: cache hit
    <path>`` or ``tokenized data: cached to <path>``; None without a cache).

    Example::

        >>> rows = CachedRows([{"input_ids": [1]}], [0], DataReport("a.jsonl", rows=1))
        >>> tokenize_with_cache(None, "a.jsonl", None, {}, lambda: rows) == (rows, None)  # no cache
        True
    """
    cache = TokenCache(cache_dir) if cache_dir is not None else None
    key = cache.key(source, tokenizer, settings) if cache is not None else None
    if cache is None or key is None:
        return build(), None
    hit = cache.load(key)
    if hit is not None:
        hit.report.source = str(Path(source).expanduser())  # as the file reader names it
        return hit, f"tokenized data: cache hit {hit.path}"
    rows = build()
    try:
        path = cache.store(key, rows)
    except OSError as error:
        warnings.warn(f"tokenized data not cached in {cache.root}: {error}", stacklevel=2)
        return rows, None
    return rows, f"tokenized data: cached to {path}"
