"""Attention backends: the one place that turns ``q, k, v`` ``[b, heads, s, d]`` into outputs.

:class:`~tunesmith.modules.attention.Attention` projects, normalises and rotates; a backend
computes ``softmax(q k^T / sqrt(d)) v`` under the rules of one forward, described by an
:class:`AttentionBatch` that :class:`~tunesmith.modules.decoder.DecoderModel` builds once and
hands to every layer. Backends, by name (:data:`ATTENTION_BACKENDS`):

* ``sdpa``: ``scaled_dot_product_attention`` with SDPA's causal path or the dense bool mask
  (padding, KV cache, packed rows as a block-causal mask). Works everywhere.
* ``varlen``: packed rows (``document_ids``) without a Python loop over documents: the
  documents are gathered into a few padded ``[docs, len]`` batches (one per length bucket,
  lengths within a factor of two), each attended by one batched causal SDPA, and scattered
  back. Work is about the sum of squared document lengths, not the squared row length.
* ``flex``: ``torch.nn.attention.flex_attention`` (compiled) with a block mask from the
  document ids and the sliding window; the CUDA choice. On CPU in torch 2.13 it has no
  backward, and its compiled kernel fails to build for document masks, so there it runs
  forward only and unfused (inference, checks).
* ``loop``: the former path, one SDPA per document in a Python loop; kept for comparison.

Every backend gives positions of no document (negative ``document_ids``) zero outputs, except
``sdpa``, whose padding outputs are finite but meaningless (as
:func:`~tunesmith.modules.masks.build_attention_mask` says); real positions agree.
A new backend (e.g. ring attention) is a callable ``(q, k, v, batch) -> out`` with an optional
``prepare(batch)`` run once per forward, added by :func:`register_attention_backend`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from tunesmith.modules.masks import causal_mask, document_spans

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionBatch",
    "VarlenLayout",
    "flex_attention",
    "loop_attention",
    "register_attention_backend",
    "resolve_attention_backend",
    "sdpa_attention",
    "softcapped_attention",
    "varlen_attention",
    "varlen_layout",
]


@dataclass
class AttentionBatch:
    """What may attend to what in one forward; shared by every layer of the model.

    Args:
        backend: the resolved backend name (a key of :data:`ATTENTION_BACKENDS`).
        mask: dense bool ``[b|1, 1, q_len, kv_len]`` mask (True = attend), or None for SDPA's
            causal path (see :func:`~tunesmith.modules.masks.build_attention_mask`).
        document_ids: ``[b, s]`` packed rows (equal ids = one document, negative = padding).
        sliding_window: each query sees only the last ``sliding_window`` keys, or None.
        position_ids: ``[b|1, q_len]`` positions of the queries (set by the decoder; what a
            layer scales by position reads, e.g. Llama 4's attention temperature), or None.
        prepared: what backends computed once for this forward (index tensors, block
            masks), by backend name; filled by :meth:`prepare`.

    Example::

        >>> batch = AttentionBatch("varlen", document_ids=torch.tensor([[0, 0, 1, -1]]))
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> batch.prepare()(q, k, v, batch).shape
        torch.Size([1, 2, 4, 8])
    """

    backend: str = "sdpa"
    mask: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    sliding_window: int | None = None
    position_ids: torch.Tensor | None = None
    prepared: dict[str, Any] = field(default_factory=dict)

    def prepare(self) -> AttentionBackend:
        """Run the backend's ``prepare`` (once, outside any compiled region); return it."""
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention backend {self.backend!r}; known: {sorted(ATTENTION_BACKENDS)}"
            )
        backend = ATTENTION_BACKENDS[self.backend]
        prepare = getattr(backend, "prepare", None)
        if prepare is not None:
            prepare(self)
        return backend


class AttentionBackend(Protocol):
    """``(q [b, h, s, d], k, v [b, h_kv, kv_len, d], batch) -> out [b, h, s, d]``."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor: ...


def register_attention_backend(name: str, backend: AttentionBackend) -> None:
    """Add (or replace) a backend under ``name``; it may carry a ``prepare(batch)`` method.

    Example::

        >>> register_attention_backend("mine", sdpa_attention)
        >>> "mine" in ATTENTION_BACKENDS
        True
        >>> del ATTENTION_BACKENDS["mine"]
    """
    if name == "auto":
        raise ValueError("'auto' is the selection rule, not a backend name")
    ATTENTION_BACKENDS[name] = backend


def resolve_attention_backend(
    name: str, *, device: torch.device | str, packed: bool, cached: bool
) -> str:
    """The backend that ``name`` means for one forward.

    ``auto`` picks ``varlen`` for packed rows (``flex`` instead on CUDA when flex attention
    is there) and ``sdpa`` otherwise. Any choice becomes ``sdpa`` with a KV cache (generation
    is unchanged), and ``varlen``/``loop`` become ``sdpa`` for rows that are not packed.

    Example::

        >>> resolve_attention_backend("auto", device="cpu", packed=True, cached=False)
        'varlen'
        >>> resolve_attention_backend("varlen", device="cpu", packed=False, cached=False)
        'sdpa'
    """
    if name != "auto" and name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend must be 'auto' or one of {sorted(ATTENTION_BACKENDS)}, got {name!r}"
        )
    if cached:
        return "sdpa"
    if name == "auto":
        if not packed:
            return "sdpa"
        return "flex" if torch.device(device).type == "cuda" and _HAS_FLEX else "varlen"
    if name in ("varlen", "loop") and not packed:
        return "sdpa"
    return name


# -- sdpa ------------------------------------------------------------------------------------


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """SDPA under ``batch.mask`` (causal when None; a single query then sees every key).

    Example::

        >>> q = k = v = torch.randn(1, 2, 3, 8)
        >>> sdpa_attention(q, k, v, AttentionBatch()).shape
        torch.Size([1, 2, 3, 8])
    """
    groups = q.shape[1] // k.shape[1]
    if batch.mask is None:
        # Causal fast path: flash/efficient kernels handle grouped heads themselves.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=q.shape[2] > 1, enable_gqa=groups > 1
        )
    if q.device.type == "cpu":  # the CPU kernels group heads under a mask too (no copies)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask, enable_gqa=groups > 1)
    # With an explicit mask, repeat kv heads so every SDPA backend accepts it.
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


# -- soft-capped scores (Gemma 2) ------------------------------------------------------------


def softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    *,
    softcap: float,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(cap * tanh(q k^T * scale / cap)) v`` under ``batch``'s dense mask (causal
    when None), written out: no fused kernel caps the scores, so this holds one
    ``[b, heads, q_len, kv_len]`` score tensor. Any backend's batch works (packed rows carry
    their block-causal mask); context parallel's ring caps its blocks' scores itself, and
    flex attention caps them inside its kernel: the ``flex`` backend, and on CUDA every
    forward whose queries are all its keys (training, prefill), so a GPU never holds the
    ``[s, s]`` scores (a cached decode step, one query, is written out).

    Example::

        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> out = softcapped_attention(q, k, v, AttentionBatch(), softcap=1e9)  # no cap at all
        >>> torch.allclose(out, sdpa_attention(q, k, v, AttentionBatch()), atol=1e-5)
        True
    """
    if batch.backend == "ring":  # context parallel: the ring caps each block's scores
        return ATTENTION_BACKENDS["ring"](q, k, v, batch, scale=scale, softcap=softcap)
    fused = q.is_cuda and _HAS_FLEX and q.shape[2] == k.shape[2]  # training, prefill on GPU
    if batch.backend == "flex" or fused:  # the cap as a score_mod, inside the kernel
        return flex_attention(q, k, v, batch, scale=scale, softcap=softcap)
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    mask = batch.mask
    if mask is None:  # causal, the new queries being the last of the keys
        q_len, kv_len = q.shape[2], k.shape[2]
        mask = causal_mask(q_len, kv_len, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return probs @ v


# -- varlen ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenLayout:
    """Where the documents of packed rows sit, as index tensors (one entry per length bucket).

    ``gather[i]`` is ``[docs_i, len_i]``: flat positions (into ``b * s``) of bucket ``i``'s
    documents, padded past each document's end by repeating a valid position (a causal query
    never sees the keys after it, so those never reach a real output). ``real[i]`` flat
    indices into ``gather[i]`` that are real tokens, ``targets`` their flat positions in the
    output (all buckets concatenated), ``windows[i]`` the ``[len_i, len_i]`` sliding-window
    band or None.
    """

    gather: tuple[torch.Tensor, ...]
    real: tuple[torch.Tensor, ...]
    targets: torch.Tensor
    windows: tuple[torch.Tensor | None, ...]
    num_positions: int


def varlen_layout(
    document_ids: torch.Tensor, *, sliding_window: int | None = None, bucket_ratio: float = 2.0
) -> VarlenLayout | None:
    """The :class:`VarlenLayout` of ``[b, s]`` packed ``document_ids``, or None when some id
    appears in two separate runs of a row (then only a mask describes the attention).

    Documents are grouped by length: lengths within a factor ``bucket_ratio`` share one padded
    batch, so padding costs at most ``bucket_ratio ** 2`` per document while the number of
    SDPA calls grows only with ``log(longest) / log(bucket_ratio)``, not with documents.
    One host sync reads the bucket sizes.

    Example::

        >>> layout = varlen_layout(torch.tensor([[0, 0, 0, 1, -1]]))
        >>> [g.tolist() for g in layout.gather], layout.targets.tolist()
        ([[[3]], [[0, 1, 2]]], [3, 0, 1, 2])
    """
    if document_ids.dim() != 2:
        raise ValueError(
            f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}"
        )
    if bucket_ratio <= 1:
        raise ValueError(f"bucket_ratio must be > 1, got {bucket_ratio}")
    b, s = document_ids.shape
    device = document_ids.device
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    real_starts = starts & (document_ids >= 0)
    # Contiguity: as many runs of real ids in a row as distinct real ids.
    ordered = document_ids.sort(dim=-1).values
    distinct = torch.ones_like(ordered, dtype=torch.bool)
    distinct[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    runs_per_row = real_starts.sum(-1)
    ids_per_row = (distinct & (ordered >= 0)).sum(-1)

    flat_starts = starts.reshape(-1)
    run_start = torch.nonzero(flat_starts).squeeze(-1)
    run_end = torch.cat([run_start[1:], run_start.new_tensor([b * s])])
    keep = real_starts.reshape(-1)[run_start]
    start, length = run_start[keep], (run_end - run_start)[keep]
    bucket = torch.ceil(
        torch.log(length.double()) / math.log(bucket_ratio) - 1e-9
    ).long()  # lengths in (ratio^(k-1), ratio^k] share bucket k
    order = torch.argsort(bucket, stable=True)
    start, length, bucket = start[order], length[order], bucket[order]
    keys, counts = torch.unique_consecutive(bucket, return_counts=True)
    # One sync: contiguity and, per bucket, its size and longest document.
    longest = (
        torch.segment_reduce(length.float(), "max", lengths=counts).long()
        if len(counts)
        else counts
    )
    host = torch.cat([(runs_per_row != ids_per_row).any().long()[None], counts, longest]).tolist()
    if host[0]:
        return None
    n = len(keys)
    counts_h, longest_h = host[1 : 1 + n], host[1 + n :]
    gather, real, targets, windows = [], [], [], []
    offset = 0
    for count, width in zip(counts_h, longest_h, strict=True):
        first, lens = start[offset : offset + count], length[offset : offset + count]
        offset += count
        step = torch.arange(width, device=device)
        valid = step[None, :] < lens[:, None]
        index = first[:, None] + torch.minimum(step[None, :], lens[:, None] - 1)
        gather.append(index)
        flat_valid = torch.nonzero(valid.reshape(-1)).squeeze(-1)
        real.append(flat_valid)
        targets.append(index.reshape(-1)[flat_valid])
        window = None
        if sliding_window is not None and width > sliding_window:
            window = causal_mask(width, sliding_window=sliding_window, device=device)
        windows.append(window)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return VarlenLayout(
        gather=tuple(gather),
        real=tuple(real),
        targets=torch.cat(targets) if targets else empty,
        windows=tuple(windows),
        num_positions=b * s,
    )


def _prepare_varlen(batch: AttentionBatch) -> None:
    if "varlen" not in batch.prepared:
        if batch.document_ids is None:
            raise ValueError("the 'varlen' attention backend needs document_ids (packed rows)")
        batch.prepared["varlen"] = varlen_layout(
            batch.document_ids, sliding_window=batch.sliding_window
        )


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """Causal attention within each document of packed rows: gather the documents into
    padded per-bucket batches, one SDPA per bucket, scatter back (padding -> zeros).

    Falls back to :func:`sdpa_attention` (``batch.mask``) when the layout is None
    (non-contiguous ids) or under ``torch.compile`` (data-dependent shapes would recompile).

    Example::

        >>> docs = torch.tensor([[0, 0, 1, 1]])
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> out = varlen_attention(q, k, v, AttentionBatch("varlen", document_ids=docs))
        >>> torch.allclose(out[..., 2:, :], sdpa_attention(q[..., 2:, :], k[..., 2:, :],
        ...     v[..., 2:, :], AttentionBatch()), atol=1e-6)
        True
    """
    if torch.compiler.is_compiling():
        return sdpa_attention(q, k, v, batch)
    _prepare_varlen(batch)
    layout: VarlenLayout | None = batch.prepared["varlen"]
    if layout is None:
        return sdpa_attention(q, k, v, batch)
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    qf = q.transpose(1, 2).reshape(b * s, heads, d)
    kf = k.transpose(1, 2).reshape(b * s, kv_heads, d)
    vf = v.transpose(1, 2).reshape(b * s, kv_heads, d)
    pieces = []
    for index, real, window in zip(layout.gather, layout.real, layout.windows, strict=True):
        qb, kb, vb = (t[index].transpose(1, 2) for t in (qf, kf, vf))  # [docs, h, len, d]
        if window is None:
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=groups > 1)
        else:
            kb, vb = _repeat_kv(kb, groups), _repeat_kv(vb, groups)
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=window)
        pieces.append(out.transpose(1, 2).reshape(-1, heads, d)[real])
    values = torch.cat(pieces) if pieces else qf.new_zeros(0, heads, d)
    out = qf.new_zeros(b * s, heads, d).index_copy(0, layout.targets, values)
    return out.view(b, s, heads, d).transpose(1, 2)


varlen_attention.prepare = _prepare_varlen  # type: ignore[attr-defined]


# -- flex ------------------------------------------------------------------------------------

try:
    from torch.nn.attention import flex_attention as _flex_module

    _HAS_FLEX = True
except ImportError:  # pragma: no cover - torch without flex attention
    _flex_module = None
    _HAS_FLEX = False

_compiled_flex: Callable[..., torch.Tensor] | None = None


def _flex_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """Compiled flex attention (fused kernel); the plain op inside an outer compile, and on
    CPU, where torch 2.13's inductor fails to build the kernel for document masks (C++
    compile error in the flex template) so only the unfused op runs."""
    global _compiled_flex
    if torch.compiler.is_compiling() or device.type == "cpu":
        return _flex_module.flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(_flex_module.flex_attention)
    return _compiled_flex


def _prepare_flex(batch: AttentionBatch) -> None:
    if "flex" in batch.prepared:
        return
    if not _HAS_FLEX:
        raise RuntimeError("the 'flex' attention backend needs torch.nn.attention.flex_attention")
    window = batch.sliding_window
    if batch.document_ids is not None:
        docs = batch.document_ids
        b, s = docs.shape

        def mask_mod(bi, hi, qi, ki):
            keep = (docs[bi, qi] == docs[bi, ki]) & (ki <= qi) & (docs[bi, qi] >= 0)
            return keep & (ki > qi - window) if window is not None else keep

        device = docs.device
    elif batch.mask is not None:
        dense = batch.mask
        b, _, s, kv_len = dense.shape
        if s != kv_len:
            raise ValueError(f"the 'flex' backend needs q_len == kv_len, got {s} and {kv_len}")

        def mask_mod(bi, hi, qi, ki):
            return dense[bi, 0, qi, ki]

        device = dense.device
    else:
        batch.prepared["flex"] = None  # plain causal: decided per call from the shapes
        return
    batch.prepared["flex"] = _flex_module.create_block_mask(mask_mod, b, None, s, s, device=device)


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    *,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Compiled flex attention under a block mask of the documents, the sliding window, or
    ``batch.mask``; positions that may attend to nothing (padding) get zeros. ``scale`` is the
    softmax scale (default ``d ** -0.5``), ``softcap`` caps the scores inside the kernel
    (``cap * tanh(score / cap)``, a ``score_mod``: no ``[s, s]`` scores are written out).

    Raises:
        NotImplementedError: gradients on CPU (torch's flex attention has no CPU backward);
            use ``varlen`` there.

    Example::

        q = k = v = torch.randn(1, 2, 4, 8)
        docs = torch.tensor([[0, 0, 1, -1]])
        flex_attention(q, k, v, AttentionBatch("flex", document_ids=docs)).shape
        # -> torch.Size([1, 2, 4, 8])
    """
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise NotImplementedError(
            "attention_backend 'flex' has no backward on CPU in torch "
            f"{torch.__version__}; use 'varlen' (packed rows) or 'sdpa'"
        )
    _prepare_flex(batch)
    block_mask = batch.prepared["flex"]
    if block_mask is None:
        s = q.shape[2]
        if s != k.shape[2]:
            raise ValueError(f"the 'flex' backend needs q_len == kv_len, got {s} and {k.shape[2]}")
        window = batch.sliding_window

        def causal(bi, hi, qi, ki):
            keep = ki <= qi
            return keep & (ki > qi - window) if window is not None else keep

        block_mask = _flex_module.create_block_mask(causal, None, None, s, s, device=q.device)
        batch.prepared["flex"] = block_mask
    groups = q.shape[1] // k.shape[1]
    score_mod = None
    if softcap is not None:

        def score_mod(score, bi, hi, qi, ki):
            return torch.tanh(score / softcap) * softcap

    return _flex_kernel(q.device)(
        q, k, v, block_mask=block_mask, enable_gqa=groups > 1, scale=scale, score_mod=score_mod
    )


flex_attention.prepare = _prepare_flex  # type: ignore[attr-defined]


# -- loop (the former path) ------------------------------------------------------------------


def _prepare_loop(batch: AttentionBatch) -> None:
    if "loop" in batch.prepared:
        return
    spans = document_spans(batch.document_ids) if batch.document_ids is not None else None
    if spans is not None and batch.sliding_window is not None:
        longest = max((end - start for row in spans for start, end in row), default=0)
        spans = None if longest > batch.sliding_window else spans
    batch.prepared["loop"] = spans


def loop_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """One causal SDPA per document of each row, in a Python loop (the former packed path);
    padding positions get zeros. Falls back to :func:`sdpa_attention` where spans cannot say
    it (non-contiguous ids, a document longer than the sliding window, under compile).

    Example::

        >>> docs = torch.tensor([[0, 0, 1, -1]])
        >>> q = k = v = torch.randn(1, 2, 4, 8)
        >>> loop_attention(q, k, v, AttentionBatch("loop", document_ids=docs))[0, :, 3].abs().max()
        tensor(0.)
    """
    if torch.compiler.is_compiling():
        return sdpa_attention(q, k, v, batch)
    _prepare_loop(batch)
    spans = batch.prepared["loop"]
    if spans is None:
        return sdpa_attention(q, k, v, batch)
    return attend_by_document(q, k, v, spans, enable_gqa=q.shape[1] > k.shape[1])


loop_attention.prepare = _prepare_loop  # type: ignore[attr-defined]


def attend_by_document(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spans: list[list[tuple[int, int]]],
    *,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal SDPA over each ``(start, end)`` span of each row (``[b, heads, s, d]`` in and
    out); the positions of no span (padding) are zeros.

    Example::

        >>> q = k = v = torch.randn(1, 2, 3, 8)
        >>> attend_by_document(q, k, v, [[(0, 2)]], enable_gqa=False)[0, :, 2].abs().max()
        tensor(0.)
    """
    b, heads, s, d = q.shape
    rows = []
    for row, row_spans in enumerate(spans):
        pieces, pos = [], 0
        for start, end in row_spans:
            if start > pos:
                pieces.append(q.new_zeros(1, heads, start - pos, d))
            pieces.append(
                F.scaled_dot_product_attention(
                    q[row : row + 1, :, start:end],
                    k[row : row + 1, :, start:end],
                    v[row : row + 1, :, start:end],
                    is_causal=True,
                    enable_gqa=enable_gqa,
                )
            )
            pos = end
        if pos < s:
            pieces.append(q.new_zeros(1, heads, s - pos, d))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows, dim=0)


ATTENTION_BACKENDS: dict[str, AttentionBackend] = {
    "sdpa": sdpa_attention,
    "varlen": varlen_attention,
    "flex": flex_attention,
    "loop": loop_attention,
}
