"""The QAT benchmark's task (``benchmarks/qat_task.py``): 8-letter sorting on the demo's world."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.qat_task import TaskSettings, add_outliers, make_splits, make_task
from tunesmith.demo.task import read_jsonl


def test_splits_are_distinct_strings_of_the_set_length():
    settings = TaskSettings(num_train=300, num_held_out=50, length=6, seed=3)
    train, held_out = make_splits(settings)
    assert (len(train), len(held_out)) == (300, 50)
    strings = [ex.letters for ex in train + held_out]
    assert all(len(s) == len(set(s)) == 6 for s in strings)
    assert len(set(strings)) == 350  # no string twice, none in both splits
    assert make_splits(settings) == (train, held_out)
    assert make_splits(TaskSettings(num_train=300, num_held_out=50, length=6, seed=4)) != (
        train,
        held_out,
    )


@pytest.mark.parametrize("length", [0, 9])
def test_a_length_the_demo_cannot_score_is_refused(length):
    with pytest.raises(ValueError, match=f"TaskSettings.length must be 1..8.*got {length}"):
        make_splits(TaskSettings(length=length))


def test_make_task_writes_the_splits_in_the_demos_layout(tmp_path):
    settings = TaskSettings(num_train=120, num_held_out=10)
    assets, held_out = make_task(tmp_path, settings)
    train, expected = make_splits(settings)
    assert held_out == expected
    assert read_jsonl(assets.train_file) == train
    assert read_jsonl(assets.held_out_file) == held_out
    assert (assets.model_dir / "model.safetensors").is_file()
    assert (assets.tokenizer_dir / "tokenizer.json").is_file()


def test_add_outliers_sets_a_share_of_the_decoder_weights_only(tmp_path):
    weights = {
        "model.layers.0.mlp.up_proj.weight": torch.full((64, 128), 0.01),
        "model.layers.0.input_layernorm.weight": torch.ones(128),
        "model.embed_tokens.weight": torch.full((50, 128), 0.01),
    }
    save_file(weights, tmp_path / "model.safetensors")
    add_outliers(tmp_path, 0.3, every=16, seed=0)
    out = load_file(tmp_path / "model.safetensors")
    up = out["model.layers.0.mlp.up_proj.weight"]
    changed = up != 0.01
    assert torch.equal(up[changed].abs(), torch.full_like(up[changed], 0.3))
    assert 0.8 / 16 < changed.float().mean().item() < 1.2 / 16
    assert (up[changed] > 0).any() and (up[changed] < 0).any()
    for name in ("model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"):
        assert torch.equal(out[name], weights[name])
