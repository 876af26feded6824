"""Metric loggers: stdout, JSONL, TensorBoard, Weights & Biases, and fan-out.

Every logger has the same three methods (the :class:`MetricLogger` protocol) and can be named in
a config as a ``_component_``::

    metric_logger:
      _component_: tunesmith.training.JSONLLogger
      log_dir: ${output_dir}/logs

Loggers take no rank argument. In a distributed run the recipe builds the configured logger on
rank 0 only and a :class:`NullLogger` on every other rank, so the training loop calls
``logger.log(...)`` unconditionally.

Example::

    >>> logger = MultiLogger([StdoutLogger(), JSONLLogger("runs/exp1")])
    >>> logger.log_config({"lr": 2e-5})
    >>> logger.log(10, {"loss": 1.2345, "lr": 2e-5, "tokens_seen": 4096})
    step 10 | loss 1.234 | lr 2.0e-05
    >>> logger.close()

The console shows a few of a record's metrics in a compact line (the table
:data:`~tunesmith.training.logging.console.CONSOLE_FIELDS`); the file, TensorBoard and W&B
loggers get every one. The loop calls ``begin(total_steps, start_step, elapsed_before)`` on
loggers that have it (here :class:`StdoutLogger`, through :class:`MultiLogger`): lines then
read ``step 10/200 | ... | elapsed 0:01:02 | eta 0:19:38``, the elapsed time continuing a
resumed run's ``metrics.jsonl``. With ``log_every_n_steps > 1`` the loop logs the means of a
:class:`MetricWindow` of the steps since the last line, not the last step's values.

Optional back ends are imported only when their logger is constructed: ``tensorboard``
(``pip install tunesmith[tb]``) and ``wandb`` (``pip install tunesmith[wandb]``).
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import os
import resource
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import yaml
from tqdm import tqdm

from tunesmith.config.registry import component
from tunesmith.config.secrets import redact
from tunesmith.models.atomic import UnsafePathError, open_fd_no_follow, open_no_follow
from tunesmith.training.logging.console import console_kind, console_line, format_duration

__all__ = [
    "JSONLLogger",
    "MetricLogger",
    "MetricWindow",
    "MetricsWriteError",
    "append_record",
    "format_duration",
    "MultiLogger",
    "NullLogger",
    "StdoutLogger",
    "TensorBoardLogger",
    "WandBLogger",
]


@runtime_checkable
class MetricLogger(Protocol):
    """What a training loop needs from a logger."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record scalar ``metrics`` at training ``step``."""

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        """Record the run's (resolved) config once, at start: environment reads stay
        ``${oc.env:NAME}`` (see :func:`~tunesmith.config.plain_config`)."""

    def close(self) -> None:
        """Flush and release files/handles. Safe to call twice."""


class _ContextManager:
    """``with Logger(...) as log:`` closes the logger on exit."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # type: ignore[attr-defined]


def _scalars(step: int, metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Validate ``step`` and turn every metric into a Python int/float (tensors included)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {step!r}")
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric names must be str, got {key!r}")
        if key == "step":
            raise ValueError("metric name 'step' is reserved; pass the step as the first argument")
        if isinstance(value, bool):
            raise TypeError(f"metric {key!r} must be a number, got bool {value!r}")
        if isinstance(value, int):
            out[key] = value
            continue
        try:
            out[key] = float(value)  # floats, numpy scalars, 1-element tensors
        except (TypeError, ValueError) as err:
            raise TypeError(f"metric {key!r} must be a number, got {value!r}") from err
    return out


def _plain(obj: Any) -> Any:
    """Turn a config (OmegaConf or nested mappings) into plain YAML/JSON-able Python objects;
    an OmegaConf config is rendered by :func:`~tunesmith.config.plain_config`, so values read
    from the environment stay ``${oc.env:NAME}`` and are never written."""
    if type(obj).__module__.startswith("omegaconf"):
        from tunesmith.config import plain_config

        return _plain(plain_config(obj))
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


@component
class StdoutLogger(_ContextManager):
    """One compact line per ``log`` call: ``step 10 | loss 1.234 | lr 2.0e-05``.

    A training record shows the fields of
    :data:`~tunesmith.training.logging.console.CONSOLE_FIELDS` for its kind of recipe, each
    to a few significant digits (the loss to 4, the learning rate as ``1.0e-04``, tokens/s as
    ``13.9k``, memory as ``1.31 GB``); every other metric stays in the file loggers. Any other
    record (evaluation, the first step's time) shows each of its metrics. ``stream`` defaults
    to the current ``sys.stdout``, written through ``tqdm.write`` so a progress bar on the
    terminal is cleared and redrawn around the line, never glued to it. ``log_config`` prints
    the resolved config only with ``print_config=True`` (the JSONL logger keeps it in
    ``config.yaml``). After :meth:`begin` a line shows the step out of the run's total, the
    time since the run began and the time left at the pace so far. ``min_interval_s``: a
    training line at most that often (the last step's always), e.g. a heartbeat in a log file.

    Example::

        >>> StdoutLogger().log(10, {"loss": 1.2345, "lr": 2e-5, "grad_norm": 0.51234})
        step 10 | loss 1.234 | lr 2.0e-05 | grad_norm 0.512
    """

    def __init__(
        self,
        stream: IO[str] | None = None,
        print_config: bool = False,
        min_interval_s: float = 0.0,
    ) -> None:
        self._stream = stream
        self.print_config = print_config
        self.min_interval_s = float(min_interval_s)
        self._total: int | None = None
        self._start_step = 0
        self._started = 0.0
        self._elapsed_before = 0.0
        self._last_line: float | None = None

    def begin(self, total_steps: int, start_step: int = 0, elapsed_before: float = 0.0) -> None:
        """Show ``step N/total_steps``, the elapsed time and an ETA from now on: a run resumed
        at ``start_step`` counts its pace from there, and its elapsed time from
        ``elapsed_before`` (the time the records before took, as ``metrics.jsonl`` counts it).

        Example::

            >>> logger = StdoutLogger()
            >>> logger.begin(200, start_step=100, elapsed_before=3600)
            >>> logger.log(110, {"loss": 1.5})  # doctest: +ELLIPSIS
            step 110/200 | loss 1.5 | elapsed 1:00:00 | eta ...
        """
        self._total, self._start_step = int(total_steps), int(start_step)
        self._elapsed_before = float(elapsed_before)
        self._started = time.monotonic()

    def _write(self, text: str) -> None:
        text = redact(text)  # the run's secret values (${oc.env:...} reads) never shown
        if self._stream is not None:
            self._stream.write(text)
            self._stream.flush()
            return
        tqdm.write(text, file=sys.stdout, end="")  # clears and redraws any bar around it
        sys.stdout.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        values = _scalars(step, metrics)
        now = time.monotonic()
        training = console_kind(values) is not None
        if training and self._skipped(step, now):
            return
        elapsed = eta = None
        if self._total is not None and training:
            session, done = now - self._started, step - self._start_step
            elapsed = self._elapsed_before + session
            eta = session / done * max(self._total - step, 0) if done > 0 else None
        line = console_line(step, values, total=self._total, elapsed=elapsed, eta=eta)
        self._write(line + "\n")

    def _skipped(self, step: int, now: float) -> bool:
        """Whether ``min_interval_s`` leaves this training line out (the last one never)."""
        due = self._last_line is None or now - self._last_line >= self.min_interval_s
        if due or step == self._total:
            self._last_line = now
            return False
        return True

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        if self.print_config:
            self._write("config:\n" + yaml.safe_dump(_plain(cfg), sort_keys=False))

    def close(self) -> None:
        pass


class MetricWindow:
    """The steps' metrics since the last log line, reduced to what that line shows.

    ``add`` takes one step's metrics (as :meth:`~tunesmith.training.trainer.Trainer.step`
    returns them); ``means`` gives, for the steps added since the last ``clear``:

    - ``weighted`` keys (the loss and the objective's other per-step means): the mean over
      every unit of the window, i.e. each step's value weighted by its count of ``unit``
      (``sum(value * units) / sum(units)``; steps without the key are left out; with no
      unit at all, the plain mean of the steps);
    - ``unit`` and ``summed`` keys (e.g. ``skipped_update``): the window's total;
    - ``last`` keys (``lr``, ``tokens_seen``, ``epoch``: a position, not a per-step amount):
      the last value;
    - any other key (``grad_norm``, a rollout's rewards): the plain mean over the steps.

    Integers that are summed or last stay integers. Keys keep the order they first came in.

    Example::

        >>> window = MetricWindow("trained_tokens")
        >>> window.add({"loss": 2.0, "trained_tokens": 10, "lr": 1e-3})
        >>> window.add({"loss": 1.0, "trained_tokens": 30, "lr": 9e-4})
        >>> window.means()
        {'loss': 1.25, 'trained_tokens': 40, 'lr': 0.0009}
    """

    def __init__(
        self,
        unit: str,
        *,
        weighted: Sequence[str] = ("loss",),
        summed: Sequence[str] = ("skipped_update",),
        last: Sequence[str] = ("lr", "tokens_seen", "epoch"),
    ) -> None:
        self.unit = unit
        self.weighted = set(weighted)
        self.summed = {*summed, unit}
        self.last = set(last)
        self._steps: list[Mapping[str, float]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, metrics: Mapping[str, float], weighted: Sequence[str] = ()) -> None:
        """Add one step's ``metrics``; ``weighted`` names more keys to weight by units."""
        self.weighted.update(weighted)
        self._steps.append(dict(metrics))

    def clear(self) -> None:
        """Forget the steps added so far (after their line is logged)."""
        self._steps = []

    def means(self) -> dict[str, float]:
        """The window's line (see the class docs); empty when no step was added."""
        keys = list(dict.fromkeys(k for step in self._steps for k in step))
        return {key: self._reduce(key) for key in keys}

    def _reduce(self, key: str) -> float:
        values = [(step[key], step.get(self.unit, 0)) for step in self._steps if key in step]
        if key in self.last:
            return values[-1][0]
        if key in self.summed:
            return sum(v for v, _ in values)
        if key in self.weighted:
            units = sum(u for _, u in values)
            if units > 0:
                return sum(float(v) * u for v, u in values) / units
        return sum(float(v) for v, _ in values) / len(values)


@component
class JSONLLogger(_ContextManager):
    """Append one JSON object per ``log`` call to ``log_dir/metrics.jsonl``.

    Each line is ``{"step": step, **metrics, "time": ..., "elapsed_s": ...}``, flushed as soon
    as it is written, so a crashed run keeps every logged step. ``time`` is the wall clock
    (Unix seconds), ``elapsed_s`` the run's training time so far: it counts from when the
    logger opened and, in a file that already holds records (a resumed run), continues from the
    last one's ``elapsed_s`` (the time the run was down is not counted), so runs compare
    against time. ``timestamps=False`` leaves both out. The file is opened in append mode: a
    resumed run continues the same file (readers such as :func:`tunesmith.training.plot_run`
    keep the last value logged for a step); a recipe's fresh run finds none (its
    :meth:`~tunesmith.training.Checkpointer.start` moves an earlier run's aside first).
    ``log_config`` writes ``log_dir/config.yaml``.

    Both files are opened without following a symbolic link (one planted in ``log_dir`` is
    refused, naming it; ``log_dir`` itself is the user's and may be a link). Each record is
    appended with one ``write`` at once; when the disk is full (or the file size limit is
    reached) the run stops with one line naming the file and saying ``disk full``, and the
    file keeps every whole record written before.

    Example::

        >>> with JSONLLogger("runs/exp1", timestamps=False) as logger:
        ...     logger.log(1, {"loss": 2.5})
        >>> open("runs/exp1/metrics.jsonl").read()
        '{"step": 1, "loss": 2.5}\\n'
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        filename: str = "metrics.jsonl",
        timestamps: bool = True,
    ) -> None:
        self.log_dir = Path(log_dir)  # the user's folder (a link there is the user's choice)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.log_dir / filename
        self.timestamps = bool(timestamps)
        self._fd: int | None = open_fd_no_follow(self.path, "a")  # a planted link: refused
        OPEN_LOG_DIRS.add(os.path.abspath(self.log_dir))
        self._elapsed_before = _last_elapsed(self.path) if self.timestamps else 0.0
        self._opened = time.monotonic()

    @property
    def elapsed_before(self) -> float:
        """The ``elapsed_s`` the file's last record holds (0 for a new file): where a resumed
        run's time continues from."""
        return self._elapsed_before

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **_scalars(step, metrics)}
        if self.timestamps:
            elapsed = self._elapsed_before + time.monotonic() - self._opened
            record |= {"time": round(time.time(), 3), "elapsed_s": round(elapsed, 3)}
        self.append(json.dumps(record) + "\n", f"the record of step {step}")

    def append(self, line: str, what: str = "a record") -> None:
        """Append ``line`` (one whole record, ending in a newline) to the file, written
        through at once; a record that does not fit (disk full, file size limit) is taken
        back, so the file keeps every record before it, whole, and
        :class:`MetricsWriteError` names the file.

        Example::

            >>> with JSONLLogger("runs/exp1", timestamps=False) as logger:
            ...     logger.append('{"step": 1, "samples": []}\\n')
            >>> open("runs/exp1/metrics.jsonl").read()
            '{"step": 1, "samples": []}\\n'
        """
        if self._fd is None:
            raise RuntimeError(f"JSONLLogger for {self.path} is closed")
        append_record(self._fd, self.path, redact(line).encode("utf-8"), what)

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(_plain(cfg), sort_keys=False)
        path = self.log_dir / "config.yaml"
        try:
            with open_no_follow(path, "w") as f:  # a planted link: refused, never followed
                f.write(text)
        except UnsafePathError:
            raise
        except OSError as err:
            raise MetricsWriteError(
                f"{path}: cannot write the run's config: {_write_failure(err)}"
            ) from err

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            OPEN_LOG_DIRS.discard(os.path.abspath(self.log_dir))


OPEN_LOG_DIRS: set[str] = set()
"""Folders whose ``metrics.jsonl`` a :class:`JSONLLogger` of this process has open: a fresh
run leaves them where they are (a script that opened its logger before the trainer started
writes there; see :meth:`~tunesmith.training.checkpoint.checkpointer.Checkpointer.start`)."""


class MetricsWriteError(OSError):
    """A metrics record (or ``config.yaml``) could not be written; the message is one line
    naming the file and why (``disk full``, the file size limit), the records before it kept."""


def _write_failure(err: OSError) -> str:
    """``'disk full (No space left on device)'`` and the like for a failed write."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"disk full ({os.strerror(err.errno)})"
    if err.errno == errno.EFBIG:
        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = (
            ""
            if soft == resource.RLIM_INFINITY
            else f"; the file size limit (ulimit -f) is {soft} bytes"
        )
        return f"file too large ({os.strerror(err.errno)}{limit})"
    return err.strerror or str(err)


def append_record(fd: int, path: Path, data: bytes, what: str = "a record") -> None:
    """Append ``data`` (one whole record) to the file open as ``fd`` (``O_APPEND``) with plain
    ``write`` calls, so it reaches the kernel at once; if the disk fills up or the file size
    limit is reached part-way, the part written is cut off again (the file keeps the records
    before it, whole) and :class:`MetricsWriteError` names ``path``.

    Example (on a full disk)::

        append_record(fd, Path("out/metrics.jsonl"), b'{"step": 3}\\n')
        # raises MetricsWriteError: out/metrics.jsonl: cannot append the record of step 3:
        #   disk full ...
    """
    size = os.fstat(fd).st_size
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError as err:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)  # no half record at the end
        raise MetricsWriteError(
            f"{path}: cannot append {what}: {_write_failure(err)}; the {size} bytes written "
            "before it are kept"
        ) from err


def _last_elapsed(path: Path) -> float:
    """The ``elapsed_s`` of the last record of ``path`` that has one (0 for none)."""
    with open_no_follow(path, "r", errors="replace") as f:  # the file just opened for appending
        text = f.read()
    for line in reversed(text.splitlines()):
        try:
            value = json.loads(line).get("elapsed_s")
        except (json.JSONDecodeError, AttributeError):
            continue  # a line cut short by a crash
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


@component
class TensorBoardLogger(_ContextManager):
    """Scalars to TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard``).

    Needs ``tensorboard`` (``pip install tunesmith[tb]``). The config is logged as text under the
    tag ``config``. Extra keyword arguments go to ``SummaryWriter``.

    Example::

        >>> with TensorBoardLogger("runs/exp1/tb") as logger:
        ...     logger.log(1, {"loss": 2.5})
    """

    def __init__(self, log_dir: str | os.PathLike[str], **writer_kwargs: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardLogger needs the 'tensorboard' package: "
                "pip install tunesmith[tb]  (or: pip install tensorboard)"
            ) from err
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), **writer_kwargs)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in _scalars(step, metrics).items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        text = yaml.safe_dump(_plain(cfg), sort_keys=False)
        # TensorBoard renders text as markdown; indenting by 4 spaces keeps YAML verbatim.
        self._writer.add_text("config", "".join("    " + ln for ln in text.splitlines(True)))

    def close(self) -> None:
        if not self._closed:
            self._writer.close()
            self._closed = True


@component
class WandBLogger(_ContextManager):
    """Log to Weights & Biases (``wandb.init(project=..., **init_kwargs)``).

    Needs ``wandb`` (``pip install tunesmith[wandb]``), imported only when this class is
    constructed. ``log`` passes ``step`` through, so W&B's x-axis is the training step.

    Example (needs ``wandb`` and a W&B login)::

        logger = WandBLogger("my-project", name="sft-llama3-1b")
        logger.log(1, {"loss": 2.5}); logger.close()
    """

    def __init__(
        self,
        project: str,
        *,
        entity: str | None = None,
        name: str | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError(
                "WandBLogger needs the 'wandb' package: pip install tunesmith[wandb]  "
                "(or: pip install wandb)"
            ) from err
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            init_kwargs["dir"] = str(log_dir)
        self._run = wandb.init(project=project, entity=entity, name=name, **init_kwargs)
        self._closed = False

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(_scalars(step, metrics), step=step)

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        self._run.config.update(_plain(cfg), allow_val_change=True)

    def close(self) -> None:
        if not self._closed:
            self._run.finish()
            self._closed = True


@component
class NullLogger(_ContextManager):
    """Discards everything: what non-zero ranks get instead of a real logger."""

    def begin(self, total_steps: int, start_step: int = 0, elapsed_before: float = 0.0) -> None:
        pass

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class MultiLogger(_ContextManager):
    """Send every call to each of ``loggers`` in order.

    ``close`` closes all of them even if one fails, then re-raises the first error.

    Example::

        >>> logger = MultiLogger([StdoutLogger(), JSONLLogger("runs/exp1")])
    """

    def __init__(self, loggers: Sequence[MetricLogger]) -> None:
        for i, logger in enumerate(loggers):
            if not isinstance(logger, MetricLogger):
                raise TypeError(
                    f"loggers[{i}] ({type(logger).__name__}) lacks log/log_config/close"
                )
        self.loggers = list(loggers)

    @property
    def elapsed_before(self) -> float:
        """The time a resumed run's records took before, as its file loggers have it (the
        largest ``elapsed_before`` among them; 0 without one)."""
        return max((float(getattr(lg, "elapsed_before", 0.0)) for lg in self.loggers), default=0.0)

    def begin(
        self, total_steps: int, start_step: int = 0, elapsed_before: float | None = None
    ) -> None:
        """Pass ``begin`` on to each logger that has one (see :meth:`StdoutLogger.begin`), with
        ``elapsed_before`` (default :attr:`elapsed_before`): the console's elapsed time then
        continues a resumed run's as the file's does."""
        before = self.elapsed_before if elapsed_before is None else elapsed_before
        for logger in self.loggers:
            if not hasattr(logger, "begin"):
                continue
            takes = "elapsed_before" in inspect.signature(logger.begin).parameters
            extra = {"elapsed_before": before} if takes else {}  # a logger of before that key
            logger.begin(total_steps, start_step, **extra)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for logger in self.loggers:
            logger.log(step, metrics)

    def log_config(self, cfg: Mapping[str, Any]) -> None:
        for logger in self.loggers:
            logger.log_config(cfg)

    def close(self) -> None:
        first: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as err:
                first = first or err
        if first is not None:
            raise first
