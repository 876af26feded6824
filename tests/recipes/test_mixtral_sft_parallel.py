"""Mixtral through the SFT recipe on two ranks (``ep 2`` within ``dp_shard 2``, torchrun's way)
== one process: the ranks read the folder's original names (``block_sparse_moe.experts.{i}.w1``)
through the distributed load, train 3 steps with the load-balancing term weighing (coefficient
0.1) and export under the same names; losses, grad norms, token counts and weights as in one
process (the harness of tests/recipes/test_sft_expert_parallel.py)."""

from __future__ import annotations

from tests.recipes.sft_world import (
    assert_same_as_single,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    run_sft,
    sft_overrides,
)
from tunesmith.models.zoo import mixtral

STEPS = 3


def test_ep2_on_two_ranks_equals_one_process(tmp_path):
    # 6 experts (ep 2 divides them), top-3, window 8
    model_dir = make_model_dir(tmp_path, family=mixtral, num_experts=6, router_aux_loss_coef=0.1)
    data = make_counting_data(tmp_path / "count.jsonl", rows=24)
    common = ("batch_size=1", f"max_steps={STEPS}")
    single = run_sft(model_dir, data, tmp_path / "single", *common, "gradient_accumulation_steps=2")
    out = tmp_path / "ep"
    overrides = sft_overrides(
        model_dir, data, out, *common, "parallelism.dp_shard=2", "parallelism.ep=2"
    )
    launch_ranks(overrides, tmp_path, world_size=2, timeout=240)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=2)
    names = final_weights(out)
    assert "model.layers.0.block_sparse_moe.experts.5.w2.weight" in names
    assert not any(".mlp." in name for name in names)
