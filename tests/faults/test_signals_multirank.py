"""Every stop signal (Ctrl-C, SIGTERM, SIGHUP) stops a run of many ranks as it stops one process:
a checkpoint at the end of the step, exit code 0, no process left.

* ``tunesmith run --nproc-per-node 2`` started as a real interpreter in a session of its own
  (as a shell starts a job) gets Ctrl-C (SIGINT to its whole process group, as a terminal sends
  it), SIGTERM or SIGHUP once a step is logged: both ranks save the step they stop at, the CLI
  exits 0 after them, and torchrun and the ranks are gone (SIGHUP and SIGTERM: slow); the CLI
  SIGKILLed (slow): torchrun stops the ranks, which save, and none is left;
* the forwarding itself, on stand-ins for torchrun and its ranks: each signal the CLI receives
  reaches each rank once, and torchrun none;
* one process: SIGHUP asks for a stop as SIGTERM does, and stays ignored under ``nohup``; the
  Ray trainer group's driver takes SIGHUP as well;
* asynchronous GRPO (slow: Ray starts in each run), with the trainer as 2 Ray actors and as 2
  torchrun ranks: Ctrl-C saves, exits 0, and leaves no trainer or Ray process behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.test_async_faults import RayProcesses
from tests.recipes.sft_world import (
    checkpoints,
    cli_command,
    make_counting_data,
    make_model_dir,
    read_metrics,
    sft_overrides,
    subprocess_env,
)
from tests.rl.rl_world import grpo_overrides, make_prompts, ray_temp_dir
from tests.rl.test_trainer_group import FAST, RAY_GROUP, SLOW_REWARD, STEPS
from tunesmith.cli.main import _SignalForwarder
from tunesmith.training.loop import _install_stop_handlers
from tunesmith.training.stop_signals import stop_signals

TOTAL = 1000  # far more steps than a run makes before its signal
BOUND_S = 60  # the CLI exits this long after the signal at most


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    return make_model_dir(root), make_counting_data(root / "count.jsonl", rows=24), root


# ----------------------------------------------------------------------- a real launcher


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's /proc), children first."""
    children = []
    for listed in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(p) for p in listed.read_text().split()]
        except OSError:  # that thread ended meanwhile
            continue
    return [p for child in children for p in (child, *descendants(child))]


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def wait_gone(pids: list[int]) -> list[int]:
    """``pids`` still alive after :data:`BOUND_S` s (none, once they have all exited)."""
    deadline = time.monotonic() + BOUND_S
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


@contextlib.contextmanager
def launched(argv: list[str], log: Path, **env: str) -> Iterator[subprocess.Popen]:
    """``tunesmith ARGV`` as a real interpreter leading a process group of its own (a job in
    a shell), its output in ``log``; SIGKILLed with everything below it if still running at
    the end (a failed test)."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            cli_command(*argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=subprocess_env(**env),
            start_new_session=True,
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            kill([*descendants(process.pid), process.pid])
            process.wait()


def kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def interrupt_when(
    process: subprocess.Popen,
    log: Path,
    line: str,
    how: str,
    sig: int,
    before: Callable[[], object] = lambda: None,
) -> list[int]:
    """Once ``line`` is in ``log``: ``before()``, then ``sig`` to ``process`` (``kill``) or to
    its whole process group (``ctrl-c``, as a terminal sends it). Returns the processes below
    it just before."""
    deadline = time.monotonic() + 300
    while line not in log.read_text():
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {line!r} in 300 s"
        time.sleep(0.05)
    before()
    below = descendants(process.pid)
    (os.killpg if how == "ctrl-c" else os.kill)(process.pid, sig)
    return below


def finish(process: subprocess.Popen, log: Path) -> int:
    """Its exit code, within :data:`BOUND_S` s of the signal (else the test fails)."""
    try:
        return process.wait(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        output = log.read_text()[-3000:]
        raise AssertionError(f"running {BOUND_S} s after the signal:\n{output}") from None


SIGNALS = [  # ~15 s each on 2 cores (4 interpreters start): one in the default selection
    pytest.param("ctrl-c", signal.SIGINT, id="ctrl-c"),
    # the same forwarding as Ctrl-C (test_each_signal_reaches_each_rank_once), and each signal
    # in a rank's training is the single-process tests' (below, test_interrupt_resume.py)
    pytest.param("kill", signal.SIGHUP, id="sighup", marks=pytest.mark.slow),
    pytest.param("kill", signal.SIGTERM, id="sigterm", marks=pytest.mark.slow),
    # the CLI itself killed: torchrun (told by Linux) stops the ranks with SIGTERM
    pytest.param("kill", signal.SIGKILL, id="sigkill-to-the-cli", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("how", "sig"), SIGNALS)
def test_a_stop_signal_saves_both_ranks_and_exits_0(world, tmp_path, how, sig):
    model_dir, data, _ = world
    out, log = tmp_path / "run", tmp_path / "cli.log"
    overrides = sft_overrides(
        model_dir, data, out, "batch_size=2", f"max_steps={TOTAL}", "distributed_timeout_s=60"
    )
    argv = ["run", "sft", "--config", "tiny", "--nproc-per-node", "2", *overrides]
    with launched(argv, log) as cli:
        below = interrupt_when(cli, log, f"step 1/{TOTAL}", how, sig)  # torchrun and its ranks
        code = finish(cli, log)
    killed = sig == signal.SIGKILL
    assert killed or alive(below) == []  # gone before the CLI exited
    left = wait_gone(below)
    kill(left)
    assert len(below) == 3 and left == [], below
    output = log.read_text()
    assert code == (-signal.SIGKILL if killed else 0), output[-3000:]
    (latest,) = checkpoints(out)
    step = int(latest.name.removeprefix("step_"))
    assert 1 <= step < TOTAL and max(read_metrics(out)) == step
    assert sorted(p.name for p in (latest / "training_state").glob("rank*.pt")) == [
        "rank0.pt",
        "rank1.pt",
    ]
    name = "SIGTERM" if killed else signal.Signals(sig).name
    assert f"{name}: stopped after step {step}; resume with resume=true" in output
    assert "tunesmith: interrupted" not in output and "tunesmith: error" not in output


# ------------------------------------------------------------------ the forwarding itself

_RANK = """
    import pathlib, signal, sys, time
    path, got = pathlib.Path(sys.argv[1]), []
    def record(signum, frame):
        got.append(signal.Signals(signum).name)
        path.write_text(" ".join(got))
    for name in sys.argv[2:]:
        signal.signal(getattr(signal, name), record)
    path.write_text("")  # ready
    while len(got) < len(sys.argv[2:]):
        time.sleep(0.01)
"""
_TORCHRUN = """
    import pathlib, signal, subprocess, sys
    folder, names, rank = pathlib.Path(sys.argv[1]), sys.argv[3:], sys.argv[2]
    def record(signum, frame):
        with open(folder / "torchrun", "a") as f:
            f.write(signal.Signals(signum).name + " ")
    for name in names:
        signal.signal(getattr(signal, name), record)
    ranks = [subprocess.Popen([sys.executable, "-c", rank, str(folder / f"rank{r}"), *names])
             for r in range(2)]
    sys.exit(max(r.wait() for r in ranks))
"""


def test_each_signal_reaches_each_rank_once(tmp_path):
    """The CLI's forwarder around a stand-in torchrun with 2 stand-in ranks: Ctrl-C, SIGTERM
    and SIGHUP sent to this process while it waits reach each rank once, never torchrun."""
    names = [s.name for s in stop_signals()]
    folder, ranks = tmp_path, [tmp_path / "rank0", tmp_path / "rank1"]

    def signal_this_process() -> None:
        while not all(r.exists() for r in ranks):
            time.sleep(0.01)
        for name in names:
            os.kill(os.getpid(), getattr(signal, name))
            time.sleep(0.1)

    with _SignalForwarder() as forwarder:
        installed = [signal.getsignal(getattr(signal, n)) == forwarder._receive for n in names]
        assert all(installed), installed  # else a signal below would stop the test run
        threading.Thread(target=signal_this_process, daemon=True).start()
        torchrun = [sys.executable, "-c", textwrap.dedent(_TORCHRUN), str(folder)]
        code = forwarder.start(subprocess.Popen([*torchrun, textwrap.dedent(_RANK), *names]))
    assert code == 0
    assert forwarder.received == names
    assert [r.read_text() for r in ranks] == [" ".join(names)] * 2
    assert not (folder / "torchrun").exists()


# ------------------------------------------------------------------------- one process


def test_sighup_in_training_asks_for_a_stop_as_sigterm_does():
    previous = signal.getsignal(signal.SIGHUP)
    stop_signal, restore = _install_stop_handlers(announce=False)
    try:
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
        assert stop_signal() == "SIGHUP"
    finally:
        restore()
    assert signal.getsignal(signal.SIGHUP) is previous


def test_sighup_ignored_at_the_start_stays_ignored():
    """``nohup tunesmith run ...``: the run outlives its terminal."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        stop_signal, restore = _install_stop_handlers(announce=False)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        restore()
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_the_ray_driver_takes_sighup_too():
    from tunesmith.rl.asynchronous.trainer_group import _Driver

    driver = object.__new__(_Driver)  # its signal handling alone: no Ray, no config
    driver.signals = []
    with driver._signals_forwarded():
        handlers = {s: signal.getsignal(s) for s in stop_signals()}
        assert len(set(handlers.values())) == 1, handlers
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
    assert driver.signals == [signal.SIGHUP]


# ------------------------------------------------------------------------ async GRPO


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["ray-actors", "torchrun-ranks"])
def test_ctrl_c_stops_async_grpo_with_a_checkpoint_and_no_process_left(world, tmp_path, launcher):
    """``grpo_async`` with its trainer as 2 Ray actors, or as 2 torchrun ranks whose rank 0
    starts Ray: Ctrl-C during step 2 (a reward call takes a second), then exit 0, the step
    it stopped at saved, every process of the run (trainers, Ray's) gone."""
    model_dir, _, root = world
    prompts = make_prompts(root / f"prompts-{launcher}.jsonl", rows=24)
    out, log = tmp_path / "run", tmp_path / "cli.log"
    group = [*RAY_GROUP, "ray.num_cpus=4"] if launcher == "ray-actors" else []
    ranks = ["--nproc-per-node", "2"] if launcher == "torchrun-ranks" else []
    with ray_temp_dir() as temp:
        overrides = grpo_overrides(
            model_dir, prompts, out, *FAST, "async_mode=sync", SLOW_REWARD, *group,
            f"ray.temp_dir={temp}",
        )  # fmt: skip
        argv = ["--allow-any-component", "run", "grpo_async", "--config", "tiny", *ranks]
        ray = RayProcesses(Path(temp))
        with launched([*argv, *overrides], log, RAY_AUTH_MODE="disabled") as cli:
            line = f"step 1/{STEPS}"
            below = interrupt_when(cli, log, line, "ctrl-c", signal.SIGINT, before=ray.scan)
            code, output = finish(cli, log), log.read_text()
        assert code == 0, output[-3000:]
        assert any(name == "raylet" for _, name in ray.seen.values()), ray.seen  # watched
        ray.wait_gone(below)
    (latest,) = checkpoints(out)
    step = int(latest.name.removeprefix("step_"))
    assert step < STEPS and max(read_metrics(out)) == step
    if launcher == "ray-actors":  # the driver sends its actors SIGTERM for any stop signal
        assert "SIGINT: sent SIGTERM to the trainer ranks" in output
    stopped = "SIGTERM" if launcher == "ray-actors" else "SIGINT"
    assert f"{stopped}: stopped after step {step}; resume with resume=true" in output
