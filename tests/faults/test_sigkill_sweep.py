"""SIGKILL at random points of a real training process: in the training loop, while a
checkpoint is written (weights, optimizer state, fsyncs, the rename, pruning) and during the
final save that exports the model. Whatever the point, every committed checkpoint that the run
still keeps is there and verifies against its manifest, no half-written one is visible, the
newest loads and equals the uninterrupted run's checkpoint of that step, and resuming in a new
process ends with bitwise the uninterrupted run's weights and the same logged metrics.

Each seed picks its kill point from the uninterrupted run's event map (seeds cycle through the
three phases); the child SIGKILLs itself when it reaches that event. CI runs 4 seeds, ``make
test-faults`` all 24."""

from __future__ import annotations

import signal

import pytest
import torch

from tests.faults.catalogue import params
from tests.faults.harness import (
    assert_same_run,
    assert_same_weights,
    expected_checkpoints,
    kill_point,
    read_mark,
    run_child,
)
from tests.recipes.sft_world import checkpoints
from tunesmith.models import from_hf
from tunesmith.training import CheckpointDirectory


def _state(folder) -> dict[str, torch.Tensor]:
    return from_hf(folder).state_dict()


@pytest.mark.parametrize("case", params("fault", "sigkill"))
def test_sigkill_at_a_random_point_loses_nothing(case, sweep, tmp_path, outcome):
    seed = int(case.id.rsplit("-", 1)[1])
    at, phase = kill_point(seed, sweep.events)
    out, mark = tmp_path / "run", tmp_path / "mark.json"
    killed = run_child(sweep.argv(out), tmp_path / "killed.log", probes={"at": at, "mark": mark})
    assert killed.exitcode == -signal.SIGKILL, killed.output[-3000:]
    assert read_mark(mark)["event"] == sweep.events[at]  # it died where the seed said

    root = out / "checkpoints"
    directory = CheckpointDirectory(root, clean_stale=False) if root.is_dir() else None
    expected = expected_checkpoints(sweep.events, at)
    left = [p.name for p in directory.list()] if directory else []
    assert left == expected, f"killed at {sweep.events[at]!r}"  # none lost, none half-written
    for name in left:
        assert CheckpointDirectory.is_complete(root / name, verify=True), name
    latest = directory.latest() if directory else None
    assert (latest.name if latest else None) == (expected[-1] if expected else None)
    if latest is not None:  # it loads, and it is what the uninterrupted run saved at that step
        reference = sweep.every_checkpoint / "checkpoints" / latest.name
        assert_same_weights(_state(latest), _state(reference), latest.name)

    resumed = run_child(sweep.argv(out, "resume=auto"), tmp_path / "resumed.log")
    assert resumed.exitcode == 0, resumed.output[-3000:]
    assert_same_run(out, sweep.reference)
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []  # dead writers' dirs
    outcome.update(
        phase=phase,
        killed_at=sweep.events[at],
        checkpoints_left=left,
        lost_checkpoints=0,
        resumed_from=latest.name if latest else "scratch",
        final=[p.name for p in checkpoints(out)][-1],
    )
