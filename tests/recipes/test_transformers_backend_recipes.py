"""Every recipe on the transformers backend's architectures, each run held to transformers.

The architectures of :data:`~tests.models.transformers_world.ARCHITECTURES` (Cohere 2: a logit
scale, sliding and full attention; StarCoder 2: biases, a GELU MLP; LFM2: convolution layers
beside attention, so no packed rows) have no native family: ``from_hf`` wraps transformers' own
model. Every run is checked against a number computed with
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` (not our wrapper) and a plain
PyTorch loss on its full logits (the checks of :mod:`tests.recipes.recipe_references` with
transformers' model as the reference), so a recipe on the backend == transformers + plain
PyTorch:

- ``sft``: the logged loss, gradient norm and trained tokens of step 1 (for Cohere 2 the loss
  without the logit scale is far from it: the chunked head path applies the scale); a 5-step
  run logs five finite losses.
- ``sft`` LoRA (``tiny_lora``): the step-1 loss is the same reference (B starts at zero); the
  last checkpoint is a PEFT adapter that ``peft`` loads onto transformers' model with the logits
  of our model with the adapter loaded, and the adapter moved.
- packing: StarCoder 2 and Cohere 2 (sliding layers) packed == unpacked == the reference
  (transformers masks the documents of a row by its position ids); LFM2 refuses packed rows
  (sft, kd) with an error naming it.
- ``dpo``: the step-1 sequence log-probs, loss ``log 2`` and gradient norm.
- ``kd``: a fallback student from a native (Qwen2.5) teacher and the reverse: the logged KL,
  cross-entropy, loss and gradient norm from both models' full logits.
- ``grpo`` and ``ppo`` (a native critic; sampling at temperature 0.7): at every step the
  trainer's log-probs are the sampler's within 1e-5, and the weights move.
- ``reward_model`` (and ``ppo``'s default critic, a copy of the policy's body) is refused with
  the backend named.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.models.transformers_world import ARCHITECTURES, make_transformers_model_dir
from tests.recipes import recipe_references as references
from tests.recipes.recipe_references import (
    BATCH,
    ONE_STEP,
    PPO,
    RL,
    RecipeWorld,
    Reference,
    kl,
    recipe_samples,
    sft_reference,
    trained_logits,
)
from tests.recipes.sft_world import (
    _any_component_allowed,
    checkpoint_weights,
    checkpoints,
    largest_change,
    make_equal_length_data,
    make_model_dir,
    read_metrics,
    run_config,
    run_recipe,
)
from tests.rl.rl_world import grpo_overrides
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.config import load_config
from tunesmith.data import PackedDataset, Tokenizer
from tunesmith.models import from_hf
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME
from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.recipes import config_path

NATIVE = "qwen2_5"
"""The native family of the kd partner (the same tokenizer as the architectures' folders)."""

SLOW = pytest.mark.slow

# (recipe, architecture, kd partner or None, tier marks). The default tier runs every recipe
# once and every architecture once; the slow tier the rest.
CASES = [
    pytest.param("sft", "cohere2", None, id="sft-cohere2"),
    pytest.param("sft", "starcoder2", None, id="sft-starcoder2", marks=SLOW),
    pytest.param("sft", "lfm2", None, id="sft-lfm2", marks=SLOW),
    pytest.param("sft_lora", "starcoder2", None, id="sft_lora-starcoder2", marks=SLOW),
    pytest.param("sft_lora", "lfm2", None, id="sft_lora-lfm2"),
    pytest.param("sft_lora", "cohere2", None, id="sft_lora-cohere2", marks=SLOW),
    pytest.param("dpo", "starcoder2", None, id="dpo-starcoder2"),
    pytest.param("dpo", "cohere2", None, id="dpo-cohere2", marks=SLOW),
    pytest.param("dpo", "lfm2", None, id="dpo-lfm2", marks=SLOW),
    pytest.param("kd", "lfm2", NATIVE, id="kd-lfm2-from-qwen2_5"),
    pytest.param("kd", NATIVE, "cohere2", id="kd-qwen2_5-from-cohere2", marks=SLOW),
    pytest.param("kd", "starcoder2", NATIVE, id="kd-starcoder2-from-qwen2_5", marks=SLOW),
    pytest.param("grpo", "starcoder2", None, id="grpo-starcoder2"),
    pytest.param("grpo", "cohere2", None, id="grpo-cohere2", marks=SLOW),
    pytest.param("grpo", "lfm2", None, id="grpo-lfm2", marks=SLOW),
    pytest.param("ppo", "lfm2", None, id="ppo-lfm2"),
]
RECIPES = ("sft", "sft_lora", "dpo", "kd", "grpo", "ppo")


def test_every_recipe_runs_an_architecture_and_every_architecture_three_recipes():
    cases = [case.values for case in CASES]
    assert {recipe for recipe, _, _ in cases} == set(RECIPES)
    runs = Counter(arch for _, model, partner in cases for arch in {model, partner})
    assert {a: runs[a] for a in ARCHITECTURES if runs[a] < 3} == {}
    default = [case.values for case in CASES if not case.marks]
    assert {r for r, _, _ in default} == set(RECIPES)
    assert {a for _, m, p in default for a in (m, p)} >= set(ARCHITECTURES)


# -- the world: a folder of every architecture and a native one, the data of every recipe ------


def _hf(model_dir: Path) -> transformers.PreTrainedModel:
    """transformers' own model of ``model_dir`` in float32 (the reference)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


TRANSFORMERS = Reference(
    load=_hf,
    logits=lambda hf, input_ids, attention_mask=None: (
        hf(input_ids=input_ids, attention_mask=attention_mask).logits
    ),
)
"""transformers' model of a folder and its full logits (with the model's logit scale)."""

RAW_HEAD = Reference(
    load=_hf,
    logits=lambda hf, input_ids, attention_mask=None: hf.lm_head(
        hf.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    ),
)
"""The same model's head output without its logit scale."""


class World(RecipeWorld):
    """Model folders (built when first asked for: one tokenizer), chat data, equal-length chat
    data (for packing), pairs and prompts; the reference is transformers' model of a folder."""

    reference = TRANSFORMERS

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self._dirs: dict[str, Path] = {}
        self._equal: tuple[Path, int] | None = None

    def model_dir(self, arch: str) -> Path:
        if arch not in self._dirs:
            root = self.root / arch
            folder = (
                make_model_dir(root) if arch == NATIVE else make_transformers_model_dir(root, arch)
            )
            # from_hf picks the backend: the architectures' folders are transformers'
            assert isinstance(from_hf(folder), TransformersLM) == (arch != NATIVE), arch
            self._dirs[arch] = folder
        return self._dirs[arch]

    def equal_length_chat(self) -> tuple[Path, int]:
        """Chat data of 8 samples of one length L (4 to a pack of 4L tokens) and L."""
        if self._equal is None:
            path = self.root / "equal.jsonl"
            self._equal = path, make_equal_length_data(path, self.model_dir("starcoder2"), 8)
        return self._equal


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World(tmp_path_factory.mktemp("transformers_backend"))


def _scaled(hf: torch.nn.Module) -> bool:
    """Whether transformers' model scales its head's output (Cohere's ``logit_scale``)."""
    scale = getattr(hf.config, "logit_scale", None)
    assert (scale not in (None, 1.0)) == (hf.config.model_type == "cohere2"), scale
    return scale not in (None, 1.0)


# -- the contract of each recipe (the rest: tests.recipes.recipe_references) ------------------


def check_sft(world: World, arch: str, partner: str | None, out: Path) -> None:
    logged, hf, samples = references.check_sft(world, arch, partner, out)
    if _scaled(hf):  # Cohere: the loss of the raw head is far from the logged one
        with torch.no_grad():
            raw = F.cross_entropy(*trained_logits(RAW_HEAD, hf, samples)).item()
        assert abs(raw - logged["loss"]) > 1e-3 * logged["loss"], raw


def check_sft_lora(world: World, arch: str, _partner: str | None, out: Path) -> None:
    model_dir = world.model_dir(arch)
    steps = [f"batch_size={BATCH}", "max_steps=3", "shuffle=false", "optimizer.lr=5e-2"]
    logged = read_metrics(run_recipe("sft", "tiny_lora", model_dir, world.chat, out, *steps))
    assert sorted(logged) == [1, 2, 3]
    samples = recipe_samples("sft", model_dir, world.chat, BATCH)
    expected = sft_reference(world.reference, model_dir, samples)
    assert logged[1]["trained_tokens_in_window"] == expected.tokens
    assert logged[1]["loss"] == pytest.approx(expected.loss, rel=1e-5)  # B = 0: the base model's

    step_dir = checkpoints(out)[-1]
    assert step_dir.name == "step_000003" and (step_dir / ADAPTER_CONFIG_NAME).is_file()
    adapter = checkpoint_weights(step_dir)
    lora_b = {k: v for k, v in adapter.items() if ".lora_B." in k}
    assert lora_b and len(lora_b) == len(adapter) // 2, sorted(adapter)
    for name, tensor in lora_b.items():  # zero at the start: every one moved
        assert tensor.abs().max() > 1e-3, name

    tokenizer = Tokenizer.from_pretrained(model_dir)
    ids = torch.tensor([recipe_samples("sft", model_dir, world.chat, 1)[0]["input_ids"]])
    noise = torch.randint(0, tokenizer.vocab_size, (2, ids.shape[1]),
                          generator=torch.Generator().manual_seed(0))  # fmt: skip
    ids = torch.cat([ids, noise])
    loaded = load_checkpoint(step_dir)
    assert loaded.kind == "adapter" and isinstance(loaded.model, TransformersLM)
    with torch.no_grad():
        ours = loaded.model(ids)
        theirs = peft.PeftModel.from_pretrained(_hf(model_dir), step_dir).eval()(ids).logits
        base = _hf(model_dir)(ids).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (ours - base).abs().max() > 1e-3  # the adapter changes the logits


def check_packing(world: World, arch: str, out: Path) -> None:
    """Packed (four samples of length L in a row of 4L) == unpacked (a batch of the same four)
    == the reference (each sample alone through transformers' model)."""
    model_dir = world.model_dir(arch)
    data, length = world.equal_length_chat()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    samples = recipe_samples("sft", model_dir, data, 8)
    packs = PackedDataset(samples, BATCH * length, tokenizer.pad_id)
    assert packs.members[0] == list(range(BATCH))  # step 1's row: the four samples
    common = ["max_steps=1", "shuffle=false", f"dataset.max_seq_len={BATCH * length}"]
    packed = run_recipe("sft", "tiny", model_dir, data, out / "packed", "packed=true",
                        "batch_size=1", *common)  # fmt: skip
    unpacked = run_recipe("sft", "tiny", model_dir, data, out / "unpacked", "packed=false",
                          f"batch_size={BATCH}", *common)  # fmt: skip
    p, u = read_metrics(packed)[1], read_metrics(unpacked)[1]
    expected = sft_reference(world.reference, model_dir, samples[:BATCH])
    assert p["tokens_seen"] == u["tokens_seen"] == BATCH * length
    assert p["trained_tokens_in_window"] == u["trained_tokens_in_window"] == expected.tokens
    assert p["loss"] == pytest.approx(u["loss"], rel=1e-5)
    assert p["loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert p["grad_norm"] == pytest.approx(u["grad_norm"], rel=1e-4)
    assert p["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-4)


def check_kd(world: World, student: str, teacher: str | None, out: Path) -> None:
    run = references.check_kd(world, student, teacher, out, min_kl=1e-3)
    if _scaled(run.teacher):  # Cohere's teacher: the KL of its raw head is far from the logged
        with torch.no_grad():
            raw_teacher, _ = trained_logits(RAW_HEAD, run.teacher, run.samples)
            raw = kl(raw_teacher.log_softmax(-1), run.logits.log_softmax(-1)).mean().item()
        assert abs(raw - run.logged["kd_loss"]) > 1e-3 * run.logged["kd_loss"], raw


def check_ppo(world: World, arch: str, partner: str | None, out: Path) -> None:
    """PPO's policy on the backend, its critic a reward model of the native folder."""
    critic_dir = world.model_dir(NATIVE)
    critic = (
        f"critic_model={{_component_: tunesmith.models.reward_model_from_hf, path: {critic_dir}}}"
    )
    references.check_ppo(world, arch, partner, out, critic)


CHECKS = {
    "sft": check_sft, "sft_lora": check_sft_lora, "dpo": references.check_dpo, "kd": check_kd,
    "grpo": references.check_grpo, "ppo": check_ppo,
}  # fmt: skip


@pytest.mark.parametrize(("recipe", "arch", "partner"), CASES)
def test_recipe_on_architecture_matches_transformers(world, tmp_path, recipe, arch, partner):
    CHECKS[recipe](world, arch, partner, tmp_path / "out")


# -- packing, five steps, what the backend refuses ----------------------------------------------


@pytest.mark.parametrize("arch", [pytest.param("starcoder2"), pytest.param("cohere2", marks=SLOW)])
def test_packed_rows_equal_unpacked_and_transformers(world, tmp_path, arch):
    check_packing(world, arch, tmp_path)


@pytest.mark.parametrize("recipe", ["sft", pytest.param("kd", marks=SLOW)])
def test_lfm2_refuses_packed_rows(world, tmp_path, recipe):
    extra = [f"teacher_dir={world.model_dir(NATIVE)}"] if recipe == "kd" else []
    model_dir = world.model_dir("lfm2")
    with pytest.raises(ValueError, match="lfm2") as refused:
        run_recipe(recipe, "tiny", model_dir, world.chat, tmp_path, "packed=true", *ONE_STEP,
                   *extra)  # fmt: skip
    message = str(refused.value)
    assert "transformers backend" in message and "set packed: false" in message, message
    assert not (tmp_path / "metrics.jsonl").exists()  # refused at setup, before a step


def test_five_steps_on_starcoder2(world, tmp_path):
    out = run_recipe("sft", "tiny", world.model_dir("starcoder2"), world.chat, tmp_path,
                     "batch_size=2", "max_steps=5")  # fmt: skip
    logged = read_metrics(out)
    assert sorted(logged) == [1, 2, 3, 4, 5]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in logged.values())
    assert checkpoints(out)[-1].name == "step_000005"
    final = checkpoint_weights(checkpoints(out)[-1])
    assert largest_change(final, checkpoint_weights(world.model_dir("starcoder2"))) > 1e-4


def test_reward_models_are_refused_with_the_backend_named(world, tmp_path):
    model_dir = world.model_dir("cohere2")
    with pytest.raises(Exception, match="transformers backend") as refused:
        run_recipe("reward_model", "tiny", model_dir, world.pairs, tmp_path, *ONE_STEP)
    assert "cohere2" in str(refused.value)
    overrides = grpo_overrides(model_dir, world.prompts, tmp_path / "ppo", *RL, *PPO)
    cfg = load_config(config_path("tiny", "ppo"), overrides)
    with (
        _any_component_allowed(),  # the test reward lives in tests/
        pytest.raises(ValueError, match="transformers backend") as refused,
    ):
        run_config("ppo", cfg)
    assert "critic_model" in str(refused.value) and "starcoder2" not in str(refused.value)
    assert "cohere2" in str(refused.value)
