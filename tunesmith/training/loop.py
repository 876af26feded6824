"""The training loop every recipe shares; a recipe brings its data, its model and its objective.

:func:`fit` is the loop of every recipe around a :class:`~tunesmith.training.trainer.Trainer`
fed by a :class:`~tunesmith.training.sources.BatchSource` (a
:class:`~tunesmith.training.sources.DatasetSource` for SFT, DPO, KD and reward models; a
rollout source for RL)::

    trainer.start()                                  # resume=... : the checkpoint to continue
    while not trainer.done:
        metrics = trainer.step(source.next_step())   # one optimizer step
        log(window means); maybe evaluate; maybe save; stop on a signal or stop_after_steps

Saving: every ``save_every_n_steps`` steps and/or every ``save_every_minutes`` of wall time
(rank 0's clock decides, one all-reduce makes every rank agree), and after the last step.
Ctrl-C (SIGINT), SIGTERM and SIGHUP (:mod:`~tunesmith.training.stop_signals`) each ask for a
checkpoint at the end of the current step and a clean exit (code 0) with the resume hint; a
second Ctrl-C aborts at once. Logging: every ``log_every_n_steps`` steps the means of the steps
since the last line (:class:`~tunesmith.training.logging.loggers.MetricWindow`: the loss over
every unit of the window); ``progress_bar: auto`` (the default) shows a bar when stdout is a
terminal.
``resume: true`` with no checkpoint in ``output_dir`` is refused; ``resume: auto`` resumes
when there is one and starts fresh otherwise.

Example (the core of a recipe; :func:`fit_from_config` builds the trainer, its loggers and
its samples from the config, then calls :func:`fit`)::

    ctx = init_distributed("cpu")
    settings = LoopSettings.from_config(cfg)
    source = DatasetSource.build(dataset, collate, settings, ctx)
    fit_from_config(cfg, ctx, model=model, objective=objective, source=source, name="sft")

Without a config (see docs/library.md)::

    trainer = Trainer(settings, ctx, model=model, objective=objective, source=source,
                      optimizer=partial(torch.optim.AdamW, lr=1e-4),
                      lr_scheduler=partial(cosine_with_warmup, num_warmup_steps=10))
    fit(trainer, source, val_dataset=val_dataset, loggers=[JSONLLogger("runs/exp1")])
"""

from __future__ import annotations

import copy
import os
import random
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from tunesmith.config import ConfigError, check_keys, instantiate
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.training import qat
from tunesmith.training.checkpoint.checkpointer import not_continued
from tunesmith.training.checkpoint.run_lock import hold_run_lock
from tunesmith.training.datasets import inherit_val_dataset
from tunesmith.training.logging.console import FORMATS, RunSummary, parameter_line
from tunesmith.training.logging.loggers import (
    MetricLogger,
    MetricWindow,
    MultiLogger,
    NullLogger,
    StdoutLogger,
)
from tunesmith.training.logging.quiet import quiet_third_party
from tunesmith.training.memory.planner import MemoryPlan
from tunesmith.training.memory.preflight import PreflightReport, longest_batch, preflight
from tunesmith.training.memory.usage import peak_memory_metric
from tunesmith.training.moe_balancing import BiasBalancing
from tunesmith.training.parallel.distributed import (
    DistributedContext,
    all_reduce_sum,
    close_distributed,
    init_distributed,
    peer_failure,
)
from tunesmith.training.rules import Rule, check_rules
from tunesmith.training.sample_prompts import SamplePrompts
from tunesmith.training.settings import LOOP_KEYS, LOOP_RULES, LoopSettings, value_of
from tunesmith.training.sources import BatchSource, DatasetSource, dropped_per_epoch, make_loader
from tunesmith.training.stop_signals import handle_stop_signals, keep_handlers
from tunesmith.training.trainer import LossOutput, Objective, Trainer, evaluate

__all__ = [
    "AUTOCAST",
    "LOOP_KEYS",
    "LOOP_RUNTIME_ARGS",
    "LOOP_RUNTIME_KWARGS",
    "LossOutput",
    "Objective",
    "dropped_per_epoch",
    "evaluate",
    "fit",
    "fit_from_config",
    "make_loader",
    "run_main",
]

Batch = dict[str, torch.Tensor]

# Arguments fit() passes at run time (for `tunesmith validate`).
LOOP_RUNTIME_ARGS = {"tokenizer": 0, "dataset": 1, "val_dataset": 1, "optimizer": 1,
                     "lr_scheduler": 1}  # fmt: skip
LOOP_RUNTIME_KWARGS = {"lr_scheduler": ["num_training_steps"]}


def run_main(
    train: Callable[[DictConfig, DistributedContext], None],
    cfg: DictConfig,
    keys: Sequence[str],
    rules: Mapping[str, Rule] = LOOP_RULES,
) -> None:
    """A recipe's ``main``: check the config's top-level keys (unknown ones, and each value
    against ``rules``: see :mod:`~tunesmith.training.loop_config`), start the process group,
    run ``train(cfg, ctx)`` (known third-party notices left out:
    :func:`~tunesmith.training.logging.quiet.quiet_third_party`), and turn a dead or hung
    peer's collective error into one clear line."""
    cfg = inherit_val_dataset(cfg)
    issues = check_keys(cfg, list(keys))
    issues += [i for i in check_rules(cfg, rules) if i.path in keys]
    if issues:
        raise ConfigError.from_issues(issues)
    cfg = resolve_resume(cfg)  # before anything is written
    settings = LoopSettings.from_config(cfg)
    ctx = init_distributed(settings.device, settings.distributed_timeout_s, settings.parallelism)
    if settings.parallelism is not None and ctx.is_rank_zero:
        print(
            f"parallelism: {ctx.mesh.mesh_dim_names} mesh of {tuple(ctx.mesh.shape)} ranks, "
            f"{ctx.dp_size} data-parallel"
        )
    restore_signals = keep_handlers()  # fit() installs its own, and Ray its SIGTERM's
    lock = None
    try:  # one run per output_dir, taken before anything is written into it
        lock = hold_run_lock(settings.output_dir, ctx)  # a live run's lock is named first
        refuse_another_runs(cfg)
        random.seed(settings.seed)
        torch.manual_seed(settings.seed)
        with quiet_third_party():  # library notices that say nothing about the run
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
            restore_signals()
        close_distributed()


_STEP_DIR = re.compile(r"step_\d+")


def resolve_resume(cfg: DictConfig) -> DictConfig:
    """``cfg`` with its ``resume`` checked against ``cfg.output_dir`` before anything is
    written (``cfg`` itself is left as it is): ``resume=<folder>`` must exist; ``resume=true``
    needs a checkpoint (a ``step_*`` folder of ``<output_dir>/checkpoints``) and otherwise
    stops with one line; ``resume=auto`` becomes ``true`` when there is one and ``false`` when
    not (a fresh start).

    Example::

        >>> from omegaconf import OmegaConf
        >>> cfg = OmegaConf.create({"output_dir": "runs/new", "resume": "auto"})
        >>> resolve_resume(cfg).resume, cfg.resume
        (False, 'auto')
    """
    resume, existing = value_of(cfg, "resume"), _step_dirs(cfg.get("output_dir"))
    if resume == "auto":
        cfg = copy.deepcopy(cfg)
        cfg.resume = bool(existing)
    elif isinstance(resume, str) and not Path(resume).is_dir():
        raise FileNotFoundError(f"resume={resume}: no such checkpoint folder")
    elif resume is True and not existing:
        raise FileNotFoundError(
            f"resume=true: no checkpoint to resume in {Path(cfg.output_dir) / 'checkpoints'}; "
            "start fresh with resume=false, or pass resume=auto (resume when there is a "
            "checkpoint, else start fresh)"
        )
    return cfg


def refuse_another_runs(cfg: DictConfig) -> None:
    """Refuse, before anything is tokenised or built, a start (``resume`` resolved) that would
    not continue the ``step_*`` folders of ``<output_dir>/checkpoints`` (another run's), unless
    ``overwrite=true`` (:meth:`Checkpointer.start` then moves them aside): the line
    :meth:`Checkpointer.start` would give after the data and the model."""
    existing, resume = _step_dirs(cfg.get("output_dir")), value_of(cfg, "resume")
    here = isinstance(resume, str) and Path(resume).parent.resolve() in {
        p.parent.resolve() for p in existing
    }  # resume=<a step folder of this run>: a rollback, not another run
    if existing and resume is not True and not here and not value_of(cfg, "overwrite"):
        root = Path(cfg.output_dir) / "checkpoints"
        raise FileExistsError(not_continued(root, existing, resume))


def _step_dirs(output_dir: str | None) -> list[Path]:
    """The ``step_*`` folders of ``<output_dir>/checkpoints`` (complete or not), oldest first."""
    root = Path(output_dir) / "checkpoints" if output_dir else None
    if root is None or not root.is_dir():
        return []
    steps = [p for p in root.iterdir() if _STEP_DIR.fullmatch(p.name) and p.is_dir()]
    return sorted(steps, key=lambda p: int(p.name.removeprefix("step_")))


def fit_from_config(
    cfg: DictConfig,
    ctx: DistributedContext,
    *,
    model: nn.Module,
    objective: Objective,
    source: BatchSource,
    val_dataset: Sequence[Any] | None = None,
    name: str = "train",
    memory_plan: MemoryPlan | None = None,
    evaluator: Callable[[], Mapping[str, float]] | None = None,
    make_trainer: Callable[..., Trainer] = Trainer.from_config,
    resumable: Collection[str] = (),
) -> None:
    """:func:`fit` with what ``cfg`` asks for: the trainer (``make_trainer(cfg, ctx, model=,
    objective=, source=, resumable=)``, e.g. a ``functools.partial`` of
    :meth:`Trainer.from_config` with hooks, or of a subclass's that also trains PPO's critic;
    ``resumable``: the recipe's own keys a resume may change), its ``metric_loggers`` and
    ``sample_prompts``.

    With ``preflight: true`` (a :class:`DatasetSource`) first runs the objective forward and
    backward once on the longest batch of the data (no update, same RNG) and prints the
    measured peak, next to ``memory_plan``'s estimate when the recipe gives one.
    """
    log = _console(ctx)
    settings = LoopSettings.from_config(cfg)
    if settings.preflight:  # before the optimizer exists: nothing may step
        if not isinstance(source, DatasetSource):
            raise ValueError(
                f"preflight: true measures a dataset's longest batch; this "
                f"recipe's batches come from a {type(source).__name__}"
            )
        report = _preflight(settings, ctx, model, objective, source.loader)
        log(report.summary(memory_plan))
    trainer = make_trainer(
        cfg, ctx, model=model, objective=objective, source=source, resumable=resumable
    )
    if ctx.is_rank_zero:
        trainer.log = log
    trainer.start()  # first: a refused resume leaves no logger's file behind
    if (qat_settings := qat.QATSettings.from_config(cfg)) is not None:
        hook = qat.step_hook(qat_settings)  # fake quantization from its first step on
        hook(trainer, trainer.progress["step"], {})
        trainer.on_step_end.append(hook)
    if (balancing := BiasBalancing.from_config(cfg)) is not None:  # DeepSeek-V3 experts
        trainer.on_step_end.append(balancing.step_hook(trainer.model))
    loggers = [instantiate(c) for c in cfg.get("metric_loggers") or []]
    samples = SamplePrompts.from_config(cfg, model, world_size=ctx.world_size)  # sample_prompts
    fit(
        trainer,
        source,
        loggers=loggers,
        samples=samples,
        val_dataset=val_dataset,
        name=name,
        evaluator=evaluator,
        start=False,
    )


def fit(
    trainer: Trainer,
    source: BatchSource,
    *,
    loggers: Sequence[MetricLogger] = (),
    samples: SamplePrompts | None = None,
    val_dataset: Sequence[Any] | None = None,
    evaluator: Callable[[], Mapping[str, float]] | None = None,
    name: str = "train",
    start: bool = True,
) -> None:
    """Run ``trainer`` to the end on the micro-batches of ``source`` as its settings say (see
    the module docs): start it (resuming as ``settings.resume`` says; ``start=False``: the
    caller already did), then step, log to ``loggers`` (rank 0's), validate on
    ``val_dataset``, log ``samples``, checkpoint, and stop on SIGINT/SIGTERM/SIGHUP or
    ``stop_after_steps``.

    Rank 0 prints the model's parameter count first (trained of total) and, once the loop
    ends (done or stopped), a summary of the records logged
    (:class:`~tunesmith.training.logging.console.RunSummary`: steps, tokens, time, peak
    memory, evaluation, the last checkpoint). A dataset source's records carry the
    fractional ``epoch``; without a terminal (``progress_bar: auto``) and without a
    :class:`StdoutLogger`, a line every :data:`HEARTBEAT_S` seconds shows the progress.

    A source with a ``step_metrics()`` method (a rollout source: rewards, generation time)
    has them logged with the trainer's, and the trainer's share of the step as ``train_s``.
    ``evaluator`` (e.g. held-out rewards) replaces the objective's loss on ``val_dataset``.
    """
    ctx, settings, objective = trainer.ctx, trainer.settings, trainer.objective
    log = _console(ctx)  # through tqdm.write: never glued to the progress bar
    if ctx.is_rank_zero:
        trainer.log = log
    if start:  # verified; refuses another run's checkpoints or a changed config
        trainer.start()
    if trainer.done:  # resumed at its last step: nothing to train, nothing logged
        log(_complete(trainer))
        MultiLogger(list(loggers)).close()  # the files and runs the caller opened
        return
    show_bar = ctx.is_rank_zero and _show_bar(settings.progress_bar)
    summary = RunSummary(trainer.progress["tokens_seen"])  # the lines printed at the end
    console = _heartbeat(loggers, settings.progress_bar)  # a log file's progress lines
    logger = MultiLogger([*loggers, *console, summary]) if ctx.is_rank_zero else NullLogger()
    logger.log_config(trainer.record.config)  # environment reads as ${oc.env:...}, never values
    total_steps, stop_after = trainer.total_steps, settings.stop_after_steps
    logger.begin(total_steps, trainer.progress["step"])  # step N/total, elapsed, ETA
    log(parameter_line(trainer.model))
    log_every = settings.log_every_n_steps
    minutes = settings.save_every_minutes
    save_every_s = None if minutes is None else float(minutes) * 60
    steps_per_epoch = getattr(source, "steps_per_epoch", None)  # a dataset's: epochs shown
    bar = tqdm(
        total=total_steps,
        initial=trainer.progress["step"],
        disable=not show_bar,
        desc=name,
        dynamic_ncols=True,
    )
    window, timing = MetricWindow(objective.unit), _Timing()
    stop_signal, restore_signals = _install_stop_handlers(announce=ctx.is_rank_zero)
    try:
        step_start = last_save = time.perf_counter()
        first_step = trainer.progress["step"] + 1  # its time includes compilation and warm-up
        while not trainer.done:
            micro_batches = source.next_step()
            train_start = time.perf_counter()
            metrics = trainer.step(micro_batches)
            objective_means = [k for k in metrics if k not in (*_TRAINER_KEYS, objective.unit)]
            if hasattr(source, "step_metrics"):  # e.g. rewards, generation time
                metrics |= {"train_s": time.perf_counter() - train_start, **source.step_metrics()}
            step = trainer.progress["step"]
            if steps_per_epoch:
                metrics["epoch"] = step / steps_per_epoch
            bar.update(1)
            if show_bar and "loss" in metrics:
                bar.set_postfix_str(f"loss {FORMATS['sig4'](metrics['loss'])}", refresh=False)
            window.add(metrics, weighted=objective_means)
            timing.add(time.perf_counter() - step_start, trainer, first=step == first_step)
            if step % log_every == 0 or step == total_steps:
                logger.log(step, _timed(window.means(), trainer, timing))
                window.clear()
                timing = _Timing()
            elif step == first_step:
                logger.log(step, {"first_step_s": timing.first_s})
                timing.first_s = None
            if _every(step, settings.eval_every_n_steps, total_steps):
                if evaluator is not None:
                    logger.log(step, dict(evaluator()))
                elif val_dataset is not None:
                    logger.log(step, trainer.evaluate(val_dataset))
            if samples is not None:  # greedy completions of the fixed prompts, as text
                samples.maybe_log(step, total_steps, logger)
            # rank 0's clock decides a timed save; one all-reduce: every rank agrees on both
            due = (
                save_every_s is not None
                and ctx.is_rank_zero
                and time.perf_counter() - last_save >= save_every_s
            )
            flags = all_reduce_sum([float(stop_signal() is not None), float(due)], ctx.device)
            stop, due = bool(flags[0].item()), bool(flags[1].item())
            stop_early = stop_after is not None and step == stop_after < total_steps
            if (stop or stop_early) and len(window):  # the steps since the last line
                logger.log(step, _timed(window.means(), trainer, timing))
                window.clear()
            if _every(step, settings.save_every_n_steps, total_steps) or stop or stop_early or due:
                log(f"checkpoint: {trainer.save()}")
                last_save = time.perf_counter()
            if stop or stop_early:
                reason = (
                    (stop_signal() or "a stop signal on another rank")
                    if stop
                    else (f"stop_after_steps={stop_after}")
                )
                log(f"{reason}: stopped after step {step}; resume with resume=true")
                break
            step_start = time.perf_counter()
        log(summary.text(trainer.last_checkpoint))
    finally:
        restore_signals()
        bar.close()
        logger.close()


def _complete(trainer: Trainer) -> str:
    """What a run resumed at its last step says instead of training.

    Example: ``runs/a/checkpoints/step_000300: the run is complete (step 300 of 300); to train
    further, resume with a larger max_steps``.
    """
    key = "max_steps" if trainer.settings.max_steps else "epochs"
    step, total = trainer.progress["step"], trainer.total_steps
    return (
        f"{trainer.last_checkpoint}: the run is complete (step {step} of {total}); to train "
        f"further, resume with a larger {key}"
    )


_TRAINER_KEYS = ("loss", "lr", "grad_norm", "tokens_seen", "skipped_update")
"""Keys of :meth:`Trainer.step`'s metrics that are not the objective's own per-unit means."""


class _Timing:
    """Wall time and tokens of the steps of one logging window (the first step of the run
    apart: its time includes compilation and warm-up)."""

    def __init__(self) -> None:
        self.first_s: float | None = None
        self.seconds, self.steps, self.tokens = 0.0, 0, 0

    def add(self, seconds: float, trainer: Trainer, first: bool) -> None:
        if first:
            self.first_s = seconds
            return
        self.seconds += seconds
        self.steps += 1
        self.tokens += trainer.rank_tokens * trainer.ctx.dp_cp_size


def _timed(metrics: Mapping[str, float], trainer: Trainer, timing: _Timing) -> dict[str, float]:
    """``metrics`` (a window's) with the unit count named ``<unit>_in_window`` (the units of
    the window's steps, e.g. ``trained_tokens_in_window``), then the window's throughput and
    the peak memory (:func:`~tunesmith.training.memory.usage.peak_memory_metric`:
    ``peak_rss_gb`` on a CPU, ``peak_alloc_gb`` on CUDA), then its mean step time
    (``first_step_s`` for the run's first step: compilation and warm-up)."""
    timed: dict[str, float] = {}
    for key, value in metrics.items():
        if key != trainer.objective.unit:
            timed[key] = value
            continue
        timed[f"{key}_in_window"] = value
        if timing.steps:
            timed["tokens_per_s"] = timing.tokens / timing.seconds
        memory_key, memory = peak_memory_metric(trainer.ctx.device)
        timed[memory_key] = memory
    if timing.first_s is not None:
        timed["first_step_s"] = timing.first_s
    if timing.steps:
        timed["step_time_s"] = timing.seconds / timing.steps
    return timed


HEARTBEAT_S = 30.0
"""Seconds between the progress lines of a run whose stdout is no terminal (see
:func:`_heartbeat`)."""


def _heartbeat(loggers: Sequence[MetricLogger], setting: Any) -> list[MetricLogger]:
    """The console logger a run gets when it shows no progress bar because stdout is not a
    terminal (``progress_bar: auto``; a log file, a pipe) and none of ``loggers`` prints
    lines: a :class:`StdoutLogger` line at most every :data:`HEARTBEAT_S` seconds (and each
    evaluation's), so a long run's log never goes quiet."""
    if (setting is not None and setting != "auto") or sys.stdout.isatty():
        return []
    if any(isinstance(logger, StdoutLogger) for logger in loggers):
        return []
    return [StdoutLogger(min_interval_s=HEARTBEAT_S)]


def _console(ctx: DistributedContext) -> Callable[..., None]:
    """Rank 0's ``print`` for the run's lines, through ``tqdm.write`` (a progress bar is
    cleared and redrawn around each line); other ranks print nothing."""
    if not ctx.is_rank_zero:
        return lambda *a, **k: None

    def write(*parts: Any, **_: Any) -> None:
        tqdm.write(" ".join(str(p) for p in parts), file=sys.stdout)
        sys.stdout.flush()

    return write


def _show_bar(setting: Any) -> bool:
    """``progress_bar``: true/false as set; ``auto`` (or absent): when stdout is a terminal."""
    if setting is None or setting == "auto":
        return sys.stdout.isatty()
    return bool(setting)


def _preflight(
    settings: LoopSettings,
    ctx: DistributedContext,
    model: nn.Module,
    objective: Objective,
    loader: StatefulDataLoader,
) -> PreflightReport:
    """One forward and backward of ``objective`` on the longest batch of the loader's data."""
    dataset = loader.dataset
    batch = longest_batch(dataset, min(settings.batch_size, len(dataset)), loader.collate_fn)
    autocast_dtype = AUTOCAST[settings.mixed_precision]

    def batch_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(ctx.device.type, autocast_dtype, enabled=bool(autocast_dtype)):
            out = objective(model, batch)
        return out.loss if out.aux_loss is None else out.loss + out.aux_loss

    return preflight(
        model,
        {k: v.to(ctx.device) for k, v in batch.items()},
        batch_loss,
        device=ctx.device,
        free_grads_in_backward=settings.optimizer_in_backward,
    )


def _every(step: int, every: int | None, total: int) -> bool:
    return step == total or bool(every) and step % int(every) == 0


def _install_stop_handlers(
    announce: bool = True,
) -> tuple[Callable[[], str | None], Callable[[], None]]:
    """Each stop signal (:func:`~tunesmith.training.stop_signals.stop_signals`: Ctrl-C, SIGTERM,
    SIGHUP) asks for a checkpoint at the end of the current step, then a clean exit; a Ctrl-C
    after that aborts at once (``KeyboardInterrupt``). Returns (the name of the first signal
    received, or None; a function that puts the previous handlers back). ``announce``: say on
    stderr that the run will stop."""
    received: list[str] = []

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and received:
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        if not received:
            received.append(name)
        if announce:  # os.write: print is not safe inside a signal handler
            os.write(
                2,
                f"\n{name}: saving a checkpoint at the end of this step, then stopping "
                "(Ctrl-C again aborts at once)\n".encode(),
            )

    return (lambda: received[0] if received else None), handle_stop_signals(handler)
