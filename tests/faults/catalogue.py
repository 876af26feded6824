"""Every case of the reliability suite, in one list: the tests take their parameters (and test
ids) from it, and ``python -m tests.faults.report`` renders RELIABILITY.md from it and the
recorded outcomes, so the table and the suite cannot drift apart.

Groups: ``fault`` (a real training process killed, stopped or starved), ``bad_input`` (a broken
config, dataset, checkpoint or tokenizer given to ``tunesmith run``), ``safety`` (code from a
config or a file must not run) and ``determinism``. Cases with ``ci=False`` run only in
``make test-faults`` (pytest marker ``faults``); the others run in the default selection too.
"""

from __future__ import annotations

from tests.faults.bad_inputs import BAD_INPUTS
from tests.faults.checkpoint_cases import CHECKPOINT_FAULTS
from tests.faults.error_cases import ERROR_FAULTS
from tests.faults.file_cases import CASES as FILE_CASES
from tests.faults.hostile_cases import HOSTILE_CASES
from tests.faults.kit import Case
from tests.faults.ray_cases import RAY
from tests.faults.safety_cases import SAFETY
from tests.faults.sandbox_cases import SANDBOX

__all__ = [
    "CASES",
    "CI_SIGKILL_SEEDS",
    "GROUPS",
    "PHASES",
    "SIGKILL_SEEDS",
    "Case",
    "cases",
    "params",
]

PHASES = ("training", "checkpoint", "export")
SIGKILL_SEEDS = tuple(range(24))
CI_SIGKILL_SEEDS = (0, 1, 2, 3)  # one of each phase, and one more in training
GROUPS = ("fault", "bad_input", "safety", "determinism")


_RESUMES = "resume (a new process, `resume=auto`) ends bitwise equal to the uninterrupted run"

FAULTS = [
    *(
        Case(
            f"sigkill-seed-{seed:02d}",
            "fault",
            "sigkill",
            f"SIGKILL at a random {PHASES[seed % len(PHASES)]} event (seed {seed})",
            "every committed checkpoint the run keeps is there and verifies, the newest loads "
            f"and equals the reference's; no partial checkpoint is visible; {_RESUMES}",
            ci=seed in CI_SIGKILL_SEEDS,
        )
        for seed in SIGKILL_SEEDS
    ),
    Case(
        "sigterm-mid-step",
        "fault",
        "sigterm",
        "SIGTERM during the backward pass of step 3",
        "checkpoint of step 3 written, exit 0 within 30 s of the signal; " + _RESUMES,
    ),
    Case(
        "sigterm-mid-checkpoint",
        "fault",
        "sigterm",
        "SIGTERM while the step-2 checkpoint writes its optimizer state",
        "step-2 checkpoint completes, step 3 is saved, exit 0 within 30 s; " + _RESUMES,
    ),
    Case(
        "sigterm-during-export",
        "fault",
        "sigterm",
        "SIGTERM while the final checkpoint (the exported model) is being fsynced",
        "the final checkpoint completes, exit 0 within 30 s, weights equal the reference",
    ),
    Case(
        "sigterm-torchrun-2-ranks",
        "fault",
        "sigterm",
        "SIGTERM to `tunesmith run --nproc-per-node 2` (the CLI passes it to both ranks)",
        "both ranks save one checkpoint together; the ranks, torchrun and the CLI exit 0 "
        "within 60 s",
        ci=False,
    ),
    Case(
        "disk-full-during-checkpoint",
        "fault",
        "disk_full",
        "the checkpoint filesystem fills up while the second checkpoint is written (a 2.6 MB "
        "tmpfs; RLIMIT_FSIZE where mounting is not permitted)",
        "one-line error naming the checkpoint and 'disk full' (or 'file too large'), exit 1; "
        "no partial checkpoint left; the first checkpoint verifies and resuming from it "
        "reproduces the uninterrupted run",
    ),
    Case(
        "file-size-limit-during-checkpoint",
        "fault",
        "disk_full",
        "RLIMIT_FSIZE lowered to 100 kB after the first checkpoint, so writing the second "
        "one fails with EFBIG",
        "one-line error naming the checkpoint and 'File too large', exit 1; no partial "
        "checkpoint left; the first checkpoint verifies and resuming from it reproduces the "
        "uninterrupted run",
    ),
    Case(
        "rank-1-killed",
        "fault",
        "rank_death",
        "2-rank gloo run (FSDP2), rank 1 SIGKILLed in the forward pass of step 3",
        "rank 0 exits 1 within 60 s with one line: 'rank 0 of 2: a collective operation ... "
        "failed (Connection closed by peer ...)'",
    ),
    Case(
        "rank-1-stopped",
        "fault",
        "rank_death",
        "2-rank gloo run, rank 1 frozen with SIGSTOP (alive but silent) in step 3",
        "rank 0 exits 1 after distributed_timeout_s (10 s), within 60 s, with one line naming "
        "the timed-out collective, instead of waiting 30 minutes",
    ),
    Case(
        "rank-0-killed",
        "fault",
        "rank_death",
        "2-rank gloo run, rank 0 (which hosts the rendezvous store) SIGKILLed in step 3",
        "rank 1 exits 1 within 60 s with a one-line error naming the failed collective",
        ci=False,
    ),
    Case(
        "rank-killed-under-torchrun",
        "fault",
        "rank_death",
        "`tunesmith run --nproc-per-node 2`, rank 1 dies (SIGKILL) at its third loss",
        "torchrun stops the other rank, the CLI exits 1 within 120 s; its first error line is "
        "'tunesmith: error: rank 1 of 2: killed by SIGKILL (signal 9)...', one line per failed "
        "rank, no traceback or torchrun output on the console, and the path of the log that "
        "holds them",
        ci=False,
    ),
    Case(
        "async-trainer-rank-killed",
        "fault",
        "async_rl",
        "`grpo_async` on 2 trainer ranks (gloo) with Ray workers, `save_every_n_steps=2`: rank 1 "
        "SIGKILLed at its first forward pass after the step-2 checkpoint",
        "rank 0 exits 1 within 60 s with one line naming the failed collective; the Ray workers "
        "and the run's raylet/gcs_server are gone; the step-2 checkpoint verifies and a resumed "
        "run (2 ranks) goes on from batch 2 with the prompt stream's next prompts",
        ci=False,
    ),
    Case(
        "async-trainer-actor-killed",
        "fault",
        "async_rl",
        "`grpo_async` with `trainer_group.launcher=ray` (2 trainer actors, gloo), "
        "`save_every_n_steps=2`: rank 1's actor SIGKILLed once the step-2 checkpoint is written "
        "(inside step 3)",
        "the driver exits 1 within 60 s with one line 'rank 1 of 2: its process (pid N) died: "
        "killed by a signal'; the trainer actors, the Ray workers and the run's Ray processes "
        "are gone; the step-2 checkpoint verifies and a resumed run ends bitwise where the "
        "uninterrupted run ends, on the same groups",
        ci=False,
    ),
    Case(
        "async-reward-worker-killed",
        "fault",
        "async_rl",
        "`grpo_async` in `overlap` mode: the reward worker SIGKILLed while it scores batch 1",
        "Ray restarts it and the prompts are sampled again: every update made, every prompt of "
        "the stream trained on once, batches in order, staleness <= 1; worker_restarts >= 1",
        ci=False,
    ),
    Case(
        "async-worker-cannot-start",
        "fault",
        "async_rl",
        "`grpo_async` with `rollout.engine=vllm` where vLLM is not installed: the rollout "
        "worker's constructor raises",
        "exit 1 with one line 'a rollout worker could not start: ImportError: ...', no "
        "traceback; none of the run's Ray processes left",
    ),
]

DETERMINISM = [
    Case(
        "cpu-same-seed-twice",
        "determinism",
        "cpu",
        "the tiny config (shuffled data) run twice with seed 0, in two processes",
        "bitwise identical loss, grad norm and lr at every step and identical final weights; "
        "seed 1 differs",
    ),
    Case(
        "cpu-packed-accumulation-twice",
        "determinism",
        "cpu",
        "packed=true, gradient_accumulation_steps=2, run twice with seed 0",
        "bitwise identical losses and final weights",
    ),
]

CASES: list[Case] = [
    *FAULTS,
    *CHECKPOINT_FAULTS,
    *ERROR_FAULTS,
    *(
        Case(b.id, "bad_input", b.kind, b.what, b.expect, ci=True)
        for b in BAD_INPUTS  # the builders live in tests/faults/bad_inputs.py
    ),
    *SAFETY,
    *SANDBOX,  # tests/faults/sandbox_cases.py
    *RAY,  # tests/faults/ray_cases.py
    *FILE_CASES,
    *HOSTILE_CASES,  # tests/faults/test_hostile_inputs.py
    *DETERMINISM,
]


def cases(group: str, kind: str | None = None) -> list[Case]:
    """The cases of ``group`` (and ``kind``), in catalogue order."""
    return [c for c in CASES if c.group == group and (kind is None or c.kind == kind)]


def params(group: str, kind: str | None = None) -> list:
    """``pytest.param`` per case (test id = case id; ``faults`` marker where ``ci=False``)."""
    import pytest

    return [
        pytest.param(c, id=c.id, marks=() if c.ci else pytest.mark.faults)
        for c in cases(group, kind)
    ]


if len({c.id for c in CASES}) != len(CASES):
    raise ValueError("tests/faults/catalogue.py: case ids must be unique")
