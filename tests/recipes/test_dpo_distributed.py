"""DPO under FSDP2 on two CPU ranks (gloo) == one process: same logged losses and rewards, same
exported weights; the frozen reference copy is sharded like the policy, and precomputed
reference log-probs are gathered from both ranks into one table.

Why the runs see the same pairs: the DistributedSampler draws one permutation per epoch from the
seed alone and hands rank r ``perm[r::2]``, so with a per-rank batch of B step k's batches on
the two ranks are exactly the single process's step-k batch of 2B (see
``test_sft_distributed``). The 'add' pairs have responses of different lengths, so the ranks'
token counts differ; the loss is a mean over pairs of all ranks.
"""

from __future__ import annotations

import pytest

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    final_weights,
    largest_change,
    launch_ranks,
    make_model_dir,
    read_eval_metrics,
    read_metrics,
    recipe_overrides,
    run_recipe,
)

PER_RANK, STEPS = 2, 3
COMMON = [f"max_steps={STEPS}", "optimizer.lr=1e-3"]
VAL = "val_fraction=0.2"  # 26 pairs: 21 train, 5 val (neither splits evenly over 2 ranks)
PRECOMPUTE = ["precompute_reference=true", VAL]
# CPO on the dpo recipe: no reference model, an SFT term on the chosen response
CPO = ["loss._component_=tunesmith.modules.losses.CPOLoss", "~loss.reference_free"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_fsdp")
    model_dir = make_model_dir(root)
    data = make_preference_data(root / "add.jsonl", rows=26, seed=0, task="add")
    return root, model_dir, data


def _single(world, name: str, *extra: str, config: str = "tiny"):
    """The single-process run ``name`` (run once per module: two tests compare with it)."""
    root, model_dir, data = world
    if (root / name / "checkpoints").is_dir():
        return root / name
    return run_recipe(
        "dpo", config, model_dir, data, root / name, f"batch_size={2 * PER_RANK}", *COMMON, *extra
    )


@pytest.fixture(scope="module")
def single_live(world):
    """The one-process run (reference log-probs on the fly) that the precompute runs match."""
    return _single(world, "single_live", VAL)


def _check_same_as_single(model_dir, single, distributed, ranks: int = 2) -> None:
    assert [p.name for p in checkpoints(distributed)] == [f"step_{STEPS:06d}"]
    state = checkpoints(distributed)[-1] / "training_state"
    assert sorted(p.name for p in state.glob("rank*.pt")) == [f"rank{r}.pt" for r in range(ranks)]
    logged_1, logged_2 = read_metrics(single), read_metrics(distributed)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, STEPS + 1))
    for step in logged_1:
        one, two = logged_1[step], logged_2[step]
        assert one["pairs_in_window"] == two["pairs_in_window"] == 2 * PER_RANK
        assert one["tokens_seen"] == two["tokens_seen"]
        assert ("nll_loss" in one) == ("nll_loss" in two)  # CPO's SFT term
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected", "nll_loss"):
            if key in one:
                assert two[key] == pytest.approx(one[key], rel=1e-5), f"{key} at step {step}"
        for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracy"):
            assert two[key] == pytest.approx(one[key], abs=1e-5), f"{key} at step {step}"
    assert abs(logged_1[STEPS]["rewards/margin"]) > 1e-4  # the reference matters by then
    weights_1 = final_weights(single)
    assert_same_weights(final_weights(distributed), weights_1, 1e-5)
    lora_b = [w.abs().max().item() for n, w in weights_1.items() if ".lora_B." in n]
    if lora_b:  # an adapter: every lora_B (zero at the start) moved
        assert min(lora_b) > 1e-4
    else:
        assert largest_change(weights_1, checkpoint_weights(model_dir)) > 1e-3


@pytest.mark.parametrize(
    ("config", "loss"),
    [
        pytest.param("tiny", [], id="tiny-dpo"),
        # slow: tiny-dpo proves full FSDP2, tiny_lora-cpo the CPO loss on the recipe
        pytest.param("tiny", CPO, id="tiny-cpo", marks=pytest.mark.slow),
        pytest.param("tiny_lora", CPO, id="tiny_lora-cpo"),
    ],
)
def test_two_gloo_ranks_equal_one_process(world, tmp_path, config, loss):
    """DPO (a frozen reference, sharded like the policy) and CPO (none, an SFT term on the
    chosen response), full fine-tuning and LoRA."""
    _, model_dir, data = world
    single = _single(world, "single" + ("_cpo" if loss else "") + config[4:], *loss, config=config)
    out = tmp_path / "fsdp"
    overrides = recipe_overrides(model_dir, data, out, f"batch_size={PER_RANK}", *COMMON, *loss)
    launch_ranks(overrides, tmp_path, recipe="dpo", config=config)
    _check_same_as_single(model_dir, single, out)


def test_precomputed_reference_on_two_ranks_equals_one_process(world, single_live, tmp_path):
    """21 training pairs do not split evenly over 2 ranks: the precompute pass pads one rank
    with a repeat, and the gathered table must still give every pair its own log-probs. The
    5 validation pairs do not either: evaluation must count each exactly once."""
    _, model_dir, data = world
    single = single_live
    out = tmp_path / "fsdp"
    overrides = recipe_overrides(
        model_dir, data, out, f"batch_size={PER_RANK}", *COMMON, *PRECOMPUTE
    )
    launch_ranks(overrides, tmp_path, recipe="dpo")
    assert "precomputing the reference" in (tmp_path / "rank0.log").read_text()
    _check_same_as_single(model_dir, single, out)
    val_1, val_2 = read_eval_metrics(single)[STEPS], read_eval_metrics(out)[STEPS]
    keys = ("val_loss", "val_rewards/chosen", "val_rewards/margin", "val_rewards/accuracy",
            "val_logps/chosen")  # fmt: skip
    for key in keys:
        assert val_2[key] == pytest.approx(val_1[key], rel=1e-5, abs=1e-6), key


def test_hsdp_precomputed_reference_on_four_ranks_equals_one_process(world, single_live, tmp_path):
    """``parallelism: {dp_replicate: 2, dp_shard: 2}``: the policy and the frozen reference
    are HSDP-sharded, the reference precompute splits the pairs over the 4 data-parallel
    ranks (21 and 5 pairs: padded) and gathers them over the dp group."""
    _, model_dir, data = world
    single = single_live
    out = tmp_path / "hsdp"
    overrides = recipe_overrides(
        model_dir,
        data,
        out,
        f"batch_size={2 * PER_RANK // 4}",
        *COMMON,
        *PRECOMPUTE,
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=2",
    )
    launch_ranks(overrides, tmp_path, recipe="dpo", world_size=4, timeout=240)
    assert "precomputing the reference" in (tmp_path / "rank0.log").read_text()
    _check_same_as_single(model_dir, single, out, ranks=4)
    val_1, val_2 = read_eval_metrics(single)[STEPS], read_eval_metrics(out)[STEPS]
    for key in ("val_loss", "val_rewards/margin", "val_rewards/accuracy", "val_logps/chosen"):
        assert val_2[key] == pytest.approx(val_1[key], rel=1e-5, abs=1e-6), key
