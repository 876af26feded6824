"""The demo end to end at toy size, and its task, scorer and tokenizer on hand-made cases."""

from __future__ import annotations

import json

import pytest
import torch

from tunesmith.cli.main import main as cli_main
from tunesmith.data import Tokenizer
from tunesmith.demo.assets import AssetSettings, DemoAssets, make_assets
from tunesmith.demo.run import run_demo
from tunesmith.demo.task import (
    ALPHABET,
    Example,
    accuracy,
    make_splits,
    read_jsonl,
    score,
    write_jsonl,
)
from tunesmith.models import from_hf
from tunesmith.models.safetensors_io import find_weight_files

TOY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
}
TOY = AssetSettings(num_train=48, num_held_out=12, seed=3, model=TOY_MODEL)
SHORT = [
    "max_steps=6",
    "batch_size=8",
    "log_every_n_steps=3",
    "optimizer.lr=1e-2",
    "lr_scheduler.num_warmup_steps=1",
]


# ----------------------------------------------------------------------------- task and scorer


def test_answer_is_the_sorted_string():
    assert Example("QZXAB").answer == "ABQXZ"
    assert Example("A").answer == "A"


def test_score_on_hand_made_replies():
    ex = Example("DCA")
    assert score("ACD", ex)
    assert score("  ACD\n", ex)  # surrounding whitespace is not an error
    assert not score("DCA", ex)  # the prompt copied back
    assert not score("AC", ex)
    assert not score("ACDA", ex)
    assert not score("acd", ex)
    assert not score("A C D", ex)
    assert not score("", ex)


def test_accuracy_counts_correct_replies():
    examples = [Example("BA"), Example("CAB"), Example("ZY"), Example("MN")]
    assert accuracy(["AB", "ABC", "YZ", "NM"], examples) == 0.75
    assert accuracy(["", "", "", ""], examples) == 0.0
    with pytest.raises(ValueError, match="3 replies for 4 examples"):
        accuracy(["AB", "ABC", "YZ"], examples)
    with pytest.raises(ValueError, match="no examples"):
        accuracy([], [])


def test_splits_are_disjoint_and_repeatable():
    train, held_out = make_splits(300, 100, seed=7)
    assert len(train) == 300 and len(held_out) == 100
    strings = [ex.letters for ex in train + held_out]
    assert len(set(strings)) == 400  # no string twice, none in both splits
    for s in strings:
        assert 3 <= len(s) <= 8
        assert len(set(s)) == len(s)  # distinct letters
        assert set(s) <= set(ALPHABET)
    assert make_splits(300, 100, seed=7) == (train, held_out)
    assert make_splits(300, 100, seed=8) != (train, held_out)
    with pytest.raises(ValueError, match="only 26 exist"):
        make_splits(20, 10, min_len=1, max_len=1)


def test_jsonl_round_trip(tmp_path):
    examples = [Example("KJH"), Example("ZA")]
    path = write_jsonl(examples, tmp_path / "d.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1]["messages"] == [
        {"role": "system", "content": "sort the letters"},
        {"role": "user", "content": "sort ZA"},
        {"role": "assistant", "content": "AZ"},
    ]
    assert read_jsonl(path) == examples
    (tmp_path / "bad.jsonl").write_text('{"messages": [{"role": "system"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_jsonl(tmp_path / "bad.jsonl")


# ----------------------------------------------------------------------------- assets


@pytest.fixture(scope="module")
def toy_assets(tmp_path_factory) -> DemoAssets:
    return make_assets(tmp_path_factory.mktemp("demo"), TOY)


def test_tokenizer_gives_each_capital_letter_its_own_token(toy_assets):
    tok = Tokenizer.from_pretrained(toy_assets.model_dir)
    ex = Example("QWERTY")
    ids, mask = tok.tokenize_conversation(ex.messages())
    trained = [tok.decode([i]) for i, m in zip(ids, mask) if m]
    assert trained == ["E", "Q", "R", "T", "W", "Y", "<|im_end|>"]
    for letter in ALPHABET:
        assert len(tok.encode(letter, add_special_tokens=False)) == 1
    # chat words of the template are merged, so a sample stays short
    assert len(tok.encode("assistant", add_special_tokens=False)) == 1
    assert tok.eos_id == tok.token_to_id("<|im_end|>")


def test_tokenizer_folder_matches_transformers(toy_assets):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_pretrained(toy_assets.model_dir)
    theirs = AutoTokenizer.from_pretrained(toy_assets.model_dir)
    messages = Example("MKZBA").messages()
    expected = theirs.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ours.tokenize_conversation(messages)[0] == list(expected)


def test_assets_are_reused_with_the_same_settings(toy_assets):
    weights = find_weight_files(toy_assets.model_dir)[0][0]
    stamp = weights.stat().st_mtime_ns
    assert make_assets(toy_assets.root, TOY) == toy_assets
    assert weights.stat().st_mtime_ns == stamp
    base = from_hf(toy_assets.model_dir)
    assert base.spec.hidden_size == 32 and base.spec.num_hidden_layers == 1


# ----------------------------------------------------------------------------- end to end


def test_short_demo_end_to_end(tmp_path, capsys):
    result = run_demo(tmp_path, settings=TOY, overrides=SHORT, threads=1)
    out = capsys.readouterr().out

    assets = DemoAssets.under(tmp_path)
    for path in (assets.train_file, assets.held_out_file, assets.tokenizer_dir / "tokenizer.json"):
        assert path.is_file(), path
    assert len(read_jsonl(assets.train_file)) == 48

    # the checkpoint is a HF folder of the trained model: it loads, and differs from the base
    assert result.checkpoint.name == "step_000006"
    tuned, base = from_hf(result.checkpoint), from_hf(assets.model_dir)
    assert tuned.spec == base.spec
    changed = [
        name
        for (name, a), (_, b) in zip(tuned.state_dict().items(), base.state_dict().items())
        if not torch.equal(a, b)
    ]
    assert "model.embed_tokens.weight" in changed

    # the accuracies are the scorer's verdicts on the replies that were generated
    held_out = read_jsonl(assets.held_out_file)
    assert result.held_out == held_out
    assert len(result.replies_before) == len(result.replies_after) == 12
    for acc, replies in (
        (result.accuracy_before, result.replies_before),
        (result.accuracy_after, result.replies_after),
    ):
        assert acc == sum(score(r, ex) for r, ex in zip(replies, held_out)) / 12

    # training ran through the sft recipe: it logged a falling loss and the plot was drawn
    records = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [r["step"] for r in records if "loss" in r] == [3, 6]
    assert losses[-1] < losses[0]
    assert result.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert f"{result.accuracy_before:.1%} before -> {result.accuracy_after:.1%} after" in out
    assert str(result.checkpoint) in out and str(result.plot) in out


def test_demo_refuses_overrides_of_its_own_paths(tmp_path):
    with pytest.raises(ValueError, match="output_dir=elsewhere"):
        run_demo(tmp_path, settings=TOY, overrides=["output_dir=elsewhere"], verbose=False)
    assert not any(tmp_path.iterdir())  # refused before building anything


def test_cli_demo_command(tmp_path, capsys):
    """``tunesmith demo`` with the default task and model, trained for two steps only."""
    args = ["demo", "--output-dir", str(tmp_path), "--threads", "1", "--seed", "1"]
    overrides = ["max_steps=2", "batch_size=4", "lr_scheduler.num_warmup_steps=1"]
    assert cli_main([*args, *overrides]) == 0
    out = capsys.readouterr().out
    assert "randomly initialised tiny Qwen2.5-style model built by tunesmith" in out
    assert "held-out accuracy (200 prompts never seen in training)" in out
    checkpoint = tmp_path / "sft" / "checkpoints" / "step_000002"
    assert f"checkpoint (Hugging Face folder): {checkpoint}" in out
    assert (tmp_path / "sft" / "loss.png").is_file()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["seed"] == 1 and manifest["num_train"] == AssetSettings().num_train


@pytest.mark.slow
def test_full_demo_learns_the_task(tmp_path):
    """The real demo (about a minute on one core): from chance to nearly always right."""
    result = run_demo(tmp_path, threads=1, verbose=False)
    assert result.accuracy_before <= 0.05
    assert result.accuracy_after >= 0.9
