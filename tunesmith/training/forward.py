"""One forward pass of a collated batch through a decoder, the way every recipe runs it.

Packed rows pass their ``document_ids`` (each document attends causally to itself only);
right-padded rows need only the causal mask (a real token never attends to the padding after it, and padding is never
trained). MoE models also return their router logits, for the load-balancing loss.

Example::

    >>> from tunesmith.data.collate import collate_padded
    >>> from tunesmith.models import llama3
    >>> model = llama3.llama3_tiny()
    >>> batch = collate_padded([{"input_ids": [1, 2, 3], "labels": [2, 3, -100]},
    ...                         {"input_ids": [4], "labels": [-100]}], pad_id=0)
    >>> out, router_logits = forward_batch(model, batch, return_hidden_states=True)
    >>> out.shape, router_logits  # [batch, seq, hidden]; a dense model has no routers
    (torch.Size([2, 3, 64]), ())
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tunesmith.modules.logits import LogitTransform
from tunesmith.modules.losses import IGNORE_INDEX, token_logprobs
from tunesmith.modules.moe import load_balancing_loss
from tunesmith.training.parallel.context_parallel import CP_INDEX, context_parallel_group, cp_sum

__all__ = [
    "forward_batch",
    "head_transform",
    "head_weight",
    "model_inputs",
    "router_aux_loss",
    "sequence_logps",
    "transform_kwargs",
]


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The keyword arguments of ``model(batch["input_ids"], ...)`` for a collated batch."""
    inputs: dict[str, Any] = {"position_ids": batch["position_ids"]}
    if "document_ids" in batch:
        inputs["document_ids"] = batch["document_ids"]
    if CP_INDEX in batch:  # context parallel: this rank's share of each row
        inputs["cp_index"] = batch[CP_INDEX]
    return inputs


def forward_batch(
    model: nn.Module, batch: Mapping[str, torch.Tensor], **kwargs: Any
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Logits (or, with ``return_hidden_states=True``, the final hidden states) and the
    router logits of MoE layers (empty for dense models)."""
    if not getattr(getattr(model, "spec", None), "is_moe", False):
        return model(batch["input_ids"], **model_inputs(batch), **kwargs), ()
    return model(batch["input_ids"], **model_inputs(batch), **kwargs, output_router_logits=True)


def head_weight(model: nn.Module) -> torch.Tensor:
    """The output projection's weight ``[vocab, hidden]`` for a loss that owns the head: the
    ``lm_head`` weight, or, for an adapted head (LoRA/DoRA on ``lm_head``), the weight it
    effectively multiplies by (differentiable in the adapters).

    >>> from tunesmith.models import llama3
    >>> from tunesmith.modules.losses import LinearCrossEntropyLoss
    >>> model = llama3.llama3_tiny()
    >>> hidden = model(torch.tensor([[1, 2, 3]]), return_hidden_states=True)
    >>> loss = LinearCrossEntropyLoss()(hidden, head_weight(model), torch.tensor([[2, 3, -100]]))
    >>> head_weight(model) is model.lm_head.weight  # a plain head
    True
    """
    head = model.lm_head
    effective = getattr(head, "effective_weight", None)
    return head.weight if effective is None else effective()


def head_transform(model: nn.Module) -> LogitTransform | None:
    """What the model does to its head's output before the softmax (its ``logit_transform``:
    Granite's scale, Gemma 2's soft cap), for a loss that owns the head; None when nothing.

    >>> from tunesmith.models import llama3
    >>> from tunesmith.modules.losses import LinearCrossEntropyLoss
    >>> model = llama3.llama3_tiny()
    >>> hidden = model(torch.tensor([[1, 2, 3]]), return_hidden_states=True)
    >>> labels = torch.tensor([[2, 3, -100]])
    >>> loss = LinearCrossEntropyLoss()(
    ...     hidden, head_weight(model), labels, transform=head_transform(model)
    ... )
    >>> head_transform(model) is None  # Llama's logits are the projection's
    True
    """
    return LogitTransform.of(getattr(model, "logit_transform", None))


def transform_kwargs(loss_fn: Any, **transforms: LogitTransform | None) -> dict[str, Any]:
    """The keyword arguments that hand a loss owning the head (``needs_hidden_states``) its
    model's ``transforms``: the ones that are not None, so a custom loss without such a keyword
    keeps working for plain models. A transform the loss cannot take is an error (its logits
    would silently be wrong).

    >>> from tunesmith.modules.losses import LinearCrossEntropyLoss
    >>> transform_kwargs(LinearCrossEntropyLoss(), transform=None)
    {}
    >>> def my_loss(hidden, weight, labels): ...
    >>> transform_kwargs(my_loss, transform=LogitTransform(0.5))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: my_loss takes no 'transform' keyword, but the model's logits are transformed ...
    """
    given = {name: t for name, t in transforms.items() if t is not None}
    if not given:
        return given
    fn = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return given
    loss_name = type(loss_fn).__name__
    if not isinstance(loss_fn, nn.Module):
        loss_name = getattr(loss_fn, "__qualname__", loss_name)
    for name, transform in given.items():
        if name not in params:
            raise TypeError(
                f"{loss_name} takes no {name!r} keyword, but the model's logits "
                f"are transformed ({transform}) before the softmax: add a keyword-only "
                f"`{name}: LogitTransform | None = None` to its forward and apply it to the "
                "logits of every chunk"
            )
    return given


def router_aux_loss(
    model: nn.Module, router_logits: tuple[torch.Tensor, ...], batch: Mapping[str, torch.Tensor]
) -> torch.Tensor | None:
    """The MoE load-balancing loss times the model's coefficient (None for dense models). A
    context-parallel batch's (``cp_index``) token statistics are summed over the cp group
    first, so every rank of it gets the whole rows' loss (each counting ``1 / cp`` of it)."""
    if not router_logits:
        return None
    group = context_parallel_group(model)
    reduce = (lambda sums: cp_sum(sums, group)) if CP_INDEX in batch else None
    aux = load_balancing_loss(
        router_logits, model.spec.num_experts_per_tok, batch.get("attention_mask"), reduce
    )
    return model.spec.router_aux_loss_coef * aux


def sequence_logps(
    model: nn.Module, batch: Mapping[str, torch.Tensor], *, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Per row: the summed log-probability of its trained labels (float32, ``[b]``), their
    number (``[b]``), and the MoE router logits. The head is applied ``chunk_size`` trained
    positions at a time (:func:`~tunesmith.modules.losses.token_logprobs`), so the
    ``[b, s, vocab]`` logits never exist. A context-parallel batch's (``cp_index``) partial
    sums are added over the cp group (:func:`~tunesmith.training.parallel.context_parallel.cp_sum`),
    so every rank of it gets the whole rows' values."""
    hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
    labels = batch["labels"]
    logps = token_logprobs(
        hidden, head_weight(model), labels, chunk_size=chunk_size, transform=head_transform(model)
    )
    sums, counts = logps.sum(-1), (labels != IGNORE_INDEX).sum(-1)
    if CP_INDEX in batch:
        group = context_parallel_group(model)
        sums, counts = cp_sum(sums, group), cp_sum(counts, group)
    return sums, counts, router_logits
