"""Every recipe on DeepSeek-V3 and DeepSeek-V2 (multi-head latent attention, shared experts,
DeepSeek routing), each run held to a number computed from the model itself, by the checks of
:mod:`tests.recipes.test_recipes_on_families` (GRPO/PPO: the trainer's log-probs are the
sampler's, decoded with the latent KV cache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.sft_world import make_model_dir
from tests.recipes.test_recipes_on_families import CHECKS
from tests.recipes.test_recipes_on_families import World as FamiliesWorld
from tunesmith.models.zoo import deepseek_v2, deepseek_v3

FAMILIES = {"deepseek_v3": deepseek_v3, "deepseek_v2": deepseek_v2}
CASES = [
    ("sft", "deepseek_v3", None), ("dpo", "deepseek_v2", None),
    ("kd", "deepseek_v3", "deepseek_v2"), ("reward_model", "deepseek_v3", None),
    ("grpo", "deepseek_v2", None), ("ppo", "deepseek_v3", None),
]  # fmt: skip


class World(FamiliesWorld):
    """The DeepSeek model folders (one tokenizer) and the data of every recipe."""

    def __init__(self, root: Path) -> None:
        super(FamiliesWorld, self).__init__(root)
        self.dirs = {
            family: make_model_dir(root / family, family=module, initializer_range=0.1)
            for family, module in FAMILIES.items()
        }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("deepseek"))


@pytest.mark.parametrize(
    ("recipe", "family", "teacher"),
    CASES,
    ids=[f"{r}-{f}" + (f"-from-{t}" if t else "") for r, f, t in CASES],
)
def test_recipe_on_deepseek_matches_its_full_logits_reference(
    world, tmp_path, recipe, family, teacher
):
    CHECKS[recipe](world, family, teacher, tmp_path / "out")
