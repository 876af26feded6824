"""The entry point of every fault-suite child process: the ``tunesmith`` CLI, optionally with
:class:`~tests.faults.probes.Probes`, its output going to a log file.

Children are forked from a server process that has already imported torch and tunesmith (see
:mod:`tests.faults.harness`), so each starts in well under a second; each is still a separate
process with its own pid that a signal kills for real.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

import tunesmith.recipes.sft  # noqa: F401  (imported once in the fork server, not per child)
from tests.faults.probes import Probes
from tests.forked import redirect_output
from tunesmith.cli.main import main


def run_cli(
    argv: list[str], log: str, env: dict[str, str | None], probes: dict[str, Any] | None
) -> None:
    """Run ``tunesmith ARGV`` with stdout and stderr appended to ``log``; exit with its code."""
    redirect_output(log)
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(1)  # like the in-process runs: results compare bitwise
    installed = None
    if probes is not None:
        installed = Probes(
            **{k: Path(v) if k in ("trace", "mark") else v for k, v in probes.items()}
        ).install()
    try:
        code = main(argv)
    finally:
        if installed is not None:
            installed.dump()
    sys.exit(code)
