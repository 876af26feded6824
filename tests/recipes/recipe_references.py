"""The references that recipe runs on a model are held to, computed with full logits and plain
PyTorch losses, for any model a :class:`Reference` loads: our own (``from_hf``, in
``test_recipes_on_families``) or transformers' (``AutoModelForCausalLM``, in
``test_transformers_backend_recipes``).

A test file's world (:class:`RecipeWorld`: model folders by name, chat data, pairs, prompts)
names its reference; the ``check_*`` functions run a recipe on a folder of that world and hold
the logged step to the number its reference computes:

- :func:`check_sft`: the logged loss, gradient norm and trained tokens of step 1 are the
  token-mean cross-entropy of the step-1 batch, the norm of its gradient and its token count.
- :func:`check_dpo` (the reference a frozen copy of the policy): the logged sequence log-probs
  of step 1 are the full-logit ones, the rewards 0, the loss ``log 2`` and the gradient norm
  that of the DPO loss on full logits.
- :func:`check_kd` (a student and a teacher): the logged KL, cross-entropy, loss and gradient
  norm of step 1 from both models' full logits.
- :func:`check_grpo` and :func:`check_ppo` (sampling at temperature 0.7): at every step the
  trainer's log-probs of the completions are the sampler's within 1e-5, and the weights move.

The checks return what they computed, so a file adds its own asserts (a logit transform that
must matter, say).

Example::

    class World(RecipeWorld):
        reference = Reference(load=lambda folder: from_hf(folder, dtype=torch.float32))

        def model_dir(self, name: str) -> Path: ...

    logged, model, samples = check_sft(world, "gemma2", None, tmp_path / "out")
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.recipes.preference_world import collate_pairs, make_preference_data
from tests.recipes.sft_world import (
    _any_component_allowed,
    checkpoint_weights,
    checkpoints,
    largest_change,
    make_chat_data,
    read_metrics,
    recipe_config,
    run_config,
    run_recipe,
)
from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl
from tunesmith.config import instantiate, load_config
from tunesmith.data import Tokenizer
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.recipes import config_path

BATCH = 4
ONE_STEP = [f"batch_size={BATCH}", "max_steps=1", "shuffle=false"]
RL = ["max_steps=2", "generation.max_new_tokens=8", "generation.temperature=0.7",
      "optimizer.lr=1e-2"]  # fmt: skip
PPO = ["prompts_per_step=4", "batch_size=2", "kl_coef=0.1"]


def _call(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    """``model``'s forward: full logits (ours apply the family's logit transform)."""
    return model(input_ids, attention_mask=attention_mask)


@dataclass(frozen=True)
class Reference:
    """The model a test file holds recipes to: ``load(folder)`` builds it (float32) from a HF
    folder; ``logits(model, input_ids, attention_mask=None)`` are its full logits
    (``[batch, seq, vocab]``, any logit transform applied); by default its forward."""

    load: Callable[[Path], torch.nn.Module]
    logits: Callable[..., torch.Tensor] = _call


class RecipeWorld:
    """Chat data, pairs and prompts under ``root``; a subclass names its :attr:`reference`
    and gives the model folders (:meth:`model_dir`)."""

    reference: Reference

    def __init__(self, root: Path) -> None:
        self.root = root
        self.chat = make_chat_data(root / "chat.jsonl", rows=8)
        self.pairs = make_preference_data(root / "pairs.jsonl", rows=8, task="add")
        self.prompts = make_prompts(root / "prompts.jsonl", rows=16)

    def model_dir(self, name: str) -> Path:
        """The HF folder of the model called ``name``."""
        raise NotImplementedError


# -- the references ---------------------------------------------------------------------------


def grad_norm(model: torch.nn.Module) -> float:
    """The global norm of ``model``'s gradients (in float64)."""
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def recipe_samples(recipe: str, model_dir: Path, data: Path, n: int, *overrides: str) -> list[dict]:
    """The first ``n`` samples the recipe's dataset config builds from ``data``."""
    cfg = recipe_config(
        recipe, "tiny", model_dir, data, Path("unused"), "dataset.cache_dir=null", *overrides
    )
    dataset = instantiate(cfg.dataset, Tokenizer.from_pretrained(model_dir))
    return [dataset[i] for i in range(n)]


def trained_logits(
    reference: Reference, model: torch.nn.Module, samples: list[dict]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference ``model``'s full logits at the trained positions of ``samples``, one
    unpadded row at a time, and their labels."""
    rows, labels = [], []
    for sample in samples:
        logits = reference.logits(model, torch.tensor([sample["input_ids"]]))[0]
        target = torch.tensor(sample["labels"])
        rows.append(logits[target != IGNORE_INDEX])
        labels.append(target[target != IGNORE_INDEX])
    return torch.cat(rows), torch.cat(labels)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` per row, from log-probabilities."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def sequence_logps(reference: Reference, model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Per row of a collated pair batch: the summed log-probability of its trained labels."""
    logits = reference.logits(model, batch["input_ids"], batch["attention_mask"])
    labels = batch["labels"]
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (labels != IGNORE_INDEX)).sum(-1)


@dataclass
class SFTReference:
    """The token-mean cross-entropy of some samples under the reference model, the norm of its
    gradient (left on ``model``) and the number of trained tokens."""

    loss: float
    grad_norm: float
    tokens: int
    model: torch.nn.Module


def sft_reference(reference: Reference, model_dir: Path, samples: list[dict]) -> SFTReference:
    """:class:`SFTReference` of ``samples`` under ``reference``'s model of ``model_dir``."""
    model = reference.load(model_dir)
    logits, labels = trained_logits(reference, model, samples)
    loss = F.cross_entropy(logits, labels)  # the token mean
    loss.backward()
    return SFTReference(loss.item(), grad_norm(model), labels.numel(), model)


# -- the contract of each recipe --------------------------------------------------------------


def check_sft(
    world: RecipeWorld, name: str, _partner: str | None, out: Path
) -> tuple[dict, torch.nn.Module, list[dict]]:
    """Step 1 of SFT == :func:`sft_reference` of its batch; returns the logged record, the
    reference model (its gradients computed) and the batch's samples."""
    model_dir = world.model_dir(name)
    logged = read_metrics(run_recipe("sft", "tiny", model_dir, world.chat, out, *ONE_STEP))[1]
    samples = recipe_samples("sft", model_dir, world.chat, BATCH)
    expected = sft_reference(world.reference, model_dir, samples)
    assert logged["trained_tokens_in_window"] == expected.tokens
    assert logged["loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-4)
    return logged, expected.model, samples


def check_dpo(world: RecipeWorld, name: str, _partner: str | None, out: Path) -> None:
    """Step 1 of DPO (the reference a frozen copy of the policy) == full-logit log-probs."""
    model_dir = world.model_dir(name)
    logged = read_metrics(run_recipe("dpo", "tiny", model_dir, world.pairs, out, *ONE_STEP))[1]
    model = world.reference.load(model_dir)
    batch = collate_pairs(model_dir, world.pairs, list(range(BATCH)))
    assert (batch["attention_mask"] == 0).any()  # padded rows
    logps = sequence_logps(world.reference, model, batch)
    chosen, rejected = logps[:BATCH], logps[BATCH:]
    beta = 0.1  # the reference is the policy: its log-probs are the policy's, detached
    margin = beta * ((chosen - chosen.detach()) - (rejected - rejected.detach()))
    loss = -F.logsigmoid(margin).mean()
    loss.backward()
    assert logged["pairs_in_window"] == BATCH
    assert logged["logps/chosen"] == pytest.approx(chosen.mean().item(), rel=1e-5)
    assert logged["logps/rejected"] == pytest.approx(rejected.mean().item(), rel=1e-5)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert abs(logged[key]) < 1e-5, (key, logged[key])  # policy == reference at step 1
    assert logged["loss"] == pytest.approx(math.log(2), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(model), rel=1e-4)


@dataclass
class KDRun:
    """What :func:`check_kd` computed: the logged step-1 record, the batch's samples, the
    teacher's reference model and the student's trained logits."""

    logged: dict
    samples: list[dict]
    teacher: torch.nn.Module
    logits: torch.Tensor


def check_kd(
    world: RecipeWorld, student: str, teacher: str | None, out: Path, *, min_kl: float
) -> KDRun:
    """Step 1 of KD == the forward KL (T = 1) and cross-entropy of both models' full logits;
    the KL is over ``min_kl`` (two models, two distributions)."""
    assert teacher is not None
    student_dir, teacher_dir = world.model_dir(student), world.model_dir(teacher)
    extra = [f"teacher_dir={teacher_dir}", *ONE_STEP]
    logged = read_metrics(run_recipe("kd", "tiny", student_dir, world.chat, out, *extra))[1]
    samples = recipe_samples("kd", student_dir, world.chat, BATCH, f"teacher_dir={teacher_dir}")
    reference = world.reference
    teacher_model = reference.load(teacher_dir)
    with torch.no_grad():
        teacher_logits, _ = trained_logits(reference, teacher_model, samples)
    student_model = reference.load(student_dir)
    logits, labels = trained_logits(reference, student_model, samples)
    divergence = kl(teacher_logits.log_softmax(-1), logits.log_softmax(-1)).mean()  # forward
    ce = F.cross_entropy(logits, labels)
    loss = 0.5 * divergence + 0.5 * ce  # the tiny config's kd_ratio
    loss.backward()
    assert logged["trained_tokens_in_window"] == labels.numel()
    assert divergence.item() > min_kl  # two models, two distributions
    assert logged["kd_loss"] == pytest.approx(divergence.item(), rel=1e-5)
    assert logged["ce_loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm(student_model), rel=1e-4)
    return KDRun(logged, samples, teacher_model, logits)


def assert_sampler_is_trainer(out: Path, model_dir: Path) -> dict[int, dict]:
    """Steps 1 and 2 of an RL run: completions trained, the trainer's log-probs the sampler's
    within 1e-5; the final weights (the initial ones' names) moved. Returns those records."""
    logged = {s: r for s, r in read_metrics(out).items() if "logprob_mismatch_max" in r}
    assert sorted(logged) == [1, 2], sorted(logged)
    for step, record in logged.items():
        assert record["completion_tokens_in_window"] > 0, step
        assert record["logprob_mismatch_max"] < 1e-5, (step, record["logprob_mismatch_max"])
    final = checkpoint_weights(checkpoints(out)[-1])
    initial = checkpoint_weights(model_dir)
    assert final.keys() == initial.keys(), sorted(final.keys() ^ initial.keys())
    assert largest_change(final, initial) > 1e-4
    return logged


def check_grpo(world: RecipeWorld, name: str, _partner: str | None, out: Path) -> None:
    """Two GRPO steps: sampler == trainer (:func:`assert_sampler_is_trainer`), 16 rollouts."""
    model_dir = world.model_dir(name)
    run_rl("grpo", "tiny", grpo_overrides(model_dir, world.prompts, out, *RL))
    logged = assert_sampler_is_trainer(out, model_dir)
    assert logged[1]["rollout_samples"] == 16 and logged[1]["advantage_std"] > 0.1


def check_ppo(
    world: RecipeWorld, name: str, _partner: str | None, out: Path, *overrides: str
) -> None:
    """Two PPO steps (with ``overrides``): KL 0 at step 1 (the reference is the policy),
    sampler == trainer, a critic checkpoint with a score head."""
    model_dir = world.model_dir(name)
    cfg = load_config(
        config_path("tiny", "ppo"),
        grpo_overrides(model_dir, world.prompts, out, *RL, *PPO, *overrides),
    )
    with _any_component_allowed():  # the test reward lives in tests/
        run_config("ppo", cfg)
    records = [r for r in read_metrics(out).values() if "kl" in r]
    assert abs(records[0]["kl"]) < 1e-6  # step 1: the reference is the policy
    assert_sampler_is_trainer(out, model_dir)
    assert "score.weight" in checkpoint_weights(out / "critic" / "checkpoints" / "step_000002")
