"""The memory switches of the SFT recipe change how a step is computed, never what it computes:
linear cross-entropy, activation checkpointing (full and selective) and the optimizer step
fused into backward each give the weights of the plain run, through the real recipe."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.sft_world import (
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_sft,
)
from tunesmith.config import ConfigError

# SGD: Adam would turn rounding-level gradient differences (~1e-9 on k_proj.bias) into
# visible updates; the components' AdamW equivalences are tested in tests/memory. The plain run
# uses the full-logits loss (the tiny config ships the linear one).
STEPS = ["max_steps=3", "max_grad_norm=null", "lr_scheduler.num_warmup_steps=1",
         "optimizer=torch.optim.SGD", "optimizer.lr=0.5",
         "loss._component_=tunesmith.modules.losses.CrossEntropyLoss"]  # fmt: skip
SWITCHES = {
    "linear_ce": ["loss._component_=tunesmith.modules.losses.LinearCrossEntropyLoss"],
    "checkpoint_full": ["activation_checkpointing={mode: full}"],
    "checkpoint_selective": ["activation_checkpointing={mode: selective, every_k: 2}"],
    "optimizer_in_backward": ["optimizer_in_backward=true"],
    "all_together": [
        "loss._component_=tunesmith.modules.losses.LinearCrossEntropyLoss",
        "loss.num_chunks=3",
        "activation_checkpointing={mode: full}",
        "optimizer_in_backward=true",
        "activation_offloading=true",  # a warned no-op on CPU
    ],
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("switches")
    model_dir, data = make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=24)
    plain = run_sft(model_dir, data, root / "plain", *STEPS)
    return model_dir, data, final_weights(plain), read_metrics(plain)


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_switch_gives_the_plain_run(world, tmp_path, name):
    model_dir, data, expected, expected_metrics = world
    with pytest.warns(UserWarning) if "activation_offloading=true" in SWITCHES[name] else _none():
        out = run_sft(model_dir, data, tmp_path / name, *STEPS, *SWITCHES[name])
    weights = final_weights(out)
    assert weights.keys() == expected.keys()
    changed = [
        k for k in expected if not torch.equal(expected[k], make_model_weights(model_dir)[k])
    ]
    assert changed, "the plain run must actually train"
    for key in expected:
        torch.testing.assert_close(weights[key], expected[key], atol=2e-6, rtol=1e-5, msg=key)
    losses = [read_metrics(out)[s]["loss"] for s in (1, 2, 3)]
    assert losses == pytest.approx([expected_metrics[s]["loss"] for s in (1, 2, 3)], rel=1e-5)


def test_optimizer_in_backward_refuses_accumulation_and_clipping(world, tmp_path):
    model_dir, data, _, _ = world
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        run_sft(
            model_dir,
            data,
            tmp_path / "a",
            *STEPS,
            "optimizer_in_backward=true",
            "gradient_accumulation_steps=2",
        )
    with pytest.raises(ConfigError, match="max_grad_norm"):
        run_sft(model_dir, data, tmp_path / "b", "max_steps=2", "optimizer_in_backward=true")


_BASE_WEIGHTS: dict = {}


def make_model_weights(model_dir):
    """The untrained weights of the model folder (cached)."""
    from tests.recipes.sft_world import checkpoint_weights

    if model_dir not in _BASE_WEIGHTS:
        _BASE_WEIGHTS[model_dir] = checkpoint_weights(model_dir)
    return _BASE_WEIGHTS[model_dir]


class _none:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
