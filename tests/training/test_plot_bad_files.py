"""`tunesmith plot` on a broken metrics.jsonl: binary bytes, JSON nested too deep, a line
that is not a record, a line too long; each is one error naming the file and line."""

from __future__ import annotations

import pytest

from tunesmith.training.logging.plot import read_metrics

BAD = {
    "binary": (b"\x89PNG\r\n\x1a\n\xff\xfe", "not UTF-8 text"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deep"),
    "list": (b"[1, 2]", "not a metrics record with a step: [1, 2]"),
    "no-step": (b'{"loss": 1.0}', "not a metrics record with a step"),
    "not-json": (b"{oops", "not a metrics record with a step"),
    "long": (b'{"step": 2, "x": "' + b"y" * 2**21 + b'"}', "a line over 1048576 bytes"),
}


@pytest.mark.parametrize("line, words", BAD.values(), ids=BAD.keys())
def test_a_broken_metrics_line_names_the_file_and_line(tmp_path, line, words):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n' + line + b"\n")
    with pytest.raises(ValueError) as error:
        read_metrics(path)
    assert str(error.value).startswith(f"{path}:2: ") and words in str(error.value)


def test_good_lines_still_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.0}\n\n{"step": 2, "loss": 1.5, "note": "x"}\n')
    assert read_metrics(path) == {"loss": [(1, 2.0), (2, 1.5)]}
