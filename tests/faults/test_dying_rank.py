"""A rank that dies or hangs in a 2-rank gloo run (FSDP2): the other rank must not wait
forever. It exits 1 with one line naming the failed collective: at once when the peer's
connection closes (killed), after ``distributed_timeout_s`` when the peer is alive but silent
(SIGSTOP; without the bound gloo would wait 30 minutes). Through ``tunesmith run
--nproc-per-node 2`` torchrun stops the surviving rank and the CLI reports the failure: one
line per failed rank (the killed one first), torchrun's output and the tracebacks in the log.

The ranks are started the way torchrun starts them (the torchrun environment variables), as
children of the suite's fork server; the victim signals itself at its third forward pass."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.faults.catalogue import params
from tests.faults.harness import finish, read_mark, start_child, stop
from tests.faults.test_error_faults import torchrun_errors
from tests.recipes.sft_world import free_port, sft_overrides

TIMEOUT_S = 10  # distributed_timeout_s of these runs
BOUND_S = 60  # the survivor must be gone this long after the fault


def _one_error(output: str) -> str:
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("tunesmith: error: ")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


@pytest.mark.parametrize(
    "case", [p for p in params("fault", "rank_death") if "torchrun" not in p.id]
)
def test_survivor_exits_with_a_clear_error(case, fault_world, tmp_path, outcome):
    victim = 0 if case.id == "rank-0-killed" else 1
    survivor = 1 - victim
    sig = signal.SIGSTOP if case.id == "rank-1-stopped" else signal.SIGKILL
    argv = ["run", "sft", "--config", "tiny", *sft_overrides(
        fault_world.model_dir, fault_world.count, tmp_path / "out", "batch_size=2",
        "max_steps=50", f"distributed_timeout_s={TIMEOUT_S}",
    )]  # fmt: skip
    port, mark = str(free_port()), tmp_path / "mark.json"
    ranks, logs = [], [tmp_path / f"rank{r}.log" for r in range(2)]
    started = time.monotonic()
    for rank in range(2):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        probes = (
            {"on": "forward", "nth": 3, "signal": sig, "mark": mark} if rank == victim else None
        )
        ranks.append(start_child(argv, logs[rank], env=env, probes=probes))
    try:
        done = finish(ranks[survivor], logs[survivor], timeout=240, started=started)
        assert mark.is_file(), "the victim never reached its third forward pass"
        after_s = time.monotonic() - read_mark(mark)["time"]
    finally:
        for process in ranks:
            stop(process)  # the frozen or surviving one, if any
    assert done.exitcode == 1, done.output[-3000:]
    assert after_s < BOUND_S, f"rank {survivor} took {after_s:.0f} s to give up"
    if sig == signal.SIGSTOP:
        assert after_s >= TIMEOUT_S - 1, f"gave up after {after_s:.1f} s, before the timeout"
    error = _one_error(done.output)
    assert f"rank {survivor} of 2: a collective operation with the other ranks failed" in error
    assert "another rank has probably died or hangs" in error
    assert f"distributed_timeout_s: {TIMEOUT_S} s" in error
    outcome.update(exit_code=1, seconds_after_fault=round(after_s, 1), error=error)


@pytest.mark.parametrize("case", [p for p in params("fault", "rank_death") if "torchrun" in p.id])
def test_rank_dying_under_torchrun_fails_the_cli(case, fault_world, tmp_path, outcome):
    # ranks start with a safe sys.path: the test's own components are added deliberately (in
    # the child's environment: the fork server's was fixed when it started)
    repo = {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    overrides = sft_overrides(
        fault_world.model_dir,
        fault_world.count,
        tmp_path / "out",
        "batch_size=2",
        "max_steps=50",
        f"distributed_timeout_s={TIMEOUT_S}",
        "loss._component_=tests.faults.components.DieOnCall",
        "loss.call=3",
        "loss.rank=1",
    )
    argv = ["--allow-any-component", "run", "sft", "--config", "tiny", "--nproc-per-node", "2",
            *overrides]  # fmt: skip
    log = tmp_path / "cli.log"
    started = time.monotonic()
    done = finish(start_child(argv, log, env=repo), log, timeout=240, started=started)
    assert done.exitcode == 1, done.output[-3000:]
    lines, log = torchrun_errors(done.output)
    assert lines[0] == (
        "tunesmith: error: rank 1 of 2: killed by SIGKILL (signal 9); out of memory? see `dmesg`"
    ), lines
    for line in lines[1:]:  # the survivor's own error, when it wrote one before torchrun's SIGTERM
        assert line.startswith("tunesmith: error: rank 0 of 2: a collective operation"), lines
    text = log.read_text()
    assert "exitcode  : -9" in text  # torchrun's summary names the killed rank, in the log
    assert "[rank0]: step 2/" in text  # the ranks' output is there too
    outcome.update(exit_code=1, seconds=round(done.seconds, 1), error=lines[0])
