"""Every recipe takes ``compile`` (its layers and its loss, :mod:`tunesmith.training.setup`)
and gives the eager run's losses and weights; a recipe whose objective the memory planner does
not price says so in one line instead of printing an estimate; packs take their length from
the dataset object (a training split of it too), not from the dataset's config node."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import Subset

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_recipe,
)
from tunesmith.data import PackedDataset
from tunesmith.training.setup import packing_length, token_batches

# recipe -> (its data, extra overrides); {model_dir} is filled in
RECIPES = {
    "dpo": ("pairs", []),
    "reward_model": ("pairs", []),
    "kd": ("chat", ["teacher_dir={model_dir}"]),
}
# SGD: Adam would magnify rounding-level differences between compiled and eager kernels.
STEPS = ["max_steps=2", "batch_size=2", "max_grad_norm=null", "optimizer=torch.optim.SGD",
         "optimizer.lr=0.1"]  # fmt: skip
COMPILE = "compile={backend: aot_eager}"  # dynamo + AOTAutograd, run eagerly (fast)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile_every")
    return {
        "model_dir": make_model_dir(root),
        "pairs": make_preference_data(root / "pairs.jsonl", rows=8),
        "chat": make_chat_data(root / "chat.jsonl", rows=8),
    }


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_run_gives_the_eager_run(world, tmp_path, capsys, recipe):
    data, extra = RECIPES[recipe]
    model_dir = world["model_dir"]
    extra = [e.format(model_dir=model_dir) for e in extra]
    plain = run_recipe(recipe, "tiny", model_dir, world[data], tmp_path / "plain", *STEPS, *extra)
    printed = capsys.readouterr().out
    assert "memory plan: not estimated for" in printed and f"({recipe})" in printed, printed
    out = run_recipe(recipe, "tiny", model_dir, world[data], tmp_path / "compiled", *STEPS,
                     *extra, COMPILE)  # fmt: skip
    losses, expected_losses = read_metrics(out), read_metrics(plain)
    for step in (1, 2):
        assert losses[step]["loss"] == pytest.approx(expected_losses[step]["loss"], rel=1e-5)
    weights, expected = final_weights(out), final_weights(plain)
    assert weights.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(weights[key], expected[key], atol=2e-6, rtol=1e-5, msg=key)


def _samples(n: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [1, 2, 3], "labels": [2, 3, -100]} for _ in range(n)]


class _Dataset(list):
    max_seq_len = 8


class _Tokenizer:
    pad_id = None


def test_packs_take_their_length_from_the_dataset_object():
    split = Subset(_Dataset(_samples(6)), [0, 2, 4, 5])  # a training split keeps the length
    assert packing_length(split) == 8 and packing_length(_samples(2)) is None
    packed = OmegaConf.create({"packed": True})
    data, _ = token_batches(packed, split, _Tokenizer())
    assert isinstance(data, PackedDataset) and data.max_seq_len == 8 and len(data) == 2
    data, _ = token_batches(OmegaConf.create({}), split, _Tokenizer())  # padded per batch
    assert data is split
    with pytest.raises(ValueError, match="packed: true needs the dataset's max_seq_len"):
        token_batches(packed, _samples(2), _Tokenizer())
