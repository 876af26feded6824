"""DeepSeek-V3 (multi-head latent attention, shared experts, group-limited sigmoid routing with
a correction bias) through the SFT recipe on two ranks == one process: the logged losses, grad
norms, token counts and the exported weights after 5 steps, with expert parallel (ep 2: 3 of
the 6 routed experts per rank, the rest FSDP2-sharded over dp_shard 2), with FSDP2 alone
(dp_shard 2) and with tensor parallel (tp 2: each rank two of the four heads, the latents
replicated). Bias-based balancing is on: the correction biases, updated from the expert loads
summed over the ranks, end as the single process's (they are in the compared weights)."""

from __future__ import annotations

import pytest

from tests.recipes.sft_world import (
    assert_same_as_single,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    run_sft,
    sft_overrides,
)
from tunesmith.models.zoo import deepseek_v3

STEPS = 5
BALANCING = "moe_bias_balancing.update_rate=0.01"
LAYOUTS = {
    "ep2_dp_shard2": ["parallelism.dp_shard=2", "parallelism.ep=2"],
    "dp_shard2": ["parallelism.dp_shard=2"],
    "tp2": ["parallelism.tp=2", "gradient_accumulation_steps=2"],  # one data-parallel rank
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek_parallel")
    model_dir = make_model_dir(root, family=deepseek_v3, initializer_range=0.1,
                               num_attention_heads=4, num_key_value_heads=4)  # fmt: skip
    data = make_counting_data(root / "count.jsonl", rows=24)
    single = run_sft(model_dir, data, root / "single", "batch_size=1",
                     "gradient_accumulation_steps=2", f"max_steps={STEPS}", BALANCING)  # fmt: skip
    return model_dir, data, single


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_equal_one_process(world, tmp_path, layout):
    model_dir, data, single = world
    out = tmp_path / "out"
    overrides = sft_overrides(model_dir, data, out, "batch_size=1", f"max_steps={STEPS}",
                              *LAYOUTS[layout], BALANCING)  # fmt: skip
    launch_ranks(overrides, tmp_path, world_size=2, timeout=240)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=2)
    biases = [w for k, w in final_weights(out).items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # balancing ran
