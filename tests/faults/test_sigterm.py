"""SIGTERM (a preemption notice) at a step, during a checkpoint write and during the final
export: the process finishes what it is doing, writes a checkpoint and exits 0 within 30 s of
the signal, and resuming from that checkpoint reproduces the uninterrupted run bitwise. Through
``tunesmith run --nproc-per-node 2`` the CLI sends the signal on to both ranks (not to torchrun,
which would stop them), which save together and exit cleanly; INT and HUP too, and Ctrl-C to
the whole process group: ``test_signals_multirank.py``."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.catalogue import params
from tests.faults.harness import assert_same_run, finish, read_mark, run_child, start_child
from tests.recipes.sft_world import checkpoints, read_metrics, sft_overrides
from tunesmith.training import CheckpointDirectory

BOUND_S = 30


def _nth(events: list[str], name: str, n: int) -> int:
    """Index of the ``n``-th (1-based) event starting with ``name``."""
    return [i for i, e in enumerate(events) if e.startswith(name)][n - 1]


def _signal_point(case_id: str, events: list[str]) -> tuple[int, str]:
    """(event index, name of the checkpoint that must be the newest afterwards)."""
    if case_id == "sigterm-mid-step":
        return _nth(events, "backward", 3), "step_000003"
    if case_id == "sigterm-mid-checkpoint":
        return _nth(events, "optimizer_state begin", 1), "step_000003"
    export = _nth(events, "save_begin 7", 1)
    return next(i for i in range(export, len(events)) if events[i].startswith("fsync")), (
        "step_000007"
    )


@pytest.mark.parametrize("case", [p for p in params("fault", "sigterm") if "torchrun" not in p.id])
def test_sigterm_saves_and_exits_cleanly(case, sweep, tmp_path, outcome):
    at, newest = _signal_point(case.id, sweep.events)
    out, mark = tmp_path / "run", tmp_path / "mark.json"
    probes = {"at": at, "signal": signal.SIGTERM, "mark": mark}
    done = run_child(sweep.argv(out), tmp_path / "run.log", probes=probes)
    exit_s = time.monotonic() - read_mark(mark)["time"]
    assert done.exitcode == 0, done.output[-3000:]
    assert exit_s < BOUND_S, f"exited {exit_s:.1f} s after SIGTERM"
    directory = CheckpointDirectory(out / "checkpoints", clean_stale=False)
    assert directory.latest().name == newest
    assert CheckpointDirectory.is_complete(directory.latest(), verify=True)
    if newest != "step_000007":
        assert f"SIGTERM: stopped after step {int(newest[5:])}" in done.output
        assert max(read_metrics(out)) == int(newest[5:])
        resumed = run_child(sweep.argv(out, "resume=true"), tmp_path / "resumed.log")
        assert resumed.exitcode == 0, resumed.output[-3000:]
    assert_same_run(out, sweep.reference)
    outcome.update(
        signalled_at=sweep.events[at],
        exit_code=0,
        seconds_to_exit=round(exit_s, 2),
        checkpoint=newest,
    )


@pytest.mark.parametrize("case", [p for p in params("fault", "sigterm") if "torchrun" in p.id])
def test_sigterm_through_torchrun_stops_both_ranks(case, fault_world, tmp_path, outcome):
    out, log = tmp_path / "run", tmp_path / "cli.log"
    overrides = sft_overrides(
        fault_world.model_dir,
        fault_world.count,
        out,
        "batch_size=2",
        "max_steps=1000",
        "distributed_timeout_s=60",
    )
    argv = ["run", "sft", "--config", "tiny", "--nproc-per-node", "2", *overrides]
    started = time.monotonic()
    cli = start_child(argv, log)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and '"loss"' in metrics.read_text()):
        assert cli.exitcode is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no step logged in 240 s"
        time.sleep(0.1)
    cli.terminate()  # SIGTERM to the `tunesmith run` process
    sent = time.monotonic()
    done = finish(cli, log, timeout=120, started=started)
    exit_s = time.monotonic() - sent
    assert done.exitcode == 0, done.output[-3000:]
    assert exit_s < 2 * BOUND_S, f"exited {exit_s:.1f} s after SIGTERM"
    (latest,) = checkpoints(out)
    ranks = sorted(p.name for p in (latest / "training_state").glob("rank*.pt"))
    assert ranks == ["rank0.pt", "rank1.pt"]
    assert f"SIGTERM: stopped after step {int(latest.name[5:])}" in done.output
    outcome.update(exit_code=0, seconds_to_exit=round(exit_s, 2), checkpoint=latest.name)
