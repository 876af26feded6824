"""``tunesmith demo rl``: its verifier on hand-made replies, its files, a shortened run end to
end (twice: the same seed gives the same run), the CLI, and the full demo (slow)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.demo.test_demo import TOY_MODEL
from tunesmith.cli.main import main as cli_main
from tunesmith.config import ConfigError, instantiate, load_config
from tunesmith.data import Tokenizer
from tunesmith.demo.rl import (
    RLDemoSettings,
    greedy_accuracy,
    plot_rewards,
    run_rl_demo,
    split_overrides,
    write_rl_data,
)
from tunesmith.demo.task import Example, read_jsonl
from tunesmith.models import from_hf
from tunesmith.recipes import config_path
from tunesmith.rl.prompts import Prompt, PromptDataset
from tunesmith.rl.rewards import RewardSet, Sample
from tunesmith.rl.rewards.strings import CharacterMatch, StringMatch, character_match

TOY = RLDemoSettings(
    seed=3, num_demonstrations=16, num_prompts=48, num_held_out=12, model=TOY_MODEL
)
SHORT = [
    "sft.epochs=30",  # 16 demonstrations / batch 16: 30 steps
    "sft.optimizer.lr=1e-2",
    "sft.lr_scheduler.num_warmup_steps=1",
    "max_steps=4",
    "group_size=4",
    "prompts_per_step=4",
    "eval_every_n_steps=2",
    "log_every_n_steps=1",
    "lr_scheduler.num_warmup_steps=1",
    "optimizer.lr=1e-2",
]


# ----------------------------------------------------------------------------- the verifier


def _demo_rewards() -> RewardSet:
    """The rewards exactly as the shipped GRPO config builds them."""
    return instantiate(load_config(config_path("demo", "grpo")).rewards)


def test_the_demo_config_scores_exact_answers_and_partial_credit():
    rewards = _demo_rewards()
    ex = Example("DCA")  # the answer is "ACD"
    replies = {  # reply -> (correct, fraction of right characters), counted by hand
        "ACD": (1.0, 1.0),
        "  ACD\n": (1.0, 1.0),  # whitespace around the reply is not part of it
        "acd": (0.0, 0.0),  # lower case is another string
        "ADC": (0.0, 1 / 3),  # A right; D, C in each other's place
        "DCA": (0.0, 1 / 3),  # the prompt copied back: C in the middle is right
        "AC": (0.0, 2 / 3),  # a letter missing
        "ACDA": (0.0, 3 / 4),  # a letter too many
        "A C D": (0.0, 1 / 5),
        "": (0.0, 0.0),
    }
    samples = [Sample("sort DCA", reply, answer=ex.answer) for reply in replies]
    result = rewards(samples)
    assert result.per_reward["correct"].tolist() == [c for c, _ in replies.values()]
    assert result.per_reward["characters"].tolist() == pytest.approx(
        [f for _, f in replies.values()]
    )
    expected_total = [c + 0.5 * f for c, f in replies.values()]
    assert result.total.tolist() == pytest.approx(expected_total)
    assert result.failures == {"correct": 0, "characters": 0}


def test_string_rewards_on_their_own():
    assert character_match("", "") == 1.0
    assert character_match("ABC", "") == 0.0
    assert character_match("XBC", "ABC") == pytest.approx(2 / 3)
    samples = [
        Sample("", "BA", answer=["AB", "BA"]),  # any listed reference counts
        Sample("", " AB ", answer="AB"),
        Sample("", "AX", answer=["AB", "XY"]),
    ]
    assert StringMatch()(samples) == [1.0, 1.0, 0.0]
    assert StringMatch(strip=False)(samples) == [1.0, 0.0, 0.0]
    assert CharacterMatch()(samples) == [1.0, 1.0, 0.5]
    assert CharacterMatch(strip=False)(samples)[1] == pytest.approx(0.0)  # " AB " vs "AB"
    for bad in (None, 12, []):
        with pytest.raises(ValueError, match="reference"):
            StringMatch().score(Sample("", "AB", answer=bad))
    # in a reward set a sample without a reference scores 0 and is counted, not fatal
    result = RewardSet({"correct": StringMatch()})(
        [Sample("", "AB", answer=None), Sample("", "AB", answer="AB")]
    )
    assert result.per_reward["correct"].tolist() == [0.0, 1.0]
    assert result.failures == {"correct": 1}


# ----------------------------------------------------------------------------- data, overrides


def test_rl_data_splits_the_training_strings(tmp_path):
    data = write_rl_data(tmp_path, TOY)
    train = read_jsonl(data.assets.train_file)
    assert data.demonstrations == train[:16] == read_jsonl(data.demonstrations_file)
    prompts = PromptDataset(data.prompts_file)
    held_out = PromptDataset(data.held_out_file)
    assert len(prompts) == 48 and len(held_out) == 12
    for dataset, examples in ((prompts, train[16:]), (held_out, data.held_out)):
        for prompt, ex in zip(dataset, examples):
            assert prompt.messages == ex.prompt_messages()
            assert prompt.answer == "".join(sorted(ex.letters))
    demo_strings = {ex.letters for ex in data.demonstrations}
    prompt_strings = {ex.letters for ex in train[16:]}
    held_strings = {ex.letters for ex in data.held_out}
    assert not demo_strings & prompt_strings and not held_strings & (demo_strings | prompt_strings)


def test_overrides_go_to_their_run():
    sft, grpo = split_overrides(
        ["sft.epochs=3", "max_steps=9", "grpo.optimizer.lr=1e-3", "~sft.lr_scheduler", "~kl"]
    )
    assert sft == ["epochs=3", "~lr_scheduler"]
    assert grpo == ["max_steps=9", "optimizer.lr=1e-3", "~kl"]
    for own in ("model_dir=x", "grpo.prompts.source=x", "sft.dataset.source=x", "output_dir=y"):
        with pytest.raises(ValueError, match="sets .* itself"):
            split_overrides([own])


def test_demo_refuses_bad_overrides_before_building(tmp_path):
    with pytest.raises(ValueError, match="sft.output_dir=elsewhere"):
        run_rl_demo(tmp_path, settings=TOY, overrides=["sft.output_dir=elsewhere"], verbose=False)
    for bad, where in (("sft.epochz=1", "epochz"), ("max_stepz=3", "max_stepz")):
        with pytest.raises(ConfigError, match=where):  # a misspelt key of either run
            run_rl_demo(tmp_path, settings=TOY, overrides=[bad], verbose=False)
    assert not any(tmp_path.iterdir())


def test_reward_plot_and_its_optional_dependency(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    lines = [{"step": 5, "reward": 0.5, "reward/correct": 0.25},
             {"step": 10, "reward": 0.75, "reward/correct": 0.5, "val_reward/correct": 0.4}]  # fmt: skip
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    png = plot_rewards(tmp_path, start=0.3)
    assert png == tmp_path / "rewards.png" and png.read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "loss_only").mkdir()
    (tmp_path / "loss_only" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="no reward values"):
        plot_rewards(tmp_path / "loss_only")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install"):
        plot_rewards(tmp_path)


# ----------------------------------------------------------------------------- end to end


def _correct(replies: list[str], examples: list[Example]) -> float:
    """Held-out accuracy counted here, independently of the rewards."""
    return sum(r.strip() == "".join(sorted(ex.letters)) for r, ex in zip(replies, examples)) / len(
        examples
    )


def _characters(replies: list[str], examples: list[Example]) -> float:
    """Mean fraction of right characters, counted here: position by position."""
    total = 0.0
    for reply, ex in zip(replies, examples):
        reply, answer = reply.strip(), "".join(sorted(ex.letters))
        same = sum(1 for i in range(min(len(reply), len(answer))) if reply[i] == answer[i])
        total += same / max(len(reply), len(answer))
    return total / len(examples)


def test_greedy_accuracy_scores_the_replies(tmp_path):
    """A model made to answer "A" forever: 10 A's (the limit) is right for one prompt only."""
    data = write_rl_data(tmp_path, TOY)
    tokenizer = Tokenizer.from_pretrained(data.assets.model_dir)
    model = from_hf(data.assets.model_dir)
    assert model.spec.tie_word_embeddings
    with torch.no_grad():
        for layer in model.model.layers:  # no attention or MLP output: the stream is the
            layer.self_attn.o_proj.weight.zero_()  # last token's embedding
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        embed.zero_()
        embed[:, 0] = 1.0  # every token points the same way; "A" twice as far: after the
        embed[tokenizer.token_to_id("A"), 0] = 2.0  # norm, the tied head always picks "A"
    prompts = [Prompt(0, Example("CBA").prompt_messages(), answer="A" * 10),
               Prompt(1, Example("CBA").prompt_messages(), answer="ABC")]  # fmt: skip
    accuracy, replies = greedy_accuracy(
        model, tokenizer, prompts, _demo_rewards(), max_new_tokens=10
    )
    assert replies == ["A" * 10, "A" * 10]
    assert accuracy == 0.5
    with pytest.raises(ValueError, match="no reward 'exact'"):
        greedy_accuracy(
            model, tokenizer, prompts, _demo_rewards(), max_new_tokens=10, reward="exact"
        )


def test_short_rl_demo_end_to_end(tmp_path, capsys):
    result = run_rl_demo(tmp_path / "a", settings=TOY, overrides=SHORT, threads=1)
    out = capsys.readouterr().out
    root = tmp_path / "a"

    # both runs went through the recipes and wrote their checkpoints
    assert result.warmup_checkpoint == root / "sft" / "checkpoints" / "step_000030"
    assert result.checkpoint == root / "grpo" / "checkpoints" / "step_000004"
    assert from_hf(result.checkpoint).spec == from_hf(result.warmup_checkpoint).spec

    # the accuracies are the exact verdicts on the greedy replies that were generated
    held_out = read_jsonl(root / "data" / "held_out.jsonl")
    assert result.held_out == held_out
    assert len(result.replies_before) == len(result.replies_after) == 12
    assert result.accuracy_before == _correct(result.replies_before, held_out)
    assert result.accuracy_after == _correct(result.replies_after, held_out)

    # the GRPO run logged rewards every step and held-out accuracy every 2 steps; the recipe's
    # own evaluation of the final policy agrees with the demo's
    records = [json.loads(line) for line in (root / "grpo" / "metrics.jsonl").open()]
    assert [r["step"] for r in records if "reward/correct" in r] == [1, 2, 3, 4]
    held = [(r["step"], r["val_reward/correct"]) for r in records if "val_reward/correct" in r]
    assert [s for s, _ in held] == [2, 4]
    assert held[-1][1] == pytest.approx(result.accuracy_after)
    # ... on the very replies the demo returns: their partial credit, counted here, is the
    # recipe's (and not zero, so the comparison can fail)
    final = records[-1]
    assert final["step"] == 4
    characters = _characters(result.replies_after, held_out)
    assert characters > 0
    assert final["val_reward/characters"] == pytest.approx(characters)
    assert result.curve == [(0, result.accuracy_before), *held]
    assert result.plot == root / "grpo" / "rewards.png"
    assert result.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    line = f"{result.accuracy_before:.1%} after SFT -> {result.accuracy_after:.1%} after GRPO"
    assert line in out
    assert str(result.checkpoint) in out and str(result.plot) in out

    # the same seed gives the same run: replies, numbers and weights
    again = run_rl_demo(tmp_path / "b", settings=TOY, overrides=SHORT, threads=1, verbose=False)
    assert again.replies_before == result.replies_before
    assert again.replies_after == result.replies_after
    assert again.curve == result.curve
    first, second = from_hf(result.checkpoint).state_dict(), from_hf(again.checkpoint).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_cli_demo_rl_command(tmp_path, capsys):
    """``tunesmith demo rl`` with the default task and model, trained for a few steps only."""
    args = ["demo", "rl", "--output-dir", str(tmp_path), "--threads", "1", "--seed", "1"]
    overrides = ["sft.epochs=1", "sft.lr_scheduler.num_warmup_steps=1", "max_steps=2",
                 "lr_scheduler.num_warmup_steps=1", "eval_every_n_steps=2"]  # fmt: skip
    assert cli_main([*args, *overrides]) == 0
    out = capsys.readouterr().out
    assert "96 demonstrations (SFT), 3904 prompts with a verifier (RL), 200 held-out" in out
    assert "after SFT ->" in out and "after GRPO" in out
    assert (tmp_path / "grpo" / "checkpoints" / "step_000002").is_dir()
    assert (tmp_path / "sft" / "checkpoints" / "step_000006").is_dir()
    assert json.loads((tmp_path / "manifest.json").read_text())["seed"] == 1
    config = (tmp_path / "grpo" / "config.yaml").read_text()
    assert "seed: 1" in config


def test_cli_demo_kind_chooses_the_demo(tmp_path, capsys):
    """``demo sft`` is the SFT demo, ``demo rl`` the RL one (each refuses its own way)."""
    assert cli_main(["demo", "sft", "--output-dir", str(tmp_path), "output_dir=x"]) == 1
    assert "the demo sets model_dir, dataset.source, output_dir itself" in capsys.readouterr().err
    assert cli_main(["demo", "rl", "--output-dir", str(tmp_path), "output_dir=x"]) == 1
    assert "of its GRPO run itself" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_rl_demo_gains_twenty_points(tmp_path, seed):
    """The real demo (two to three minutes on one core): SFT fits its 96 demonstrations but
    leaves held-out accuracy low; GRPO adds at least 20 points."""
    result = run_rl_demo(tmp_path, settings=RLDemoSettings(seed=seed), threads=1, verbose=False)
    assert result.accuracy_demonstrations >= 0.95
    assert 0.1 <= result.accuracy_before <= 0.5
    assert result.accuracy_after >= result.accuracy_before + 0.2
