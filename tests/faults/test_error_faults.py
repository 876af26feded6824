"""Errors that must name the real cause, in few lines. Under ``tunesmith run --nproc-per-node
2`` a failure is one ``tunesmith: error: rank R of N: ...`` line per failed rank (ranks with the
same error share a line), with no traceback or torchrun output on the console, and the path of
the log that holds them. (The file size limit inside torch's writers is a ``disk_full`` case of
``test_disk_full.py``; the pieces are checked on their own below.)"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import pytest

from tests.faults.catalogue import params
from tests.faults.harness import finish, start_child, with_a_bad_row
from tests.recipes.sft_world import sft_overrides
from tunesmith.cli.torchrun import failure_lines
from tunesmith.training.checkpoint import checkpointer
from tunesmith.training.checkpoint.checkpointer import _write_error

_START = (
    "tunesmith: 2 ranks through torchrun; the full output of every rank and of torchrun goes to "
)
_END = "tunesmith: the full output of every rank and of torchrun is in "
_TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "exitcode", "distributed/elastic", "[rank")


def torchrun_errors(output: str) -> tuple[list[str], Path]:
    """The ``tunesmith: error:`` lines of a failed torchrun run and its log, checking that the
    console shows nothing of torchrun's own output nor any traceback.

    Example::

        lines, log = torchrun_errors(done.output)
    """
    for noise in _TORCHRUN_NOISE:
        assert noise not in output, output[-3000:]
    lines = output.splitlines()
    start = [line for line in lines if line.startswith(_START)]
    assert len(start) == 1 and lines[-1].startswith(_END), output[-3000:]
    log = Path(lines[-1][len(_END) :])
    assert start[0] == _START + str(log) and log.is_file(), output[-3000:]
    return [line for line in lines if line.startswith("tunesmith: error: ")], log


@pytest.mark.parametrize("case", params("fault", "torchrun"))
def test_the_same_error_on_every_rank_is_one_line(case, fault_world, tmp_path, outcome):
    out = tmp_path / "out"
    data, bad = with_a_bad_row(fault_world.chat, tmp_path / "broken.jsonl")
    overrides = sft_overrides(fault_world.model_dir, data, out, "max_steps=2")
    overrides.append("dataset.on_bad_row=error")
    argv = ["run", "sft", "--config", "tiny", "--nproc-per-node", "2", *overrides]
    log = tmp_path / "cli.log"
    done = finish(start_child(argv, log), log, timeout=240, started=time.monotonic())
    assert done.exitcode == 1, done.output[-3000:]
    lines, run_log = torchrun_errors(done.output)
    assert len(lines) == 1 and lines[0].startswith(
        f"tunesmith: error: ranks 0, 1 of 2: dataset: BadRowError: {data}: "
    ), lines
    assert f"bad row at line {bad}: malformed_json" in lines[0], lines
    assert run_log.parent == out / "logs"  # the run's log is the only thing written
    assert [p.relative_to(out).as_posix() for p in out.rglob("*")] == [
        "logs",
        f"logs/{run_log.name}",
    ]
    text = run_log.read_text()
    for rank in (0, 1):  # each rank's traceback, prefixed with its rank, and torchrun's summary
        assert f"[rank{rank}]: rank {rank} of 2 failed:\n[rank{rank}]: Traceback" in text
    assert "tunesmith.cli.launch FAILED" in text
    outcome.update(exit_code=1, error=lines[0].replace(str(tmp_path), "<case>"))


# ----------------------------------------------------------------------------- the pieces


def _failure(rank: int, message: str | None = None, signal: str | None = None, **more):
    exitcode = {"SIGKILL": -9, "SIGTERM": -15, "SIGSEGV": -11}.get(signal or "", 1)
    return {"rank": rank, "exitcode": exitcode, "signal": signal, "message": message,
            "time": 1.0, **more}  # fmt: skip


def test_failure_lines_put_a_killed_rank_first_and_drop_the_stopped_ones():
    peer = "rank 0 of 4: a collective operation with the other ranks failed (...)"
    failures = [
        _failure(0, peer, time=0.5),
        _failure(2, signal="SIGTERM"),  # stopped by torchrun after the failure
        _failure(3, signal="SIGKILL", time=2.0),
    ]
    assert failure_lines(failures, 4) == [
        "rank 3 of 4: killed by SIGKILL (signal 9); out of memory? see `dmesg`",
        "rank 0 of 4: a collective operation with the other ranks failed (...)",
    ]


def test_failure_lines_group_ranks_with_the_same_error():
    same = [_failure(r, f"rank {r} of 8: max_steps: expected > 0") for r in (0, 1, 2, 3, 5)]
    other = _failure(7, "out of memory", time=3.0)
    assert failure_lines([*same, other], 8) == [
        "ranks 0-3, 5 of 8: max_steps: expected > 0",
        "rank 7 of 8: out of memory",
    ]
    assert failure_lines([_failure(0, "x"), _failure(1, "x")], 2) == ["ranks 0, 1 of 2: x"]


def test_failure_lines_of_odd_endings():
    assert failure_lines([_failure(0, signal="SIGTERM")], 2) == [
        "rank 0 of 2: killed by SIGTERM (signal 15)"
    ]  # only stopped ranks: then they are the news
    assert failure_lines([_failure(1, signal="SIGSEGV")], 2) == [
        "rank 1 of 2: killed by SIGSEGV (signal 11)"
    ]
    assert failure_lines([_failure(1, exitcode=2)], 2) == [
        "rank 1 of 2: exited with code 2 without an error message"
    ]
    assert failure_lines([{"rank": None, "message": "rendezvous timed out"}], 2) == [
        "torchrun: rendezvous timed out"
    ]


def test_write_error_names_the_file_size_limit(tmp_path, monkeypatch):
    lost = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(checkpointer, "_file_size_limit", lambda: 8000)
    error = _write_error(4, tmp_path, lost, free=10**9, needed=2**20)
    assert error.errno == errno.EFBIG
    assert (
        "(file too large: the process's file size limit (ulimit -f) is 8000 bytes (7.8 KiB), "
        "the checkpoint needs about 1.0 MiB; raise it, e.g. `ulimit -f unlimited`)"
    ) in str(error)
    assert "\n" not in str(error)
    fits = _write_error(4, tmp_path, lost, free=10**9, needed=1000)  # the limit is not why
    assert "file too large" not in str(fits) and fits.errno is None
    monkeypatch.setattr(checkpointer, "_file_size_limit", lambda: None)
    efbig = OSError(errno.EFBIG, "File too large")
    assert "(file too large for the filesystem)" in str(
        _write_error(4, tmp_path, efbig, free=10**9, needed=1)
    )
