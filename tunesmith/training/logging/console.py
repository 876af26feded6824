"""What a run shows on the console: the compact step line, the end-of-run summary, the
parameter count, and the stream the launchers tee to a log.

:data:`CONSOLE_FIELDS` is the one table of what a step line shows, per kind of recipe
(``train``: SFT, DPO, KD, reward models; ``rl``: GRPO, PPO), in order and with its format;
every other metric goes to ``metrics.jsonl`` (and TensorBoard / W&B) only.
:func:`console_line` renders a record with it, :class:`RunSummary` collects the records of a
run for the lines printed at its end.

Example::

    >>> console_line(20, {"loss": 1.23456, "lr": 2e-5, "grad_norm": 0.51234,
    ...                   "tokens_per_s": 13874.4, "peak_rss_gb": 1.3088, "tokens_seen": 577},
    ...              total=200)
    'step 20/200 | loss 1.235 | lr 2.0e-05 | grad_norm 0.512 | 13.9k tok/s | rss 1.31 GB'
    >>> import io
    >>> console, log = io.StringIO(), io.StringIO()
    >>> tee = Tee(console, log)
    >>> _ = tee.write("step 1\\n"), tee.write("\\r 50%|#####     |")
    >>> console.getvalue(), log.getvalue()
    ('step 1\\n\\r 50%|#####     |', 'step 1\\n')
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "CONSOLE_FIELDS",
    "FORMATS",
    "MAX_LINE",
    "Field",
    "RunSummary",
    "Tee",
    "console_kind",
    "console_line",
    "format_duration",
    "format_metric",
    "parameter_line",
]

MAX_LINE = 158
"""The longest console line: a record's fields that do not fit are left out, those of lowest
``keep`` first (they stay in ``metrics.jsonl``)."""


# -- numbers -----------------------------------------------------------------------------------


def _finite(fmt: Callable[[float], str]) -> Callable[[float], str]:
    return lambda v: fmt(v) if math.isfinite(v) else str(float(v))


def _si(value: float) -> str:
    """Three significant digits with a k/M/G suffix: ``13.9k``."""
    for suffix, scale in (("", 1.0), ("k", 1e3), ("M", 1e6), ("G", 1e9)):
        text = f"{value / scale:.3g}"
        if abs(float(text)) < 1000:
            return text + suffix
    return f"{value:.3g}"


FORMATS: dict[str, Callable[[float], str]] = {
    "sig4": _finite(lambda v: f"{v:.4g}"),  # loss: 1.235, 0.01235, 1.235e-05
    "sig3": _finite(lambda v: f"{v:.3g}"),  # grad norm, KL, lengths, rewards
    "sig2": _finite(lambda v: f"{v:.2g}"),  # spreads, phase times
    "sci": _finite(lambda v: f"{v:.1e}"),  # learning rate: 1.0e-04
    "pct": _finite(lambda v: f"{100 * v:.1f}%"),  # accuracies: 41.2%
    "si": _finite(_si),  # tokens/s: 13.9k
    "gb": _finite(lambda v: f"{v:.3g} GB"),  # memory: 1.31 GB
    "sec": _finite(lambda v: f"{v:.2g}s"),  # phase times: 0.1s
    "epoch": _finite(lambda v: f"{v:.2f}"),  # fractional epochs: 1.50
    "int": _finite(lambda v: f"{v:.0f}"),  # counts
}
"""The formats of :data:`CONSOLE_FIELDS`, by name."""


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of a number of seconds (rounded down).

    >>> format_duration(3725.9)
    '1:02:05'
    """
    whole = int(max(seconds, 0.0))
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def format_metric(key: str, value: float) -> str:
    """A metric outside the table (evaluation, first step time) as the console shows it:
    accuracies as percentages, ``*_s`` as seconds, ``*_gb`` in GB, integers as they are,
    other floats to 4 significant digits.

    >>> format_metric("val_token_accuracy", 0.4123), format_metric("first_step_s", 3.21)
    ('41.2%', '3.2s')
    """
    if isinstance(value, int):
        return str(value)
    name = key.rsplit("/", 1)[-1]
    fmt = next((f for suffix, f in _BY_SUFFIX if name.endswith(suffix)), "sig4")
    return FORMATS[fmt](float(value))


_BY_SUFFIX = (("accuracy", "pct"), ("_s", "sec"), ("_gb", "gb"))
"""(the end of a metric's name, its format) for metrics outside :data:`CONSOLE_FIELDS`."""


# -- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Field:
    """One field of a step line: ``label`` and the value of the first of ``keys`` a record
    has, formatted by :data:`FORMATS` ``[fmt]`` (a ``{}`` in ``label`` places the value:
    ``{} tok/s``); ``more`` (a joiner and the keys after the first) shows several values
    under one label, e.g. ``reward 0.523±0.31`` or ``gen/lp/train 0.21/0.05/0.12s``; those
    that ``more`` names are shown only when the record has them. ``nonzero``: the field is
    shown only when its value is not 0. ``keep``: when a line is too long, fields of lower
    ``keep`` are left out first."""

    label: str
    keys: tuple[str, ...]
    fmt: str = "sig4"
    more: tuple[str, tuple[str, ...], str] | None = None  # (joiner, keys, format)
    nonzero: bool = False
    keep: int = 5

    def render(self, metrics: Mapping[str, float]) -> str | None:
        key = next((k for k in self.keys if k in metrics), None)
        if key is None or (self.nonzero and not metrics[key]):
            return None
        value = FORMATS[self.fmt](float(metrics[key]))
        if self.more is not None:
            joiner, keys, fmt = self.more
            value += "".join(joiner + FORMATS[fmt](float(metrics[k])) for k in keys if k in metrics)
        return self.label.format(value) if "{}" in self.label else f"{self.label} {value}"


def _phases(*phases: tuple[str, str]) -> Field:
    """One field of the seconds each phase of a step took, ``gen/score/lp/train
    0.21/0.003/0.05/0.12s`` (``phases``: ``(short name, metric)``; a rollout source logs
    them all)."""
    names = "/".join(name for name, _ in phases)
    keys = tuple(key for _, key in phases)
    return Field(f"{names} {{}}s", keys[:1], "sig2", more=("/", keys[1:], "sig2"), keep=7)


_LR = Field("lr", ("lr",), "sci", keep=6)
_GRAD_NORM = Field("grad_norm", ("grad_norm",), "sig3", keep=3)
_TOKENS_PER_S = Field("{} tok/s", ("tokens_per_s",), "si", keep=2)
_MEMORY = (
    Field("rss", ("peak_rss_gb",), "gb", keep=6),  # CPU: the process's peak resident set
    Field("mem", ("peak_alloc_gb",), "gb", keep=6),  # CUDA: the allocator's peak
)
_SKIPPED = Field("skipped", ("skipped_update",), "int", nonzero=True, keep=9)

CONSOLE_FIELDS: dict[str, tuple[Field, ...]] = {
    "train": (  # SFT, DPO, KD, reward models
        Field("epoch", ("epoch",), "epoch", keep=7),
        Field("loss", ("loss",), "sig4", keep=9),
        Field("acc", ("token_accuracy", "rewards/accuracy", "accuracy"), "pct", keep=8),
        _LR,
        _GRAD_NORM,
        _TOKENS_PER_S,
        *_MEMORY,
        _SKIPPED,
    ),
    "rl": (  # GRPO, PPO
        Field("reward", ("reward",), "sig3", more=("±", ("reward_std",), "sig2"), keep=9),
        Field("kl", ("kl",), "sig3", keep=8),
        Field("vloss", ("critic/loss",), "sig3", keep=7),
        Field(
            "len",
            ("completion_length",),
            "sig3",
            more=("/", ("completion_length_max",), "int"),
            keep=8,
        ),
        Field("loss", ("loss",), "sig3", keep=4),
        Field("lr", ("lr",), "sci", keep=5),
        _GRAD_NORM,
        _phases(
            ("gen", "generate_s"), ("score", "reward_s"), ("lp", "logprobs_s"), ("train", "train_s")
        ),
        _TOKENS_PER_S,
        *_MEMORY,
        _SKIPPED,
    ),
}
"""What a step line shows per kind of recipe (see :func:`console_kind`), in this order: the
label, the metric (the first of its keys the record has), its format; a metric a record lacks
is left out, and so are the fields of lowest ``keep`` on a line longer than :data:`MAX_LINE`.
``step N/total`` comes first, ``elapsed`` and ``eta`` last."""


def console_kind(metrics: Mapping[str, float]) -> str | None:
    """Which row of :data:`CONSOLE_FIELDS` renders ``metrics``: ``rl`` for a record with
    rollout rewards, ``train`` for one with a loss or a learning rate, None for any other
    record (evaluation, the first step's time), whose every metric is shown.

    >>> console_kind({"loss": 1.0, "reward": 0.5}), console_kind({"val_loss": 1.0})
    ('rl', None)
    """
    if "reward" in metrics:
        return "rl"
    if "loss" in metrics or "lr" in metrics:
        return "train"
    return None


def console_line(
    step: int,
    metrics: Mapping[str, float],
    *,
    total: int | None = None,
    elapsed: float | None = None,
    eta: float | None = None,
) -> str:
    """The console line of the record ``metrics`` of ``step`` (see :data:`CONSOLE_FIELDS`);
    at most :data:`MAX_LINE` characters (fields at the end of the table left out first).

    Example::

        >>> console_line(3, {"val_loss": 2.31234, "val_token_accuracy": 0.25}, total=10)
        'step 3/10 | val_loss 2.312 | val_token_accuracy 25.0%'
    """
    head = f"step {step}" if total is None else f"step {step}/{total}"
    tail = [] if elapsed is None else [f"elapsed {format_duration(elapsed)}"]
    tail += [] if eta is None else [f"eta {format_duration(eta)}"]
    budget = MAX_LINE - len(" | ".join([head, *tail])) - 3  # the fields go in one " | "
    kind = console_kind(metrics)
    if kind is None:
        fields = [f"{k} {format_metric(k, v)}" for k, v in metrics.items()]
        while fields and len(" | ".join(fields)) > budget:
            fields.pop()
    else:
        shown = [(f, t) for f in CONSOLE_FIELDS[kind] if (t := f.render(metrics)) is not None]
        fields = _fitted(shown, budget)
    return " | ".join([head, *fields, *tail])


def _fitted(shown: list[tuple[Field, str]], budget: int) -> list[str]:
    """The rendered fields of ``shown`` that fit in ``budget`` characters (joined by
    `` | ``): those of lowest ``keep`` left out first (the last of them first), the rest in
    table order."""
    kept = list(shown)
    by_drop_order = sorted(range(len(shown)), key=lambda i: (shown[i][0].keep, -i))
    for i in by_drop_order:
        if len(" | ".join(t for _, t in kept)) <= budget:
            break
        kept.remove(shown[i])
    return [t for _, t in kept]


# -- the start and the end of a run --------------------------------------------------------------


def parameter_line(model: nn.Module) -> str:
    """How many parameters ``model`` has and how many are trained (a sharded parameter counts
    whole: a ``DTensor`` reports its global size).

    Example::

        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 8))
        >>> parameter_line(model)
        'parameters: 1,009,008, all trained'
        >>> model[0].requires_grad_(False)  # doctest: +ELLIPSIS
        Linear(...)
        >>> parameter_line(model)
        'parameters: 8,008 trained of 1,009,008 (0.79%)'
    """
    total = trained = 0
    for p in model.parameters():
        total += p.numel()
        trained += p.numel() if p.requires_grad else 0
    if trained == total:
        return f"parameters: {total:,}, all trained"
    share = trained / total if total else 0.0
    return f"parameters: {trained:,} trained of {total:,} ({share:.2%})"


class RunSummary:
    """The records a run logs, reduced to the lines printed at its end (``done:``, or
    ``stopped:`` before its last step): steps, tokens, wall time, throughput, peak memory,
    the final and best evaluation metric, the checkpoint.

    Takes the records as a metric logger does (``begin``, ``log``; ``log_config`` and
    ``close`` do nothing), so it sees the numbers ``metrics.jsonl`` gets. ``tokens_before``:
    the ``tokens_seen`` a resumed run starts from (the throughput is this session's);
    ``begin``'s ``elapsed_before``: the time of the records before, so the elapsed time
    continues as ``metrics.jsonl``'s ``elapsed_s`` does.

    Example::

        >>> summary = RunSummary(clock=iter([0.0, 10.0]).__next__)
        >>> summary.begin(total_steps=4)
        >>> for step in (2, 4):
        ...     summary.log(step, {"loss": 1.0 / step, "tokens_seen": 500 * step,
        ...                        "peak_rss_gb": 0.5 + step / 100})
        >>> summary.log(4, {"val_loss": 0.3})
        >>> print(summary.text("runs/a/checkpoints/step_000004"))
        done: step 4/4 | 2,000 tokens seen | elapsed 0:00:10 | 200 tokens/s | peak rss 0.54 GB
          val_loss 0.3 at the end, best 0.3 (step 4)
          checkpoint: runs/a/checkpoints/step_000004
    """

    def __init__(
        self, tokens_before: int = 0, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tokens_before = self.tokens_seen = int(tokens_before)
        self._clock = clock
        self.total_steps = self.step = 0
        self.elapsed_before, self._started = 0.0, 0.0
        self.peak: dict[str, float] = {}  # peak_rss_gb / peak_alloc_gb: the largest logged
        self.evals: list[tuple[int, float]] = []  # (step, the eval metric)
        self.eval_key: str | None = None

    def begin(self, total_steps: int, start_step: int = 0, elapsed_before: float = 0.0) -> None:
        """The run's length, where it starts, and the time its records before took."""
        self.total_steps, self.step = int(total_steps), int(start_step)
        self.elapsed_before, self._started = float(elapsed_before), self._clock()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.step = max(self.step, int(step))
        self.tokens_seen = int(metrics.get("tokens_seen", self.tokens_seen))
        for key in (field.keys[0] for field in _MEMORY):  # peak_rss_gb, peak_alloc_gb
            if key in metrics:
                self.peak[key] = max(self.peak.get(key, 0.0), float(metrics[key]))
        key = "val_loss" if "val_loss" in metrics else "val_reward"
        if key in metrics:
            self.eval_key = key
            self.evals.append((int(step), float(metrics[key])))

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def text(self, checkpoint: str | Path | None) -> str:
        """The summary's lines (the checkpoint: where the run saved last, or None)."""
        session = self._clock() - self._started
        rate = (self.tokens_seen - self.tokens_before) / session if session > 0 else 0.0
        state = "done" if self.step >= self.total_steps else "stopped"
        first = [
            f"{state}: step {self.step}/{self.total_steps}",
            f"{self.tokens_seen:,} tokens seen",
            f"elapsed {format_duration(self.elapsed_before + session)}",
            f"{_si(rate)} tokens/s",
            *(f"peak {k[5:-3]} {FORMATS['gb'](v)}" for k, v in self.peak.items()),
        ]
        lines = [" | ".join(first)]
        if self.evals:
            lines.append("  " + self._eval_text())
        lines.append(f"  checkpoint: {checkpoint if checkpoint is not None else 'none saved'}")
        return "\n".join(lines)

    def _eval_text(self) -> str:
        key, last = self.eval_key, self.evals[-1][1]
        better = min if key == "val_loss" else max  # a loss falls, a reward rises
        best_step, best = better(self.evals, key=lambda e: e[1])
        fmt = FORMATS["sig4"]
        return f"{key} {fmt(last)} at the end, best {fmt(best)} (step {best_step})"


# -- the launchers' stream ---------------------------------------------------------------------


class Tee:
    """Writes to ``console`` and to ``log``; progress-bar redraws (text with ``\\r``) go to
    the console only. ``tty``: what :meth:`isatty` answers (default: the console's), so
    ``progress_bar: auto`` decides as the user's terminal would. Other attributes
    (``encoding``, ``fileno``, ...) are the console's."""

    def __init__(self, console: TextIO, log: TextIO, tty: bool | None = None) -> None:
        self.console, self.log, self.tty = console, log, tty

    def write(self, text: str) -> int:
        self.console.write(text)
        if "\r" not in text:
            self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.console.isatty() if self.tty is None else self.tty

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)
