"""Boolean attention masks (``True`` = may attend), shaped ``[b, 1, q_len, kv_len]``.

Queries are the *last* ``q_len`` of the ``kv_len`` positions (the newest tokens
when a KV cache holds earlier ones), so query ``i`` sits at position
``kv_len - q_len + i``.
"""

from __future__ import annotations

import torch

__all__ = [
    "build_attention_mask",
    "causal_mask",
    "document_causal_mask",
    "document_spans",
    "document_position_ids",
    "padding_position_ids",
]


def causal_mask(
    q_len: int,
    kv_len: int | None = None,
    *,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[q_len, kv_len]`` causal mask, optionally limited to the last ``sliding_window`` keys.

    Example::

        >>> causal_mask(2, 3).int()
        tensor([[1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    kv_len = q_len if kv_len is None else kv_len
    q_pos, k_pos = _positions(q_len, kv_len, device)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def _positions(
    q_len: int, kv_len: int, device: torch.device | str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of query indices and row of key indices within the ``kv_len`` sequence."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return q_pos, k_pos


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-causal mask for packed sequences: attend causally within one's own document.

    ``document_ids`` is ``[b, s]`` (any integer labels, equal within a document).

    Example::

        >>> document_causal_mask(torch.tensor([[0, 0, 1]]))[0, 0].int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [0, 0, 1]], dtype=torch.int32)
    """
    if document_ids.dim() != 2:
        raise ValueError(
            f"document_ids must be [batch, seq], got shape {tuple(document_ids.shape)}"
        )
    same_doc = document_ids[:, :, None] == document_ids[:, None, :]
    causal = causal_mask(document_ids.shape[1], device=document_ids.device)
    return (same_doc & causal)[:, None]


def document_position_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions restarting at 0 at every document boundary of a packed ``[b, s]`` batch.

    Example::

        >>> document_position_ids(torch.tensor([[0, 0, 0, 1, 1]]))
        tensor([[0, 1, 2, 0, 1]])
    """
    seq = document_ids.shape[-1]
    idx = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - start_idx


def padding_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens of a ``[b, s]`` 0/1 padding mask (pads get 0).

    Use these with left padding so each row's first real token has position 0.

    Example::

        >>> padding_position_ids(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]))
        tensor([[0, 0, 0, 1],
                [0, 1, 2, 3]])
    """
    mask = attention_mask.long()
    return ((mask.cumsum(-1) - 1) * mask).clamp_min(0)


def document_spans(document_ids: torch.Tensor) -> list[list[tuple[int, int]]] | None:
    """Each row's documents as ``(start, end)`` runs of equal, non-negative ids (negative ids
    are padding), or None when some id appears in two separate runs of a row (then only
    :func:`document_causal_mask` describes the attention).

    Example::

        >>> document_spans(torch.tensor([[0, 0, 1, -1], [5, 5, 5, 5]]))
        [[(0, 2), (2, 3)], [(0, 4)]]
    """
    spans = []
    for row in document_ids.tolist():
        runs: list[tuple[int, int]] = []
        seen: set[int] = set()
        start = 0
        for i in range(1, len(row) + 1):
            if i < len(row) and row[i] == row[start]:
                continue
            if row[start] >= 0:
                if row[start] in seen:
                    return None
                seen.add(row[start])
                runs.append((start, i))
            start = i
        spans.append(runs)
    return spans


def build_attention_mask(
    attention_mask: torch.Tensor | None,
    *,
    batch_size: int,
    q_len: int,
    kv_len: int,
    sliding_window: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """The ``[b|1, 1, q_len, kv_len]`` bool mask for one forward, or None for plain causal.

    ``attention_mask`` may be None (causal), a 2-D ``[b, kv_len]`` 0/1 padding mask
    (combined with causal), or an explicit 4-D bool mask (used as given). A sliding
    window, if any, is applied on top. None is returned when SDPA's own causal path
    is exact: no padding, no cache (or a single new token), window not reached.
    Query rows that may attend to nothing (padding) are opened to every key so
    attention stays finite; their outputs are meaningless and must be ignored.
    """
    window_matters = sliding_window is not None and kv_len > sliding_window
    if attention_mask is None:
        if not window_matters and (q_len == kv_len or q_len == 1):
            return None
        mask = causal_mask(q_len, kv_len, sliding_window=sliding_window, device=device)[None, None]
    elif attention_mask.dim() == 2:
        if attention_mask.shape != (batch_size, kv_len):
            raise ValueError(
                f"2-D attention_mask must be [batch, cached + new tokens] = "
                f"{[batch_size, kv_len]}, got {list(attention_mask.shape)}"
            )
        causal = causal_mask(q_len, kv_len, sliding_window=sliding_window, device=device)
        mask = attention_mask.bool()[:, None, None, :] & causal
    elif attention_mask.dim() == 4:
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                f"4-D attention_mask must be bool (True = attend), got {attention_mask.dtype}"
            )
        if attention_mask.shape[-2:] != (q_len, kv_len) or attention_mask.shape[1] != 1:
            raise ValueError(
                f"4-D attention_mask must be [batch, 1, {q_len}, {kv_len}], "
                f"got {list(attention_mask.shape)}"
            )
        mask = attention_mask
        if window_matters:
            q_pos, k_pos = _positions(q_len, kv_len, device)
            mask = mask & (k_pos > q_pos - sliding_window)
    else:
        raise ValueError(
            f"attention_mask must be 2-D or 4-D, got shape {list(attention_mask.shape)}"
        )
    return mask | ~mask.any(dim=-1, keepdim=True)
