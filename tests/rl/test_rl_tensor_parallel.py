"""The RL recipes under tensor parallel: ``parallelism.tp=2`` on two gloo ranks == one process.

Why the runs agree: the prompt stream splits each step's prompts over the *data-parallel*
ranks (one here: both tp ranks get every prompt), keyed sampling makes each completion a
function of (seed, round, prompt, sample number), and ``generate`` has the ranks of a tp group
take the first rank's tokens; the body's hidden states and ``lm_head``'s logits are the same on
every tp rank, so both ranks score the same completions and compute the single process's
rewards, advantages, loss and (sharded) gradients. Rows end at different steps (a stop
string), held-out rewards are decoded greedily on the tp ranks too.

The optimizer is SGD, not AdamW: Adam turns rounding noise on gradients that are 0 in exact
arithmetic (``k_proj``'s bias: softmax ignores a shift shared by every key) into updates of
the learning rate's size, which would drown a 1e-5 comparison of the weights.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.recipes.sft_world import (
    _any_component_allowed,
    assert_same_weights,
    checkpoint_weights,
    final_weights,
    largest_change,
    launch_ranks,
    make_model_dir,
    read_metrics,
)
from tests.rl.rl_world import make_prompts, run_rl
from tunesmith.rl.rewards import Sample

STEPS = 2
ROLLOUT_KEYS = ("rollout_samples", "reward", "reward/chars", "reward_std", "completion_length",
                "stopped_fraction", "advantage_std")  # fmt: skip


class CompletionChars:
    """A dense test reward: the completion's length in characters / 32 (every group's
    completions differ in length, so every step has a gradient)."""

    name = "chars"

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [len(s.completion) / 32 for s in samples]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_tp")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


def _overrides(world, out: Path, *extra: str) -> list[str]:
    _, model_dir, prompts = world
    val = (
        f"{{_component_: tunesmith.rl.prompts.PromptDataset, source: {prompts}, "
        "prompt_column: prompt, answer_column: answer}"
    )
    return [
        f"model_dir={model_dir}", f"prompts.source={prompts}", f"output_dir={out}",
        f"rewards.rewards={{chars: {{_component_: {__name__}.CompletionChars}}}}",
        "progress_bar=false", f"max_steps={STEPS}", "generation.max_new_tokens=8",
        "generation.stop_strings=[a]", "optimizer._component_=torch.optim.SGD", "~optimizer.fused",
        "optimizer.lr=0.1", f"val_prompts={val}", f"eval_every_n_steps={STEPS}", *extra,
    ]  # fmt: skip


def _run_single(world, recipe: str, out: Path, *extra: str) -> Path:
    run_rl(recipe, "tiny", _overrides(world, out, *extra))
    return out


def _run_ranks(world, recipe: str, out: Path, log_dir: Path, *extra: str, ranks: int = 2) -> Path:
    with _any_component_allowed():  # inherited by the ranks
        launch_ranks(
            _overrides(world, out, *extra), log_dir, recipe=recipe, world_size=ranks, timeout=300
        )
    return out


def _held_out(out: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if "val_reward" in r]
    return {k: v for k, v in record.items() if k.startswith("val_reward")}


def _check_same_run(one_dir: Path, two_dir: Path, train_keys: Sequence[str]) -> None:
    one, two = read_metrics(one_dir), read_metrics(two_dir)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        for key in ROLLOUT_KEYS:  # the same completions, rewards and advantages
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-6, abs=1e-9), key
        assert 0 < one[step]["stopped_fraction"] < 1  # rows end at different steps
        assert one[step]["advantage_std"] > 0.1  # every step has a gradient
        for key in train_keys:
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), key
        assert two[step]["logprob_mismatch_max"] < 1e-5  # sharded sampler == sharded trainer
    held_out = _held_out(one_dir)
    assert sorted(held_out) == ["val_reward", "val_reward/chars"]
    for key, value in held_out.items():
        assert _held_out(two_dir)[key] == pytest.approx(value, rel=1e-6), key


def test_grpo_tp2_equals_one_process(world, tmp_path):
    single = _run_single(world, "grpo", tmp_path / "one")
    tp = _run_ranks(world, "grpo", tmp_path / "tp", tmp_path, "parallelism.tp=2")
    assert "('dp_shard', 'tp') mesh of (1, 2) ranks" in (tmp_path / "rank0.log").read_text()
    _check_same_run(single, tp, ("loss", "grad_norm", "entropy"))
    weights = final_weights(single)
    assert_same_weights(final_weights(tp), weights, 1e-5)
    _, model_dir, _ = world
    assert largest_change(weights, checkpoint_weights(model_dir)) > 1e-3


@pytest.mark.slow
def test_ppo_tp2_without_sequence_parallel_equals_one_process(world, tmp_path):
    extra = ("group_size=4", "prompts_per_step=4", "batch_size=8", "kl_coef=0.1")
    single = _run_single(world, "ppo", tmp_path / "one", *extra)
    tp = _run_ranks(
        world,
        "ppo",
        tmp_path / "tp",
        tmp_path,
        *extra,
        "parallelism.tp=2",
        "parallelism.sequence_parallel=false",
    )
    _check_same_run(single, tp, ("grad_norm", "critic/loss", "values", "returns"))
    step = f"step_{STEPS:06d}"
    for sub in ("checkpoints", "critic/checkpoints"):  # the policy and the critic
        weights = checkpoint_weights(single / sub / step)
        assert_same_weights(checkpoint_weights(tp / sub / step), weights, 1e-5)


@pytest.mark.slow
def test_grpo_tp2_times_dp_shard2_on_four_ranks_equals_one_process(world, tmp_path):
    single = _run_single(world, "grpo", tmp_path / "one")
    tp = _run_ranks(
        world,
        "grpo",
        tmp_path / "tp",
        tmp_path,
        "parallelism.tp=2",
        "parallelism.dp_shard=2",
        ranks=4,
    )
    assert "('dp_shard', 'tp') mesh of (2, 2) ranks" in (tmp_path / "rank0.log").read_text()
    _check_same_run(single, tp, ("loss", "grad_norm", "entropy"))
    assert_same_weights(final_weights(tp), final_weights(single), 1e-5)
