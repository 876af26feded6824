"""Test driver: the ``tunesmith`` CLI with a checkpoint write that stalls half-way.

    python -m tests.recipes.stalling_save SAVE_NUMBER SENTINEL -- run sft --config tiny ...

The SAVE_NUMBER-th checkpoint save (1-based) writes its Hugging Face files into the temporary
checkpoint folder, then creates the file SENTINEL and sleeps, so a test can SIGKILL the process
while the checkpoint is provably half-written (weights there, training state not yet).
Earlier saves are untouched. The patch lives here, in the tests, never in the library.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tunesmith.cli.main import main
from tunesmith.training.checkpoint import checkpointer


def _install(stall_at: int, sentinel: Path) -> None:
    write = checkpointer.write_hf_checkpoint
    calls = {"n": 0}

    def stalling_write(*args, **kwargs):
        written = write(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == stall_at:
            # the temporary folder being written; renamed into place so the test never reads
            # the sentinel half-written (it polls for its existence)
            partial = sentinel.with_name(sentinel.name + ".partial")
            partial.write_text(str(args[1]))
            partial.rename(sentinel)
            time.sleep(600)
        return written

    checkpointer.write_hf_checkpoint = stalling_write


if __name__ == "__main__":
    stall_at, sentinel, separator, *cli_args = sys.argv[1:]
    if separator != "--":
        raise SystemExit(f"usage: {__doc__.splitlines()[2].strip()}")
    _install(int(stall_at), Path(sentinel))
    sys.exit(main(cli_args))
