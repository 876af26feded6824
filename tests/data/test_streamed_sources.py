"""JSON-array and CSV/TSV files are read streamed, never whole: a JSON array element by
element (our scanner finds each element's bytes, ``json`` parses it), CSV record by record.
The rows are exactly what ``json.load`` / ``csv`` over the whole text give; an element or
record over ``max_row_bytes`` is a ``row_too_large`` bad row held in memory only up to the
limit; broken files name the file and the position; ``max_row_bytes`` is a dataset key."""

from __future__ import annotations

import csv
import io
import json
import random
import tracemalloc

import pytest

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data.preference_dataset import PreferenceDataset
from tunesmith.data.report import ROW_TOO_LARGE, BadRow, BadRowError, DataError
from tunesmith.data.sft_dataset import SFTDataset
from tunesmith.data.sources import _ArrayReader, load_rows
from tunesmith.data.tokenizer import Tokenizer
from tunesmith.rl.prompts import PromptDataset

MIB = 2**20
TRICKY_STRINGS = ["", "]", "[", "}{", ",", '"', "\\", '\\"', '"]', "a\\", "\n\t\r", "é€😀",
                  "\u2028", "\x00", "[[[", "]]],{", '\\\\"']  # fmt: skip


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return rng.choice(TRICKY_STRINGS) + rng.choice(TRICKY_STRINGS) * rng.randrange(3)
    if kind == 1:
        return rng.choice([0, -1, 3.5, 1e300, -2.5e-7, 10**30])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return "".join(rng.choice('ab[]{},"\\ \n') for _ in range(rng.randrange(12)))
    if kind in (4, 5):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = (rng.choice(TRICKY_STRINGS) + str(k) for k in range(rng.randrange(4)))
    return {key: _value(rng, depth + 1) for key in keys}


def _dump(value, rng: random.Random) -> str:
    style = rng.randrange(4)
    if style == 0:
        return json.dumps(value)
    if style == 1:
        return json.dumps(value, ensure_ascii=False, indent=rng.choice([1, 2, "\t"]))
    if style == 2:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return json.dumps(value, separators=(" ,\n ", " :\t"))


def _array_files():
    rng = random.Random(0)
    files = [
        "[]",
        " \n [ \n ] \n",
        '[{"messages": [{"role": "user", "content": "a [bracket] and \\"quotes\\""}]}]',
        '[ "a\\\\", "b\\"]", {"c": [[], {}, [[]]]} ,1 , null ]',
        '\ufeff[{"é": "ünïcödé 😀"}, "\\ud83d\\ude00"]',
        '[[1, [2, [3]]], {"a": {"b": {"c": "]}"}}}]\n\n',
    ]
    for _ in range(60):
        files.append(_dump([_value(rng) for _ in range(rng.randrange(6))], rng))
    return files


ARRAYS = _array_files()


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 7, 64, 2**16])
def test_the_array_scanner_finds_the_elements_json_load_does(chunk_size):
    for text in ARRAYS:
        data = text.encode()
        reader = _ArrayReader(io.BytesIO(data), 10**9, chunk_size)
        elements = [json.loads(raw) for _, raw in reader.elements()]
        assert elements == json.loads(text.removeprefix("\ufeff")), text


def test_a_json_array_file_gives_the_rows_json_load_gives(tmp_path):
    path = tmp_path / "data.json"
    for text in ARRAYS:
        path.write_text(text, encoding="utf-8")
        expected = json.loads(text.removeprefix("\ufeff"))
        if not expected:
            with pytest.raises(DataError, match="has no rows"):
                load_rows(path)
            continue
        assert [row for _, _, row in load_rows(path)] == expected, text


def test_json_array_rows_name_the_line_they_start_on(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[\n  {"a": 1},\n\n  {"a": [\n2]}, 3]')
    assert list(load_rows(path)) == [
        (0, " (line 2)", {"a": 1}),
        (1, " (line 4)", {"a": [2]}),
        (2, " (line 5)", 3),
    ]


BAD_ARRAYS = {
    # file bytes: the position json.load reports too, and our reason
    b'[{"text": "a"},\n {"text": }]': r"line 2 column 11: malformed JSON \(Expecting value\) in row 1",
    b"[1, 2,]": r"line 1 column 7: malformed JSON \(expecting a value\) in row 2",
    b"[,1]": r"line 1 column 2: malformed JSON \(expecting a value\) in row 0",
    b"[1, 2] x": r"line 1 column 8: malformed JSON \(extra data after the array\)$",
    b"[1, 2]\n[3]": r"line 2 column 1: malformed JSON \(extra data after the array\)$",
    b"[1, 2}": r"line 1 column 6: malformed JSON \('\}' where ',' or '\]' was expected\) in row 1",
    b'\xef\xbb\xbf[{"\xc3\xa9\xc3\xa9": 1}, {"a" 2}]': r"line 1 column 18: malformed JSON \(Expecting ':' delimiter\) in row 1",
    b"[1 2]": r"line 1 column 4: malformed JSON \(Extra data\) in row 0",
    # where json.load names another place (it reads on), the file's end
    b"[1, 2": r"line 1 column 6: malformed JSON \(the file ends early: the array is not closed\) in row 1",
    b'[1,\n "ab': r"line 2 column 5: malformed JSON \(the file ends early: unterminated string\) in row 1",
    b'[{"a": "\xff"}]': r"line 1: bytes are not valid UTF-8 \(byte offset 8: invalid start byte\) in row 0",
}  # fmt: skip


@pytest.mark.parametrize("data", list(BAD_ARRAYS), ids=range(len(BAD_ARRAYS)))
def test_a_broken_json_array_names_the_file_and_the_position(tmp_path, data):
    path = tmp_path / "data.json"
    path.write_bytes(data)
    with pytest.raises(DataError, match=f"^{path}: {BAD_ARRAYS[data]}"):
        load_rows(path)
    try:
        json.loads(data.decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    else:
        raise AssertionError("not broken JSON")


def _peak(function):
    """``function()`` and the peak of memory (bytes, traced) while it ran."""
    tracemalloc.start()
    try:
        result = function()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


GOOD = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}


def test_a_json_array_element_over_the_limit_is_counted_not_held(tmp_path):
    path = tmp_path / "data.json"
    content = ("[{,}]\n\\" * 150 + '"') * 5000  # brackets, escapes, quotes: 6.6 MB as JSON
    big = {"messages": [{"role": "user", "content": content}]}
    path.write_text(json.dumps([GOOD, big, GOOD]))
    size, limit = path.stat().st_size, 2**18
    rows, peak = _peak(lambda: [(w, r) for _, w, r in load_rows(path, max_row_bytes=limit)])
    assert [r.reason if isinstance(r, BadRow) else r for _, r in rows] == [
        GOOD,
        ROW_TOO_LARGE,
        GOOD,
    ]
    big_size = len(json.dumps(big))
    assert rows[1][1].detail == (
        f"the row is {big_size} bytes, over the limit of {limit} (max_row_bytes); it was not read"
    )
    assert peak < size / 8, f"peak {peak} bytes for a file of {size}"


def test_a_whole_file_object_over_the_limit_is_refused_unread(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"rows": [GOOD] * 50}, indent=2))
    with pytest.raises(
        DataError,
        match=f"^{path}: line 1 opens a JSON value .*over the "
        "max_row_bytes limit of 1000, so it is not read whole",
    ):
        load_rows(path, max_row_bytes=1000)
    with pytest.raises(DataError, match=f"^{path}: holds one JSON object spread over"):
        load_rows(path)
    # JSON Lines in a .json file bigger than the limit is still read line by line
    path.write_text((json.dumps(GOOD) + "\n") * 50)
    assert len(load_rows(path, max_row_bytes=1000)) == 50


# ----------------------------------------------------------------------------- CSV / TSV

CSV_FILES = [
    "prompt,completion\na,b\n",
    'prompt,completion\r\n"with, comma","with ""quotes"""\r\n\r\nx,\r\n',
    'prompt,completion\n"two\nlines","three\n\nlines"\nlast,row',
    '\ufeffprompt,completion\né,😀\n  spaced  ,""\n',
    'prompt,completion\n"[json]","{\\"a\\": 1}"\nshort\n',
]
TSV_FILES = ["prompt\tcompletion\na,b\tc\n", 'prompt\tcompletion\n"q\tr"\t"x\ny"\n']


def _csv_reference(text: str, sep: str) -> list[dict]:
    records = [
        r
        for r in csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""), delimiter=sep)
        if r
    ]
    header = records[0]
    return [
        {name: (row[k] if k < len(row) and row[k] else None) for k, name in enumerate(header)}
        for row in records[1:]
    ]


CSV_CASES = [(".csv", t) for t in CSV_FILES] + [(".tsv", t) for t in TSV_FILES]


@pytest.mark.parametrize("suffix,text", CSV_CASES, ids=range(len(CSV_CASES)))
def test_a_csv_file_gives_the_rows_csv_gives_over_the_whole_text(tmp_path, suffix, text):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(text.encode())
    rows = load_rows(path)
    assert rows.columns == ["prompt", "completion"]
    assert [row for _, _, row in rows] == _csv_reference(text, "\t" if suffix == ".tsv" else ",")


def test_csv_rows_name_the_line_they_start_on(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text('prompt,completion\n"a\nb",c\n\nd,e\n')
    assert [(i, w) for i, w, _ in load_rows(path)] == [(0, " (line 2)"), (1, " (line 5)")]


def test_a_csv_field_over_the_limit_is_a_bad_row_and_reading_goes_on(tmp_path):
    path = tmp_path / "data.csv"
    one_line = "x" * (8 * MIB)
    lines = 10_000  # a quoted cell over many lines, with quotes in it: 8 MB
    quoted = '"' + ('y,""' * 200 + "\n") * lines + '"'
    path.write_text(f"prompt,completion\na,b\n{one_line},c\nd,{quoted}\ne,f\n")
    size, limit = path.stat().st_size, 2**17
    rows, peak = _peak(lambda: [(w, r) for _, w, r in load_rows(path, max_row_bytes=limit)])
    shown = [r.reason if isinstance(r, BadRow) else r for _, r in rows]
    assert shown == [
        {"prompt": "a", "completion": "b"},
        ROW_TOO_LARGE,
        ROW_TOO_LARGE,
        {"prompt": "e", "completion": "f"},
    ]
    assert [w for w, _ in rows] == [" (line 2)", " (line 3)", " (line 4)", f" (line {lines + 5})"]
    assert f"the row is {len(one_line) + 3} bytes" in rows[1][1].detail
    assert f"the row is {len(quoted) + 3} bytes" in rows[2][1].detail
    assert peak < size / 8, f"peak {peak} bytes for a file of {size}"


def test_csv_limit_is_restored_and_does_not_cap_fields_under_max_row_bytes(tmp_path):
    before = csv.field_size_limit()
    path = tmp_path / "data.csv"
    path.write_text("prompt,completion\n" + "z" * (1 * MIB) + ",c\n")  # over csv's 128 KiB
    assert [r for _, _, r in load_rows(path)][0]["prompt"] == "z" * MIB
    assert csv.field_size_limit() == before


BAD_CSV = {
    b"prompt,completion\nhi,yo\n\xff,x\n": r"line 3: bytes are not valid UTF-8 \(byte offset 24",
    b"prompt,completion\na,b,c\n": r"line 2: the row has 3 cells, the header 2$",
    b"prompt,prompt\na,b\n": r"line 1: the header names column 'prompt' twice$",
    b"prompt,completion\na,\"b\" x\"\n": "",  # csv reads it (not strict): no error
    b'prompt,completion\na,"' + b"q" * 3000: r"line 2: the row starting here is over the "
    r"max_row_bytes limit of 1000 and its quoted cell does not end before the end of the file",
    b"x" * 2000 + b",c\na,b\n": r"line 1: the header row is too large: the row is 2003 bytes, "
    r"over the limit of 1000",
}  # fmt: skip


@pytest.mark.parametrize("data", list(BAD_CSV), ids=range(len(BAD_CSV)))
def test_a_broken_csv_file_names_the_file_and_the_line(tmp_path, data):
    path = tmp_path / "data.csv"
    path.write_bytes(data)
    if not BAD_CSV[data]:
        assert len(load_rows(path, max_row_bytes=1000)) == 1
        return
    with pytest.raises(DataError, match=f"^{path}: {BAD_CSV[data]}"):
        load_rows(path, max_row_bytes=1000)


# ----------------------------------------------------------------------- the dataset key


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path_factory.mktemp("tok")))


def _with_big_row(tmp_path, name="data.json"):
    path = tmp_path / name
    big = {"messages": [{"role": "user", "content": "x" * 5000}, GOOD["messages"][1]]}
    path.write_text(json.dumps([GOOD, big, GOOD]))
    return path


def test_max_row_bytes_is_a_dataset_key_that_respects_on_bad_row(tok, tmp_path):
    path = _with_big_row(tmp_path)
    assert len(SFTDataset(tok, source=path)) == 3  # the default limit is 16 MiB
    ds = SFTDataset(tok, source=path, max_row_bytes=1000, on_bad_row="skip")
    assert ds.row_indices == [0, 2] and ds.report.examples == {ROW_TOO_LARGE: [1]}
    size = len(json.dumps(json.loads(path.read_text())[1]))
    with pytest.raises(
        BadRowError,
        match=rf"^{path}: bad row at line 1: row_too_large: "
        rf"the row is {size} bytes, over the limit of 1000",
    ):
        SFTDataset(tok, source=path, max_row_bytes=1000)


def test_max_row_bytes_reaches_prompt_datasets(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hi", "answer": "1"}\n{"prompt": "' + "y" * 2000 + '", "answer": "2"}\n'
    )
    assert len(PromptDataset(path)) == 2
    ds = PromptDataset(path, max_row_bytes=1000, on_bad_row="skip")
    assert len(ds) == 1 and ds.report.examples == {ROW_TOO_LARGE: [2]}  # line 2


@pytest.mark.parametrize("value", [0, -5, True, "1000", 1.5, None])
def test_max_row_bytes_must_be_a_positive_int(tok, tmp_path, value):
    path = _with_big_row(tmp_path)
    message = rf"^max_row_bytes must be a positive int \(bytes\), got {value!r}$"
    for build in (
        lambda: SFTDataset(tok, source=path, max_row_bytes=value),
        lambda: PreferenceDataset(tok, source=path, max_row_bytes=value),
        lambda: PromptDataset(path, max_row_bytes=value),
        lambda: load_rows(path, max_row_bytes=value),
    ):
        with pytest.raises(ValueError, match=message):
            build()
