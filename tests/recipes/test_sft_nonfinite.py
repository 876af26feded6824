"""A non-finite loss: ``on_nonfinite_loss=stop`` ends the run with an error naming the step and
the last good checkpoint (which stays intact); ``skip`` drops that step's update and goes on.
The NaN comes from a test-only loss that turns NaN on a chosen call (``nan_loss.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.recipes.sft_world import (
    checkpoint_weights,
    checkpoints,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_sft,
)
from tunesmith.config import ALLOW_ANY_COMPONENT_ENV
from tunesmith.training import CheckpointDirectory

NAN_STEP = 3
NAN_LOSS = ["loss._component_=tests.recipes.nan_loss.NaNOnCall", f"loss.call={NAN_STEP}"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("nonfinite")
    return make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=24)


@pytest.fixture(autouse=True)
def _allow_test_components(monkeypatch):
    monkeypatch.setenv(ALLOW_ANY_COMPONENT_ENV, "1")


def test_stop_names_the_step_and_keeps_the_last_good_checkpoint(world, tmp_path):
    model_dir, data = world
    out = tmp_path / "run"
    with pytest.raises(FloatingPointError) as error:
        run_sft(
            model_dir,
            data,
            out,
            "max_steps=6",
            "save_every_n_steps=2",
            "on_nonfinite_loss=stop",
            *NAN_LOSS,
        )
    good = out / "checkpoints" / "step_000002"
    message = str(error.value)
    assert f"at step {NAN_STEP}" in message and str(good) in message
    assert "on_nonfinite_loss=skip" in message
    assert checkpoints(out) == [good]
    assert CheckpointDirectory(good.parent, clean_stale=False).latest() == good
    assert sorted(read_metrics(out)) == [1, 2]  # nothing logged for the bad step


def test_skip_drops_the_bad_update_and_goes_on(world, tmp_path):
    model_dir, data = world
    out = run_sft(
        model_dir,
        data,
        tmp_path / "run",
        "max_steps=5",
        "save_every_n_steps=1",
        "keep_last=null",
        "on_nonfinite_loss=skip",
        *NAN_LOSS,
    )
    assert [p.name for p in checkpoints(out)] == [f"step_{s:06d}" for s in range(1, 6)]
    logged = read_metrics(out)
    assert sorted(logged) == [1, 2, 3, 4, 5]
    assert math.isnan(logged[NAN_STEP]["loss"])
    assert all(math.isfinite(logged[s]["loss"]) for s in logged if s != NAN_STEP)

    weights = {s: checkpoint_weights(checkpoints(out)[s - 1]) for s in (2, 3, 4)}
    for name in weights[2]:  # the bad step changed nothing ...
        assert torch.equal(weights[NAN_STEP][name], weights[NAN_STEP - 1][name]), name
    for name in weights[2]:  # ... and the weights are finite
        assert torch.isfinite(weights[4][name]).all(), name
    moved = max((weights[4][k] - weights[3][k]).abs().max().item() for k in weights[3])
    assert moved > 1e-4  # ... while the next step trained again
