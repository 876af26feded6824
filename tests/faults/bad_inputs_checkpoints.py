"""Bad inputs about checkpoints and output folders: damaged content, foreign folders, a second
run in the same output dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.faults.kit import REFUSED, BadInput, Setup, World, resume_copy

__all__ = ["CASES"]


def _flip_byte(path: Path) -> Path:
    """One byte changed near the end of ``path`` (same size: only a content hash sees it)."""
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _incomplete_step_dir(world: World) -> Setup:
    """Another run's step folder without its COMPLETE manifest (a copy cut short)."""
    step = world.out / "checkpoints" / "step_000005"
    shutil.copytree(world.finished / "checkpoints" / "step_000001", step)
    (step / "COMPLETE").unlink()
    words = [str(world.out / "checkpoints"), "step_000005", "resume=true", "overwrite=true"]
    return Setup([], words)


def _only_checkpoint_corrupt(world: World) -> Setup:
    damaged = _flip_byte(resume_copy(world) / "model.safetensors")
    root = world.out / "checkpoints"
    return Setup(
        ["resume=true"], [f"no usable checkpoint in {root}", f"{damaged}: content differs"]
    )


def _resume_folder_corrupt(world: World) -> Setup:
    step = resume_copy(world)
    damaged = _flip_byte(step / "training_state" / "rank0.pt")
    return Setup([f"resume={step}"], [f"resume={step}", f"{damaged}: content differs"])


def _from_hf_own_checkpoint_corrupt(world: World) -> Setup:
    model = Path(
        shutil.copytree(world.finished / "checkpoints" / "step_000002", world.tmp / "ckpt")
    )
    damaged = _flip_byte(model / "model.safetensors")
    return Setup([f"model_dir={model}"], [f"{damaged}: content differs from the COMPLETE manifest"])


def _resume_elsewhere_into_other_checkpoints(world: World) -> Setup:
    shutil.copytree(world.finished, world.out)
    source = world.tmp / "source"
    shutil.copytree(world.finished / "checkpoints" / "step_000001", source / "step_000001")
    words = [str(world.out / "checkpoints"), "already holds checkpoints", "overwrite=true"]
    return Setup([f"resume={source / 'step_000001'}"], words)


def _lock_of_another_host(world: World) -> Setup:
    from tunesmith.training.checkpoint.run_lock import LOCK_NAME

    lock = world.out / LOCK_NAME
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({"pid": 4242, "host": "node-17", "started": "2026-01-01T00:00"}))
    return Setup([], [str(world.out), "host node-17", f"delete {lock}"])


CASES: list[BadInput] = [
    BadInput(
        "output-dir-holds-incomplete-step-dir",
        "checkpoint",
        "a new run into an output_dir whose checkpoints/ holds another run's step_000005 "
        "without a COMPLETE manifest (it used to be deleted by pruning)",
        REFUSED.format("the folder, resume=true and overwrite=true; the folder untouched"),
        _incomplete_step_dir,
    ),
    BadInput(
        "resume-only-checkpoint-corrupt-same-size",
        "checkpoint",
        "`resume=true` when the only checkpoint's model.safetensors has one byte flipped "
        "(same size)",
        REFUSED.format("the file (instead of resuming with wrong weights)"),
        _only_checkpoint_corrupt,
    ),
    BadInput(
        "resume-folder-corrupt-same-size",
        "checkpoint",
        "`resume=<folder>` whose training_state/rank0.pt has one byte flipped (same size)",
        REFUSED.format("the file"),
        _resume_folder_corrupt,
    ),
    BadInput(
        "from-hf-own-checkpoint-corrupt",
        "checkpoint",
        "model_dir=<one of our checkpoints> whose model.safetensors has one byte flipped "
        "(same size)",
        REFUSED.format("the file (from_hf verifies our own checkpoints)"),
        _from_hf_own_checkpoint_corrupt,
    ),
    BadInput(
        "resume-elsewhere-into-other-checkpoints",
        "checkpoint",
        "`resume=<a checkpoint elsewhere>` into an output_dir holding another run's checkpoints",
        REFUSED.format("the folder and overwrite=true; the old checkpoints untouched"),
        _resume_elsewhere_into_other_checkpoints,
    ),
    BadInput(
        "output-dir-locked-by-another-host",
        "checkpoint",
        "an output_dir whose lock file names a run on another host",
        REFUSED.format("the host and the lock file to delete if that run is dead"),
        _lock_of_another_host,
    ),
]
