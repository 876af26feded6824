"""The knowledge-distillation recipe end to end: a tiny student (hidden 64) learns from a bigger
teacher (hidden 128, trained for a few steps with the SFT recipe on the same chat data).

- Distillation works: the student's token-mean KL to the teacher on held-out data, computed
  here with transformers' own models, falls to well under half its starting value, and the
  recipe's logged ``val_kd_loss`` is that same number.
- Every divergence kind is what it says: the logged step-1 ``kd_loss`` equals the divergence
  (written out below from its definition, at temperature 2) of transformers' student and
  teacher logits on the step-1 batch; computing it in 1 chunk or in 7 gives the same losses
  and the same weights.
- ``kd_ratio=0`` is plain SFT: the same per-step losses as the SFT recipe.
- A teacher with another vocabulary size is refused; a bf16 teacher runs.
- FSDP2 over two gloo ranks trains like one process (started here as torchrun would; the slow
  variant goes through ``tunesmith run kd --nproc-per-node 2``).
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig
from torch.utils.data import DistributedSampler
from transformers import AutoModelForCausalLM

from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    cli_command,
    final_weights,
    largest_change,
    launch_ranks,
    make_chat_data,
    make_counting_data,
    make_model_dir,
    read_eval_metrics,
    read_metrics,
    recipe_config,
    recipe_overrides,
    run_config,
    run_recipe,
    subprocess_env,
)
from tunesmith.config import instantiate
from tunesmith.data import Tokenizer
from tunesmith.models import build_model, from_hf
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.modules.losses import IGNORE_INDEX

TEACHER_SIZE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8}
TEACHER_STEPS, ROWS, VAL_ROWS, SEED = 40, 128, 32, 0
KINDS = ("forward", "reverse", "symmetric", "js")


# -- the world ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Student and teacher folders (same tokenizer), training and held-out chat data."""
    root = tmp_path_factory.mktemp("kd")
    chat = make_chat_data(root / "chat.jsonl", rows=ROWS, seed=0)
    teacher_init = make_model_dir(root / "teacher-init", seed=1, **TEACHER_SIZE)
    sft = run_recipe(
        "sft",
        "tiny",
        teacher_init,
        chat,
        root / "teacher-sft",
        f"max_steps={TEACHER_STEPS}",
        "batch_size=8",
        "metric_loggers=[]",
    )
    return {
        "student": make_model_dir(root / "student", seed=0),
        "teacher": checkpoints(sft)[-1],
        "chat": chat,
        "val": make_chat_data(root / "val.jsonl", rows=VAL_ROWS, seed=1),
    }


def kd_config(
    world: dict[str, Path],
    output_dir: Path,
    *overrides: str,
    teacher: Path | None = None,
    val: bool = False,
) -> DictConfig:
    """The shipped kd ``tiny`` config on the world (or another ``teacher``); with ``val``, the
    held-out chat file as ``val_dataset``."""
    return recipe_config(
        "kd",
        "tiny",
        world["student"],
        world["chat"],
        output_dir,
        f"teacher_dir={teacher or world['teacher']}",
        *overrides,
        val=world["val"] if val else None,
    )


def run_kd(world: dict[str, Path], output_dir: Path, *overrides: str, **kw) -> Path:
    """Run the kd recipe in this process; returns ``output_dir``."""
    run_config("kd", kd_config(world, output_dir, *overrides, **kw))
    return output_dir


# -- an independent divergence: transformers' logits, the definitions in float64 --------------


def trained_logits(folder: Path, samples: list[dict]) -> torch.Tensor:
    """transformers' logits of ``folder``'s causal LM at every trained position of ``samples``
    (rows where the label is not ignored), float64 ``[n, vocab]``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for sample in samples:
            logits = model(torch.tensor([sample["input_ids"]])).logits[0]
            rows.append(logits[torch.tensor(sample["labels"]) != IGNORE_INDEX].double())
    return torch.cat(rows)


def kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """Per row ``KL(p || q) = Σ_v p(v) (log p(v) - log q(v))``."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def reference_divergence(
    kind: str, student: torch.Tensor, teacher: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Per-row divergence between the softened teacher (T) and student (S) distributions,
    times T² (Hinton et al.): forward KL(T||S), reverse KL(S||T), symmetric their mean, js the
    Jensen-Shannon divergence ½KL(T||M) + ½KL(S||M) with M = ½(T + S)."""
    log_s = torch.log_softmax(student / temperature, dim=-1)
    log_t = torch.log_softmax(teacher / temperature, dim=-1)
    if kind == "forward":
        value = kl(log_t, log_s)
    elif kind == "reverse":
        value = kl(log_s, log_t)
    elif kind == "symmetric":
        value = (kl(log_t, log_s) + kl(log_s, log_t)) / 2
    else:
        log_m = torch.log((log_t.exp() + log_s.exp()) / 2)
        value = (kl(log_t, log_m) + kl(log_s, log_m)) / 2
    return value * temperature**2


def recipe_samples(world: dict[str, Path], source: Path) -> list[dict]:
    """The samples the kd config's dataset builds from ``source``, in source order."""
    cfg = kd_config(world, Path("unused"), f"dataset.source={source}", "dataset.cache_dir=null")
    return list(instantiate(cfg.dataset, Tokenizer.from_pretrained(world["student"])))


def first_batch(world: dict[str, Path], batch_size: int) -> list[dict]:
    """The samples of the recipe's step-1 batch: the first ``batch_size`` of the seeded
    shuffle of one rank's sampler, epoch 0."""
    dataset = recipe_samples(world, world["chat"])
    order = list(DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED, drop_last=True))
    return [dataset[i] for i in order[:batch_size]]


def mean_kl_to_teacher(student: Path, teacher: Path, samples: list[dict]) -> float:
    """The student's forward KL(teacher || student), a mean over the trained tokens."""
    values = reference_divergence(
        "forward", trained_logits(student, samples), trained_logits(teacher, samples)
    )
    return values.mean().item()


# -- tests -------------------------------------------------------------------------------------

DISTILL_STEPS = 32


def test_distillation_lowers_the_students_kl_to_the_teacher_on_held_out_data(world, tmp_path):
    held_out = recipe_samples(world, world["val"])
    start = mean_kl_to_teacher(world["student"], world["teacher"], held_out)
    assert start > 0.3, f"the teacher barely differs from the random student (KL {start:.3f})"

    out = run_kd(
        world,
        tmp_path / "kd",
        "kd_ratio=1.0",
        "batch_size=8",
        f"max_steps={DISTILL_STEPS}",
        f"eval_every_n_steps={DISTILL_STEPS // 2}",
        val=True,
    )
    final = checkpoints(out)[-1]
    assert final.name == f"step_{DISTILL_STEPS:06d}"
    end = mean_kl_to_teacher(final, world["teacher"], held_out)
    logged = read_eval_metrics(out)
    assert sorted(logged) == [DISTILL_STEPS // 2, DISTILL_STEPS]
    assert logged[DISTILL_STEPS]["val_kd_loss"] == pytest.approx(end, rel=1e-4)
    assert logged[DISTILL_STEPS]["val_kd_loss"] < logged[DISTILL_STEPS // 2]["val_kd_loss"]
    assert end < 0.5 * start, f"held-out KL to the teacher: {start:.3f} -> {end:.3f}"


KIND_BATCH = 3  # 9 trained tokens at step 1: 7 chunks of ceil(9 / 7) = 2 rows, the last one 1


@pytest.fixture(scope="module")
def step1_logits(world) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' student and teacher logits at the trained positions of step 1's batch."""
    batch = first_batch(world, KIND_BATCH)
    return trained_logits(world["student"], batch), trained_logits(world["teacher"], batch)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_its_definition_and_chunking_changes_nothing(
    world, step1_logits, tmp_path, kind
):
    common = [
        f"batch_size={KIND_BATCH}",
        "max_steps=3",
        f"loss.kind={kind}",
        "loss.temperature=2.0",
    ]
    whole = run_kd(world, tmp_path / "one-chunk", *common, "loss.num_chunks=1")
    chunked = run_kd(world, tmp_path / "seven-chunks", *common, "loss.num_chunks=7")

    logged_1, logged_7 = read_metrics(whole), read_metrics(chunked)
    student, teacher = step1_logits
    rows = logged_1[1]["trained_tokens_in_window"]
    assert rows == student.shape[0] and rows % math.ceil(rows / 7) != 0  # a short last chunk
    expected = reference_divergence(kind, student, teacher, temperature=2.0).mean().item()
    assert logged_1[1]["kd_loss"] == pytest.approx(expected, rel=1e-5), kind
    ce = torch.nn.functional.cross_entropy(
        student, _step1_targets(world, KIND_BATCH), reduction="mean"
    )
    assert logged_1[1]["ce_loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert logged_1[1]["loss"] == pytest.approx(0.5 * expected + 0.5 * ce.item(), rel=1e-5)

    assert sorted(logged_1) == sorted(logged_7) == [1, 2, 3]
    for step in logged_1:
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
            assert logged_7[step][key] == pytest.approx(logged_1[step][key], rel=1e-5), (
                f"{key} at step {step}"
            )
    weights_1 = final_weights(whole)
    assert_same_weights(final_weights(chunked), weights_1, 1e-5)
    assert largest_change(weights_1, checkpoint_weights(world["student"])) > 1e-3


def _step1_targets(world: dict[str, Path], batch_size: int) -> torch.Tensor:
    """The trained labels of step 1's batch, in the order of :func:`trained_logits`."""
    labels = torch.cat([torch.tensor(s["labels"]) for s in first_batch(world, batch_size)])
    return labels[labels != IGNORE_INDEX]


def test_kd_ratio_0_is_the_sft_recipe(world, tmp_path):
    common = ["batch_size=4", "max_steps=4"]
    kd = run_kd(world, tmp_path / "kd", *common, "kd_ratio=0.0")
    sft = run_recipe("sft", "tiny", world["student"], world["chat"], tmp_path / "sft", *common)
    logged_kd, logged_sft = read_metrics(kd), read_metrics(sft)
    assert sorted(logged_kd) == sorted(logged_sft) == [1, 2, 3, 4]
    for step in logged_kd:
        a, b = logged_kd[step], logged_sft[step]
        assert a["trained_tokens_in_window"] == b["trained_tokens_in_window"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"loss at step {step}"
        assert a["ce_loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), f"step {step}"
        assert a["kd_loss"] > 0.1  # computed (and logged), only weighted by 0
    assert_same_weights(final_weights(kd), final_weights(sft), 1e-5)


def padded_teacher(teacher_dir: Path, root: Path, extra_rows: int) -> Path:
    """The teacher of ``teacher_dir`` with ``extra_rows`` random rows appended to its embedding
    and head (``extra_rows < 0``: its last rows cut off), as Qwen2.5 0.5B and 7B share a
    tokenizer but pad their vocabularies differently."""
    teacher = from_hf(teacher_dir)
    spec = teacher.spec.replace(vocab_size=teacher.spec.vocab_size + extra_rows)
    padded = build_model(spec)
    state = teacher.state_dict()
    torch.manual_seed(2)
    for name, tensor in padded.state_dict().items():
        source = state[name]
        if source.shape != tensor.shape:  # embed_tokens / lm_head: keep the shared rows
            rows = min(source.shape[0], tensor.shape[0])
            source = torch.cat([source[:rows], torch.randn_like(tensor[rows:])])
        tensor.copy_(source)
    return save_hf_checkpoint(padded, root, source_dir=teacher_dir)


def test_a_teacher_with_a_padded_vocabulary_distils_over_the_tokenizer_ids(world, tmp_path):
    """A teacher whose head has 64 padding rows more than the student's gives exactly the
    losses of the same teacher without them: no token id reaches the padding rows, so both
    distributions are taken over the tokenizer's ids."""
    common = ["batch_size=4", "max_steps=2"]
    padded = padded_teacher(world["teacher"], tmp_path / "padded", 64)
    plain = read_metrics(run_kd(world, tmp_path / "plain", *common))
    wide = read_metrics(run_kd(world, tmp_path / "wide", *common, teacher=padded))
    for step in plain:
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
            assert wide[step][key] == pytest.approx(plain[step][key], rel=1e-6), (key, step)


def test_a_teacher_that_cannot_embed_the_tokenizer_ids_is_refused(world, tmp_path):
    teacher = padded_teacher(world["teacher"], tmp_path / "teacher", -11)
    rows = Tokenizer.from_pretrained(world["student"]).vocab_size
    out = tmp_path / "kd"
    message = (
        rf"student lm_head.weight has {rows} rows but teacher lm_head.weight has {rows - 11}, "
        rf"and the tokenizer has {rows} ids: distillation needs one tokenizer that both models"
    )
    with pytest.raises(ValueError, match=message):
        run_kd(world, out, "max_steps=1", teacher=teacher)
    assert not (out / "checkpoints").exists()


def test_a_bf16_teacher_runs(world, tmp_path):
    common = ["batch_size=4", "max_steps=2"]
    fp32 = read_metrics(run_kd(world, tmp_path / "fp32", *common))
    bf16 = read_metrics(run_kd(world, tmp_path / "bf16", *common, "teacher_model.dtype=bfloat16"))
    assert sorted(bf16) == [1, 2]
    for step in bf16:
        assert all(math.isfinite(bf16[step][k]) for k in ("loss", "kd_loss", "grad_norm"))
    # the teacher really ran in bf16 (its logits rounded), yet distils the same distribution
    assert bf16[1]["kd_loss"] != fp32[1]["kd_loss"]
    assert bf16[1]["kd_loss"] == pytest.approx(fp32[1]["kd_loss"], rel=3e-2)
    assert bf16[1]["ce_loss"] == fp32[1]["ce_loss"]  # the student is float32 in both


PER_RANK, FSDP_STEPS = 2, 3


def rank_token_counts(world: dict[str, Path], source: Path) -> list[tuple[int, int]]:
    """Per step, the trained tokens of each of two ranks' batches of PER_RANK samples: the
    sampler's one seeded permutation, dealt out to rank r as ``perm[r::2]``."""
    dataset = recipe_samples(world, source)
    perm = list(DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED, drop_last=True))
    counts = [sum(t != IGNORE_INDEX for t in dataset[i]["labels"]) for i in perm]
    ranks = [counts[r::2][: len(counts) // 2] for r in range(2)]
    return [
        tuple(sum(rank[s * PER_RANK : (s + 1) * PER_RANK]) for rank in ranks)
        for s in range(FSDP_STEPS)
    ]


@pytest.fixture(scope="module")
def fsdp_world(world, tmp_path_factory) -> tuple[Path, list[str], Path]:
    """Counting data (answers of different lengths: the ranks train different numbers of
    tokens, so only a global token mean, not a mean of the ranks' means, matches one process),
    the overrides both runs share, and the single-process run."""
    root = tmp_path_factory.mktemp("kd-fsdp")
    data = make_counting_data(root / "count.jsonl", rows=24)
    assert any(a != b for a, b in rank_token_counts(world, data))
    common = [f"dataset.source={data}", f"max_steps={FSDP_STEPS}"]
    single = run_kd(world, root / "single", f"batch_size={2 * PER_RANK}", *common)
    return data, common, single


def distributed_overrides(world, fsdp_world, out: Path) -> list[str]:
    """The CLI overrides of the two-rank run (PER_RANK samples a rank)."""
    data, common, _ = fsdp_world
    return recipe_overrides(
        world["student"],
        data,
        out,
        f"teacher_dir={world['teacher']}",
        *common,
        f"batch_size={PER_RANK}",
    )


def check_same_as_single(world, fsdp_world, out: Path) -> None:
    """Two-rank run ``out`` logged the single process's losses and ended with its weights."""
    data, _, single = fsdp_world
    state = checkpoints(out)[-1] / "training_state"
    assert sorted(p.name for p in state.glob("rank*.pt")) == ["rank0.pt", "rank1.pt"]
    logged_1, logged_2 = read_metrics(single), read_metrics(out)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, FSDP_STEPS + 1))
    tokens = rank_token_counts(world, data)
    for step in logged_1:
        one, two = logged_1[step], logged_2[step]
        tokens_in_window = (one["trained_tokens_in_window"], two["trained_tokens_in_window"])
        assert tokens_in_window == (sum(tokens[step - 1]),) * 2
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-5), f"{key} at step {step}"
    weights_1 = final_weights(single)
    assert_same_weights(final_weights(out), weights_1, 1e-5)
    assert largest_change(weights_1, checkpoint_weights(world["student"])) > 1e-3


def test_two_gloo_ranks_equal_one_process(world, fsdp_world, tmp_path):
    out = tmp_path / "fsdp"
    launch_ranks(distributed_overrides(world, fsdp_world, out), tmp_path, recipe="kd")
    check_same_as_single(world, fsdp_world, out)


@pytest.mark.slow
def test_cli_nproc_per_node_2_equals_one_process(world, fsdp_world, tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        cli_command(
            "run",
            "kd",
            "--config",
            "tiny",
            "--nproc-per-node",
            "2",
            *distributed_overrides(world, fsdp_world, out),
        ),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    check_same_as_single(world, fsdp_world, out)
