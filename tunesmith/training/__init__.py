"""Training building blocks: the loop API, LR schedules, metric loggers, checkpoint dirs, plots.

The loop without a config (see docs/library.md): :class:`LoopSettings`, :class:`Trainer`,
:func:`fit`, :class:`DatasetSource`, :func:`init_distributed`, :class:`Checkpointer`,
:func:`forward_batch` (imported on first use, so importing a building block stays light;
``parallelize`` shares its name with its module: ``from tunesmith.training.parallelize import
parallelize``). The schedules and loggers can be named in a config as a
``_component_``, e.g. ``tunesmith.training.cosine_with_warmup`` or
``tunesmith.training.JSONLLogger``. Optional back ends (tensorboard, wandb, matplotlib) are
imported only when used.

Example::

    from tunesmith.training import DatasetSource, LoopSettings, Trainer, fit
"""

from importlib import import_module
from typing import Any

from tunesmith.training.checkpoint.directory import (
    MARKER,
    CheckpointDirectory,
    CheckpointWriteError,
)
from tunesmith.training.logging.loggers import (
    JSONLLogger,
    MetricLogger,
    MultiLogger,
    NullLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
)
from tunesmith.training.logging.plot import plot_run, read_metrics
from tunesmith.training.lr_schedules import (
    constant_with_warmup,
    cosine_with_warmup,
    linear_with_warmup,
)

_LOOP_API = {  # name -> the module that defines it
    "Checkpointer": "checkpoint.checkpointer",
    "DatasetSource": "sources",
    "LoopSettings": "settings",
    "LossOutput": "trainer",
    "Objective": "trainer",
    "Trainer": "trainer",
    "evaluate": "trainer",
    "fit": "loop",
    "fit_from_config": "loop",
    "forward_batch": "forward",
    "init_distributed": "parallel.distributed",
}

__all__ = [
    *_LOOP_API,
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


def __getattr__(name: str) -> Any:
    if name in _LOOP_API:
        return getattr(import_module(f"tunesmith.training.{_LOOP_API[name]}"), name)
    raise AttributeError(f"module 'tunesmith.training' has no attribute {name!r}")
