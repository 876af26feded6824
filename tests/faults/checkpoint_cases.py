"""Faults about checkpoint integrity and output folders: same-size corruption, rollback past a
damaged checkpoint, a second run in the same folder, a user's folder left alone."""

from __future__ import annotations

from tests.faults.kit import Case

__all__ = ["CHECKPOINT_FAULTS"]

_SAME = "ends bitwise equal to the uninterrupted run (weights and every logged step)"
_FALLS_BACK = (
    "resume=true warns naming the file, resumes from step_000002, moves step_000004 to "
    "checkpoints/rolled-back-<time>/ (not deleted), writes step 4 again and " + _SAME
)

CHECKPOINT_FAULTS: list[Case] = [
    Case(
        "corrupt-newest-weights-same-size",
        "fault",
        "corruption",
        "one byte of model.safetensors flipped (same size) in the newest checkpoint "
        "(step_000004; step_000002 intact)",
        _FALLS_BACK,
    ),
    Case(
        "corrupt-newest-rank-state-same-size",
        "fault",
        "corruption",
        "one byte of training_state/rank0.pt flipped (same size) in the newest checkpoint",
        _FALLS_BACK,
    ),
    Case(
        "corrupt-newest-optimizer-state-same-size",
        "fault",
        "corruption",
        "one byte of the optimizer's .distcp file flipped (same size) in the newest checkpoint",
        _FALLS_BACK,
    ),
    Case(
        "truncated-newest-continues",
        "fault",
        "rollback",
        "the newest checkpoint's model.safetensors cut short (the case that used to die at step "
        "4 with 'FileExistsError ... pass overwrite=True')",
        "resume=true falls back to step_000002 and continues past step 4 to the end; " + _SAME,
    ),
    Case(
        "resume-older-step-continues",
        "fault",
        "rollback",
        "a finished run (checkpoints of steps 2, 4, 6, 7) resumed with resume=<step_000004>",
        "step_000006 and step_000007 moved to checkpoints/rolled-back-<time>/ (not deleted), "
        "the run continues from step 4 and " + _SAME,
    ),
    Case(
        "second-run-same-output-dir",
        "fault",
        "lock",
        "a second `tunesmith run sft` in the output dir of a run that is still training "
        "(frozen with SIGSTOP at its 3rd backward, so the overlap is certain)",
        "the second exits 1 at start naming the first's pid and the lock file, having written "
        "nothing (metrics.jsonl, config.yaml unchanged); the first, continued, " + _SAME,
    ),
    Case(
        "stale-lock-after-sigkill",
        "fault",
        "lock",
        "SIGKILL right after the step-2 checkpoint: the lock file of the dead run stays behind",
        "resume=true takes the stale lock over with a message naming the dead pid, removes the "
        "lock at the end, and " + _SAME,
    ),
    Case(
        "user-folder-survives-fresh-run",
        "fault",
        "output_dir",
        "a user's checkpoints/step_000003/ (notes, no manifest) in the output dir of a new run",
        "resume=false refused (names the folder, resume=true and overwrite=true), nothing "
        "touched; overwrite=true moves it to overwritten-<time>/checkpoints/ with its notes "
        "intact, and the new run " + _SAME,
    ),
    Case(
        "user-folder-survives-pruning",
        "fault",
        "output_dir",
        "a user's checkpoints/step_000001/ (notes, no manifest) next to a stopped run's "
        "checkpoints, resumed with keep_last=2",
        "pruning removes only the run's own old checkpoints: the user's folder and notes "
        "survive the resumed run, which " + _SAME,
    ),
]
