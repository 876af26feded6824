"""Every recipe on the newer model families, each run held to a number computed here.

The families of :data:`FAMILIES` (soft caps, sandwich and post norms, multipliers and a scaled
head, NoPE layers, partial and interleaved rotary, LongRoPE, whole-projection qk-norm) are
assigned round-robin to the recipes (:data:`CASES`: every recipe runs at least one of them,
every family at least two recipes), and every run is checked against a reference computed in
this file from the model itself with full logits (``model(...)`` applies the family's logit
transform; the recipes' chunked head paths must apply it too):

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

import math
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from tests.recipes.preference_world import collate_pairs, make_preference_data
from tests.recipes.sft_world import (
    _any_component_allowed,
    checkpoint_weights,
    checkpoints,
    largest_change,
    make_chat_data,
    make_model_dir,
    read_metrics,
    recipe_config,
    run_config,
    run_recipe,
)
from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl
from tunesmith.config import instantiate, load_config
from tunesmith.data import Tokenizer
from tunesmith.models import from_hf, reward_model_from_hf
from tunesmith.models.zoo import gemma2, gemma3, glm4, granite, olmo2, olmo3, phi3, smollm3
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.recipes import config_path

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
BATCH = 4
ONE_STEP = [f"batch_size={BATCH}", "max_steps=1", "shuffle=false"]
RL = ["max_steps=2", "generation.max_new_tokens=8", "generation.temperature=0.7",
      "optimizer.lr=1e-2"]  # fmt: skip
PPO = ["prompts_per_step=4", "batch_size=2", "kl_coef=0.1"]


def test_every_recipe_runs_a_new_family_and_every_family_two_recipes():
    assert {recipe for recipe, _, _ in CASES} == set(RECIPES)
    runs = Counter(family for _, family, _ in CASES)
    assert {f: runs[f] for f in FAMILIES if runs[f] < 2} == {}
    assert set(runs) | {t for *_, t in CASES if t} <= set(FAMILIES)


# -- the world: a model folder of every family, the data of every recipe ----------------------


class World:
    """A model folder of every family (one tokenizer), chat data, pairs and prompts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.chat = make_chat_data(root / "chat.jsonl", rows=8)
        self.pairs = make_preference_data(root / "pairs.jsonl", rows=8, task="add")
        self.prompts = make_prompts(root / "prompts.jsonl", rows=16)
        self.dirs = {
            family: make_model_dir(root / family, family=module, **overrides)
            for family, (module, overrides) in FAMILIES.items()
        }

    def model_dir(self, family: str) -> Path:
        return self.dirs[family]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("families"))


def _grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def _samples(recipe: str, model_dir: Path, data: Path, n: int, *overrides: str) -> list[dict]:
    """The first ``n`` samples the recipe's dataset config builds from ``data``."""
    cfg = recipe_config(
        recipe, "tiny", model_dir, data, Path("unused"), "dataset.cache_dir=null", *overrides
    )
    dataset = instantiate(cfg.dataset, Tokenizer.from_pretrained(model_dir))
    return [dataset[i] for i in range(n)]


def _trained_logits(model: torch.nn.Module, samples: list[dict]) -> tuple[torch.Tensor, ...]:
    """``model``'s full logits (its forward: transform applied) at the trained positions of
    ``samples``, one unpadded row at a time, and their labels."""
    rows, labels = [], []
    for sample in samples:
        logits = model(torch.tensor([sample["input_ids"]]))[0]
        target = torch.tensor(sample["labels"])
        rows.append(logits[target != IGNORE_INDEX])
        labels.append(target[target != IGNORE_INDEX])
    return torch.cat(rows), torch.cat(labels)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


# -- the contract of each recipe --------------------------------------------------------------


def check_sft(world: World, family: str, _teacher: str | None, out: Path) -> None:
    model_dir = world.model_dir(family)
    logged = read_metrics(run_recipe("sft", "tiny", model_dir, world.chat, out, *ONE_STEP))[1]
    model = from_hf(model_dir, dtype=torch.float32)
    samples = _samples("sft", model_dir, world.chat, BATCH)
    logits, labels = _trained_logits(model, samples)
    loss = F.cross_entropy(logits, labels)  # the token mean
    loss.backward()
    assert logged["trained_tokens"] == labels.numel()
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(_grad_norm(model), rel=1e-4)
    if family in TRANSFORMED:  # the raw head's loss is far from it: the check above tells
        transform, model.logit_transform = model.logit_transform, None
        with torch.no_grad():
            raw = F.cross_entropy(*_trained_logits(model, samples)).item()
        assert abs(raw - logged["loss"]) > 1e-3 * logged["loss"], (raw, transform)


def _sequence_logps(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Per row of a collated pair batch: the summed log-probability of its trained labels."""
    logps = model(batch["input_ids"]).log_softmax(-1)
    labels = batch["labels"]
    picked = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (labels != IGNORE_INDEX)).sum(-1)


def check_dpo(world: World, family: str, _teacher: str | None, out: Path) -> None:
    model_dir = world.model_dir(family)
    logged = read_metrics(run_recipe("dpo", "tiny", model_dir, world.pairs, out, *ONE_STEP))[1]
    model = from_hf(model_dir, dtype=torch.float32)
    logps = _sequence_logps(model, collate_pairs(model_dir, world.pairs, list(range(BATCH))))
    chosen, rejected = logps[:BATCH], logps[BATCH:]
    beta = 0.1  # the reference is the policy: its log-probs are the policy's, detached
    margin = beta * ((chosen - chosen.detach()) - (rejected - rejected.detach()))
    loss = -F.logsigmoid(margin).mean()
    loss.backward()
    assert logged["pairs"] == BATCH
    assert logged["logps/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
    assert logged["logps/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert abs(logged[key]) < 1e-5, (key, logged[key])  # policy == reference at step 1
    assert logged["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(_grad_norm(model), rel=1e-4)


def check_kd(world: World, family: str, teacher: str | None, out: Path) -> None:
    assert teacher is not None
    student_dir, teacher_dir = world.model_dir(family), world.model_dir(teacher)
    extra = [f"teacher_dir={teacher_dir}", *ONE_STEP]
    out = run_recipe("kd", "tiny", student_dir, world.chat, out, *extra)
    logged = read_metrics(out)[1]
    samples = _samples("kd", student_dir, world.chat, BATCH, f"teacher_dir={teacher_dir}")
    student = from_hf(student_dir, dtype=torch.float32)
    with torch.no_grad():
        teacher_logits, _ = _trained_logits(from_hf(teacher_dir, dtype=torch.float32), samples)
    logits, labels = _trained_logits(student, samples)
    kl = _kl(teacher_logits.log_softmax(-1), logits.log_softmax(-1)).mean()  # forward, T = 1
    ce = F.cross_entropy(logits, labels)
    loss = 0.5 * kl + 0.5 * ce  # the tiny config's kd_ratio
    loss.backward()
    assert logged["trained_tokens"] == labels.numel()
    assert kl.item() > 1e-2  # two models, two distributions
    assert logged["kd_loss"] == pytest.approx(kl.item(), rel=1e-5)
    assert logged["ce_loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(_grad_norm(student), rel=1e-4)


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
    assert record["pairs"] == BATCH
    assert record["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert record["margin"] == pytest.approx(margins.mean().item(), rel=1e-4, abs=1e-6)
    assert record["accuracy"] == (margins > 0).double().mean().item()
    assert record["grad_norm"] == pytest.approx(_grad_norm(model), rel=1e-4)
    hf = AutoModelForSequenceClassification.from_pretrained(step_1, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_scores = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(hf_scores.logits[:, 0], scores.detach(), atol=1e-5, rtol=0)
    initial = {k: v for k, v in checkpoint_weights(model_dir).items() if not k.startswith("lm_")}
    assert largest_change(checkpoint_weights(step_1), initial) > 1e-3  # step 1 trained


def _assert_sampler_is_trainer(out: Path, model_dir: Path) -> dict[int, dict]:
    logged = {s: r for s, r in read_metrics(out).items() if "logprob_mismatch_max" in r}
    assert sorted(logged) == [1, 2], sorted(logged)
    for step, record in logged.items():
        assert record["completion_tokens"] > 0, step
        assert record["logprob_mismatch_max"] < 1e-5, (step, record["logprob_mismatch_max"])
    assert largest_change(_final(out), checkpoint_weights(model_dir)) > 1e-4
    return logged


def _final(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint_weights(checkpoints(out)[-1])


def check_grpo(world: World, family: str, _teacher: str | None, out: Path) -> None:
    model_dir = world.model_dir(family)
    run_rl("grpo", "tiny", grpo_overrides(model_dir, world.prompts, out, *RL))
    logged = _assert_sampler_is_trainer(out, model_dir)
    assert logged[1]["rollout_samples"] == 16 and logged[1]["advantage_std"] > 0.1


def check_ppo(world: World, family: str, _teacher: str | None, out: Path) -> None:
    model_dir = world.model_dir(family)
    overrides = grpo_overrides(model_dir, world.prompts, out, *RL, *PPO)
    cfg = load_config(config_path("tiny", "ppo"), overrides)
    with _any_component_allowed():  # the test reward lives in tests/
        run_config("ppo", cfg)
    records = [r for r in read_metrics(out).values() if "kl" in r]
    assert abs(records[0]["kl"]) < 1e-6  # step 1: the reference is the policy
    _assert_sampler_is_trainer(out, model_dir)
    critic = checkpoint_weights(out / "critic" / "checkpoints" / "step_000002")
    assert "score.weight" in critic


CHECKS = {
    "sft": check_sft, "dpo": check_dpo, "kd": check_kd, "reward_model": check_reward_model,
    "grpo": check_grpo, "ppo": check_ppo,
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
