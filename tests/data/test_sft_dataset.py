"""SFTDataset: trained-token counts checked by hand, truncation, the bad-row catalogue
(skip = counted with row index, error = file + row + reason), file formats, the val split."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data.labels import IGNORE_INDEX, count_trained
from tunesmith.data.report import BadRowError, DataError
from tunesmith.data.sft_dataset import SFTDataset
from tunesmith.data.sources import load_rows
from tunesmith.data.tokenizer import Tokenizer
from tunesmith.data.validation import split_train_val


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path_factory.mktemp("q"), "qwen2_5"))


@pytest.fixture(scope="module")
def llama_tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path_factory.mktemp("l"), "llama3"))


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ntok(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def check_labels(sample: dict) -> None:
    ids, labels = sample["input_ids"], sample["labels"]
    assert len(ids) == len(labels) and labels[-1] == IGNORE_INDEX
    for i, label in enumerate(labels[:-1]):
        assert label in (IGNORE_INDEX, ids[i + 1])


CALL = {
    "role": "assistant",
    "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "oslo"}}}
    ],
}
CONVERSATIONS = [
    [msg("user", "hello"), msg("assistant", "hi there")],
    [
        msg("system", "you help"),
        msg("user", "add two and two"),
        msg("assistant", "the answer is 4"),
        msg("user", "thanks"),
        msg("assistant", "you are welcome"),
    ],
    [msg("user", "weather in oslo?"), CALL, msg("tool", "hot"), msg("assistant", "it is hot")],
]


@pytest.fixture
def conversations_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])


# ------------------------------------------------------------------- trained tokens by hand


def test_train_on_assistant_counts_each_reply_and_its_end_token(tok, conversations_file):
    ds = SFTDataset(tok, source=conversations_file)
    # ChatML: a reply is its content then <|im_end|> (1 token); the content is encoded on its
    # own here, independently of the template rendering.
    plain = [["hi there"], ["the answer is 4", "you are welcome"]]
    for sample, replies in zip(ds.samples[:2], plain, strict=False):
        check_labels(sample)
        assert count_trained(sample["labels"]) == sum(ntok(tok, r) + 1 for r in replies)
        targets = [t for t in sample["labels"] if t != IGNORE_INDEX]
        assert tok.decode(targets) == "".join(r + "<|im_end|>" for r in replies)
    # the tool-call reply is trained too: the last turn alone is not everything
    assert count_trained(ds[2]["labels"]) > ntok(tok, "it is hot") + 1
    assert ds.report.trained_tokens == sum(count_trained(s["labels"]) for s in ds.samples)
    assert ds.report.samples == ds.report.rows == 3 and ds.report.num_skipped == 0


def test_train_on_last_turn(tok, conversations_file):
    ds = SFTDataset(tok, source=conversations_file, train_on="last_turn")
    for sample, last in zip(ds, ["hi there", "you are welcome", "it is hot"], strict=True):
        check_labels(sample)
        targets = [t for t in sample["labels"] if t != IGNORE_INDEX]
        assert len(targets) == ntok(tok, last) + 1
        assert tok.decode(targets) == last + "<|im_end|>"


def test_train_on_all(tok, conversations_file):
    ds = SFTDataset(tok, source=conversations_file, train_on="all")
    for sample, conv in zip(ds, CONVERSATIONS, strict=True):
        text = tok.apply_chat_template(conv)
        assert sample["input_ids"] == tok.encode(text, add_special_tokens=False)
        assert count_trained(sample["labels"]) == len(sample["input_ids"]) - 1
        check_labels(sample)


def test_raw_prompt_completion_and_text(llama_tok, tmp_path):
    bos, eos = llama_tok.bos_id, llama_tok.eos_id
    path = write_jsonl(tmp_path / "pc.jsonl", [{"q": "two plus two is", "a": " four"}])
    ds = SFTDataset(
        llama_tok,
        source=path,
        format="prompt_completion",
        column_map={"prompt": "q", "completion": "a"},
        use_chat_template=False,
    )
    prompt = llama_tok.encode("two plus two is", add_special_tokens=False)
    completion = llama_tok.encode(" four", add_special_tokens=False)
    assert ds[0]["input_ids"] == [bos, *prompt, *completion, eos]
    assert ds[0]["labels"] == [IGNORE_INDEX] * len(prompt) + [*completion, eos, IGNORE_INDEX]

    path = write_jsonl(tmp_path / "text.jsonl", [{"text": "the water is hot"}])
    ds = SFTDataset(llama_tok, source=path, format="text", max_seq_len=64)
    body = llama_tok.encode("the water is hot", add_special_tokens=False)
    assert ds[0]["input_ids"] == [bos, *body, eos]
    assert ds[0]["labels"] == [*body, eos, IGNORE_INDEX]
    with pytest.raises(ValueError, match="system_prompt needs the chat template"):
        SFTDataset(llama_tok, source=path, format="text", system_prompt="x")


def test_templated_prompt_completion_with_system_prompt(tok, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "hello", "completion": "hi there"}])
    ds = SFTDataset(tok, source=path, format="prompt_completion", system_prompt="be kind")
    conv = [msg("system", "be kind"), msg("user", "hello"), msg("assistant", "hi there")]
    assert ds[0]["input_ids"] == tok.tokenize_conversation(conv)[0]
    assert count_trained(ds[0]["labels"]) == ntok(tok, "hi there") + 1


# ------------------------------------------------------------------------------ truncation


def test_truncation_right_left_drop(tok, tmp_path):
    conv = CONVERSATIONS[1]
    path = write_jsonl(tmp_path / "one.jsonl", [{"messages": conv}])
    full, mask = tok.tokenize_conversation(conv)
    n = len(full) - 3

    right = SFTDataset(tok, source=path, max_seq_len=n, truncation="right")
    assert right[0]["input_ids"] == full[:n] and right.report.truncated == 1
    check_labels(right[0])
    assert count_trained(right[0]["labels"]) == sum(mask[1:n])

    left = SFTDataset(tok, source=path, max_seq_len=n, truncation="left")
    assert left[0]["input_ids"] == full[-n:]
    assert count_trained(left[0]["labels"]) == sum(mask[-n + 1 :])

    with pytest.raises(BadRowError, match=r"one\.jsonl: bad row at line 1: too_long"):
        SFTDataset(tok, source=path, max_seq_len=n, truncation="drop")
    kept = SFTDataset(tok, source=path, max_seq_len=len(full), truncation="drop")
    assert kept[0]["input_ids"] == full and kept.report.truncated == 0


def test_fully_truncated_assistant_turn_is_reported_not_trained(tok, tmp_path):
    long_prompt = "the weather in paris is hot " * 6
    rows = [
        {"messages": [msg("user", "hello"), msg("assistant", "hi there")]},
        {"messages": [msg("user", long_prompt), msg("assistant", "yes")]},
    ]
    path = write_jsonl(tmp_path / "cut.jsonl", rows)
    max_len = len(tok.tokenize_conversation(rows[0]["messages"])[0])
    ds = SFTDataset(tok, source=path, max_seq_len=max_len, on_bad_row="skip")
    assert ds.row_indices == [0]
    assert ds.report.skipped == {"no_trained_tokens": 1}
    assert ds.report.examples == {"no_trained_tokens": [2]}  # line 2
    assert "after truncation" in ds.report.summary()
    with pytest.raises(BadRowError, match=r"cut\.jsonl: bad row at line 2: no_trained_tokens"):
        SFTDataset(tok, source=path, max_seq_len=max_len)


# ---------------------------------------------------------------------------- bad rows

GOOD = {"messages": [msg("user", "hello"), msg("assistant", "hi there")]}
HUGE = {"messages": [msg("user", "hot " * 30_000), msg("assistant", "yes")]}
BAD_LINES = {  # reason -> the raw JSONL line
    "missing_field": json.dumps({"other": 1}),
    "wrong_type": json.dumps({"messages": [msg("user", "a"), {"role": "assistant", "content": 4}]}),
    "empty_assistant_turn": json.dumps({"messages": [msg("user", "a"), msg("assistant", " ")]}),
    "no_assistant_turn": json.dumps({"messages": [msg("user", "a")]}),
    "roles_out_of_order": json.dumps({"messages": [msg("assistant", "a"), msg("user", "b")]}),
    "unknown_role": json.dumps({"messages": [msg("user", "a"), msg("bot", "b")]}),
    "malformed_json": '{"messages": [',
    "invalid_utf8": b'{"messages": "\xff\xfe"}'.decode("latin-1"),
    "too_long": json.dumps(HUGE),
}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_bytes(b"".join(line.encode("latin-1") + b"\n" for line in lines))
    return path


def test_every_bad_row_is_counted_with_its_row_index_under_skip(tok, tmp_path):
    lines = [json.dumps(GOOD), ""]  # a blank line is not a row
    lines += list(BAD_LINES.values())
    lines.append(json.dumps(GOOD))
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    ds = SFTDataset(tok, source=path, max_seq_len=64, truncation="drop", on_bad_row="skip")
    n_bad = len(BAD_LINES)
    assert ds.row_indices == [0, n_bad + 1]
    assert ds.report.rows == n_bad + 2 and ds.report.samples == 2
    assert ds.report.skipped == dict.fromkeys(BAD_LINES, 1)
    assert ds.report.examples == {reason: [i + 3] for i, reason in enumerate(BAD_LINES)}  # lines
    summary = ds.report.summary()
    for reason in BAD_LINES:
        assert reason in summary


@pytest.mark.parametrize("reason", list(BAD_LINES))
def test_bad_row_raises_with_file_row_and_line_under_error(tok, tmp_path, reason):
    path = write_lines(tmp_path / f"{reason}.jsonl", [json.dumps(GOOD), "", BAD_LINES[reason]])
    with pytest.raises(BadRowError) as info:
        SFTDataset(tok, source=path, max_seq_len=64, truncation="drop")
    err = info.value
    assert (err.source, err.row, err.reason) == (str(path), 1, reason)
    assert str(err).startswith(f"{path}: bad row at line 3: {reason}: ")


def test_huge_line_is_truncated_when_asked(tok, tmp_path):
    path = write_jsonl(tmp_path / "huge.jsonl", [HUGE])
    ds = SFTDataset(tok, source=path, max_seq_len=32, truncation="left")
    assert len(ds[0]["input_ids"]) == 32 and ds.report.truncated == 1
    assert tok.decode([t for t in ds[0]["labels"] if t != IGNORE_INDEX]) == "yes<|im_end|>"


def test_template_error_is_a_bad_row(tmp_path):
    folder = make_tokenizer_folder(
        tmp_path / "t",
        "qwen2_5",
        chat_template="{% if messages|length > 2 %}{{ raise_exception('too many turns') }}{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    tok = Tokenizer.from_pretrained(folder)
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, {"messages": CONVERSATIONS[1]}])
    ds = SFTDataset(tok, source=path, on_bad_row="skip")
    assert ds.report.skipped == {"template_error": 1} and ds.report.examples["template_error"] == [
        2
    ]
    with pytest.raises(BadRowError, match="template_error: .*too many turns"):
        SFTDataset(tok, source=path)


def test_all_rows_bad_is_an_error_even_when_skipping(tok, tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [BAD_LINES["no_assistant_turn"]])
    with pytest.raises(
        DataError, match=r"(?s)bad\.jsonl: no usable samples.*no_assistant_turn \(lines 1;"
    ):
        SFTDataset(tok, source=path, on_bad_row="skip")


# ----------------------------------------------------------------------- files and columns


def test_file_level_errors_name_the_file(tok, tmp_path):
    cases = {
        "empty.jsonl": (b"", "file is empty"),
        "blank.jsonl": (b"\n  \n", "file is empty"),
        "empty.csv": (b"", "file is empty"),
        "bad.csv": (b"prompt,completion\nhi,yo\n\xff,x\n", "line 3: bytes are not valid UTF-8"),
        "array.json": (b'[{"text": "a"},\n {"text": }]', "line 2 column 11: malformed JSON"),
        "object.json": (b'{\n "text": "a"\n}\n', "one JSON object spread over several lines"),
        "empty.parquet": (b"", "could not load the dataset"),
        "rows.xml": (b"hello\n", "unsupported file type '.xml'"),
        "none.json": (b"[]", "has no rows"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(DataError, match=f"^{path}: .*{message}"):
            SFTDataset(tok, source=path, format="text")
    with pytest.raises(DataError, match="nope.jsonl: no such file"):
        SFTDataset(tok, source=tmp_path / "nope.jsonl")


def test_missing_column_names_the_column_and_the_columns_there(tok, tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"question": "a", "response": "b"}])
    with pytest.raises(DataError, match=r"qa\.jsonl: .*needs column 'instruction'.*'question'"):
        SFTDataset(tok, source=path, format="alpaca")
    ds = SFTDataset(
        tok,
        source=path,
        format="alpaca",
        column_map={"instruction": "question", "output": "response"},
    )
    assert len(ds) == 1


def test_json_array_csv_tsv_parquet_and_folder_give_the_same_samples(tok, tmp_path):
    rows = [
        {"instruction": "add 2 and 2", "input": "", "output": "4"},
        {"instruction": "name a city", "input": "in italy", "output": "rome"},
    ]
    jsonl = SFTDataset(tok, source=write_jsonl(tmp_path / "a.jsonl", rows), format="alpaca")
    (tmp_path / "a.json").write_text(json.dumps(rows))
    pd.DataFrame(rows).to_csv(tmp_path / "a.csv", index=False)
    pd.DataFrame(rows).to_csv(tmp_path / "a.tsv", index=False, sep="\t")
    (tmp_path / "folder").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "a.parquet")
    pd.DataFrame(rows).to_parquet(tmp_path / "folder" / "train.parquet")
    for source in ("a.json", "a.csv", "a.tsv", "a.parquet", "folder"):
        ds = SFTDataset(tok, source=tmp_path / source, format="alpaca")
        assert ds.samples == jsonl.samples, source


def test_parquet_messages_with_arrow_filled_nulls_and_wrong_types(tok, tmp_path):
    rows = [{"messages": c} for c in CONVERSATIONS]
    jsonl = SFTDataset(tok, source=write_jsonl(tmp_path / "c.jsonl", rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "c.parquet")  # Arrow adds tool_calls: None etc.
    parquet = SFTDataset(tok, source=tmp_path / "c.parquet")
    assert parquet.samples == jsonl.samples
    # a whole column of the wrong type: every row is bad
    pd.DataFrame({"prompt": [1, 2], "completion": ["a", "b"]}).to_parquet(tmp_path / "n.parquet")
    with pytest.raises(
        BadRowError, match=r"n\.parquet: bad row at row 1: wrong_type: column 'prompt' is int"
    ):
        SFTDataset(tok, source=tmp_path / "n.parquet", format="prompt_completion")


def test_csv_cells_stay_text_and_empty_cells_are_missing(tok, tmp_path):
    path = tmp_path / "n.csv"
    path.write_text("prompt,completion\n2+2=,4\nempty,\n", encoding="utf-8")
    ds = SFTDataset(tok, source=path, format="prompt_completion", on_bad_row="skip")
    assert ds.row_indices == [0] and ds.report.examples == {"missing_field": [3]}  # line 3
    assert tok.decode([t for t in ds[0]["labels"] if t != IGNORE_INDEX]) == "4<|im_end|>"


def test_load_rows_numbers_rows_and_lines(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", ['{"a": 1}', "", '{"b": 2}', "[3]"])
    rows = load_rows(path)
    assert rows.columns == ["a", "b"]
    assert list(rows) == [
        (0, " (line 1)", {"a": 1}),
        (1, " (line 3)", {"b": 2}),
        (2, " (line 4)", [3]),
    ]
    with pytest.raises(ValueError, match="a single local file is one split"):
        load_rows(path, split="validation")


def test_bad_arguments_are_refused(tok, conversations_file):
    for kwargs, message in [
        ({"train_on": "user"}, "train_on must be one of"),
        ({"truncation": "middle"}, "truncation must be one of"),
        ({"on_bad_row": "ignore"}, "on_bad_row must be one of"),
        ({"format": "chatml"}, "unknown dataset format"),
        ({"column_map": {"msgs": "x"}}, "does not read"),
    ]:
        with pytest.raises(ValueError, match=message):
            SFTDataset(tok, source=conversations_file, **kwargs)


# ------------------------------------------------------------------------- validation split


def test_split_train_val_is_disjoint_complete_and_deterministic(tok, tmp_path):
    path = write_jsonl(tmp_path / "many.jsonl", [GOOD] * 20)
    ds = SFTDataset(tok, source=path)
    train, val = split_train_val(ds, val_fraction=0.15, seed=3)
    assert len(val) == 3 and len(train) == 17
    assert sorted(train.indices + val.indices) == list(range(20))
    assert split_train_val(ds, 0.15, seed=3)[1].indices == val.indices
    assert split_train_val(ds, 0.15, seed=4)[1].indices != val.indices
    assert val[0] == ds[val.indices[0]]
    with pytest.raises(ValueError, match="leaves nothing to train on"):
        split_train_val([1], 0.5)
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\)"):
        split_train_val(ds, 0.0)
