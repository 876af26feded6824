"""Checkpoint integrity and output folders, with real `tunesmith run sft` processes: a checkpoint
damaged after it was written (same size: only the content hash sees it) is skipped, the run
rolls back to the previous good one and continues past the damaged step to the uninterrupted
run's result; resuming an older step continues too; nothing is deleted that the run did not
write (newer checkpoints, a user's folders are moved aside or left alone); one run per output
dir, and a killed run's lock does not block its resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from tests.faults.catalogue import params
from tests.faults.harness import assert_same_run, finish, read_mark, run_child, start_child, stop
from tests.recipes.sft_world import checkpoints
from tunesmith.training import CheckpointDirectory
from tunesmith.training.checkpoint.run_lock import LOCK_NAME

# the file each corruption case damages in the newest checkpoint
DAMAGED = {
    "corrupt-newest-weights-same-size": "model.safetensors",
    "corrupt-newest-rank-state-same-size": "training_state/rank0.pt",
    "corrupt-newest-optimizer-state-same-size": "training_state/optimizer/*.distcp",
}


def _flip_byte(path: Path) -> None:
    """One byte changed near the end (tensor data, not a header): the size stays the same."""
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF
    path.write_bytes(bytes(data))


def _stopped_run(sweep, out: Path, tmp: Path, *extra: str) -> None:
    """The sweep run stopped after step 4: checkpoints step_000002 and step_000004."""
    done = run_child(sweep.argv(out, "stop_after_steps=4", *extra), tmp / "first.log")
    assert done.exitcode == 0, done.output[-3000:]
    assert [p.name for p in checkpoints(out)] == ["step_000002", "step_000004"]


def _resume(sweep, out: Path, tmp: Path, *extra: str, name: str = "resumed"):
    done = run_child(sweep.argv(out, *extra), tmp / f"{name}.log")
    assert done.exitcode == 0, done.output[-3000:]
    assert "Traceback" not in done.output
    return done


def _rolled_back(root: Path) -> tuple[Path, list[str]]:
    (aside,) = root.glob("rolled-back-*")
    return aside, sorted(p.name for p in aside.iterdir())


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file()
    }


def _shown(text: str, tmp: Path) -> str:
    return text.replace(str(tmp), "<case>")


@pytest.mark.parametrize("case", params("fault", "corruption"))
def test_same_size_corruption_rolls_back_and_continues(case, sweep, tmp_path, outcome):
    out = tmp_path / "run"
    _stopped_run(sweep, out, tmp_path)
    root = out / "checkpoints"
    (damaged,) = (root / "step_000004").glob(DAMAGED[case.id])
    _flip_byte(damaged)
    assert CheckpointDirectory.is_complete(root / "step_000004")  # sizes alone: looks fine

    done = _resume(sweep, out, tmp_path, "resume=true")
    warning = f"warning: skipping damaged checkpoint step_000004: {damaged}: content differs"
    assert warning in done.output, done.output[-3000:]
    assert f"resumed from {root / 'step_000002'} at step 2" in done.output
    aside, moved = _rolled_back(root)
    assert (
        moved == ["step_000004"]
        and (aside / "step_000004" / damaged.relative_to(root / "step_000004")).is_file()
    )
    assert [p.name for p in checkpoints(out)] == ["step_000006", "step_000007"]
    assert_same_run(out, sweep.reference)
    line = next(x for x in done.output.splitlines() if x.startswith("warning: skipping"))
    outcome.update(
        warning=_shown(line, tmp_path)[:160] + "...",
        resumed_from="step_000002",
        moved_aside=f"{aside.name}/step_000004",
        final="step_000007",
        lost_checkpoints=0,
    )


@pytest.mark.parametrize("case", [p for p in params("fault", "rollback") if "truncated" in p.id])
def test_damaged_newest_rolls_back_and_finishes(case, sweep, tmp_path, outcome):
    out = tmp_path / "run"
    _stopped_run(sweep, out, tmp_path)
    weights = out / "checkpoints" / "step_000004" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])

    done = _resume(sweep, out, tmp_path, "resume=true")
    assert "FileExistsError" not in done.output and "overwrite=True" not in done.output
    assert f"{weights}: " in done.output and "bytes, the COMPLETE manifest records" in done.output
    aside, moved = _rolled_back(out / "checkpoints")
    assert moved == ["step_000004"]
    assert_same_run(out, sweep.reference)
    outcome.update(
        resumed_from="step_000002",
        moved_aside=f"{aside.name}/step_000004",
        final="step_000007",
        lost_checkpoints=0,
    )


@pytest.mark.parametrize("case", [p for p in params("fault", "rollback") if "older" in p.id])
def test_resume_of_an_older_step_continues(case, sweep, tmp_path, outcome):
    out = Path(shutil.copytree(sweep.every_checkpoint, tmp_path / "run"))
    root = out / "checkpoints"
    names = ["step_000002", "step_000004", "step_000006", "step_000007"]
    assert [p.name for p in checkpoints(out)] == names
    done = _resume(sweep, out, tmp_path, f"resume={root / 'step_000004'}", "keep_last=null")
    aside, moved = _rolled_back(root)
    assert moved == ["step_000006", "step_000007"]
    assert f"moved the newer step_000006, step_000007 to {aside} (not deleted)" in done.output
    assert [p.name for p in checkpoints(out)] == names  # 6 and 7 written again
    for name in moved:  # the moved ones are intact and verify
        assert CheckpointDirectory.problem(aside / name) is None
    assert_same_run(out, sweep.reference)
    outcome.update(
        resumed_from="step_000004",
        moved_aside=f"{aside.name}/{{step_000006, step_000007}}",
        final="step_000007",
        lost_checkpoints=0,
    )


@pytest.mark.parametrize("case", [p for p in params("fault", "lock") if "second" in p.id])
def test_second_run_in_the_same_output_dir_is_refused(case, sweep, tmp_path, outcome):
    out, mark = tmp_path / "run", tmp_path / "mark.json"
    probes = {"on": "backward", "nth": 3, "signal": signal.SIGSTOP, "mark": mark}
    started = time.monotonic()
    first = start_child(sweep.argv(out), tmp_path / "first.log", probes=probes)
    try:
        deadline = time.monotonic() + 120
        while not mark.is_file():
            assert first.exitcode is None and time.monotonic() < deadline, "never reached step 3"
            time.sleep(0.05)
        assert read_mark(mark)["event"] == "backward"
        before = _files(out)
        assert "metrics.jsonl" in before and "config.yaml" in before

        second = run_child(sweep.argv(out), tmp_path / "second.log")
        assert second.exitcode == 1, second.output[-3000:]
        errors = [x for x in second.output.splitlines() if x.startswith("tunesmith: error: ")]
        assert len(errors) == 1 and "Traceback" not in second.output, second.output[-3000:]
        assert f"is in use by another run (pid {first.pid} on host" in errors[0]
        assert str(out / LOCK_NAME) in errors[0]
        assert _files(out) == before  # wrote nothing: not even a line of metrics

        os.kill(first.pid, signal.SIGCONT)
        done = finish(first, tmp_path / "first.log", timeout=120, started=started)
    finally:
        stop(first)
    assert done.exitcode == 0, done.output[-3000:]
    assert not (out / LOCK_NAME).exists()
    assert_same_run(out, sweep.reference)
    outcome.update(error=_shown(errors[0], tmp_path), first_run="finished, equal to the reference")


@pytest.mark.parametrize("case", [p for p in params("fault", "lock") if "stale" in p.id])
def test_stale_lock_of_a_killed_run_is_taken_over(case, sweep, tmp_path, outcome):
    out, mark = tmp_path / "run", tmp_path / "mark.json"
    probes = {"on": "save_end 2", "signal": signal.SIGKILL, "mark": mark}
    killed = run_child(sweep.argv(out), tmp_path / "killed.log", probes=probes)
    assert killed.exitcode == -signal.SIGKILL, killed.output[-3000:]
    lock = out / LOCK_NAME
    assert lock.is_file()  # the dead run's lock is still there
    dead_pid = json.loads(lock.read_text())["pid"]

    done = _resume(sweep, out, tmp_path, "resume=true")
    message = next(x for x in done.output.splitlines() if x.startswith("taking over"))
    assert f"taking over the stale lock {lock} of pid {dead_pid}" in message
    assert "no longer running" in message
    assert not lock.exists()
    assert_same_run(out, sweep.reference)
    outcome.update(
        message=_shown(message, tmp_path), resumed_from="step_000002", lost_checkpoints=0
    )


def _user_folder(root: Path, name: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "notes.md").write_text("my notes about this run\n")
    return folder


@pytest.mark.parametrize("case", [p for p in params("fault", "output_dir") if "fresh" in p.id])
def test_user_folder_survives_a_fresh_run(case, sweep, tmp_path, outcome):
    out = tmp_path / "run"
    folder = _user_folder(out / "checkpoints", "step_000003")
    refused = run_child(sweep.argv(out), tmp_path / "refused.log")
    assert refused.exitcode == 1, refused.output[-3000:]
    (error,) = [x for x in refused.output.splitlines() if x.startswith("tunesmith: error: ")]
    for words in (str(out / "checkpoints"), "step_000003", "resume=true", "overwrite=true"):
        assert words in error, error
    assert (folder / "notes.md").is_file()
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "notes.md", "step_000003"]

    done = _resume(sweep, out, tmp_path, "overwrite=true")
    (aside,) = out.glob("overwritten-*")
    assert (aside / "checkpoints" / "step_000003" / "notes.md").read_text().startswith("my notes")
    assert f"to {aside} (not deleted)" in done.output
    assert_same_run(out, sweep.reference)
    outcome.update(
        error=_shown(error, tmp_path),
        overwrite=f"moved to {aside.name}/checkpoints/step_000003, notes intact",
        lost_checkpoints=0,
    )


@pytest.mark.parametrize("case", [p for p in params("fault", "output_dir") if "pruning" in p.id])
def test_user_folder_survives_pruning(case, sweep, tmp_path, outcome):
    out = tmp_path / "run"
    _stopped_run(sweep, out, tmp_path)
    folder = _user_folder(out / "checkpoints", "step_000001")
    _resume(sweep, out, tmp_path, "resume=true")
    assert (folder / "notes.md").read_text().startswith("my notes")
    # keep_last=2 pruned the run's own step_000002 and step_000004, nothing else
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps == ["step_000001", "step_000006", "step_000007"]
    assert_same_run(out, sweep.reference)
    outcome.update(left=", ".join(steps), user_folder="intact", lost_checkpoints=0)
