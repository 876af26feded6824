"""What a checkpoint remembers of its run, and which config changes a resume may make.

**Resume.** Each checkpoint stores a :class:`RunRecord`: the run's config as
:func:`~tunesmith.config.plain_config` renders it (interpolations resolved, environment reads
kept as ``${oc.env:NAME}``: a changed secret is no change, a changed interpolation is), the
schedule length and the number of training samples. Before any weight is loaded,
:func:`check_resume` compares it with the new run's and refuses, listing every changed key as
``dotted.path: old -> new``, unless each change is to a resumable key
(:data:`~tunesmith.training.settings.RESUMABLE_KEYS`, and those a recipe declares):

- ``max_steps``, ``epochs``: the schedule length. The LR schedule is recomputed for the new
  length from the step the run resumed at (the learning rate at step ``s`` is then the one a
  run started with the new length has at step ``s``), and the change is logged. A length
  below the checkpoint's step is refused.
- ``stop_after_steps``, ``save_every_n_steps``, ``save_every_minutes``, ``keep_last``,
  ``log_every_n_steps``, ``log_grad_norm``,
  ``eval_every_n_steps``, ``val_dataset`` (not when ``val_fraction`` > 0: then it decides the
  training split), ``metric_loggers``, ``progress_bar``: when to stop, save, log and evaluate;
  a dataset's ``cache_dir`` (where tokenised rows are cached: the tokens do not change).
- ``output_dir``, ``resume``, ``overwrite``, ``preflight``, ``distributed_timeout_s``: where
  and how the run is started; asynchronous RL's ``ray``, ``rollout``, ``reward_workers``,
  ``max_worker_restarts``, ``buffer_size`` and ``trainer_group``: where and with what its
  workers and trainer ranks run.
- ``activation_checkpointing``, ``activation_offloading``, ``compile``, ``attention_backend``:
  memory and speed only.
- ``on_nonfinite_loss``: what to do at a non-finite step (a run stopped at one may go on with
  ``skip``).
- ``parallelism``, ``batch_size``, ``gradient_accumulation_steps`` (:data:`BATCH_KEYS`), and the
  number of ranks: when the global batch (``batch_size x gradient_accumulation_steps x``
  data-parallel ranks) stays the same, e.g. 4 ranks of ``tp: 2`` with ``batch_size: 2`` resumed
  on one process with ``batch_size: 4``: the same samples make each step (the checkpointer
  maps the data position). A changed global batch is refused with the numbers.

Everything else (``optimizer``, ``lr_scheduler``, ``seed``, ``shuffle``, ``dataset``,
``model_dir``, a recipe's own keys, ...) must stay as it was; a different number of training
samples (the data file changed in place) is refused too. Allowed changes are logged.
The rules every value is checked against before a run starts are in
:mod:`tunesmith.training.rules`, the loop's keys with their rules and defaults in
:mod:`tunesmith.training.settings`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tunesmith.config import COMPONENT_KEY, ConfigError, ConfigIssue, resolve_component
from tunesmith.training.rules import is_int
from tunesmith.training.settings import RESUMABLE_KEYS

__all__ = [
    "BATCH_KEYS",
    "RECORD_KEY",
    "Change",
    "RunRecord",
    "check_resume",
    "config_changes",
    "read_record",
]

# ----------------------------------------------------------------------------- resume

SCHEDULE_KEYS = ("max_steps", "epochs")
BATCH_KEYS = ("batch_size", "gradient_accumulation_steps", "parallelism")
"""Keys that may change on resume as long as the global batch (``batch_size x
gradient_accumulation_steps x`` data-parallel ranks) stays the same: another mesh, or another
split of the same batch into micro-batches, trains on the same samples in the same steps."""
RECORD_KEY = "run_config"
"""The entry of a checkpoint's ``training_state/rank<N>.pt`` that holds the :class:`RunRecord`."""
_ABSENT = object()


@dataclass
class RunRecord:
    """What a checkpoint remembers of its run (plain data: ``torch.load(weights_only=True)``
    reads it back): the rendered config, the schedule length, the number of training samples.
    A ``Stateful`` for :class:`~tunesmith.training.checkpoint.checkpointer.Checkpointer.save`.

    >>> RunRecord({"seed": 0}, total_steps=8, samples=32).state_dict()["total_steps"]
    8
    """

    config: dict[str, Any]
    total_steps: int
    samples: int
    step: int = 0  # the checkpoint's step (set when read back)
    data_parallel: int | None = None  # data-parallel ranks of the run (None: not recorded)

    def state_dict(self) -> dict[str, Any]:
        return {"config": self.config, "total_steps": self.total_steps, "samples": self.samples,
                "data_parallel": self.data_parallel}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.config = dict(state["config"])
        self.total_steps = int(state["total_steps"])
        self.samples = int(state["samples"])
        dp = state.get("data_parallel")  # absent from checkpoints older than the key
        self.data_parallel = None if dp is None else int(dp)


def read_record(checkpoint: Path, rank: int) -> RunRecord | None | bool:
    """The :class:`RunRecord` in ``checkpoint`` (this rank's training state, or rank 0's when
    the checkpoint was written by fewer ranks: the record is the same on every rank), without
    loading anything else; False when the checkpoint predates run records; None when the file
    cannot be read (the checkpoint loader then says why).

    >>> import torch
    >>> state = Path("out/checkpoints/step_000004/training_state"); state.mkdir(parents=True)
    >>> torch.save({RECORD_KEY: RunRecord({"seed": 0}, 8, 32).state_dict(),
    ...             "progress": {"step": 4}}, state / "rank0.pt")
    >>> record = read_record(Path("out/checkpoints/step_000004"), 1)  # rank 1: rank 0's file
    >>> record.total_steps, record.step
    (8, 4)
    """
    from tunesmith.training.checkpoint import safe_dcp

    file = checkpoint / "training_state" / f"rank{rank}.pt"
    if not file.is_file():  # saved by fewer ranks (a resume on another mesh)
        file = file.with_name("rank0.pt")
    try:  # plain tensors and containers only, never arbitrary pickled objects
        state = safe_dcp.load_plain(file, map_location="cpu")
    except Exception:
        return None
    if not isinstance(state, dict):
        return None
    saved = state.get(RECORD_KEY)
    if not isinstance(saved, dict):
        return False
    try:
        record = RunRecord({}, 0, 0)
        record.load_state_dict(saved)
        record.step = int(state.get("progress", {}).get("step", 0))
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    return record


@dataclass(frozen=True)
class Change:
    """One key whose value differs: ``str(change)`` is ``"optimizer.lr: 0.001 -> 0.002"``."""

    path: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {self.describe()}"

    def describe(self) -> str:
        return f"{_value(self.old)} -> {_value(self.new)}"


def _value(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    text = repr(value)  # a leaf: a scalar, in full unless it is a long text (a prompt)
    return text if len(text) <= 200 else text[:197] + "..."


def _leaves(tree: Any, path: str = "") -> dict[str, Any]:
    """Dotted path -> value of every leaf (list items by index; an empty container is a leaf)."""
    if isinstance(tree, Mapping) and tree:
        items = tree.items()
    elif isinstance(tree, (list, tuple)) and tree:
        items = enumerate(tree)
    else:
        return {path: tree}
    out: dict[str, Any] = {}
    for key, value in items:
        out.update(_leaves(value, f"{path}.{key}" if path else str(key)))
    return out


def _same(path: str, a: Any, b: Any) -> bool:
    """Equal values (``True`` is not ``1``); an absent key and ``null`` (both: the default);
    two ``_component_`` paths that resolve to the same object (a class moved to another module,
    still importable under its old path)."""
    if a is _ABSENT or b is _ABSENT:
        return (b if a is _ABSENT else a) is None
    if isinstance(a, bool) == isinstance(b, bool) and a == b:
        return True
    if path.rsplit(".", 1)[-1] != COMPONENT_KEY or not (isinstance(a, str) and isinstance(b, str)):
        return False
    try:
        return resolve_component(a) is resolve_component(b)
    except ConfigError:
        return False


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Change]:
    """Every leaf that differs between two rendered configs, in the new config's order
    (then the keys it no longer has). A key set to null where the other config lacks it is no
    change, nor is a ``_component_`` path that resolves to the same object as before.

    >>> [str(c) for c in config_changes({"optimizer": {"lr": 1e-3}}, {"optimizer": {"lr": 2e-3}})]
    ['optimizer.lr: 0.001 -> 0.002']
    """
    before, after = _leaves(old), _leaves(new)
    changes = [
        Change(p, before.get(p, _ABSENT), v)
        for p, v in after.items()
        if not _same(p, before.get(p, _ABSENT), v)
    ]
    changes += [
        Change(p, v, _ABSENT)
        for p, v in before.items()
        if p not in after and not _same(p, v, _ABSENT)
    ]
    return changes


def _resumable(change: Change, new: Mapping[str, Any], resumable: Collection[str]) -> bool:
    top = change.path.split(".", 1)[0]
    if change.path in ("dataset.cache_dir", "val_dataset.cache_dir"):
        return True  # where tokenised rows are cached: the tokens are the same
    if top == "val_dataset" and new.get("val_fraction"):
        return False  # with a val_fraction, whether val_dataset is set decides the training split
    return top in resumable


def check_resume(
    checkpoint: Path,
    saved: RunRecord,
    current: RunRecord,
    *,
    resizable: bool = True,
    resumable: Collection[str] = RESUMABLE_KEYS,
) -> list[str]:
    """Refuse (:class:`~tunesmith.config.ConfigError`, one ``path: old -> new`` line per key)
    to resume ``checkpoint`` with a config that differs from ``saved``'s outside
    ``resumable`` (the loop's :data:`RESUMABLE_KEYS` and a recipe's own), with another
    number of training samples, with a schedule shorter than the checkpoint's step, or with another length when the LR scheduler cannot be given one
    (``resizable`` false). :data:`BATCH_KEYS` and the number of data-parallel ranks (the
    records' ``data_parallel``, when both have one) may change if the global batch stays the
    same. Returns the lines to log about the changes that are applied.

    >>> cfg = {"seed": 0, "max_steps": 8, "batch_size": 4}
    >>> saved = RunRecord(cfg, total_steps=8, samples=32, step=4)
    >>> check_resume(Path("ckpt"), saved, RunRecord(cfg | {"max_steps": 12}, 12, 32))
    ['max_steps 8 -> 12: the LR schedule now ends at step 12 (was 8)']
    >>> check_resume(Path("ckpt"), saved, RunRecord(cfg | {"seed": 1}, 8, 32))
    Traceback (most recent call last):
    tunesmith.config.errors.ConfigError: resume from ckpt: the config differs from the ...
    seed: 0 -> 1
    """
    changes = config_changes(saved.config, current.config)
    same_batch = _global_batch(saved) is not None and _global_batch(saved) == _global_batch(current)
    issues = [
        ConfigIssue(c.path, c.describe())
        for c in changes
        if not (_resumable(c, current.config, resumable) or (same_batch and _top(c) in BATCH_KEYS))
    ]
    dp_sizes = (saved.data_parallel, current.data_parallel)
    if not same_batch and None not in dp_sizes and dp_sizes[0] != dp_sizes[1]:
        issues.append(_batch_issue(saved, current))
    if saved.samples != current.samples:
        issues.append(
            ConfigIssue(
                "dataset",
                f"{saved.samples} training samples -> {current.samples}: the data changed",
            )
        )
    if issues:
        # the keys that may change, of those this run's config has (not another recipe's)
        listed = [k for k in sorted(resumable) if k in current.config or k in saved.config]
        raise ConfigError.from_issues(
            issues,
            header=(
                f"resume from {checkpoint}: the config differs from the checkpoint's in keys that "
                "cannot change on resume (start a new run in another output_dir, or set them back; "
                f"may change: {', '.join(listed or sorted(resumable))}; and {', '.join(BATCH_KEYS)} "
                "with the same global batch):"
            ),
        )
    notes = [
        f"resume: {c.path} {c.describe()}"
        for c in changes
        if c.path.split(".", 1)[0] not in (*SCHEDULE_KEYS, "resume")
    ]
    schedule = [c for c in changes if c.path in SCHEDULE_KEYS]
    if current.total_steps == saved.total_steps:
        return notes + [
            f"resume: {c.path} {c.describe()} (the run stays {current.total_steps} steps long)"
            for c in schedule
        ]
    deciding = "max_steps" if current.config.get("max_steps") is not None else "epochs"
    key = next((c for c in schedule if c.path == deciding), None) or Change(
        deciding, saved.config.get(deciding), current.config.get(deciding)
    )
    _check_length(checkpoint, saved, current, key, resizable)
    notes.append(
        f"{key.path} {key.describe()}: the LR schedule now ends at step "
        f"{current.total_steps} (was {saved.total_steps})"
    )
    return notes


def _top(change: Change) -> str:
    return change.path.split(".", 1)[0]


def _global_batch(record: RunRecord) -> int | None:
    """``batch_size x gradient_accumulation_steps x`` data-parallel ranks of ``record`` (None:
    not known: no data-parallel size recorded, or no integer ``batch_size``); for an RL run,
    its rows per step, ``prompts_per_step x group_size``, whatever the mesh (``batch_size`` is
    then only the micro-batch)."""
    prompts, group = record.config.get("prompts_per_step"), record.config.get("group_size")
    if is_int(prompts) and is_int(group):
        return prompts * group
    batch = record.config.get("batch_size")
    accum = record.config.get("gradient_accumulation_steps")
    accum = 1 if accum is None else accum
    if record.data_parallel is None or not (is_int(batch) and is_int(accum)):
        return None
    return batch * accum * record.data_parallel


def _batch_issue(saved: RunRecord, current: RunRecord) -> ConfigIssue:
    """The global batch changed with the number of data-parallel ranks: the numbers, and the
    ``batch_size`` that would keep it when one does."""

    def product(record: RunRecord) -> str:
        accum = record.config.get("gradient_accumulation_steps") or 1
        return (
            f"{record.config.get('batch_size')} x {accum} x {record.data_parallel} = "
            f"{_global_batch(record)}"
        )

    message = (
        f"{saved.data_parallel} -> {current.data_parallel} ranks changes the global batch "
        f"(batch_size x gradient_accumulation_steps x data-parallel ranks) from {product(saved)} "
        f"to {product(current)}"
    )
    old, accum = _global_batch(saved), current.config.get("gradient_accumulation_steps") or 1
    if old is not None and is_int(accum) and old % (accum * current.data_parallel) == 0:
        message += f": keep it {old} with batch_size={old // (accum * current.data_parallel)}"
    return ConfigIssue("data_parallel", message)


def _check_length(
    checkpoint: Path, saved: RunRecord, current: RunRecord, key: Change, resizable: bool
) -> None:
    if current.total_steps < saved.step:
        raise ConfigError.from_issues(
            [
                ConfigIssue(
                    key.path,
                    (
                        f"{key.describe()} makes the run {current.total_steps} steps long, but {checkpoint} "
                        f"is at step {saved.step}"
                    ),
                )
            ]
        )
    if not resizable:
        raise ConfigError.from_issues(
            [
                ConfigIssue(
                    key.path,
                    (
                        f"{key.describe()}: the lr_scheduler keeps its length where it cannot be changed "
                        "on resume (use one of tunesmith.training's schedules, or keep the length)"
                    ),
                )
            ]
        )
