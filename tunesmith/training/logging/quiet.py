"""Keep known third-party notices off a run's console: warnings and log lines that say nothing
about the run (a deprecated call inside a library, optional kernels a library could not load
that tunesmith never uses, Ray's start-up INFO lines). Every recipe runs inside
:func:`quiet_third_party` (:func:`~tunesmith.training.loop.run_main`), and so does the demo.

Each entry names its source; anything not listed (and every third-party error, and Ray's
warnings) is shown as before.

Example::

    >>> import logging, warnings
    >>> with quiet_third_party():
    ...     warnings.warn("'set_vital' is deprecated, please do not call", UserWarning)
    ...     logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: missing")
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["NOISY_LOGS", "NOISY_WARNINGS", "RAY_LEVEL", "quiet_third_party"]


@dataclass(frozen=True)
class Noise:
    """Records of logger ``source`` (or, for a warning, its category) whose message matches
    ``pattern`` (a regular expression: searched in a log record's message, matched at the
    start of a warning's), and why they say nothing about a run."""

    source: str
    pattern: str
    why: str


NOISY_WARNINGS: tuple[Noise, ...] = (
    Noise(
        "UserWarning",
        r"'set_vital' is deprecated",
        "torchdata's StatefulDataLoader calls a torch API deprecated since torch 2.6 on "
        "construction; the data loader works the same",
    ),
)
"""Warnings (``warnings.warn``) left out: category name, message pattern, why."""

NOISY_LOGS: tuple[Noise, ...] = (
    Noise(
        "torchao",
        r"^Failed to load .*_C.*\.so",
        "torchao's optional compiled kernels (MX/FP8, CUTLASS) built for another torch; "
        "tunesmith uses torchao's NF4 tensor only, which is Python",
    ),
    Noise(
        "torch.utils._pytree",
        r"is an Enum subclass and is now natively supported by torch\.compile",
        "importing torchao registers its enums with pytree the way torch deprecated",
    ),
    Noise(
        "bitsandbytes.backends.cpu.ops",
        r"pip install kernels",
        "bitsandbytes' faster CPU 4-bit matmul from the `kernels` package; tunesmith uses "
        "bitsandbytes' optimizers only",
    ),
)
"""Log records left out: logger name, message pattern, why."""

RAY_LEVEL = "warning"
"""The least level of Ray's own log lines shown (its INFO lines, e.g. ``Started a local Ray
instance.``, are not): ``RAY_LOGGER_LEVEL`` for a Ray imported during the block (unless the
user set it; the Ray processes the run starts inherit it), a filter on the ``ray`` logger's
handlers for one imported before."""


class _Drop(logging.Filter):
    """Leaves out the records whose message matches one of ``patterns``."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


class _BelowLevel(logging.Filter):
    """Leaves out the records below ``level``."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Within the block, leave out the warnings of :data:`NOISY_WARNINGS`, the log records of
    :data:`NOISY_LOGS` and Ray's log lines below :data:`RAY_LEVEL`; everything is as before
    after it (warning filters, logger filters, the environment)."""
    filters: list[tuple[logging.Filterer, logging.Filter]] = []
    by_logger: dict[str, list[str]] = {}
    for noise in NOISY_LOGS:
        by_logger.setdefault(noise.source, []).append(noise.pattern)
    for name, patterns in by_logger.items():
        filters.append((logging.getLogger(name), _Drop(patterns)))
    if "ray" in sys.modules:  # imported already: its level is set; its handlers filter
        below = _BelowLevel(logging.getLevelName(RAY_LEVEL.upper()))
        filters += [(handler, below) for handler in logging.getLogger("ray").handlers]
    ray_level_set = "RAY_LOGGER_LEVEL" not in os.environ
    with warnings.catch_warnings():
        for noise in NOISY_WARNINGS:
            category = _category(noise.source)  # the message must match from its start
            warnings.filterwarnings("ignore", message=noise.pattern, category=category)
        for target, f in filters:
            target.addFilter(f)
        if ray_level_set:
            os.environ["RAY_LOGGER_LEVEL"] = RAY_LEVEL
        try:
            yield
        finally:
            for target, f in filters:
                target.removeFilter(f)
            if ray_level_set:
                os.environ.pop("RAY_LOGGER_LEVEL", None)


def _category(name: str) -> type[Warning]:
    """The built-in warning class named ``name``."""
    category = getattr(builtins, name)
    if not (isinstance(category, type) and issubclass(category, Warning)):
        raise TypeError(f"NOISY_WARNINGS: {name!r} is not a warning category")
    return category
