"""The training loop's settings, each declared once: name, rule, default, whether a resume may
change it, and a one-line doc.

:class:`LoopSettings` is the typed, frozen form of the keys the loop reads (``seed``,
``batch_size``, ``max_steps``, ``save_every_n_steps``...): the run reads them from the config
once (:meth:`LoopSettings.from_config`) and passes the object on; a Python user builds one
directly, no YAML involved. The keys whose value is a component or a section of its own
(``optimizer``, ``dataset``, ``metric_loggers``...) are declared in :data:`LOOP_SECTIONS`, and
the model step's keys in :data:`MODEL_SETTINGS`. Everything else is derived from these
declarations: :data:`LOOP_KEYS` and :data:`LOOP_RULES` (what ``tunesmith validate`` and every
run check up front), :data:`RESUMABLE_KEYS` (what a resume may change: see
:mod:`~tunesmith.training.loop_config`) and the table of ``docs/training_config.md``
(:func:`markdown_table`).

Example::

    >>> settings = LoopSettings(output_dir="runs/exp1", batch_size=4, max_steps=100)
    >>> settings.seed, settings.gradient_accumulation_steps, settings.on_nonfinite_loss
    (0, 1, 'stop')
    >>> LoopSettings(output_dir="runs/exp1", batch_size=0)
    Traceback (most recent call last):
    tunesmith.config.errors.ConfigError: batch_size: expected an int >= 1, got 0
    >>> "max_steps" in RESUMABLE_KEYS, "seed" in RESUMABLE_KEYS
    (True, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.training.precision import (
    Precision,
    check_precision,
    machine_problem,
    precision_problem,
)
from tunesmith.training.rules import (
    Rule,
    choice,
    component,
    flag,
    integer,
    is_int,
    number,
    shown,
    text,
    type_name,
)

__all__ = [
    "LOOP_KEYS",
    "LOOP_RULES",
    "LOOP_SECTIONS",
    "LOOP_SETTINGS",
    "MODEL_KEYS",
    "MODEL_RULES",
    "MODEL_SETTINGS",
    "RESUMABLE_KEYS",
    "SHARED_SETTINGS",
    "LoopSettings",
    "Setting",
    "Settings",
    "keys_of",
    "markdown_table",
    "resumable_keys",
    "rules_of",
    "setting",
    "settings_of",
    "value_of",
]

REQUIRED = dataclasses.MISSING
"""The default of a key that must be given."""


@dataclass(frozen=True)
class Setting:
    """One top-level config key: its ``rule`` (None: checked by the component that reads it),
    ``default`` (:data:`REQUIRED`: must be given), whether a resume may change it, and a
    one-line doc.

    >>> Setting("seed", integer(0), "seed of the shuffle and the initialisation", 0).shown_default
    '0'
    """

    name: str
    rule: Rule | None
    doc: str
    default: Any = None
    resumable: bool = False

    @property
    def shown_default(self) -> str:
        """The default as a config would write it."""
        if self.default is REQUIRED:
            return "required"
        if self.default is None or isinstance(self.default, Precision):
            return "null"
        if isinstance(self.default, bool):
            return str(self.default).lower()
        return str(self.default)


def setting(default: Any, rule: Rule | None, doc: str, *, resumable: bool = False) -> Any:
    """A field of a :class:`Settings` dataclass declared with its :class:`Setting` (the field's
    name is the key's; :data:`REQUIRED`: no default).

    Example::

        seed: int = setting(0, integer(0), "seed of the shuffle, the initialisation and sampling")
    """
    declared = Setting("", rule, doc, default, resumable)
    if default is REQUIRED:
        return field(metadata={"setting": declared})
    return field(default=default, metadata={"setting": declared})


def _cuda_missing(device: Any) -> str | None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return (
            "got 'cuda', but this machine has no CUDA device (torch.cuda.is_available() is "
            "false); use auto or cpu"
        )
    return None


_PARALLEL_KEYS = ("dp_replicate", "dp_shard", "tp", "cp", "ep")


def _parallelism_problem(value: Any) -> str | None:
    """What is wrong inside a ``parallelism`` mapping (its sizes against the world are
    checked when the process group starts:
    :class:`~tunesmith.training.parallel.distributed.ParallelDims`)."""
    if value is None:
        return None
    for key in value.keys():  # noqa: SIM118 (a DictConfig or a dict)
        if key not in (*_PARALLEL_KEYS, "sequence_parallel"):
            allowed = ", ".join((*_PARALLEL_KEYS, "sequence_parallel"))
            return f"unknown key {key!r} (allowed: {allowed})"
    if not isinstance(value.get("sequence_parallel", True), bool):
        return f"sequence_parallel: expected true or false, got {shown(value['sequence_parallel'])}"
    for key in _PARALLEL_KEYS:
        size = value.get(key, 1)
        auto = key == "dp_shard" and ((is_int(size) and size == -1) or size == "auto")
        if not auto and not (is_int(size) and size >= 1):
            also = " (or -1 / 'auto': what is left of the world)" if key == "dp_shard" else ""
            return f"{key}: expected an int >= 1{also}, got {shown(size)}"
    return None


_PRECISION_RULE = Rule(
    "a mapping of weights, master_weights, optimizer_states, save_dtype, matmuls, or null (the "
    "model's own dtype, no master copies)",
    lambda v: v is None or type_name(v) == "mapping",
    extra=lambda v: precision_problem(v) or machine_problem(v),  # fp8 matmuls: this machine's GPU
)
_PARALLELISM_RULE = Rule(
    "a mapping of dp_replicate, dp_shard, tp, cp, ep sizes (and sequence_parallel: "
    "true/false), or null (every rank data-parallel shard)",
    lambda v: v is None or type_name(v) == "mapping",
    extra=_parallelism_problem,
)


class Settings:
    """The base of a frozen settings dataclass whose fields are declared with :func:`setting`:
    every value is checked against its rule when built (:class:`~tunesmith.config.ConfigError`
    names each bad one), and :meth:`from_config` reads the fields from a config once."""

    def __post_init__(self) -> None:
        issues = []
        for declared in settings_of(type(self)):
            value = getattr(self, declared.name)
            if declared.rule is None or isinstance(value, Precision):
                continue
            problem = declared.rule.problem(value)
            if problem is not None:
                issues.append(ConfigIssue(declared.name, problem))
        if issues:
            raise ConfigError.from_issues(issues)

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any]) -> Any:
        """The settings of ``cfg``: each field from its key (absent keys: their defaults);
        other keys are not looked at."""
        return cls(**_read(cls, cfg))


def _read(cls: type, cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    return {s.name: _plain(cfg[s.name]) for s in settings_of(cls) if s.name in cfg}


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The :class:`Setting` of each field of the settings dataclass ``cls``, named.

    >>> [s.name for s in settings_of(LoopSettings)][:3]
    ['output_dir', 'batch_size', 'model_dir']
    """
    return tuple(
        dataclasses.replace(f.metadata["setting"], name=f.name) for f in dataclasses.fields(cls)
    )


@dataclass(frozen=True)
class LoopSettings(Settings):
    """What the training loop is told by the config's top-level keys, typed and checked
    (every value against its rule when built: :class:`~tunesmith.config.ConfigError` names
    each bad one). See the module docs; ``precision`` is the resolved
    :class:`~tunesmith.training.precision.Precision`, ``parallelism`` the mesh sizes as a
    plain mapping (or None)."""

    output_dir: str = setting(
        REQUIRED,
        text(required=True),
        "the run's folder: checkpoints/, metrics.jsonl, logs/",
        resumable=True,
    )
    batch_size: int = setting(
        REQUIRED, integer(1, required=True), "samples per micro-batch on each data-parallel rank"
    )
    model_dir: str | None = setting(
        None,
        text(null="no source model folder"),
        "the Hugging Face folder the model came from (its tokenizer and config files are "
        "copied into every checkpoint)",
    )
    seed: int = setting(0, integer(0), "seed of the shuffle, the initialisation and sampling")
    device: str = setting(
        "auto",
        Rule(
            "one of 'auto', 'cpu', 'cuda'",
            lambda v: v in ("auto", "cpu", "cuda"),
            extra=_cuda_missing,
        ),
        "auto: CUDA when available, else the CPU",
    )
    mixed_precision: str | None = setting(
        None,
        choice(*(k for k in AUTOCAST if k), null="full precision"),
        "autocast dtype of the forward",
    )
    precision: Precision = setting(
        Precision(),
        _PRECISION_RULE,
        "dtypes the weights, master copies and optimizer states are kept in; matmuls: fp8 "
        "training (CUDA 8.9+)",
    )
    shuffle: bool = setting(True, flag(), "a seeded new order of the samples each epoch")
    gradient_accumulation_steps: int = setting(1, integer(1), "micro-batches per optimizer step")
    epochs: int = setting(
        1, integer(1), "passes over the data when max_steps is null", resumable=True
    )
    max_steps: int | None = setting(
        None,
        integer(1, null="epochs decide"),
        "the run's length in optimizer steps",
        resumable=True,
    )
    stop_after_steps: int | None = setting(
        None,
        integer(1, null="no early stop"),
        "stop (with a checkpoint) after this step; the schedule keeps its length",
        resumable=True,
    )
    max_grad_norm: float | None = setting(
        None, number(above=0, null="no clipping"), "clip the gradients' global norm to this"
    )
    log_grad_norm: bool = setting(
        False, flag(), "log grad_norm even without clipping", resumable=True
    )
    val_fraction: float = setting(
        0.0,
        number(at_least=0, below=1),
        "a seeded share of the training samples held out for validation",
    )
    log_every_n_steps: int = setting(
        1, integer(1), "a line of window means every this many steps", resumable=True
    )
    eval_every_n_steps: int | None = setting(
        None,
        integer(1, null="after the last step only"),
        "validation every this many steps",
        resumable=True,
    )
    save_every_n_steps: int | None = setting(
        None,
        integer(1, null="after the last step only"),
        "a checkpoint every this many steps",
        resumable=True,
    )
    save_every_minutes: float | None = setting(
        None,
        number(above=0, null="no timed saves", unit="a number of minutes"),
        "a checkpoint every this many minutes of wall time",
        resumable=True,
    )
    keep_last: int | None = setting(
        None,
        integer(1, null="keep every checkpoint"),
        "the newest checkpoints kept",
        resumable=True,
    )
    resume: bool | str | None = setting(
        False,
        Rule(
            "true, false (or null), auto (resume when there is a checkpoint) or a checkpoint folder",
            lambda v: v is None or isinstance(v, bool) or (isinstance(v, str) and v.strip() != ""),
        ),
        "continue from output_dir's newest checkpoint, or from this folder",
        resumable=True,
    )
    overwrite: bool = setting(
        False, flag(), "a fresh run moves an earlier run's checkpoints aside", resumable=True
    )
    on_nonfinite_loss: str = setting(
        "stop",
        choice("stop", "skip"),
        "at a non-finite loss or gradient norm: stop, or skip the update",
        resumable=True,
    )
    progress_bar: bool | str = setting(
        "auto",
        Rule(
            "true, false or auto (a bar when stdout is a terminal)",
            lambda v: isinstance(v, bool) or v == "auto",
        ),
        "a progress bar on the console",
        resumable=True,
    )
    optimizer_in_backward: bool = setting(
        False, flag(), "each parameter steps as soon as its gradient is ready (no gradients kept)"
    )
    activation_offloading: bool = setting(
        False, flag(), "saved activations wait in CPU memory", resumable=True
    )
    distributed_timeout_s: float | None = setting(
        None,
        number(above=0, null="the backend's default", unit="a number of seconds"),
        "how long a collective waits for the other ranks",
        resumable=True,
    )
    preflight: bool = setting(
        False, flag(), "measure one step on the longest batch before training", resumable=True
    )
    parallelism: Mapping[str, Any] | None = setting(
        None,
        _PARALLELISM_RULE,
        "mesh sizes: dp_replicate, dp_shard, tp, cp, ep (see docs/parallelism.md)",
    )
    sample_every_n_steps: int | None = setting(
        None,
        integer(1, null="every eval_every_n_steps"),
        "greedy samples of sample_prompts",
        resumable=True,
    )
    sample_max_new_tokens: int = setting(
        64, integer(1), "the length of each in-training sample", resumable=True
    )

    @classmethod
    def from_config(cls, cfg: DictConfig | Mapping[str, Any]) -> LoopSettings:
        """The settings of ``cfg`` (absent keys: their defaults; ``precision`` resolved and
        checked with ``mixed_precision`` and ``optimizer_in_backward``).

        >>> cfg = OmegaConf.create({"output_dir": "out", "batch_size": 2, "seed": 7, "x": 1})
        >>> LoopSettings.from_config(cfg).seed
        7
        """
        values = _read(cls, cfg)
        values["precision"] = check_precision(cfg)
        return cls(**values)

    def as_config(self) -> dict[str, Any]:
        """The settings as plain config values (what a checkpoint records of a run built
        without a config; ``precision`` as its dtype names).

        >>> LoopSettings(output_dir="out", batch_size=2).as_config()["precision"]
        {'weights': None, 'master_weights': None, 'optimizer_states': None, 'save_dtype': None, 'matmuls': None}
        """
        values = {s.name: getattr(self, s.name) for s in settings_of(LoopSettings)}
        values["precision"] = {
            k: None if v is None else str(v).removeprefix("torch.")
            for k, v in dataclasses.asdict(self.precision).items()
        }
        return values


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _sample_prompts_fit(value: Any) -> bool:
    return (
        value is None
        or type_name(value) == "list"
        and all(isinstance(p, str) or type_name(p) == "mapping" for p in value)
    )


LOOP_SECTIONS: tuple[Setting, ...] = (
    Setting("optimizer", component(required=True),
            "the optimizer, built over the trained parameters", REQUIRED),
    Setting("lr_scheduler", component(required=True),
            "the LR schedule, given num_training_steps", REQUIRED),
    Setting("tokenizer", component(required=True), "the tokenizer", REQUIRED),
    Setting("dataset", component(required=True), "the training data", REQUIRED),
    Setting("val_dataset", Rule(
        "a mapping with _component_, a mapping of the training dataset's settings to change "
        "(e.g. source: held_out.jsonl), or null (no validation set)",
        lambda v: v is None or type_name(v) == "mapping",
    ), "the validation data", None, resumable=True),
    Setting("metric_loggers", component(null="no metric logging", many=True),
            "where metrics go besides the console", None, resumable=True),
    Setting("sample_prompts", Rule(
        "a list of prompts (strings, {messages: [...]} or {text: ...}), or null (no samples)",
        _sample_prompts_fit,
    ), "prompts whose greedy completions are logged during training", None, resumable=True),
)  # fmt: skip
"""The loop's keys whose values are components or sections read by what they build."""

MODEL_SETTINGS: tuple[Setting, ...] = (
    Setting("model", component(required=True), "the trained model (a _component_ mapping)",
            REQUIRED),
    Setting("loss", component(required=True), "the loss (a _component_ mapping)", REQUIRED),
    Setting("activation_checkpointing", None,
            "recompute activations in the backward (a mapping of options, or null)", None,
            resumable=True),
    Setting("compile", Rule(
        "true, false, null or a mapping of compile options",
        lambda v: v is None or isinstance(v, bool) or type_name(v) == "mapping",
    ), "torch.compile of the decoder layers and the loss", None, resumable=True),
    Setting("attention_backend", choice(
        "auto", "sdpa", "varlen", "flex", "loop", null="each model's own setting: auto"
    ), "the attention kernel", None, resumable=True),
    Setting("quantization", Rule(
        "a mapping {qat: {scheme, group_size, fake_quant_after_n_steps}}, or null",
        lambda v: v is None or type_name(v) == "mapping",
    ), "quantization-aware training: fake-quantized linear layers (tunesmith.training.qat)",
        None),
    Setting("moe_bias_balancing", Rule(
        "a mapping {update_rate}, or null",
        lambda v: v is None or type_name(v) == "mapping",
    ), "DeepSeek-V3 bias-based expert balancing after each step "
       "(tunesmith.training.moe_balancing)", None),
)  # fmt: skip
"""The keys of every recipe's model step (``setup`` and ``parallelize``)."""


LOOP_SETTINGS: tuple[Setting, ...] = (*settings_of(LoopSettings), *LOOP_SECTIONS)
"""Every top-level key the loop reads."""


SHARED_SETTINGS: tuple[Setting, ...] = (
    Setting("packed", flag(), "samples packed into rows of the dataset's max_seq_len "
            "(block-causal attention)", False),
    Setting("reference_offload", flag(),
            "the reference policy waits in CPU memory between uses", False),
)  # fmt: skip
"""Keys that some recipes (not every one) give the shared model and data steps of
:mod:`tunesmith.training.setup`; each recipe lists those it has in its ``KEYS``."""

_DECLARED = {s.name: s for s in (*LOOP_SETTINGS, *MODEL_SETTINGS, *SHARED_SETTINGS)}


def value_of(cfg: DictConfig | Mapping[str, Any], name: str) -> Any:
    """``cfg[name]``, or the default declared for ``name`` (a loop, model or shared key) when
    ``cfg`` does not have it: for code that needs one key where a whole settings object
    cannot be built (a config of another recipe, a part of one).

    >>> value_of({"seed": 3}, "seed"), value_of({}, "val_fraction"), value_of({}, "packed")
    (3, 0.0, False)
    """
    declared = _DECLARED[name]
    if name in cfg:
        return _plain(cfg[name])
    if declared.default is REQUIRED:
        raise ConfigError.from_issues([ConfigIssue(name, "required, but not set")])
    return declared.default


def keys_of(*tables: Iterable[Setting]) -> list[str]:
    """The key names of ``tables``, in order."""
    return [s.name for table in tables for s in table]


def rules_of(*tables: Iterable[Setting]) -> dict[str, Rule]:
    """Each key of ``tables`` that has a rule -> its rule."""
    return {s.name: s.rule for table in tables for s in table if s.rule is not None}


def resumable_keys(*tables: Iterable[Setting]) -> frozenset[str]:
    """The keys of ``tables`` a resume may change."""
    return frozenset(s.name for table in tables for s in table if s.resumable)


LOOP_KEYS = keys_of(LOOP_SETTINGS)
LOOP_RULES = rules_of(LOOP_SETTINGS)
MODEL_KEYS = keys_of(MODEL_SETTINGS)
MODEL_RULES = rules_of(MODEL_SETTINGS)
RESUMABLE_KEYS = resumable_keys(LOOP_SETTINGS, MODEL_SETTINGS)
"""The loop's and the model step's keys a resume may change (a recipe adds its own)."""


def markdown_table(*tables: Iterable[Setting]) -> str:
    """The table of ``docs/training_config.md``: one row per key.

    >>> print(markdown_table([Setting("seed", integer(0), "the seed", 0)]))
    | key | allowed | default | resume may change | what |
    |---|---|---|---|---|
    | `seed` | an int >= 0 | `0` |  | the seed |
    """
    rows = ["| key | allowed | default | resume may change | what |", "|---|---|---|---|---|"]
    for table in tables:
        for s in table:
            allowed = s.rule.allowed if s.rule is not None else "a mapping with _component_"
            default = s.shown_default
            default = default if default == "required" else f"`{default}`"
            rows.append(
                f"| `{s.name}` | {allowed} | {default} | {'yes' if s.resumable else ''} | {s.doc} |"
            )
    return "\n".join(rows)
