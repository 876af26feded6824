"""The machine line every benchmark results file starts with.

>>> "x" in machine()  # e.g. '2 x AMD EPYC 7B13 (x86_64), 24 GiB RAM'
True
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """CPU count and model, architecture and RAM (what /proc tells; less where it cannot)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {mem_kb / 2**20:.0f} GiB RAM"
    except OSError:
        mem = ""
    return f"{os.cpu_count()} x {cpu} ({platform.machine()}){mem}"
