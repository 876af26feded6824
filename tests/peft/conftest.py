"""Tiny Hugging Face checkpoints and helpers for the LoRA/DoRA/QLoRA tests (no downloads)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models.conftest import HF_FAMILIES, write_tiny_hf_checkpoint

# The families whose adapters are plain linear layers; Qwen3-MoE's expert adapters (PEFT's
# fused ``target_parameters`` format) have their own tests in test_lora_experts.py, Mixtral's
# (peft names its experts' projections w1/w3/w2) in test_mixtral_lora.py, gpt-oss's (gate/up
# interleaved) in tests/models/test_gpt_oss.py, Llama 4's in tests/models/test_llama4.py,
# DeepSeek's (latent attention: no k_proj/v_proj) in test_lora_deepseek.py; which MoE MLP
# adapters peft drops (GLM-4.5's included, with its experts-only folders): test_peft_moe_targets.py.
MOE_FAMILIES = (
    "qwen3_moe", "mixtral", "gpt_oss", "llama4_text", "deepseek_v2", "deepseek_v3", "glm4_moe",
)  # fmt: skip
DENSE_FAMILIES = tuple(f for f in HF_FAMILIES if f not in MOE_FAMILIES)

# A family whose checkpoints fuse projections that tunesmith keeps apart (``Family.fused``:
# Phi-3's ``qkv_proj``, ``gate_up_proj``) has adapters on q/k/v and gate/up in memory, while
# peft adapts the fused modules; peft_io translates (tests/peft/test_peft_format.py).


def dense_family_params(*rest: object) -> list:
    """``pytest.param(family, *rest)`` for each of ``DENSE_FAMILIES``."""
    return [pytest.param(f, *rest) for f in DENSE_FAMILIES]


# Every weight of this shape set holds a multiple of 64 * 256 values, torchao's default NF4
# blocking (hidden 128, 4 heads x 32, no GQA, intermediate 256, vocab 128).
QLORA_SIZES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 32,
}


def token_batch(vocab: int = 128, batch: int = 2, seq: int = 10, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=gen)


@torch.no_grad()
def randomize_adapters_(params: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Give adapter tensors seeded non-trivial values: B non-zero (else LoRA is a no-op) and
    DoRA magnitudes away from the base norms. ``params``: name -> parameter."""
    gen = torch.Generator().manual_seed(seed)
    for name in sorted(params):
        p = params[name]
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype)
        if name.endswith("lora_magnitude_vector"):
            p.mul_(1.0 + 0.3 * noise)
        elif "lora_" in name:
            p.copy_(0.05 * noise)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    write_tiny_hf_checkpoint(folder, "llama", seed=3)
    return folder


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory) -> Callable[[str], Path]:
    """``family_dir("gemma2")``: the folder of a tiny checkpoint of that ``HF_FAMILIES`` family
    (tests/models/conftest.py's config), written once per session."""
    folders: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in folders:
            folders[family] = tmp_path_factory.mktemp(family)
            write_tiny_hf_checkpoint(folders[family], family, seed=4)
        return folders[family]

    return get


@pytest.fixture(scope="session")
def qwen2_dir(family_dir) -> Path:
    """q/k/v biases: exercises the bias paths of LoRA and DoRA."""
    return family_dir("qwen2")


@pytest.fixture(scope="session")
def qlora_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qlora_llama")
    write_tiny_hf_checkpoint(folder, "llama", seed=5, **QLORA_SIZES)
    return folder
