"""The on-policy distillation (GKD) recipe end to end on a tiny student and a teacher trained
for a few SFT steps on the same data (so its distributions are sharp and differ from the
student's):

- ``lmbda=0`` (no on-policy step, no ``seq_kd``) is the ``kd`` recipe: the same rows, the same
  losses and the same weights, bit for bit;
- with ``lmbda=1`` the logged step-1 ``kd_loss`` is the generalised JSD (written out below, at
  a temperature) of transformers' student and teacher logits on the completions the student
  sampled, and the rows train exactly those completion tokens after the dataset's prompts;
- ``seq_kd``: the off-policy steps' completions are the teacher's keyed samples;
- gradient accumulation == the big batch; stop + resume == the uninterrupted run, bitwise, on a
  run that mixes on-policy and dataset steps;
- a teacher with another tokenizer is refused before anything is built, both named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.recipes.sft_world import (
    assert_resumed_as_uninterrupted,
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    final_weights,
    largest_change,
    make_counting_data,
    make_model_dir,
    noise_tolerance,
    read_metrics,
    recipe_config,
    run_config,
    run_recipe,
)
from tunesmith.config import instantiate
from tunesmith.data import Tokenizer
from tunesmith.generation.config import GenerationConfig
from tunesmith.models import build_model, from_hf, llama3
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.rl.on_policy_distillation import (
    GKDSettings,
    OnPolicyDistillationSource,
    on_policy_step,
    split_sample,
)
from tunesmith.training import setup
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.settings import LoopSettings

TEACHER_SIZE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8}
STEPS, BATCH = 4, 4
FAST = ["generation.max_new_tokens=6", "optimizer.lr=1e-2"]
ONE = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Student, teacher (SFT-trained, bigger), counting data (answers of different lengths)."""
    root = tmp_path_factory.mktemp("gkd")
    data = make_counting_data(root / "count.jsonl", rows=24)
    sft = run_recipe(
        "sft",
        "tiny",
        make_model_dir(root / "teacher-init", seed=1, **TEACHER_SIZE),
        data,
        root / "teacher-sft",
        "max_steps=12",
        "batch_size=8",
        "optimizer.lr=1e-2",
        "metric_loggers=[]",
    )
    return {
        "student": make_model_dir(root / "student"),
        "teacher": checkpoints(sft)[-1],
        "data": data,
    }


def gkd_config(world, out: Path, *overrides: str, config: str = "tiny"):
    return recipe_config(
        "gkd", config, world["student"], world["data"], out,
        f"teacher_dir={world['teacher']}", *FAST, *overrides,
    )  # fmt: skip


def run_gkd(world, out: Path, *overrides: str) -> Path:
    run_config("gkd", gkd_config(world, out, *overrides))
    return out


# -- lmbda = 0 is the kd recipe ----------------------------------------------------------------


def test_lmbda_0_is_the_kd_recipe(world, tmp_path):
    loss = ["loss.kind=js", "loss.js_beta=0.3", "loss.temperature=2.0", "kd_ratio=0.7"]
    common = [f"max_steps={STEPS}", f"batch_size={BATCH}", "optimizer.lr=1e-2", *loss]
    gkd = read_metrics(run_gkd(world, tmp_path / "gkd", "lmbda=0.0", *common))
    kd_out = run_recipe(
        "kd", "tiny", world["student"], world["data"], tmp_path / "kd",
        f"teacher_dir={world['teacher']}", *common,
    )  # fmt: skip
    kd = read_metrics(kd_out)
    assert sorted(gkd) == sorted(kd) == list(range(1, STEPS + 1))
    for step in kd:
        for key in ("loss", "kd_loss", "ce_loss", "grad_norm", "trained_tokens_in_window"):
            assert gkd[step][key] == kd[step][key], f"{key} at step {step}"
        assert gkd[step]["on_policy"] == 0.0 and gkd[step]["generate_s"] == 0.0
        tokens = kd[step]["trained_tokens_in_window"]
        assert gkd[step]["completion_length"] == pytest.approx(tokens / BATCH)
    assert len({kd[s]["trained_tokens_in_window"] for s in kd}) > 1  # answers differ in length
    assert_same_weights(final_weights(tmp_path / "gkd"), final_weights(kd_out), 0.0)
    assert largest_change(final_weights(kd_out), checkpoint_weights(world["student"])) > 1e-3


# -- lmbda = 1: the divergence on the student's own completions --------------------------------


def step1_source(
    world, cfg, student: Path, teacher: Path | None = None, **settings
) -> tuple[OnPolicyDistillationSource, list]:
    """The source a one-process run of ``cfg`` builds with ``student``'s and ``teacher``'s
    models (folders), and the dataset samples it draws."""
    tokenizer = Tokenizer.from_pretrained(world["student"])
    dataset = instantiate(cfg.dataset, tokenizer)
    dataset, _, collate = setup.sft_batches(cfg, dataset, None, tokenizer)
    source = OnPolicyDistillationSource.build(
        dataset, collate, LoopSettings.from_config(cfg), ONE,
        student=from_hf(student), teacher=teacher and from_hf(teacher), tokenizer=tokenizer,
        settings=GKDSettings(**settings), generation=GenerationConfig(**cfg.generation),
    )  # fmt: skip
    return source, dataset


def hf_logits(folder: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' float64 logits of ``folder`` at the trained positions of ``batch``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return logits[batch["labels"] != IGNORE_INDEX].double()


def generalised_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float, t: float):
    """GKD's eq. 1 per row at temperature ``t`` (times t²): ``β KL(T||M) + (1-β) KL(S||M)``,
    ``M = β T + (1-β) S``."""
    p_s, p_t = torch.softmax(student / t, -1), torch.softmax(teacher / t, -1)
    m = beta * p_t + (1 - beta) * p_s
    kl_tm = (p_t * (p_t.log() - m.log())).sum(-1)
    kl_sm = (p_s * (p_s.log() - m.log())).sum(-1)
    return (beta * kl_tm + (1 - beta) * kl_sm) * t**2


def test_lmbda_1_step_1_loss_is_the_divergence_on_the_sampled_rows(world, tmp_path):
    overrides = ["lmbda=1.0", "max_steps=1", "batch_size=3", "loss.js_beta=0.3",
                 "loss.temperature=2.0"]  # fmt: skip
    out = run_gkd(world, tmp_path / "gkd", *overrides)
    logged = read_metrics(out)[1]
    cfg = gkd_config(world, tmp_path / "unused", *overrides)
    source, dataset = step1_source(world, cfg, world["student"], lmbda=1.0)
    (batch,) = source.next_step()
    order = list(source.data.sampler)[:3]  # the step's samples, in order

    sampled = 0
    for row, index in enumerate(order):  # prompt = the dataset's, labels = completion only
        prompt, _ = split_sample(dataset[index], index)
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        trained = [t for t, label in enumerate(labels) if label != IGNORE_INDEX]
        assert ids[: len(prompt)] == prompt
        assert trained == list(range(len(prompt) - 1, len(prompt) - 1 + len(trained)))
        assert [labels[t] for t in trained] == ids[len(prompt) : len(prompt) + len(trained)]
        sampled += len(trained)
    assert logged["on_policy"] == 1.0 and logged["completion_length"] == sampled / 3
    assert logged["trained_tokens_in_window"] == sampled

    student, teacher = hf_logits(world["student"], batch), hf_logits(world["teacher"], batch)
    expected = generalised_jsd(student, teacher, beta=0.3, t=2.0).mean().item()
    assert expected > 0.05  # the teacher is far from the student
    assert logged["kd_loss"] == pytest.approx(expected, rel=1e-5)
    assert logged["loss"] == pytest.approx(logged["kd_loss"], rel=1e-6)  # kd_ratio 1: KD alone


def test_seq_kd_trains_on_the_teachers_keyed_samples(world, tmp_path):
    """Off-policy with seq_kd, the rows are those the teacher samples when it is the one
    answering on-policy (same keys), not the dataset's."""
    cfg = gkd_config(world, tmp_path / "unused", "batch_size=3")
    student, teacher = world["student"], world["teacher"]
    seq_kd, _ = step1_source(world, cfg, student, teacher, lmbda=0.0, seq_kd=True)
    teacher_answers, _ = step1_source(world, cfg, teacher, lmbda=1.0)
    dataset_rows, _ = step1_source(world, cfg, student, lmbda=0.0)
    (rows,), (expected,), (plain,) = (
        s.next_step() for s in (seq_kd, teacher_answers, dataset_rows)
    )
    assert seq_kd.step_metrics()["on_policy"] == 0.0 and seq_kd.step_metrics()["generate_s"] > 0
    for key in ("input_ids", "labels", "attention_mask", "position_ids"):
        assert torch.equal(rows[key], expected[key]), key
    assert rows["labels"].shape != plain["labels"].shape or not torch.equal(
        rows["labels"], plain["labels"]
    )


# -- accumulation, resume ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(world, tmp_path_factory) -> Path:
    """lmbda=0.5 over STEPS steps: on-policy and dataset steps both happen (the draw is keyed by
    the seed and the step)."""
    draws = [on_policy_step(0, s, 0.5) for s in range(STEPS)]
    assert True in draws and False in draws
    out = tmp_path_factory.mktemp("gkd-uninterrupted")
    return run_gkd(world, out, f"max_steps={STEPS}", f"batch_size={BATCH}")


def test_accumulation_equals_the_big_batch(world, uninterrupted, tmp_path):
    out = run_gkd(
        world, tmp_path / "accum", f"max_steps={STEPS}", f"batch_size={BATCH // 2}",
        "gradient_accumulation_steps=2",
    )  # fmt: skip
    big, accum = read_metrics(uninterrupted), read_metrics(out)
    assert [big[s]["on_policy"] for s in big] == [
        float(on_policy_step(0, s, 0.5)) for s in range(STEPS)
    ]
    for step in big:
        for key in ("on_policy", "completion_length", "trained_tokens_in_window"):
            assert accum[step][key] == big[step][key], f"{key} at step {step}"
        for key in ("loss", "kd_loss", "grad_norm"):
            assert accum[step][key] == pytest.approx(big[step][key], rel=1e-5), (key, step)
    assert_same_weights(final_weights(out), final_weights(uninterrupted), noise_tolerance(1e-5))
    assert largest_change(final_weights(out), checkpoint_weights(world["student"])) > 1e-3


def test_stop_and_resume_equals_the_uninterrupted_run(world, uninterrupted, tmp_path):
    common = [f"max_steps={STEPS}", f"batch_size={BATCH}"]
    out = run_gkd(world, tmp_path / "resumed", *common, "stop_after_steps=2")
    assert [p.name for p in checkpoints(out)] == ["step_000002"]
    run_gkd(world, out, *common, "resume=true")
    assert_resumed_as_uninterrupted(out, uninterrupted, steps=STEPS)
    logged, expected = read_metrics(out), read_metrics(uninterrupted)
    for step in range(1, STEPS + 1):
        for key in ("on_policy", "completion_length", "kd_loss"):
            assert logged[step][key] == expected[step][key], f"{key} at step {step}"


# -- one tokenizer -------------------------------------------------------------------------------


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(world, tmp_path):
    tokenizer_dir = make_tokenizer_folder(tmp_path / "llama-tokenizer", "llama3")
    theirs = Tokenizer.from_pretrained(tokenizer_dir)
    spec = llama3.spec("llama3_tiny", vocab_size=theirs.vocab_size)
    teacher = save_hf_checkpoint(build_model(spec), tmp_path / "teacher", source_dir=tokenizer_dir)
    mine = Tokenizer.from_pretrained(world["student"])
    out = tmp_path / "gkd"
    cfg = recipe_config(
        "gkd", "tiny", world["student"], world["data"], out, f"teacher_dir={teacher}",
        "max_steps=1",
    )  # fmt: skip
    with pytest.raises(ValueError) as refused:
        run_config("gkd", cfg)
    message = str(refused.value)
    assert f"the student's tokenizer {mine.name} ({mine.vocab_size} ids)" in message, message
    assert f"the teacher's tokenizer {teacher} ({theirs.vocab_size} ids)" in message, message
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
