"""Peak memory of this process, on the device that matters.

Example::

    >>> peak_memory_gb(torch.device("cpu")) > 0
    True
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["peak_memory_gb"]


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory (CUDA), else this process's peak resident set, in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)  # bytes on macOS, KiB elsewhere
