"""KTO under FSDP2 on two CPU ranks (gloo) == one process: the same logged losses, KL
estimates and rewards, the same exported weights, full fine-tuning (a frozen reference copy
sharded like the policy) and LoRA (the adapters off as the reference; precomputed reference
log-probs gathered from both ranks, and a validation set that does not split evenly).

Why the runs see the same rows: the DistributedSampler hands rank r ``perm[r::2]`` of one
seeded permutation, so step k's two per-rank batches of B are the single process's step-k
batch of 2B (see ``test_sft_distributed``), and each row's KL partner is fixed by its dataset
index. The KL estimate is the mean over the step's KL rows of both ranks: with a per-rank
estimate (TRL's) the ranks' losses would differ from the single process's.
"""

from __future__ import annotations

import pytest

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
from tests.recipes.test_kto import make_rated_data

PER_RANK, STEPS = 2, 3
COMMON = [f"max_steps={STEPS}", "optimizer.lr=1e-3"]
CASES = {  # config -> its own overrides
    "tiny": [],
    "tiny_lora": ["precompute_reference=true", "val_fraction=0.25"],  # 21 rows: 16 train, 5 val
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("kto_fsdp")
    return root, make_model_dir(root), make_rated_data(root / "rated.jsonl", rows=21, every=3)


@pytest.mark.parametrize("config", list(CASES))
def test_two_gloo_ranks_equal_one_process(world, tmp_path, config):
    root, model_dir, data = world
    extra = [*COMMON, *CASES[config]]
    single = run_recipe(
        "kto", config, model_dir, data, tmp_path / "single", f"batch_size={2 * PER_RANK}", *extra
    )
    out = tmp_path / "fsdp"
    launch_ranks(
        recipe_overrides(model_dir, data, out, f"batch_size={PER_RANK}", *extra),
        tmp_path,
        recipe="kto",
        config=config,
    )
    assert [p.name for p in checkpoints(out)] == [f"step_{STEPS:06d}"]
    logged_1, logged_2 = read_metrics(single), read_metrics(out)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, STEPS + 1))
    for step in logged_1:
        one, two = logged_1[step], logged_2[step]
        assert one.keys() == two.keys()
        assert one["completions_in_window"] == two["completions_in_window"] == 2 * PER_RANK
        for key in one:
            if key.split("/")[0] in ("loss", "grad_norm", "kl", "rewards", "logps", "count"):
                assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-6), f"{key} at {step}"
    assert any(logged["kl"] > 0 for logged in logged_1.values())
    if "val_fraction=0.25" in extra:
        assert "precomputing the reference" in (tmp_path / "rank0.log").read_text()
        val_1, val_2 = read_eval_metrics(single)[STEPS], read_eval_metrics(out)[STEPS]
        for key in ("val_loss", "val_kl", "val_rewards/chosen", "val_logps/chosen"):
            assert val_2[key] == pytest.approx(val_1[key], rel=1e-5, abs=1e-6), key
    weights_1 = final_weights(single)
    assert_same_weights(final_weights(out), weights_1, 1e-5)
    lora_b = [w.abs().max().item() for n, w in weights_1.items() if ".lora_B." in n]
    if lora_b:  # an adapter: every lora_B (zero at the start) moved
        assert min(lora_b) > 1e-4
    else:
        assert largest_change(weights_1, checkpoint_weights(model_dir)) > 1e-3
