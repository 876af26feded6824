"""LoRA on Mixtral (attention and experts): our PEFT folder is the one peft writes for
transformers' Mixtral, peft loads it with equal logits, and our loader reads it back."""

from __future__ import annotations

import warnings

import peft
import pytest
import torch
from safetensors.torch import load_file

from tests.models.test_mixtral import hf_mixtral
from tests.peft.test_lora_experts import _randomise_adapters
from tunesmith.models import from_hf
from tunesmith.models.peft_io import load_peft_adapter, save_peft_adapter
from tunesmith.modules.peft import adapter_state_dict, apply_lora, disable_adapters

IDS = torch.tensor([[3, 17, 99, 5, 64, 8, 2, 41, 9], [7, 7, 120, 33, 1, 90, 12, 6, 18]])
MODEL = {"num_local_experts": 5, "num_experts_per_tok": 3, "sliding_window": 4,
         "num_hidden_layers": 2}  # fmt: skip


# Ours name the experts' projections as in memory; peft takes Mixtral's file names (w1 = gate,
# w3 = up, w2 = down) and maps them onto transformers' fused experts.
TARGETS = {
    "attention_and_experts": (["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                              ["q_proj", "v_proj", "w1", "w3", "w2"]),
    "down_only": (["down_proj"], ["w2"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(TARGETS))
def test_peft_folder_matches_peft_and_loads_in_peft_and_back(tmp_path, case):
    targets, peft_targets = TARGETS[case]
    hf_mixtral(seed=4, **MODEL).save_pretrained(tmp_path / "hf")
    ours = apply_lora(from_hf(tmp_path / "hf").eval(), target_modules=targets, rank=2, alpha=4)
    _randomise_adapters(ours, seed=5)
    folder = save_peft_adapter(ours, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets)
        reference = peft.get_peft_model(hf_mixtral(seed=4, **MODEL), config)
        want = {k: v.shape for k, v in peft.get_peft_model_state_dict(reference).items()}
        got = {k: v.shape for k, v in load_file(folder / "adapter_model.safetensors").items()}
        assert got == want
        loaded = peft.PeftModel.from_pretrained(hf_mixtral(seed=4, **MODEL), folder).eval()
    with torch.no_grad():
        expected = ours(IDS)
        with disable_adapters(ours):
            assert (expected - ours(IDS)).abs().max() > 1e-3  # the adapters do something
        torch.testing.assert_close(loaded(IDS).logits, expected, rtol=0, atol=2e-5)
        back = load_peft_adapter(from_hf(tmp_path / "hf").eval(), folder)
        mine, theirs = adapter_state_dict(ours), adapter_state_dict(back)
        assert sorted(mine) == sorted(theirs)
        for k, v in mine.items():
            torch.testing.assert_close(theirs[k], v, rtol=0, atol=0, msg=k)
