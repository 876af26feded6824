"""What every recipe gets from the shared loop and set-up, beyond SFT's own tests.

Preflight: one forward and backward of the recipe's own objective on the longest batch before
training (the policy and its reference for DPO, student and teacher for KD), printed with its
measured peak, changing nothing: the run's losses and weights are those of the run without it,
bit for bit. ``compile`` (layers and loss, :mod:`tunesmith.training.setup`) gives the eager
run's losses and weights; a recipe whose objective the memory planner does not price says so
in one line. Packs take their length from the dataset object, not the dataset's config node."""

from __future__ import annotations

import re

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
    "dpo": ("pairs", ["optimizer_in_backward=true", "max_grad_norm=null"]),
    "reward_model": ("pairs", []),
    "kd": ("chat", ["teacher_dir={model_dir}"]),
    "kto": ("pairs", ["dataset.format=paired_messages"]),  # each pair: two rated rows
}
STEPS = ["max_steps=2", "batch_size=2"]
# SGD: Adam would magnify rounding-level differences between compiled and eager kernels.
SGD = ["max_grad_norm=null", "optimizer=torch.optim.SGD", "optimizer.lr=0.1"]
COMPILE = "compile={backend: aot_eager}"  # dynamo + AOTAutograd, run eagerly (fast)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("every_recipe")
    return {
        "model_dir": make_model_dir(root),
        "pairs": make_preference_data(root / "pairs.jsonl", rows=8),
        "chat": make_chat_data(root / "chat.jsonl", rows=8),
    }


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_preflight_runs_in_every_recipe_and_changes_nothing(world, tmp_path, capsys, recipe):
    data, extra = RECIPES[recipe]
    model_dir = world["model_dir"]
    extra = [e.format(model_dir=model_dir) for e in extra]
    plain = run_recipe(recipe, "tiny", model_dir, world[data], tmp_path / "plain", *STEPS, *extra)
    assert "preflight:" not in capsys.readouterr().out
    out = run_recipe(
        recipe,
        "tiny",
        model_dir,
        world[data],
        tmp_path / "preflight",
        *STEPS,
        *extra,
        "preflight=true",
    )
    printed = capsys.readouterr().out
    match = re.search(
        r"preflight: forward\+backward on the longest batch \((\d+) x (\d+)\) "
        r"in [\d.]+ s, peak ([\d.]+) MiB measured",
        printed,
    )
    assert match, printed
    rows = int(match[1])
    assert rows == (4 if recipe in ("dpo", "reward_model") else 2)  # a pair: two rows
    assert float(match[3]) > 0

    logged, expected_logged = read_metrics(out), read_metrics(plain)
    assert sorted(logged) == sorted(expected_logged) == [1, 2]
    for step, record in expected_logged.items():
        untimed = {k: v for k, v in record.items() if k != "time" and not k.endswith(("_s", "_gb"))}
        assert {k: logged[step][k] for k in untimed} == untimed, f"step {step}"
    expected, got = final_weights(plain), final_weights(out)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_compiled_run_gives_the_eager_run(world, tmp_path, capsys, recipe):
    data, extra = RECIPES[recipe]
    model_dir = world["model_dir"]
    extra = [e.format(model_dir=model_dir) for e in extra if e.startswith(("teacher", "data"))]
    plain = run_recipe(
        recipe, "tiny", model_dir, world[data], tmp_path / "plain", *STEPS, *SGD, *extra
    )
    printed = capsys.readouterr().out
    assert "memory plan: not estimated for" in printed and f"({recipe})" in printed, printed
    out = run_recipe(
        recipe, "tiny", model_dir, world[data], tmp_path / "compiled", *STEPS, *SGD, *extra, COMPILE
    )
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
