"""Every recipe on the transformers backend's architectures, each run held to transformers.

The architectures of :data:`~tests.models.transformers_world.ARCHITECTURES` (Cohere 2: a logit
scale, sliding and full attention; StarCoder 2: biases, a GELU MLP; LFM2: convolution layers
beside attention, so no packed rows) have no native family: ``from_hf`` wraps transformers' own
model. Every run is checked against a number computed in this file with
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` (not our wrapper) and a plain
PyTorch loss on its full logits, so a recipe on the backend == transformers + plain PyTorch:

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
from tests.recipes.preference_world import collate_pairs, make_preference_data
from tests.recipes.sft_world import (
    _any_component_allowed,
    checkpoint_weights,
    checkpoints,
    largest_change,
    make_chat_data,
    make_equal_length_data,
    make_model_dir,
    read_metrics,
    recipe_config,
    run_config,
    run_recipe,
)
from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.config import instantiate, load_config
from tunesmith.data import PackedDataset, Tokenizer
from tunesmith.models import from_hf
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME
from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.recipes import config_path

NATIVE = "qwen2_5"
"""The native family of the kd partner (the same tokenizer as the architectures' folders)."""

BATCH = 4
ONE_STEP = [f"batch_size={BATCH}", "max_steps=1", "shuffle=false"]
RL = ["max_steps=2", "generation.max_new_tokens=8", "generation.temperature=0.7",
      "optimizer.lr=1e-2"]  # fmt: skip
PPO = ["prompts_per_step=4", "batch_size=2", "kl_coef=0.1"]
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


class World:
    """Model folders (built when first asked for: one tokenizer), chat data, equal-length chat
    data (for packing), pairs and prompts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.chat = make_chat_data(root / "chat.jsonl", rows=8)
        self.pairs = make_preference_data(root / "pairs.jsonl", rows=8, task="add")
        self.prompts = make_prompts(root / "prompts.jsonl", rows=16)
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


def _hf(model_dir: Path) -> transformers.PreTrainedModel:
    """transformers' own model of ``model_dir`` in float32 (the reference)."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


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


def _trained_logits(hf: torch.nn.Module, samples: list[dict], raw: bool = False):
    """transformers' full logits at the trained positions of ``samples`` (one unpadded row at a
    time) and their labels; ``raw``: the head's output without the model's logit scale."""
    rows, labels = [], []
    for sample in samples:
        ids = torch.tensor([sample["input_ids"]])
        if raw:
            logits = hf.lm_head(hf.model(input_ids=ids).last_hidden_state)[0]
        else:
            logits = hf(input_ids=ids).logits[0]
        target = torch.tensor(sample["labels"])
        rows.append(logits[target != IGNORE_INDEX])
        labels.append(target[target != IGNORE_INDEX])
    return torch.cat(rows), torch.cat(labels)


def _sft_reference(model_dir: Path, samples: list[dict]) -> tuple[float, float, int]:
    """The token-mean cross-entropy of ``samples`` under transformers' model, the norm of its
    gradient and the number of trained tokens."""
    hf = _hf(model_dir)
    logits, labels = _trained_logits(hf, samples)
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    return loss.item(), _grad_norm(hf), labels.numel()


def _scaled(hf: torch.nn.Module) -> bool:
    """Whether transformers' model scales its head's output (Cohere's ``logit_scale``)."""
    scale = getattr(hf.config, "logit_scale", None)
    assert (scale not in (None, 1.0)) == (hf.config.model_type == "cohere2"), scale
    return scale not in (None, 1.0)


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return (p_log.exp() * (p_log - q_log)).sum(-1)


# -- the contract of each recipe --------------------------------------------------------------


def check_sft(world: World, arch: str, _partner: str | None, out: Path) -> None:
    model_dir = world.model_dir(arch)
    logged = read_metrics(run_recipe("sft", "tiny", model_dir, world.chat, out, *ONE_STEP))[1]
    samples = _samples("sft", model_dir, world.chat, BATCH)
    loss, grad_norm, tokens = _sft_reference(model_dir, samples)
    assert logged["trained_tokens"] == tokens
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    hf = _hf(model_dir)
    if _scaled(hf):  # Cohere: the loss of the raw head is far from the logged one
        with torch.no_grad():
            raw = F.cross_entropy(*_trained_logits(hf, samples, raw=True)).item()
        assert abs(raw - logged["loss"]) > 1e-3 * logged["loss"], raw


def check_sft_lora(world: World, arch: str, _partner: str | None, out: Path) -> None:
    model_dir = world.model_dir(arch)
    steps = [f"batch_size={BATCH}", "max_steps=3", "shuffle=false", "optimizer.lr=5e-2"]
    logged = read_metrics(run_recipe("sft", "tiny_lora", model_dir, world.chat, out, *steps))
    assert sorted(logged) == [1, 2, 3]
    loss, _, tokens = _sft_reference(model_dir, _samples("sft", model_dir, world.chat, BATCH))
    assert logged[1]["trained_tokens"] == tokens
    assert logged[1]["loss"] == pytest.approx(loss, rel=1e-5)  # B = 0: the base model's loss

    step_dir = checkpoints(out)[-1]
    assert step_dir.name == "step_000003" and (step_dir / ADAPTER_CONFIG_NAME).is_file()
    adapter = checkpoint_weights(step_dir)
    lora_b = {k: v for k, v in adapter.items() if ".lora_B." in k}
    assert lora_b and len(lora_b) == len(adapter) // 2, sorted(adapter)
    for name, tensor in lora_b.items():  # zero at the start: every one moved
        assert tensor.abs().max() > 1e-3, name

    tokenizer = Tokenizer.from_pretrained(model_dir)
    ids = torch.tensor([_samples("sft", model_dir, world.chat, 1)[0]["input_ids"]])
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
    samples = _samples("sft", model_dir, data, 8)
    packs = PackedDataset(samples, BATCH * length, tokenizer.pad_id)
    assert packs.members[0] == list(range(BATCH))  # step 1's row: the four samples
    common = ["max_steps=1", "shuffle=false", f"dataset.max_seq_len={BATCH * length}"]
    packed = run_recipe("sft", "tiny", model_dir, data, out / "packed", "packed=true",
                        "batch_size=1", *common)  # fmt: skip
    unpacked = run_recipe("sft", "tiny", model_dir, data, out / "unpacked", "packed=false",
                          f"batch_size={BATCH}", *common)  # fmt: skip
    p, u = read_metrics(packed)[1], read_metrics(unpacked)[1]
    loss, grad_norm, tokens = _sft_reference(model_dir, samples[:BATCH])
    assert p["tokens_seen"] == u["tokens_seen"] == BATCH * length
    assert p["trained_tokens"] == u["trained_tokens"] == tokens
    assert p["loss"] == pytest.approx(u["loss"], rel=1e-5)
    assert p["loss"] == pytest.approx(loss, rel=1e-5)
    assert p["grad_norm"] == pytest.approx(u["grad_norm"], rel=1e-4)
    assert p["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)


def _sequence_logps(hf: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Per row of a collated pair batch: the summed log-probability of its trained labels
    under transformers' model."""
    logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (labels != IGNORE_INDEX)).sum(-1)


def check_dpo(world: World, arch: str, _partner: str | None, out: Path) -> None:
    model_dir = world.model_dir(arch)
    logged = read_metrics(run_recipe("dpo", "tiny", model_dir, world.pairs, out, *ONE_STEP))[1]
    hf = _hf(model_dir)
    batch = collate_pairs(model_dir, world.pairs, list(range(BATCH)))
    assert (batch["attention_mask"] == 0).any()  # padded rows
    logps = _sequence_logps(hf, batch)
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
    assert logged["grad_norm"] == pytest.approx(_grad_norm(hf), rel=1e-4)


def check_kd(world: World, student: str, teacher: str | None, out: Path) -> None:
    assert teacher is not None
    student_dir, teacher_dir = world.model_dir(student), world.model_dir(teacher)
    extra = [f"teacher_dir={teacher_dir}", *ONE_STEP]
    logged = read_metrics(run_recipe("kd", "tiny", student_dir, world.chat, out, *extra))[1]
    samples = _samples("kd", student_dir, world.chat, BATCH, f"teacher_dir={teacher_dir}")
    teacher_hf = _hf(teacher_dir)
    with torch.no_grad():
        teacher_logits, _ = _trained_logits(teacher_hf, samples)
    hf = _hf(student_dir)
    logits, labels = _trained_logits(hf, samples)
    kl = _kl(teacher_logits.log_softmax(-1), logits.log_softmax(-1)).mean()  # forward, T = 1
    ce = F.cross_entropy(logits, labels)
    loss = 0.5 * kl + 0.5 * ce  # the tiny config's kd_ratio
    loss.backward()
    assert logged["trained_tokens"] == labels.numel()
    assert kl.item() > 1e-3  # two models, two distributions
    assert logged["kd_loss"] == pytest.approx(kl.item(), rel=1e-5)
    assert logged["ce_loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert logged["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(_grad_norm(hf), rel=1e-4)
    if _scaled(teacher_hf):  # Cohere's teacher: the KL of its raw head is far from the logged
        with torch.no_grad():
            raw_teacher, _ = _trained_logits(teacher_hf, samples, raw=True)
            raw = _kl(raw_teacher.log_softmax(-1), logits.log_softmax(-1)).mean().item()
        assert abs(raw - logged["kd_loss"]) > 1e-3 * logged["kd_loss"], raw


def _assert_sampler_is_trainer(out: Path, model_dir: Path) -> dict[int, dict]:
    logged = {s: r for s, r in read_metrics(out).items() if "logprob_mismatch_max" in r}
    assert sorted(logged) == [1, 2], sorted(logged)
    for step, record in logged.items():
        assert record["completion_tokens"] > 0, step
        assert record["logprob_mismatch_max"] < 1e-5, (step, record["logprob_mismatch_max"])
    final = checkpoint_weights(checkpoints(out)[-1])
    initial = checkpoint_weights(model_dir)
    assert final.keys() == initial.keys(), sorted(final.keys() ^ initial.keys())
    assert largest_change(final, initial) > 1e-4
    return logged


def check_grpo(world: World, arch: str, _partner: str | None, out: Path) -> None:
    model_dir = world.model_dir(arch)
    run_rl("grpo", "tiny", grpo_overrides(model_dir, world.prompts, out, *RL))
    logged = _assert_sampler_is_trainer(out, model_dir)
    assert logged[1]["rollout_samples"] == 16 and logged[1]["advantage_std"] > 0.1


def check_ppo(world: World, arch: str, _partner: str | None, out: Path) -> None:
    """PPO's policy on the backend, its critic a reward model of the native folder."""
    model_dir, critic_dir = world.model_dir(arch), world.model_dir(NATIVE)
    critic = (
        f"critic_model={{_component_: tunesmith.models.reward_model_from_hf, path: {critic_dir}}}"
    )
    overrides = grpo_overrides(model_dir, world.prompts, out, *RL, *PPO, critic)
    cfg = load_config(config_path("tiny", "ppo"), overrides)
    with _any_component_allowed():  # the test reward lives in tests/
        run_config("ppo", cfg)
    records = [r for r in read_metrics(out).values() if "kl" in r]
    assert abs(records[0]["kl"]) < 1e-6  # step 1: the reference is the policy
    _assert_sampler_is_trainer(out, model_dir)
    assert "score.weight" in checkpoint_weights(out / "critic" / "checkpoints" / "step_000002")


CHECKS = {
    "sft": check_sft, "sft_lora": check_sft_lora, "dpo": check_dpo, "kd": check_kd,
    "grpo": check_grpo, "ppo": check_ppo,
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
