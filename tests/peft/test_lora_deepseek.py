"""LoRA on DeepSeek-V3 (multi-head latent attention's projections, routed and shared experts):
PEFT folders that peft loads onto transformers' model with our logits, and back."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

from tests.models.hf_deepseek import CASES, hf_config, hf_model
from tunesmith.models import from_hf
from tunesmith.models.peft_io import load_peft_adapter, save_peft_adapter
from tunesmith.modules.peft import (
    adapter_state_dict,
    apply_lora,
    disable_adapters,
    trainable_parameters,
)

MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# Routed experts only: peft (transformers 5) turns every gate/up/down_proj target of a MoE
# model into the fused experts' target_parameters, so it cannot adapt the shared experts or
# the dense layers' MLPs by those names.
EXPERTS = ["experts.gate_proj", "experts.up_proj", "experts.down_proj"]
IDS = torch.tensor([[3, 17, 99, 5, 64, 8, 2, 41], [7, 7, 120, 33, 1, 90, 12, 6]])


def _hf(case: str, seed: int = 4):
    model_type, fields = CASES[case]
    return hf_model(hf_config(model_type, **fields), seed=seed)


@pytest.mark.parametrize(
    ("case", "targets"),
    [
        ("v3_qlora_interleave_groups", MLA + EXPERTS),
        ("v3_plain_q_yarn_top1", ["q_proj", "kv_b_proj"]),
    ],
    ids=["low_rank_q_and_experts", "plain_q"],
)
def test_peft_folder_loads_in_peft_with_equal_logits_and_back(tmp_path, case, targets):
    _hf(case).save_pretrained(tmp_path / "hf")
    ours = apply_lora(from_hf(tmp_path / "hf").eval(), target_modules=targets, rank=2, alpha=4)
    names = set(trainable_parameters(ours))
    if "q_a_proj" in targets:  # every MLA projection and both kinds of expert are adapted
        for part in [*MLA, "experts.lora.gate_proj", "experts.lora.down_proj"]:
            assert any(part in n for n in names), part
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in trainable_parameters(ours).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    folder = save_peft_adapter(ours, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft.get_peft_model(
            _hf(case), peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets)
        )
        want = {k: v.shape for k, v in peft.get_peft_model_state_dict(reference).items()}
        got = {k: v.shape for k, v in load_file(folder / "adapter_model.safetensors").items()}
        assert got == want
        loaded = peft.PeftModel.from_pretrained(_hf(case), folder).eval()
    with torch.no_grad():
        expected = ours(IDS)
        with disable_adapters(ours):
            assert (expected - ours(IDS)).abs().max() > 1e-3  # the adapters do something
        torch.testing.assert_close(loaded(IDS).logits, expected, rtol=0, atol=1e-4)
        back = load_peft_adapter(from_hf(tmp_path / "hf").eval(), folder)
        for k, v in adapter_state_dict(ours).items():
            torch.testing.assert_close(adapter_state_dict(back)[k], v, rtol=0, atol=0, msg=k)


def test_all_linear_takes_mla_projections_not_the_router():
    from tunesmith.models import deepseek_v3

    model = apply_lora(deepseek_v3.deepseek_v3_tiny(), target_modules="all-linear", rank=2, alpha=4)
    names = set(trainable_parameters(model))
    for part in MLA:
        assert any(f"self_attn.{part}." in n for n in names), part
    assert not any("mlp.gate." in n for n in names)
