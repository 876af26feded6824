"""Resuming: a run stopped at step k and resumed ends with bitwise the same weights, and logs
the same metrics for steps k+1..N, as one uninterrupted run of N steps (the LR schedule, the
optimizer state, the data position and the RNG all continue). The same holds after the process
is SIGKILLed in the middle of writing a checkpoint, and after a SIGTERM (which saves and exits
cleanly)."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from tests import forked
from tests.recipes.sft_world import (
    checkpoints,
    final_weights,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_sft,
    sft_overrides,
    subprocess_env,
)
from tunesmith.training import CheckpointDirectory

ROWS, BATCH, TOTAL = 24, 4, 10  # 6 steps an epoch: TOTAL spans two epochs
COMPARED = ("loss", "lr", "grad_norm", "tokens_seen", "trained_tokens_in_window")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return root, make_model_dir(root), make_counting_data(root / "count.jsonl", rows=ROWS)


@pytest.fixture(scope="module")
def uninterrupted(world):
    """Output folders of uninterrupted runs, by their extra overrides (run once each)."""
    root, model_dir, data = world
    runs: dict[tuple[str, ...], Path] = {}

    def get(*extra: str) -> Path:
        if extra not in runs:
            out = root / f"uninterrupted-{len(runs)}"
            runs[extra] = run_sft(model_dir, data, out, f"batch_size={BATCH}", *extra)
        return runs[extra]

    return get


def _assert_same_run(resumed: Path, reference: Path, from_step: int, to_step: int) -> None:
    weights, expected = final_weights(resumed), final_weights(reference)
    assert weights.keys() == expected.keys()
    for name in weights:
        assert torch.equal(weights[name], expected[name]), (
            f"{name} differs after resuming by up to "
            f"{(weights[name] - expected[name]).abs().max().item():.3g}"
        )
    logged, logged_ref = read_metrics(resumed), read_metrics(reference)
    assert sorted(logged) == list(range(1, to_step + 1))
    for step in range(from_step, to_step + 1):
        for key in COMPARED:
            assert logged[step][key] == logged_ref[step][key], f"{key} at step {step}"


@pytest.mark.parametrize(
    ("stop_at", "extra"),
    [
        pytest.param(4, (), id="mid-epoch"),
        pytest.param(6, (), id="epoch-boundary"),
        # 12 micro-batches an epoch, 5 a step: step 3 takes 2 from epoch 0 and 3 from epoch 1
        pytest.param(
            2, ("batch_size=2", "gradient_accumulation_steps=5"), id="accum-across-epochs"
        ),
    ],
)
def test_stop_and_resume_equals_uninterrupted(world, uninterrupted, tmp_path, stop_at, extra):
    _, model_dir, data = world
    config = (f"max_steps={TOTAL}", *extra)
    reference = uninterrupted(*config)
    out = tmp_path / "run"
    run_sft(model_dir, data, out, f"batch_size={BATCH}", *config, f"stop_after_steps={stop_at}")
    assert [p.name for p in checkpoints(out)] == [f"step_{stop_at:06d}"]
    assert sorted(read_metrics(out)) == list(range(1, stop_at + 1))

    run_sft(model_dir, data, out, f"batch_size={BATCH}", *config, "resume=true")
    assert checkpoints(out)[-1].name == f"step_{TOTAL:06d}"
    _assert_same_run(out, reference, stop_at + 1, TOTAL)


def _wait_for(condition, process: forked.Child, log: Path, what: str) -> None:
    deadline = time.monotonic() + 120
    while not condition():
        if process.poll() is not None:
            output = log.read_text()[-3000:]
            pytest.fail(f"the run exited ({process.returncode}) before {what}:\n{output}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_sigkill_while_writing_a_checkpoint_keeps_the_previous_one(world, uninterrupted, tmp_path):
    _, model_dir, data = world
    config = [f"batch_size={BATCH}", f"max_steps={TOTAL}", "save_every_n_steps=2"]
    out, sentinel, log = tmp_path / "run", tmp_path / "stalled", tmp_path / "driver.log"
    driver = forked.Child.module(
        "tests.recipes.stalling_save",
        [
            "2",
            sentinel,
            "--",
            "run",
            "sft",
            "--config",
            "tiny",
            *sft_overrides(model_dir, data, out, *config),
        ],
        log,
        env=subprocess_env(),
    )
    try:
        _wait_for(sentinel.exists, driver, log, "the second checkpoint write stalled")
        partial = Path(sentinel.read_text())
        assert partial.name.startswith(".tmp-step_000004-") and partial.is_dir()
        assert (partial / "model.safetensors").is_file()  # half-written: weights, no state
        assert not (partial / "training_state").exists()
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == -signal.SIGKILL
    assert partial.is_dir()  # the crash left the temporary folder behind ...
    assert [p.name for p in checkpoints(out)] == ["step_000002"]  # ... and it is not a checkpoint
    root = out / "checkpoints"
    assert CheckpointDirectory(root, clean_stale=False).latest() == root / "step_000002"

    run_sft(model_dir, data, out, *config, "resume=true")
    assert not partial.exists()  # cleaned: its writer is dead
    assert checkpoints(out)[-1].name == f"step_{TOTAL:06d}"
    _assert_same_run(out, uninterrupted(f"max_steps={TOTAL}"), 3, TOTAL)


def test_sigterm_saves_and_exits_cleanly_then_resume_continues(world, uninterrupted, tmp_path):
    _, model_dir, data = world
    total = 1000  # far more than the run will do before the signal
    out, log = tmp_path / "run", tmp_path / "run.log"
    overrides = sft_overrides(model_dir, data, out, f"batch_size={BATCH}", f"max_steps={total}")
    run = forked.Child.cli(
        ["run", "sft", "--config", "tiny", *overrides], log, env=subprocess_env()
    )
    metrics = out / "metrics.jsonl"

    def step_logged() -> bool:
        return metrics.is_file() and '"loss"' in metrics.read_text()

    try:
        _wait_for(step_logged, run, log, "step 1")
        run.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        run.wait(timeout=60)
        elapsed = time.monotonic() - sent
        output = log.read_text()
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output[-3000:]
    assert elapsed < 30, f"took {elapsed:.1f} s to stop after SIGTERM"
    stopped = max(read_metrics(out))
    assert f"SIGTERM: stopped after step {stopped}" in output
    assert [p.name for p in checkpoints(out)] == [f"step_{stopped:06d}"]

    until = stopped + 2
    config = [f"max_steps={total}", f"stop_after_steps={until}"]
    handler = signal.getsignal(signal.SIGTERM)
    run_sft(model_dir, data, out, f"batch_size={BATCH}", *config, "resume=true")
    assert signal.getsignal(signal.SIGTERM) is handler  # the caller's handler is back
    assert checkpoints(out)[-1].name == f"step_{until:06d}"
    _assert_same_run(out, uninterrupted(*config), stopped + 1, until)


@pytest.mark.parametrize(("extra", "key"), [((f"max_steps={TOTAL}",), "max_steps"), ((), "epochs")])
def test_resuming_a_complete_run_says_so_and_changes_nothing(world, tmp_path, capsys, extra, key):
    root, model_dir, data = world
    out = run_sft(model_dir, data, tmp_path / "done", f"batch_size={BATCH}", *extra)
    last = checkpoints(out)[-1]
    metrics, weights = (out / "metrics.jsonl").read_text(), final_weights(out)
    capsys.readouterr()
    run_sft(model_dir, data, out, f"batch_size={BATCH}", *extra, "resume=true")
    step = int(last.name.split("_")[1])
    assert (
        f"{last}: the run is complete (step {step} of {step}); to train further, resume with "
        f"a larger {key}"
    ) in capsys.readouterr().out
    assert (out / "metrics.jsonl").read_text() == metrics  # nothing logged, nothing trained
    assert checkpoints(out)[-1] == last
    assert all(torch.equal(weights[k], v) for k, v in final_weights(out).items())


def test_another_runs_checkpoints_are_refused_before_anything_is_built(
    world, uninterrupted, tmp_path, capsys
):
    root, model_dir, data = world
    out = tmp_path / "run"
    shutil.copytree(uninterrupted(), out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    capsys.readouterr()
    with pytest.raises(FileExistsError, match="already holds checkpoints of another run"):
        run_sft(model_dir, data, out, f"batch_size={BATCH}")  # resume=false, no overwrite
    assert capsys.readouterr().out == ""  # no tokenising, memory plan or model said anything
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
