"""A tiny random transformers Qwen3-MoE for parity tests (ours vs transformers / peft).

Example::

    tiny_hf_qwen3_moe(seed=0).config.num_experts
    # -> 4
"""

from __future__ import annotations

import torch
import transformers


def tiny_hf_qwen3_moe(
    seed: int = 0, *, layers: int = 2, experts: int = 4, mlp_only_layers: tuple[int, ...] = ()
) -> transformers.PreTrainedModel:
    """A ``Qwen3MoeForCausalLM`` (hidden 64, experts of width 32, top-2, GQA 4/2) whose weights
    are drawn from ``seed`` (norm weights around 1, the rest small), in eval mode."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.1 * noise)
    return model.eval()
