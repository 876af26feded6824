"""``merge_adapters`` on a model whose experts (and their LoRA adapters) are split over expert
parallel ranks == the one-process merge.

On 2 gloo ranks (ep 2) and on 4 (ep 2 with two holders of each expert, and ep 4): a tiny
Qwen3-MoE with LoRA on attention and on the stacked experts (random adapters), one copy kept
whole as the reference and one split by ``apply_expert_parallel``. Both are merged; the split
model's merged weights, gathered, equal the reference's (the expert weights to float32
rounding, ``atol`` 1e-6: each rank folds its own experts' ``B_e @ A_e``), its experts stay
split the same way (each rank holds ``E / ep`` merged experts, no adapter left), and its
logits before and after the merge equal the reference's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.gloo_world import run_on_ranks
from tunesmith.models import qwen3_moe
from tunesmith.modules.peft import apply_lora, merge_adapters, trainable_parameters
from tunesmith.training.parallel.distributed import ParallelDims, expert_mesh_of, full_tensor
from tunesmith.training.parallel.expert_parallel import apply_expert_parallel

TARGETS = ["v_proj", "gate_proj", "up_proj", "down_proj"]


def _adapted() -> torch.nn.Module:
    """The same LoRA-adapted tiny Qwen3-MoE on every rank, adapters random (not zero)."""
    torch.manual_seed(0)
    model = apply_lora(qwen3_moe.qwen3_moe_tiny(), target_modules=TARGETS, rank=4, alpha=8)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainable_parameters(model).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _case(world: int, ep: int) -> dict[str, float]:
    """Largest differences, split model vs the reference, on this rank."""
    reference = _adapted()
    split = apply_expert_parallel(
        copy.deepcopy(reference), expert_mesh_of(ParallelDims(dp_shard=world, ep=ep), "cpu")
    )
    ids = torch.randint(
        0, 100, (2, 7), generator=torch.Generator().manual_seed(2 + dist.get_rank())
    )
    torch.manual_seed(0)
    base = qwen3_moe.qwen3_moe_tiny().state_dict()  # the weights the adapters were added to
    out: dict[str, float] = {}
    with torch.no_grad():
        out["logits"] = (split(ids) - reference(ids)).abs().max().item()
        merge_adapters(reference)
        merge_adapters(split)
        out["merged_logits"] = (split(ids) - reference(ids)).abs().max().item()
    merged, expected = split.state_dict(), reference.state_dict()
    assert merged.keys() == expected.keys() and not any("lora" in k for k in merged)
    experts = [k for k in expected if ".experts." in k]
    out["experts_weights"] = max(
        (full_tensor(merged[k]) - expected[k]).abs().max().item() for k in experts
    )
    out["other_weights"] = max(
        (full_tensor(merged[k]) - expected[k]).abs().max().item()
        for k in expected
        if k not in experts
    )
    # the merge moved the weights it folded an adapter into: experts and v_proj
    out["moved"] = min(
        (expected[k] - base[k]).abs().max().item()
        for k in [*experts, "model.layers.0.self_attn.v_proj.weight"]
    )
    layer = split.model.layers[0].mlp.experts
    assert not layer.lora
    for name in ("gate_proj", "up_proj", "down_proj"):
        param = getattr(layer, name)
        assert isinstance(param, DTensor) and param.placements[1].is_shard(0)
        assert param.to_local().shape[0] == layer.num_experts // ep
        assert getattr(param, "expert_parallel", False)
    return out


CASES = {2: [2], 4: [2, 4]}


def _worker(rank: int, world: int) -> dict[int, dict[str, float]]:
    return {ep: _case(world, ep) for ep in CASES[world]}


def _check(world: int) -> None:
    for rank, results in enumerate(run_on_ranks(_worker, world, world)):
        for ep, diffs in results.items():
            where = f"rank {rank} of {world}, ep {ep}"
            for name in ("logits", "merged_logits", "experts_weights"):
                assert diffs[name] <= 1e-5, f"{where}: {name} differ by {diffs[name]}"
            assert diffs["other_weights"] == 0.0, where  # not split: merged identically
            assert diffs["moved"] > 1e-3, f"{where}: the merge left a weight unchanged"


def test_merge_of_expert_lora_under_ep2_on_two_ranks_equals_one_process():
    _check(2)


@pytest.mark.slow
def test_merge_of_expert_lora_under_ep_on_four_ranks_equals_one_process():
    _check(4)
