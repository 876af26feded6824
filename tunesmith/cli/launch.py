"""Run a recipe file on a config: in this process, or as one rank under torchrun.

``python -m tunesmith.cli.launch RECIPE_FILE CONFIG_FILE [OVERRIDES...]`` is what
``tunesmith run --nproc-per-node N`` hands to torchrun for every rank. Started that way (the
``TUNESMITH_RUN_LOG`` environment variable names the run's log), a rank appends its output to
the log, each line prefixed ``[rankN]: ``; local rank 0 also keeps writing to the console (its
progress and metrics, as a single-process run shows them), the other ranks write only to the
log. A rank that fails writes its traceback to the log and its one-line error to the error file
torchrun gives it (``TORCHELASTIC_ERROR_FILE``, the format of torch's ``@record``), prints
nothing, and exits 1; the CLI prints one line per failure (see :mod:`tunesmith.cli.torchrun`).
A stop signal the CLI passes on (:mod:`tunesmith.training.stop_signals`) makes a rank in
training save a checkpoint with the others and exit 0; interrupted before training (or by a
second Ctrl-C) a rank records ``interrupted`` as its error and exits 130.

Example::

    run_recipe(Path("my_recipe.py"), load_config("my.yaml"))
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, TextIO

from tunesmith.cli.torchrun import RUN_LOG_ENV
from tunesmith.config import load_config
from tunesmith.config.secrets import redact
from tunesmith.models.atomic import open_no_follow
from tunesmith.recipes import run_recipe
from tunesmith.training.logging.console import Tee

__all__ = ["run_recipe"]  # defined in tunesmith.recipes.catalog


def _run(argv: list[str]) -> None:
    recipe_file, config_file, *overrides = argv
    run_recipe(Path(recipe_file), load_config(config_file, overrides))


def _main(argv: list[str]) -> None:
    log = os.environ.get(RUN_LOG_ENV)
    if not log or "RANK" not in os.environ:  # by hand, or under a plain torchrun: as it comes
        _run(argv)
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    output = _route_output(Path(log), rank, console=os.environ.get("LOCAL_RANK", "0") == "0")
    try:
        _run(argv)
    except Exception as error:
        _record_failure(error, output, rank, world_size)
        sys.exit(1)
    except KeyboardInterrupt:  # before training, or a second Ctrl-C: no traceback on the console
        output.write(f"rank {rank} of {world_size}: interrupted\n")
        _write_error_file("interrupted", "")
        sys.exit(130)


class _Prefixed:
    """A text stream that writes to ``file`` with ``prefix`` at the start of every line.

    Example::

        >>> out = _Prefixed(sys.stdout, "[rank1]: ")
        >>> _ = out.write("a\\nb\\n")
        [rank1]: a
        [rank1]: b
    """

    def __init__(self, file: TextIO, prefix: str) -> None:
        self.file, self.prefix, self.at_start = file, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in re.split(r"(?<=\n)", text):
            if piece:
                out.append(self.prefix + piece if self.at_start else piece)
                self.at_start = piece.endswith("\n")
        self.file.write(redact("".join(out)))  # the run's secret values never reach the log
        self.file.flush()
        return len(text)

    def flush(self) -> None:
        self.file.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno, ...
        return getattr(self.file, name)


def _route_output(log: Path, rank: int, *, console: bool) -> _Prefixed:
    """Send this rank's output to ``log`` (lines prefixed ``[rankN]: ``); with ``console`` to
    the console as well, else only to the log (C/C++ output too, unprefixed)."""
    file = open_no_follow(log, "a", buffering=1, errors="replace")  # a planted link: refused
    prefixed = _Prefixed(file, f"[rank{rank}]: ")
    sys.stdout.flush()
    sys.stderr.flush()
    if console:
        sys.stdout, sys.stderr = Tee(sys.stdout, prefixed), Tee(sys.stderr, prefixed)
    else:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        sys.stdout = sys.stderr = prefixed
    return prefixed


def _record_failure(error: Exception, log: _Prefixed, rank: int, world_size: int) -> None:
    """The traceback to the log; the one-line error to torchrun's error file for this rank.

    Example::

        >>> import io
        >>> log = io.StringIO()
        >>> os.environ["TORCHELASTIC_ERROR_FILE"] = "error.json"
        >>> _record_failure(ValueError("batch_size: expected > 0"), log, 1, 2)
        >>> del os.environ["TORCHELASTIC_ERROR_FILE"]
        >>> log.getvalue().splitlines()[0], json.load(open("error.json"))["message"]["message"]
        ('rank 1 of 2 failed:', 'batch_size: expected > 0')
    """
    trace = redact("".join(traceback.format_exception(error)))
    log.write(f"rank {rank} of {world_size} failed:\n{trace}")
    _write_error_file(redact(str(error).strip() or type(error).__name__), trace)


def _write_error_file(message: str, trace: str) -> None:
    """This rank's one-line ``message`` (and ``trace``) in the error file torchrun gave it
    (``TORCHELASTIC_ERROR_FILE``, the format of torch's ``@record``), when there is one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": trace, "timestamp": str(int(now)), "time": now}}}  # fmt: skip
    with open(path, "w") as f:
        json.dump(data, f)


if __name__ == "__main__":
    _main(sys.argv[1:])
