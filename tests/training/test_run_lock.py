"""The output-dir lock: a live holder (a real second process) refuses, a SIGKILLed one is taken
over, another host's is refused naming the file, release leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tunesmith.training.checkpoint.run_lock import LOCK_NAME, OutputDirInUseError, RunLock

_HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tunesmith.training.checkpoint.run_lock import RunLock

    lock = RunLock.acquire(Path(sys.argv[1]))
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    lock.release()
    """
)


@pytest.fixture
def holder(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "out")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_a_live_holder_refuses_a_second_run(holder, tmp_path):
    out = tmp_path / "out"
    owner = json.loads((out / LOCK_NAME).read_text())
    assert owner["pid"] == holder.pid and owner["host"] == socket.gethostname()
    with pytest.raises(OutputDirInUseError) as info:
        RunLock.acquire(out)
    message = str(info.value)
    assert f"pid {holder.pid} on host {owner['host']}" in message
    assert str(out / LOCK_NAME) in message and "choose another output_dir" in message
    holder.stdin.close()  # the holder finishes and releases: the next run goes ahead
    assert holder.wait(timeout=30) == 0
    assert not (out / LOCK_NAME).exists()
    RunLock.acquire(out).release()


def test_the_lock_of_a_killed_run_is_taken_over(holder, tmp_path):
    out = tmp_path / "out"
    holder.send_signal(signal.SIGKILL)
    assert holder.wait(timeout=30) == -signal.SIGKILL
    assert (out / LOCK_NAME).is_file()  # left behind, stale
    with RunLock.acquire(out) as lock:
        assert f"pid {holder.pid}" in lock.took_over and "no longer running" in lock.took_over
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not (out / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_refused_naming_the_file(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"pid": 1, "host": "node-17", "started": "yesterday"}))
    with pytest.raises(OutputDirInUseError) as info:
        RunLock.acquire(tmp_path)
    assert "host node-17" in str(info.value) and f"delete {lock}" in str(info.value)
    assert lock.is_file()


def test_a_second_lock_in_the_same_process_is_refused(tmp_path):
    with RunLock.acquire(tmp_path), pytest.raises(OutputDirInUseError, match=f"pid {os.getpid()}"):
        RunLock.acquire(tmp_path)


def test_release_leaves_nothing_behind(tmp_path):
    RunLock.acquire(tmp_path / "new").release()
    assert not (tmp_path / "new").exists()  # created by the lock, empty: removed again
    RunLock.acquire(tmp_path).release()
    assert tmp_path.is_dir() and list(tmp_path.iterdir()) == []


_FORKING_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from tunesmith.training.checkpoint.run_lock import RunLock

    lock = RunLock.acquire(Path(sys.argv[1]))
    child = os.fork()
    if child == 0:  # inherits the locked file description, as a forked worker would
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    sys.stdin.read()
    """
)


def test_a_lock_kept_by_a_child_of_a_dead_run_says_so(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKING_HOLDER, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(proc.stdout.readline())
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with pytest.raises(OutputDirInUseError, match="still held by a process it started"):
            RunLock.acquire(out)
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # the kernel drops the lock once the killed child has exited
        try:
            lock = RunLock.acquire(out)
            break
        except OutputDirInUseError:
            assert time.monotonic() < deadline, "the lock outlived the child"
            time.sleep(0.05)
    with lock:
        assert f"pid {proc.pid}" in lock.took_over
