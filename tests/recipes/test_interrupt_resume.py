"""Interrupting a run of a shipped config (a real ``tunesmith run`` process) after its first
save interval: Ctrl-C (SIGINT) and SIGTERM save at the end of the current step and exit cleanly
with the resume hint, so nothing is lost; a crash (SIGKILL) loses at most one save interval.
Resuming then ends with bitwise the weights of an uninterrupted run. A second Ctrl-C aborts at
once."""

from __future__ import annotations

import os
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
from tunesmith.training.loop import _install_stop_handlers

BATCH, TOTAL = 4, 1000  # far more steps than the run does before it is interrupted


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    return make_model_dir(root), make_counting_data(root / "count.jsonl", rows=24)


def _interrupt(world, out: Path, log: Path, sig: int, *save: str) -> int:
    """Start ``tunesmith run sft --config tiny`` with the ``save`` keys, send ``sig`` once its
    first checkpoint exists and one more step is logged; returns the process's exit code."""
    model_dir, data = world
    overrides = sft_overrides(
        model_dir, data, out, f"batch_size={BATCH}", f"max_steps={TOTAL}", "keep_last=2", *save
    )
    run = forked.Child.cli(
        ["run", "sft", "--config", "tiny", *overrides], log, env=subprocess_env()
    )
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 150
    try:
        while True:  # the first save interval has passed, and a step after it
            saved = checkpoints(out) if (out / "checkpoints").is_dir() else []
            steps = read_metrics(out) if metrics.is_file() else {}
            if saved and steps and max(steps) > int(saved[0].name.removeprefix("step_")):
                break
            if run.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"no checkpoint before the run ended ({run.returncode}):\n"
                    f"{log.read_text()[-3000:]}"
                )
            time.sleep(0.02)
        run.send_signal(sig)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    return run.returncode


def _assert_resumes_to_the_uninterrupted_weights(
    world, out: Path, reference: Path, until: int
) -> None:
    model_dir, data = world
    config = [f"batch_size={BATCH}", f"max_steps={TOTAL}", f"stop_after_steps={until}"]
    run_sft(model_dir, data, reference, *config)
    run_sft(model_dir, data, out, *config, "resume=true")
    assert checkpoints(out)[-1].name == f"step_{until:06d}"
    got, expected = final_weights(out), final_weights(reference)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), f"{name} differs after resuming"
    logged, logged_ref = read_metrics(out), read_metrics(reference)
    assert logged[until]["loss"] == logged_ref[until]["loss"]


@pytest.mark.parametrize(
    ("sig", "save"),
    [
        pytest.param(signal.SIGINT, ("save_every_n_steps=3",), id="ctrl-c-step-interval"),
        pytest.param(signal.SIGTERM, ("save_every_minutes=0.002",), id="sigterm-timed-saves"),
    ],
)
def test_a_signal_after_the_first_save_loses_nothing_and_resumes_exactly(
    world, tmp_path, sig, save
):
    out, log = tmp_path / "run", tmp_path / "run.log"
    code = _interrupt(world, out, log, sig, *save)
    output = log.read_text()
    assert code == 0, output[-3000:]
    stopped = max(read_metrics(out))
    name = signal.Signals(sig).name
    assert f"{name}: saving a checkpoint at the end of this step" in output
    assert f"{name}: stopped after step {stopped}; resume with resume=true" in output
    assert checkpoints(out)[-1].name == f"step_{stopped:06d}"  # nothing lost
    _assert_resumes_to_the_uninterrupted_weights(world, out, tmp_path / "reference", stopped + 2)


@pytest.mark.slow
def test_a_crash_loses_at_most_one_save_interval(world, tmp_path):
    out, log = tmp_path / "run", tmp_path / "run.log"
    assert _interrupt(world, out, log, signal.SIGKILL, "save_every_n_steps=3") == -signal.SIGKILL
    last_step = max(read_metrics(out))
    newest = int(checkpoints(out)[-1].name.removeprefix("step_"))
    assert last_step - 3 <= newest <= last_step  # at most one interval of steps lost
    _assert_resumes_to_the_uninterrupted_weights(world, out, tmp_path / "reference", last_step + 1)


def test_a_second_ctrl_c_aborts_at_once():
    previous = signal.getsignal(signal.SIGINT)
    stop_signal, restore = _install_stop_handlers(announce=False)
    try:
        assert stop_signal() is None
        os.kill(os.getpid(), signal.SIGINT)  # the first: a stop at the end of the step
        time.sleep(0.01)
        assert stop_signal() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # the second: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) is previous


def test_sigterm_then_ctrl_c_aborts_too():
    stop_signal, restore = _install_stop_handlers(announce=False)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert stop_signal() == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM keeps waiting for the save
        time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        restore()
