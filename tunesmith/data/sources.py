"""Read the rows of a dataset: a local JSON/JSONL/Parquet/CSV/text file or a Hub dataset.

Local JSON Lines, JSON-array, CSV/TSV and text files are read here, never whole: JSON Lines
and text line by line, a JSON array element by element (a small scanner of our own finds
each element's bytes, following strings, escapes and bracket depth over the file read in
chunks; ``json`` parses each element), CSV record by record (``csv`` over the file's lines).
A row over ``max_row_bytes`` (16 MiB by default) is a bad row ``row_too_large``: its bytes
are counted to find where it ends, never held whole. A malformed JSON Lines line, or one
whose bytes are not UTF-8, is a bad row with its line number (which the dataset may skip),
and rows whose values have different types survive to the per-row checks instead of
failing the whole file in Arrow's schema inference. CSV cells are text (CSV has no types,
so ``"4"`` stays the text ``"4"``); an empty cell is missing (None). Parquet files, local
folders and Hub names go through ``datasets.load_dataset``. A file that cannot be read at
all (empty, not UTF-8 in CSV/JSON-array files, broken JSON-array structure, a CSV row with
more cells than its header...) raises :class:`~tunesmith.data.report.DataError` naming the
file and the line (and column, and row, where known).

Rows are numbered from 0 in source order; blank lines in JSON Lines and CSV are not rows.

A ``.txt`` file is plain text for the ``text`` format: each row is ``{"text": ...}``, cut as
``sample_by`` says, with the names and the default of the ``datasets`` library's ``text``
builder (what torchtune's text-completion datasets read a ``.txt`` file with): ``"line"``
(the default: one sample per line, without its line break), ``"paragraph"`` (paragraphs
separated by one or more blank lines, their inner line breaks kept) or ``"document"`` (the
whole file, one sample). Blank lines are never rows, and a line (or paragraph) that is not
UTF-8 is a bad row naming its line.

Example::

    >>> Path("train.jsonl").write_text('{"prompt": "Hi", "answer": "Hello"}\\n{broken\\n')
    44
    >>> for index, where, row in load_rows("train.jsonl"):
    ...     print(index, where, row)  # row: a dict, or a BadRow for a broken line
    0  (line 1) {'prompt': 'Hi', 'answer': 'Hello'}
    1  (line 2) malformed_json: Expecting property name enclosed in double quotes at column 2
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from tunesmith.config.typecheck import Check
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
    "DataSource",
    "Rows",
    "SampleBy",
    "check_max_row_bytes",
    "load_rows",
    "read_text_rows",
    "source_problem",
]

MAX_ROW_BYTES = 16 * 2**20
"""The largest row read (a JSON Lines line, a JSON array element, a CSV record, a text row, a
Parquet row's text): 16 MiB. A larger one is a bad row (``row_too_large``), never held in
memory whole; ``load_rows`` (and a dataset's ``max_row_bytes`` key) takes another limit."""

FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt")
"""Suffixes of local files read directly; anything else must be a folder or a Hub name."""

SampleBy = Literal["line", "paragraph", "document"]
TEXT_SAMPLE_BY: tuple[str, ...] = get_args(SampleBy)
"""How a ``.txt`` file is cut into rows (see the module docs)."""


@dataclass
class Rows:
    """The rows of one source, in order.

    Iterating gives ``(index, where, row)``: ``where`` is extra location text for
    messages (``" (line 7)"``: where the row starts in a JSON Lines, JSON array, CSV or text
    file; ``""`` for a Parquet file, a folder or a Hub dataset) and ``row`` is a dict, any other
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
        return BadRow(
            ROW_TOO_LARGE,
            f"the row holds {size} bytes of text, over the limit of {limit} (max_row_bytes)",
        )
    return row


def _too_large(size: int, limit: int, what: str = "line") -> BadRow:
    return BadRow(
        ROW_TOO_LARGE,
        f"the {what} is {size} bytes, over the limit of {limit} (max_row_bytes); it was not read",
    )


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


_CHUNK = 2**16
_Where = tuple[int, int, int]  # (byte offset, line, column) in a file, the last two 1-based
_JSON_SPACE = b" \t\n\r"
_BOM = b"\xef\xbb\xbf"
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 bytes that do not start a character
# a whole string without escapes (one with them is followed by _string_end), or a byte of
# structure: no nested repeats, so the regex engine keeps no backtracking stack per escape
_STRING_OR_STRUCTURE = re.compile(rb'"[^"\\]*"|["\[\]{},]')


class _Scanner:
    """The structural bytes (``[]{},``) outside strings of a JSON file read in chunks.

    ``events()`` yields ``(chunk, index)`` for each of them, and ``(chunk, -1)`` at the end
    of each chunk; ``in_string`` says whether the bytes read so far end inside a string.

    Example::

        >>> import io
        >>> scan = _Scanner(io.BytesIO(b'["a,]", [1]]'))
        >>> [chunk[i : i + 1] for chunk, i in scan.events() if i >= 0]
        [b'[', b',', b'[', b']', b']']
    """

    def __init__(self, f: Any, chunk_size: int = _CHUNK) -> None:
        self.f = f
        self.chunk_size = chunk_size
        self.in_string = False
        self._skip = 0  # bytes of an escape to skip at the start of the next chunk

    def events(self) -> Iterator[tuple[bytes, int]]:
        while data := self.f.read(self.chunk_size):
            i, self._skip = self._skip, 0
            while i < len(data):
                if self.in_string:
                    i = self._string_end(data, i)
                    continue
                m = _STRING_OR_STRUCTURE.search(data, i)
                if m is None:
                    break
                i = m.end()
                if i - m.start() > 1:  # a whole string
                    continue
                if data[m.start()] == 0x22:  # '"': a string with escapes, or that goes on
                    self.in_string = True
                else:
                    yield data, m.start()
            yield data, -1

    def _string_end(self, data: bytes, i: int) -> int:
        """Where scanning goes on after ``data[i:]``, inside a string: after the first quote
        not escaped (one after an odd run of backslashes is), else at the chunk's end."""
        while (quote := data.find(b'"', i)) >= 0:
            if _backslashes_before(data, quote, i) % 2 == 0:
                self.in_string = False
                return quote + 1
            i = quote + 1
        self._skip = _backslashes_before(data, len(data), i) % 2  # escapes the next byte
        return len(data)


def _backslashes_before(data: bytes, end: int, start: int) -> int:
    """How many backslashes ``data[start:end]`` ends with."""
    k = end
    while k > start and data[k - 1] == 0x5C:
        k -= 1
    return end - k


class _Position:
    """Offset, line and column (1-based, in characters) in a file read chunk by chunk.

    Example::

        >>> p = _Position()
        >>> p.at(b"ab\\ncd", 4)
        (4, 2, 2)
    """

    def __init__(self) -> None:
        self.base = 0  # the file offset of the chunk's first byte
        self.index = 0  # how far into the chunk line and column are counted
        self.line = 1
        self.column = 1

    def at(self, data: bytes, index: int) -> _Where:
        """``(offset, line, column)`` of ``data[index]``; calls go forwards in a chunk."""
        if index > self.index:
            start = data.rfind(b"\n", self.index, index) + 1
            if start:
                self.line += data.count(b"\n", self.index, index)
                self.column = 1
            else:
                start = self.index
            self.column += len(data[start:index].translate(None, _CONTINUATION))
            self.index = index
        return self.base + index, self.line, self.column

    def next_chunk(self, data: bytes) -> None:
        self.at(data, len(data))
        self.base += len(data)
        self.index = 0


class _JsonSyntax(Exception):
    """Broken JSON structure at ``(line, column)``, in array element ``row`` if any."""

    def __init__(self, message: str, where: _Where, row: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.line, self.column = where[1], where[2]
        self.row = row


@dataclass
class _Element:
    """The bytes of one element of a JSON array as it is read: held up to ``limit`` bytes,
    only counted past it. ``start`` is the ``(offset, line, column)`` of its first byte."""

    limit: int
    data: bytearray | None = field(default_factory=bytearray)
    size: int = 0
    start: _Where | None = None

    def add(self, chunk: bytes, begin: int, end: int, position: _Position) -> None:
        """Take ``chunk[begin:end]`` (leading whitespace of the element dropped)."""
        if self.start is None:
            part = chunk[begin:end]
            begin += len(part) - len(part.lstrip(_JSON_SPACE))
            if begin >= end:
                return
            self.start = position.at(chunk, begin)
        self.size += end - begin
        if self.data is not None and self.size > self.limit:
            self.data = None  # over the limit: counted, never held whole
        elif self.data is not None:
            self.data += chunk[begin:end]

    def value(self) -> bytes | int:
        """The element's bytes, or its size when it is over the limit."""
        return self.size if self.data is None else bytes(self.data).rstrip(_JSON_SPACE)


class _ArrayReader:
    """The elements of a top-level JSON array file, read in chunks: see :meth:`elements`."""

    def __init__(self, f: Any, limit: int, chunk_size: int = _CHUNK) -> None:
        self.scanner = _Scanner(f, chunk_size)
        self.position = _Position()
        if f.read(len(_BOM)) == _BOM:  # a UTF-8 byte-order mark: columns count after it
            self.position.base = len(_BOM)
        else:
            f.seek(0)
        self.limit = limit
        self.depth = 0  # 0 before the array, 1 inside it, 2+ inside an element
        self.rows = 0  # elements read so far
        self.element: _Element | None = None  # the element being read (None outside)
        self.closed = False

    def elements(self) -> Iterator[tuple[_Where, bytes | int]]:
        """``(start, raw)`` per element: ``start`` its ``(offset, line, column)``, ``raw``
        its bytes or (over the limit) its size. Broken structure raises :class:`_JsonSyntax`.

        Example::

            >>> import io
            >>> [raw for _, raw in _ArrayReader(io.BytesIO(b'[1, {"a": [2]}]'), 99).elements()]
            [b'1', b'{"a": [2]}']
        """
        begin = 0  # where this chunk's bytes not yet given to the element start
        for chunk, i in self.scanner.events():
            if i < 0:
                self._take(chunk, begin, len(chunk))
                self.position.next_chunk(chunk)
                begin = 0
                continue
            opening = self.depth == 0
            if self._ends_element(chunk, begin, i):
                done = self._finish(chunk, begin, i)
                begin = i + 1
                if done is not None:
                    yield done
            elif opening:
                begin = i + 1
        if not self.closed:
            what = "unterminated string" if self.scanner.in_string else "the array is not closed"
            where = (self.position.base, self.position.line, self.position.column)
            raise _JsonSyntax(f"the file ends early: {what}", where, self.rows)

    def _ends_element(self, chunk: bytes, begin: int, i: int) -> bool:
        """Follow the structural byte ``chunk[i]``: True when it is the ``,`` or ``]`` that
        ends an element of the array."""
        byte = chunk[i : i + 1]
        if self.closed:  # bytes after the array: refused
            self._take(chunk, begin, i + 1)
        if self.depth == 0:  # the opening bracket, after space only
            self._take(chunk, begin, i)
            self.depth, self.element = 1, _Element(self.limit)
            return False
        if byte in b"[{":
            self.depth += 1
            return False
        if self.depth > 1:  # inside an element
            if byte != b",":
                self.depth -= 1
            return False
        if byte == b"}":
            where = self.position.at(chunk, i)
            raise _JsonSyntax("'}' where ',' or ']' was expected", where, self.rows)
        return True

    def _finish(self, chunk: bytes, begin: int, i: int) -> tuple[_Where, bytes | int] | None:
        """The element that ``chunk[i]`` (``,`` or the closing ``]``) ends; None for the
        closing bracket of an empty array."""
        element = self.element
        assert element is not None
        element.add(chunk, begin, i, self.position)
        self.closed = chunk[i : i + 1] == b"]"
        self.element = None if self.closed else _Element(self.limit)
        if element.start is None and self.closed and self.rows == 0:
            return None
        if element.start is None:
            raise _JsonSyntax("expecting a value", self.position.at(chunk, i), self.rows)
        self.rows += 1
        return element.start, element.value()

    def _take(self, chunk: bytes, begin: int, end: int) -> None:
        """Give ``chunk[begin:end]`` to the element being read; outside one (before or
        after the array) it must be space."""
        if self.element is not None:
            self.element.add(chunk, begin, end, self.position)
            return
        if text := chunk[begin:end].lstrip(_JSON_SPACE):
            what = "extra data after the array" if self.closed else "bytes before the array"
            raise _JsonSyntax(what, self.position.at(chunk, end - len(text)), None)


def _read_json_array(path: Path, limit: int) -> list[tuple[str, Any]]:
    """The ``(where, row)`` pairs of a JSON array file, read element by element; an element
    over ``limit`` bytes is a ``row_too_large`` bad row, counted but never held whole."""
    items: list[tuple[str, Any]] = []
    with open(path, "rb") as f:
        try:
            for start, raw in _ArrayReader(f, limit).elements():
                items.append(
                    (f" (line {start[1]})", _array_row(path, start, raw, len(items), limit))
                )
        except _JsonSyntax as e:
            row = "" if e.row is None else f" in row {e.row}"
            raise DataError(
                f"{path}: line {e.line} column {e.column}: malformed JSON ({e.message}){row}"
            ) from None
    return items


def _array_row(path: Path, start: _Where, raw: bytes | int, row: int, limit: int) -> Any:
    """Element ``row`` of a JSON array (its bytes ``raw`` begin at ``start``), parsed; a
    :class:`BadRow` when ``raw`` is the size of an element over ``limit``."""
    if isinstance(raw, int):
        return _too_large(raw, limit, "row")
    offset, line, column = start
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad_line = line + raw.count(b"\n", 0, e.start)
        raise DataError(
            f"{path}: line {bad_line}: bytes are not valid UTF-8 (byte offset "
            f"{offset + e.start}: {e.reason}) in row {row}; re-encode the file as UTF-8"
        ) from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"line {line + e.lineno - 1} column {e.colno + (column - 1 if e.lineno == 1 else 0)}"
        raise DataError(f"{path}: {at}: malformed JSON ({e.msg}) in row {row}") from e
    except RecursionError:
        raise DataError(f"{path}: JSON nested too deep to read (row {row}, line {line})") from None


def _read_json(path: Path, limit: int) -> list[tuple[str, Any]]:
    head = _head(path)
    if not head:
        raise DataError(f"{path}: file is empty")
    if head == b"[":  # a JSON array of rows
        return _read_json_array(path, limit)
    if path.suffix == ".json" and head == b"{":
        _refuse_one_object(path, limit)
    return _read_json_lines(path, limit)


def _refuse_one_object(path: Path, limit: int) -> None:
    """Refuse a ``.json`` file that is one JSON object spread over several lines (not JSON
    Lines). It is read whole to tell, so only up to ``limit`` bytes: a bigger file whose
    first line opens a value that does not end there is refused unread."""
    size = path.stat().st_size
    if size > limit and _first_line_is_open(path, limit):
        raise DataError(
            f"{path}: line 1 opens a JSON value that does not end on that line (one JSON "
            f"object spread over several lines?), and the file is {size} bytes, over the "
            f"max_row_bytes limit of {limit}, so it is not read whole; expected JSON Lines "
            "(one row object per line) or a JSON array of row objects"
        )
    if size > limit:
        return
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


def _first_line_is_open(path: Path, limit: int) -> bool:
    """Whether the first non-blank line of ``path`` is a JSON value cut short at its end."""
    for _, raw in _file_lines(path, limit):
        if isinstance(raw, int):
            return False  # a JSON Lines row over the limit: a bad row, not this
        text = raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8", "replace").rstrip()
        if not text:
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return e.pos >= len(text)
        except RecursionError:
            return False
        return False
    return False


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

        >>> Path("notes.txt").write_text("First paragraph,\\nover two lines.\\n\\nSecond one.\\n")
        46
        >>> read_text_rows("notes.txt", sample_by="paragraph")
        [(' (line 1)', {'text': 'First paragraph,\\nover two lines.'}), (' (line 4)', {'text': 'Second one.'})]
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


class _RowTooLarge(Exception):
    """A CSV row of ``size`` bytes over the limit, skipped to its end unread."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class _CsvLines:
    """The lines of a CSV file, each decoded, for ``csv.reader``: each is counted into the
    bytes and quotes of the row being read. A row over the limit is skipped to its end (the
    end of a line where its quotes are balanced) and raises :class:`_RowTooLarge`."""

    def __init__(self, path: Path, f: Any, limit: int) -> None:
        self.path, self.f, self.limit = path, f, limit
        self.line = 0  # lines read so far
        self.offset = 0  # file offset of the next byte
        self.row_line = 0  # first line of the row being read
        self.size = 0  # bytes of the row being read
        self.quotes = 0  # '"' in it so far

    def __iter__(self) -> _CsvLines:
        return self

    def __next__(self) -> str:
        raw = self.f.readline(self.limit + 1)
        if not raw:
            raise StopIteration
        self.line += 1
        self.row_line = self.row_line or self.line
        start, self.offset = self.offset, self.offset + len(raw)
        self.size += len(raw)
        self.quotes += raw.count(b'"')
        if self.size > self.limit:
            self._skip(raw)
            raise _RowTooLarge(self.size)
        if self.line == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(
                f"{self.path}: line {self.line}: bytes are not valid UTF-8 (byte offset "
                f"{start + e.start}: {e.reason}); re-encode the file as UTF-8"
            ) from e

    def _skip(self, raw: bytes) -> None:
        """Read on, counting, to the end of the row that ``raw`` is part of."""
        while not (raw.endswith(b"\n") and self.quotes % 2 == 0):
            ended = raw.endswith(b"\n")
            raw = self.f.readline(_CHUNK)
            if not raw and self.quotes % 2:
                raise DataError(
                    f"{self.path}: line {self.row_line}: the row starting here is over the "
                    f"max_row_bytes limit of {self.limit} and its quoted cell does not end "
                    "before the end of the file; cannot tell where the row ends"
                )
            if not raw:
                return
            self.line += ended
            self.offset += len(raw)
            self.size += len(raw)
            self.quotes += raw.count(b'"')

    def end_row(self) -> int:
        """The first line of the row just read; counting starts again for the next."""
        line, self.row_line, self.size, self.quotes = self.row_line, 0, 0, 0
        return line


@contextlib.contextmanager
def _csv_field_limit(limit: int) -> Iterator[None]:
    """``csv.field_size_limit`` set to ``limit`` (at most a C long on every platform)."""
    old = csv.field_size_limit(min(limit, 2**31 - 1))
    try:
        yield
    finally:
        csv.field_size_limit(old)


def _csv_records(lines: _CsvLines, sep: str) -> Iterator[tuple[int, list[str] | BadRow]]:
    """``(first line, cells)`` of each non-blank record; ``cells`` is a :class:`BadRow` for
    a record over the limit."""
    reader = csv.reader(lines, delimiter=sep)
    while True:
        try:
            cells: list[str] | BadRow = next(reader)
        except StopIteration:
            return
        except _RowTooLarge as e:
            cells = _too_large(e.size, lines.limit, "row")
        except csv.Error as e:
            raise DataError(f"{lines.path}: line {lines.line}: malformed CSV ({e})") from None
        line = lines.end_row()
        if cells:
            yield line, cells


def _csv_row(path: Path, header: list[str], line: int, cells: list[str] | BadRow) -> Any:
    """A CSV record as a row: ``{column: text}``, an empty or absent cell None."""
    if isinstance(cells, BadRow):
        return cells
    if len(cells) > len(header):
        raise DataError(
            f"{path}: line {line}: the row has {len(cells)} cells, the header {len(header)}"
        )
    return {
        name: cells[k] if k < len(cells) and cells[k] else None for k, name in enumerate(header)
    }


def _read_csv(path: Path, sep: str, limit: int) -> Rows:
    """The rows of a CSV (or TSV) file, read record by record; a record over ``limit``
    bytes is a ``row_too_large`` bad row, counted but never held whole."""
    with open(path, "rb") as f, _csv_field_limit(limit):
        lines = _CsvLines(path, f, limit)
        records = _csv_records(lines, sep)
        line, header = next(records, (0, None))
        if header is None:
            raise DataError(f"{path}: file is empty")
        if isinstance(header, BadRow):
            raise DataError(f"{path}: line {line}: the header row is too large: {header.detail}")
        if len(set(header)) < len(header):
            twice = next(name for name in header if header.count(name) > 1)
            raise DataError(f"{path}: line {line}: the header names column {twice!r} twice")
        items = [(f" (line {n})", _csv_row(path, header, n, cells)) for n, cells in records]
    return Rows(str(path), header, items)


def source_problem(source: str | os.PathLike[str]) -> str | None:
    """Why ``source`` cannot be read (None: it can be tried): a path that looks local (it
    starts with ``/``, ``./``, ``../`` or ``~``, or ends in a data file's suffix) and does not
    exist. Anything else may be a Hub dataset or a ``datasets`` builder name.

    Example::

        >>> source_problem("data/missing.jsonl")
        'data/missing.jsonl: no such file or folder'
        >>> source_problem("openai/gsm8k") is None
        True
    """
    path = Path(source).expanduser()
    looks_local = str(source).startswith(("/", "./", "../", "~")) or path.suffix.lower() in (
        FILE_SUFFIXES
    )
    return f"{source}: no such file or folder" if looks_local and not path.exists() else None


DataSource = Annotated[str | os.PathLike[str], Check(source_problem, on_disk=True)]
"""The ``source`` of a dataset: checked by :func:`source_problem` in ``tunesmith validate``
and every run before anything is read, and again when it is read."""


def check_max_row_bytes(value: Any) -> int:
    """``value`` if it is a positive int (a row limit in bytes), else a ValueError naming
    the key ``max_row_bytes``.

    Example::

        >>> check_max_row_bytes(2**20)
        1048576
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_row_bytes must be a positive int (bytes), got {value!r}")
    return value


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
    (see the module docs); other sources ignore it. A row over ``max_row_bytes`` (a
    positive int: a line of a JSON Lines or text file, an element of a JSON array, a CSV
    record, the text of a Parquet row) is a bad row (``row_too_large``), skipped unread.

    Example::

        >>> Path("train.csv").write_text("prompt,answer\\nTwo plus two?,4\\n")
        30
        >>> rows = load_rows("train.csv")
        >>> rows.columns, len(rows)
        (['prompt', 'answer'], 1)
        >>> list(rows)  # CSV cells are text
        [(0, ' (line 2)', {'prompt': 'Two plus two?', 'answer': '4'})]
    """
    if sample_by not in TEXT_SAMPLE_BY:
        raise ValueError(f"sample_by must be one of {TEXT_SAMPLE_BY}, got {sample_by!r}")
    check_max_row_bytes(max_row_bytes)
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
            rows = _read_csv(path, "\t" if suffix == ".tsv" else ",", max_row_bytes)
    else:
        if (problem := source_problem(source)) is not None:
            raise DataError(problem)
        rows = _load_with_datasets(str(source), str(source), split=split, data_files=data_files)
    if len(rows) == 0:
        raise DataError(f"{rows.name}: has no rows")
    rows.max_row_bytes = max_row_bytes
    return rows
