"""Ring attention: exact attention over a sequence split across the ranks of a context-parallel
group, no rank ever holding more than two key/value blocks.

Each rank of the group holds some positions of every row (``q``, ``k``, ``v`` of shape
``[b, heads, s_local, d]``) and the ``index`` of each of them in the full row. The key/value
blocks travel once around the ring (point-to-point send/recv to the next rank); each rank
attends its queries to every block that passes by and merges the partial results with the
online-softmax rule (a running maximum, sum of exponentials and weighted sum of values, so the
result is the softmax over all keys at once). A block none of whose keys any local query may
see (all later in the row, or of other documents) is skipped. The backward pass circulates the
blocks again, together with their key/value gradients, which are home after one more hop.

Masking is by index, not by position in the local tensors: query ``i`` sees key ``j`` when
``index[j] <= index[i]`` (causal), both have the same ``document_ids`` value (packed rows; a
negative id is padding: its query gets zeros, its key is never seen) and, with a
``sliding_window``, ``index[i] - index[j] < sliding_window``.

Example (on every rank of ``group``; here each holds the zigzag halves of a 4-token row)::

    out = ring_attention(q, k, v, group=group, index=torch.tensor([0, 3]))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tunesmith.modules.attention_backends import AttentionBatch, register_attention_backend

__all__ = ["RingShard", "ring_attention", "ring_backend", "ring_batch"]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: ProcessGroup | None,
    index: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
    enable_gqa: bool = False,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the local queries over the keys of every rank of ``group`` (see the module
    docs); differentiable in ``q``, ``k`` and ``v``. All ranks of ``group`` must call it with
    the same shapes.

    Args:
        q: ``[b, heads, s_local, d]`` queries of this rank's positions.
        k: ``[b, kv_heads, s_local, d]`` keys (``kv_heads`` divides ``heads``; fewer needs
            ``enable_gqa``), ``v`` the values, same shape.
        group: the context-parallel process group (None: the default group).
        index: ``[b, s_local]`` or ``[s_local]`` each local position's index in the full row.
        document_ids: ``[b, s_local]`` document of each position (packed rows), or None.
        sliding_window: attend only to the last ``sliding_window`` positions, or None.
        enable_gqa: let ``kv_heads`` be a divisor of ``heads`` (grouped-query attention).
        scale: the softmax scale (default ``d ** -0.5``).
        softcap: soft-cap every block's scores, ``cap * tanh(scores / cap)`` (Gemma 2).
        sinks: ``[heads]`` attention sinks (gpt-oss): a logit per head added to the softmax
            denominator once, after the ring (``out * exp(lse - logaddexp(lse, sink))``);
            differentiable.

    Returns:
        ``[b, heads, s_local, d]``, zeros for queries that may see no key (padding).

    Example::

        >>> idx = torch.arange(4)   # one rank: plain causal attention
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> out = ring_attention(q, k, v, group=None, index=idx)
        >>> out.shape
        torch.Size([1, 2, 4, 8])
        >>> sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, sdpa, atol=1e-6)
        True
    """
    b, heads, s, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2] != s or k.shape[3] != d:
        raise ValueError(
            f"k and v must be [b, kv_heads, s_local, d] = [{b}, *, {s}, {d}] like q, "
            f"got {list(k.shape)} and {list(v.shape)}"
        )
    kv_heads = k.shape[1]
    if heads % kv_heads or (kv_heads != heads and not enable_gqa):
        raise ValueError(
            f"q has {heads} heads and k/v {kv_heads}: equal counts, or a divisor with "
            "enable_gqa=True"
        )
    if index.dim() == 1 and index.shape[0] == s:
        index = index[None].expand(b, s)
    if tuple(index.shape) != (b, s):
        raise ValueError(f"index must be [b, s_local] = {[b, s]}, got {list(index.shape)}")
    if document_ids is not None and tuple(document_ids.shape) != (b, s):
        raise ValueError(
            f"document_ids must be [b, s_local] = {[b, s]}, got {list(document_ids.shape)}"
        )
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return _Ring.apply(q, k, v, group, index, document_ids, sliding_window, scale, softcap, sinks)


# -- the kernel -------------------------------------------------------------------------------


QUERY_CHUNK = 1024
"""Queries attended at once against one key block: bounds the transient scores to
``heads x QUERY_CHUNK x s_local`` (the whole local sequence when shorter)."""


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, index, document_ids, sliding_window, scale, softcap, sinks):  # type: ignore[override]
        ring = _RingInfo(group)
        layout = _Layout(ring, index, document_ids, sliding_window)
        b, heads, s, d = q.shape
        kv_heads = k.shape[1]
        work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        q5 = q.view(b, kv_heads, heads // kv_heads, s, d)
        acc = torch.zeros(q5.shape, dtype=work, device=q.device)
        row_max = torch.full(q5.shape[:-1], -math.inf, dtype=work, device=q.device)
        row_sum = torch.zeros_like(row_max)
        block = torch.stack([k, v])
        for step in range(ring.size):
            pending = ring.shift(block) if step < ring.size - 1 else None
            source = (ring.rank - step) % ring.size
            kb, vb = block[0].to(work)[:, :, None], block[1].to(work)[:, :, None]
            for rows, mask in layout.chunks(source):
                scores = (q5[..., rows, :].to(work) @ kb.transpose(-1, -2)) * scale
                if softcap is not None:
                    scores = scores.div_(softcap).tanh_().mul_(softcap)
                scores = scores.masked_fill_(~mask, -math.inf)
                old = row_max[..., rows]
                new_max = torch.maximum(old, scores.amax(-1))
                safe = torch.where(new_max == -math.inf, 0.0, new_max)
                p = torch.exp_(scores.sub_(safe[..., None]))
                keep = torch.exp(old - safe)
                row_sum[..., rows] = row_sum[..., rows] * keep + p.sum(-1)
                acc[..., rows, :] = acc[..., rows, :] * keep[..., None] + p @ vb
                row_max[..., rows] = new_max
                del scores, p
            if pending is not None:
                block = pending()
        seen = row_sum > 0
        out = torch.where(seen[..., None], acc / torch.where(seen, row_sum, 1.0)[..., None], 0.0)
        lse = torch.where(seen, row_max + torch.log(torch.where(seen, row_sum, 1.0)), -math.inf)
        if sinks is not None:  # one more term in each row's denominator, no value
            sink = sinks.to(work).view(1, kv_heads, heads // kv_heads, 1).expand_as(lse)
            total = torch.logaddexp(lse, sink)
            out, lse = out * torch.exp(lse - total)[..., None], total
        ctx.save_for_backward(q, k, v, out, lse, *(() if sinks is None else (sinks,)))
        ctx.ring, ctx.layout, ctx.scale, ctx.work = ring, layout, scale, work
        ctx.softcap = softcap
        return out.view(b, heads, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        ring, layout, scale, work = ctx.ring, ctx.layout, ctx.scale, ctx.work
        b, heads, s, d = q.shape
        kv_heads = k.shape[1]
        q5 = q.view(b, kv_heads, heads // kv_heads, s, d)
        do = grad_out.reshape(q5.shape).to(work)
        delta = (do * out).sum(-1, keepdim=True)
        safe_lse = torch.where(lse == -math.inf, math.inf, lse)[..., None]  # exp(-inf) = 0
        dq = torch.zeros(q5.shape, dtype=work, device=q.device)
        block = torch.stack([k, v])
        dkv = None  # the gradient of the held block, accumulated along the ring
        for step in range(ring.size):
            pending = ring.shift(block) if step < ring.size - 1 else None
            if step > 0:
                dkv = ring.shift(dkv)()
            mine = torch.zeros(block.shape, dtype=work, device=block.device)
            source = (ring.rank - step) % ring.size
            kb, vb = block[0].to(work)[:, :, None], block[1].to(work)[:, :, None]
            for rows, mask in layout.chunks(source):
                qc, doc = q5[..., rows, :].to(work), do[..., rows, :]
                scores = (qc @ kb.transpose(-1, -2)) * scale
                slope = None
                if ctx.softcap is not None:  # d capped / d raw = 1 - tanh^2
                    tanh = scores.div_(ctx.softcap).tanh_()
                    slope = 1.0 - tanh * tanh
                    scores = tanh.mul_(ctx.softcap)
                p = torch.exp_(scores.sub_(safe_lse[..., rows, :])).masked_fill_(~mask, 0.0)
                ds = (doc @ vb.transpose(-1, -2)).sub_(delta[..., rows, :]).mul_(p)
                if slope is not None:
                    ds = ds.mul_(slope)
                ds = ds.mul_(scale)
                dq[..., rows, :] += ds @ kb
                mine[0] += (ds.transpose(-1, -2) @ qc).sum(2)
                mine[1] += (p.transpose(-1, -2) @ doc).sum(2)
                del scores, p, ds
            dkv = mine if dkv is None else dkv + mine
            if pending is not None:
                block = pending()
        if ring.size > 1:  # the last block's gradient is its owner's (the next rank)
            dkv = ring.shift(dkv)()
        dq = dq.view(b, heads, s, d).to(q.dtype)
        dsinks = None
        if sinks:  # d out / d sink = -p_sink * out: -sum over rows of p_sink * delta
            sink = sinks[0].to(work).view(1, kv_heads, heads // kv_heads, 1)
            dsinks = -(torch.exp(sink - lse) * delta[..., 0]).sum((0, 3)).reshape(heads)
            dsinks = dsinks.to(sinks[0].dtype)
        grads = (dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype))
        return (*grads, None, None, None, None, None, None, dsinks)


class _RingInfo:
    """This rank's place in the ring and the point-to-point shift to the next rank."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        ready = dist.is_available() and dist.is_initialized()
        self.size = dist.get_world_size(group) if ready else 1
        self.rank = dist.get_rank(group) if ready else 0
        if self.size > 1:  # point-to-point ops take global ranks
            self.next = self._global((self.rank + 1) % self.size)
            self.prev = self._global((self.rank - 1) % self.size)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def shift(self, tensor: torch.Tensor):
        """Start sending ``tensor`` to the next rank and receiving the previous rank's; returns
        a function that waits and gives the received tensor."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group),
               dist.P2POp(dist.irecv, received, self.prev, self.group)]  # fmt: skip
        works = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for work in works:
                work.wait()
            return received

        return wait

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """``tensor`` of every rank of the ring, in rank order."""
        if self.size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor.contiguous(), group=self.group)
        return out


class _Layout:
    """Which (local query, key) pairs attend, per key block and query chunk. The index and
    document ids of every rank are tiny: all-gathered once instead of circulating with the
    keys; the masks are built chunk by chunk (never ``s_local x s_local`` at once)."""

    def __init__(
        self,
        ring: _RingInfo,
        index: torch.Tensor,
        document_ids: torch.Tensor | None,
        sliding_window: int | None,
    ) -> None:
        docs = document_ids if document_ids is not None else torch.zeros_like(index)
        self.index, self.docs, self.window = index, docs.to(index.dtype), sliding_window
        self.blocks = ring.gather(torch.stack([index, self.docs]))

    def chunks(self, source: int):
        """``(rows, mask [b, 1, 1, rows, s_k])`` for the query chunks that see any key of rank
        ``source``'s block (the others, and whole blocks, are skipped)."""
        held = self.blocks[source]
        k_idx, k_doc = held[0][:, None, :], held[1][:, None, :]
        s = self.index.shape[1]
        for start in range(0, s, QUERY_CHUNK):
            rows = slice(start, min(start + QUERY_CHUNK, s))
            q_idx, q_doc = self.index[:, rows, None], self.docs[:, rows, None]
            mask = (k_idx <= q_idx) & (k_doc == q_doc) & (q_doc >= 0)
            if self.window is not None:
                mask &= k_idx > q_idx - self.window
            if bool(mask.any()):
                yield rows, mask[:, None, None]


# -- the attention backend ---------------------------------------------------------------------


@dataclass(frozen=True)
class RingShard:
    """The context-parallel layout of one forward: the ring's ``group`` and each local
    position's ``index`` ``[b, s_local]`` in the full row (``AttentionBatch.prepared["ring"]``).

    >>> ring_batch(RingShard(None, torch.arange(4)[None])).backend
    'ring'
    """

    group: ProcessGroup | None
    index: torch.Tensor


def ring_batch(
    shard: RingShard,
    *,
    document_ids: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> AttentionBatch:
    """The :class:`~tunesmith.modules.attention_backends.AttentionBatch` of a forward whose
    rows are split over ``shard.group`` (every layer then calls :func:`ring_attention`).

    >>> ring_batch(RingShard(None, torch.arange(4)[None]), sliding_window=2).sliding_window
    2
    """
    batch = AttentionBatch("ring", document_ids=document_ids, sliding_window=sliding_window)
    batch.prepared["ring"] = shard
    return batch


def ring_backend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``ring`` attention backend: :func:`ring_attention` with the batch's
    :class:`RingShard` (see :func:`ring_batch`), document ids and sliding window (and, from
    :func:`~tunesmith.modules.attention_backends.softcapped_attention`, a scale and soft-cap)."""
    shard = batch.prepared.get("ring")
    if shard is None:
        raise ValueError(
            "the ring attention backend needs the context-parallel layout of the forward "
            "(cp_index): use ring_batch(), not attention_backend='ring'"
        )
    return ring_attention(
        q,
        k,
        v,
        group=shard.group,
        index=shard.index,
        document_ids=batch.document_ids,
        sliding_window=batch.sliding_window,
        enable_gqa=q.shape[1] != k.shape[1],
        scale=scale,
        softcap=softcap,
        sinks=sinks,
    )


register_attention_backend("ring", ring_backend)
