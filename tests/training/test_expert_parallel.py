"""Expert parallel == one process for the MoE layer: outputs, input gradients, router
gradients and expert gradients (the data-parallel average) on gloo ranks.

Each rank routes its own random tokens; the reference is the same layer unsplit, run in each
rank on every rank's tokens. Cases: float32 (the grouped-matmul path) and float64 (the loop
over experts), routing where every token goes to the first rank's experts (the other ranks'
experts receive no token, forward and backward), a rank with no token at all, and on four
ranks ep 2 with two holders of each expert (``expert_dp`` 2) and ep 4. The refusals are
checked in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.gloo_world import run_on_ranks
from tunesmith.config import ConfigError
from tunesmith.modules.moe import MoE
from tunesmith.training.parallel.distributed import ParallelDims, expert_mesh_of
from tunesmith.training.parallel.expert_parallel import apply_expert_parallel

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 4, 2


def _layer(dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    return MoE(HIDDEN, INTER, num_experts=EXPERTS, top_k=TOP_K, norm_topk_prob=True).to(dtype)


def _tokens(rank: int, world: int, routing: str, dtype: torch.dtype) -> torch.Tensor:
    """This rank's tokens; with ``routing == "empty"`` the last rank has none."""
    torch.manual_seed(100 + rank)
    rows = 0 if routing == "empty" and rank == world - 1 else 5 + 3 * rank
    return torch.randn(rows, HIDDEN, dtype=dtype)


def _skew_router(layer: MoE) -> None:
    """Every token picks experts 0 and 1 (those of ep rank 0): the others receive none."""
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0, 0], layer.gate.weight[1, 0] = 50.0, 49.0


def _largest(diff: torch.Tensor) -> float:
    """Largest absolute entry; 0 for an empty tensor (the rank with no token)."""
    return diff.abs().max().item() if diff.numel() else 0.0


def _case(world: int, ep: int, routing: str, dtype: torch.dtype) -> dict[str, float]:
    """Largest differences, EP vs the reference, on this rank."""
    rank = dist.get_rank()
    reference, split = _layer(dtype), _layer(dtype)
    if routing == "skewed":
        _skew_router(reference), _skew_router(split)
    inputs = [_tokens(r, world, routing, dtype) for r in range(world)]
    # biased tokens so that skewed routing is decided by the first feature
    if routing == "skewed":
        inputs = [x.abs() + 0.5 for x in inputs]
    weights = [
        torch.randn(x.shape, dtype=dtype, generator=torch.Generator().manual_seed(7 + r))
        for r, x in enumerate(inputs)
    ]
    ref_inputs = [x.clone().requires_grad_() for x in inputs]
    ref_out = [reference(x[None])[0][0] for x in ref_inputs]
    sum((o * w).sum() for o, w in zip(ref_out, weights)).backward()

    mesh = expert_mesh_of(ParallelDims(dp_shard=world, ep=ep), "cpu")
    apply_expert_parallel(split, mesh)
    x = inputs[rank].clone().requires_grad_()
    out, logits = split(x[None])
    (out[0] * weights[rank]).sum().backward()

    # the router's gradient on this rank: this rank's tokens only (no data-parallel average)
    router = _layer(dtype)
    if routing == "skewed":
        _skew_router(router)
    (router(inputs[rank][None])[0][0] * weights[rank]).sum().backward()
    assert out[0].shape == ref_out[rank].shape and x.grad.shape == x.shape
    diffs = {
        "out": _largest(out[0] - ref_out[rank]),
        "input_grad": _largest(x.grad - ref_inputs[rank].grad),
        "router_grad": _largest(split.gate.weight.grad - router.gate.weight.grad),
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        param = getattr(split.experts, name)
        assert param.placements[1].is_shard(0) and param.to_local().shape[0] == EXPERTS // ep
        expected = getattr(reference.experts, name).grad / world  # the data-parallel average
        diffs[name] = (param.grad.full_tensor() - expected).abs().max().item()
        diffs[name + "_scale"] = expected.abs().max().item()
    return diffs


CASES_2 = [
    (2, 2, r, d) for r in ("random", "skewed", "empty") for d in (torch.float32, torch.float64)
]
CASES_4 = [(4, 2, "random", torch.float32), (4, 4, "random", torch.float32),
           (4, 2, "skewed", torch.float64), (4, 4, "empty", torch.float32)]  # fmt: skip


def _worker(rank: int, world: int) -> dict:
    return {case: _case(*case) for case in (CASES_2 if world == 2 else CASES_4)}


def _run(world: int) -> list[dict]:
    return run_on_ranks(_worker, world, world)


def _check(per_rank: list[dict]) -> None:
    for rank, results in enumerate(per_rank):
        for (world, ep, routing, dtype), diffs in results.items():
            where = f"rank {rank} of {world}, ep {ep}, {routing}, {dtype}"
            tol = 1e-5 if dtype == torch.float32 else 1e-12
            for name in ("out", "input_grad", "router_grad", "gate_proj", "up_proj", "down_proj"):
                assert diffs[name] <= tol, f"{where}: {name} differs by {diffs[name]}"
            for name in ("gate_proj", "up_proj", "down_proj"):  # the gradients are not all zero
                assert diffs[name + "_scale"] > 1e-3, f"{where}: {name} has no gradient"


def test_expert_parallel_on_two_ranks_equals_one_process():
    _check(_run(2))


@pytest.mark.slow
def test_expert_parallel_on_four_ranks_equals_one_process():
    """ep 2 with each expert held by two ranks (their gradients summed), and ep 4."""
    _check(_run(4))


def test_ep_that_does_not_divide_the_experts_or_dp_shard_is_refused():
    with pytest.raises(ConfigError, match="ep 3 does not divide dp_shard 4"):
        ParallelDims.resolve({"dp_shard": 4, "ep": 3}, world_size=4)
    from tunesmith.models.zoo import qwen3_moe
    from tunesmith.training.parallelize import check_model_fits

    spec = qwen3_moe.spec("qwen3_moe_tiny")
    with pytest.raises(ConfigError, match=f"ep 3 does not divide num_experts {spec.num_experts}"):
        check_model_fits(spec, ParallelDims(dp_shard=3, ep=3))
