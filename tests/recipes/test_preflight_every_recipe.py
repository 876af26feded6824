"""Every recipe has the preflight step (the shared loop runs it): one forward and backward of
the recipe's own objective on the longest batch before training (the policy and its reference
for DPO, student and teacher for KD), printed with its measured peak, changing nothing: the
run's losses and weights are those of the run without it, bit for bit."""

from __future__ import annotations

import re

import pytest
import torch

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_recipe,
)

# recipe -> (its data, extra overrides); {model_dir} is filled in
RECIPES = {
    "dpo": ("pairs", ["optimizer_in_backward=true", "max_grad_norm=null"]),
    "reward_model": ("pairs", []),
    "kd": ("chat", ["teacher_dir={model_dir}"]),
}
STEPS = ["max_steps=2", "batch_size=2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
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
    out = run_recipe(recipe, "tiny", model_dir, world[data], tmp_path / "preflight", *STEPS,
                     *extra, "preflight=true")  # fmt: skip
    printed = capsys.readouterr().out
    match = re.search(r"preflight: forward\+backward on the longest batch \((\d+) x (\d+)\) "
                      r"in [\d.]+ s, peak ([\d.]+) MiB measured", printed)  # fmt: skip
    assert match, printed
    rows = int(match[1])
    assert rows == (4 if data == "pairs" else 2)  # a pair is two rows: chosen, then rejected
    assert float(match[3]) > 0

    logged, expected_logged = read_metrics(out), read_metrics(plain)
    assert sorted(logged) == sorted(expected_logged) == [1, 2]
    for step, record in expected_logged.items():
        untimed = {k: v for k, v in record.items() if not k.endswith(("_s", "_gb"))}
        assert {k: logged[step][k] for k in untimed} == untimed, f"step {step}"
    expected, got = final_weights(plain), final_weights(out)
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
