"""Multi-turn GRPO through the recipes (``environment:``), on a tiny policy and a feedback
environment whose trajectories take 1 to 3 turns depending on the prompt
(``tests.rl.envs_world.TurnsByAnswer``):

- two FSDP2 ranks == one process: the ranks' trajectories need different numbers of turns, so
  a rank whose trajectories are over must keep decoding with the other (a missing turn would
  hang the sharded forward), and the rollouts, losses and weights equal one process's;
- ``grpo_async`` in ``sync`` mode (Ray rollout and reward workers running the environment)
  == the synchronous recipe, bitwise;
- a rollout worker SIGKILLed between the turns of its trajectories (a slow tool) loses and
  duplicates nothing: its prompts are sampled again with the same keys, and the run ends with
  the weights of the run where nothing died (slow).
"""

from __future__ import annotations

import json

import pytest
import ray

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
from tests.rl.envs_world import SLOW_TURNS_ENV, TURNS_ENV
from tests.rl.rl_world import grpo_overrides, local_ray, run_killing_the_rollout_worker, run_rl

STEPS = 3
FAST = [
    f"max_steps={STEPS}",
    # SGD: Adam's normalised step would turn the sharded sums' rounding of a near-zero
    # gradient into a whole step of one weight (seen: 3e-4), hiding what the test compares
    "optimizer._component_=torch.optim.SGD",
    "optimizer.lr=0.5",
    "optimizer.fused=false",  # DTensor has no fused SGD
    "generation.max_new_tokens=6",
    f"environment._component_={TURNS_ENV}",
    "episode.max_turns=4",
    "shuffle=false",
]
ROLLOUT_KEYS = ("reward", "reward/digits", "reward/last_digits", "completion_length", "env/turns")


def uneven_prompts(path, steps: int = STEPS):
    """Prompts in steps of 4 (``shuffle=false``): rank 0 of 2 gets each step's first two
    (answers 3 and 6: one turn), rank 1 the last two (5 and 8: three turns), so rank 0's
    trajectories are over two turns before rank 1's."""
    rows = [(1, 2), (2, 4), (2, 3), (4, 4)] * steps
    path.write_text("".join(
        json.dumps({"prompt": f"add {a} and {b}", "answer": str(a + b)}) + "\n" for a, b in rows
    ))  # fmt: skip
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    return root, make_model_dir(root), uneven_prompts(root / "prompts.jsonl")


@pytest.fixture(scope="module")
def single(world):
    root, model_dir, prompts = world
    out = root / "single"
    run_rl("grpo", "tiny", grpo_overrides(model_dir, prompts, out, *FAST))
    return out


def test_two_fsdp2_ranks_with_uneven_turns_equal_one_process(world, single, tmp_path):
    _, model_dir, prompts = world
    with _any_component_allowed():  # inherited by the ranks
        launch_ranks(
            grpo_overrides(model_dir, prompts, tmp_path / "two", *FAST),
            tmp_path,
            recipe="grpo",
            timeout=300,
        )
    one, two = read_metrics(single), read_metrics(tmp_path / "two")
    assert {one[step]["env/turns"] for step in one} == {2.0}  # half 1 turn, half 3
    for step in range(1, STEPS + 1):
        for key in ROLLOUT_KEYS:  # the same rollouts
            assert two[step][key] == pytest.approx(one[step][key], abs=1e-6), (step, key)
        for key in ("loss", "grad_norm", "entropy"):  # (a GRPO loss can be ~1e-8)
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-7), key
        assert two[step]["logprob_mismatch_max"] < 1e-5
    weights = final_weights(single)
    assert_same_weights(final_weights(tmp_path / "two"), weights, 1e-5)
    assert largest_change(weights, checkpoint_weights(model_dir)) > 1e-3  # it trained


@pytest.fixture(scope="module")
def ray_instance():
    """A Ray instance for the module's asynchronous runs (they join it)."""
    with local_ray():
        yield ray.get_runtime_context().gcs_address


@pytest.fixture(scope="module")
def async_sync(world, ray_instance):
    root, model_dir, prompts = world
    out = root / "async"
    run_rl("grpo_async", "tiny", grpo_overrides(model_dir, prompts, out, *FAST, "async_mode=sync"))
    return out


def test_async_sync_mode_equals_the_synchronous_recipe(single, async_sync):
    out = async_sync
    assert_same_weights(final_weights(out), final_weights(single), atol=0.0)
    ours, theirs = read_metrics(out), read_metrics(single)
    for step in range(1, STEPS + 1):
        for key in ("reward", "completion_length", "loss", "env/turns", "env/policy_tokens"):
            assert ours[step][key] == theirs[step][key], (step, key)


@pytest.mark.slow  # the single-turn case (test_grpo_async) runs by default: same requeue path
def test_a_rollout_worker_killed_mid_trajectory_loses_and_duplicates_nothing(
    world, async_sync, ray_instance, tmp_path
):
    _, model_dir, prompts = world
    out, log = tmp_path / "killed", tmp_path / "run.log"
    overrides = [*grpo_overrides(model_dir, prompts, out, *FAST), "async_mode=sync",
                 f"environment._component_={SLOW_TURNS_ENV}", f"ray.address={ray_instance}"]  # fmt: skip
    # 0.3 s after step 1: past the first turn's tool step of batch 2's trajectories
    run_killing_the_rollout_worker(overrides, log, delay_s=0.3)
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))  # every update made
    assert metrics[STEPS]["worker_restarts"] >= 1 and metrics[STEPS]["requeued_groups"] >= 1
    used = [tuple(g[:2]) for r in _rollouts(out) for g in r["groups"]]
    assert used == [tuple(g[:2]) for r in _rollouts(async_sync) for g in r["groups"]]
    assert_same_weights(final_weights(out), final_weights(async_sync), atol=0.0)


def _rollouts(out):
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
