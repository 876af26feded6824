"""Every recipe on the MoE families (Mixtral, DeepSeek-V3 and V2: multi-head latent attention,
shared experts, DeepSeek routing; gpt-oss; Llama 4: chunked attention, NoPE layers, sigmoid
top-1 MoE; GLM-4.5: DeepSeek routing beside partial-rotary GQA), each run held to a number computed from the model itself by the checks of
:mod:`tests.recipes.test_recipes_on_families` (reward_model: transformers'
``*ForSequenceClassification`` loads the checkpoint, written under the family's on-disk names,
and scores alike; GRPO/PPO: the trainer's log-probs are the sampler's, decoded with the
family's KV cache, latent for DeepSeek)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.recipes.sft_world import make_model_dir
from tests.recipes.test_recipes_on_families import CHECKS
from tests.recipes.test_recipes_on_families import World as FamiliesWorld
from tunesmith.models.zoo import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    llama4,
    mixtral,
    qwen3_moe,
)

# The load-balancing term is left out of the logged losses the checks recompute (coefficient 0;
# its exactness: tests/models/test_mixtral.py, test_gpt_oss.py); Mixtral's window of 8 is
# shorter than the rows.
NO_AUX = {"initializer_range": 0.1, "router_aux_loss_coef": 0.0}
MODELS: dict[str, tuple[ModuleType, dict]] = {
    "mixtral": (mixtral, NO_AUX),
    "qwen3_moe": (qwen3_moe, NO_AUX),
    "deepseek_v3": (deepseek_v3, {"initializer_range": 0.1}),
    "deepseek_v2": (deepseek_v2, {"initializer_range": 0.1}),
    "gpt_oss": (gpt_oss, NO_AUX),
    "gpt_oss_teacher": (gpt_oss, {"seed": 1, **NO_AUX}),
    "llama4": (llama4, {"num_experts": 4}),
    "glm4_moe": (glm4_moe, {"initializer_range": 0.1}),
}
"""model folder name -> (its zoo module, :func:`make_model_dir` arguments)."""

CASES: list[tuple[str, str, str | None]] = [
    ("sft", "mixtral", None), ("dpo", "mixtral", None), ("kd", "mixtral", "qwen3_moe"),
    ("reward_model", "mixtral", None), ("grpo", "mixtral", None), ("ppo", "mixtral", None),
    ("sft", "deepseek_v3", None), ("dpo", "deepseek_v2", None),
    ("kd", "deepseek_v3", "deepseek_v2"), ("reward_model", "deepseek_v3", None),
    ("grpo", "deepseek_v2", None), ("ppo", "deepseek_v3", None),
    ("sft", "gpt_oss", None), ("dpo", "gpt_oss", None), ("kd", "gpt_oss", "gpt_oss_teacher"),
    ("reward_model", "gpt_oss", None), ("grpo", "gpt_oss", None), ("ppo", "gpt_oss", None),
    ("sft", "llama4", None), ("dpo", "llama4", None), ("kd", "llama4", "glm4_moe"), ("reward_model", "llama4", None),
    ("grpo", "llama4", None), ("ppo", "llama4", None),
    ("sft", "glm4_moe", None), ("dpo", "glm4_moe", None), ("kd", "glm4_moe", "llama4"),
    ("reward_model", "glm4_moe", None), ("grpo", "glm4_moe", None), ("ppo", "glm4_moe", None),
]  # fmt: skip
"""(recipe, family, kd teacher's model folder)."""


class World(FamiliesWorld):
    """The folders of :data:`MODELS` (one tokenizer) and the data of every recipe."""

    def __init__(self, root: Path) -> None:
        super(FamiliesWorld, self).__init__(root)
        self.dirs = {
            name: make_model_dir(root / name, family=module, **arguments)
            for name, (module, arguments) in MODELS.items()
        }


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("moe_families"))


@pytest.mark.parametrize(
    ("recipe", "family", "teacher"),
    CASES,
    ids=[f"{r}-{f}" + (f"-from-{t}" if t else "") for r, f, t in CASES],
)
def test_recipe_on_moe_family_matches_its_full_logits_reference(
    world, tmp_path, recipe, family, teacher
):
    CHECKS[recipe](world, family, teacher, tmp_path / "out")
