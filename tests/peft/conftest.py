"""Tiny Hugging Face checkpoints and helpers for the LoRA/DoRA/QLoRA tests (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models.conftest import write_tiny_hf_checkpoint

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
def qwen2_dir(tmp_path_factory) -> Path:
    """q/k/v biases: exercises the bias paths of LoRA and DoRA."""
    folder = tmp_path_factory.mktemp("qwen2")
    write_tiny_hf_checkpoint(folder, "qwen2", seed=4)
    return folder


@pytest.fixture(scope="session")
def qlora_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qlora_llama")
    write_tiny_hf_checkpoint(folder, "llama", seed=5, **QLORA_SIZES)
    return folder
