"""Read the rows of a dataset: a local JSON/JSONL/Parquet/CSV/text file or a Hub dataset.

JSON Lines (and JSON arrays) are parsed here, line by line, so that a malformed line or
bytes that are not UTF-8 become a bad row with its line number (which the dataset may
skip), and so that rows whose values have different types survive to the per-row checks
instead of failing the whole file in Arrow's schema inference. Parquet and CSV files,
local folders and Hub names go through ``datasets.load_dataset``; CSV cells are read as
strings (CSV has no types, so ``"4"`` stays the text ``"4"``). A file that cannot be read
at all (empty, not UTF-8 in CSV/JSON-array files, not a JSON array...) raises
:class:`~tunesmith.data.report.DataError` naming the file (and the line where known).

Rows are numbered from 0 in source order; blank lines in JSON Lines are not rows.

A ``.txt`` file is plain text for the ``text`` format: each row is ``{"text": ...}``, cut as
``sample_by`` says, with the names and the default of the ``datasets`` library's ``text``
builder (what torchtune's text-completion datasets read a ``.txt`` file with): ``"line"``
(the default: one sample per line, without its line break), ``"paragraph"`` (paragraphs
separated by one or more blank lines, their inner line breaks kept) or ``"document"`` (the
whole file, one sample). Blank lines are never rows, and a line (or paragraph) that is not
UTF-8 is a bad row naming its line.

Example::

    >>> rows = load_rows("train.jsonl")          # doctest: +SKIP
    >>> for index, where, row in rows:  # doctest: +SKIP
    ...     print(index, where, row)  # row: a dict, or a BadRow for a broken line
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunesmith.data.report import INVALID_UTF8, MALFORMED_JSON, BadRow, DataError

__all__ = ["FILE_SUFFIXES", "TEXT_SAMPLE_BY", "Rows", "load_rows", "read_text_rows"]

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt")
"""Suffixes of local files read directly; anything else must be a folder or a Hub name."""

TEXT_SAMPLE_BY = ("line", "paragraph", "document")
"""How a ``.txt`` file is cut into rows (see the module docs)."""


@dataclass
class Rows:
    """The rows of one source, in order.

    Iterating gives ``(index, where, row)``: ``where`` is extra location text for
    messages (``" (line 7)"`` for JSON Lines, else ``""``) and ``row`` is a dict, any other
    JSON value (reported later as a wrong type), or a :class:`BadRow` for a line that could
    not be decoded or parsed. ``columns`` is the union of the column names of all rows.
    ``items`` is either a list of ``(where, row)`` pairs or a ``datasets.Dataset``
    (iterated lazily, with no location text).
    """

    name: str
    columns: list[str]
    items: Any = field(repr=False)

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[tuple[int, str, Any]]:
        if isinstance(self.items, list):
            for index, (where, row) in enumerate(self.items):
                yield index, where, row
        else:
            for index, row in enumerate(self.items):
                yield index, "", row


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _decode(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: line {_line_of(data, e.start)}: bytes are not valid UTF-8 "
            f"(byte offset {e.start}: {e.reason}); re-encode the file as UTF-8"
        ) from e


def _union_columns(rows: Sequence[tuple[str, Any]]) -> list[str]:
    seen: dict[str, None] = {}
    for _, row in rows:
        if isinstance(row, Mapping):
            seen.update(dict.fromkeys(row))
    return list(seen)


def _read_json_lines(path: Path, data: bytes) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
        data = data[3:]
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f" (line {number})"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = BadRow(INVALID_UTF8, f"bytes are not valid UTF-8 at byte {e.start} of the line")
            items.append((where, bad))
            continue
        try:
            items.append((where, json.loads(text)))
        except json.JSONDecodeError as e:
            items.append((where, BadRow(MALFORMED_JSON, f"{e.msg} at column {e.colno}")))
    return items


def _read_json(path: Path) -> list[tuple[str, Any]]:
    data = path.read_bytes()
    if not data.strip():
        raise DataError(f"{path}: file is empty")
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if head == b"[":  # a JSON array of rows
        text = _decode(path, data)
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: line {e.lineno} column {e.colno}: malformed JSON ({e.msg})"
            ) from e
        return [("", row) for row in rows]
    if path.suffix == ".json" and head == b"{" and data.strip().count(b"\n") > 0:
        try:
            whole = json.loads(_decode(path, data))
        except (json.JSONDecodeError, DataError):
            whole = None
        if isinstance(whole, dict):
            raise DataError(
                f"{path}: holds one JSON object spread over several lines; expected JSON "
                f"Lines (one row object per line) or a JSON array of row objects"
            )
    return _read_json_lines(path, data)


def _text_chunks(data: bytes, sample_by: str) -> Iterator[tuple[int, list[bytes]]]:
    """``(first line number, lines)`` of each row of a text file (blank lines dropped)."""
    lines = [line.removesuffix(b"\r") for line in data.split(b"\n")]
    if sample_by == "line":
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield number, [line]
        return
    chunk: list[bytes] = []
    start = 0
    for number, line in enumerate(lines, start=1):
        if line.strip():
            start = start if chunk else number
            chunk.append(line)
        elif chunk and sample_by == "paragraph":
            yield start, chunk
            chunk = []
        elif chunk:  # a document keeps its inner blank lines
            chunk.append(line)
    while chunk and not chunk[-1].strip():
        chunk.pop()
    if chunk:
        yield start, chunk


def read_text_rows(path: str | os.PathLike[str], sample_by: str = "line") -> list[tuple[str, Any]]:
    """The ``(where, row)`` pairs of a plain text file: ``row`` is ``{"text": ...}`` (or a
    :class:`BadRow` for text that is not UTF-8), ``where`` its first line (``" (line 3)"``).

    Example::

        >>> read_text_rows("notes.txt", sample_by="paragraph")  # doctest: +SKIP
        [(' (line 1)', {'text': 'First paragraph,\\nover two lines.'}), ...]
    """
    if sample_by not in TEXT_SAMPLE_BY:
        raise ValueError(f"sample_by must be one of {TEXT_SAMPLE_BY}, got {sample_by!r}")
    path = Path(path)
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
        data = data[3:]
    if not data.strip():
        raise DataError(f"{path}: file is empty")
    items: list[tuple[str, Any]] = []
    for number, lines in _text_chunks(data, sample_by):
        raw = b"\n".join(lines)
        try:
            items.append((f" (line {number})", {"text": raw.decode("utf-8")}))
        except UnicodeDecodeError as e:
            line = number + raw.count(b"\n", 0, e.start)
            bad = BadRow(INVALID_UTF8, f"bytes are not valid UTF-8 on line {line}")
            items.append((f" (line {number})", bad))
    return items


def _load_with_datasets(name: str, *args: Any, **kwargs: Any) -> Rows:
    import datasets  # heavy import, only where needed

    try:
        ds = datasets.load_dataset(*args, **kwargs)
    except Exception as e:
        causes = []
        cause: BaseException | None = e
        while cause is not None and len(causes) < 4:
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__ or cause.__context__
        raise DataError(f"{name}: could not load the dataset: " + " <- ".join(causes)) from e
    return Rows(name, list(ds.column_names), ds)


def _read_csv(path: Path, sep: str) -> Rows:
    import datasets

    data = path.read_bytes()
    text = _decode(path, data)
    if not text.strip():
        raise DataError(f"{path}: file is empty")
    header = next(csv.reader(io.StringIO(text), delimiter=sep))
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return _load_with_datasets(
        str(path), "csv", data_files=str(path), split="train", sep=sep, features=features
    )


def load_rows(
    source: str | os.PathLike[str],
    *,
    split: str = "train",
    data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
    sample_by: str = "line",
) -> Rows:
    """Read all rows of ``source``.

    ``source`` is a local file (by suffix: ``.jsonl``/``.json``, ``.parquet``, ``.csv``,
    ``.tsv``, ``.txt``), a local folder, or a name for ``datasets.load_dataset`` (a Hub
    dataset or a builder like ``"json"`` with ``data_files``). ``split`` and ``data_files`` go
    to ``load_dataset``; a single local file is one split (``"train"``). ``sample_by`` cuts a
    ``.txt`` file into ``{"text": ...}`` rows: ``"line"``, ``"paragraph"`` or ``"document"``
    (see the module docs); other sources ignore it.

    Example::

        >>> rows = load_rows("data/train.parquet")  # doctest: +SKIP
        >>> rows.columns  # doctest: +SKIP
        ['messages']
    """
    if sample_by not in TEXT_SAMPLE_BY:
        raise ValueError(f"sample_by must be one of {TEXT_SAMPLE_BY}, got {sample_by!r}")
    path = Path(source).expanduser()
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in FILE_SUFFIXES:
            raise DataError(
                f"{path}: unsupported file type {suffix!r}; supported: {FILE_SUFFIXES} "
                f"(or pass a datasets builder name as source with data_files=...)"
            )
        if split != "train" or data_files is not None:
            raise ValueError(
                f"{path}: a single local file is one split; split/data_files apply only to "
                f"folders and Hub datasets (use val_fraction to hold out validation rows)"
            )
        if suffix in (".jsonl", ".json"):
            items = _read_json(path)
            rows = Rows(str(path), _union_columns(items), items)
        elif suffix == ".txt":
            rows = Rows(str(path), ["text"], read_text_rows(path, sample_by))
        elif suffix == ".parquet":
            rows = _load_with_datasets(str(path), "parquet", data_files=str(path), split="train")
        else:
            rows = _read_csv(path, "\t" if suffix == ".tsv" else ",")
    else:
        looks_local = str(source).startswith(("/", "./", "../", "~")) or path.suffix.lower() in (
            FILE_SUFFIXES
        )
        if looks_local and not path.exists():
            raise DataError(f"{source}: no such file or folder")
        rows = _load_with_datasets(str(source), str(source), split=split, data_files=data_files)
    if len(rows) == 0:
        raise DataError(f"{rows.name}: has no rows")
    return rows
