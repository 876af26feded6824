"""``prompt_style`` for alpaca rows: the Stanford Alpaca prompt (and a plain
"### Instruction / ### Response" prompt) tokenised as text, checked against tokenising the
documented prompt text + output directly with the ``tokenizers`` library; and a base model
(a tokenizer folder with no chat template) trained on alpaca data by the ``sft`` recipe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, processors, trainers

from tests.data.tokenizer_factory import corpus, make_tokenizer_folder
from tests.recipes.sft_world import checkpoints, read_metrics, run_recipe
from tunesmith.data import SFTDataset, Tokenizer
from tunesmith.data.formats import (
    PROMPT_STYLES,
    Conversation,
    PromptCompletion,
    convert_row,
    render_prompt,
)
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.hf import save_hf_checkpoint

IGNORE = -100

# The prompts as published by Stanford Alpaca (README / train.py PROMPT_DICT), written out
# here independently of tunesmith's constants, with the response on its own line.
ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)

ROWS = [
    {"instruction": "Give the capital of France.", "input": "", "output": "Paris is the capital."},
    {"instruction": "Add the numbers.", "input": "12 and 30", "output": "The sum is 42."},
    {"instruction": "Sort the words.", "input": "pear, apple", "output": "apple, pear"},
    {"instruction": "Name a colour.", "input": "  ", "output": "Blue."},
    {"instruction": "Say hello.", "output": "Hello there!"},  # no input column at all
]


def documented_prompt(row: dict) -> str:
    extra = (row.get("input") or "").strip()
    if extra:
        return ALPACA_INPUT.format(instruction=row["instruction"], input=row["input"])
    return ALPACA_NO_INPUT.format(instruction=row["instruction"])


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def reference(folder: Path, prompt: str, output: str) -> tuple[list[int], list[int]]:
    """ids and shifted labels from tokenising prompt + output as ONE text (with the
    tokenizer's own post-processing, e.g. BOS), training the output and EOS only: a token
    is the prompt's when its characters end within the prompt (BOS has no characters)."""
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    eos = hf.token_to_id(config["eos_token"])
    encoding = hf.encode(prompt + output)
    ids = [*encoding.ids, eos]
    n = sum(1 for _, end in encoding.offsets if end <= len(prompt))
    assert 0 < n < len(encoding.ids)
    labels = [ids[i + 1] if i + 1 >= n else IGNORE for i in range(len(ids) - 1)] + [IGNORE]
    return ids, labels


def make_sentencepiece_folder(folder: Path) -> Path:
    """A tiny Llama-2-style tokenizer (the ``tokenizer.json`` conversion of a SentencePiece
    model: "▁" prefix-space normaliser, BPE, ``<s>`` added in front) with no chat template."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    texts = corpus() + [documented_prompt(r) + r["output"] for r in ROWS]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["llama3", "qwen2_5", "sentencepiece"])
def folders(request, tmp_path_factory) -> dict[str, Path]:
    """The family's tokenizer with its chat template and without any (a base model)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "sentencepiece":  # a base-model layout only: no chat template
        base = make_sentencepiece_folder(root / "base")
        return {"family": request.param, "chat": base, "base": base}
    return {
        "family": request.param,
        "chat": make_tokenizer_folder(root / "chat", request.param),
        "base": make_tokenizer_folder(root / "base", request.param, chat_template=None),
    }


def test_render_prompt_is_the_published_alpaca_wording():
    assert render_prompt("alpaca", "Do X.", "data") == ALPACA_INPUT.format(
        instruction="Do X.", input="data"
    )
    for empty in (None, "", " \n"):
        assert render_prompt("alpaca", "Do X.", empty) == ALPACA_NO_INPUT.format(
            instruction="Do X."
        )
    assert render_prompt("instruction_response", "Do X.", "data") == (
        "### Instruction:\nDo X.\n\n### Input:\ndata\n\n### Response:\n"
    )
    assert render_prompt("instruction_response", "Do X.") == (
        "### Instruction:\nDo X.\n\n### Response:\n"
    )
    assert render_prompt("alpaca", "Do X.", system="Be brief.") == (
        "Be brief.\n\n" + ALPACA_NO_INPUT.format(instruction="Do X.")
    )


@pytest.mark.parametrize("which", ["chat", "base"])
def test_alpaca_style_equals_tokenising_the_documented_text(folders, which, tmp_path):
    folder = folders[which]
    data = write_rows(tmp_path / "alpaca.jsonl", ROWS)
    # explicit on a chat tokenizer; the default on a base one (no chat template)
    style = {"prompt_style": "alpaca"} if which == "chat" else {}
    ds = SFTDataset(Tokenizer.from_pretrained(folder), source=str(data), format="alpaca", **style)
    assert len(ds) == len(ROWS)
    for row, sample in zip(ROWS, ds.samples, strict=True):
        ids, labels = reference(folder, documented_prompt(row), row["output"])
        assert sample["input_ids"] == ids, row
        assert sample["labels"] == labels, row


def test_instruction_response_style_equals_tokenising_its_text(folders, tmp_path):
    folder = folders["base"]
    data = write_rows(tmp_path / "alpaca.jsonl", ROWS)
    tok = Tokenizer.from_pretrained(folder)
    ds = SFTDataset(tok, source=str(data), format="alpaca", prompt_style="instruction_response")
    for row, sample in zip(ROWS, ds.samples, strict=True):
        extra = (row.get("input") or "").strip()
        prompt = f"### Instruction:\n{row['instruction']}\n\n"
        prompt += f"### Input:\n{row['input']}\n\n" if extra else ""
        prompt += "### Response:\n"
        ids, labels = reference(folder, prompt, row["output"])
        assert sample["input_ids"] == ids
        assert sample["labels"] == labels


def test_train_on_all_trains_the_prompt_too(folders, tmp_path):
    folder = folders["base"]
    data = write_rows(tmp_path / "alpaca.jsonl", ROWS[1:2])
    ds = SFTDataset(
        Tokenizer.from_pretrained(folder), source=str(data), format="alpaca", train_on="all"
    )
    ids, _ = reference(folder, documented_prompt(ROWS[1]), ROWS[1]["output"])
    assert ds.samples[0]["labels"] == [*ids[1:], IGNORE]


@pytest.mark.parametrize("family", ["llama3", "qwen2_5"])
def test_default_style_follows_the_tokenizer(family, tmp_path):
    data = write_rows(tmp_path / "alpaca.jsonl", ROWS)
    chat = Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path / "chat", family))
    base_dir = make_tokenizer_folder(tmp_path / "base", family, chat_template=None)
    base = Tokenizer.from_pretrained(base_dir)
    default_chat = SFTDataset(chat, source=str(data), format="alpaca")
    as_chat = SFTDataset(chat, source=str(data), format="alpaca", prompt_style="chat_template")
    assert default_chat.samples == as_chat.samples
    # the chat template path renders the conversation, not the alpaca text
    conv = Conversation(
        [
            {"role": "user", "content": "Give the capital of France."},
            {"role": "assistant", "content": "Paris is the capital."},
        ]
    )
    chat_ids, _ = chat.tokenize_conversation(conv.messages)
    assert default_chat.samples[0]["input_ids"] == list(chat_ids)
    default_base = SFTDataset(base, source=str(data), format="alpaca")
    as_alpaca = SFTDataset(base, source=str(data), format="alpaca", prompt_style="alpaca")
    assert default_base.samples == as_alpaca.samples
    # other formats still need a chat template on a base tokenizer
    with pytest.raises(ValueError, match="has none"):
        SFTDataset(base, source=str(data), format="alpaca", prompt_style="chat_template")


def test_system_text_is_prepended_and_the_row_wins():
    row = {"instruction": "Do X.", "output": "Done.", "system": "Row system."}
    got = convert_row(row, "alpaca", prompt_style="alpaca", system_prompt="Config system.")
    assert got == PromptCompletion(
        "Row system.\n\n" + ALPACA_NO_INPUT.format(instruction="Do X."), "Done."
    )
    del row["system"]
    got = convert_row(row, "alpaca", prompt_style="instruction_response", system_prompt="Sys.")
    assert got.prompt == "Sys.\n\n### Instruction:\nDo X.\n\n### Response:\n"


def test_system_prompt_reaches_the_tokens(folders, tmp_path):
    folder = folders["base"]
    data = write_rows(tmp_path / "alpaca.jsonl", ROWS[:1])
    ds = SFTDataset(
        Tokenizer.from_pretrained(folder),
        source=str(data),
        format="alpaca",
        system_prompt="You are terse.",
    )
    prompt = "You are terse.\n\n" + documented_prompt(ROWS[0])
    assert ds.samples[0]["input_ids"] == reference(folder, prompt, ROWS[0]["output"])[0]


def test_bad_styles_and_rows_are_named(folders, tmp_path):
    assert PROMPT_STYLES == ("chat_template", "alpaca", "instruction_response")
    row = {"instruction": "Do X.", "output": "Done."}
    with pytest.raises(ValueError, match="'vicuna'"):
        convert_row(row, "alpaca", prompt_style="vicuna")
    with pytest.raises(ValueError, match="format 'alpaca' only"):
        convert_row({"prompt": "a", "completion": "b"}, "prompt_completion", prompt_style="alpaca")
    data = write_rows(tmp_path / "alpaca.jsonl", [*ROWS[:2], {"instruction": "x", "output": " "}])
    tok = Tokenizer.from_pretrained(folders["base"])
    with pytest.raises(ValueError, match="'vicuna'"):
        SFTDataset(tok, source=str(data), format="alpaca", prompt_style="vicuna")
    with pytest.raises(ValueError, match="format 'alpaca' only"):
        SFTDataset(tok, source=str(data), format="text", prompt_style="alpaca")
    ds = SFTDataset(tok, source=str(data), format="alpaca", on_bad_row="skip")
    assert len(ds) == 2
    assert ds.report.skipped == {"empty_assistant_turn": 1}


def test_base_model_trains_on_alpaca_data_with_no_extra_files(tmp_path):
    tok_dir = make_tokenizer_folder(tmp_path / "tokenizer", "qwen2_5", chat_template=None)
    vocab = Tokenizer.from_pretrained(tok_dir).vocab_size
    torch.manual_seed(0)
    model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=vocab))
    model_dir = save_hf_checkpoint(model, tmp_path / "model", source_dir=tok_dir)
    assert not Tokenizer.from_pretrained(model_dir).chat_templates  # a base model folder
    rows = [
        {
            "instruction": f"Add {a} and {b}.",
            "input": "" if a % 2 else f"{a} {b}",
            "output": str(a + b),
        }
        for a, b in zip(range(16), range(5, 21), strict=True)
    ]
    data = write_rows(tmp_path / "alpaca.jsonl", rows)
    out = run_recipe(
        "sft", "tiny", model_dir, data, tmp_path / "out", "max_steps=2", "dataset.format=alpaca"
    )
    metrics = read_metrics(out)
    assert sorted(metrics) == [1, 2]
    assert all(math.isfinite(m["loss"]) for m in metrics.values())
    assert checkpoints(out), "no checkpoint written"


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """A tiny model folder whose tokenizer has no chat template (a base model)."""
    root = tmp_path_factory.mktemp("base_model")
    tok_dir = make_tokenizer_folder(root / "tokenizer", "qwen2_5", chat_template=None)
    vocab = Tokenizer.from_pretrained(tok_dir).vocab_size
    torch.manual_seed(0)
    model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=vocab))
    return save_hf_checkpoint(model, root / "model", source_dir=tok_dir)


def test_base_model_trains_on_raw_prompt_completion_and_preference_data(base_model_dir, tmp_path):
    sums = [(a, b) for a, b in zip(range(12), range(3, 15), strict=True)]
    completions = write_rows(
        tmp_path / "pc.jsonl",
        [{"prompt": f"{a} + {b} =", "completion": f" {a + b}"} for a, b in sums],
    )
    pairs = write_rows(
        tmp_path / "pairs.jsonl",
        [
            {"prompt": f"{a} + {b} =", "chosen": f" {a + b}", "rejected": f" {a + b + 1}"}
            for a, b in sums
        ],
    )
    runs = {
        "sft": ("sft", completions, ["dataset.format=prompt_completion",
                                     "dataset.use_chat_template=false"]),
        "dpo": ("dpo", pairs, ["dataset.format=prompt_chosen_rejected",
                               "dataset.use_chat_template=false", "batch_size=2"]),
    }  # fmt: skip
    for name, (recipe, data, extra) in runs.items():
        out = run_recipe(
            recipe, "tiny", base_model_dir, data, tmp_path / name, "max_steps=2", *extra
        )
        metrics = read_metrics(out)
        assert sorted(metrics) == [1, 2], name
        assert all(math.isfinite(m["loss"]) for m in metrics.values()), name
        assert checkpoints(out), f"{name}: no checkpoint written"
