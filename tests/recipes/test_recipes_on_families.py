"""Every recipe on the newer model families, each run held to a number computed here.

The families of :data:`FAMILIES` (soft caps, sandwich and post norms, multipliers and a scaled
head, NoPE layers, partial and interleaved rotary, LongRoPE, whole-projection qk-norm) are
assigned round-robin to the recipes (:data:`CASES`: every recipe runs at least one of them,
every family at least two recipes), and every run is checked against a reference computed from
the model itself (``from_hf``) with full logits (``model(...)`` applies the family's logit
transform; the recipes' chunked head paths must apply it too), by the checks of
:mod:`tests.recipes.recipe_references` (``reward_model``'s and the logit transform's here):

- ``sft``: the logged loss and gradient norm of step 1 are the token-mean cross-entropy of the
  step-1 batch and the norm of its gradient (and, for a family with a logit transform, that
  loss without the transform is far from the logged one: the comparison tests it).
- ``dpo`` (the reference a frozen copy of the policy): the logged sequence log-probs of step 1
  are the full-logit ones, the rewards 0 (the reference runs the policy's transform too), the
  loss ``log 2`` and the gradient norm that of the DPO loss on full logits.
- ``kd`` (student and teacher of two families, one with a logit transform): the logged KL,
  cross-entropy, loss and gradient norm of step 1 from both models' full logits.
- ``reward_model``: the logged loss, accuracy, margin and gradient norm of step 2 from the
  scores of the step-1 checkpoint, which transformers' ``*ForSequenceClassification`` loads
  and scores alike.
- ``grpo`` and ``ppo`` (sampling at temperature 0.7): at every step the trainer's log-probs of
  the completions (the chunked head path, transform and temperature) are the sampler's (full
  logits of the KV-cache decode) within 1e-5, and the weights move.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from tests.recipes import recipe_references as references
from tests.recipes.preference_world import collate_pairs
from tests.recipes.recipe_references import (
    BATCH,
    RecipeWorld,
    Reference,
    grad_norm,
    trained_logits,
)
from tests.recipes.sft_world import (
    checkpoint_weights,
    checkpoints,
    largest_change,
    make_model_dir,
    read_metrics,
    run_recipe,
)
from tunesmith.models import from_hf, reward_model_from_hf
from tunesmith.models.family import family_for
from tunesmith.models.zoo import gemma2, gemma3, glm4, granite, olmo2, olmo3, phi3, smollm3

FAMILIES: dict[str, tuple[ModuleType, dict]] = {
    # Logits up to ~4 (a wider init) under a soft cap of 2: the cap bites (the shipped 30 would
    # change a tiny model's logits, |z| < 1, by 1e-4).
    "gemma2": (gemma2, {"initializer_range": 0.1, "final_logit_softcapping": 2.0}),
    "gemma3": (gemma3, {}),
    "olmo2": (olmo2, {}),
    "olmo3": (olmo3, {}),
    "granite": (granite, {}),  # logits divided by logits_scaling 4
    "smollm3": (smollm3, {}),
    "phi3": (phi3, {}),
    "glm4": (glm4, {}),
}
"""family -> (its zoo module, spec overrides of its ``<family>_tiny`` size)."""

TRANSFORMED = ("gemma2", "granite")
"""The families whose logits are transformed (soft-capped, scaled) before the softmax."""

CASES: list[tuple[str, str, str | None]] = [
    ("sft", "gemma2", None), ("sft", "phi3", None), ("sft", "olmo2", None),
    ("dpo", "granite", None), ("dpo", "olmo3", None), ("dpo", "gemma3", None),
    ("kd", "gemma3", "granite"), ("kd", "gemma2", "smollm3"),  # (student, teacher)
    ("reward_model", "glm4", None), ("reward_model", "smollm3", None),
    ("grpo", "gemma2", None), ("grpo", "olmo2", None), ("grpo", "smollm3", None),
    ("ppo", "phi3", None), ("ppo", "granite", None), ("ppo", "glm4", None),
    ("ppo", "olmo3", None),
]  # fmt: skip
"""(recipe, family, kd teacher's family)."""

RECIPES = ("sft", "dpo", "kd", "reward_model", "grpo", "ppo")


def test_every_recipe_runs_a_new_family_and_every_family_two_recipes():
    assert {recipe for recipe, _, _ in CASES} == set(RECIPES)
    runs = Counter(family for _, family, _ in CASES)
    assert {f: runs[f] for f in FAMILIES if runs[f] < 2} == {}
    assert set(runs) | {t for *_, t in CASES if t} <= set(FAMILIES)


# -- the world: a model folder of every family, the data of every recipe ----------------------


class World(RecipeWorld):
    """A model folder of every family (one tokenizer), chat data, pairs and prompts; the
    reference is our own model of a folder (``from_hf``, float32)."""

    reference = Reference(load=lambda folder: from_hf(folder, dtype=torch.float32))

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.dirs = {
            family: make_model_dir(root / family, family=module, **overrides)
            for family, (module, overrides) in FAMILIES.items()
        }

    def model_dir(self, family: str) -> Path:
        return self.dirs[family]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("families"))


# -- the contract of each recipe (the rest: tests.recipes.recipe_references) ------------------


def check_sft(world: World, family: str, teacher: str | None, out: Path) -> None:
    logged, model, samples = references.check_sft(world, family, teacher, out)
    if family in TRANSFORMED:  # the raw head's loss is far from it: the check above tells
        transform, model.logit_transform = model.logit_transform, None
        with torch.no_grad():
            raw = F.cross_entropy(*trained_logits(world.reference, model, samples)).item()
        assert abs(raw - logged["loss"]) > 1e-3 * logged["loss"], (raw, transform)


def check_reward_model(world: World, family: str, _teacher: str | None, out: Path) -> None:
    model_dir = world.model_dir(family)
    steps = [f"batch_size={BATCH}", "max_steps=2", "shuffle=false", "save_every_n_steps=1",
             "keep_last=null", "lr_scheduler.num_warmup_steps=0", "optimizer.lr=1e-2"]  # fmt: skip
    logged = read_metrics(run_recipe("reward_model", "tiny", model_dir, world.pairs, out, *steps))
    step_1 = checkpoints(out)[0]
    assert step_1.name == "step_000001"
    batch = collate_pairs(model_dir, world.pairs, list(range(BATCH, 2 * BATCH)))  # step 2's
    assert (batch["attention_mask"] == 0).any()  # padded rows: scored at their last real token
    model = reward_model_from_hf(step_1, dtype=torch.float32)
    scores = model(batch["input_ids"], attention_mask=batch["attention_mask"])[:, 0]
    margins = scores[:BATCH] - scores[BATCH:]
    loss = -F.logsigmoid(margins).mean()
    loss.backward()
    record = logged[2]
    assert record["pairs_in_window"] == BATCH
    assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert record["margin"] == pytest.approx(margins.mean().item(), rel=1e-4, abs=1e-6)
    assert record["accuracy"] == (margins > 0).double().mean().item()
    assert record["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)
    if family_for(model.spec.model_type).classifier_architecture is None:
        # transformers has no classifier for it (Llama 4 text, GLM-4.5): the folder is
        # tunesmith's (the save warns), and transformers indeed refuses it
        with pytest.raises(ValueError, match="Unrecognized configuration class"):
            AutoModelForSequenceClassification.from_pretrained(step_1)
    else:
        hf = AutoModelForSequenceClassification.from_pretrained(step_1, dtype=torch.float32)
        with torch.no_grad():
            hf_scores = hf.eval()(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            )
        torch.testing.assert_close(hf_scores.logits[:, 0], scores.detach(), atol=1e-5, rtol=0)
    initial = {k: v for k, v in checkpoint_weights(model_dir).items() if not k.startswith("lm_")}
    assert largest_change(checkpoint_weights(step_1), initial) > 1e-3  # step 1 trained


CHECKS = {
    "sft": check_sft, "dpo": references.check_dpo,
    "kd": partial(references.check_kd, min_kl=1e-2), "reward_model": check_reward_model,
    "grpo": references.check_grpo, "ppo": references.check_ppo,
}  # fmt: skip


@pytest.mark.parametrize(
    ("recipe", "family", "teacher"),
    CASES,
    ids=[f"{r}-{f}" + (f"-from-{t}" if t else "") for r, f, t in CASES],
)
def test_recipe_on_family_matches_its_full_logits_reference(
    world, tmp_path, recipe, family, teacher
):
    CHECKS[recipe](world, family, teacher, tmp_path / "out")
