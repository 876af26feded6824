"""PreferenceDataset and collate_preference: the shared prompt and the trained reply tokens
checked against an independent rendering, every format and file kind, the bad-pair catalogue
(skip = counted with row index, error = file + row + reason), truncation, batch layout."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.data.test_sft_dataset import (  # noqa: F401 - _datasets_cache is an autouse fixture
    _datasets_cache,
    msg,
    write_jsonl,
    write_lines,
)
from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data import PreferenceDataset, collate_preference
from tunesmith.data.labels import IGNORE_INDEX, count_trained
from tunesmith.data.report import BadRowError, DataError
from tunesmith.data.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path_factory.mktemp("q"), "qwen2_5"))


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path_factory.mktemp("l"), "llama3"))


PROMPT = [
    msg("system", "you help"),
    msg("user", "add two and two"),
    msg("assistant", "the answer is 4"),
    msg("user", "and three and three?"),
]
CHOSEN = msg("assistant", "the answer is 6")
REJECTED = msg("assistant", "it is hot in paris today and the water is hot too")
PAIR = {"chosen": [*PROMPT, CHOSEN], "rejected": [*PROMPT, REJECTED]}
SIMPLE = {  # one user turn, as strings
    "prompt": "what is the weather in paris?",
    "chosen": "it is hot",
    "rejected": "no idea",
}
SIMPLE_PROMPT = [msg("user", SIMPLE["prompt"])]


def prompt_ids(tok: Tokenizer, prompt: list[dict]) -> list[int]:
    """The prompt rendered as text with the generation prompt, then encoded (no spans)."""
    text = tok.apply_chat_template(prompt, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def reference(tok: Tokenizer, prompt: list[dict], reply: dict) -> tuple[list[int], list[int]]:
    """Ids and shifted labels of ``prompt + [reply]`` trained on the last reply span only,
    written out from ``tokenize_conversation`` directly."""
    ids, _, spans = tok.tokenize_conversation([*prompt, reply], return_spans=True)
    start, end = spans[-1]
    labels = [ids[i + 1] if start <= i + 1 < end else IGNORE_INDEX for i in range(len(ids) - 1)]
    return ids, [*labels, IGNORE_INDEX]


def trained_text(tok: Tokenizer, labels: list[int]) -> str:
    return tok.decode([t for t in labels if t != IGNORE_INDEX])


def check_sample(tok: Tokenizer, sample: dict, prompt: list[dict], chosen: dict, rejected: dict):
    """The sample equals the independent rendering of both conversations, with the prompt
    (rendered with its generation prompt) as their shared prefix."""
    shared = prompt_ids(tok, prompt)
    assert sample["prompt_len"] == len(shared)
    for side, reply in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = reference(tok, prompt, reply)
        assert sample[f"{side}_input_ids"] == ids
        assert sample[f"{side}_input_ids"][: len(shared)] == shared
        assert sample[f"{side}_labels"] == labels


# ------------------------------------------------------------------------- tokens by hand


@pytest.mark.parametrize("family", ["qwen2_5", "llama3"])
def test_prompt_is_shared_and_only_the_last_reply_is_trained(family, tok, llama_tok, tmp_path):
    t = tok if family == "qwen2_5" else llama_tok
    path = write_jsonl(tmp_path / "p.jsonl", [PAIR])
    ds = PreferenceDataset(t, source=path)
    sample = ds[0]
    assert sorted(sample) == [
        "chosen_input_ids",
        "chosen_labels",
        "prompt_len",
        "rejected_input_ids",
        "rejected_labels",
    ]
    check_sample(t, sample, PROMPT, CHOSEN, REJECTED)
    # the reply text encoded on its own + the end-of-turn token: the earlier assistant turn
    # of the prompt is not trained
    eot = "<|im_end|>" if family == "qwen2_5" else "<|eot_id|>"
    for side, reply in (("chosen", CHOSEN), ("rejected", REJECTED)):
        labels = sample[f"{side}_labels"]
        assert trained_text(t, labels) == reply["content"] + eot
        assert (
            count_trained(labels) == len(t.encode(reply["content"], add_special_tokens=False)) + 1
        )
        assert all(label == IGNORE_INDEX for label in labels[: sample["prompt_len"] - 1])
    assert ds.row_indices == [0] and ds.report.samples == ds.report.rows == 1
    assert ds.report.tokens == len(sample["chosen_input_ids"]) + len(sample["rejected_input_ids"])
    assert ds.report.trained_tokens == sum(
        count_trained(sample[k]) for k in ("chosen_labels", "rejected_labels")
    )


def test_unstable_prefix_falls_back_to_the_common_prefix_before_both_replies(tok, tmp_path):
    # A reply that starts with a newline: the generation prompt's "\n" and the reply's "\n"
    # merge into one token, so the prompt's ids are not a prefix of the conversation's ids.
    chosen, rejected = msg("assistant", "\nhello there"), msg("assistant", " hello")
    shared = prompt_ids(tok, SIMPLE_PROMPT)
    full_chosen, _ = reference(tok, SIMPLE_PROMPT, chosen)
    assert full_chosen[: len(shared)] != shared  # precondition: the prefix is not stable
    path = write_jsonl(
        tmp_path / "nl.jsonl",
        [{"prompt": SIMPLE["prompt"], "chosen": chosen["content"], "rejected": " hello"}],
    )
    sample = PreferenceDataset(tok, source=path, format="prompt_chosen_rejected")[0]
    n = sample["prompt_len"]
    starts = []
    for side, reply in (("chosen", chosen), ("rejected", rejected)):
        ids, labels = reference(tok, SIMPLE_PROMPT, reply)
        assert sample[f"{side}_input_ids"] == ids and sample[f"{side}_labels"] == labels
        starts.append(
            tok.tokenize_conversation([*SIMPLE_PROMPT, reply], return_spans=True)[2][-1][0]
        )
    # the prompt: the longest common prefix that ends at or before both reply starts
    c, r = sample["chosen_input_ids"], sample["rejected_input_ids"]
    assert n <= min(starts) and c[:n] == r[:n] and (n == min(starts) or c[n] != r[n])
    assert n == len(shared) - 1  # everything but the merged "\n" of the generation prompt


# -------------------------------------------------------------------------------- formats


def test_every_format_and_column_map_give_the_same_samples(tok, tmp_path):
    whole = PreferenceDataset(tok, source=write_jsonl(tmp_path / "w.jsonl", [PAIR]))
    layouts = {
        "trl_lists": {"prompt": PROMPT, "chosen": [CHOSEN], "rejected": [REJECTED]},
        "trl_strings": {
            "prompt": PROMPT,
            "chosen": CHOSEN["content"],
            "rejected": REJECTED["content"],
        },
        # UltraFeedback style: a prompt string next to whole conversations (not read then)
        "whole_with_prompt": {"prompt": "ignored", **PAIR},
    }
    for name, row in layouts.items():
        ds = PreferenceDataset(tok, source=write_jsonl(tmp_path / f"{name}.jsonl", [row]))
        assert ds.samples == whole.samples, name
    renamed = {"p": PROMPT, "good": [CHOSEN], "bad": [REJECTED]}
    ds = PreferenceDataset(
        tok,
        source=write_jsonl(tmp_path / "renamed.jsonl", [renamed]),
        column_map={"prompt": "p", "chosen": "good", "rejected": "bad"},
    )
    assert ds.samples == whole.samples


def test_prompt_chosen_rejected_strings_with_column_map_and_system(tok, tmp_path):
    rows = [
        {"q": SIMPLE["prompt"], "good": SIMPLE["chosen"], "bad": SIMPLE["rejected"]},
        {"q": "hi", "good": "hello", "bad": "go away", "sys": "be kind"},
    ]
    ds = PreferenceDataset(
        tok,
        source=write_jsonl(tmp_path / "s.jsonl", rows),
        format="prompt_chosen_rejected",
        column_map={"prompt": "q", "chosen": "good", "rejected": "bad", "system": "sys"},
    )
    check_sample(
        tok,
        ds[0],
        SIMPLE_PROMPT,
        msg("assistant", SIMPLE["chosen"]),
        msg("assistant", SIMPLE["rejected"]),
    )
    check_sample(
        tok,
        ds[1],
        [msg("system", "be kind"), msg("user", "hi")],
        msg("assistant", "hello"),
        msg("assistant", "go away"),
    )
    # the same strings as a one-user-turn prompt in the messages format
    as_messages = {"prompt": "hi", "chosen": "hello", "rejected": "go away"}
    plain = PreferenceDataset(tok, source=write_jsonl(tmp_path / "m.jsonl", [as_messages]))
    check_sample(
        tok, plain[0], [msg("user", "hi")], msg("assistant", "hello"), msg("assistant", "go away")
    )


def test_system_prompt_is_added_where_missing(tok, tmp_path):
    rows = [PAIR, {"prompt": SIMPLE["prompt"], "chosen": "it is hot", "rejected": "no idea"}]
    ds = PreferenceDataset(tok, source=write_jsonl(tmp_path / "s.jsonl", rows), system_prompt="x")
    check_sample(tok, ds[0], PROMPT, CHOSEN, REJECTED)  # the row's own system message wins
    with_system = [msg("system", "x"), *SIMPLE_PROMPT]
    check_sample(
        tok, ds[1], with_system, msg("assistant", "it is hot"), msg("assistant", "no idea")
    )


def test_parquet_file_and_folder_give_the_jsonl_samples(tok, tmp_path):
    rows = [
        {"prompt": PROMPT, "chosen": [CHOSEN], "rejected": [REJECTED]},
        {
            "prompt": SIMPLE_PROMPT,
            "chosen": [msg("assistant", "hot")],
            "rejected": [msg("assistant", "cold")],
        },
    ]
    jsonl = PreferenceDataset(tok, source=write_jsonl(tmp_path / "r.jsonl", rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "r.parquet")  # Arrow fills absent keys with None
    (tmp_path / "folder").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "folder" / "train.parquet")
    for source in ("r.parquet", "folder"):
        ds = PreferenceDataset(tok, source=tmp_path / source)
        assert ds.samples == jsonl.samples and ds.row_indices == [0, 1], source
    # and the conversations' flat counterpart
    flat = [
        {"prompt": SIMPLE["prompt"], "chosen": "hot", "rejected": "cold"},
    ]
    pd.DataFrame(flat).to_parquet(tmp_path / "flat.parquet")
    ds = PreferenceDataset(tok, source=tmp_path / "flat.parquet", format="prompt_chosen_rejected")
    assert ds.samples == jsonl.samples[1:]


# ------------------------------------------------------------------------------ truncation


def long_pair_file(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "long.jsonl", [PAIR])


def test_truncation_cuts_the_prompt_start_then_both_responses_to_one_budget(tok, tmp_path):
    shared = prompt_ids(tok, PROMPT)
    full = {
        side: reference(tok, PROMPT, r) for side, r in (("chosen", CHOSEN), ("rejected", REJECTED))
    }
    responses = {
        side: (ids[len(shared) :], labels[len(shared) :]) for side, (ids, labels) in full.items()
    }
    longest = max(len(ids) for ids, _ in responses.values())
    shortest = min(len(ids) for ids, _ in responses.values())
    assert longest > shortest + 2  # the pair's responses have different lengths
    max_prompt = len(shared) - 5
    max_len = max_prompt + shortest - 1  # both responses lose tokens
    ds = PreferenceDataset(
        tok, source=long_pair_file(tmp_path), max_seq_len=max_len, max_prompt_len=max_prompt
    )
    sample = ds[0]
    kept_prompt = shared[-max_prompt:]  # keep_end: the latest turns and the generation prompt
    assert sample["prompt_len"] == max_prompt
    assert tok.decode(kept_prompt).endswith(
        "and three and three?<|im_end|>\n<|im_start|>assistant\n"
    )
    budget = max_len - max_prompt
    for side, (ids, labels) in responses.items():
        assert sample[f"{side}_input_ids"] == kept_prompt + ids[:budget]
        assert len(sample[f"{side}_input_ids"]) == max_len
        # labels: the reference labels, but the last kept position has nothing to predict
        expected = [IGNORE_INDEX] * (max_prompt - 1) + [full[side][1][len(shared) - 1]]
        expected += labels[: budget - 1] + [IGNORE_INDEX]
        assert sample[f"{side}_labels"] == expected
    assert ds.report.truncated == 1

    start = PreferenceDataset(
        tok,
        source=long_pair_file(tmp_path),
        max_seq_len=max_len,
        max_prompt_len=max_prompt,
        truncation="keep_start",
    )[0]
    assert start["chosen_input_ids"][:max_prompt] == shared[:max_prompt]
    assert start["rejected_input_ids"] == shared[:max_prompt] + responses["rejected"][0][:budget]


def test_without_max_prompt_len_only_the_responses_are_cut(tok, tmp_path):
    shared = prompt_ids(tok, PROMPT)
    chosen_ids, _ = reference(tok, PROMPT, CHOSEN)
    rejected_ids, _ = reference(tok, PROMPT, REJECTED)
    max_len = len(chosen_ids) - 1  # the chosen reply (the shorter) loses its final newline
    assert len(rejected_ids) > len(chosen_ids)
    ds = PreferenceDataset(tok, source=long_pair_file(tmp_path), max_seq_len=max_len)
    assert ds[0]["prompt_len"] == len(shared)
    assert ds[0]["chosen_input_ids"] == chosen_ids[:max_len]
    assert ds[0]["rejected_input_ids"] == rejected_ids[:max_len]
    # pairs that fit are untouched, whatever max_prompt_len says
    fit = PreferenceDataset(
        tok, source=long_pair_file(tmp_path), max_seq_len=len(rejected_ids), max_prompt_len=3
    )
    check_sample(tok, fit[0], PROMPT, CHOSEN, REJECTED)
    assert fit.report.truncated == 0


def test_drop_and_emptied_responses_are_bad_rows(tok, tmp_path):
    short_prompt = [msg("system", "you help"), msg("user", "hi")]
    short = {"prompt": short_prompt, "chosen": "hello", "rejected": "go away"}
    path = write_jsonl(tmp_path / "two.jsonl", [short, PAIR])
    limit = len(reference(tok, short_prompt, msg("assistant", "go away"))[0])
    assert len(prompt_ids(tok, PROMPT)) >= limit  # the long pair's prompt alone fills it
    with pytest.raises(BadRowError, match=r"two\.jsonl: bad row at line 2: too_long"):
        PreferenceDataset(tok, source=path, max_seq_len=limit, truncation="drop")
    dropped = PreferenceDataset(
        tok, source=path, max_seq_len=limit, truncation="drop", on_bad_row="skip"
    )
    assert dropped.row_indices == [0] and dropped.report.examples == {"too_long": [2]}  # line 2
    # keep_end without max_prompt_len: the long prompt leaves the responses nothing
    with pytest.raises(
        BadRowError, match=r"bad row at line 2: no_trained_tokens: .*max_prompt_len"
    ):
        PreferenceDataset(tok, source=path, max_seq_len=limit)
    # a budget of one response token: that token is trained, its label sits on the prompt's
    # last position (the sequence's own last position never has a target)
    one = PreferenceDataset(tok, source=path, max_seq_len=limit, max_prompt_len=limit - 1)
    assert one.row_indices == [0, 1]
    assert [count_trained(one[1][k]) for k in ("chosen_labels", "rejected_labels")] == [1, 1]


def test_identical_after_truncation_or_tokenisation_is_a_bad_row(tok, llama_tok, tmp_path):
    # Llama 3's template trims replies: "hot " and "hot" are the same tokens
    path = write_jsonl(
        tmp_path / "trim.jsonl", [{"prompt": "hi", "chosen": "hot ", "rejected": "hot"}]
    )
    with pytest.raises(BadRowError, match="bad row at line 1: identical_responses: .*same tokens"):
        PreferenceDataset(llama_tok, source=path, format="prompt_chosen_rejected")
    # two replies that share their first tokens, cut to that shared head
    same_start = {"prompt": "hi", "chosen": "the answer is 4", "rejected": "the answer is 5"}
    path = write_jsonl(tmp_path / "head.jsonl", [same_start])
    head = len(prompt_ids(tok, [msg("user", "hi")]))
    head += len(tok.encode("the answer is", add_special_tokens=False))
    with pytest.raises(BadRowError, match="identical_responses: .*after truncation"):
        PreferenceDataset(tok, source=path, max_seq_len=head, format="prompt_chosen_rejected")
    kept = PreferenceDataset(
        tok, source=path, max_seq_len=head + 2, format="prompt_chosen_rejected"
    )
    assert kept[0]["chosen_input_ids"][-1] != kept[0]["rejected_input_ids"][-1]


# ---------------------------------------------------------------------------- bad rows

GOOD = {"prompt": "hi", "chosen": "hello", "rejected": "go away"}
BAD_ROWS = {  # reason -> a row of the messages format
    "missing_field": {"prompt": "hi", "chosen": "hello"},
    "wrong_type": {"prompt": "hi", "chosen": 4, "rejected": "x"},
    "empty_assistant_turn": {"prompt": "hi", "chosen": " ", "rejected": "x"},
    "identical_responses": {"prompt": "hi", "chosen": "same", "rejected": "same"},
    "prompt_mismatch": {
        "chosen": [msg("user", "hi"), msg("assistant", "a")],
        "rejected": [msg("user", "hello"), msg("assistant", "b")],
    },
    "last_turn_not_assistant": {
        "chosen": [msg("user", "hi"), msg("assistant", "a"), msg("user", "ok")],
        "rejected": [msg("user", "hi"), msg("assistant", "b")],
    },
    "roles_out_of_order": {"chosen": [msg("assistant", "a")], "rejected": [msg("assistant", "b")]},
    "too_long": {"prompt": "hot " * 200, "chosen": "yes", "rejected": "no"},
}
BAD_LINES = {reason: json.dumps(row) for reason, row in BAD_ROWS.items()}
BAD_LINES["malformed_json"] = '{"chosen": ['


def test_every_bad_pair_is_counted_with_its_row_index_under_skip(tok, tmp_path):
    lines = [json.dumps(GOOD), "", *BAD_LINES.values(), json.dumps(GOOD)]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    ds = PreferenceDataset(tok, source=path, max_seq_len=64, truncation="drop", on_bad_row="skip")
    n_bad = len(BAD_LINES)
    assert ds.row_indices == [0, n_bad + 1]
    assert ds.report.rows == n_bad + 2 and ds.report.samples == 2
    assert ds.report.skipped == dict.fromkeys(BAD_LINES, 1)
    assert ds.report.examples == {reason: [i + 3] for i, reason in enumerate(BAD_LINES)}  # lines
    summary = ds.report.summary()
    assert all(reason in summary for reason in BAD_LINES)


@pytest.mark.parametrize("reason", list(BAD_LINES))
def test_bad_pair_raises_with_file_row_and_line_under_error(tok, tmp_path, reason):
    path = write_lines(tmp_path / f"{reason}.jsonl", [json.dumps(GOOD), "", BAD_LINES[reason]])
    with pytest.raises(BadRowError) as info:
        PreferenceDataset(tok, source=path, max_seq_len=64, truncation="drop")
    err = info.value
    assert (err.source, err.row, err.reason) == (str(path), 1, reason)
    assert str(err).startswith(f"{path}: bad row at line 3: {reason}: ")


def test_template_error_is_a_bad_pair(tmp_path):
    folder = make_tokenizer_folder(
        tmp_path / "t",
        "qwen2_5",
        chat_template="{% if messages|length > 2 %}{{ raise_exception('too many turns') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    t = Tokenizer.from_pretrained(folder)
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, PAIR])
    ds = PreferenceDataset(t, source=path, on_bad_row="skip")
    assert ds.row_indices == [0] and ds.report.examples == {"template_error": [2]}  # line 2
    with pytest.raises(BadRowError, match="bad row at line 2: template_error: .*too many turns"):
        PreferenceDataset(t, source=path)


def test_all_rows_bad_and_bad_arguments_are_refused(tok, tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [BAD_LINES["identical_responses"]])
    with pytest.raises(DataError, match=r"(?s)bad\.jsonl: no usable pairs.*identical_responses"):
        PreferenceDataset(tok, source=path, on_bad_row="skip")
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    for kwargs, message in [
        ({"truncation": "right"}, "truncation must be one of"),
        ({"on_bad_row": "ignore"}, "on_bad_row must be one of"),
        (
            {"format": "alpaca"},
            "unknown dataset format .alpaca.; choose one of .*prompt_chosen_rejected",
        ),
        ({"column_map": {"answer": "x"}}, "does not read"),
        ({"max_prompt_len": 8}, "max_prompt_len needs max_seq_len"),
        (
            {"max_seq_len": 8, "max_prompt_len": 8},
            r"max_prompt_len must be in \[1, max_seq_len=8\)",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            PreferenceDataset(tok, source=good, **kwargs)
    with pytest.raises(
        DataError, match=r"good\.jsonl: .*needs column 'better' \(for field 'chosen'\)"
    ):
        PreferenceDataset(tok, source=good, column_map={"chosen": "better"})


# ---------------------------------------------------------------------------------- collate


def test_collate_puts_chosen_rows_first_then_rejected_padded(tok, tmp_path):
    rows = [PAIR, GOOD, {"prompt": "hi", "chosen": "a longer reply here", "rejected": "no"}]
    ds = PreferenceDataset(tok, source=write_jsonl(tmp_path / "c.jsonl", rows))
    batch = collate_preference(ds.samples, pad_id=tok.pad_id, pad_to_multiple_of=8)
    sequences = [s["chosen_input_ids"] for s in ds.samples] + [
        s["rejected_input_ids"] for s in ds.samples
    ]
    labels = [s["chosen_labels"] for s in ds.samples] + [s["rejected_labels"] for s in ds.samples]
    width = -(-max(map(len, sequences)) // 8) * 8
    assert set(batch) == {"input_ids", "labels", "attention_mask", "position_ids"}
    assert all(t.dtype == torch.long and t.shape == (6, width) for t in batch.values())
    for row, (ids, lab) in enumerate(zip(sequences, labels, strict=True)):
        pad = width - len(ids)
        assert batch["input_ids"][row].tolist() == ids + [tok.pad_id] * pad
        assert batch["labels"][row].tolist() == lab + [IGNORE_INDEX] * pad
        assert batch["attention_mask"][row].tolist() == [1] * len(ids) + [0] * pad
        assert batch["position_ids"][row].tolist() == list(range(width))


def test_collate_errors_name_the_sample():
    good = {
        "chosen_input_ids": [1, 2],
        "chosen_labels": [2, -100],
        "rejected_input_ids": [1, 3],
        "rejected_labels": [3, -100],
        "prompt_len": 1,
    }
    with pytest.raises(ValueError, match="empty batch"):
        collate_preference([], pad_id=0)
    missing = {k: v for k, v in good.items() if k != "rejected_labels"}
    with pytest.raises(ValueError, match="preference sample 1 has no 'rejected_labels'"):
        collate_preference([good, missing], pad_id=0)
    short = {**good, "rejected_labels": [3]}
    with pytest.raises(
        ValueError, match="preference sample 2: 2 rejected_input_ids but 1 rejected_labels"
    ):
        collate_preference([good, good, short], pad_id=0)
    with pytest.raises(ValueError, match="preference sample 0 is list"):
        collate_preference([[1, 2]], pad_id=0)  # type: ignore[list-item]
