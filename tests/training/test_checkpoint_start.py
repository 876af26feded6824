"""Where a run starts (``Checkpointer.start``): verified resume points, rollback that moves newer
checkpoints aside, and refusing (or with ``overwrite`` moving aside) another run's folders.
Nothing is ever deleted: every test checks the files are still somewhere."""

from __future__ import annotations

import os

import pytest
import torch

from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.training import CheckpointDirectory
from tunesmith.training.checkpoint.checkpointer import Checkpointer
from tunesmith.training.parallel.distributed import DistributedContext

CTX = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


def _write(root, *steps: int, run_id: str = "old") -> CheckpointDirectory:
    ckpts = CheckpointDirectory(root, run_id=run_id)
    for step in steps:
        ckpts.write(
            step,
            lambda tmp, s=step: (tmp / "model.safetensors").write_bytes(
                os.urandom(64) + bytes([s])
            ),
        )
    return ckpts


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    data[3] ^= 0x01
    path.write_bytes(bytes(data))


def _start(root, resume, **kwargs) -> tuple:
    lines: list[str] = []
    path = Checkpointer(root, CTX).start(resume, log=lines.append, **kwargs)
    return path, lines


def _steps(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step_"))


def test_fresh_run_in_an_empty_folder(tmp_path):
    assert _start(tmp_path / "checkpoints", False) == (None, [])
    assert _start(tmp_path / "checkpoints", True) == (None, [])


def test_fresh_run_refuses_a_folder_that_is_not_its_own(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_000003").mkdir(parents=True)  # a user's folder, no manifest
    (root / "step_000003" / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError) as info:
        _start(root, False)
    message = str(info.value)
    for words in (str(root), "step_000003", "resume=true", "overwrite=true"):
        assert words in message
    assert (root / "step_000003" / "notes.txt").read_text() == "keep"


def test_overwrite_moves_the_old_run_aside(tmp_path):
    root = tmp_path / "checkpoints"
    _write(root, 1, 2)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "config.yaml").write_text("lr: 1\n")
    path, lines = _start(root, False, overwrite=True)
    assert path is None and _steps(root) == []
    (aside,) = tmp_path.glob("overwritten-*")
    assert _steps(aside / "checkpoints") == ["step_000001", "step_000002"]
    assert (aside / "metrics.jsonl").is_file() and (aside / "config.yaml").is_file()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert str(aside) in lines[0] and "not deleted" in lines[0]


def test_resume_skips_a_damaged_newest_and_moves_it_aside(tmp_path):
    root = tmp_path / "checkpoints"
    _write(root, 2, 4)
    damaged = root / "step_000004" / "model.safetensors"
    _corrupt(damaged)
    checkpointer = Checkpointer(root, CTX)
    lines: list[str] = []
    assert checkpointer.start(True, log=lines.append) == root / "step_000002"
    assert f"skipping damaged checkpoint step_000004: {damaged}: content differs" in lines[0]
    (aside,) = root.glob("rolled-back-*")
    assert _steps(aside) == ["step_000004"] and _steps(root) == ["step_000002"]
    assert "moved the newer step_000004" in lines[1] and str(aside) in lines[1]
    assert checkpointer.directory.run_id == "old"  # continues the resumed run


def test_resume_from_an_older_step_moves_the_newer_ones_aside(tmp_path):
    root = tmp_path / "checkpoints"
    _write(root, 1, 2, 3)
    (root / "step_000009").mkdir()  # newer and not a checkpoint: moved too, never deleted
    path, lines = _start(root, str(root / "step_000001"))
    assert path == root / "step_000001"
    (aside,) = root.glob("rolled-back-*")
    assert _steps(aside) == ["step_000002", "step_000003", "step_000009"]
    assert _steps(root) == ["step_000001"]


def test_resume_with_no_good_checkpoint_names_the_file(tmp_path):
    root = tmp_path / "checkpoints"
    _write(root, 1)
    damaged = root / "step_000001" / "model.safetensors"
    _corrupt(damaged)
    with pytest.raises(FileNotFoundError) as info:
        _start(root, True)
    assert f"no usable checkpoint in {root}" in str(info.value)
    assert f"{damaged}: content differs" in str(info.value)
    assert _steps(root) == ["step_000001"]


def test_resume_from_a_damaged_folder_names_the_file(tmp_path):
    root = tmp_path / "checkpoints"
    _write(root, 1)
    damaged = root / "step_000001" / "model.safetensors"
    _corrupt(damaged)
    with pytest.raises(CheckpointError, match=f"{damaged}: content differs"):
        _start(root, str(root / "step_000001"))


def test_resume_from_elsewhere_refuses_another_runs_checkpoints(tmp_path):
    _write(tmp_path / "a" / "checkpoints", 1)
    root = tmp_path / "b" / "checkpoints"
    _write(root, 5)
    source = tmp_path / "a" / "checkpoints" / "step_000001"
    with pytest.raises(FileExistsError, match="overwrite=true"):
        _start(root, str(source))
    path, _ = _start(root, str(source), overwrite=True)
    assert path == source and _steps(root) == []
