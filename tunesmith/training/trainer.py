"""The Trainer: one optimizer step at a time over the micro-batches a batch source gives it.

An :class:`Objective` says what one micro-batch's loss is: a *sum* over some unit (trained
tokens for SFT and KD, preference pairs for DPO and reward models), plus summed metrics.
:meth:`Trainer.step` does the rest, identically for every method: it counts the units of the
step's micro-batches on the data-parallel ranks (``ctx.dp_cp_group``), backpropagates each
summed loss divided by that count (times ``ctx.dp_cp_size``, since FSDP averages gradients
over those ranks), so the update equals one big batch's mean; then clips, applies the
non-finite policy, steps the optimizer (or lets an optimizer in backward do it) and the LR
schedule, and calls the ``on_step_end`` hooks. :meth:`save` / :meth:`start` / :meth:`load`
checkpoint and resume it with its :class:`~tunesmith.training.sources.BatchSource`.

Example (a recipe's loop; :func:`~tunesmith.training.loop.fit` adds logging and stopping)::

    settings = LoopSettings(output_dir="runs/exp1", batch_size=4, max_steps=100)
    source = DatasetSource.build(dataset, collate, settings, ctx)
    trainer = Trainer(settings, ctx, model=model, objective=objective, source=source,
                      optimizer=partial(torch.optim.AdamW, lr=1e-4),
                      lr_scheduler=partial(cosine_with_warmup, num_warmup_steps=10))
    trainer.start()                                # settings.resume picks the checkpoint
    while not trainer.done:
        metrics = trainer.step(source.next_step())
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from tunesmith.config import instantiate, plain_config
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.training.checkpoint.checkpointer import Checkpointer
from tunesmith.training.loop_config import RECORD_KEY, RunRecord, check_resume, read_record
from tunesmith.training.lr_schedules import schedule_params, set_schedule_params
from tunesmith.training.memory.activations import activation_offloading
from tunesmith.training.memory.optim_in_backward import OptimizerInBackward, check_compatible
from tunesmith.training.parallel.context_parallel import check_objective, shard_batch
from tunesmith.training.parallel.distributed import DistributedContext, all_reduce_sum, full_tensor
from tunesmith.training.precision import build_optimizer
from tunesmith.training.router_stats import (
    read_expert_loads,
    reset_router_statistics,
    summarise_expert_loads,
    track_routing,
)
from tunesmith.training.settings import RESUMABLE_KEYS, LoopSettings
from tunesmith.training.sources import BatchSource

__all__ = [
    "LossOutput", "Objective", "OptimizerFactory", "SchedulerFactory", "StepHook", "Trainer",
    "evaluate",
]  # fmt: skip

Batch = dict[str, torch.Tensor]
OptimizerFactory = Callable[[Iterable[Any]], torch.optim.Optimizer]
"""Builds the optimizer over parameters (or parameter groups): ``partial(torch.optim.AdamW,
lr=1e-4)``. The trainer calls it (wrapped for master weights or a step in backward)."""
SchedulerFactory = Callable[..., Any]
"""``factory(optimizer, num_training_steps=N)`` -> the LR schedule:
``partial(tunesmith.training.cosine_with_warmup, num_warmup_steps=10)``."""


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
    """A method's loss. ``unit`` names what the loss is summed over (logged per step).

    An objective may also define ``prepare_step(model, micro_batches, counted=True)``: called
    once per optimizer step with all of the step's micro-batches (as the source gave them, on
    the host) before the first forward, under ``torch.no_grad()`` and the step's autocast, on
    every data-parallel rank (it may all-reduce over them), and by :func:`evaluate` before each
    validation batch (with that batch alone, on the device; ``counted=False`` for the repeat a
    rank short of items runs, whose results are discarded). It computes what the losses of
    the whole step share, e.g. KTO's KL estimate over all micro-batches and ranks
    (:class:`~tunesmith.training.objectives.unpaired.KTOObjective`), so accumulation equals
    one big batch; objectives without it are called as before.
    """

    unit: str

    def units(self, batch: Mapping[str, torch.Tensor]) -> int:
        """How many units (trained tokens, pairs) ``batch`` holds; called before the forward."""
        ...

    def __call__(self, model: nn.Module, batch: Batch) -> LossOutput: ...


StepHook = Callable[["Trainer", int, dict[str, float]], None]
"""``hook(trainer, step, metrics)``, called after each optimizer step (e.g. sync weights to a
generator, bump a policy version; ``trainer.expert_loads`` holds the step's MoE expert loads,
as DeepSeek-V3's bias balancing reads them)."""


class Trainer:
    """Optimizer, LR schedule, checkpoints and progress counters of one run of ``model`` on
    ``objective``, as ``settings`` say (``max_steps``/``epochs``, ``max_grad_norm``,
    ``on_nonfinite_loss``, ``mixed_precision``, ``precision``, ``optimizer_in_backward``,
    ``activation_offloading``, ``output_dir``, ``keep_last``, ``resume``, ``overwrite``...);
    ``optimizer`` and ``lr_scheduler`` build the two over the trained parameters
    (:data:`OptimizerFactory`, :data:`SchedulerFactory`). :meth:`from_config` builds it all
    from a config.

    ``source`` is checkpointed with the trainer (its state under ``"dataloader"``, its
    ``epoch`` in the progress counters); without ``steps_per_epoch`` on it,
    ``settings.max_steps`` sets the run's length. ``schedule_steps`` is the LR schedule's
    length when it is not the run's (a subclass whose first steps leave the model alone, e.g.
    PPO's critic warm-up). ``run_config`` is what each checkpoint records of the run (a resume
    refuses changes outside ``resumable``); without it, the settings themselves.

    Example::

        trainer = Trainer(settings, ctx, model=model, objective=objective, source=source,
                          optimizer=partial(torch.optim.AdamW, lr=1e-4),
                          lr_scheduler=partial(cosine_with_warmup, num_warmup_steps=10))
        trainer.on_step_end.append(lambda t, step, metrics: print(step, metrics["loss"]))
        trainer.step(source.next_step())["loss"]
        # -> 2.31
    """

    def __init__(
        self,
        settings: LoopSettings,
        ctx: DistributedContext,
        *,
        model: nn.Module,
        objective: Objective,
        optimizer: OptimizerFactory,
        lr_scheduler: SchedulerFactory,
        source: BatchSource | None = None,
        run_config: Mapping[str, Any] | None = None,
        resumable: Collection[str] = RESUMABLE_KEYS,
        on_step_end: Sequence[StepHook] = (),
        schedule_steps: int | None = None,
    ) -> None:
        self.settings, self.ctx, self.model, self.objective = settings, ctx, model, objective
        check_objective(objective, ctx.cp_size)  # context parallel: refused where not exact
        self.source = source
        self.on_step_end: list[StepHook] = list(on_step_end)
        self.log = print if ctx.is_rank_zero else (lambda *a, **k: None)
        self.total_steps = settings.max_steps or _steps_per_epoch(source) * settings.epochs
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.in_backward = settings.optimizer_in_backward
        self.precision = settings.precision  # bf16 weights, master copies, save dtype
        if self.in_backward:  # each parameter steps as soon as its gradient is ready
            check_compatible(
                settings.gradient_accumulation_steps,
                settings.max_grad_norm,
                on_nonfinite_loss=settings.on_nonfinite_loss,
            )
            self.optimizer = OptimizerInBackward(trainable, optimizer)
        else:
            params = trainable if self.precision.master_weights else _by_kind(trainable)
            self.optimizer = build_optimizer(self.precision, params, optimizer)
        self.scheduler = lr_scheduler(
            self.optimizer, num_training_steps=schedule_steps or self.total_steps
        )
        self._schedule = schedule_params(self.scheduler)  # this run's: wins over a checkpoint's
        record = dict(run_config) if run_config is not None else settings.as_config()
        self.record = RunRecord(
            record, self.total_steps, int(getattr(source, "samples", 0)), data_parallel=ctx.dp_size
        )
        self.resumable = frozenset(resumable)
        self.autocast_dtype = AUTOCAST[settings.mixed_precision]
        self.offload = settings.activation_offloading
        self.checkpointer = Checkpointer(
            Path(settings.output_dir) / "checkpoints",
            ctx,
            keep_last=settings.keep_last,
            source_dir=settings.model_dir,
            save_dtype=self.precision.save_dtype,
        )
        self.progress = {"step": 0, "tokens_seen": 0}
        self.last_checkpoint: Path | None = None
        self.rank_tokens = 0  # real (non-padding) tokens of the last step on this rank
        track_routing(model)  # MoE layers count their experts' load (router_stats)
        # the last step's expert load per MoE layer, summed over ctx.dp_cp_group: the router
        # statistics and on_step_end hooks (DeepSeek-V3's bias balancing) read it
        self.expert_loads: dict[nn.Module, torch.Tensor] = {}

    @classmethod
    def from_config(
        cls,
        cfg: DictConfig,
        ctx: DistributedContext,
        *,
        model: nn.Module,
        objective: Objective,
        source: BatchSource | None = None,
        resumable: Collection[str] = (),
        **kwargs: Any,
    ) -> Trainer:
        """The trainer a config asks for: its :class:`LoopSettings`, its ``optimizer`` and
        ``lr_scheduler`` components, and the config itself recorded in every checkpoint (a
        resume compares it; ``resumable``: the recipe's own keys that may change then).
        ``kwargs`` go to the constructor (``on_step_end``, ``schedule_steps``, a subclass's).

        Example::

            trainer = Trainer.from_config(cfg, ctx, model=model, objective=objective,
                                          source=source)
        """
        return cls(
            LoopSettings.from_config(cfg),
            ctx,
            model=model,
            objective=objective,
            optimizer=partial(instantiate, cfg.optimizer),
            lr_scheduler=partial(instantiate, cfg.lr_scheduler),
            source=source,
            run_config=plain_config(cfg),
            resumable=RESUMABLE_KEYS | set(resumable),
            **kwargs,
        )

    @property
    def done(self) -> bool:
        return self.progress["step"] >= self.total_steps

    def step(self, micro_batches: Sequence[Batch]) -> dict[str, float]:
        """One optimizer step over ``micro_batches`` (in train mode); returns its metrics:
        ``loss``, ``lr`` (the learning rate this update used), ``grad_norm`` (when computed:
        see :attr:`computes_grad_norm`), ``tokens_seen``, the unit count and the objective's metrics as means over the units.

        Its phases run in named ``torch.profiler.record_function`` ranges (``trainer/units``,
        ``trainer/prepare`` (an objective's ``prepare_step``), ``trainer/objective``, ``trainer/backward``, ``trainer/grad_norm``,
        ``trainer/optimizer``, ``trainer/metrics``), so a profiler trace splits the step."""
        ctx, objective, accum = self.ctx, self.objective, len(micro_batches)
        step = self.progress["step"] + 1
        micro_batches = [_cp_share(mb, ctx) for mb in micro_batches]  # context parallel
        self.model.train()
        reset_router_statistics(self.model)  # MoE: count this step's routing only
        with record_function("trainer/units"):
            local = sum(objective.units(mb) for mb in micro_batches)
            units = all_reduce_sum(local, ctx.device, ctx.dp_cp_group)
            # a world of one knows its count: no device-to-host copy of the sum
            count = int(local) if ctx.dp_cp_size == 1 else int(units.item())
        if count == 0:  # on every rank: the count is global
            return self._empty_step(step, micro_batches)
        self._prepare(micro_batches)
        step_loss = torch.zeros((), device=ctx.device)
        sums: dict[str, torch.Tensor] = {}
        for mb in micro_batches:
            batch = {k: v.to(ctx.device) for k, v in mb.items()}
            with (
                record_function("trainer/objective"),
                torch.autocast(
                    ctx.device.type, self.autocast_dtype, enabled=bool(self.autocast_dtype)
                ),
                activation_offloading(self.offload, device=ctx.device),
            ):
                out = objective(self.model, batch)
            with record_function("trainer/backward"):
                loss = out.loss * ctx.dp_cp_size / units.float()  # FSDP2 averages over dp x cp
                if out.aux_loss is not None:  # already a mean over this micro-batch
                    loss = loss + out.aux_loss / accum
                loss.backward()
            step_loss += loss.detach()
            _add_metrics(sums, out.metrics)
        step_loss = all_reduce_sum(step_loss, ctx.device, ctx.dp_cp_group) / ctx.dp_cp_size
        # with the optimizer in backward the update is done and no gradient is left
        with record_function("trainer/grad_norm"):
            grad_norm = (
                _clip(self.model, self.settings.max_grad_norm) if self.computes_grad_norm else None
            )
        loss_value = step_loss.item()
        if not (math.isfinite(loss_value) and (grad_norm is None or math.isfinite(grad_norm))):
            norm_text = "" if grad_norm is None else f" / grad norm {grad_norm}"
            message = f"loss {loss_value}{norm_text} at step {step}"
            if self.settings.on_nonfinite_loss == "stop":
                raise FloatingPointError(
                    f"{message}; stopping (last good checkpoint: {self.last_checkpoint}). "
                    "Set on_nonfinite_loss=skip to skip such batches."
                )
            self.log(f"skipping the update: {message}")
            update = False
        else:
            update = True
        lr = self.scheduler.get_last_lr()[0]  # what this update used (logged as such)
        with record_function("trainer/optimizer"):
            if update:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        with record_function("trainer/metrics"):
            self.progress["step"] = step
            self.rank_tokens = sum(_real_tokens(mb) for mb in micro_batches)
            seen = (
                self.rank_tokens
                if ctx.dp_cp_size == 1
                else int(all_reduce_sum(self.rank_tokens, ctx.device, ctx.dp_cp_group).item())
            )
            self.progress["tokens_seen"] += int(seen)
            metrics = {
                "loss": loss_value, "lr": lr,
                "grad_norm": grad_norm, "tokens_seen": self.progress["tokens_seen"],
                objective.unit: count // _unit_copies(objective, ctx),
            }  # fmt: skip
            if grad_norm is None:
                del metrics["grad_norm"]
            metrics |= _means(sums, units, ctx)
            self.expert_loads = read_expert_loads(self.model, ctx.device, ctx.dp_cp_group)
            metrics |= summarise_expert_loads(self.expert_loads)
        for hook in self.on_step_end:
            hook(self, step, metrics)
        return metrics

    def _prepare(self, micro_batches: Sequence[Batch]) -> None:
        """The objective's ``prepare_step`` (see :class:`Objective`), when it has one."""
        prepare = getattr(self.objective, "prepare_step", None)
        if prepare is None:
            return
        dtype = self.autocast_dtype
        with (
            record_function("trainer/prepare"),
            torch.no_grad(),
            torch.autocast(self.ctx.device.type, dtype, enabled=bool(dtype)),
        ):
            prepare(self.model, micro_batches)

    @property
    def computes_grad_norm(self) -> bool:
        """Whether :meth:`step` computes (and reports as ``grad_norm``) the gradients' global
        norm: when clipping needs it (``max_grad_norm`` set) or ``log_grad_norm: true`` asks
        for it; never with the optimizer in backward (no gradient is left to norm). Without
        it the step skips a pass over every gradient, and the non-finite check
        (``on_nonfinite_loss``) looks at the loss alone.

        Example::

            Trainer.from_config(cfg, ctx, model=model, objective=objective).computes_grad_norm
            # -> True
        """
        if self.in_backward:
            return False
        return bool(self.settings.max_grad_norm) or self.settings.log_grad_norm

    def _empty_step(self, step: int, micro_batches: Sequence[Batch]) -> dict[str, float]:
        """A step whose micro-batches hold no unit to train on anywhere (e.g. an RL batch whose
        completions were all cut with ``overlong_filter``): no forward and no update, but the
        step counts (schedule, progress, hooks) and says so (``skipped_update``)."""
        self.log(
            f"step {step}: no {self.objective.unit} to train on in this step's batches; "
            "the update is skipped"
        )
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():  # torch warns of a schedule stepped without an update
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.progress["step"] = step
        self.expert_loads = {}  # no forward: no expert load
        self.rank_tokens = sum(_real_tokens(mb) for mb in micro_batches)
        seen = all_reduce_sum(self.rank_tokens, self.ctx.device, self.ctx.dp_cp_group)
        self.progress["tokens_seen"] += int(seen.item())
        metrics = {"loss": 0.0, "lr": lr,
                   "tokens_seen": self.progress["tokens_seen"], self.objective.unit: 0,
                   "skipped_update": 1.0}  # fmt: skip
        for hook in self.on_step_end:
            hook(self, step, metrics)
        return metrics

    def evaluate(
        self, dataset: Sequence[Any], collate: Callable[[list[Any]], Batch] | None = None
    ) -> dict[str, float]:
        """``val_loss`` and ``val_<metric>`` over ``dataset`` (see :func:`evaluate`), batched by
        ``collate`` (default: the source's) in ``settings.batch_size``; the model's mode is
        restored.
        """
        collate = collate if collate is not None else self.source.collate
        return evaluate(
            self.model,
            self.objective,
            dataset,
            collate,
            self.ctx,
            self.settings.batch_size,
            self.autocast_dtype,
        )

    def save(self) -> Path:
        """Checkpoint the current step (a collective); returns its folder."""
        progress = {"step": self.progress["step"], "epoch": getattr(self.source, "epoch", 0),
                    "tokens_seen": self.progress["tokens_seen"]}  # fmt: skip
        saved_with = {**self._stateful(), RECORD_KEY: self.record}  # the record is read first
        self.last_checkpoint = self.checkpointer.save(
            self.progress["step"], self.model, self.optimizer, saved_with, progress
        )
        return self.last_checkpoint

    def start(self) -> Path | None:
        """Begin the run as ``settings.resume`` / ``settings.overwrite`` say (see
        :meth:`Checkpointer.start`: a changed config is refused before anything moves), loading
        the checkpoint it picks; returns that checkpoint (None: step 0)."""
        resized = False

        def check(path: Path) -> None:
            nonlocal resized
            resized = self._check_config(path)

        path = self.checkpointer.start(
            self.settings.resume,
            overwrite=self.settings.overwrite,
            check=check,
            log=self.log,
        )
        if path is not None:
            self._restore(path, resized, verify=False)  # start() verified it
        return path

    def load(self, path: str | Path) -> None:
        """Resume from checkpoint ``path`` (verified; a changed config refused)."""
        self._restore(Path(path), self._check_config(Path(path)), verify=True)

    def _restore(self, path: Path, resized: bool, verify: bool) -> None:
        progress = self.checkpointer.load(
            path, self.model, self.optimizer, self._stateful(), verify=verify
        )
        self.progress = {"step": progress["step"], "tokens_seen": progress["tokens_seen"]}
        if self.source is not None:
            self.source.epoch = progress.get("epoch", 0)
        self.last_checkpoint = path
        self.log(f"resumed from {path} at step {progress['step']}")
        if resized:  # the new length's schedule from the step resumed at
            set_schedule_params(self.scheduler, self._schedule)

    def _stateful(self) -> dict[str, Any]:
        stateful: dict[str, Any] = {"scheduler": self.scheduler}
        if self.source is not None:
            stateful["dataloader"] = self.source  # the name it had before batch sources
        return stateful

    def _check_config(self, checkpoint: Path) -> bool:
        """Refuse to resume ``checkpoint`` with changed keys that may not change (see
        :func:`~tunesmith.training.loop_config.check_resume`), log the changes that apply;
        returns whether the schedule length changed."""
        saved = read_record(checkpoint, self.ctx.rank)
        if saved is None:  # unreadable: the checkpoint loader says why
            return False
        if saved is False:
            self.log(
                f"warning: {checkpoint} does not record its run's config (an older "
                "checkpoint): changes to the config cannot be checked; the LR schedule "
                "continues as saved"
            )
            return False
        for note in check_resume(
            checkpoint,
            saved,
            self.record,
            resumable=self.resumable,
            resizable=self._schedule is not None,
        ):
            self.log(note)
        return saved.total_steps != self.record.total_steps


def evaluate(
    model: nn.Module,
    objective: Objective,
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], Batch],
    ctx: DistributedContext,
    batch_size: int,
    autocast_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """``val_loss`` and ``val_<metric>``: the objective's sums over ``dataset`` divided by its
    units, with no gradient, in eval mode (the model's mode is restored after). Data-parallel
    rank ``r`` takes items ``r, r + dp_size, ...``; every rank runs the same number of batches
    (a sharded model needs each forward on all ranks), a rank short of items repeating one
    whose result it then discards, so no item counts twice."""
    mine = list(range(ctx.dp_rank, len(dataset), ctx.dp_size))
    batches = [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]
    rounds = len(batches)
    if ctx.world_size > 1:
        count = torch.tensor(rounds, device=ctx.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        rounds = int(count.item())
    sums: dict[str, torch.Tensor] = {}
    units = 0
    prepare = getattr(objective, "prepare_step", None)  # see Objective
    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)),
        ):
            for i in range(rounds):
                counted = i < len(batches)
                mb = _cp_share(collate([dataset[j] for j in (batches[i] if counted else [0])]), ctx)
                batch = {k: v.to(ctx.device) for k, v in mb.items()}
                if prepare is not None:
                    prepare(model, [batch], counted=counted)
                out = objective(model, batch)
                metrics = {"loss": out.loss, **out.metrics}
                if not counted:  # zeros keep every rank's metric names (and all-reduces) equal
                    metrics = {k: torch.zeros_like(v) for k, v in metrics.items()}
                _add_metrics(sums, metrics)
                units += objective.units(mb) if counted else 0
    finally:
        model.train(was_training)
    total_units = all_reduce_sum(units, ctx.device, ctx.dp_cp_group)
    return {f"val_{k}": v for k, v in _means(sums, total_units, ctx).items()}


def _cp_share(batch: Batch, ctx: DistributedContext) -> Batch:
    """This rank's share of each row under context parallel (the batch as is without)."""
    if ctx.cp_size == 1:
        return batch
    multiple = ctx.dims.tp if ctx.dims.sequence_parallel else 1  # whole tp shards
    return shard_batch(batch, cp_rank=ctx.cp_rank, cp_size=ctx.cp_size, multiple=multiple)


def _unit_copies(objective: Objective, ctx: DistributedContext) -> int:
    """How many ranks count each unit: the cp ranks of a row-level objective all do."""
    return ctx.cp_size if getattr(objective, "context_parallel", None) == "rows" else 1


def _by_kind(params: list[nn.Parameter]) -> list[nn.Parameter] | list[dict[str, Any]]:
    """``params``, or two parameter groups when DTensors and plain tensors mix (a
    tensor-parallel model's replicated score head or router): torch's fused and for-each
    optimizer kernels take one kind per call.

    >>> _by_kind([nn.Parameter(torch.ones(1))])[0].shape
    torch.Size([1])
    """
    sharded = [p for p in params if isinstance(p, DTensor)]
    if not sharded or len(sharded) == len(params):
        return params
    return [{"params": sharded}, {"params": [p for p in params if not isinstance(p, DTensor)]}]


def _steps_per_epoch(source: BatchSource | None) -> int:
    steps = getattr(source, "steps_per_epoch", None)
    if steps is None:
        raise ValueError("max_steps is needed: the batch source has no epochs to count")
    return int(steps)


def _add_metrics(sums: dict[str, torch.Tensor], metrics: Mapping[str, torch.Tensor]) -> None:
    for key, value in metrics.items():
        value = value.detach().to(torch.float64)
        sums[key] = sums[key] + value if key in sums else value


def _means(
    sums: Mapping[str, torch.Tensor], units: torch.Tensor, ctx: DistributedContext
) -> dict[str, float]:
    """Each summed metric over the dp x cp ranks divided by the global unit count (one
    all-reduce and one host sync for all of them: ``step`` reports them every step)."""
    if not sums:
        return {}
    keys = sorted(sums)
    stacked = torch.stack([sums[key].reshape(()) for key in keys])
    totals = all_reduce_sum(stacked, ctx.device, ctx.dp_cp_group) / units.to(torch.float64)
    return dict(zip(keys, totals.tolist()))


def _real_tokens(batch: Mapping[str, torch.Tensor]) -> int:
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    if "document_ids" in batch:
        return int((batch["document_ids"] >= 0).sum())
    return int(batch["input_ids"].numel()) if "input_ids" in batch else 0


def _clip(model: nn.Module, max_norm: float | None) -> float:
    """The global gradient norm (clipped to ``max_norm`` when set). Gradients on different
    meshes (tensor parallel with FSDP2: 2-D DTensors next to data-parallel-only or plain
    replicated ones) are normed per mesh and layout, and the parts combined. Gradients are
    multiplied only when the clipping coefficient is below 1 (torch's
    ``clip_grad_norm_`` multiplies by the clamped coefficient always: a pass over every
    gradient that changes nothing when it is 1)."""
    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        grad = p.grad
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    if len(groups) <= 1:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if not max_norm:
            return float(full_tensor(norm))
        coefficient = float(max_norm) / (norm + 1e-6)  # as clip_grads_with_norm_ computes it
        value, scale = torch.stack([full_tensor(norm), full_tensor(coefficient)]).tolist()
        if scale < 1.0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return value
    parts = [
        full_tensor(torch.nn.utils.get_total_norm([p.grad for p in group])).double()
        for group in groups.values()
    ]
    norm = float(torch.linalg.vector_norm(torch.stack(parts)))
    if max_norm and norm > max_norm:
        for group in groups.values():
            torch._foreach_mul_([p.grad for p in group], max_norm / (norm + 1e-6))
    return norm
