"""Multi-turn GRPO through the recipes (``environment:``), on a tiny policy and a feedback
environment whose trajectories take 1 to 3 turns depending on the prompt
(``tests.rl.envs_world.TurnsByAnswer``):

- two FSDP2 ranks == one process: the ranks' trajectories need different numbers of turns, so
  a rank whose trajectories are over must keep decoding with the other (a missing turn would
  hang the sharded forward), and the rollouts, losses and weights equal one process's;
- ``grpo_async`` in ``sync`` mode (Ray rollout and reward workers running the environment)
  == the synchronous recipe, bitwise.
"""

from __future__ import annotations

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
from tests.rl.envs_world import TURNS_ENV
from tests.rl.rl_world import grpo_overrides, local_ray, make_prompts, run_rl

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
]
ROLLOUT_KEYS = ("reward", "reward/digits", "reward/last_digits", "completion_length", "env/turns")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


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
    turns = {one[step]["env/turns"] for step in one}
    assert len(turns) > 1 or 1.0 < turns.pop() < 3.0  # the steps mix 1-, 2- and 3-turn rows
    for step in range(1, STEPS + 1):
        for key in ROLLOUT_KEYS:  # the same rollouts
            assert two[step][key] == pytest.approx(one[step][key], abs=1e-6), (step, key)
        for key in ("loss", "grad_norm", "entropy"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)
        assert two[step]["logprob_mismatch_max"] < 1e-5
    weights = final_weights(single)
    assert_same_weights(final_weights(tmp_path / "two"), weights, 1e-5)
    assert largest_change(weights, checkpoint_weights(model_dir)) > 1e-3  # it trained


def test_async_sync_mode_equals_the_synchronous_recipe(world, single):
    root, model_dir, prompts = world
    out = root / "async"
    with local_ray():
        run_rl(
            "grpo_async",
            "tiny",
            grpo_overrides(model_dir, prompts, out, *FAST, "async_mode=sync"),
        )
    assert_same_weights(final_weights(out), final_weights(single), atol=0.0)
    ours, theirs = read_metrics(out), read_metrics(single)
    for step in range(1, STEPS + 1):
        for key in ("reward", "completion_length", "loss", "env/turns", "env/policy_tokens"):
            assert ours[step][key] == theirs[step][key], (step, key)
