"""LoRA, DoRA and QLoRA through the SFT recipe (the shipped `tiny_lora` config).

- A LoRA run trains only the adapters (every base weight stays bitwise the base model's), lowers
  the loss on its training set, and checkpoints a PEFT adapter folder a small fraction of the
  model's size that ``peft`` loads onto the transformers base with our trained model's logits;
  ``export_merged`` turns it into a plain HF folder with the same logits.
- FSDP2 on two gloo ranks == one process (LoRA, and QLoRA with NF4 bases sharded over ranks),
  also across a stop and resume.
- Stopping and resuming a LoRA run == the uninterrupted run (bitwise adapters, same logs).
- DoRA and QLoRA runs lower the loss and their checkpoints load back into the same model.
- The shipped LoRA/QLoRA configs for real models run end to end (bf16 base, fp32 adapters).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from torch import nn

from tests.recipes.sft_world import (
    checkpoints,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_recipe,
    run_sft,
    run_sft_keeping_model,
    sft_overrides,
)
from tunesmith.data import SFTDataset, Tokenizer, collate_padded
from tunesmith.models import from_hf, phi3
from tunesmith.models.base_record import BASE_RECORD
from tunesmith.models.export import export_merged
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, load_peft_adapter
from tunesmith.modules.peft import (
    adapter_modules,
    dequantize_nf4,
    disable_adapters,
    is_nf4,
    quantize_nf4,
)
from tunesmith.training.checkpoint.directory import MARKER

CONFIG = "tiny_lora"
ROWS, BATCH, STEPS = 24, 4, 8  # 6 steps an epoch: STEPS spans two epochs
RANK, TARGETS = 8, ("q_proj", "v_proj")  # what tiny_lora.yaml adapts
ATTENTION, MLP = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
COMPARED = ("loss", "lr", "grad_norm", "tokens_seen", "trained_tokens_in_window")
# NF4 bases shard over FSDP2 ranks when every quantised weight holds a multiple of
# 64 * 256 * world_size values (torchao splits whole scaler groups): 4 heads x 64, 2 KV heads.
FSDP_QLORA_SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return root, make_model_dir(root), make_counting_data(root / "count.jsonl", rows=ROWS)


@pytest.fixture(scope="module")
def lora_run(world) -> tuple[Path, nn.Module]:
    """An uninterrupted LoRA run: its output folder and the model it trained (in eval mode)."""
    root, model_dir, data = world
    out, model = run_sft_keeping_model(
        model_dir, data, root / "lora", f"batch_size={BATCH}", f"max_steps={STEPS}", config=CONFIG
    )
    return out, model.eval()


def _batch(model_dir: Path, data: Path) -> dict[str, torch.Tensor]:
    """Every training sample in one padded batch."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    samples = SFTDataset(tokenizer, source=str(data)).samples
    return collate_padded(samples, pad_id=tokenizer.pad_id)


def _probe_ids(model_dir: Path, data: Path) -> torch.Tensor:
    """Real conversations and random tokens, to compare logits on."""
    ids = _batch(model_dir, data)["input_ids"][:3]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    noise = torch.randint(0, vocab, (2, ids.shape[1]), generator=torch.Generator().manual_seed(0))
    return torch.cat([ids, noise])


@torch.no_grad()
def _dataset_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """Token-mean cross-entropy of ``model`` on the trained tokens of ``batch``."""
    logits = model(batch["input_ids"], position_ids=batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()


def _assert_loss_went_down(model: nn.Module, out: Path, batch: dict[str, torch.Tensor]) -> None:
    with disable_adapters(model):
        before = _dataset_loss(model, batch)
    after = _dataset_loss(model, batch)
    assert after < before - 0.1, f"training-set loss {before:.4f} -> {after:.4f}"
    logged = [record["loss"] for _, record in sorted(read_metrics(out).items())]
    assert sum(logged[-3:]) < sum(logged[:3]), logged


def _hf(folder: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _assert_same_logits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------- LoRA


def test_lora_run_trains_only_the_adapters_and_lowers_the_loss(world, lora_run):
    _, model_dir, data = world
    out, model = lora_run
    base = from_hf(model_dir).state_dict()
    trained = model.state_dict()
    for name, tensor in base.items():
        assert torch.equal(trained[name], tensor), f"base weight {name} changed"
    adapters = {k for k in trained if k not in base}
    layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    expected = {
        f"model.layers.{i}.self_attn.{t}.lora_{ab}.weight"
        for i in range(layers)
        for t in TARGETS
        for ab in "AB"
    }
    assert adapters == expected
    assert {n for n, p in model.named_parameters() if p.requires_grad} == expected
    for name in expected:
        if ".lora_B." in name:  # zero at the start: the run moved every one
            assert trained[name].abs().max() > 1e-4, name
    _assert_loss_went_down(model, out, _batch(model_dir, data))


def test_lora_checkpoint_is_a_peft_adapter_that_peft_and_export_load(world, lora_run, tmp_path):
    _, model_dir, data = world
    out, model = lora_run
    step_dir = checkpoints(out)[-1]
    assert step_dir.name == f"step_{STEPS:06d}"
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, BASE_RECORD, MARKER, "training_state"]
    )
    config = json.loads((step_dir / ADAPTER_CONFIG_NAME).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, 16)
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    assert config["base_model_name_or_path"] == str(model_dir)

    # Size: r * (in + out) values per adapted layer, a few percent of the model's file.
    hf_config = json.loads((model_dir / "config.json").read_text())
    hidden, head_dim = hf_config["hidden_size"], hf_config["head_dim"]
    outs = {"q_proj": hf_config["num_attention_heads"] * head_dim}
    outs["v_proj"] = hf_config["num_key_value_heads"] * head_dim
    numel = hf_config["num_hidden_layers"] * sum(RANK * (hidden + outs[t]) for t in TARGETS)
    tensors = load_file(step_dir / ADAPTER_WEIGHTS_NAME)
    assert sum(t.numel() for t in tensors.values()) == numel
    adapter_bytes = (step_dir / ADAPTER_WEIGHTS_NAME).stat().st_size
    assert adapter_bytes < 0.05 * (model_dir / "model.safetensors").stat().st_size

    ids = _probe_ids(model_dir, data)
    with torch.no_grad():
        ours = model(ids)
        theirs = peft.PeftModel.from_pretrained(_hf(model_dir), step_dir).eval()(ids).logits
        reloaded = load_peft_adapter(from_hf(model_dir), step_dir).eval()(ids)
    _assert_same_logits(theirs, ours, "peft base + adapter vs the trained model")
    _assert_same_logits(reloaded, ours, "from_hf + load_peft_adapter vs the trained model")

    merged_dir = export_merged(step_dir, tmp_path / "merged")  # base: adapter_config.json
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(
        merged_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info
    with torch.no_grad():
        _assert_same_logits(merged.eval()(ids).logits, ours, "merged export vs the trained model")


@pytest.mark.parametrize(
    ("case", "extra"),
    [
        pytest.param("lora", (), id="lora"),
        pytest.param(  # ~15-40 s: torchao in two more processes
            "qlora",
            ("model.quantize_base=nf4", "model.target_modules=all-linear"),
            id="qlora",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_two_gloo_ranks_equal_one_process(world, tmp_path, case, extra):
    _, model_dir, data = world
    if case == "qlora":
        model_dir = make_model_dir(tmp_path / "world", **FSDP_QLORA_SIZES)
    steps = 3
    single = run_sft(
        model_dir,
        data,
        tmp_path / "single",
        f"batch_size={BATCH}",
        f"max_steps={steps}",
        *extra,
        config=CONFIG,
    )
    fsdp = tmp_path / "fsdp"
    overrides = sft_overrides(
        model_dir, data, fsdp, f"batch_size={BATCH // 2}", f"max_steps={steps}", *extra
    )
    launch_ranks(overrides, tmp_path, config=CONFIG)
    _assert_two_ranks_match(fsdp, single, steps)


@pytest.mark.slow  # ~30-60 s: two launches of two ranks
def test_two_gloo_ranks_stop_and_resume_equal_one_process(world, lora_run, tmp_path):
    """Each rank reloads its shard of the adapters and of the optimizer state."""
    _, model_dir, data = world
    single, _ = lora_run
    fsdp = tmp_path / "fsdp"
    config = (f"batch_size={BATCH // 2}", f"max_steps={STEPS}")
    launch_ranks(
        sft_overrides(model_dir, data, fsdp, *config, "stop_after_steps=3"), tmp_path, config=CONFIG
    )
    assert [p.name for p in checkpoints(fsdp)] == ["step_000003"]
    launch_ranks(
        sft_overrides(model_dir, data, fsdp, *config, "resume=true"), tmp_path, config=CONFIG
    )
    _assert_two_ranks_match(fsdp, single, STEPS)


def _assert_two_ranks_match(fsdp: Path, single: Path, steps: int) -> None:
    """Same logged losses and grad norms, same adapter weights (up to reduction order)."""
    step_dir = checkpoints(fsdp)[-1]
    assert step_dir.name == f"step_{steps:06d}"
    assert (step_dir / ADAPTER_CONFIG_NAME).is_file()
    ranks = sorted(p.name for p in (step_dir / "training_state").glob("rank*.pt"))
    assert ranks == ["rank0.pt", "rank1.pt"]
    logged_1, logged_2 = read_metrics(single), read_metrics(fsdp)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, steps + 1))
    for step in logged_1:
        tokens = "trained_tokens_in_window"
        assert logged_1[step][tokens] == logged_2[step][tokens]
        assert logged_2[step]["loss"] == pytest.approx(logged_1[step]["loss"], rel=1e-5)
        assert logged_2[step]["grad_norm"] == pytest.approx(logged_1[step]["grad_norm"], rel=1e-5)
    weights_1, weights_2 = final_weights(single), final_weights(fsdp)
    assert weights_1.keys() == weights_2.keys()
    for name in weights_1:
        torch.testing.assert_close(
            weights_2[name], weights_1[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert min(w.abs().max().item() for n, w in weights_1.items() if ".lora_B." in n) > 1e-4


def test_stop_and_resume_equals_uninterrupted(world, lora_run, tmp_path):
    _, model_dir, data = world
    reference, _ = lora_run
    stop_at = 3
    out = tmp_path / "run"
    config = (f"batch_size={BATCH}", f"max_steps={STEPS}")
    run_sft(model_dir, data, out, *config, f"stop_after_steps={stop_at}", config=CONFIG)
    assert [p.name for p in checkpoints(out)] == [f"step_{stop_at:06d}"]
    run_sft(model_dir, data, out, *config, "resume=true", config=CONFIG)
    assert checkpoints(out)[-1].name == f"step_{STEPS:06d}"

    weights, expected = final_weights(out), final_weights(reference)
    assert weights.keys() == expected.keys()
    for name in weights:
        assert torch.equal(weights[name], expected[name]), (
            f"{name} differs after resuming by up to "
            f"{(weights[name] - expected[name]).abs().max().item():.3g}"
        )
    logged, logged_ref = read_metrics(out), read_metrics(reference)
    assert sorted(logged) == sorted(logged_ref) == list(range(1, STEPS + 1))
    for step in logged:
        for key in COMPARED:
            assert logged[step][key] == logged_ref[step][key], f"{key} at step {step}"


# ----------------------------------------------------------------------------- DoRA, QLoRA


@pytest.mark.parametrize(
    ("case", "extra"),
    [
        pytest.param("dora", ("model.use_dora=true",), id="dora"),
        pytest.param("qlora", ("model.quantize_base=nf4",), id="qlora"),
    ],
)
def test_dora_and_qlora_runs_lower_the_loss_and_load_back(world, tmp_path, case, extra):
    _, model_dir, data = world
    out, model = run_sft_keeping_model(
        model_dir,
        data,
        tmp_path / case,
        f"batch_size={BATCH}",
        f"max_steps={STEPS}",
        *extra,
        config=CONFIG,
    )
    model.eval()
    _assert_loss_went_down(model, out, _batch(model_dir, data))
    step_dir = checkpoints(out)[-1]
    config = json.loads((step_dir / ADAPTER_CONFIG_NAME).read_text())
    assert config["use_dora"] is (case == "dora")
    keys = load_file(step_dir / ADAPTER_WEIGHTS_NAME).keys()
    assert any(k.endswith(".lora_magnitude_vector") for k in keys) is (case == "dora")

    base = from_hf(model_dir)
    if case == "qlora":  # the base stays the NF4 quantisation of the original weights
        for name, module in adapter_modules(model).items():
            assert is_nf4(module.weight) and not module.weight.requires_grad
            original = base.get_submodule(name).weight
            assert torch.equal(
                dequantize_nf4(module.weight), dequantize_nf4(quantize_nf4(original))
            )
    quantize = "nf4" if case == "qlora" else False
    reloaded = load_peft_adapter(base, step_dir, quantize_base=quantize).eval()
    ids = _probe_ids(model_dir, data)
    with torch.no_grad():
        ours = model(ids)
        _assert_same_logits(reloaded(ids), ours, "from_hf + load_peft_adapter")
        if case == "dora":
            theirs = peft.PeftModel.from_pretrained(_hf(model_dir), step_dir).eval()(ids).logits
            _assert_same_logits(theirs, ours, "peft base + DoRA adapter")


# ----------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize(
    ("config", "rank", "alpha", "targets", "quantized"),
    [
        ("qwen3_0_6b_lora", 8, 16, ["k_proj", "o_proj", "q_proj", "v_proj"], False),
        ("llama3_2_1b_qlora", 16, 32, [*ATTENTION, *MLP], True),
    ],
)
def test_shipped_lora_configs_run_on_the_tiny_world(
    world, tmp_path, config, rank, alpha, targets, quantized
):
    """The real-model configs, pointed at the tiny model with a shorter packed length."""
    _, model_dir, data = world
    out, model = run_sft_keeping_model(
        model_dir,
        data,
        tmp_path / config,
        "max_steps=2",
        "dataset.max_seq_len=128",
        "val_fraction=0.0",
        "lr_scheduler.num_warmup_steps=1",
        config=config,
    )
    adapter_config = json.loads((checkpoints(out)[-1] / ADAPTER_CONFIG_NAME).read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (rank, alpha)
    assert sorted(adapter_config["target_modules"]) == sorted(targets)
    tensors = load_file(checkpoints(out)[-1] / ADAPTER_WEIGHTS_NAME)
    assert {t.dtype for t in tensors.values()} == {torch.float32}  # fp32 adapters
    for name, module in adapter_modules(model).items():
        assert is_nf4(module.weight) is quantized, name
        assert module.dense_weight().dtype == torch.bfloat16, name  # the frozen bf16 base
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert all(math.isfinite(r["loss"]) for r in read_metrics(out).values())


def test_lora_the_peft_format_cannot_hold_is_refused_before_training(world, tmp_path):
    """Phi-3's checkpoints fuse q, k and v: adapting q_proj and v_proj alone could never be
    saved as a PEFT adapter, so the run stops at setup, naming the fix, with nothing written."""
    root, _, data = world
    phi3_dir = make_model_dir(tmp_path / "phi3", family=phi3, rope_scaling=None)
    with pytest.raises(
        ValueError, match=r"q_proj and v_proj adapted without k_proj.*target_modules: \[qkv_proj\]"
    ):
        run_recipe("sft", "tiny_lora", phi3_dir, data, tmp_path / "out")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_shipped_phi4_mini_lora_config_runs_on_a_tiny_phi3(world, tmp_path):
    """phi4_mini_lora names Phi's fused qkv_proj: on a tiny Phi-3 (partial rotary, LongRoPE)
    it adapts q, k, v and o and saves the adapter in peft's fused layout."""
    _, _, data = world
    phi3_dir = make_model_dir(tmp_path / "phi3", family=phi3)
    out = run_sft(
        phi3_dir, data, tmp_path / "out", "max_steps=2", "dataset.max_seq_len=128",
        "val_fraction=0.0", "lr_scheduler.num_warmup_steps=1", config="phi4_mini_lora",
    )  # fmt: skip
    adapter_config = json.loads((checkpoints(out)[-1] / ADAPTER_CONFIG_NAME).read_text())
    assert sorted(adapter_config["target_modules"]) == ["o_proj", "qkv_proj"]
    assert all(math.isfinite(r["loss"]) for r in read_metrics(out).values())
