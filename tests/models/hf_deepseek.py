"""Tiny random transformers DeepSeek-V3 / V2 models on odd configs, for parity tests (ours vs
transformers / peft): ``hf_model(hf_config(model_type, **fields))`` for ``CASES[name]``."""

from __future__ import annotations

import torch
import transformers

VOCAB = 131
BASE = {
    "vocab_size": VOCAB, "hidden_size": 40, "intermediate_size": 56, "moe_intermediate_size": 20,
    "num_hidden_layers": 3, "num_attention_heads": 5, "num_key_value_heads": 5,
    "max_position_embeddings": 256, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
    "v_head_dim": 10, "kv_lora_rank": 16, "bos_token_id": 1, "eos_token_id": None,
    "pad_token_id": 0, "tie_word_embeddings": False,
}  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 32}  # fmt: skip
CASES = {
    # Low-rank query, interleaved RoPE, 6 experts in 3 groups (2 kept), top-3, layer 0 dense.
    "v3_qlora_interleave_groups": ("deepseek_v3", {
        "q_lora_rank": 24, "rope_interleave": True, "n_routed_experts": 6,
        "num_experts_per_tok": 3, "n_group": 3, "topk_group": 2, "n_shared_experts": 2,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    # Plain q_proj, rotate-half RoPE with YaRN (mscale_all_dim on the softmax scale), 5 experts,
    # top-1, no dense layer, weights not renormalised.
    "v3_plain_q_yarn_top1": ("deepseek_v3", {
        "q_lora_rank": None, "rope_interleave": False, "n_routed_experts": 5,
        "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
        "first_k_dense_replace": 0, "routed_scaling_factor": 1.7, "norm_topk_prob": False,
        "rope_parameters": YARN}),
    # DeepSeek-V2: softmax greedy top-2 over 7 experts, biases on attention and MLPs.
    "v2_greedy_bias": ("deepseek_v2", {
        "q_lora_rank": None, "n_routed_experts": 7, "num_experts_per_tok": 2,
        "topk_method": "greedy", "n_shared_experts": 2, "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.3, "attention_bias": True, "mlp_bias": True}),
    # DeepSeek-V2: group-limited greedy (6 experts in 3 groups, 1 kept), low-rank query.
    "v2_group_limited": ("deepseek_v2", {
        "q_lora_rank": 24, "n_routed_experts": 6, "num_experts_per_tok": 2,
        "topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1,
        "n_shared_experts": 1, "first_k_dense_replace": 2, "routed_scaling_factor": 1.0}),
}  # fmt: skip


def hf_config(model_type: str, **fields) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(model_type, **{**BASE, "num_mtp_layers": 0, **fields})


def hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """An fp32 eager transformers model with seeded weights (norms near 1) and, for V3, a
    random ``e_score_correction_bias`` (zero after init; it must matter)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.2 * noise)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model.eval()
