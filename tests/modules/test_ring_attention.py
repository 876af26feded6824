"""Ring attention on two gloo ranks == full attention on one device.

Each rank holds the zigzag halves of every row (rank 0 chunks 0 and 3, rank 1 chunks 1 and 2 of
four) and runs :func:`ring_attention`; its output and the gradients of its q, k, v must equal
the rows of full-sequence SDPA (float64) at its positions, for: plain causal rows, GQA, packed
rows whose documents cross the split (and trailing padding: zeros), a sliding window. A
float64 ``gradcheck`` of the whole two-rank function (inputs replicated, outputs gathered)
checks the backward, key/value gradients travelling around the ring included. The ranks
attend 3 queries at a time (``QUERY_CHUNK``), so chunks that see no key of a block are
skipped too. On one process
(no group) the kernel is checked against SDPA, and bad shapes are refused. Soft-capped scores
(Gemma 2) are checked the same way, gradcheck included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.gloo_world import run_on_ranks
from tunesmith.modules import ring_attention as ring_module
from tunesmith.modules.ring_attention import ring_attention

CP = 2


def _zigzag(seq: int, rank: int) -> torch.Tensor:
    chunk = seq // (2 * CP)
    keep = (rank, 2 * CP - 1 - rank)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in keep])


def _reference(q, k, v, docs, window, scale=None, softcap=None):
    """Full attention by an explicit mask; queries of negative documents give zeros."""
    s = q.shape[2]
    pos = torch.arange(s)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - window)
    mask = mask[None].expand(q.shape[0], s, s)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])
    real = torch.ones(q.shape[0], s, dtype=torch.bool) if docs is None else docs >= 0
    mask = mask | (~real[:, :, None] & torch.eye(s, dtype=torch.bool))  # finite padding rows
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], enable_gqa=k.shape[1] != q.shape[1], scale=scale
        )
    else:  # written out: scores capped before the mask and the softmax
        groups = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scores = q @ kk.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~mask[:, None], -torch.inf)
        out = torch.softmax(scores, -1) @ vv
    return torch.where(real[:, None, :, None], out, 0.0)


CASES = {
    "causal": dict(kv_heads=4, docs=None, window=None),
    "gqa": dict(kv_heads=2, docs=None, window=None),
    # documents 0 | 1 | 2 cross the chunk borders at 4, 8, 12; row 1 ends with padding
    "packed": dict(
        kv_heads=2, docs=[[0] * 6 + [1] * 7 + [2] * 3, [0] * 3 + [1] * 10 + [-1] * 3], window=None
    ),
    "window": dict(kv_heads=2, docs=None, window=5),
    # Gemma 2: scores soft-capped (cap 1.5 bites at scale 0.7) under packed documents
    "softcap": dict(
        kv_heads=2,
        docs=[[0] * 6 + [1] * 10, [0] * 3 + [1] * 10 + [-1] * 3],
        window=None,
        scale=0.7,
        softcap=1.5,
    ),
}


def _case(name: str, rank: int) -> dict[str, float]:
    case = CASES[name]
    torch.manual_seed(0)
    b, heads, s, d = 2, 4, 16, 8
    q = torch.randn(b, heads, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, case["kv_heads"], s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, case["kv_heads"], s, d, dtype=torch.float64, requires_grad=True)
    docs = None if case["docs"] is None else torch.tensor(case["docs"])
    grad_out = torch.randn(b, heads, s, d, dtype=torch.float64)
    extra = {key: case[key] for key in ("scale", "softcap") if key in case}
    expected = _reference(q, k, v, docs, case["window"], **extra)
    expected.backward(grad_out)
    mine = _zigzag(s, rank)
    local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(
        *local,
        group=None,
        index=mine,
        enable_gqa=case["kv_heads"] != heads,
        document_ids=None if docs is None else docs[:, mine],
        sliding_window=case["window"],
        **extra,
    )
    out.backward(grad_out[:, :, mine])
    errors = {"out": (out - expected[:, :, mine]).abs().max().item()}
    for label, full, part in zip("qkv", (q, k, v), local, strict=True):
        errors[label] = (part.grad - full.grad[:, :, mine]).abs().max().item()
    return errors


class _Scatter(torch.autograd.Function):
    """Replicated full tensor -> this rank's positions; backward sums the ranks' gradients."""

    @staticmethod
    def forward(ctx, full, mine):
        ctx.shape, ctx.mine = full.shape, mine
        return full[:, :, mine].clone()

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        full[:, :, ctx.mine] = grad
        dist.all_reduce(full)
        return full, None


class _Gather(torch.autograd.Function):
    """Each rank's positions -> the full tensor on every rank; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, part, mine):
        parts = [torch.empty_like(part) for _ in range(CP)]
        dist.all_gather(parts, part.contiguous())
        s = part.shape[2] * CP
        full = part.new_zeros(*part.shape[:2], s, part.shape[3])
        for rank, p in enumerate(parts):
            full[:, :, _zigzag(s, rank)] = p
        ctx.mine = mine
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[:, :, ctx.mine], None


def _gradcheck(rank: int, softcap: float | None = None) -> bool:
    torch.manual_seed(0)
    b, heads, s, d = 1, 2, 8, 3
    q = torch.randn(b, heads, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 1, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 1, s, d, dtype=torch.float64, requires_grad=True)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]])
    mine = _zigzag(s, rank)

    def fn(q, k, v):
        parts = [_Scatter.apply(t, mine) for t in (q, k, v)]
        out = ring_attention(
            *parts, group=None, index=mine, document_ids=docs[:, mine], enable_gqa=True,
            softcap=softcap,
        )  # fmt: skip
        return _Gather.apply(out, mine)

    return torch.autograd.gradcheck(fn, (q, k, v))


def _worker(rank: int) -> dict:
    ring_module.QUERY_CHUNK = 3  # several query chunks per block (8 local positions)
    results = {name: _case(name, rank) for name in CASES}
    results["gradcheck"] = _gradcheck(rank)
    results["gradcheck_softcap"] = _gradcheck(rank, softcap=0.8)
    return results


@pytest.fixture(scope="module")
def ring_results():
    return run_on_ranks(_worker, CP)


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_full_attention(ring_results, name):
    for rank, results in enumerate(ring_results):
        for what, error in results[name].items():
            assert error < 1e-12, f"{name} rank {rank}: {what} differs by {error}"


@pytest.mark.parametrize("name", ["gradcheck", "gradcheck_softcap"])
def test_gradcheck_on_two_ranks(ring_results, name):
    assert [r[name] for r in ring_results] == [True] * CP


def test_one_process_is_sdpa():
    torch.manual_seed(0)
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 2, 7, 8, dtype=torch.float64).unbind(0)
    out = ring_attention(q, k, v, group=None, index=torch.arange(7), enable_gqa=True)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_bad_shapes_are_refused():
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ring_attention(q, kv, kv, group=None, index=torch.arange(6))
    with pytest.raises(ValueError, match=r"index must be \[b, s_local\] = \[1, 6\]"):
        ring_attention(q, kv, kv, group=None, index=torch.arange(5), enable_gqa=True)
