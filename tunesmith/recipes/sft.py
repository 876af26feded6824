"""Supervised fine-tuning: one recipe for one device or many (FSDP2), full fine-tuning.

    tunesmith run sft --config tiny                         # one process
    tunesmith run sft --config qwen3_0_6b --nproc-per-node 8  # eight ranks, FSDP2

The recipe: tokenise the dataset (optionally pack it), build the model (activation
checkpointing, compile, FSDP2 when world > 1), estimate the memory of the longest batch
(which ``preflight: true`` also measures), then :func:`~tunesmith.training.loop.fit` the
objective below: cross-entropy summed over the trained tokens, divided by the trained tokens
of all micro-batches on all ranks, so the update equals one big batch's token-mean loss.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from tunesmith.config import instantiate
from tunesmith.config.errors import type_name
from tunesmith.data import packed_or_padded
from tunesmith.modules.losses import IGNORE_INDEX, LinearCrossEntropyLoss
from tunesmith.training.compile import compile_loss, compile_options
from tunesmith.training.distributed import DistributedContext
from tunesmith.training.forward import forward_batch, router_aux_loss
from tunesmith.training.loop import (
    LOOP_KEYS,
    LOOP_RUNTIME_ARGS,
    LOOP_RUNTIME_KWARGS,
    LossOutput,
    build_datasets,
    check_vocab,
    fit,
    make_loader,
    run_main,
)
from tunesmith.training.loop_config import LOOP_RULES, Rule, flag
from tunesmith.training.memory_planner import MemoryPlan, estimate_memory, optimizer_kind
from tunesmith.training.parallelize import parallelize
from tunesmith.training.preflight import longest_batch

# Arguments the recipe passes at run time (for `tunesmith validate`).
RUNTIME_ARGS = LOOP_RUNTIME_ARGS
RUNTIME_KWARGS = LOOP_RUNTIME_KWARGS
KEYS = [
    *LOOP_KEYS, "model", "packed", "loss", "activation_checkpointing", "compile",
]  # fmt: skip
RULES = {  # what each top-level value may be, checked up front
    **LOOP_RULES, "packed": flag(),
    "compile": Rule("true, false, null or a mapping of compile options",
                    lambda v: v is None or isinstance(v, bool) or type_name(v) == "mapping"),
}  # fmt: skip


def main(cfg: DictConfig) -> None:
    run_main(train, cfg, KEYS, RULES)


def train(cfg: DictConfig, ctx: DistributedContext) -> None:
    log = print if ctx.is_rank_zero else (lambda *a, **k: None)

    # -- data
    tokenizer = instantiate(cfg.tokenizer)
    dataset, val_dataset = build_datasets(cfg, tokenizer, log)
    dataset, collate = packed_or_padded(
        dataset, packed=bool(cfg.get("packed", False)), max_seq_len=cfg.dataset.get("max_seq_len"),
        pad_id=tokenizer.pad_id if tokenizer.pad_id is not None else 0,
    )  # fmt: skip
    loader, sampler = make_loader(dataset, collate, cfg, ctx)

    # -- model and loss
    model = instantiate(cfg.model).to(ctx.device)
    check_vocab(tokenizer, model, cfg)
    loss_fn = instantiate(cfg.loss)
    model = parallelize(model, ctx, cfg)  # checkpointing, compiled layers, FSDP2
    compiling = compile_options(cfg.get("compile"))
    if compiling is not None and compiling.loss:
        loss_fn = compile_loss(loss_fn, backend=compiling.backend, mode=compiling.mode,
                               dynamic=compiling.dynamic)  # fmt: skip
    objective = TokenCrossEntropy(loss_fn)
    plan = _memory_plan(cfg, ctx, model, loss_fn, dataset, collate)
    if plan is not None:
        log(plan.table())

    # -- train: per step, the token-mean loss of all micro-batches on all ranks
    fit(cfg, ctx, model=model, objective=objective, loader=loader, sampler=sampler,
        val_dataset=val_dataset, name="sft", memory_plan=plan)  # fmt: skip


class TokenCrossEntropy:
    """The SFT objective: cross-entropy summed over the trained tokens (labels != -100), plus
    the MoE load-balancing loss (a mean per micro-batch) for MoE models."""

    unit = "trained_tokens"

    def __init__(self, loss_fn: torch.nn.Module) -> None:
        self.loss_fn = loss_fn

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        loss, router_logits = _loss(model, self.loss_fn, batch)
        return LossOutput(loss, aux_loss=router_aux_loss(model, router_logits, batch))


def _loss(model, loss_fn, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """Summed loss over the batch's trained tokens, and the MoE router logits. A loss that owns
    the output projection (``needs_hidden_states``) gets hidden states and the head's weight."""
    if getattr(loss_fn, "needs_hidden_states", False):
        hidden, router_logits = forward_batch(model, batch, return_hidden_states=True)
        return loss_fn(hidden, model.lm_head.weight, batch["labels"]), router_logits
    logits, router_logits = forward_batch(model, batch)
    return loss_fn(logits, batch["labels"]), router_logits


def _memory_plan(cfg, ctx, model, loss_fn, dataset, collate) -> MemoryPlan | None:
    """The estimated peak memory of a step on the longest batch of ``dataset``."""
    if not hasattr(model, "spec") or not len(dataset):
        return None
    batch = longest_batch(dataset, min(cfg.batch_size, len(dataset)), collate)
    return estimate_memory(
        model, batch_size=batch["input_ids"].shape[0], seq_len=batch["input_ids"].shape[1],
        optimizer=optimizer_kind(cfg.optimizer._component_, cfg.optimizer),
        mixed_precision=cfg.get("mixed_precision"),
        activation_checkpointing=cfg.get("activation_checkpointing"),
        loss=loss_fn if isinstance(loss_fn, LinearCrossEntropyLoss) else "full",
        optimizer_in_backward=bool(cfg.get("optimizer_in_backward", False)),
        packed="document_ids" in batch, world_size=ctx.shard_size, device=ctx.device,
    )  # fmt: skip
