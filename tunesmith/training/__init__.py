"""Training building blocks the recipes call: LR schedules, metric loggers, checkpoint dirs, plots.

Everything here can be named in a config as a ``_component_``, e.g.
``tunesmith.training.cosine_with_warmup`` or ``tunesmith.training.JSONLLogger``. Optional back
ends (tensorboard, wandb, matplotlib) are imported only when used.
"""

from tunesmith.training.checkpoint_dir import MARKER, CheckpointDirectory, CheckpointWriteError
from tunesmith.training.lr_schedules import (
    constant_with_warmup,
    cosine_with_warmup,
    linear_with_warmup,
)
from tunesmith.training.metric_logging import (
    JSONLLogger,
    MetricLogger,
    MultiLogger,
    NullLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
)
from tunesmith.training.plot import plot_run, read_metrics

__all__ = [
    "MARKER",
    "CheckpointDirectory",
    "CheckpointWriteError",
    "JSONLLogger",
    "MetricLogger",
    "MultiLogger",
    "NullLogger",
    "StdoutLogger",
    "TensorBoardLogger",
    "WandBLogger",
    "constant_with_warmup",
    "cosine_with_warmup",
    "linear_with_warmup",
    "plot_run",
    "read_metrics",
]
