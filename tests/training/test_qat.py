"""Quantization-aware training (issue #37): fake quantization computes exactly what torchao's
quantized model computes, LoRA's frozen base is rounded while its adapters are not, a delayed
start trains its first steps as plain training does and resumes exactly, and the export of a
QAT run (full or LoRA) is a torchao-quantized folder transformers loads whose logits are the
fake-quantized model's.

Tolerances: fake-quantized == quantized in one process, exactly (the same torchao kernels);
transformers' model of the exported folder against ours fake-quantized: 1e-4 (two
implementations of the same float32 maths).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from tests.recipes.sft_world import (
    checkpoints,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_sft,
)
from tunesmith.cli.main import main
from tunesmith.config import ConfigError
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.export import export_merged
from tunesmith.models.hf import from_hf
from tunesmith.modules.fake_quant import (
    QAT_SCHEMES,
    fake_quant_enabled,
    prepare_fake_quant,
    quantize,
)
from tunesmith.modules.peft import DoRALinear, LoRALinear
from tunesmith.training.qat import QATSettings

QAT = "quantization={qat: {scheme: int8da-int4w, group_size: 32, fake_quant_after_n_steps: %d}}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("qat")
    return {"model": make_model_dir(root), "data": make_counting_data(root / "d.jsonl", rows=16)}


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


IDS = torch.arange(40).reshape(2, 20) * 7 % 200


@pytest.mark.parametrize("scheme", QAT_SCHEMES)
def test_fake_quantized_model_computes_what_the_quantized_model_computes(scheme):
    torch.manual_seed(0)
    plain = build_model(qwen2_5.spec("qwen2_5_tiny"))
    faked = prepare_fake_quant(copy.deepcopy(plain), scheme, 32)
    real = quantize(copy.deepcopy(plain), scheme, 32)
    assert type(faked.lm_head) is nn.Linear and type(real.lm_head.weight) is nn.Parameter
    torch.testing.assert_close(_logits(faked, IDS), _logits(real, IDS), rtol=0, atol=0)
    assert (_logits(faked, IDS) - _logits(plain, IDS)).abs().max() > 1e-4  # rounding is on


def test_lora_rounds_its_frozen_base_and_not_its_adapters():
    from torchao.quantization.qat import FakeQuantizedLinear

    torch.manual_seed(0)
    base = nn.Linear(64, 16)
    layer = LoRALinear.from_linear(copy.deepcopy(base), rank=4, alpha=8)
    nn.init.normal_(layer.lora_B.weight)
    model = prepare_fake_quant(nn.ModuleDict({"proj": layer}), "int8da-int4w", 32)
    x = torch.randn(3, 64)
    reference = prepare_fake_quant(nn.Sequential(copy.deepcopy(base)), "int8da-int4w", 32)[0]
    assert isinstance(reference, FakeQuantizedLinear)
    expected = reference(x) + layer.scaling * layer.lora_B(layer.lora_A(x))
    torch.testing.assert_close(model["proj"](x), expected, rtol=0, atol=1e-6)
    assert fake_quant_enabled(model)


def test_what_qat_cannot_do_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"quantization\.qat\.scheme: must be one of int8da"):
        QATSettings.from_config({"quantization": {"qat": {"scheme": "int3"}}})
    with pytest.raises(ConfigError, match=r"quantization\.qat\.group: unknown key"):
        QATSettings.from_config({"quantization": {"qat": {"group": 32}}})
    dora = nn.ModuleDict({"proj": DoRALinear(64, 8, rank=2, alpha=2)})
    with pytest.raises(ValueError, match="QAT on DoRALinear proj"):
        prepare_fake_quant(dora, "int4w", 32)
    with pytest.raises(ValueError, match="group_size 48 does not divide the 64 inputs of 0"):
        prepare_fake_quant(nn.Sequential(nn.Linear(64, 8)), "int4w", 48)


def test_delayed_start_trains_like_plain_training_then_rounds_and_resumes_exactly(world, tmp_path):
    steps = ["max_steps=3", "batch_size=4", "save_every_n_steps=1"]
    plain = read_metrics(run_sft(world["model"], world["data"], tmp_path / "plain", *steps))
    qat = run_sft(world["model"], world["data"], tmp_path / "qat", *steps, QAT % 1)
    losses = read_metrics(qat)
    assert losses[1]["loss"] == plain[1]["loss"]  # step 1: no rounding yet
    assert abs(losses[2]["loss"] - plain[2]["loss"]) > 1e-6  # from step 2 on: rounded
    stopped = tmp_path / "resumed"
    run_sft(world["model"], world["data"], stopped, *steps, QAT % 1, "stop_after_steps=1")
    run_sft(world["model"], world["data"], stopped, *steps, QAT % 1, "resume=true")
    resumed = read_metrics(stopped)
    assert [resumed[s]["loss"] for s in (2, 3)] == [losses[s]["loss"] for s in (2, 3)]


@pytest.mark.parametrize("config", ["tiny", "tiny_lora"])
def test_export_of_a_qat_run_is_the_fake_quantized_model(world, tmp_path, config):
    run = run_sft(
        world["model"], world["data"], tmp_path / "run", "max_steps=3", "batch_size=4",
        QAT % 0, "optimizer.lr=1e-3", config=config,
    )  # fmt: skip
    step = checkpoints(run)[-1]
    assert (step / "adapter_config.json").is_file() == (config == "tiny_lora")  # PEFT folder
    out = tmp_path / "quantized"
    assert main(["export", str(run), "--output-dir", str(out), "--quantize", "int8da-int4w"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    merged = from_hf(export_merged(step, tmp_path / "merged"), dtype=torch.float32)
    faked = prepare_fake_quant(copy.deepcopy(merged), "int8da-int4w", 32)
    torch.testing.assert_close(_logits(theirs, IDS), _logits(faked, IDS), rtol=0, atol=1e-4)
    assert (_logits(theirs, IDS) - _logits(merged, IDS)).abs().max() > 1e-3  # quantized
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("add 3 and 4")["input_ids"]
    ours = from_hf(out)  # generate/chat/eval's loader: transformers' model of the folder
    torch.testing.assert_close(_logits(ours, IDS), _logits(theirs, IDS), rtol=0, atol=0)
    if config == "tiny":
        with pytest.raises(ValueError, match="is a quantized checkpoint, which cannot be trained"):
            run_sft(out, world["data"], tmp_path / "again", "max_steps=1")
