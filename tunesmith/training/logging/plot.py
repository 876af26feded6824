"""Plot a run's ``metrics.jsonl`` (written by :class:`~tunesmith.training.JSONLLogger`) to PNG.

Top panel: ``loss`` (train) and ``val_loss`` against step; then one panel for each group of
the recipe's own metrics the run logged (:data:`RECIPE_PANELS`: DPO's rewards and margins,
the reward accuracy, SFT's token accuracy, distillation's KD and CE losses, CPO's and ORPO's
chosen NLL, RL rewards, KL, PPO's policy and value losses; their ``val_`` curves with them);
bottom panel: ``lr``, when logged.
When a step appears more than once (a run resumed from an earlier checkpoint appends to the same
file) the last value logged for it wins. A file holding two runs (the steps start over: a
second ``"step": 1`` after step 5, written before fresh runs moved an earlier run's file aside)
is read from where the last run starts, with a warning naming that line.

Needs ``matplotlib`` (``pip install tunesmith[plot]``), imported only when plotting. The figure is
drawn with matplotlib's object API and the Agg canvas, so pyplot's global backend is left alone.

Example::

    >>> from tunesmith.training import JSONLLogger
    >>> with JSONLLogger("runs/exp1", timestamps=False) as logger:
    ...     for step in (1, 2, 3):
    ...         logger.log(step, {"loss": 3.0 / step, "lr": 1e-3})
    >>> plot_run("runs/exp1")
    PosixPath('runs/exp1/loss.png')
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

from tunesmith.models.atomic import open_no_follow

__all__ = ["RECIPE_PANELS", "metric_panels", "plot_run", "read_metrics"]

_LOSS_KEYS = ("loss", "val_loss")

RECIPE_PANELS: tuple[tuple[str, str], ...] = (
    ("rewards (chosen, rejected, margin)", r"(val_)?rewards/(chosen|rejected|margins?)"),
    ("accuracy", r"(val_)?(rewards/|token_)?accuracy"),
    ("distillation losses", r"(val_)?(kd_loss|ce_loss)"),
    ("chosen NLL", r"(val_)?nll_loss"),
    ("reward", r"(val_)?reward(/.+)?"),
    ("KL", r"(val_)?kl"),
    ("policy / value loss", r"(val_)?(policy_loss|value_loss)"),
)
"""(panel title, regular expression of the metric names it draws), in panel order."""


_MAX_LINE = 2**20  # a metrics record is a few hundred bytes


def _record(raw: bytes, where: str) -> dict:
    """One metrics record (a JSON object with a ``step``); errors name ``where``."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text ({err.reason}); not a metrics file") from None
    except ValueError as err:
        raise ValueError(f"{where}: not a metrics record with a step: {err}") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deep; not a metrics record") from None
    if not isinstance(record, dict) or "step" not in record:
        raise ValueError(f"{where}: not a metrics record with a step: {str(record)[:80]}")
    return record


def read_metrics(path: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Read a ``metrics.jsonl`` into ``{metric: [(step, value), ...]}`` sorted by step.

    Later lines override earlier ones for the same (metric, step). Non-numeric values are
    skipped. A malformed line raises ``ValueError`` naming the file and line number. Where
    the steps go back to (or before) the first step of the run so far, a later run starts:
    only the last run is read, and a warning names the line where it starts (a resumed run
    going back a few steps, to redo them from its checkpoint, is the same run).
    """
    path = Path(path)
    series: dict[str, dict[int, float]] = {}
    first = previous = restart = None  # the run's first step, the last line's, a later run's
    with open(path, "rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(_MAX_LINE + 1), b""), start=1):
            if len(raw) > _MAX_LINE:
                raise ValueError(
                    f"{path}:{lineno}: a line over {_MAX_LINE} bytes; not a metrics file"
                )
            if not raw.strip():
                continue
            record = _record(raw, f"{path}:{lineno}")
            step = record["step"]
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{path}:{lineno}: step must be an int, got {step!r}")
            if previous is not None and step < previous and step <= first:  # a later run
                series, first, restart = {}, step, (lineno, step, previous)
            first = step if first is None else first
            previous = step
            for key, value in record.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                series.setdefault(key, {})[step] = float(value)
    if restart is not None:
        lineno, step, before = restart
        warnings.warn(
            f"{path}:{lineno}: a later run starts here (step {step} after step {before}); "
            "reading only that run, the lines before it are another run's",
            stacklevel=2,
        )
    return {k: sorted(v.items()) for k, v in series.items()}


def metric_panels(series: dict[str, list[tuple[int, float]]]) -> list[tuple[str, list[str]]]:
    """The panels :func:`plot_run` draws for ``series`` (as :func:`read_metrics` gives it):
    ``(title, metric names)``, loss first, then each :data:`RECIPE_PANELS` group with a logged
    metric, then ``lr``.

    Example::

        >>> metric_panels({"loss": [(1, 2.0)], "rewards/margin": [(1, 0.1)], "lr": [(1, 1e-3)]})
        [('loss', ['loss']), ('rewards (chosen, rejected, margin)', ['rewards/margin']), \
('learning rate', ['lr'])]
    """
    panels = [("loss", [k for k in _LOSS_KEYS if k in series])]
    for title, pattern in RECIPE_PANELS:
        keys = [k for k in series if re.fullmatch(pattern, k)]
        if keys:
            panels.append((title, keys))
    if "lr" in series:
        panels.append(("learning rate", ["lr"]))
    return panels


def plot_run(
    run_dir: str | os.PathLike[str], out_png: str | os.PathLike[str] | None = None
) -> Path:
    """Draw the loss curves, the recipe's own metrics and lr (each when logged: see
    :func:`metric_panels`) of ``run_dir/metrics.jsonl``; return the PNG path.

    ``out_png`` defaults to ``run_dir/loss.png``. Raises ``FileNotFoundError`` naming the missing
    file, and ``ValueError`` if the file has neither ``loss`` nor ``val_loss``.

    Example::

        >>> from tunesmith.training import JSONLLogger
        >>> with JSONLLogger("runs/exp1", timestamps=False) as logger:
        ...     logger.log(1, {"loss": 2.5, "val_loss": 2.7})
        >>> plot_run("runs/exp1", "loss.png")
        PosixPath('loss.png')
        >>> plot_run("runs/none")
        Traceback (most recent call last):
        FileNotFoundError: no metrics file runs/none/metrics.jsonl (written by JSONLLogger)
    """
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics file {metrics_path} (written by JSONLLogger)")
    series = read_metrics(metrics_path)
    losses = [k for k in _LOSS_KEYS if k in series]
    if not losses:
        raise ValueError(
            f"{metrics_path} has no 'loss' or 'val_loss' values (found: {sorted(series) or 'none'})"
        )
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plot_run needs matplotlib: pip install tunesmith[plot]  (or: pip install matplotlib)"
        ) from err

    panels = metric_panels(series)
    extra = len(panels) - 1 - ("lr" in series)  # recipe panels
    heights = [2] + [1.25] * extra + ([1] if "lr" in series else [])
    fig = Figure(figsize=(8, (4 if len(panels) == 1 else 6) + 2.5 * extra), layout="constrained")
    axes = (
        fig.subplots(len(panels), 1, sharex=True, height_ratios=heights)
        if len(panels) > 1
        else [fig.subplots()]
    )
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            steps, values = zip(*series[key])
            marker = "o" if key.startswith("val_") or len(steps) < 50 else None
            label = {"loss": "train loss", "val_loss": "validation loss"}.get(key, key)
            color = "tab:green" if key == "lr" else None
            ax.plot(steps, values, marker=marker, markersize=3, label=label, color=color)
        ax.set_ylabel("learning rate" if title == "learning rate" else title)
        ax.grid(True, alpha=0.3)
        if title == "learning rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        else:
            ax.legend()
    axes[0].set_title(run_dir.resolve().name)
    axes[-1].set_xlabel("step")

    out = Path(out_png) if out_png is not None else run_dir / "loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    if out_png is not None:  # the user's own path
        fig.savefig(out, format="png", dpi=100)
        return out
    with open_no_follow(out, "wb") as f:  # in the run's folder: a planted link is refused
        fig.savefig(f, format="png", dpi=100)
    return out
