"""Attention sinks (gpt-oss): a learned logit per head in the softmax denominator.

Each head ``h`` has a scalar ``sinks[h]``; its attention probabilities are
``exp(score_j) / (sum_i exp(score_i) + exp(sinks[h]))``: a key-less "sink" column that takes
a share of the probability mass and contributes no value, so a query may attend to (almost)
nothing. transformers' ``GptOssAttention`` (``eager_attention_forward`` with ``s_aux``)
defines the maths; :func:`sink_attention` computes it for every attention backend:

* ``sdpa``, ``varlen``, ``loop`` (and any backend whose batch carries a dense mask): the
  scores are written out under the batch's mask (packed rows carry their block-causal mask,
  so nothing leaks across documents), like
  :func:`~tunesmith.modules.attention_backends.softcapped_attention`;
* ``flex``: the kernel's output rescaled by its log-sum-exp, ``out * sigmoid(lse - sink)``
  (exact: the sink only adds ``exp(sink)`` to the denominator);
* ``ring`` (context parallel): :func:`~tunesmith.modules.ring_attention.ring_attention` adds
  the sink to each row's denominator once, after the ring;
* any other backend is refused, naming the sinks.

Example::

    >>> from tunesmith.modules.attention_backends import AttentionBatch, sdpa_attention
    >>> q = k = v = torch.randn(1, 2, 4, 8)
    >>> no_sink = torch.full((2,), float("-inf"))   # exp(-inf) = 0: plain attention
    >>> torch.allclose(sink_attention(q, k, v, AttentionBatch(), no_sink),
    ...                sdpa_attention(q, k, v, AttentionBatch()), atol=1e-6)
    True
"""

from __future__ import annotations

import torch

from tunesmith.modules.attention_backends import (
    _HAS_FLEX,
    ATTENTION_BACKENDS,
    AttentionBatch,
    _flex_kernel,
    _flex_module,
    _prepare_flex,
    _repeat_kv,
)
from tunesmith.modules.masks import causal_mask

__all__ = ["SINK_BACKENDS", "sink_attention"]

SINK_BACKENDS = ("sdpa", "varlen", "loop", "flex", "ring")
"""Backends that compute attention sinks exactly; any other is refused by name."""


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    sinks: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax([q k^T * scale, sinks]) v`` without the sink column (``[b, h, s, d]`` out),
    under ``batch`` (see the module docs for each backend); ``sinks`` is ``[heads]``.

    Raises:
        NotImplementedError: for a backend that cannot add the sinks (``ring``), naming it.
    """
    if batch.backend == "flex":
        return _flex_with_sinks(q, k, v, batch, sinks, scale)
    if batch.backend == "ring":  # context parallel: the sink joins each row's final sum
        return ATTENTION_BACKENDS["ring"](q, k, v, batch, scale=scale, sinks=sinks)
    if batch.backend not in SINK_BACKENDS:
        raise NotImplementedError(
            f"attention sinks (gpt-oss) are not supported by the {batch.backend!r} attention "
            f"backend; supported: {', '.join(SINK_BACKENDS)}"
        )
    if batch.mask is None and (batch.document_ids is not None or batch.prepared.get("loop")):
        raise ValueError(
            "attention sinks on packed rows need the batch's dense mask (DecoderModel builds it "
            "from document_ids); spans or document ids alone would attend across documents"
        )
    return _written_out(q, k, v, batch.mask, sinks, scale)


def _written_out(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """The scores ``[b, h, q_len, kv_len]`` written out, the sink appended as a last column
    (causal when ``mask`` is None, the new queries being the last of the keys)."""
    groups = q.shape[1] // k.shape[1]
    k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask is None:
        mask = causal_mask(q.shape[2], k.shape[2], device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    # As transformers: subtract the row max (the sink included) before the softmax.
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return probs.to(v.dtype) @ v


def _flex_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: AttentionBatch,
    sinks: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    """Flex attention's output times ``sigmoid(lse - sink)``: ``Z / (Z + exp(sink))``."""
    if not _HAS_FLEX:
        raise RuntimeError("the 'flex' attention backend needs torch.nn.attention.flex_attention")
    if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
        raise NotImplementedError(
            "attention_backend 'flex' has no backward on CPU in torch "
            f"{torch.__version__}; use 'varlen' (packed rows) or 'sdpa'"
        )
    _prepare_flex(batch)
    if batch.prepared["flex"] is None:  # plain causal (sliding) attention
        batch.prepared["flex"] = _causal_block_mask(q.shape[2], k.shape[2], batch, q.device)
    out, aux = _flex_kernel(q.device)(
        q, k, v, block_mask=batch.prepared["flex"], enable_gqa=q.shape[1] > k.shape[1],
        scale=scale, return_aux=_flex_module.AuxRequest(lse=True),
    )  # fmt: skip
    keep = torch.sigmoid(aux.lse.float() - sinks.float().reshape(1, -1, 1))
    return (out.float() * keep[..., None]).to(out.dtype)


def _causal_block_mask(q_len: int, kv_len: int, batch: AttentionBatch, device: torch.device):
    if q_len != kv_len:
        raise ValueError(f"the 'flex' backend needs q_len == kv_len, got {q_len} and {kv_len}")
    window = batch.sliding_window

    def causal(bi, hi, qi, ki):
        keep = ki <= qi
        return keep & (ki > qi - window) if window is not None else keep

    return _flex_module.create_block_mask(causal, None, None, q_len, kv_len, device=device)
