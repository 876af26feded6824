"""The lines every benchmark results file starts with: the machine, the command that made it.

>>> "x" in machine()  # e.g. '2 x AMD EPYC 7B13 (x86_64), 24 GiB RAM'
True
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


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


def command_line(
    script: str, args: argparse.Namespace, defaults: Mapping[str, Any], skip: Iterable[str] = ()
) -> str:
    """``python SCRIPT`` and every flag whose value is not its default (``skip``: left out).

    >>> ns = argparse.Namespace(threads=1, new_tokens=32, dry_run=True)
    >>> command_line("benchmarks/x.py", ns, {"threads": 1, "new_tokens": 64, "dry_run": False})
    'python benchmarks/x.py --new-tokens 32 --dry-run'
    """
    parts = [f"python {script}"]
    for flag, default in defaults.items():
        value = getattr(args, flag)
        if flag in skip or value == default:
            continue
        key = "--" + flag.replace("_", "-")
        if isinstance(value, bool):
            parts.append(key)
        elif isinstance(value, list):
            parts.append(f"{key} {' '.join(map(str, value))}")
        else:
            parts.append(f"{key} {value}")
    return " ".join(parts)
