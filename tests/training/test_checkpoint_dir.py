import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest

from tunesmith.training import MARKER, CheckpointDirectory, CheckpointWriteError
from tunesmith.training.checkpoint.directory import aside_folder


def _writer(payload: dict[str, bytes]):
    def write(tmp):
        for rel, data in payload.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp / rel).write_bytes(data)

    return write


def _payload(step: int) -> dict[str, bytes]:
    return {
        "model.safetensors": os.urandom(2048) + bytes([step % 256]),
        "train_state/optimizer.pt": f"opt-{step}".encode(),
    }


def _read(path) -> dict[str, bytes]:
    return {
        p.relative_to(path).as_posix(): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _names(root) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_write_list_latest_and_manifest(tmp_path):
    ckpts = CheckpointDirectory(tmp_path / "ckpts", checksum=True, run_id="run-a")
    assert ckpts.latest() is None and ckpts.list() == []
    written = {}
    for step in (5, 100, 20):
        written[step] = _payload(step)
        path = ckpts.write(step, _writer(written[step]))
        assert path == tmp_path / "ckpts" / f"step_{step:06d}"
    assert [p.name for p in ckpts.list()] == ["step_000005", "step_000020", "step_000100"]
    assert ckpts.latest() == tmp_path / "ckpts" / "step_000100"
    assert _names(tmp_path / "ckpts") == ["step_000005", "step_000020", "step_000100"]  # no temp
    for step, payload in written.items():
        path = ckpts.path_for(step)
        assert _read(path) == payload
        manifest = json.loads((path / MARKER).read_text())
        assert manifest["step"] == step and manifest["run"] == "run-a"
        assert manifest["files"] == {
            rel: {
                "size": len(data),
                "crc32": f"{zlib.crc32(data):08x}",
                "sha256": hashlib.sha256(data).hexdigest(),
            }
            for rel, data in payload.items()
        }
    assert CheckpointDirectory.step_of(ckpts.latest()) == 100
    assert ckpts.path_for(1234567).name == "step_1234567"


def test_keep_last_prunes_oldest_only_step_dirs(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "step_abc").mkdir()
    (tmp_path / "README.txt").write_text("keep me")
    ckpts = CheckpointDirectory(tmp_path, keep_last=2)
    for step in range(1, 6):
        ckpts.write(step, _writer(_payload(step)))
        expected = [f"step_{s:06d}" for s in range(max(1, step - 1), step + 1)]
        assert [p.name for p in ckpts.list()] == expected
    assert _names(tmp_path) == ["README.txt", "notes", "step_000004", "step_000005", "step_abc"]


def test_keep_last_never_prunes_the_one_just_written(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep_last=1)
    ckpts.write(30, _writer(_payload(30)))
    # Resumed from an older step: the newly written, lower-numbered checkpoint survives.
    ckpts.write(10, _writer(_payload(10)))
    assert [p.name for p in ckpts.list()] == ["step_000010"]


def test_keep_last_two_with_a_newer_stale_checkpoint(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        ckpts.write(step, _writer(_payload(step)))
    ckpts.write(15, _writer(_payload(15)))  # keep 15 (just written) and the newest other (30)
    assert [p.name for p in ckpts.list()] == ["step_000015", "step_000030"]


def test_failure_in_writer_leaves_previous_intact(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep_last=1)
    good = _payload(1)
    ckpts.write(1, _writer(good))

    def half_then_fail(tmp):
        (tmp / "model.safetensors").write_bytes(b"x" * 1000)
        raise RuntimeError("tokenizer export broke")

    with pytest.raises(CheckpointWriteError, match="tokenizer export broke") as info:
        ckpts.write(2, half_then_fail)
    assert str(tmp_path / "step_000002") in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert _names(tmp_path) == ["step_000001"]  # no temp dir, no partial step_000002
    assert ckpts.latest() == tmp_path / "step_000001"
    assert _read(ckpts.latest()) == good


def test_disk_full_is_reported_with_errno(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    ckpts.write(1, _writer(_payload(1)))

    def full(tmp):
        (tmp / "model.safetensors").write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(CheckpointWriteError, match="disk full") as info:
        ckpts.write(2, full)
    assert info.value.errno == errno.ENOSPC
    assert info.value.step == 2
    assert str(tmp_path) in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert _names(tmp_path) == ["step_000001"]


def test_keyboard_interrupt_cleans_up_and_propagates(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)

    def interrupted(tmp):
        (tmp / "a").write_bytes(b"a")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpts.write(1, interrupted)
    assert _names(tmp_path) == []


def test_existing_step_needs_overwrite(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    ckpts.write(7, _writer({"a": b"old"}))
    calls = []
    with pytest.raises(FileExistsError, match="step_000007"):
        ckpts.write(7, lambda tmp: calls.append(tmp))
    assert calls == []  # refused before writing anything
    ckpts.write(7, _writer({"b": b"new"}), overwrite=True)
    assert _read(tmp_path / "step_000007") == {"b": b"new"}
    assert _names(tmp_path) == ["step_000007"]


def test_writer_may_not_create_marker(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    with pytest.raises(CheckpointWriteError, match=MARKER):
        ckpts.write(1, _writer({MARKER: b"fake"}))
    assert _names(tmp_path) == []


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists (until reused)
    return proc.pid


def test_crash_leftovers_ignored_then_cleaned(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    good = _payload(1)
    ckpts.write(1, _writer(good))
    dead = _dead_pid()
    # A crashed write (temp dir with files, even a marker) and an unmarked step dir.
    crashed = tmp_path / f".tmp-step_000002-{dead}"
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    (crashed / MARKER).write_text(json.dumps({"step": 2, "files": {}}))
    (tmp_path / "step_000003").mkdir()
    (tmp_path / "step_000003" / "model.safetensors").write_bytes(b"no marker")
    # A temp dir of a live process (ours is pid 1-like: our parent) is left alone.
    live = tmp_path / f".tmp-step_000004-{os.getppid()}"
    live.mkdir()
    # Our own pid, but no write in progress in this process: stale (pid reuse in containers).
    own = tmp_path / f".tmp-step_000005-{os.getpid()}"
    own.mkdir()

    assert ckpts.latest() == tmp_path / "step_000001"
    assert [p.name for p in ckpts.list()] == ["step_000001"]

    reopened = CheckpointDirectory(tmp_path)
    assert not crashed.exists() and not own.exists()
    assert live.exists()
    assert (tmp_path / "step_000003").exists()  # not ours to delete outside keep_last pruning
    assert reopened.latest() == tmp_path / "step_000001"
    assert _read(reopened.latest()) == good


def test_interrupted_overwrite_is_restored(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    ckpts.write(3, _writer({"a": b"v1"}))
    # Simulate a crash between "move old aside" and "rename new in".
    os.rename(tmp_path / "step_000003", tmp_path / f".old-step_000003-{_dead_pid()}")
    assert ckpts.latest() is None
    CheckpointDirectory(tmp_path)
    assert _read(tmp_path / "step_000003") == {"a": b"v1"}


def test_latest_skips_checkpoint_not_matching_manifest(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    ckpts.write(1, _writer({"w": b"1234"}))
    ckpts.write(2, _writer({"w": b"5678"}))
    (tmp_path / "step_000002" / "w").write_bytes(b"56")  # truncated after the fact
    with pytest.warns(UserWarning, match="step_000002"):
        assert ckpts.latest() == tmp_path / "step_000001"
    assert ckpts.latest(verify=False) == tmp_path / "step_000002"


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointDirectory(tmp_path, keep_last=0)
    ckpts = CheckpointDirectory(tmp_path)
    with pytest.raises(ValueError, match="step"):
        ckpts.write(-1, _writer({}))
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        CheckpointDirectory.step_of(tmp_path / "latest")


_SLOW_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from tunesmith.training.checkpoint.directory import CheckpointDirectory

    ckpts = CheckpointDirectory(sys.argv[1], keep_last=1)

    def slow(tmp: Path) -> None:
        for i in range(20):
            (tmp / f"shard_{i:02d}.bin").write_bytes(os.urandom(256 * 1024))
            if i == 2:
                print("writing", flush=True)
            time.sleep(0.1)

    ckpts.write(2, slow)
    print("finished", flush=True)
    """
)


def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpts"
    good = {f"shard_{i:02d}.bin": os.urandom(64 * 1024) for i in range(5)}
    CheckpointDirectory(root, keep_last=1, checksum=True).write(1, _writer(good))

    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_WRITER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(0.15)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "finished" not in proc.stdout.read()
    leftovers = [n for n in _names(root) if n.startswith(".tmp-step_000002-")]
    assert len(leftovers) == 1  # the killed write's temp dir is there, half written
    assert 3 <= len(list((root / leftovers[0]).iterdir())) < 20

    ckpts = CheckpointDirectory(root, keep_last=1)  # cleans the dead writer's temp dir
    assert _names(root) == ["step_000001"]
    assert ckpts.latest() == root / "step_000001"
    assert CheckpointDirectory.is_complete(ckpts.latest(), verify=True)  # sha256 recorded
    assert _read(ckpts.latest()) == good


# ----------------------------------------------------------------------------- content hashes


def _flip_one_byte(path) -> None:
    """Same size, one byte changed (what a size check cannot see)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_same_size_corruption_is_found_and_skipped_naming_the_file(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    for step in (1, 2):
        ckpts.write(step, _writer(_payload(step)))
    damaged = tmp_path / "step_000002" / "train_state" / "optimizer.pt"
    _flip_one_byte(damaged)
    problem = CheckpointDirectory.problem(tmp_path / "step_000002")
    assert problem.startswith(f"{damaged}: content differs from the {MARKER} manifest"), problem
    assert CheckpointDirectory.problem(tmp_path / "step_000001") is None
    with pytest.warns(UserWarning, match=str(damaged)):
        assert ckpts.latest() == tmp_path / "step_000001"
    assert ckpts.newest_good() == (tmp_path / "step_000001", [(tmp_path / "step_000002", problem)])


def test_missing_and_resized_files_are_named(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    path = ckpts.write(1, _writer(_payload(1)))
    (path / "model.safetensors").write_bytes(b"short")
    assert CheckpointDirectory.problem(path) == (
        f"{path / 'model.safetensors'}: 5 bytes, the {MARKER} manifest records 2049"
    )
    (path / "model.safetensors").unlink()
    assert "missing (listed in the COMPLETE manifest)" in CheckpointDirectory.problem(path)
    assert "no COMPLETE manifest" in CheckpointDirectory.problem(tmp_path / "nothing")


def test_old_manifests_with_sizes_only_still_load(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    path = ckpts.write(1, _writer({"w": b"1234"}))
    (path / MARKER).write_text(json.dumps({"step": 1, "files": {"w": {"size": 4}}}))
    assert CheckpointDirectory.problem(path) is None
    assert ckpts.latest() == path
    (path / "w").write_bytes(b"4321")  # not visible to a size-only manifest: accepted as before
    assert ckpts.latest() == path
    (path / "w").write_bytes(b"12")
    with pytest.warns(UserWarning, match="2 bytes"):
        assert ckpts.latest() is None


# ----------------------------------------------------------------------------- never delete


def test_prune_removes_only_this_runs_checkpoints(tmp_path):
    other = CheckpointDirectory(tmp_path, run_id="other")
    other.write(1, _writer(_payload(1)))
    (tmp_path / "step_000002").mkdir()  # a user's folder: no manifest
    (tmp_path / "step_000002" / "notes.txt").write_text("mine")
    ckpts = CheckpointDirectory(tmp_path, keep_last=1, run_id="this")
    for step in (3, 4, 5):
        ckpts.write(step, _writer(_payload(step)))
    # keep_last counts this run's checkpoints only; the others are never touched
    assert _names(tmp_path) == ["step_000001", "step_000002", "step_000005"]
    assert (tmp_path / "step_000002" / "notes.txt").read_text() == "mine"


def test_adopt_continues_the_resumed_run(tmp_path):
    first = CheckpointDirectory(tmp_path, keep_last=2, run_id="first")
    for step in (1, 2):
        first.write(step, _writer(_payload(step)))
    resumed = CheckpointDirectory(tmp_path, keep_last=2)
    resumed.adopt(tmp_path / "step_000002")
    assert resumed.run_id == "first"
    resumed.write(3, _writer(_payload(3)))
    assert _names(tmp_path) == ["step_000002", "step_000003"]
    assert CheckpointDirectory.run_of(tmp_path / "step_000003") == "first"


def test_adopt_of_an_old_manifest_prunes_old_manifests(tmp_path):
    ckpts = CheckpointDirectory(tmp_path)
    for step in (1, 2):
        path = ckpts.write(step, _writer({"w": b"12"}))
        (path / MARKER).write_text(json.dumps({"step": step, "files": {"w": {"size": 2}}}))
    resumed = CheckpointDirectory(tmp_path, keep_last=1)
    resumed.adopt(tmp_path / "step_000002")
    assert resumed.run_id != "None" and CheckpointDirectory.run_of(tmp_path / "step_000002") is None
    resumed.write(3, _writer({"w": b"34"}))
    assert _names(tmp_path) == ["step_000003"]


def test_set_aside_moves_and_is_ignored_by_list_prune_and_clean(tmp_path):
    ckpts = CheckpointDirectory(tmp_path, keep_last=1)
    for step in (1, 2, 3):
        ckpts.write(step, _writer(_payload(step)))
    assert _names(tmp_path) == ["step_000003"]
    ckpts = CheckpointDirectory(tmp_path, keep_last=1)
    for step in (4, 5):
        ckpts.write(step, _writer(_payload(step)))
    into = aside_folder(tmp_path, "rolled-back")
    assert into.name.startswith("rolled-back-") and not into.exists()
    moved = ckpts.set_aside([tmp_path / "step_000005"], into)
    assert moved == into and _names(into) == ["step_000005"]
    assert aside_folder(tmp_path, "rolled-back") != into  # a second one gets its own name
    assert [p.name for p in ckpts.list()] == ["step_000003"]
    CheckpointDirectory(tmp_path, keep_last=1).write(6, _writer(_payload(6)))
    assert CheckpointDirectory.is_complete(into / "step_000005", verify=True)
    assert sorted(_names(tmp_path)) == sorted(["step_000003", "step_000006", into.name])
