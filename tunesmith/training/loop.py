"""The training loop every recipe shares; a recipe brings its data, its model and its objective.

An :class:`Objective` says what one micro-batch's loss is: a *sum* over some unit (trained
tokens for SFT and KD, preference pairs for DPO and reward models), plus summed metrics.
:func:`fit` does the rest, identically for every method: per optimizer step it takes
``gradient_accumulation_steps`` micro-batches, counts their units on the data-parallel ranks
(``ctx.dp_cp_group``), backpropagates each summed loss divided by that count (times
``ctx.dp_cp_size``, since FSDP averages gradients over those ranks), so the update equals one
big batch's mean; then clips, steps (or lets an optimizer in backward do it), logs,
validates, checkpoints, and stops cleanly on SIGTERM.

Example (the core of a recipe)::

    >>> ctx = init_distributed("cpu")                                        # doctest: +SKIP
    >>> loader, sampler = make_loader(dataset, collate, cfg, ctx)            # doctest: +SKIP
    >>> fit(cfg, ctx, model=model, objective=objective, loader=loader,      # doctest: +SKIP
    ...     sampler=sampler, name="sft")
"""

from __future__ import annotations

import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from tunesmith.config import ConfigError, check_keys, instantiate, plain_config
from tunesmith.data import split_train_val
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.training.activations import activation_offloading
from tunesmith.training.checkpointer import Checkpointer
from tunesmith.training.distributed import (
    DistributedContext,
    all_reduce_sum,
    close_distributed,
    init_distributed,
    peer_failure,
)
from tunesmith.training.loop_config import (
    LOOP_RULES,
    RECORD_KEY,
    Rule,
    RunRecord,
    check_resume,
    check_rules,
    read_record,
)
from tunesmith.training.lr_schedules import schedule_params, set_schedule_params
from tunesmith.training.memory import peak_memory_gb
from tunesmith.training.memory_planner import MemoryPlan
from tunesmith.training.metric_logging import MultiLogger, NullLogger
from tunesmith.training.optim_in_backward import OptimizerInBackward, check_compatible
from tunesmith.training.preflight import PreflightReport, longest_batch, preflight
from tunesmith.training.run_lock import hold_run_lock

__all__ = [
    "AUTOCAST",
    "LOOP_KEYS",
    "LOOP_RUNTIME_ARGS",
    "LOOP_RUNTIME_KWARGS",
    "LossOutput",
    "Objective",
    "build_datasets",
    "check_vocab",
    "fit",
    "make_loader",
    "run_main",
]

Batch = dict[str, torch.Tensor]

# The top-level config keys fit(), make_loader() and build_datasets() read; recipes add theirs.
LOOP_KEYS = [
    "output_dir", "model_dir", "seed", "device", "mixed_precision", "shuffle", "batch_size",
    "gradient_accumulation_steps", "epochs", "max_steps", "stop_after_steps", "optimizer",
    "lr_scheduler", "max_grad_norm", "tokenizer", "dataset", "val_dataset", "val_fraction", "metric_loggers", "log_every_n_steps", "eval_every_n_steps",
    "save_every_n_steps", "keep_last", "resume", "overwrite", "on_nonfinite_loss", "progress_bar",
    "optimizer_in_backward", "activation_offloading", "distributed_timeout_s", "preflight",
    "parallelism",
]  # fmt: skip
# Arguments fit() passes at run time (for `tunesmith validate`).
LOOP_RUNTIME_ARGS = {"tokenizer": 0, "dataset": 1, "val_dataset": 1, "optimizer": 1,
                     "lr_scheduler": 1}  # fmt: skip
LOOP_RUNTIME_KWARGS = {"lr_scheduler": ["num_training_steps"]}


@dataclass
class LossOutput:
    """What an objective returns for one micro-batch.

    Attributes:
        loss: the loss *summed* over the batch's units (:meth:`Objective.units`).
        metrics: other sums over the same units, logged as means (e.g. ``"accuracy"``).
        aux_loss: a term that is already a mean for this micro-batch (MoE load balancing);
            added divided by the number of accumulated micro-batches.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    aux_loss: torch.Tensor | None = None


class Objective(Protocol):
    """A method's loss. ``unit`` names what the loss is summed over (logged per step)."""

    unit: str

    def units(self, batch: Mapping[str, torch.Tensor]) -> int:
        """How many units (trained tokens, pairs) ``batch`` holds; called before the forward."""
        ...

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput: ...


def run_main(train: Callable[[DictConfig, DistributedContext], None], cfg: DictConfig,
             keys: Sequence[str], rules: Mapping[str, Rule] = LOOP_RULES) -> None:  # fmt: skip
    """A recipe's ``main``: check the config's top-level keys (unknown ones, and each value
    against ``rules``: see :mod:`~tunesmith.training.loop_config`), start the process group,
    run ``train(cfg, ctx)``, and turn a dead or hung peer's collective error into one clear
    line."""
    issues = check_keys(cfg, list(keys))
    issues += [i for i in check_rules(cfg, rules) if i.path in keys]
    if issues:
        raise ConfigError.from_issues(issues)
    resume = cfg.get("resume", False)
    if isinstance(resume, str) and not Path(resume).is_dir():  # before anything is written
        raise FileNotFoundError(f"resume={resume}: no such checkpoint folder")
    parallelism = cfg.get("parallelism")
    if isinstance(parallelism, DictConfig):
        parallelism = OmegaConf.to_container(parallelism, resolve=True)
    ctx = init_distributed(cfg.get("device", "auto"), cfg.get("distributed_timeout_s"),
                           parallelism)  # fmt: skip
    if parallelism is not None and ctx.is_rank_zero:
        print(f"parallelism: {ctx.mesh.mesh_dim_names} mesh of {tuple(ctx.mesh.shape)} ranks, "
              f"{ctx.dp_size} data-parallel")  # fmt: skip
    previous_sigterm = signal.getsignal(signal.SIGTERM)
    lock = None
    try:  # one run per output_dir, taken before anything is written into it
        lock = hold_run_lock(cfg.output_dir, ctx) if cfg.get("output_dir") else None
        random.seed(int(cfg.get("seed", 0)))
        torch.manual_seed(int(cfg.get("seed", 0)))
        train(cfg, ctx)
        if ctx.world_size > 1:  # ranks leave together: none tears its group down mid-collective
            dist.barrier()
    except Exception as error:  # a dead or hung peer: say so instead of gloo/NCCL internals
        failure = peer_failure(error, ctx)
        if failure is None:
            raise
        raise failure from error
    finally:
        if lock is not None:
            lock.release()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous_sigterm)  # fit() installed its own
        close_distributed()


def make_loader(
    dataset: Sequence[Any], collate: Callable[[list[Any]], Batch], cfg: DictConfig,
    ctx: DistributedContext,
) -> tuple[StatefulDataLoader, DistributedSampler]:  # fmt: skip
    """This rank's resumable loader over ``dataset`` (a new order every epoch when
    ``cfg.shuffle``, drawn from ``cfg.seed``), its share of the samples that of its
    data-parallel rank (``ctx.dp_rank`` of ``ctx.dp_size``). Incomplete batches are dropped,
    and so are the samples past a multiple of the dp size: how many each epoch leaves out is
    logged."""
    dropped = dropped_per_epoch(len(dataset), ctx.dp_size, int(cfg.batch_size))
    if dropped and ctx.is_rank_zero:
        which = ("a different draw each epoch" if cfg.get("shuffle", True)
                 else "always the same ones: shuffle is off")  # fmt: skip
        print(f"data: {len(dataset)} samples, {ctx.dp_size} data-parallel rank(s) x batch_size "
              f"{cfg.batch_size}: {dropped} sample(s) left out of each epoch (drop_last; "
              f"{which})")  # fmt: skip
    sampler = DistributedSampler(
        dataset, num_replicas=ctx.dp_size, rank=ctx.dp_rank,
        shuffle=bool(cfg.get("shuffle", True)), seed=int(cfg.get("seed", 0)), drop_last=True,
    )  # fmt: skip
    loader = StatefulDataLoader(
        dataset, batch_size=cfg.batch_size, sampler=sampler, collate_fn=collate, drop_last=True
    )
    return loader, sampler


def dropped_per_epoch(samples: int, world_size: int, batch_size: int) -> int:
    """Samples an epoch leaves out: those past a multiple of ``world_size`` (the sampler), then
    on each rank those past a multiple of ``batch_size`` (the last incomplete batch).

    >>> dropped_per_epoch(17, 1, 4), dropped_per_epoch(17, 2, 4), dropped_per_epoch(16, 1, 4)
    (1, 1, 0)
    """
    per_rank = samples // world_size
    return samples - per_rank * world_size + world_size * (per_rank % batch_size)


def build_datasets(
    cfg: DictConfig, tokenizer: Any, log: Callable[[str], None] = print
) -> tuple[Sequence[Any], Sequence[Any] | None]:
    """``cfg.dataset`` and the validation set: ``cfg.val_dataset``, or a seeded
    ``cfg.val_fraction`` of the training samples, or None. Logs the data report."""
    dataset = instantiate(cfg.dataset, tokenizer)
    log(f"dataset: {dataset.report.summary()}")
    val_dataset = instantiate(cfg.val_dataset, tokenizer) if cfg.get("val_dataset") else None
    if val_dataset is None and cfg.get("val_fraction", 0.0) > 0:
        dataset, val_dataset = split_train_val(
            dataset, cfg.val_fraction, seed=int(cfg.get("seed", 0))
        )
    return dataset, val_dataset


def check_vocab(tokenizer: Any, model: nn.Module, cfg: DictConfig, key: str = "model") -> None:
    """Refuse a tokenizer whose ids run past the embedding of ``model`` (built from
    ``cfg[key]``): a model of another vocabulary would index out of range, or on a GPU read
    garbage rows, in the middle of the first step."""
    rows = getattr(getattr(model, "spec", None), "vocab_size", None)
    if rows is not None and tokenizer.vocab_size > rows:
        node = cfg[key]
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name', cfg.tokenizer)} has {tokenizer.vocab_size} "
            f"token ids but {key} ({node.get('path', node._component_)}) embeds only {rows} "
            f"(model.embed_tokens.weight): {key} belongs to another vocabulary"
        )


def fit(
    cfg: DictConfig,
    ctx: DistributedContext,
    *,
    model: nn.Module,
    objective: Objective,
    loader: StatefulDataLoader,
    sampler: DistributedSampler,
    val_dataset: Sequence[Any] | None = None,
    name: str = "train",
    memory_plan: MemoryPlan | None = None,
) -> None:
    """Train ``model`` on ``objective`` over ``loader`` as ``cfg`` says (see the module docs).

    With ``preflight: true`` first runs the objective forward and backward once on the
    longest batch of the data (no update, same RNG) and prints the measured peak, next to
    ``memory_plan``'s estimate when the recipe gives one. Then creates the optimizer
    (``cfg.optimizer``, or one per parameter inside the backward pass with
    ``optimizer_in_backward``) over the parameters that require grad, the schedule, the
    :class:`Checkpointer` (resuming from ``cfg.resume``) and the metric loggers.
    """
    log = print if ctx.is_rank_zero else (lambda *a, **k: None)
    output_dir = Path(cfg.output_dir)
    accum = int(cfg.get("gradient_accumulation_steps", 1))
    steps_per_epoch = len(loader) // accum
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(loader.dataset)} samples make no optimizer step: batch_size {cfg.batch_size} "
            f"x gradient_accumulation_steps {accum} x {ctx.dp_size} data-parallel ranks is "
            "larger"
        )
    total_steps = cfg.get("max_steps") or steps_per_epoch * int(cfg.get("epochs", 1))

    if cfg.get("preflight", False):  # before the optimizer exists: nothing may step
        log(_preflight(cfg, ctx, model, objective, loader).summary(memory_plan))
    trainable = [p for p in model.parameters() if p.requires_grad]
    in_backward = bool(cfg.get("optimizer_in_backward", False))
    if in_backward:  # each parameter steps as soon as its gradient is ready
        check_compatible(accum, cfg.get("max_grad_norm"),
                         on_nonfinite_loss=cfg.get("on_nonfinite_loss", "stop"))  # fmt: skip
        optimizer = OptimizerInBackward(trainable, partial(instantiate, cfg.optimizer))
    else:
        optimizer = instantiate(cfg.optimizer, trainable)
    scheduler = instantiate(cfg.lr_scheduler, optimizer, num_training_steps=total_steps)
    schedule = schedule_params(scheduler)  # this run's length: wins over a checkpoint's
    record = RunRecord(plain_config(cfg), int(total_steps), len(loader.dataset))
    autocast_dtype = AUTOCAST[cfg.get("mixed_precision")]
    offload = bool(cfg.get("activation_offloading", False))

    checkpointer = Checkpointer(
        output_dir / "checkpoints", ctx, keep_last=cfg.get("keep_last"),
        source_dir=cfg.get("model_dir"),
    )  # fmt: skip
    stateful = {"scheduler": scheduler, "dataloader": loader}
    saved_with = {**stateful, RECORD_KEY: record}  # the record is read back before loading
    progress = {"step": 0, "epoch": 0, "tokens_seen": 0}
    # verified; refuses another run's checkpoints; moves aside what a rollback must rewrite
    resized = False  # whether the resumed run's schedule length changed

    def check_config(path: Path) -> None:  # a changed config is refused before anything moves
        nonlocal resized
        resized = _check_resume(path, ctx, record, schedule is not None, log)

    resume_from = checkpointer.start(
        cfg.get("resume", False), overwrite=bool(cfg.get("overwrite", False)),
        check=check_config, log=log,
    )  # fmt: skip
    if resume_from is not None:
        progress = checkpointer.load(resume_from, model, optimizer, stateful, verify=False)
        log(f"resumed from {resume_from} at step {progress['step']}")
        if resized:  # the new length's schedule from the step resumed at
            set_schedule_params(scheduler, schedule)
    loggers = [instantiate(c) for c in cfg.get("metric_loggers") or []]
    logger = MultiLogger(loggers) if ctx.is_rank_zero else NullLogger()
    logger.log_config(record.config)  # environment reads as ${oc.env:...}, never values
    stop_requested = _install_sigterm_handler()

    stream = _micro_batches(loader, sampler, progress)
    bar = tqdm(
        total=total_steps, initial=progress["step"], disable=not (
            ctx.is_rank_zero and cfg.get("progress_bar", True)), desc=name,
    )  # fmt: skip
    last_checkpoint = resume_from
    try:
        step_start = time.perf_counter()
        first_step = progress["step"] + 1  # its time includes compilation and warm-up
        model.train()
        while progress["step"] < total_steps:
            step = progress["step"] + 1
            micro = [next(stream) for _ in range(accum)]
            units = all_reduce_sum(sum(objective.units(mb) for mb in micro), ctx.device,
                                   ctx.dp_cp_group)  # fmt: skip
            step_loss = torch.zeros((), device=ctx.device)
            sums: dict[str, torch.Tensor] = {}
            for mb in micro:
                batch = {k: v.to(ctx.device) for k, v in mb.items()}
                with (
                    torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)),
                    activation_offloading(offload, device=ctx.device),
                ):
                    out = objective(model, batch)
                loss = out.loss * ctx.dp_cp_size / units.float()  # FSDP2 averages over dp x cp
                if out.aux_loss is not None:  # already a mean over this micro-batch
                    loss = loss + out.aux_loss / accum
                loss.backward()
                step_loss += loss.detach()
                _add_metrics(sums, out.metrics)
            step_loss = all_reduce_sum(step_loss, ctx.device, ctx.dp_cp_group) / ctx.dp_cp_size
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
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            progress["step"] = step
            real_tokens = sum(_real_tokens(mb) for mb in micro)
            seen = all_reduce_sum(real_tokens, ctx.device, ctx.dp_cp_group)
            progress["tokens_seen"] += int(seen.item())
            bar.update(1)

            if step % int(cfg.get("log_every_n_steps", 1)) == 0 or step == total_steps:
                elapsed = time.perf_counter() - step_start
                metrics = {
                    "loss": step_loss.item(), "lr": scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm, "tokens_seen": progress["tokens_seen"],
                    objective.unit: int(units.item()),
                    "tokens_per_s": real_tokens * ctx.dp_cp_size / elapsed,
                    "peak_memory_gb": peak_memory_gb(ctx.device),
                }  # fmt: skip
                metrics |= _means(sums, units, ctx)
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
                logger.log(step, evaluate(model, objective, val_dataset, loader.collate_fn, ctx,
                                          cfg.batch_size, autocast_dtype))  # fmt: skip
            stop = bool(all_reduce_sum(float(stop_requested()), ctx.device).item())
            stop_after = cfg.get("stop_after_steps")
            stop_early = stop_after is not None and step == int(stop_after) < total_steps
            if _every(step, cfg.get("save_every_n_steps"), total_steps) or stop or stop_early:
                last_checkpoint = checkpointer.save(step, model, optimizer, saved_with, progress)
                log(f"checkpoint: {last_checkpoint}")
            if stop or stop_early:
                reason = "SIGTERM" if stop else f"stop_after_steps={stop_after}"
                log(f"{reason}: stopped after step {step}; resume with resume=true")
                break
            step_start = time.perf_counter()
    finally:
        bar.close()
        logger.close()


def evaluate(
    model: nn.Module, objective: Objective, dataset: Sequence[Any],
    collate: Callable[[list[Any]], Batch], ctx: DistributedContext, batch_size: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:  # fmt: skip
    """``val_loss`` and ``val_<metric>``: the objective's sums over ``dataset`` divided by its
    units, with no gradient. Data-parallel rank ``r`` takes items ``r, r + dp_size, ...``;
    every rank runs the same number of batches (a sharded model needs each forward on all
    ranks), a rank short of items repeating one whose result it then discards, so no item
    counts twice."""
    mine = list(range(ctx.dp_rank, len(dataset), ctx.dp_size))
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    rounds = len(batches)
    if ctx.world_size > 1:
        count = torch.tensor(rounds, device=ctx.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        rounds = int(count.item())
    sums: dict[str, torch.Tensor] = {}
    units = 0
    model.eval()
    with (
        torch.no_grad(),
        torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)),
    ):
        for i in range(rounds):
            counted = i < len(batches)
            mb = collate([dataset[j] for j in (batches[i] if counted else [0])])
            out = objective(model, {k: v.to(ctx.device) for k, v in mb.items()})
            metrics = {"loss": out.loss, **out.metrics}
            if not counted:  # zeros keep every rank's metric names (and all-reduces) equal
                metrics = {k: torch.zeros_like(v) for k, v in metrics.items()}
            _add_metrics(sums, metrics)
            units += objective.units(mb) if counted else 0
    model.train()
    total_units = all_reduce_sum(units, ctx.device, ctx.dp_cp_group)
    return {f"val_{k}": v for k, v in _means(sums, total_units, ctx).items()}


def _preflight(cfg: DictConfig, ctx: DistributedContext, model: nn.Module, objective: Objective,
               loader: StatefulDataLoader) -> PreflightReport:  # fmt: skip
    """One forward and backward of ``objective`` on the longest batch of the loader's data."""
    dataset = loader.dataset
    batch = longest_batch(dataset, min(int(cfg.batch_size), len(dataset)), loader.collate_fn)
    autocast_dtype = AUTOCAST[cfg.get("mixed_precision")]

    def batch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)):
            out = objective(model, batch)
        return out.loss if out.aux_loss is None else out.loss + out.aux_loss

    return preflight(
        model, {k: v.to(ctx.device) for k, v in batch.items()}, batch_loss, device=ctx.device,
        free_grads_in_backward=bool(cfg.get("optimizer_in_backward", False)),
    )  # fmt: skip


def _add_metrics(sums: dict[str, torch.Tensor], metrics: Mapping[str, torch.Tensor]) -> None:
    for key, value in metrics.items():
        value = value.detach().to(torch.float64)
        sums[key] = sums[key] + value if key in sums else value


def _means(
    sums: Mapping[str, torch.Tensor], units: torch.Tensor, ctx: DistributedContext
) -> dict[str, float]:
    """Each summed metric over the dp x cp ranks divided by the global unit count."""
    return {
        key: (all_reduce_sum(value, ctx.device, ctx.dp_cp_group) / units.to(torch.float64)).item()
        for key, value in sorted(sums.items())
    }


def _real_tokens(batch: Mapping[str, torch.Tensor]) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return int((batch["document_ids"] >= 0).sum())


def _clip(model: nn.Module, max_norm: float | None) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else float("inf"))
    if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _every(step: int, every: int | None, total: int) -> bool:
    return step == total or bool(every) and step % int(every) == 0


def _micro_batches(loader, sampler, progress: dict[str, int]) -> Iterator[Batch]:
    """Endless stream of micro-batches; ``progress["epoch"]`` advances at each epoch end."""
    while True:
        sampler.set_epoch(progress["epoch"])
        yield from loader
        progress["epoch"] += 1


def _check_resume(checkpoint: Path, ctx: DistributedContext, record: RunRecord,
                  resizable: bool, log: Callable[[str], None]) -> bool:  # fmt: skip
    """Refuse to resume ``checkpoint`` with changed keys that may not change (see
    :func:`~tunesmith.training.loop_config.check_resume`), log the changes that apply; returns
    whether the schedule length changed."""
    saved = read_record(checkpoint, ctx.rank)
    if saved is None:  # unreadable: the checkpoint loader says why
        return False
    if saved is False:
        log(
            f"warning: {checkpoint} does not record its run's config (an older checkpoint): "
            "changes to the config cannot be checked; the LR schedule continues as saved"
        )
        return False
    for note in check_resume(checkpoint, saved, record, resizable=resizable):
        log(note)
    return saved.total_steps != record.total_steps


def _install_sigterm_handler() -> Callable[[], bool]:
    """SIGTERM asks for a checkpoint at the end of the current step, then a clean exit."""
    received = {"flag": False}

    def handler(signum, frame):
        received["flag"] = True

    if threading.current_thread() is threading.main_thread():  # signals only reach it
        signal.signal(signal.SIGTERM, handler)
    return lambda: received["flag"]
