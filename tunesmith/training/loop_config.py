"""The training loop's own config keys: what each allows, and which may change on resume.

**Up-front check.** :data:`LOOP_RULES` gives every top-level key the loop reads a
:class:`Rule` (type, range or choices); a recipe adds rules for its own keys (its ``RULES``).
:func:`check_rules` reports every value that breaks its rule, one ``key: expected ..., got ...``
issue each, before anything is built: ``tunesmith validate`` and
:func:`~tunesmith.training.loop.run_main` (before the data is tokenised) both run it.
Booleans must be YAML booleans (``true``/``false``; YAML 1.1's ``yes``/``no``/``on``/``off``
load as booleans too), never strings such as ``"true"``; integers must be ints (``4``, not
``4.0``, ``1e3`` or ``true``); numbers may be ints or floats, never booleans.

**Resume.** Each checkpoint stores a :class:`RunRecord`: the run's config as
:func:`~tunesmith.config.plain_config` renders it (interpolations resolved, environment reads
kept as ``${oc.env:NAME}``: a changed secret is no change, a changed interpolation is), the
schedule length and the number of training samples. Before any weight is loaded,
:func:`check_resume` compares it with the new run's and refuses, listing every changed key as
``dotted.path: old -> new``, unless each change is to a key of :data:`RESUMABLE_KEYS`:

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

Example::

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"max_steps": 0, "shuffle": "yes"})
    >>> for issue in check_rules(cfg, {k: LOOP_RULES[k] for k in cfg}):
    ...     print(issue)
    max_steps: expected an int >= 1, or null (epochs decide), got 0
    shuffle: expected true or false, got 'yes' (a string: write true or false, unquoted)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig
from omegaconf.errors import OmegaConfBaseException

from tunesmith.config import COMPONENT_KEY, ConfigError, ConfigIssue, resolve_component
from tunesmith.config.errors import type_name
from tunesmith.config.nodes import has_key, read_child
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.training.precision import precision_problem

__all__ = [
    "BATCH_KEYS",
    "LOOP_RULES",
    "MODEL_RULES",
    "RECORD_KEY",
    "RESUMABLE_KEYS",
    "Change",
    "Rule",
    "RunRecord",
    "check_resume",
    "check_rules",
    "choice",
    "component",
    "config_changes",
    "flag",
    "integer",
    "number",
    "read_record",
    "text",
]


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """What one key allows: ``allowed`` in words, ``fits(value)`` whether a value is one of them,
    ``extra(value)`` a further problem of a fitting value (e.g. a device this machine lacks).

    >>> integer(1).problem(0)
    'expected an int >= 1, got 0'
    """

    allowed: str
    fits: Callable[[Any], bool]
    required: bool = False
    extra: Callable[[Any], str | None] | None = None
    nested: bool = False  # an ``extra`` problem ``sub.key: ...`` is reported at ``<key>.sub.key``

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed, or None."""
        if not self.fits(value):
            return f"expected {self.allowed}, got {_shown(value)}"
        return self.extra(value) if self.extra is not None else None


def _or_null(allowed: str, null: str | None) -> str:
    return allowed if null is None else f"{allowed}, or null ({null})"


def _nullable(fits: Callable[[Any], bool], null: str | None) -> Callable[[Any], bool]:
    return lambda v: (v is None and null is not None) or (v is not None and fits(v))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(minimum: int, *, null: str | None = None, required: bool = False) -> Rule:
    """An int >= ``minimum`` (or null, meaning ``null``).

    >>> integer(1, null="no limit").allowed
    'an int >= 1, or null (no limit)'
    """
    fits = _nullable(lambda v: _is_int(v) and v >= minimum, null)
    return Rule(_or_null(f"an int >= {minimum}", null), fits, required)


def number(
    *, above: float | None = None, at_least: float | None = None, below: float | None = None,
    at_most: float | None = None, null: str | None = None, unit: str = "a number",
) -> Rule:  # fmt: skip
    """An int or float in the given bounds (never NaN or a bool).

    >>> number(at_least=0, below=1).allowed
    'a number >= 0 and < 1'
    """
    bounds = [f"> {above:g}" if above is not None else "",
              f">= {at_least:g}" if at_least is not None else "",
              f"< {below:g}" if below is not None else "",
              f"<= {at_most:g}" if at_most is not None else ""]  # fmt: skip
    words = f"{unit} {' and '.join(b for b in bounds if b)}".strip()

    def fits(v: Any) -> bool:
        return (
            _is_number(v) and not math.isnan(v)
            and (above is None or v > above) and (at_least is None or v >= at_least)
            and (below is None or v < below) and (at_most is None or v <= at_most)
        )  # fmt: skip

    return Rule(_or_null(words, null), _nullable(fits, null))


def flag() -> Rule:
    """``true`` or ``false`` (a YAML boolean, not a string)."""
    return Rule("true or false", lambda v: isinstance(v, bool))


def choice(*values: str, null: str | None = None) -> Rule:
    """One of ``values`` (exactly, case included).

    >>> choice("stop", "skip").problem("STOP")
    "expected one of 'stop', 'skip', got 'STOP' (a string)"
    """
    words = "one of " + ", ".join(repr(v) for v in values)
    return Rule(
        _or_null(words, null), _nullable(lambda v: isinstance(v, str) and v in values, null)
    )


def text(*, null: str | None = None, required: bool = False) -> Rule:
    """A non-empty string (a path, a name)."""
    fits = _nullable(lambda v: isinstance(v, str) and v.strip() != "", null)
    return Rule(_or_null("a non-empty string", null), fits, required)


def component(*, null: str | None = None, required: bool = False, many: bool = False) -> Rule:
    """A mapping with a ``_component_`` (``many``: a list of them); its arguments are checked
    by :func:`~tunesmith.config.validate_config`."""
    fits = _all_components if many else _is_component
    words = "a list of mappings with _component_" if many else "a mapping with _component_"
    return Rule(_or_null(words, null), _nullable(fits, null), required)


def _is_component(value: Any) -> bool:
    return type_name(value) == "mapping" and COMPONENT_KEY in value.keys()  # noqa: SIM118


def _all_components(value: Any) -> bool:
    return type_name(value) == "list" and all(_is_component(item) for item in value)


def _cuda_missing(device: Any) -> str | None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return (
            "got 'cuda', but this machine has no CUDA device (torch.cuda.is_available() is "
            "false); use auto or cpu"
        )
    return None


def _bool_text_hint(value: Any) -> str:
    words = {"true", "false", "yes", "no", "on", "off"}
    return ": write true or false, unquoted" if str(value).lower() in words else ""


def _shown(value: Any) -> str:
    """A value as the user wrote it: ``0``, ``'abc' (a string)``, ``true (a boolean)``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"{value!r} (a string{_bool_text_hint(value)})"
    return f"a {type_name(value)}"


_PARALLEL_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "ep")


def _parallelism_problem(value: Any) -> str | None:
    """What is wrong inside a ``parallelism`` mapping (its sizes against the world are
    checked when the process group starts: :class:`~tunesmith.training.distributed.ParallelDims`)."""
    if value is None:
        return None
    for key in value.keys():  # noqa: SIM118 (a DictConfig or a dict)
        if key not in (*_PARALLEL_KEYS, "sequence_parallel"):
            allowed = ", ".join((*_PARALLEL_KEYS, "sequence_parallel"))
            return f"unknown key {key!r} (allowed: {allowed})"
    if not isinstance(value.get("sequence_parallel", True), bool):
        return (
            f"sequence_parallel: expected true or false, got {_shown(value['sequence_parallel'])}"
        )
    for key in _PARALLEL_KEYS:
        size = value.get(key, 1)
        auto = key == "dp_shard" and ((_is_int(size) and size == -1) or size == "auto")
        if not auto and not (_is_int(size) and size >= 1):
            also = " (or -1 / 'auto': what is left of the world)" if key == "dp_shard" else ""
            return f"{key}: expected an int >= 1{also}, got {_shown(size)}"
    return None


LOOP_RULES: dict[str, Rule] = {
    "output_dir": text(required=True),
    "model_dir": text(null="no source model folder"),
    "seed": integer(0),
    "device": Rule(
        "one of 'auto', 'cpu', 'cuda'", lambda v: v in ("auto", "cpu", "cuda"), extra=_cuda_missing
    ),
    "mixed_precision": choice(*(k for k in AUTOCAST if k), null="full precision"),
    "precision": Rule(  # tunesmith.training.precision
        "a mapping of weights, master_weights, optimizer_states, save_dtype, or null (the "
        "model's own dtype, no master copies)",
        lambda v: v is None or type_name(v) == "mapping",
        extra=precision_problem,
    ),
    "shuffle": flag(),
    "batch_size": integer(1, required=True),
    "gradient_accumulation_steps": integer(1),
    "epochs": integer(1),
    "max_steps": integer(1, null="epochs decide"),
    "stop_after_steps": integer(1, null="no early stop"),
    "optimizer": component(required=True),
    "lr_scheduler": component(required=True),
    "max_grad_norm": number(above=0, null="no clipping"),
    "log_grad_norm": flag(),
    "tokenizer": component(required=True),
    "dataset": component(required=True),
    "val_dataset": Rule(
        "a mapping with _component_, a mapping of the training dataset's settings to change "
        "(e.g. source: held_out.jsonl), or null (no validation set)",
        lambda v: v is None or type_name(v) == "mapping",
    ),
    "val_fraction": number(at_least=0, below=1),
    "metric_loggers": component(null="no metric logging", many=True),
    "log_every_n_steps": integer(1),
    "eval_every_n_steps": integer(1, null="after the last step only"),
    "sample_prompts": Rule(  # tunesmith.training.sample_prompts
        "a list of prompts (strings, {messages: [...]} or {text: ...}), or null (no samples)",
        lambda v: (
            v is None
            or type_name(v) == "list"
            and all(isinstance(p, str) or type_name(p) == "mapping" for p in v)
        ),
    ),
    "sample_every_n_steps": integer(1, null="every eval_every_n_steps"),
    "sample_max_new_tokens": integer(1),
    "save_every_n_steps": integer(1, null="after the last step only"),
    "save_every_minutes": number(above=0, null="no timed saves", unit="a number of minutes"),
    "keep_last": integer(1, null="keep every checkpoint"),
    "resume": Rule(
        "true, false (or null), auto (resume when there is a checkpoint) or a checkpoint folder",
        lambda v: v is None or isinstance(v, bool) or (isinstance(v, str) and v.strip() != ""),
    ),
    "on_nonfinite_loss": choice("stop", "skip"),
    "progress_bar": Rule(
        "true, false or auto (a bar when stdout is a terminal)",
        lambda v: isinstance(v, bool) or v == "auto",
    ),
    "optimizer_in_backward": flag(),
    "activation_offloading": flag(),
    "distributed_timeout_s": number(
        above=0, null="the backend's default", unit="a number of seconds"
    ),
    "preflight": flag(),
    "overwrite": flag(),
    "parallelism": Rule(
        "a mapping of dp_replicate, dp_shard, tp, cp, ep sizes (and sequence_parallel: "
        "true/false), or null (every rank data-parallel shard)",
        lambda v: v is None or type_name(v) == "mapping",
        extra=_parallelism_problem,
    ),
}
"""One rule per top-level key the loop reads (``LOOP_KEYS``, plus ``overwrite``)."""

MODEL_RULES: dict[str, Rule] = {
    "compile": Rule(
        "true, false, null or a mapping of compile options",
        lambda v: v is None or isinstance(v, bool) or type_name(v) == "mapping",
    ),
    "attention_backend": choice(
        "auto", "sdpa", "varlen", "flex", "loop", null="each model's own setting: auto"
    ),
}
"""Rules of the keys every recipe's model step reads (``setup.MODEL_KEYS``) that have one."""


def check_rules(cfg: DictConfig, rules: Mapping[str, Rule]) -> list[ConfigIssue]:
    """One issue per top-level key of ``cfg`` whose value breaks its rule, and per required
    key that is absent. Keys without a rule are not looked at. A value whose check meets an
    interpolation inside it that does not resolve is reported at that inner value's key, as
    :func:`~tunesmith.config.validate_config` reports it.

    >>> from omegaconf import OmegaConf
    >>> [str(i) for i in check_rules(OmegaConf.create({"seed": "abc"}), {"seed": integer(0)})]
    ["seed: expected an int >= 0, got 'abc' (a string)"]
    """
    issues: list[ConfigIssue] = []
    for key, rule in rules.items():
        if not has_key(cfg, key):
            if rule.required:
                issues.append(ConfigIssue(key, f"required key is missing ({rule.allowed})"))
            continue
        try:
            value = read_child(cfg, key, key)
        except ConfigError as error:  # missing (???) or an interpolation that does not resolve
            issues.append(ConfigIssue(key, error.message))
            continue
        try:
            problem = rule.problem(value)
        except (OmegaConfBaseException, RecursionError) as error:  # a value inside `value`
            line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            inside = ConfigIssue(key, f"a value inside cannot be resolved: {line}")
            issues.append(_unresolved(value, key, set()) or inside)
            continue
        if problem is not None:
            issues.append(_issue(key, problem, rule.nested and rule.fits(value)))
    return issues


def _unresolved(node: Any, path: str, seen: set[int]) -> ConfigIssue | None:
    """The first value inside ``node`` that does not resolve (or is ``???``), at its dotted path,
    as ``validate_config`` reports it; None if every one resolves. Each node is walked once.

    >>> from omegaconf import OmegaConf
    >>> cfg = OmegaConf.create({"a": [1, "${nowhere}"]})
    >>> str(_unresolved(cfg, "cfg", set()))  # doctest: +ELLIPSIS
    "cfg.a.1: interpolation '${nowhere}' cannot be resolved: ..."
    """
    if not isinstance(node, (DictConfig, ListConfig)) or id(node) in seen:
        return None
    seen.add(id(node))
    for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):  # noqa: SIM118
        where = f"{path}.{key}"
        try:
            child = read_child(node, key, where)
        except ConfigError as error:
            return ConfigIssue(where, error.message)
        found = _unresolved(child, where, seen)
        if found is not None:
            return found
    return None


def _issue(key: str, problem: str, nested: bool) -> ConfigIssue:
    """The issue of ``problem`` at ``key`` (at ``key.sub`` for a nested ``sub: ...``).

    >>> str(_issue("rollout", "runtime_env.pip: refused", nested=True))
    'rollout.runtime_env.pip: refused'
    """
    sub, sep, rest = problem.partition(": ")
    if nested and sep and sub and " " not in sub:
        return ConfigIssue(f"{key}.{sub}", rest)
    return ConfigIssue(key, problem)


# ----------------------------------------------------------------------------- resume

RESUMABLE_KEYS = frozenset({
    "max_steps", "epochs",
    "stop_after_steps", "save_every_n_steps", "save_every_minutes", "keep_last",
    "log_every_n_steps", "log_grad_norm",
    "eval_every_n_steps", "val_dataset", "metric_loggers", "progress_bar",
    "sample_prompts", "sample_every_n_steps", "sample_max_new_tokens",
    "output_dir", "resume", "overwrite", "preflight", "distributed_timeout_s",
    "activation_checkpointing", "activation_offloading", "compile", "attention_backend",
    "on_nonfinite_loss",
    "ray", "rollout", "reward_workers", "max_worker_restarts", "buffer_size", "trainer_group",
})  # fmt: skip
"""Top-level keys whose value may differ from the checkpoint's on resume (see the module docs)."""

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
    A ``Stateful`` for :class:`~tunesmith.training.checkpointer.Checkpointer.save`.

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
    from tunesmith.training import safe_dcp

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
    changes = [Change(p, before.get(p, _ABSENT), v) for p, v in after.items()
               if not _same(p, before.get(p, _ABSENT), v)]  # fmt: skip
    changes += [Change(p, v, _ABSENT) for p, v in before.items()
                if p not in after and not _same(p, v, _ABSENT)]  # fmt: skip
    return changes


def _resumable(change: Change, new: Mapping[str, Any]) -> bool:
    top = change.path.split(".", 1)[0]
    if change.path in ("dataset.cache_dir", "val_dataset.cache_dir"):
        return True  # where tokenised rows are cached: the tokens are the same
    if top == "val_dataset" and new.get("val_fraction"):
        return False  # with a val_fraction, whether val_dataset is set decides the training split
    return top in RESUMABLE_KEYS


def check_resume(
    checkpoint: Path, saved: RunRecord, current: RunRecord, *, resizable: bool = True
) -> list[str]:
    """Refuse (:class:`~tunesmith.config.ConfigError`, one ``path: old -> new`` line per key)
    to resume ``checkpoint`` with a config that differs from ``saved``'s outside
    :data:`RESUMABLE_KEYS`, with another number of training samples, with a schedule shorter
    than the checkpoint's step, or with another length when the LR scheduler cannot be given one
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
        ConfigIssue(c.path, c.describe()) for c in changes
        if not (_resumable(c, current.config) or (same_batch and _top(c) in BATCH_KEYS))
    ]  # fmt: skip
    dp_sizes = (saved.data_parallel, current.data_parallel)
    if not same_batch and None not in dp_sizes and dp_sizes[0] != dp_sizes[1]:
        issues.append(_batch_issue(saved, current))
    if saved.samples != current.samples:
        issues.append(ConfigIssue("dataset", f"{saved.samples} training samples -> "
                                             f"{current.samples}: the data changed"))  # fmt: skip
    if issues:
        raise ConfigError.from_issues(issues, header=(
            f"resume from {checkpoint}: the config differs from the checkpoint's in keys that "
            "cannot change on resume (start a new run in another output_dir, or set them back; "
            f"may change: {', '.join(sorted(RESUMABLE_KEYS))}; and {', '.join(BATCH_KEYS)} "
            "with the same global batch):"
        ))  # fmt: skip
    notes = [f"resume: {c.path} {c.describe()}" for c in changes
             if c.path.split(".", 1)[0] not in (*SCHEDULE_KEYS, "resume")]  # fmt: skip
    schedule = [c for c in changes if c.path in SCHEDULE_KEYS]
    if current.total_steps == saved.total_steps:
        return notes + [f"resume: {c.path} {c.describe()} (the run stays "
                        f"{current.total_steps} steps long)" for c in schedule]  # fmt: skip
    deciding = "max_steps" if current.config.get("max_steps") is not None else "epochs"
    key = next((c for c in schedule if c.path == deciding), None) or Change(
        deciding, saved.config.get(deciding), current.config.get(deciding)
    )
    _check_length(checkpoint, saved, current, key, resizable)
    notes.append(f"{key.path} {key.describe()}: the LR schedule now ends at step "
                 f"{current.total_steps} (was {saved.total_steps})")  # fmt: skip
    return notes


def _top(change: Change) -> str:
    return change.path.split(".", 1)[0]


def _global_batch(record: RunRecord) -> int | None:
    """``batch_size x gradient_accumulation_steps x`` data-parallel ranks of ``record`` (None:
    not known: no data-parallel size recorded, or no integer ``batch_size``); for an RL run,
    its rows per step, ``prompts_per_step x group_size``, whatever the mesh (``batch_size`` is
    then only the micro-batch)."""
    prompts, group = record.config.get("prompts_per_step"), record.config.get("group_size")
    if _is_int(prompts) and _is_int(group):
        return prompts * group
    batch = record.config.get("batch_size")
    accum = record.config.get("gradient_accumulation_steps")
    accum = 1 if accum is None else accum
    if record.data_parallel is None or not (_is_int(batch) and _is_int(accum)):
        return None
    return batch * accum * record.data_parallel


def _batch_issue(saved: RunRecord, current: RunRecord) -> ConfigIssue:
    """The global batch changed with the number of data-parallel ranks: the numbers, and the
    ``batch_size`` that would keep it when one does."""

    def product(record: RunRecord) -> str:
        accum = record.config.get("gradient_accumulation_steps") or 1
        return (f"{record.config.get('batch_size')} x {accum} x {record.data_parallel} = "
                f"{_global_batch(record)}")  # fmt: skip

    message = (
        f"{saved.data_parallel} -> {current.data_parallel} ranks changes the global batch "
        f"(batch_size x gradient_accumulation_steps x data-parallel ranks) from {product(saved)} "
        f"to {product(current)}"
    )
    old, accum = _global_batch(saved), current.config.get("gradient_accumulation_steps") or 1
    if old is not None and _is_int(accum) and old % (accum * current.data_parallel) == 0:
        message += f": keep it {old} with batch_size={old // (accum * current.data_parallel)}"
    return ConfigIssue("data_parallel", message)


def _check_length(
    checkpoint: Path, saved: RunRecord, current: RunRecord, key: Change, resizable: bool
) -> None:
    if current.total_steps < saved.step:
        raise ConfigError.from_issues([ConfigIssue(key.path, (
            f"{key.describe()} makes the run {current.total_steps} steps long, but {checkpoint} "
            f"is at step {saved.step}"
        ))])  # fmt: skip
    if not resizable:
        raise ConfigError.from_issues([ConfigIssue(key.path, (
            f"{key.describe()}: the lr_scheduler keeps its length where it cannot be changed "
            "on resume (use one of tunesmith.training's schedules, or keep the length)"
        ))])  # fmt: skip
