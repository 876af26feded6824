"""The SFT recipe on a tiny Llama 4 (chunked attention, NoPE layers, sigmoid top-1 MoE with a
shared expert): checkpoints, resume, parallel runs == one process.

SFT 3 steps in one process (two micro-batches of one sample) is the reference of ep 2 on two
ranks (dp_shard 2: FSDP2 and the experts split over the ranks at once); with one micro-batch,
of tp 2 (the attention heads and MLPs split, the MoE layers replicated): same losses, grad
norms and weights. A run stopped at step 2 and resumed ends as the uninterrupted one (the
checkpoint's fused ``feed_forward.experts`` tensors read back), and transformers loads the
checkpoint with the trained model's logits. DPO and GRPO on Llama 4:
tests/recipes/test_recipes_on_moe_families.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.recipes.sft_world import (
    assert_same_as_single,
    assert_same_weights,
    checkpoints,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_sft,
    sft_overrides,
)
from tunesmith.models.hf import from_hf
from tunesmith.models.zoo import llama4

STEPS = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama4")
    model_dir = make_model_dir(root, family=llama4, num_experts=4)  # ep 2 divides it
    data = make_counting_data(root / "count.jsonl", rows=24)
    return root, model_dir, data


def _single(world, accumulation: int):
    root, model_dir, data = world
    out = root / f"single{accumulation}"
    if not out.exists():
        run_sft(model_dir, data, out, "batch_size=1", f"max_steps={STEPS}",
                f"gradient_accumulation_steps={accumulation}")  # fmt: skip
    return out


def _parallel(world, tmp_path, single, *settings: str) -> None:
    _, model_dir, data = world
    out = tmp_path / "run"
    overrides = sft_overrides(model_dir, data, out, "batch_size=1", f"max_steps={STEPS}", *settings)
    launch_ranks(overrides, tmp_path, world_size=2, timeout=300)
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=2)


def test_sft_learns_on_one_process(world):
    logged = read_metrics(_single(world, 2))
    assert logged[STEPS]["loss"] < logged[1]["loss"]


def test_ep2_with_dp_shard2_equals_one_process(world, tmp_path):
    """Two data-parallel ranks: two micro-batches in one process."""
    _parallel(world, tmp_path, _single(world, 2), "parallelism.dp_shard=2", "parallelism.ep=2")


def test_tp2_equals_one_process(world, tmp_path):
    """One data-parallel rank: one micro-batch in one process."""
    _parallel(world, tmp_path, _single(world, 1), "parallelism.dp_shard=1", "parallelism.tp=2")


def test_checkpoint_loads_in_transformers_and_resumes(world, tmp_path):
    _, model_dir, data = world
    single = _single(world, 2)
    folder = checkpoints(single)[-1]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(0, 200, (1, 9))
    with torch.no_grad():
        ours = from_hf(folder, dtype=torch.float32)(ids)
        assert (theirs.eval()(ids).logits - ours).abs().max() < 1e-4
    out = tmp_path / "resumed"
    common = ("batch_size=1", "gradient_accumulation_steps=2", f"max_steps={STEPS}")
    run_sft(model_dir, data, out, *common, "stop_after_steps=2")
    run_sft(model_dir, data, out, *common, "resume=true")
    assert_same_weights(final_weights(out), final_weights(single), 1e-6)
