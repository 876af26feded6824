"""The grpo recipe end to end on a tiny policy: exact resume (also in the middle of a batch's
updates), two FSDP2 ranks == one process, a LoRA policy's reference is itself without its
adapters, the optimizer in backward == the plain step, and the log-prob parity check stops a
run whose sampler and trainer disagree.

Why two ranks see the same rollouts as one process: the prompt stream hands rank r the r-th
half of each step's prompts, and keyed sampling makes each completion depend only on the seed,
the collection round, the prompt and its sample number, never on the batch it is decoded in."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

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
from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl
from tunesmith.recipes import config_path
from tunesmith.rl.source import LogprobMismatchError

STEPS = 4
FAST = [f"max_steps={STEPS}", "optimizer.lr=1e-2", "generation.max_new_tokens=8"]
ROLLOUT_KEYS = ("reward", "reward/digits", "completion_length", "logprob_mismatch_mean")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


def run_grpo(world, name: str, *extra: str, model=None):
    """Run the tiny GRPO config in this process (``model``: another model node)."""
    root, model_dir, prompts = world
    out = root / name
    run_rl("grpo", "tiny", grpo_overrides(model_dir, prompts, out, *FAST, *extra), model=model)
    return out


@pytest.fixture(scope="module")
def uninterrupted(world):
    return run_grpo(world, "uninterrupted", "updates_per_batch=2")


def test_a_run_learns_from_rewards_and_logs_rollouts(world, uninterrupted):
    logged = read_metrics(uninterrupted)
    assert sorted(logged) == list(range(1, STEPS + 1))
    first = logged[1]
    for key in (
        "reward",
        "reward_std",
        "advantage_std",
        "clip_fraction",
        "entropy",
        "logprob_mismatch_max",
        "generate_s",
        "train_s",
        "generated_tokens_per_s",
    ):
        assert key in first, key
    assert first["rollout_samples"] == 4 * 4  # prompts_per_step x group_size
    assert first["advantage_std"] > 0.1  # the dense reward gives every group a signal
    assert first["logprob_mismatch_max"] < 1e-5  # fp32: the trainer sees what the sampler saw
    assert "rollout_samples" not in logged[2]  # updates_per_batch=2: step 2 reuses the batch
    assert logged[2]["ratio"] != 1.0  # ... after step 1 moved the policy
    _, model_dir, _ = world
    assert largest_change(final_weights(uninterrupted), checkpoint_weights(model_dir)) > 1e-3


def test_resume_in_the_middle_of_a_batch_equals_the_uninterrupted_run(world, uninterrupted):
    # step 1 is the first of batch 1's two updates: the batch itself must be in the checkpoint
    out = run_grpo(world, "resumed", "updates_per_batch=2", "stop_after_steps=1")
    run_grpo(world, "resumed", "updates_per_batch=2", "resume=true")
    assert_same_weights(final_weights(out), final_weights(uninterrupted), 0.0)  # bitwise
    one, two = read_metrics(uninterrupted), read_metrics(out)
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm", *ROLLOUT_KEYS):
            assert two[step].get(key) == one[step].get(key), f"{key} at step {step}"


def test_two_fsdp2_ranks_equal_one_process(world, uninterrupted, tmp_path):
    root, model_dir, prompts = world
    single = run_grpo(world, "single")
    with _any_component_allowed():  # inherited by the ranks
        launch_ranks(
            grpo_overrides(model_dir, prompts, tmp_path / "two", *FAST),
            tmp_path,
            recipe="grpo",
            timeout=300,
        )
    one, two = read_metrics(single), read_metrics(tmp_path / "two")
    for step in range(1, STEPS + 1):
        assert two[step]["rollout_samples"] == one[step]["rollout_samples"] == 16
        for key in ("reward", "reward/digits", "completion_length"):  # the same rollouts
            assert two[step][key] == pytest.approx(one[step][key], abs=1e-6), key
        for key in ("loss", "grad_norm", "entropy"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5), key
        assert two[step]["logprob_mismatch_max"] < 1e-5  # sharded sampler == sharded trainer
    weights = final_weights(single)
    assert_same_weights(final_weights(tmp_path / "two"), weights, 1e-5)
    assert largest_change(weights, checkpoint_weights(model_dir)) > 1e-3


def test_optimizer_in_backward_equals_the_plain_step(world):
    common = ["max_grad_norm=null", "batch_size=16"]  # one micro-batch per step
    plain = run_grpo(world, "plain_step", *common)
    fused = run_grpo(world, "in_backward", *common, "optimizer_in_backward=true")
    assert_same_weights(final_weights(fused), final_weights(plain), 1e-6)


def test_optimizer_in_backward_refuses_several_micro_batches(world):
    with pytest.raises(ValueError, match="one micro-batch per step.*set batch_size to 16"):
        run_grpo(
            world,
            "in_backward_refused",
            "max_grad_norm=null",
            "batch_size=8",
            "optimizer_in_backward=true",
        )


def test_lora_policy_reference_is_the_policy_without_adapters(world):
    lora = OmegaConf.load(config_path("tiny_lora", "sft")).model  # ${model_dir}: the run's
    out = run_grpo(world, "lora", "kl.coef=0.1", model=lora)
    logged = read_metrics(out)
    assert logged[1]["kl"] == 0.0  # the adapters start at zero: policy == reference
    assert logged[STEPS]["kl"] > 0.0
    assert (out / "checkpoints" / f"step_{STEPS:06d}" / "adapter_config.json").is_file()


def test_the_parity_check_stops_a_run_whose_sampler_and_trainer_disagree(world):
    # bf16 autocast: the KV-cache decode and the full forward round differently
    with pytest.raises(LogprobMismatchError, match=r"max_logprob_mismatch=1e-06"):
        run_grpo(world, "mismatch", "mixed_precision=bf16", "max_logprob_mismatch=1e-6")


def test_a_step_with_nothing_to_train_on_is_skipped_not_fatal(world, capsys):
    # one new token each and no stop: every completion is cut, and overlong_filter trains none
    out = run_grpo(
        world, "all_cut", "overlong_filter=true", "generation.max_new_tokens=1", "max_steps=2"
    )
    logged = read_metrics(out)
    _, model_dir, _ = world
    assert [logged[s]["skipped_update"] for s in (1, 2)] == [1.0, 1.0]
    assert logged[1]["stopped_fraction"] == 0.0
    assert logged[1]["completion_tokens_in_window"] == 0
    assert "no completion_tokens to train on" in capsys.readouterr().out
    assert largest_change(final_weights(out), checkpoint_weights(model_dir)) == 0.0
