"""The data preview: trained tokens marked where the chat template says (expected text built
here from the tokenizer's own mask, not from the shifted labels), token counts, truncation
stats counted from the untruncated lengths, and exact histograms."""

from __future__ import annotations

import json

import pytest

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.recipes.preference_world import make_preference_data
from tunesmith.data import DatasetMix, PreferenceDataset, SFTDataset, Tokenizer
from tunesmith.data.preview import (
    TRAINED_COLOR,
    length_histogram,
    preview,
    render_sample,
    render_tokens,
    truncation_stats,
)

CONVERSATIONS = [
    [{"role": "user", "content": "count 3 from 7"}, {"role": "assistant", "content": "7 8 9"}],
    [
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again, twice"},
        {"role": "assistant", "content": "hi hi"},
    ],
    [
        {"role": "user", "content": "a much longer question " * 6},
        {"role": "assistant", "content": "ok"},
    ],
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    root = tmp_path_factory.mktemp("preview")
    return Tokenizer.from_pretrained(make_tokenizer_folder(root / "tok", "qwen2_5"))


@pytest.fixture
def chat(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return path


def _expected(tok, ids, mask, open_="[[", close="]]"):
    """The rendering, built from an unshifted 0/1 mask: runs of equal flags, decoded."""
    out, start = "", 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or mask[end] != mask[start]:
            text = tok.decode(ids[start:end], skip_special_tokens=False)
            out += f"{open_}{text}{close}" if mask[start] else text
            start = end
    return out


def test_render_tokens_marks_the_trained_runs(tok):
    ids = tok.encode("two plus two is four", add_special_tokens=False)
    assert len(ids) >= 3
    trained = [False] * (len(ids) - 2) + [True, True]
    head = tok.decode(ids[:-2], skip_special_tokens=False)
    tail = tok.decode(ids[-2:], skip_special_tokens=False)
    assert render_tokens(tok, ids, trained) == f"{head}[[{tail}]]"
    assert render_tokens(tok, ids, trained, color=True) == f"{head}{TRAINED_COLOR}{tail}\x1b[0m"
    assert render_tokens(tok, ids, [False] * len(ids)) == tok.decode(ids)


def test_a_rendered_sample_marks_what_the_template_trains(tok, chat):
    dataset = SFTDataset(tok, source=str(chat))
    for index, messages in enumerate(CONVERSATIONS):
        ids, mask = tok.tokenize_conversation(messages)
        body = _expected(tok, list(ids), list(mask))
        # every assistant reply (and its end-of-turn token) inside brackets, nothing else
        assert body.count("[[") == sum(m["role"] == "assistant" for m in messages)
        header = f"--- sample {index}: {len(ids)} tokens, {sum(mask)} trained"
        assert render_sample(tok, dataset[index], title=f"sample {index}") == f"{header}\n{body}"
    colored = render_sample(tok, dataset[0], title="x", color=True)
    ids, mask = tok.tokenize_conversation(CONVERSATIONS[0])
    assert colored.splitlines()[0] == f"--- x: {len(ids)} tokens, {sum(mask)} trained"
    assert colored.split("\n", 1)[1] == _expected(
        tok, list(ids), list(mask), TRAINED_COLOR, "\x1b[0m"
    )


def test_preference_samples_show_both_sides(tok, tmp_path):
    data = make_preference_data(tmp_path / "pairs.jsonl", rows=2, task="copy")
    pairs = PreferenceDataset(tok, source=str(data))
    row = json.loads(data.read_text().splitlines()[0])
    lines = []
    for side in ("chosen", "rejected"):
        ids, mask = tok.tokenize_conversation(row[side])
        lines += [f"--- pair, {side}: {len(ids)} tokens, {sum(mask)} trained"]
        lines += [_expected(tok, list(ids), list(mask))]
    assert render_sample(tok, pairs[0], title="pair") == "\n".join(lines)


def test_truncation_stats_count_cut_and_dropped_rows(tok, chat):
    full = [len(tok.tokenize_conversation(m)[0]) for m in CONVERSATIONS]
    limit = sorted(full)[1]  # the middle length: one longer (cut), one exactly at the limit
    longer = sum(n > limit for n in full)
    cut = SFTDataset(tok, source=str(chat), max_seq_len=limit, truncation="left")
    assert truncation_stats(cut) == (
        f"truncation (max_seq_len {limit}): {sum(n >= limit for n in full)} of 3 samples at "
        f"max_seq_len\n"
        f"  {chat}: 3 rows -> 3 samples, {longer} cut to max_seq_len, 0 dropped as too long"
    )
    dropped = SFTDataset(
        tok, source=str(chat), max_seq_len=limit, truncation="drop", on_bad_row="skip"
    )
    assert truncation_stats(dropped).splitlines()[1] == (
        f"  {chat}: 3 rows -> {3 - longer} samples, 0 cut to max_seq_len, {longer} dropped as "
        "too long"
    )
    whole = SFTDataset(tok, source=str(chat))
    assert (
        truncation_stats(whole).splitlines()[0]
        == "truncation: no max_seq_len, 3 samples kept whole"
    )
    mix = DatasetMix(
        tok,
        parts={
            "a": {"source": str(chat), "max_seq_len": limit, "truncation": "left"},
            "b": [cut[0]],
        },
    )
    assert truncation_stats(mix).splitlines()[1].startswith(f"  a: {chat}: 3 rows -> 3 samples")


def test_length_histogram_exact():
    assert length_histogram([3, 3, 4, 10], bins=2, width=6) == (
        "token lengths: 4 samples, min 3, mean 5.0, max 10\n  3-6  3 ######\n  7-10 1 ##"
    )
    # 9..100 in 4 bins of 23: 9-31, 32-54, 55-77, 78-100; an empty bin has no bar; mean 1082/15
    lengths = [9, 10, 31, 32, 100] + [90] * 10
    assert length_histogram(lengths, bins=4, width=10) == (
        "token lengths: 15 samples, min 9, mean 72.1, max 100\n"
        "   9-31   3 ###\n"
        "  32-54   1 #\n"
        "  55-77   0\n"
        "  78-100 11 ##########"
    )
    assert length_histogram([5, 5], bins=10, width=4) == (
        "token lengths: 2 samples, min 5, mean 5.0, max 5\n  5-5 2 ####"
    )
    assert length_histogram([]) == "token lengths: no samples"


def test_preview_puts_it_together(tok, chat):
    dataset = SFTDataset(tok, source=str(chat), max_seq_len=512)
    lengths = [len(s["input_ids"]) for s in dataset.samples]
    text = preview(tok, dataset, indices=[2, 0], bins=3)
    blocks = [
        dataset.report.summary(),
        render_sample(tok, dataset[2], title=f"sample 2 ({chat} row 3)"),
        render_sample(tok, dataset[0], title=f"sample 0 ({chat} row 1)"),
        truncation_stats(dataset),
        length_histogram(lengths, bins=3),
    ]
    assert text == "\n\n".join(blocks) + "\n"
    assert preview(tok, dataset, n=1).count("--- sample") == 1
    with pytest.raises(IndexError, match="sample 3 is out of range: the dataset has 3 samples"):
        preview(tok, dataset, indices=[3])
