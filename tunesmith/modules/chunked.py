"""Chunked local attention (Llama 4): a query sees only the keys of its own chunk.

A layer with ``attention_chunk_size`` ``C`` cuts every sequence into chunks of ``C``
positions (``position // C``, as transformers' ``create_chunked_causal_mask`` does) and
attends causally within each. That is document attention with finer documents, so every
attention backend does it exactly by being handed those finer documents
(:func:`chunk_document_ids`): packed rows (``varlen``, ``flex``, ``loop``), context parallel
(``ring``, which compares document ids) and dense masks (``sdpa``, KV cache). Chunks follow
``position_ids``: packed rows, whose positions restart at each document, get the chunks of
separate rows. With a KV cache the cached keys sit at their slot (counting only the real
tokens of a 2-D padding mask, as left-padded generation numbers them).

Example::

    >>> docs = chunk_document_ids(None, torch.arange(5)[None], 2, batch_size=1)
    >>> docs.tolist()
    [[0, 0, 1, 1, 2]]
"""

from __future__ import annotations

import torch

from tunesmith.modules.attention_backends import AttentionBatch
from tunesmith.modules.masks import (
    build_attention_mask,
    causal_mask,
    document_causal_mask,
    padding_position_ids,
)

__all__ = ["chunk_document_ids", "chunked_batch", "key_positions"]

_CHUNKS_PER_DOCUMENT = 2**32  # document d's chunk c is d * 2**32 + c (ids stay int64)


def chunk_document_ids(
    document_ids: torch.Tensor | None,
    position_ids: torch.Tensor,
    chunk_size: int,
    *,
    batch_size: int,
) -> torch.Tensor:
    """``[b, s]`` ids equal exactly for positions of one document and one chunk
    (``position // chunk_size``); negative document ids (padding) stay as they are.

    Example::

        >>> chunk_document_ids(torch.tensor([[0, 0, 0, 1, -1]]),
        ...     torch.tensor([[0, 1, 2, 0, 0]]), 2, batch_size=1).tolist()
        [[0, 0, 1, 4294967296, -1]]
    """
    chunks = (position_ids // chunk_size).expand(batch_size, -1)
    if document_ids is None:
        return chunks
    return torch.where(document_ids < 0, document_ids, document_ids * _CHUNKS_PER_DOCUMENT + chunks)


def key_positions(attention_mask: torch.Tensor | None, kv_len: int, device: torch.device):
    """Positions of the ``kv_len`` keys of a cached forward: their slots, counting only the
    real tokens of a 2-D ``[b, kv_len]`` padding mask (``[1|b, kv_len]``).

    Example::

        >>> key_positions(torch.tensor([[0, 1, 1]]), 3, torch.device("cpu")).tolist()
        [[0, 0, 1]]
    """
    if attention_mask is not None and attention_mask.dim() == 2:
        return padding_position_ids(attention_mask).to(device)
    return torch.arange(kv_len, device=device)[None]


def chunked_batch(
    mask: torch.Tensor | None,
    batch: AttentionBatch,
    *,
    chunk_size: int,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cached_len: int | None,
) -> tuple[torch.Tensor | None, AttentionBatch]:
    """The ``(mask, batch)`` of a chunked layer from those of a full-attention one: finer
    document ids for the backends that read them (packed rows, ring), and the dense mask
    limited to each query's chunk (``sdpa``, KV cache: ``cached_len`` tokens before these,
    None without a cache). A sliding window is refused.

    Example::

        >>> mask, batch = chunked_batch(None, AttentionBatch(), chunk_size=2,
        ...     position_ids=torch.arange(3)[None], attention_mask=None, cached_len=None)
        >>> mask[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    if batch.sliding_window is not None:
        raise ValueError("a layer has both a sliding window and an attention chunk size")
    if batch.backend == "ring":  # compares document ids of each (query, key) pair
        b = batch.prepared["ring"].index.shape[0]
        batch.document_ids = chunk_document_ids(
            batch.document_ids, position_ids, chunk_size, batch_size=b
        )
        return None, batch
    if batch.document_ids is not None:  # packed rows: chunks are documents of their own
        b, s = batch.document_ids.shape
        docs = chunk_document_ids(batch.document_ids, position_ids, chunk_size, batch_size=b)
        batch.document_ids = docs
        batch.mask = build_attention_mask(
            document_causal_mask(docs), batch_size=b, q_len=s, kv_len=s, device=docs.device
        )
        return batch.mask, batch
    batch.mask = _chunked_mask(mask, chunk_size, position_ids, attention_mask, cached_len)
    return batch.mask, batch


def _chunked_mask(
    mask: torch.Tensor | None,
    chunk_size: int,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cached_len: int | None,
) -> torch.Tensor:
    """``mask`` (None: causal) and "same chunk"; rows left with no key opened (finite)."""
    q_len = position_ids.shape[-1]
    kv_len = mask.shape[-1] if mask is not None else (cached_len or 0) + q_len
    if mask is None:
        mask = causal_mask(q_len, kv_len, device=position_ids.device)[None, None]
    keys = position_ids
    if cached_len is not None:
        keys = key_positions(attention_mask, kv_len, mask.device)
    same = (position_ids[:, :, None] // chunk_size) == (keys[:, None, :] // chunk_size)
    mask = mask & same[:, None]
    return mask | ~mask.any(dim=-1, keepdim=True)
