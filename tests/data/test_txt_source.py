"""Plain ``.txt`` files as a source of ``text`` rows: per line (the default), per paragraph or
the whole document; blank lines are no rows, bad bytes are a bad row naming their line."""

from __future__ import annotations

import pytest

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data.report import INVALID_UTF8, BadRow, DataError
from tunesmith.data.sft_dataset import SFTDataset
from tunesmith.data.sources import load_rows, read_text_rows
from tunesmith.data.tokenizer import Tokenizer

# BOM, CRLF line ends, runs of blank (and whitespace-only) lines, a trailing blank line.
TEXT = (
    b"\xef\xbb\xbfThe first line.\r\n"
    b"Its second line.\n"
    b"\n"
    b"   \n"
    b"A new paragraph, alone.\n"
    b"\n"
    b"Last paragraph\n"
    b"  over two lines.\n"
    b"\n"
)


def _rows(path, sample_by):
    return [(where, row) for _, where, row in load_rows(path, sample_by=sample_by)]


def test_lines_are_rows_by_default(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(TEXT)
    rows = load_rows(path)
    assert rows.columns == ["text"]
    assert [(i, where, row) for i, where, row in rows] == [
        (0, " (line 1)", {"text": "The first line."}),
        (1, " (line 2)", {"text": "Its second line."}),
        (2, " (line 5)", {"text": "A new paragraph, alone."}),
        (3, " (line 7)", {"text": "Last paragraph"}),
        (4, " (line 8)", {"text": "  over two lines."}),
    ]


def test_paragraphs_keep_their_inner_line_breaks(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(TEXT)
    assert _rows(path, "paragraph") == [
        (" (line 1)", {"text": "The first line.\nIts second line."}),
        (" (line 5)", {"text": "A new paragraph, alone."}),
        (" (line 7)", {"text": "Last paragraph\n  over two lines."}),
    ]


def test_document_is_one_row_without_outer_blank_lines(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"\n\n" + TEXT[3:])
    expected = (
        "The first line.\nIts second line.\n\n   \nA new paragraph, alone.\n\n"
        "Last paragraph\n  over two lines."
    )
    assert _rows(path, "document") == [(" (line 3)", {"text": expected})]


def test_bytes_that_are_not_utf8_are_a_bad_row_naming_the_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"good one\n\nfine\nbad \xff byte\nlast\n")
    items = read_text_rows(path)
    assert [where for where, _ in items] == [" (line 1)", " (line 3)", " (line 4)", " (line 5)"]
    bad = items[2][1]
    assert isinstance(bad, BadRow) and bad.reason == INVALID_UTF8
    assert "line 4" in bad.detail
    assert items[3][1] == {"text": "last"}
    paragraphs = read_text_rows(path, sample_by="paragraph")
    assert paragraphs[0][1] == {"text": "good one"}
    assert isinstance(paragraphs[1][1], BadRow) and "line 4" in paragraphs[1][1].detail


def test_empty_file_and_unknown_sample_by_are_refused(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b" \n\n")
    with pytest.raises(DataError, match="empty.txt: file is empty"):
        load_rows(empty)
    with pytest.raises(ValueError, match="sample_by must be one of .* got 'lines'"):
        load_rows(empty, sample_by="lines")


def test_sft_text_dataset_reads_a_txt_file(tmp_path):
    tok = Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path / "tok", "qwen2_5"))
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat\n\non the mat\nand slept\n")
    dataset = SFTDataset(tok, source=str(path), format="text")
    assert dataset.row_indices == [0, 1, 2]
    for sample, line in zip(dataset.samples, ["the cat sat", "on the mat", "and slept"]):
        ids = tok.encode(line, add_special_tokens=True) + [tok.eos_id]
        assert sample["input_ids"] == ids
        assert sample["labels"] == ids[1:] + [-100]  # every token trained, shifted
    with pytest.raises(DataError, match="format 'messages' needs column 'messages'.*'text'"):
        SFTDataset(tok, source=str(path), format="messages")


def test_the_dataset_cuts_a_txt_file_as_text_sample_by_says(tmp_path):
    from tests.data.tokenizer_factory import make_tokenizer_folder
    from tunesmith.data import SFTDataset, Tokenizer

    tok = Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path / "tok"))
    path = tmp_path / "notes.txt"
    path.write_text("one line\nsecond line\n\nthird para\n", encoding="utf-8")
    by_line = SFTDataset(tok, source=path, format="text")
    by_para = SFTDataset(tok, source=path, format="text", text_sample_by="paragraph")
    whole = SFTDataset(tok, source=path, format="text", text_sample_by="document")
    assert len(by_line) == 3 and len(by_para) == 2 and len(whole) == 1
    expected = tok.encode("one line\nsecond line", add_special_tokens=True) + [tok.eos_id]
    assert by_para[0]["input_ids"] == expected
