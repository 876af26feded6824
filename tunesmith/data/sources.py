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

import contextlib
import csv
import io
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tunesmith.data.report import (
    INVALID_UTF8,
    MALFORMED_JSON,
    ROW_TOO_LARGE,
    BadRow,
    DataError,
)

__all__ = [
    "FILE_SUFFIXES",
    "MAX_ROW_BYTES",
    "TEXT_SAMPLE_BY",
    "Rows",
    "load_rows",
    "read_text_rows",
]

MAX_ROW_BYTES = 16 * 2**20
"""The largest row read (a JSON Lines line, a text row, a Parquet/CSV row's text): 16 MiB.
A larger one is a bad row (``row_too_large``), never held in memory whole; ``load_rows``
takes another limit as ``max_row_bytes``."""

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

    max_row_bytes: int = MAX_ROW_BYTES

    def __iter__(self) -> Iterator[tuple[int, str, Any]]:
        if isinstance(self.items, list):
            for index, (where, row) in enumerate(self.items):
                yield index, where, row
        else:
            for index, row in enumerate(self.items):
                yield index, "", _sized(row, self.max_row_bytes)


def _text_bytes(value: Any) -> int:
    """About how many bytes of text ``value`` (a row read by ``datasets``) holds."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_text_bytes(v) + len(str(k)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) for v in value)
    return 8


def _sized(row: Any, limit: int) -> Any:
    """``row``, or a :class:`BadRow` when its text is over ``limit`` bytes."""
    size = _text_bytes(row)
    if size > limit:
        return BadRow(ROW_TOO_LARGE, f"the row holds {size} bytes of text, over the limit of "
                      f"{limit} (max_row_bytes)")  # fmt: skip
    return row


def _too_large(size: int, limit: int, what: str = "line") -> BadRow:
    return BadRow(ROW_TOO_LARGE, f"the {what} is {size} bytes, over the limit of {limit} "
                  "(max_row_bytes); it was not read")  # fmt: skip


def _file_lines(path: Path, limit: int) -> Iterator[tuple[int, bytes | int]]:
    """``(number, line)`` of a file read line by line (``\\n`` kept); a line over ``limit``
    bytes comes as its size instead, its bytes skipped, never held whole."""
    with open(path, "rb") as f:
        number = 0
        while line := f.readline(limit + 1):
            number += 1
            if len(line) > limit and not line.endswith(b"\n"):
                size = len(line)
                while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                    size += len(rest)
                yield number, size + len(rest) - rest.endswith(b"\n")
                continue
            yield number, line


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


def _parse_line(raw: bytes) -> Any:
    """One JSON Lines row, or a :class:`BadRow` for bytes that are not UTF-8 or not JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return BadRow(INVALID_UTF8, f"bytes are not valid UTF-8 at byte {e.start} of the line")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return BadRow(MALFORMED_JSON, f"{e.msg} at column {e.colno}")
    except RecursionError:
        return BadRow(MALFORMED_JSON, "JSON nested too deep to read")


def _read_json_lines(path: Path, limit: int) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for number, raw in _file_lines(path, limit):
        if isinstance(raw, int):
            items.append((f" (line {number})", _too_large(raw, limit)))
            continue
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
            raw = raw[3:]
        if raw.strip():
            items.append((f" (line {number})", _parse_line(raw)))
    return items


def _head(path: Path) -> bytes:
    """The first byte of ``path`` that is not whitespace or a byte-order mark (b"" if none)."""
    with open(path, "rb") as f:
        while chunk := f.read(2**16):
            rest = chunk.lstrip(b"\xef\xbb\xbf \t\r\n")
            if rest:
                return rest[:1]
    return b""


def _read_json(path: Path, limit: int) -> list[tuple[str, Any]]:
    head = _head(path)
    if not head:
        raise DataError(f"{path}: file is empty")
    if head == b"[":  # a JSON array of rows
        text = _decode(path, path.read_bytes())
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: line {e.lineno} column {e.colno}: malformed JSON ({e.msg})"
            ) from e
        except RecursionError:
            raise DataError(f"{path}: JSON nested too deep to read") from None
        return [("", _sized(row, limit)) for row in rows]
    if path.suffix == ".json" and head == b"{" and path.stat().st_size <= limit:
        data = path.read_bytes()
        whole = None
        if data.strip().count(b"\n") > 0:
            with contextlib.suppress(json.JSONDecodeError, DataError, RecursionError):
                whole = json.loads(_decode(path, data))
        if isinstance(whole, dict):
            raise DataError(
                f"{path}: holds one JSON object spread over several lines; expected JSON "
                f"Lines (one row object per line) or a JSON array of row objects"
            )
    return _read_json_lines(path, limit)


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


def read_text_rows(
    path: str | os.PathLike[str], sample_by: str = "line", max_row_bytes: int = MAX_ROW_BYTES
) -> list[tuple[str, Any]]:
    """The ``(where, row)`` pairs of a plain text file: ``row`` is ``{"text": ...}`` (or a
    :class:`BadRow` for text that is not UTF-8), ``where`` its first line (``" (line 3)"``).

    Example::

        >>> read_text_rows("notes.txt", sample_by="paragraph")  # doctest: +SKIP
        [(' (line 1)', {'text': 'First paragraph,\\nover two lines.'}), ...]
    """
    if sample_by not in TEXT_SAMPLE_BY:
        raise ValueError(f"sample_by must be one of {TEXT_SAMPLE_BY}, got {sample_by!r}")
    path = Path(path)
    if sample_by == "line":
        return _text_lines(path, max_row_bytes)
    if path.stat().st_size > max_row_bytes and sample_by == "document":
        return [(" (line 1)", _too_large(path.stat().st_size, max_row_bytes, "document"))]
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
        data = data[3:]
    if not data.strip():
        raise DataError(f"{path}: file is empty")
    items: list[tuple[str, Any]] = []
    for number, lines in _text_chunks(data, sample_by):
        raw = b"\n".join(lines)
        if len(raw) > max_row_bytes:
            items.append((f" (line {number})", _too_large(len(raw), max_row_bytes, "paragraph")))
            continue
        try:
            items.append((f" (line {number})", {"text": raw.decode("utf-8")}))
        except UnicodeDecodeError as e:
            line = number + raw.count(b"\n", 0, e.start)
            bad = BadRow(INVALID_UTF8, f"bytes are not valid UTF-8 on line {line}")
            items.append((f" (line {number})", bad))
    return items


def _text_row(raw: bytes, number: int) -> Any:
    try:
        return {"text": raw.decode("utf-8")}
    except UnicodeDecodeError:
        return BadRow(INVALID_UTF8, f"bytes are not valid UTF-8 on line {number}")


def _text_lines(path: Path, limit: int) -> list[tuple[str, Any]]:
    """The rows of a text file cut by line, read line by line (``sample_by="line"``)."""
    items: list[tuple[str, Any]] = []
    for number, raw in _file_lines(path, limit):
        where = f" (line {number})"
        if isinstance(raw, int):
            items.append((where, _too_large(raw, limit)))
            continue
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # UTF-8 byte-order mark
            raw = raw[3:]
        raw = raw.removesuffix(b"\n").removesuffix(b"\r")
        if raw.strip():
            items.append((where, _text_row(raw, number)))
    if not items:
        raise DataError(f"{path}: file is empty")
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
    max_row_bytes: int = MAX_ROW_BYTES,
) -> Rows:
    """Read all rows of ``source``.

    ``source`` is a local file (by suffix: ``.jsonl``/``.json``, ``.parquet``, ``.csv``,
    ``.tsv``, ``.txt``), a local folder, or a name for ``datasets.load_dataset`` (a Hub
    dataset or a builder like ``"json"`` with ``data_files``). ``split`` and ``data_files`` go
    to ``load_dataset``; a single local file is one split (``"train"``). ``sample_by`` cuts a
    ``.txt`` file into ``{"text": ...}`` rows: ``"line"``, ``"paragraph"`` or ``"document"``
    (see the module docs); other sources ignore it. A row over ``max_row_bytes`` (a line of
    a JSON Lines or text file, the text of a Parquet/CSV row) is a bad row
    (``row_too_large``), skipped unread.

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
            items = _read_json(path, max_row_bytes)
            rows = Rows(str(path), _union_columns(items), items)
        elif suffix == ".txt":
            rows = Rows(str(path), ["text"], read_text_rows(path, sample_by, max_row_bytes))
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
    rows.max_row_bytes = max_row_bytes
    return rows
