"""PEFT folders of MoE models that peft misreads: for each native MoE family, LoRA on its
dense / shared MLPs is lost by peft exactly when ``peft_misread_modules`` names them (peft's
logits are ours without those adapters), a warning says so at setup and when saving, and
experts-only adapters load in peft with our logits and no warning."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors import safe_open

from tests.models.conftest import randomize_
from tests.models.hf_deepseek import CASES as DEEPSEEK
from tests.models.hf_deepseek import hf_config, hf_model
from tests.models.hf_moe import tiny_hf_qwen3_moe
from tests.models.test_glm4_moe import CASES as GLM4_MOE
from tests.models.test_glm4_moe import hf_config as glm4_moe_config
from tests.models.test_mixtral import hf_mixtral
from tests.recipes.sft_world import make_chat_data, make_model_dir
from tunesmith.cli.main import main
from tunesmith.models import deepseek_v2, from_hf
from tunesmith.models.peft_io import ADAPTER_WEIGHTS_NAME, load_peft_adapter, save_peft_adapter
from tunesmith.modules.moe import ExpertLoRA
from tunesmith.modules.peft import (
    adapter_modules,
    adapter_state_dict,
    apply_lora,
    peft_misread_modules,
    trainable_parameters,
)

IDS = torch.tensor([[3, 17, 99, 5, 64, 8, 2, 41], [7, 7, 120, 33, 1, 90, 12, 6]])
ATOL = 1e-4
MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["experts.gate_proj", "experts.up_proj", "experts.down_proj"]


def _gpt_oss() -> transformers.PreTrainedModel:
    config = transformers.GptOssConfig(
        vocab_size=131, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, head_dim=16, sliding_window=4,
        num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
        pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    return _random(transformers.GptOssForCausalLM, config)


def _llama4() -> transformers.PreTrainedModel:
    config = transformers.Llama4TextConfig(
        vocab_size=128, hidden_size=48, intermediate_size=40, intermediate_size_mlp=80,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
        num_local_experts=3, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=4, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
        pad_token_id=None,
    )  # fmt: skip
    return _random(transformers.Llama4ForCausalLM, config)


def _random(cls, config) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    return randomize_(model, 0).eval()


def _deepseek(case: str) -> Callable[[], transformers.PreTrainedModel]:
    model_type, fields = DEEPSEEK[case]
    return lambda: hf_model(hf_config(model_type, **fields), seed=4).eval()


# family -> (a tiny transformers model, how many non-expert MLP projections it has: dense
# layers' and shared experts' gate/up/down).
FAMILIES: dict[str, tuple[Callable[[], transformers.PreTrainedModel], int]] = {
    "qwen3_moe": (lambda: tiny_hf_qwen3_moe(seed=4, layers=2, mlp_only_layers=(0,)), 3),
    "deepseek_v2": (_deepseek("v2_greedy_bias"), 3 * 3),  # 1 dense layer, 2 with shared experts
    "deepseek_v3": (_deepseek("v3_qlora_interleave_groups"), 3 * 3),
    "mixtral": (lambda: hf_mixtral(seed=4, num_hidden_layers=2, num_local_experts=3), 0),
    "gpt_oss": (_gpt_oss, 0),
    "llama4_text": (_llama4, 2 * 3),  # 1 dense layer, 1 with a shared expert
    "glm4_moe": (  # 1 dense layer, 2 with shared experts
        lambda: hf_model(glm4_moe_config(**GLM4_MOE["groups_top2_qknorm"]), seed=4).eval(),
        3 * 3,
    ),
}
# The families whose folders peft misreads with those adapters (measured below).
MISREAD = {"qwen3_moe", "deepseek_v2", "deepseek_v3", "glm4_moe"}


def _adapted(folder: Path, targets: list[str], seed: int = 5) -> torch.nn.Module:
    ours = apply_lora(from_hf(folder).eval(), target_modules=targets, rank=2, alpha=4)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_parameters(ours).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return ours


def _peft_logits(make: Callable[[], transformers.PreTrainedModel], adapter: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(make(), adapter).eval()
    with torch.no_grad():
        return loaded(input_ids=IDS).logits


def _without(model: torch.nn.Module, names: list[str]) -> torch.Tensor:
    """``model``'s logits with the adapters of ``names`` zeroed (then restored)."""
    layers = adapter_modules(model)
    saved = {n: layers[n].lora_B.weight.clone() for n in names}
    with torch.no_grad():
        for n in names:
            layers[n].lora_B.weight.zero_()
        logits = model(IDS)
        for n in names:
            layers[n].lora_B.weight.copy_(saved[n])
    return logits


def _non_expert_mlps(model: torch.nn.Module) -> list[str]:
    return [
        n
        for n, m in adapter_modules(model).items()
        if not isinstance(m, ExpertLoRA) and n.rpartition(".")[2] in MLP
    ]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_peft_drops_dense_and_shared_mlp_adapters_iff_flagged(tmp_path, caplog, family):
    make, n_mlps = FAMILIES[family]
    make().save_pretrained(tmp_path / "hf")
    with caplog.at_level(logging.WARNING, logger="tunesmith"):
        ours = _adapted(tmp_path / "hf", ["o_proj", *MLP])
    assert ours.spec.model_type == family
    assert len(_non_expert_mlps(ours)) == n_mlps  # the adapters at stake exist
    flagged = peft_misread_modules(ours)
    assert sorted(flagged) == (sorted(_non_expert_mlps(ours)) if family in MISREAD else [])
    warned = [r.getMessage() for r in caplog.records if "peft would drop" in r.getMessage()]
    assert len(warned) == bool(flagged)  # one line: how many, the first names, what to do
    if flagged:
        assert warned[0].startswith(f"peft would drop {n_mlps} LoRA adapters of this {family} ")
        assert f"({', '.join(flagged[:3])}" in warned[0]  # the first few names
        assert "experts.gate_proj" in warned[0] and "`tunesmith export`" in warned[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tunesmith"):
        adapter = save_peft_adapter(ours, tmp_path / "adapter")
    assert any("peft would drop" in r.getMessage() for r in caplog.records) == bool(flagged)
    with safe_open(adapter / ADAPTER_WEIGHTS_NAME, "pt") as f:
        note = (f.metadata() or {}).get("tunesmith_peft_note", "")
    assert (flagged[0] in note) if flagged else note == ""

    theirs = _peft_logits(make, adapter)
    with torch.no_grad():
        expected = ours(IDS)
    lost = (theirs - expected).abs().max()
    assert (lost > 100 * ATOL) == bool(flagged), (family, float(lost))
    torch.testing.assert_close(theirs, _without(ours, flagged), rtol=0, atol=ATOL)
    if flagged:  # the dropped adapters mattered; tunesmith reads the folder exactly
        assert (_without(ours, flagged) - expected).abs().max() > 100 * ATOL
        back = load_peft_adapter(from_hf(tmp_path / "hf").eval(), adapter)
        for key, value in adapter_state_dict(ours).items():
            assert torch.equal(adapter_state_dict(back)[key], value), key


@pytest.mark.parametrize("family", sorted(MISREAD))
def test_experts_only_targets_load_in_peft_without_a_warning(tmp_path, caplog, family):
    make, _ = FAMILIES[family]
    make().save_pretrained(tmp_path / "hf")
    with caplog.at_level(logging.WARNING, logger="tunesmith"):
        ours = _adapted(tmp_path / "hf", ["o_proj", *EXPERTS])
        adapter = save_peft_adapter(ours, tmp_path / "adapter")
    assert peft_misread_modules(ours) == [] and _non_expert_mlps(ours) == []
    assert not any("peft would drop" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        expected = ours(IDS)
    torch.testing.assert_close(_peft_logits(make, adapter), expected, rtol=0, atol=ATOL)


def test_validate_names_the_adapters_peft_would_drop(tmp_path, capsys):
    """The shipped DeepSeek-V2-Lite LoRA config (experts only) validates without a warning;
    with the MLPs targeted by leaf name, validate prints one line naming the dense layer's and
    the shared experts' projections (deepseek_v2_tiny: layer 0 dense, layer 1 MoE)."""
    model_dir = make_model_dir(tmp_path, family=deepseek_v2)
    data = make_chat_data(tmp_path / "chats.jsonl", rows=4)
    fills = [f"model_dir={model_dir}", f"dataset.source={data}"]
    assert main(["validate", "sft/deepseek_v2_lite_lora", *fills]) == 0
    assert "peft would drop" not in capsys.readouterr().out
    mlps = "model.target_modules=[q_proj,gate_proj,up_proj,down_proj]"
    assert main(["validate", "sft/deepseek_v2_lite_lora", *fills, mlps]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if "peft would drop" in x]
    assert len(lines) == 1
    assert lines[0].startswith("  model: warning: peft would drop 6 LoRA adapters ")
    assert "(model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj, " in lines[0]
