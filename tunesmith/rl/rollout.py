"""Rollouts as training rows: prompt + completion token ids right-padded into one batch, the
labels on the completion only, and per-token values (log-probs) aligned with the labels.

A row is ``prompt + completion``; ``labels[t]`` is the token at ``t + 1`` where that token is
part of the completion, else ``IGNORE_INDEX`` (labels are already shifted, as everywhere in
tunesmith). So completion token ``j`` of a row whose prompt has ``P`` tokens sits at label
position ``P - 1 + j``, and so do its sampling log-prob, its trainer and reference log-probs.
Positions count from 0 on every row; right padding needs only the causal mask.

Example::

    >>> batch = rollout_batch([[5, 6], [7]], [[8, 9], [2]], pad_id=0,
    ...                       per_token={"sampling_logprobs": [[-0.5, -0.25], [-1.0]]})
    >>> batch["input_ids"].tolist(), batch["labels"].tolist()
    ([[5, 6, 8, 9], [7, 2, 0, 0]], [[-100, 8, 9, -100], [2, -100, -100, -100]])
    >>> batch["sampling_logprobs"].tolist()
    [[0.0, -0.5, -0.25, 0.0], [-1.0, 0.0, 0.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tunesmith.modules.losses import IGNORE_INDEX, token_logprobs
from tunesmith.training.forward import forward_batch, head_weight

__all__ = [
    "completion_logprobs",
    "completion_mask",
    "micro_batches",
    "rollout_batch",
    "tempered_hidden",
]

Batch = dict[str, torch.Tensor]


def rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    *,
    per_token: Mapping[str, Sequence[Sequence[float]]] | None = None,
    per_row: Mapping[str, torch.Tensor] | None = None,
) -> Batch:
    """Training rows of ``prompt_ids[i] + completion_ids[i]``: ``input_ids``,
    ``position_ids``, ``attention_mask`` and ``labels`` (``[b, L]``), each ``per_token``
    list (one value per completion token) placed at its label positions (float32, 0 elsewhere),
    and each ``per_row`` tensor (``[b]``) as it is."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"rollout_batch: {len(prompt_ids)} prompts but {len(completion_ids)} completions"
        )
    rows = [list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)]
    length = max(len(r) for r in rows)
    b = len(rows)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    labels = torch.full((b, length), IGNORE_INDEX, dtype=torch.long)
    values = {key: torch.zeros((b, length), dtype=torch.float32) for key in per_token or {}}
    for i, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        n, start = len(rows[i]), len(prompt) - 1
        if len(prompt) == 0:
            raise ValueError(f"rollout_batch: prompt {i} is empty")
        input_ids[i, :n] = torch.as_tensor(rows[i], dtype=torch.long)
        attention_mask[i, :n] = 1
        if completion:
            labels[i, start : start + len(completion)] = torch.as_tensor(list(completion))
        for key, table in (per_token or {}).items():
            if len(table[i]) != len(completion):
                raise ValueError(
                    f"rollout_batch: {key} of row {i} has {len(table[i])} values for "
                    f"{len(completion)} completion tokens"
                )
            if completion:
                values[key][i, start : start + len(completion)] = torch.as_tensor(
                    list(table[i]), dtype=torch.float32
                )
    position_ids = torch.arange(length).expand(b, length).clone()
    batch = {"input_ids": input_ids, "position_ids": position_ids,
             "attention_mask": attention_mask, "labels": labels, **values}  # fmt: skip
    for key, tensor in (per_row or {}).items():
        if tensor.shape[0] != b:
            raise ValueError(f"rollout_batch: {key} has {tensor.shape[0]} rows, expected {b}")
        batch[key] = tensor
    return batch


def completion_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[b, L]`` bool: the label positions of completion tokens."""
    return batch["labels"] != IGNORE_INDEX


def completion_logprobs(
    model: nn.Module, batch: Mapping[str, torch.Tensor], *, temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:  # fmt: skip
    """``[b, L]`` float32: log-prob of each completion token under ``model`` at
    ``temperature`` (``log_softmax(logits / temperature)``, what the sampler used), 0 on the
    other positions. Gradients flow unless called under ``torch.no_grad``; the head is applied
    ``chunk_size`` completion tokens at a time, so the ``[b, L, vocab]`` logits never exist."""
    hidden, _ = tempered_hidden(model, batch, temperature)
    return token_logprobs(hidden, head_weight(model), batch["labels"], chunk_size=chunk_size)


def tempered_hidden(
    model: nn.Module, batch: Mapping[str, torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The final hidden states divided by ``temperature`` (``(h / T) @ W.T == logits / T``)
    and the MoE router logits (empty for dense models)."""
    hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
    return (hidden / temperature if temperature != 1.0 else hidden), router_logits


def micro_batches(batch: Mapping[str, torch.Tensor], size: int) -> list[Batch]:
    """``batch`` split into micro-batches of ``size`` rows, each cut to its longest row (the
    padding all its rows share is dropped)."""
    rows = batch["input_ids"].shape[0]
    out = []
    for start in range(0, rows, size):
        part = {k: v[start : start + size] for k, v in batch.items()}
        length = int(part["attention_mask"].sum(1).max())
        out.append({k: (v[:, :length] if v.dim() == 2 else v) for k, v in part.items()})
    return out
