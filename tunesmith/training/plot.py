"""Plot a run's ``metrics.jsonl`` (written by :class:`~tunesmith.training.JSONLLogger`) to PNG.

Top panel: ``loss`` (train) and ``val_loss`` against step; bottom panel: ``lr``, when logged.
When a step appears more than once (a run resumed from an earlier checkpoint appends to the same
file) the last value logged for it wins.

Needs ``matplotlib`` (``pip install tunesmith[plot]``), imported only when plotting. The figure is
drawn with matplotlib's object API and the Agg canvas, so pyplot's global backend is left alone.

Example::

    >>> plot_run("runs/exp1")
    PosixPath('runs/exp1/loss.png')
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["plot_run", "read_metrics"]

_LOSS_KEYS = ("loss", "val_loss")


def read_metrics(path: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Read a ``metrics.jsonl`` into ``{metric: [(step, value), ...]}`` sorted by step.

    Later lines override earlier ones for the same (metric, step). Non-numeric values are
    skipped. A malformed line raises ``ValueError`` naming the file and line number.
    """
    path = Path(path)
    series: dict[str, dict[int, float]] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = record["step"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path}:{lineno}: not a metrics record with a step: {err}"
                ) from err
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"{path}:{lineno}: step must be an int, got {step!r}")
            for key, value in record.items():
                if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                series.setdefault(key, {})[step] = float(value)
    return {k: sorted(v.items()) for k, v in series.items()}


def plot_run(
    run_dir: str | os.PathLike[str], out_png: str | os.PathLike[str] | None = None
) -> Path:
    """Draw the loss curves (and lr, if logged) of ``run_dir/metrics.jsonl``; return the PNG path.

    ``out_png`` defaults to ``run_dir/loss.png``. Raises ``FileNotFoundError`` naming the missing
    file, and ``ValueError`` if the file has neither ``loss`` nor ``val_loss``.

    Example::

        >>> plot_run("runs/exp1", "loss.png")
        PosixPath('loss.png')
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

    has_lr = "lr" in series
    fig = Figure(figsize=(8, 6 if has_lr else 4), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1]) if has_lr else [fig.subplots()]
    loss_ax = axes[0]
    for key in losses:
        steps, values = zip(*series[key])
        marker = "o" if key == "val_loss" or len(steps) < 50 else None
        label = "train loss" if key == "loss" else "validation loss"
        loss_ax.plot(steps, values, marker=marker, markersize=3, label=label)
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(run_dir.resolve().name)
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend()
    if has_lr:
        steps, values = zip(*series["lr"])
        axes[1].plot(steps, values, color="tab:green")
        axes[1].set_ylabel("learning rate")
        axes[1].ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        axes[1].grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")

    out = Path(out_png) if out_png is not None else run_dir / "loss.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
