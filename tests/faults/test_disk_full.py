"""A full disk while a checkpoint is written: the run stops with one clear line (the step, the
checkpoint folder, 'disk full'), removes its partial checkpoint, and the previous checkpoint is
intact: it verifies, and resuming from it reproduces the uninterrupted run.

The disk is a real 2.6 MB tmpfs mounted in a private user and mount namespace (``unshare
-Urm``), so the write fails with ENOSPC from the kernel; the first checkpoint (1.6 MB) fits, the
second does not. Where the machine does not permit that mount the case falls back to
``RLIMIT_FSIZE`` (which the second case always uses): files may not grow past 100 kB once the
first checkpoint is written, so writes fail with EFBIG. Each case records its mechanism.

Two more cases lower the limit inside torch's own writers, just before the second checkpoint's
optimizer state (``torch.distributed.checkpoint``) or training state (``torch.save``, whose C++
writer reports EFBIG as 'unexpected pos ... vs ...'): the error must still name the limit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.faults.catalogue import params
from tests.faults.harness import run_child
from tests.recipes.sft_world import (
    checkpoint_weights,
    checkpoints,
    cli_command,
    final_weights,
    read_metrics,
    subprocess_env,
)
from tunesmith.training import CheckpointDirectory

TMPFS_SIZE = "2600k"  # one 1.6 MB checkpoint fits, a second does not
MOUNT_AND_RUN = (  # run inside `unshare -Urm`: $0 is the mount point, "$@" the command
    "mount -t tmpfs -o size=" + TMPFS_SIZE + ' tmpfs "$0" || exit 97; "$@"; rc=$?; '
    'cp -R "$0/." "$SNAPSHOT/"; exit $rc'
)


def tmpfs_permitted(tmp: Path) -> bool:
    """Whether this machine lets us mount a tmpfs in a private namespace."""
    if shutil.which("unshare") is None:
        return False
    probe = tmp / "probe"
    probe.mkdir()
    script = 'mount -t tmpfs -o size=64k tmpfs "$0"'
    result = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", script, str(probe)], capture_output=True, timeout=60
    )
    return result.returncode == 0


def _run_on_tmpfs(sweep, tmp: Path) -> tuple[int, str, Path, Path]:
    """The sweep run with its output_dir on a small tmpfs; returns (exit code, stderr, the
    output_dir as it was (copied out before the namespace went away), its path on tmpfs)."""
    mount, snapshot = tmp / "disk", tmp / "snapshot"
    mount.mkdir()
    snapshot.mkdir()
    out = mount / "out"
    argv = sweep.argv(out, f"metric_loggers.1.log_dir={tmp / 'logs'}")
    result = subprocess.run(
        ["unshare", "-Urm", "sh", "-c", MOUNT_AND_RUN, str(mount), *cli_command(*argv)],
        env=subprocess_env(SNAPSHOT=str(snapshot)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 97, result.stderr
    return result.returncode, result.stderr, snapshot / "out", out


def _limit_probes(case_id: str, events: list[str]) -> dict[str, object]:
    """Where each case lowers RLIMIT_FSIZE, and to what (the child's log stays below it)."""
    if case_id == "file-size-limit-in-torch-save":  # the step-4 checkpoint's rank0.pt (12 kB)
        second = events.index("save_begin 4")
        at = next(i for i in range(second, len(events)) if events[i].startswith("torch_save "))
        return {"at": at, "file_size_limit": 8_000}
    if case_id == "file-size-limit-in-optimizer-state":  # its dcp file (1 MB)
        return {"on": "optimizer_state begin", "nth": 2, "file_size_limit": 100_000}
    return {"on": "save_end 2", "file_size_limit": 100_000}  # its safetensors file (470 kB)


def _run_with_file_size_limit(sweep, tmp: Path, case_id: str) -> tuple[int, str, Path, Path]:
    out = tmp / "run"
    probes = _limit_probes(case_id, sweep.events)
    done = run_child(sweep.argv(out), tmp / "run.log", probes=probes)
    return done.exitcode, done.output, out, out


@pytest.mark.parametrize("case", params("fault", "disk_full"))
def test_full_disk_keeps_the_previous_checkpoint(case, sweep, tmp_path, outcome):
    tmpfs = case.id == "disk-full-during-checkpoint" and tmpfs_permitted(tmp_path)
    if tmpfs:
        code, output, left, written_to = _run_on_tmpfs(sweep, tmp_path)
    else:
        code, output, left, written_to = _run_with_file_size_limit(sweep, tmp_path, case.id)

    assert code == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("tunesmith: error: ")]
    assert len(errors) == 1, output[-3000:]
    error = errors[0]
    root = written_to / "checkpoints"
    assert f"failed to write checkpoint step 4 in {root}" in error, error
    if tmpfs:
        assert "disk full" in error, error
    else:  # the limit is named, even where torch's writer lost the errno
        limit = _limit_probes(case.id, sweep.events)["file_size_limit"]
        assert f"file too large: the process's file size limit (ulimit -f) is {limit} bytes" in (
            error
        ), error
    assert f"Older checkpoints in {root} are untouched" in error

    # what the failed run left: the first checkpoint, complete; no partial second one
    assert sorted(p.name for p in (left / "checkpoints").iterdir()) == ["step_000002"]
    step2 = left / "checkpoints" / "step_000002"
    assert CheckpointDirectory.is_complete(step2, verify=True)
    expected = checkpoint_weights(sweep.every_checkpoint / "checkpoints" / "step_000002")
    weights = checkpoint_weights(step2)
    assert weights.keys() == expected.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name
    state = torch.load(step2 / "training_state" / "rank0.pt", weights_only=True)
    assert state["progress"]["step"] == 2

    # resume from it on a disk with room: the uninterrupted run's result, bitwise
    resumed = tmp_path / "resumed"
    shutil.copytree(left, resumed)
    done = run_child(sweep.argv(resumed, "resume=true"), tmp_path / "resumed.log")
    assert done.exitcode == 0, done.output[-3000:]
    assert checkpoints(resumed)[-1].name == "step_000007"
    expected = final_weights(sweep.reference)
    for name, tensor in final_weights(resumed).items():
        assert torch.equal(tensor, expected[name]), name
    logged, logged_ref = read_metrics(resumed), read_metrics(sweep.reference)
    for step in range(3, 8):
        assert logged[step]["loss"] == logged_ref[step]["loss"], step
    outcome.update(
        mechanism="tmpfs (ENOSPC)" if tmpfs else "RLIMIT_FSIZE (EFBIG)",
        error=error.replace(str(written_to), "<output_dir>"),
        checkpoints_left=["step_000002"],
        lost_checkpoints=0,
    )
