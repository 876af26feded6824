"""Every recipe on Mixtral (sft, dpo, kd from a Qwen3-MoE teacher, reward_model, grpo, ppo),
each run held to a number computed from the model itself by the checks of
:mod:`tests.recipes.test_recipes_on_families` (reward_model: transformers'
``MixtralForSequenceClassification`` loads the checkpoint, written under Mixtral's on-disk
names, and scores alike; GRPO/PPO: the trainer's log-probs are the sampler's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recipes.sft_world import make_model_dir
from tests.recipes.test_recipes_on_families import CHECKS
from tests.recipes.test_recipes_on_families import World as FamiliesWorld
from tunesmith.models.zoo import mixtral, qwen3_moe

# The load-balancing term is left out of the logged losses the checks recompute (its
# exactness: tests/models/test_mixtral.py); the window of 8 is shorter than the rows.
FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}
CASES = [
    ("sft", "mixtral", None), ("dpo", "mixtral", None), ("kd", "mixtral", "qwen3_moe"),
    ("reward_model", "mixtral", None), ("grpo", "mixtral", None), ("ppo", "mixtral", None),
]  # fmt: skip


class World(FamiliesWorld):
    """The Mixtral folder and a Qwen3-MoE teacher (one tokenizer), the data of every recipe."""

    def __init__(self, root: Path) -> None:
        super(FamiliesWorld, self).__init__(root)
        self.dirs = {
            family: make_model_dir(
                root / family, family=module, initializer_range=0.1, router_aux_loss_coef=0.0
            )
            for family, module in FAMILIES.items()
        }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("mixtral"))


@pytest.mark.parametrize(
    ("recipe", "family", "teacher"),
    CASES,
    ids=[f"{r}-{f}" + (f"-from-{t}" if t else "") for r, f, t in CASES],
)
def test_recipe_on_mixtral_matches_its_full_logits_reference(
    world, tmp_path, recipe, family, teacher
):
    CHECKS[recipe](world, family, teacher, tmp_path / "out")
