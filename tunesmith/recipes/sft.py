"""Supervised fine-tuning: one recipe for one device or many (FSDP2), full fine-tuning.

    tunesmith run sft --config tiny                         # one process
    tunesmith run sft --config qwen3_0_6b --nproc-per-node 8  # eight ranks, FSDP2

The loop, per optimizer step: take ``gradient_accumulation_steps`` micro-batches; count the
trained tokens of all of them on all ranks; backpropagate each micro-batch's summed loss
divided by that count (times the world size, since FSDP averages gradients over ranks), so
the update equals one big batch's token-mean loss; clip; step; log; validate; checkpoint.
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from tunesmith.config import ConfigError, check_keys, instantiate
from tunesmith.data import PackedDataset, collate_packed, collate_padded, split_train_val
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.modules.masks import document_causal_mask
from tunesmith.modules.moe import load_balancing_loss
from tunesmith.training import MultiLogger, NullLogger
from tunesmith.training.activations import activation_offloading, apply_activation_checkpointing
from tunesmith.training.checkpointer import Checkpointer
from tunesmith.training.compile import compile_loss, compile_model, compile_options
from tunesmith.training.distributed import (
    all_reduce_sum,
    close_distributed,
    init_distributed,
    peer_failure,
    shard_model,
)
from tunesmith.training.memory import peak_memory_gb
from tunesmith.training.memory_planner import estimate_memory, optimizer_kind
from tunesmith.training.optim_in_backward import OptimizerInBackward, check_compatible
from tunesmith.training.preflight import longest_batch, preflight

# Arguments the recipe passes at run time (for `tunesmith validate`).
RUNTIME_ARGS = {"tokenizer": 0, "dataset": 1, "val_dataset": 1, "optimizer": 1, "lr_scheduler": 1}
RUNTIME_KWARGS = {"lr_scheduler": ["num_training_steps"]}
KEYS = [
    "output_dir", "model_dir", "seed", "device", "mixed_precision", "tokenizer", "model",
    "dataset", "val_dataset", "val_fraction", "packed", "shuffle", "batch_size",
    "gradient_accumulation_steps", "epochs", "max_steps", "stop_after_steps", "optimizer",
    "lr_scheduler", "max_grad_norm", "loss", "metric_loggers", "log_every_n_steps",
    "eval_every_n_steps", "save_every_n_steps", "keep_last", "resume", "on_nonfinite_loss",
    "progress_bar", "optimizer_in_backward", "activation_checkpointing", "activation_offloading",
    "compile", "preflight", "distributed_timeout_s",
]  # fmt: skip
AUTOCAST = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(cfg: DictConfig) -> None:
    issues = check_keys(cfg, KEYS)
    if issues:
        raise ConfigError.from_issues(issues)
    ctx = init_distributed(cfg.get("device", "auto"), cfg.get("distributed_timeout_s"))
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        train(cfg, ctx)
    except Exception as error:  # a dead or hung peer: say so instead of gloo/NCCL internals
        failure = peer_failure(error, ctx)
        if failure is None:
            raise
        raise failure from error
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous_sigterm)  # train() installed its own
        close_distributed()


def train(cfg: DictConfig, ctx) -> None:
    seed = int(cfg.get("seed", 0))
    random.seed(seed)
    torch.manual_seed(seed)
    output_dir = Path(cfg.output_dir)
    resume = cfg.get("resume", False)
    if isinstance(resume, str) and not Path(resume).is_dir():  # before anything is written
        raise FileNotFoundError(f"resume={resume}: no such checkpoint folder")
    log = print if ctx.is_rank_zero else (lambda *a, **k: None)

    # -- data
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    log(f"dataset: {dataset.report.summary()}")
    val_dataset = instantiate(cfg.val_dataset, tokenizer) if cfg.get("val_dataset") else None
    if val_dataset is None and cfg.get("val_fraction", 0.0) > 0:
        dataset, val_dataset = split_train_val(dataset, cfg.val_fraction, seed=seed)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    if cfg.get("packed", False):
        dataset = PackedDataset(dataset, cfg.dataset.max_seq_len, pad_id)
        collate = collate_packed
    else:
        collate = partial(collate_padded, pad_id=pad_id)
    sampler = DistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=bool(cfg.get("shuffle", True)),
        seed=seed, drop_last=True,
    )  # fmt: skip
    loader = StatefulDataLoader(
        dataset, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, drop_last=True
    )
    accum = int(cfg.get("gradient_accumulation_steps", 1))
    steps_per_epoch = len(loader) // accum
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(dataset)} samples make no optimizer step: batch_size {cfg.batch_size} x "
            f"gradient_accumulation_steps {accum} x {ctx.world_size} ranks is larger"
        )
    total_steps = cfg.get("max_steps") or steps_per_epoch * int(cfg.get("epochs", 1))

    # -- model, optimizer, schedule
    model = instantiate(cfg.model).to(ctx.device)
    _check_vocab(tokenizer, model, cfg)
    if cfg.get("activation_checkpointing"):
        apply_activation_checkpointing(model, **cfg.activation_checkpointing)
    loss_fn = instantiate(cfg.loss)
    compiling = compile_options(cfg.get("compile"))
    if compiling is not None and compiling.layers:  # each layer, in place: names unchanged
        compile_model(model, backend=compiling.backend, mode=compiling.mode,
                      fullgraph=compiling.fullgraph, dynamic=compiling.dynamic)  # fmt: skip
    if compiling is not None and compiling.loss:
        loss_fn = compile_loss(loss_fn, backend=compiling.backend, mode=compiling.mode,
                               dynamic=compiling.dynamic)  # fmt: skip
    model = shard_model(model, ctx)
    # before the optimizer exists: the preflight step must not update anything
    _memory_plan_and_preflight(cfg, ctx, model, loss_fn, dataset, collate, log)
    trainable = [p for p in model.parameters() if p.requires_grad]
    in_backward = bool(cfg.get("optimizer_in_backward", False))
    if in_backward:  # each parameter steps as soon as its gradient is ready
        check_compatible(accum, cfg.get("max_grad_norm"),
                         on_nonfinite_loss=cfg.get("on_nonfinite_loss", "stop"))  # fmt: skip
        optimizer = OptimizerInBackward(trainable, partial(instantiate, cfg.optimizer))
    else:
        optimizer = instantiate(cfg.optimizer, trainable)
    scheduler = instantiate(cfg.lr_scheduler, optimizer, num_training_steps=total_steps)
    autocast_dtype = AUTOCAST[cfg.get("mixed_precision")]
    offload = bool(cfg.get("activation_offloading", False))

    # -- checkpoints, resume, logging
    checkpointer = Checkpointer(
        output_dir / "checkpoints", ctx, keep_last=cfg.get("keep_last"),
        source_dir=cfg.get("model_dir"),
    )  # fmt: skip
    stateful = {"scheduler": scheduler, "dataloader": loader}
    progress = {"step": 0, "epoch": 0, "tokens_seen": 0}
    resume_from = _resume_path(cfg.get("resume", False), checkpointer)
    if resume_from is None and checkpointer.latest() is not None:
        raise FileExistsError(
            f"{checkpointer.root} already holds checkpoints (latest: {checkpointer.latest()}); "
            "pass resume=true to continue that run, or choose another output_dir"
        )
    if resume_from is not None:
        progress = checkpointer.load(resume_from, model, optimizer, stateful)
        log(f"resumed from {resume_from} at step {progress['step']}")
    loggers = [instantiate(c) for c in cfg.get("metric_loggers") or []]
    logger = MultiLogger(loggers) if ctx.is_rank_zero else NullLogger()
    logger.log_config(cfg)
    stop_requested = _install_sigterm_handler()

    stream = _micro_batches(loader, sampler, progress)
    bar = tqdm(
        total=total_steps, initial=progress["step"], disable=not (
            ctx.is_rank_zero and cfg.get("progress_bar", True)), desc="sft",
    )  # fmt: skip
    last_checkpoint = checkpointer.latest()
    try:
        step_start = time.perf_counter()
        first_step = progress["step"] + 1  # its time includes compilation and warm-up
        model.train()
        while progress["step"] < total_steps:
            step = progress["step"] + 1
            micro = [next(stream) for _ in range(accum)]
            num_tokens = all_reduce_sum(sum(_trained(mb) for mb in micro), ctx.device)
            step_loss = torch.zeros((), device=ctx.device)
            for mb in micro:
                batch = {k: v.to(ctx.device) for k, v in mb.items()}
                with (
                    torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)),
                    activation_offloading(offload, device=ctx.device),
                ):
                    loss, router_logits = _loss(model, loss_fn, batch)
                loss = loss * ctx.world_size / num_tokens.float()
                if router_logits:  # MoE: the load-balancing loss, a mean per micro-batch
                    aux = load_balancing_loss(
                        router_logits, model.spec.num_experts_per_tok, batch.get("attention_mask")
                    )
                    loss = loss + model.spec.router_aux_loss_coef * aux / accum
                loss.backward()
                step_loss += loss.detach()
            step_loss = all_reduce_sum(step_loss, ctx.device) / ctx.world_size
            # with the optimizer in backward the update is done and no gradient is left
            grad_norm = float("nan") if in_backward else _clip(model, cfg.get("max_grad_norm"))

            if not (math.isfinite(step_loss.item()) and (in_backward or math.isfinite(grad_norm))):
                message = f"loss {step_loss.item()} / grad norm {grad_norm} at step {step}"
                if cfg.get("on_nonfinite_loss", "stop") == "stop":
                    raise FloatingPointError(
                        f"{message}; stopping (last good checkpoint: {last_checkpoint}). "
                        "Set on_nonfinite_loss=skip to skip such batches."
                    )
                log(f"skipping the update: {message}")
                optimizer.zero_grad(set_to_none=True)
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            progress["step"] = step
            progress["tokens_seen"] += int(all_reduce_sum(
                sum(_real_tokens(mb) for mb in micro), ctx.device).item())  # fmt: skip
            bar.update(1)

            if step % int(cfg.get("log_every_n_steps", 1)) == 0 or step == total_steps:
                elapsed = time.perf_counter() - step_start
                metrics = {
                    "loss": step_loss.item(), "lr": scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm, "tokens_seen": progress["tokens_seen"],
                    "trained_tokens": int(num_tokens.item()),
                    "tokens_per_s": sum(_real_tokens(mb) for mb in micro) * ctx.world_size / elapsed,
                    "peak_memory_gb": peak_memory_gb(ctx.device),
                }  # fmt: skip
                if in_backward:
                    del metrics["grad_norm"]
                if step == first_step:  # not a throughput: compilation, warm-up
                    metrics["first_step_s"] = elapsed
                    del metrics["tokens_per_s"]
                else:
                    metrics["step_time_s"] = elapsed
                logger.log(step, metrics)
            elif step == first_step:
                logger.log(step, {"first_step_s": time.perf_counter() - step_start})
            if val_dataset is not None and _every(step, cfg.get("eval_every_n_steps"), total_steps):
                val_loss = evaluate(model, val_dataset, collate, loss_fn, ctx, cfg.batch_size)
                logger.log(step, {"val_loss": val_loss})
            stop = bool(all_reduce_sum(float(stop_requested()), ctx.device).item())
            stop_after = cfg.get("stop_after_steps")
            stop_early = stop_after is not None and step == int(stop_after) < total_steps
            if _every(step, cfg.get("save_every_n_steps"), total_steps) or stop or stop_early:
                last_checkpoint = checkpointer.save(step, model, optimizer, stateful, progress)
                log(f"checkpoint: {last_checkpoint}")
            if stop or stop_early:
                reason = "SIGTERM" if stop else f"stop_after_steps={stop_after}"
                log(f"{reason}: stopped after step {step}; resume with resume=true")
                break
            step_start = time.perf_counter()
    finally:
        bar.close()
        logger.close()


def evaluate(model, dataset, collate, loss_fn, ctx, batch_size: int) -> float:
    """Token-mean loss over ``dataset``, split over ranks."""
    sampler = DistributedSampler(dataset, ctx.world_size, ctx.rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    total = torch.zeros((), device=ctx.device, dtype=torch.float64)
    tokens = 0
    model.eval()
    with torch.no_grad():
        for mb in loader:
            batch = {k: v.to(ctx.device) for k, v in mb.items()}
            total += _loss(model, loss_fn, batch)[0]
            tokens += _trained(mb)
    model.train()
    return (all_reduce_sum(total, ctx.device) / all_reduce_sum(tokens, ctx.device)).item()


def _loss(model, loss_fn, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple]:
    """Summed loss over the batch's trained tokens, and the MoE router logits. A loss that owns
    the output projection (``needs_hidden_states``) gets hidden states and the head's weight."""
    if getattr(loss_fn, "needs_hidden_states", False):
        hidden, router_logits = _forward(model, batch, return_hidden_states=True)
        return loss_fn(hidden, model.lm_head.weight, batch["labels"]), router_logits
    logits, router_logits = _forward(model, batch)
    return loss_fn(logits, batch["labels"]), router_logits


def _forward(model, batch: dict[str, torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, tuple]:
    """Logits (or hidden states), and the router logits of MoE layers (empty for dense models)."""
    if not getattr(model.spec, "is_moe", False):
        return model(batch["input_ids"], **_model_inputs(batch), **kwargs), ()
    return model(batch["input_ids"], **_model_inputs(batch), **kwargs, output_router_logits=True)


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Packed rows get a block-causal mask; right-padded rows need only the causal mask
    (a real token never attends to the padding after it, and padding is never trained)."""
    inputs: dict[str, Any] = {"position_ids": batch["position_ids"]}
    if "document_ids" in batch:
        inputs["attention_mask"] = document_causal_mask(batch["document_ids"])
    return inputs


def _memory_plan_and_preflight(cfg, ctx, model, loss_fn, dataset, collate, log) -> None:
    """Print the estimated peak memory for the longest batch of ``dataset``; with
    ``preflight: true`` also run that batch forward and backward once (no update, same RNG)
    and print the measured peak next to the estimate."""
    if not hasattr(model, "spec") or not len(dataset):
        return
    batch = longest_batch(dataset, min(cfg.batch_size, len(dataset)), collate)
    plan = estimate_memory(
        model, batch_size=batch["input_ids"].shape[0], seq_len=batch["input_ids"].shape[1],
        optimizer=optimizer_kind(cfg.optimizer._component_, cfg.optimizer),
        mixed_precision=cfg.get("mixed_precision"),
        activation_checkpointing=cfg.get("activation_checkpointing"),
        loss="linear" if getattr(loss_fn, "needs_hidden_states", False) else "full",
        loss_chunks=getattr(loss_fn, "num_chunks", 8),
        loss_chunk_size=getattr(loss_fn, "chunk_size", None),
        optimizer_in_backward=bool(cfg.get("optimizer_in_backward", False)),
        packed="document_ids" in batch, world_size=ctx.world_size, device=ctx.device,
    )  # fmt: skip
    log(plan.table())
    if not cfg.get("preflight", False):
        return
    autocast_dtype = AUTOCAST[cfg.get("mixed_precision")]

    def batch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)):
            return _loss(model, loss_fn, batch)[0]

    report = preflight(
        model, {k: v.to(ctx.device) for k, v in batch.items()}, batch_loss, device=ctx.device,
        free_grads_in_backward=bool(cfg.get("optimizer_in_backward", False)),
    )  # fmt: skip
    log(report.summary(plan))


def _check_vocab(tokenizer, model, cfg: DictConfig) -> None:
    """Refuse a tokenizer whose ids run past the model's embedding (another model's tokenizer):
    training would index out of range, or on a GPU read garbage rows."""
    rows = getattr(getattr(model, "spec", None), "vocab_size", None)
    if rows is not None and tokenizer.vocab_size > rows:
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name', cfg.tokenizer)} has {tokenizer.vocab_size} "
            f"token ids but the model ({cfg.model.get('path', cfg.model._component_)}) embeds "
            f"only {rows} (model.embed_tokens.weight): the tokenizer belongs to another model"
        )


def _trained(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"] != IGNORE_INDEX).sum())


def _real_tokens(batch: dict[str, torch.Tensor]) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int((batch["document_ids"] >= 0).sum())


def _clip(model: torch.nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _every(step: int, every: int | None, total: int) -> bool:
    return step == total or bool(every) and step % int(every) == 0


def _micro_batches(loader, sampler, progress: dict[str, int]) -> Iterator[dict[str, torch.Tensor]]:
    """Endless stream of micro-batches; ``progress["epoch"]`` advances at each epoch end."""
    while True:
        sampler.set_epoch(progress["epoch"])
        yield from loader
        progress["epoch"] += 1


def _resume_path(resume: bool | str, checkpointer: Checkpointer) -> Path | None:
    if resume is False or resume is None:
        return None
    if resume is True:  # None when nothing was saved yet: start fresh
        latest = checkpointer.latest()  # skips (with a warning) damaged checkpoints
        unusable = sorted(p.name for p in checkpointer.root.glob("step_*"))
        if latest is None and unusable:
            raise FileNotFoundError(
                f"resume=true: no usable checkpoint in {checkpointer.root}: {', '.join(unusable)} "
                "do not match their COMPLETE manifest (damaged or incomplete); restarting from "
                "step 0 would lose them. Move them away to start fresh, or pass resume=<folder>"
            )
        return latest
    return Path(resume)  # checked at the start of train()


def _install_sigterm_handler():
    """SIGTERM asks for a checkpoint at the end of the current step, then a clean exit."""
    received = {"flag": False}

    def handler(signum, frame):
        received["flag"] = True

    if threading.current_thread() is threading.main_thread():  # signals only reach it
        signal.signal(signal.SIGTERM, handler)
    return lambda: received["flag"]
