"""The training loop every recipe shares; a recipe brings its data, its model and its objective.

:func:`fit` is the loop of every recipe around a :class:`~tunesmith.training.trainer.Trainer`
fed by a :class:`~tunesmith.training.sources.BatchSource` (a
:class:`~tunesmith.training.sources.DatasetSource` for SFT, DPO, KD and reward models; a
rollout source for RL)::

    trainer.start()                                  # resume=... : the checkpoint to continue
    while not trainer.done:
        metrics = trainer.step(source.next_step())   # one optimizer step
        log(metrics); maybe evaluate; maybe save; stop on SIGTERM / stop_after_steps

Example (the core of a recipe)::

    >>> ctx = init_distributed("cpu")                                        # doctest: +SKIP
    >>> source = DatasetSource.build(dataset, collate, cfg, ctx)             # doctest: +SKIP
    >>> fit(cfg, ctx, model=model, objective=objective, source=source, name="sft")  # doctest: +SKIP
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from tqdm import tqdm

from tunesmith.config import ConfigError, check_keys, instantiate
from tunesmith.data import split_train_val
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.training.distributed import (
    DistributedContext,
    all_reduce_sum,
    close_distributed,
    init_distributed,
    peer_failure,
)
from tunesmith.training.loop_config import LOOP_RULES, Rule, check_rules
from tunesmith.training.memory import peak_memory_gb
from tunesmith.training.memory_planner import MemoryPlan
from tunesmith.training.metric_logging import MultiLogger, NullLogger
from tunesmith.training.preflight import PreflightReport, longest_batch, preflight
from tunesmith.training.run_lock import hold_run_lock
from tunesmith.training.sources import BatchSource, DatasetSource, dropped_per_epoch, make_loader
from tunesmith.training.trainer import LossOutput, Objective, Trainer, evaluate

__all__ = [
    "AUTOCAST",
    "LOOP_KEYS",
    "LOOP_RUNTIME_ARGS",
    "LOOP_RUNTIME_KWARGS",
    "LossOutput",
    "Objective",
    "build_datasets",
    "check_vocab",
    "dropped_per_epoch",
    "evaluate",
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
    source: BatchSource,
    val_dataset: Sequence[Any] | None = None,
    name: str = "train",
    memory_plan: MemoryPlan | None = None,
    evaluator: Callable[[], Mapping[str, float]] | None = None,
    make_trainer: Callable[..., Trainer] = Trainer,
) -> None:
    """Train ``model`` on ``objective`` with the micro-batches of ``source`` as ``cfg`` says
    (see the module docs).

    With ``preflight: true`` (a :class:`DatasetSource`) first runs the objective forward and
    backward once on the longest batch of the data (no update, same RNG) and prints the
    measured peak, next to ``memory_plan``'s estimate when the recipe gives one. Then builds
    the :class:`Trainer` (optimizer, schedule, checkpoints; resuming from ``cfg.resume``)
    and runs it: step, log, validate, checkpoint, stop on SIGTERM or ``stop_after_steps``.
    A source with a ``step_metrics()`` method (a rollout source: rewards, generation time)
    has them logged with the trainer's, and the trainer's share of the step as ``train_s``.
    ``evaluator`` (e.g. held-out rewards) replaces the objective's loss on ``val_dataset``.
    ``make_trainer`` builds the trainer from ``(cfg, ctx, model=, objective=, source=)`` (e.g. a
    ``functools.partial`` of a :class:`Trainer` subclass that also trains PPO's critic).
    """
    log = print if ctx.is_rank_zero else (lambda *a, **k: None)
    if cfg.get("preflight", False):  # before the optimizer exists: nothing may step
        if not isinstance(source, DatasetSource):
            raise ValueError(f"preflight: true measures a dataset's longest batch; this "
                             f"recipe's batches come from a {type(source).__name__}")  # fmt: skip
        log(_preflight(cfg, ctx, model, objective, source.loader).summary(memory_plan))
    trainer = make_trainer(cfg, ctx, model=model, objective=objective, source=source)
    trainer.start()  # verified; refuses another run's checkpoints or a changed config
    loggers = [instantiate(c) for c in cfg.get("metric_loggers") or []]
    logger = MultiLogger(loggers) if ctx.is_rank_zero else NullLogger()
    logger.log_config(trainer.record.config)  # environment reads as ${oc.env:...}, never values
    stop_requested = _install_sigterm_handler()
    total_steps, stop_after = trainer.total_steps, cfg.get("stop_after_steps")
    bar = tqdm(
        total=total_steps, initial=trainer.progress["step"], disable=not (
            ctx.is_rank_zero and cfg.get("progress_bar", True)), desc=name,
    )  # fmt: skip
    try:
        step_start = time.perf_counter()
        first_step = trainer.progress["step"] + 1  # its time includes compilation and warm-up
        while not trainer.done:
            micro_batches = source.next_step()
            train_start = time.perf_counter()
            metrics = trainer.step(micro_batches)
            if hasattr(source, "step_metrics"):  # e.g. rewards, generation time
                metrics |= {"train_s": time.perf_counter() - train_start, **source.step_metrics()}
            step = trainer.progress["step"]
            bar.update(1)
            if step % int(cfg.get("log_every_n_steps", 1)) == 0 or step == total_steps:
                elapsed = time.perf_counter() - step_start
                logger.log(step, _timed(metrics, trainer, elapsed, first=step == first_step))
            elif step == first_step:
                logger.log(step, {"first_step_s": time.perf_counter() - step_start})
            if _every(step, cfg.get("eval_every_n_steps"), total_steps):
                if evaluator is not None:
                    logger.log(step, dict(evaluator()))
                elif val_dataset is not None:
                    logger.log(step, trainer.evaluate(val_dataset))
            stop = bool(all_reduce_sum(float(stop_requested()), ctx.device).item())
            stop_early = stop_after is not None and step == int(stop_after) < total_steps
            if _every(step, cfg.get("save_every_n_steps"), total_steps) or stop or stop_early:
                log(f"checkpoint: {trainer.save()}")
            if stop or stop_early:
                reason = "SIGTERM" if stop else f"stop_after_steps={stop_after}"
                log(f"{reason}: stopped after step {step}; resume with resume=true")
                break
            step_start = time.perf_counter()
    finally:
        bar.close()
        logger.close()


def _timed(
    metrics: Mapping[str, float], trainer: Trainer, elapsed: float, first: bool
) -> dict[str, float]:
    """``metrics`` with the throughput and memory after the unit count, then the step's time
    (``first_step_s`` for the first: compilation and warm-up, not a throughput)."""
    timed: dict[str, float] = {}
    for key, value in metrics.items():
        timed[key] = value
        if key == trainer.objective.unit:
            if not first:
                timed["tokens_per_s"] = trainer.rank_tokens * trainer.ctx.dp_cp_size / elapsed
            timed["peak_memory_gb"] = peak_memory_gb(trainer.ctx.device)
    timed["first_step_s" if first else "step_time_s"] = elapsed
    return timed


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


def _every(step: int, every: int | None, total: int) -> bool:
    return step == total or bool(every) and step % int(every) == 0


def _install_sigterm_handler() -> Callable[[], bool]:
    """SIGTERM asks for a checkpoint at the end of the current step, then a clean exit."""
    received = {"flag": False}

    def handler(signum, frame):
        received["flag"] = True

    if threading.current_thread() is threading.main_thread():  # signals only reach it
        signal.signal(signal.SIGTERM, handler)
    return lambda: received["flag"]
