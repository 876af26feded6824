"""Rollouts as training rows: prompt + completion token ids right-padded into one batch, the
labels on the completion only, and per-token values (log-probs) aligned with the labels.

A row is ``prompt + completion``; ``labels[t]`` is the token at ``t + 1`` where that token is
part of the completion, else ``IGNORE_INDEX`` (labels are already shifted, as everywhere in
tunesmith). So completion token ``j`` of a row whose prompt has ``P`` tokens sits at label
position ``P - 1 + j``, and so do its sampling log-prob, its trainer and reference log-probs.
Positions count from 0 on every row; right padding needs only the causal mask.
:func:`group_batch` is the rows of scored :class:`~tunesmith.rl.groups.Group` s (the rollout
source's rows stage) and :func:`per_micro_batch` runs a no-gradient pass over a batch's rows
in micro-batches (the trainer's, the reference's and the critic's forwards).

Example::

    >>> batch = rollout_batch([[5, 6], [7]], [[8, 9], [2]], pad_id=0,
    ...                       per_token={"sampling_logprobs": [[-0.5, -0.25], [-1.0]]})
    >>> batch["input_ids"].tolist(), batch["labels"].tolist()
    ([[5, 6, 8, 9], [7, 2, 0, 0]], [[-100, 8, 9, -100], [2, -100, -100, -100]])
    >>> batch["sampling_logprobs"].tolist()
    [[0.0, -0.5, -0.25, 0.0], [-1.0, 0.0, 0.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import IGNORE_INDEX, token_logprobs
from tunesmith.rl.groups import Group
from tunesmith.training.forward import forward_batch, head_transform, head_weight
from tunesmith.training.parallel.distributed import DistributedContext

__all__ = [
    "completion_logprobs",
    "completion_mask",
    "group_batch",
    "group_masks",
    "micro_batches",
    "per_micro_batch",
    "rollout_batch",
    "tempered_hidden",
    "tempered_transform",
]

Batch = dict[str, torch.Tensor]


def rollout_batch(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    pad_id: int,
    *,
    per_token: Mapping[str, Sequence[Sequence[float]]] | None = None,
    per_row: Mapping[str, torch.Tensor] | None = None,
    masks: Sequence[Sequence[int] | None] | None = None,
) -> Batch:
    """Training rows of ``prompt_ids[i] + completion_ids[i]``: ``input_ids``,
    ``position_ids``, ``attention_mask`` and ``labels`` (``[b, L]``), each ``per_token``
    list (one value per completion token) placed at its label positions (float32, 0 elsewhere),
    and each ``per_row`` tensor (``[b]``) as it is. ``masks[i]`` (one 0/1 per completion
    token; None: all 1) leaves the label of a 0 token out: a multi-turn row's observation
    tokens are in the row but not trained.

    Example::

        >>> batch = rollout_batch([[5]], [[6, 7, 8]], pad_id=0, masks=[[1, 0, 1]])
        >>> batch["labels"].tolist()
        [[6, -100, 8, -100]]
    """
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
            labels[i, start : start + len(completion)] = _masked(completion, masks, i)
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


def _masked(
    completion: Sequence[int], masks: Sequence[Sequence[int] | None] | None, row: int
) -> torch.Tensor:
    """A row's completion as labels: ``IGNORE_INDEX`` where its mask is 0."""
    labels = torch.as_tensor(list(completion), dtype=torch.long)
    mask = None if masks is None else masks[row]
    if mask is None:
        return labels
    if len(mask) != len(completion):
        raise ValueError(
            f"rollout_batch: the mask of row {row} has {len(mask)} values for "
            f"{len(completion)} completion tokens"
        )
    return labels.masked_fill(torch.as_tensor(list(mask)) == 0, IGNORE_INDEX)


def group_masks(groups: Sequence[Group], cut: Sequence[bool] | None = None) -> list | None:
    """Each completion's mask of ``groups`` in row order (None for a row of a single-turn
    group, ``[]`` for a row ``cut`` to no token), or None when no group has masks."""
    if all(g.masks is None for g in groups):
        return None
    masks = [m for g in groups for m in (g.masks or [None] * g.size)]
    return [[] if cut and cut[i] else m for i, m in enumerate(masks)]


def completion_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``[b, L]`` bool: the label positions of completion tokens."""
    return batch["labels"] != IGNORE_INDEX


def completion_logprobs(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``[b, L]`` float32: log-prob of each completion token under ``model`` at
    ``temperature`` (``log_softmax(logits / temperature)``, what the sampler used), 0 on the
    other positions. Gradients flow unless called under ``torch.no_grad``; the head is applied
    ``chunk_size`` completion tokens at a time, so the ``[b, L, vocab]`` logits never exist."""
    hidden, _ = tempered_hidden(model, batch, temperature)
    transform = tempered_transform(model, temperature)
    return token_logprobs(
        hidden, head_weight(model), batch["labels"], chunk_size=chunk_size, transform=transform
    )


def tempered_hidden(
    model: nn.Module, batch: Mapping[str, torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The final hidden states divided by ``temperature`` (``(h / T) @ W.T == logits / T``)
    and the MoE router logits (empty for dense models)."""
    hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
    return (hidden / temperature if temperature != 1.0 else hidden), router_logits


def tempered_transform(model: nn.Module, temperature: float = 1.0) -> LogitTransform | None:
    """The model's logit transform (:func:`~tunesmith.training.forward.head_transform`) for
    the logits of :func:`tempered_hidden`'s ``h / T``, so that they come out as the sampler's
    ``transform(z) / T``: a scale commutes with ``1 / T``, a soft cap becomes ``cap / T``
    (``cap/T · tanh(s·(z/T) / (cap/T)) = cap · tanh(s·z / cap) / T``).

    Example::

        >>> from tunesmith.models import llama3
        >>> tempered_transform(llama3.llama3_tiny(), temperature=0.7) is None
        True
    """
    transform = head_transform(model)
    if transform is None or transform.softcap is None or temperature == 1.0:
        return transform
    return LogitTransform(transform.scale, transform.softcap / temperature)


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


def group_batch(
    groups: Sequence[Group],
    pad_id: int,
    *,
    overlong_filter: bool = False,
    version: int | None = None,
) -> Batch:
    """The training rows of scored ``groups``, a row per completion in order: the tokens and
    labels, the sampler's log-probs (``sampling_logprobs``), ``rewards`` and ``stopped`` (1.0
    for a completion that ended on a stop, not at ``max_new_tokens``); with
    ``overlong_filter`` a completion cut at ``max_new_tokens`` trains no token. Groups that
    all carry the reference's log-probs (scored by a reward worker) add ``ref_logprobs``;
    ``version`` (the policy being trained, when the groups were sampled elsewhere) adds each
    row's ``policy_lag``: how many updates older its sampling policy is.

    Example::

        >>> from tunesmith.rl.prompts import Prompt
        >>> prompt = Prompt(0, [{"role": "user", "content": "2+2?"}], answer="4")
        >>> group = Group(prompt, round=0, prompt_ids=[5, 6], prompt_text="2+2?",
        ...               completions=[[7, 2], [8, 9]],
        ...               logprobs=[[-0.5, -0.25], [-1.0, -2.0]], finish=["stop", "length"],
        ...               texts=["4", "44"], rewards=torch.tensor([1.0, 0.0]))
        >>> batch = group_batch([group], pad_id=0, overlong_filter=True, version=1)
        >>> batch["labels"].tolist(), batch["stopped"].tolist(), batch["policy_lag"].tolist()
        ([[-100, 7, 2, -100], [-100, -100, -100, -100]], [1.0, 0.0], [1.0, 1.0])
    """
    rows = [
        (g.prompt_ids, c, lp, f)
        for g in groups
        for c, lp, f in zip(g.completions, g.logprobs, g.finish)
    ]
    cut = [overlong_filter and f != "stop" for _, _, _, f in rows]  # trains no token
    batch = rollout_batch(
        [p for p, _, _, _ in rows],
        [[] if x else c for (_, c, _, _), x in zip(rows, cut)],
        pad_id,
        per_token={"sampling_logprobs": [[] if x else lp for (_, _, lp, _), x in zip(rows, cut)]},
        per_row={
            "rewards": torch.cat([g.rewards for g in groups]).float(),
            "stopped": torch.tensor([float(f == "stop") for _, _, _, f in rows]),
        },
        masks=group_masks(groups, cut),
    )
    if version is not None:
        batch["policy_lag"] = torch.tensor(
            [float(version - g.version) for g in groups for _ in range(g.size)]
        )
    if all(g.ref_logprobs is not None for g in groups):
        batch["ref_logprobs"] = _reference_logprobs(batch, groups, overlong_filter)
    return batch


def _reference_logprobs(
    batch: Batch, groups: Sequence[Group], overlong_filter: bool
) -> torch.Tensor:
    """The groups' reference log-probs at their tokens' label positions of ``batch``."""
    out = torch.zeros(batch["labels"].shape, dtype=torch.float32)
    row = 0
    for g in groups:
        for completion, values, finish in zip(g.completions, g.ref_logprobs or [], g.finish):
            if completion and (finish == "stop" or not overlong_filter):
                start = len(g.prompt_ids) - 1
                out[row, start : start + len(values)] = torch.tensor(values, dtype=torch.float32)
            row += 1
    return out


def per_micro_batch(
    fn: Callable[[Batch], torch.Tensor],
    batch: Mapping[str, torch.Tensor],
    size: int,
    ctx: DistributedContext,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``fn(part)`` of each ``size``-row part of ``batch`` (moved to ``ctx.device``, under
    autocast to ``autocast_dtype`` when given), concatenated on the CPU: a pass over a batch's
    rows as the update will cut them, with the same number of forwards on every rank (a
    sharded model needs each on all ranks).

    Example::

        >>> ctx = DistributedContext(rank=0, world_size=1, local_rank=0,  # one process
        ...                          device=torch.device("cpu"), mesh=None)
        >>> batch = {"input_ids": torch.arange(6).view(3, 2)}
        >>> per_micro_batch(lambda part: part["input_ids"].sum(1), batch, 2, ctx)
        tensor([1, 5, 9])
    """
    parts = []
    for start in range(0, batch["input_ids"].shape[0], size):
        part = {k: v[start : start + size].to(ctx.device) for k, v in batch.items()}
        with torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)):
            parts.append(fn(part).cpu())
    return torch.cat(parts)
