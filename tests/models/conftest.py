"""Generic helpers for model tests: tiny random transformers models and checkpoints.

Test modules under ``tests/models`` get them through the ``hf_tiny`` fixture (a namespace
of the functions below); nothing here downloads anything.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

HF_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "gemma2",
    "gemma3_text",
    "olmo2",
    "granite",
    "smollm3",
    "phi3",
    "glm4",
    "olmo3",
    "mixtral",
    "llama4_text",
    "deepseek_v3",
    "deepseek_v2",
    "gpt_oss",
    "glm4_moe",
)

_TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": None,
}
_FAMILY_TINY: dict[str, dict[str, Any]] = {
    "llama": {"head_dim": 16},
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # head_dim * heads != hidden_size, as in real Qwen3
    "qwen3_moe": {
        "head_dim": 16,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mistral": {"head_dim": 16, "sliding_window": None},
    # The features that set a family apart are on (windows shorter than the test rows).
    "gemma2": {"head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 20,
               "attn_logit_softcapping": 3.0, "final_logit_softcapping": 5.0},
    "gemma3_text": {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 4,
                    "query_pre_attn_scalar": 20, "rope_theta": 1000.0,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    "olmo2": {"head_dim": 16},
    "granite": {"head_dim": 16, "embedding_multiplier": 3.0, "residual_multiplier": 0.5,
                "attention_multiplier": 0.1, "logits_scaling": 4.0},
    "smollm3": {"head_dim": 16, "num_hidden_layers": 3, "no_rope_layer_interval": 2},
    "phi3": {"head_dim": 16, "partial_rotary_factor": 0.5, "sliding_window": 5,
             "original_max_position_embeddings": 8, "rope_scaling": {
                 "rope_type": "longrope", "long_factor": [1.0, 2.0, 4.0, 8.0],
                 "short_factor": [1.0, 1.0, 1.5, 2.0]}},
    "glm4": {"head_dim": 16},
    "olmo3": {"head_dim": 16, "num_hidden_layers": 4, "sliding_window": 4},
    # 5 experts of width 32, top-3, a window of 4 (tests/models/test_mixtral.py: odd sizes).
    "mixtral": {"head_dim": 16, "intermediate_size": 32, "num_local_experts": 5,
                "num_experts_per_tok": 3, "sliding_window": 4},
    # Multi-head latent attention (every head expands the latent: kv heads = heads), experts.
    "deepseek_v3": {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "n_routed_experts": 6, "num_experts_per_tok": 2, "n_group": 2,
                    "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "moe_intermediate_size": 32, "num_mtp_layers": 0},
    "deepseek_v2": {"num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 16,
                    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
                    "n_routed_experts": 5, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "moe_intermediate_size": 32},
    # Chunks of 3, NoPE every 3rd layer, MoE every 2nd (3 experts), a temperature that moves.
    "llama4_text": {"head_dim": 16, "num_hidden_layers": 3, "intermediate_size": 32,
                    "intermediate_size_mlp": 128, "num_local_experts": 3,
                    "interleave_moe_layer_step": 2, "no_rope_layer_interval": 3,
                    "attention_chunk_size": 3, "floor_scale": 2, "attn_scale": 0.5},
    # DeepSeek-V3 routing (6 experts in 2 groups, top-2) beside GQA with q/k/v biases, qk-norm
    # and a quarter of each head rotated; layer 0 dense.
    "glm4_moe": {"head_dim": 16, "partial_rotary_factor": 0.25, "attention_bias": True,
                 "use_qk_norm": True, "n_routed_experts": 6, "num_experts_per_tok": 2,
                 "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
                 "first_k_dense_replace": 1, "moe_intermediate_size": 32,
                 "routed_scaling_factor": 1.5, "num_mtp_layers": 0},
    # Sinks, biased experts (5, top-3) clamped at a limit the random weights reach, window 4.
    "gpt_oss": {"head_dim": 16, "intermediate_size": 32, "num_local_experts": 5,
                "num_experts_per_tok": 3, "sliding_window": 4, "swiglu_limit": 0.6},
}  # fmt: skip


def tiny_hf_config(model_type: str, **overrides: Any) -> transformers.PretrainedConfig:
    """A tiny transformers config of ``model_type`` (``HF_FAMILIES``), fields overridable."""
    kwargs = {**_TINY, **_FAMILY_TINY[model_type], **overrides}
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.1) -> torch.nn.Module:
    """Overwrite every parameter with seeded noise so that logits are O(1) and norms,
    biases and routers all matter (a fresh HF init has unit norms and zero biases)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(std * noise)
    return model


def tiny_hf_model(model_type: str, seed: int = 0, **overrides: Any) -> transformers.PreTrainedModel:
    """A randomly initialised fp32 transformers causal LM in eval mode (eager attention)."""
    config = tiny_hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, seed).eval()


def write_tiny_hf_checkpoint(
    folder: str | Path, model_type: str, seed: int = 0, **overrides: Any
) -> transformers.PreTrainedModel:
    """Save a :func:`tiny_hf_model` with ``save_pretrained`` into ``folder``; return the model."""
    model = tiny_hf_model(model_type, seed, **overrides)
    model.save_pretrained(folder)
    return model


def read_safetensors_folder(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of all ``*.safetensors`` files in ``folder`` (the on-disk HF keys)."""
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.fixture(scope="session")
def hf_tiny() -> SimpleNamespace:
    """The helpers above as one fixture: ``hf_tiny.model("qwen3", tie_word_embeddings=True)``."""
    return SimpleNamespace(
        families=HF_FAMILIES,
        config=tiny_hf_config,
        model=tiny_hf_model,
        randomize=randomize_,
        write_checkpoint=write_tiny_hf_checkpoint,
        read_safetensors=read_safetensors_folder,
    )
