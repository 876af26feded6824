"""Bad inputs refused by the up-front check of the loop's keys (type, range, enum) and by the
resume check that compares a changed config with the checkpoint's."""

from __future__ import annotations

import shutil
from collections.abc import Callable

from tests.faults.kit import REFUSED, BadInput, Setup, World, resume_copy

__all__ = ["CASES"]


def _values(*overrides: str, words: list[str]) -> Callable[[World], Setup]:
    return lambda world: Setup(list(overrides), words)


def _cuda_without_cuda(world: World) -> Setup:
    import torch

    if torch.cuda.is_available():  # nothing to refuse here: a device name outside the choices
        return Setup(["device=cuda:0"], ["device: expected one of 'auto', 'cpu', 'cuda'"])
    return Setup(["device=cuda"], ["device: got 'cuda', but this machine has no CUDA device"])


def _resume_changed(*overrides: str, words: list[str]) -> Callable[[World], Setup]:
    def build(world: World) -> Setup:
        step = resume_copy(world)
        return Setup([f"resume={step}", *overrides], [f"resume from {step}", *words])

    return build


def _resume_changed_data(world: World) -> Setup:
    step = resume_copy(world)
    other = shutil.copy(world.data, world.tmp / "other.jsonl")
    words = [f"resume from {step}", f"dataset.source: '{world.data}' -> '{other}'"]
    return Setup([f"resume={step}", f"dataset.source={other}"], words)


def _resume_true_changed_lr(world: World) -> Setup:
    step = resume_copy(world)  # the latest (only) checkpoint of world.out
    return Setup(
        ["resume=true", "optimizer.lr=0.01"], [f"resume from {step}", "optimizer.lr: 0.001 -> 0.01"]
    )


_RULE = "one line naming {} and what is allowed; nothing written"

CASES: list[BadInput] = [
    BadInput(
        "loop-negative-max-grad-norm", "config", "`max_grad_norm=-1` (flipped the gradients)",
        _RULE.format("max_grad_norm and -1"),
        _values("max_grad_norm=-1",
                words=["max_grad_norm: expected a number > 0, or null (no clipping), got -1"]),
    ),
    BadInput(
        "loop-zero-max-grad-norm", "config", "`max_grad_norm=0` (silently no clipping)",
        _RULE.format("max_grad_norm and 0"),
        _values("max_grad_norm=0", words=["max_grad_norm: expected a number > 0", "got 0"]),
    ),
    BadInput(
        "loop-unknown-nonfinite-policy", "config",
        "`on_nonfinite_loss=STOP` (skipped NaN steps silently)",
        _RULE.format("on_nonfinite_loss, 'STOP' and the choices"),
        _values("on_nonfinite_loss=STOP",
                words=["on_nonfinite_loss: expected one of 'stop', 'skip', got 'STOP'"]),
    ),
    BadInput(
        "loop-zero-max-steps", "config", "`max_steps=0`", _RULE.format("max_steps and 0"),
        _values("max_steps=0", words=["max_steps: expected an int >= 1", "got 0"]),
    ),
    BadInput(
        "loop-zero-save-every", "config", "`save_every_n_steps=0`",
        _RULE.format("save_every_n_steps and 0"),
        _values("save_every_n_steps=0",
                words=["save_every_n_steps: expected an int >= 1", "got 0"]),
    ),
    BadInput(
        "loop-negative-stop-after", "config", "`stop_after_steps=-1`",
        _RULE.format("stop_after_steps and -1"),
        _values("stop_after_steps=-1", words=["stop_after_steps: expected an int >= 1", "got -1"]),
    ),
    BadInput(
        "loop-zero-grad-accumulation", "config", "`gradient_accumulation_steps=0`",
        _RULE.format("gradient_accumulation_steps and 0"),
        _values("gradient_accumulation_steps=0",
                words=["gradient_accumulation_steps: expected an int >= 1", "got 0"]),
    ),
    BadInput(
        "loop-seed-not-a-number", "config", "`seed=abc`", _RULE.format("seed and 'abc'"),
        _values("seed=abc", words=["seed: expected an int >= 0, got 'abc'"]),
    ),
    BadInput(
        "loop-cuda-without-cuda", "config",
        "`device=cuda` on a machine without CUDA (`device=cuda:0` where there is one)",
        _RULE.format("device and the missing CUDA device"), _cuda_without_cuda,
    ),
    BadInput(
        "loop-unknown-device", "config", "`device=gpu`", _RULE.format("device and the choices"),
        _values("device=gpu", words=["device: expected one of 'auto', 'cpu', 'cuda', got 'gpu'"]),
    ),
    BadInput(
        "loop-unknown-mixed-precision", "config", "`mixed_precision=fp8`",
        _RULE.format("mixed_precision and the choices"),
        _values("mixed_precision=fp8",
                words=["mixed_precision: expected one of 'bf16', 'fp16', or null", "'fp8'"]),
    ),
    BadInput(
        "loop-boolean-as-string", "config", "`shuffle='\"true\"'` (a quoted string)",
        _RULE.format("shuffle and the string"),
        _values('shuffle="true"',
                words=["shuffle: expected true or false, got 'true' (a string: write true or "
                       "false, unquoted)"]),
    ),
    BadInput(
        "loop-float-batch-size", "config", "`batch_size=2.5`", _RULE.format("batch_size and 2.5"),
        _values("batch_size=2.5", words=["batch_size: expected an int >= 1, got 2.5"]),
    ),
    BadInput(
        "loop-zero-epochs", "config", "`epochs=0`", _RULE.format("epochs and 0"),
        _values("epochs=0", words=["epochs: expected an int >= 1, got 0"]),
    ),
    BadInput(
        "loop-val-fraction-one", "config", "`val_fraction=1.0` (nothing left to train on)",
        _RULE.format("val_fraction and 1.0"),
        _values("val_fraction=1.0", words=["val_fraction: expected a number >= 0 and < 1"]),
    ),
    BadInput(
        "loop-zero-keep-last", "config", "`keep_last=0`", _RULE.format("keep_last and 0"),
        _values("keep_last=0", words=["keep_last: expected an int >= 1", "got 0"]),
    ),
    BadInput(
        "loop-null-log-every", "config", "`log_every_n_steps=null`",
        _RULE.format("log_every_n_steps and null"),
        _values("log_every_n_steps=null",
                words=["log_every_n_steps: expected an int >= 1, got null"]),
    ),
    BadInput(
        "loop-empty-resume", "config", "`resume=` (an empty path)", _RULE.format("resume"),
        _values("resume=", words=["resume: expected true, false (or null), auto (resume when "
                                  "there is a checkpoint) or a checkpoint folder, got ''"]),
    ),
    BadInput(
        "loop-missing-lr-scheduler", "config", "`~lr_scheduler` (no schedule at all)",
        _RULE.format("lr_scheduler"),
        _values("~lr_scheduler", words=["lr_scheduler: required key is missing"]),
    ),
    BadInput(
        "loop-several-bad-values", "config", "`max_steps=0 seed=abc on_nonfinite_loss=STOP`",
        "exit 1, one line per key (all three); nothing written",
        _values("max_steps=0", "seed=abc", "on_nonfinite_loss=STOP",
                words=["seed: expected", "max_steps: expected", "on_nonfinite_loss: expected"]),
    ),
    BadInput(
        "loop-parallel-sizes-not-world", "config",
        "`parallelism: {dp_replicate: 2, dp_shard: 2}` on one process",
        REFUSED.format("the sizes, their product 4 and the world of 1, before any weight"),
        _values("parallelism.dp_replicate=2", "parallelism.dp_shard=2",
                words=["parallelism: dp_replicate 2 x dp_shard 2 x cp 1 x tp 1 = 4 rank(s), "
                       "but the world has 1"]),
    ),
    BadInput(
        "loop-parallel-zero-size", "config", "`parallelism.tp=0`",
        _RULE.format("parallelism, tp and 0"),
        _values("parallelism.tp=0", words=["parallelism: tp: expected an int >= 1, got 0"]),
    ),
    # resume with a changed config
    BadInput(
        "loop-resume-changed-lr", "config", "resume with `optimizer.lr` changed",
        REFUSED.format("the checkpoint and 'optimizer.lr: 0.001 -> 0.002'"),
        _resume_changed("optimizer.lr=0.002", words=["optimizer.lr: 0.001 -> 0.002"]),
    ),
    BadInput(
        "loop-resume-changed-batch-size", "config", "resume with `batch_size` changed",
        REFUSED.format("the checkpoint and 'batch_size: 4 -> 2'"),
        _resume_changed("batch_size=2", words=["batch_size: 4 -> 2"]),
    ),
    BadInput(
        "loop-resume-changed-seed", "config", "resume with `seed` changed",
        REFUSED.format("the checkpoint and 'seed: 0 -> 1'"),
        _resume_changed("seed=1", words=["seed: 0 -> 1"]),
    ),
    BadInput(
        "loop-resume-changed-dataset", "config", "resume with `dataset.source` changed",
        REFUSED.format("the checkpoint and both dataset.source paths"), _resume_changed_data,
    ),
    BadInput(
        "loop-resume-changed-schedule", "config",
        "resume with `lr_scheduler.num_warmup_steps` changed",
        REFUSED.format("the checkpoint and the warmup key"),
        _resume_changed("lr_scheduler.num_warmup_steps=1",
                        words=["lr_scheduler.num_warmup_steps: 2 -> 1"]),
    ),
    BadInput(
        "loop-resume-changed-parallelism", "config",
        "resume with a `parallelism` key added and the global batch doubled "
        "(`gradient_accumulation_steps=2`; the same global batch on another mesh resumes)",
        REFUSED.format("the checkpoint and 'parallelism.dp_shard: (absent) -> 1'"),
        _resume_changed("parallelism.dp_shard=1", "gradient_accumulation_steps=2",
                        words=["parallelism.dp_shard: (absent) -> 1",
                               "gradient_accumulation_steps: 1 -> 2"]),
    ),
    BadInput(
        "loop-resume-true-changed-lr", "config", "`resume=true` with `optimizer.lr` changed",
        REFUSED.format("the latest checkpoint and the key"), _resume_true_changed_lr,
    ),
]  # fmt: skip
