"""Rows over the reader's byte limit (``max_row_bytes``, 16 MiB by default) are bad rows
(``row_too_large``) read line by line and never held whole, in every file type; JSON nested
too deep to parse is a malformed row, not a crash. A skip counts them; an error names the
file and line."""

from __future__ import annotations

import json

import pytest

from tunesmith.data.report import MALFORMED_JSON, ROW_TOO_LARGE, BadRow, DataError
from tunesmith.data.sources import MAX_ROW_BYTES, load_rows

LIMIT = 200
GOOD = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
BIG = {"messages": [{"role": "user", "content": "x" * 1000}]}


def _rows(path, **kwargs):
    return [(where, row) for _, where, row in load_rows(path, max_row_bytes=LIMIT, **kwargs)]


def _reasons(rows):
    return [row.reason if isinstance(row, BadRow) else "ok" for _, row in rows]


def test_default_limit_is_16_mib():
    assert MAX_ROW_BYTES == 16 * 2**20


def test_a_jsonl_line_over_the_limit_is_a_bad_row_naming_its_size(tmp_path):
    path = tmp_path / "data.jsonl"
    lines = [json.dumps(GOOD), json.dumps(BIG), json.dumps(GOOD)]
    path.write_text("\n".join(lines) + "\n")
    rows = _rows(path)
    assert _reasons(rows) == ["ok", ROW_TOO_LARGE, "ok"]
    where, bad = rows[1]
    assert where == " (line 2)"
    assert f"the line is {len(lines[1])} bytes, over the limit of {LIMIT}" in bad.detail


def test_a_line_at_the_limit_is_read(tmp_path):
    line = json.dumps({"text": "y" * (LIMIT - 12)})
    assert len(line) == LIMIT
    path = tmp_path / "data.jsonl"
    path.write_text(line + "\n" + line)  # the last line without its newline
    assert _reasons(_rows(path)) == ["ok", "ok"]


def test_the_last_line_over_the_limit_without_a_newline(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(BIG))
    assert _reasons(_rows(path)) == ["ok", ROW_TOO_LARGE]


def test_deeply_nested_json_is_a_malformed_row(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b"[" * 100_000 + b"]" * 100_000 + b"\n")
    rows = [(w, r) for _, w, r in load_rows(path)]
    assert _reasons(rows) == ["ok", MALFORMED_JSON]
    assert rows[1][0] == " (line 2)" and "nested too deep" in rows[1][1].detail


def test_a_deep_json_array_file_names_the_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(DataError, match=rf"^{path}: JSON nested too deep"):
        load_rows(path)


def test_a_row_of_a_json_array_over_the_limit(tmp_path):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD, BIG]))
    assert _reasons(_rows(path)) == ["ok", ROW_TOO_LARGE]


@pytest.mark.parametrize("sample_by", ["line", "paragraph", "document"])
def test_text_rows_over_the_limit(tmp_path, sample_by):
    path = tmp_path / "notes.txt"
    path.write_text("short line\n\n" + "z" * 1000 + "\n")
    reasons = _reasons(_rows(path, sample_by=sample_by))
    expected = {
        "line": ["ok", ROW_TOO_LARGE],
        "paragraph": ["ok", ROW_TOO_LARGE],
        "document": [ROW_TOO_LARGE],
    }[sample_by]
    assert reasons == expected


def test_a_parquet_row_over_the_limit(tmp_path):
    import pyarrow as pa  # a dependency of datasets
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD, BIG, GOOD]), path)
    assert _reasons(_rows(path)) == ["ok", ROW_TOO_LARGE, "ok"]


def test_a_csv_row_over_the_limit(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,completion\na,b\n" + "x" * 1000 + ",c\n")
    assert _reasons(_rows(path)) == ["ok", ROW_TOO_LARGE]
