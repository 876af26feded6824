"""GGUF export of DeepSeek-V2/V3 (and Moonlight, Kimi K2) as llama.cpp's ``deepseek2``, and of
DeepSeek's routing as llama.cpp's ``deepseek2`` and ``glm4moe`` (GLM-4.5) read it.

llama.cpp runs multi-head latent attention as multi-query attention over the cached latent:
one KV "head" of ``kv_lora_rank + qk_rope_head_dim`` (``key_length``) whose values are the
latent (``value_length`` ``kv_lora_rank``), the per-head widths under ``key_length_mla``
(``qk_nope_head_dim + qk_rope_head_dim``) and ``value_length_mla`` (``v_head_dim``).
``kv_b_proj`` is stored split (:func:`split_kv_b`): ``attn_k_b`` ``[heads, kv_lora_rank,
qk_nope_head_dim]`` (the key half, transposed so that llama.cpp multiplies the query into the
latent) and ``attn_v_b`` ``[heads, v_head_dim, kv_lora_rank]``. RoPE rotates interleaved pairs
of the last ``qk_rope_head_dim`` features, as DeepSeek itself does: rows are written as they are.

The MoE layers follow ``leading_dense_block_count`` dense ones: softmax (V2) or sigmoid (V3)
gating (``expert_gating_func``), top-k within the best ``expert_group_used_count`` of
``expert_group_count`` groups (V3: a group's two best biased scores summed, the bias stored as
``exp_probs_b``), weights renormalised (``expert_weights_norm``, V3 only: V2's router never
renormalises) and scaled (``expert_weights_scale``), ``expert_shared_count`` shared experts
beside them (``ffn_*_shexp``). V2's ``group_limited_greedy`` over several groups ranks groups by
their best expert, which llama.cpp does not compute: it is refused. DeepSeek's YaRN is written
with ``yarn_log_multiplier`` ``0.1 * mscale_all_dim`` (:func:`deepseek_yarn`).

Example::

    >>> import torch
    >>> from tunesmith.modules.mla import MLAConfig
    >>> k_b, v_b = split_kv_b(torch.zeros(2 * (3 + 4), 5), MLAConfig(None, 5, 3, 2, 4), heads=2)
    >>> tuple(k_b.shape), tuple(v_b.shape)
    ((2, 5, 3), (2, 4, 5))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tunesmith.models.spec import ModelSpec
from tunesmith.modules.mla import MLAConfig

__all__ = [
    "deepseek_unsupported",
    "deepseek_yarn",
    "split_kv_b",
    "write_mla",
    "write_routing",
]


def split_kv_b(weight: torch.Tensor, mla: MLAConfig, heads: int) -> tuple[torch.Tensor, ...]:
    """``kv_b_proj.weight`` ``[heads * (nope + v), kv_lora_rank]`` -> llama.cpp's ``attn_k_b``
    ``[heads, kv_lora_rank, nope]`` and ``attn_v_b`` ``[heads, v, kv_lora_rank]``."""
    per_head = weight.reshape(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    k_b, v_b = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def deepseek_unsupported(spec: ModelSpec, *, mla: bool) -> list[str]:
    """``"setting=value"`` for every setting of a DeepSeek-routed model (DeepSeek-V2/V3 with
    ``mla``, GLM-4.5 without) that llama.cpp's ``deepseek2``/``glm4moe`` compute otherwise
    (empty when they compute this model); RoPE's layout is checked with the other families'
    settings (:func:`tunesmith.models.gguf_arches.unsupported`).

    Example::

        >>> from tunesmith.models.zoo import deepseek_v3
        >>> deepseek_unsupported(deepseek_v3.spec("deepseek_v3_tiny"), mla=True)
        []
        >>> spec = deepseek_v3.spec("deepseek_v3_tiny", attention_bias=True)
        >>> deepseek_unsupported(spec, mla=True)
        ['attention_bias=True']
    """
    routing = spec.moe_routing
    found = []
    if mla and spec.attention_bias:  # llama.cpp's deepseek2 loads no attention biases
        found.append("attention_bias=True")
    if routing is None:
        found.append("moe_routing=None")
    elif routing.method == "group_limited_greedy" and routing.n_group > 1:
        found.append(f"topk_method='group_limited_greedy' with n_group={routing.n_group}")
    dense = len(spec.mlp_only_layers)
    if spec.mlp_only_layers != tuple(range(dense)) or spec.decoder_sparse_step != 1:
        found.append(f"mlp_only_layers={spec.mlp_only_layers!r}")
    return found


def write_routing(writer: Any, spec: ModelSpec) -> None:
    """llama.cpp's keys of DeepSeek's routing, shared experts and leading dense layers."""
    import gguf

    routing = spec.moe_routing
    assert routing is not None  # checked by deepseek_unsupported
    writer.add_leading_dense_block_count(len(spec.mlp_only_layers))
    writer.add_expert_shared_count(routing.n_shared_experts)
    writer.add_expert_weights_scale(routing.routed_scaling_factor)
    writer.add_expert_weights_norm(spec.norm_topk_prob and routing.method == "noaux_tc")
    gating = gguf.ExpertGatingFuncType
    sigmoid = routing.method == "noaux_tc"
    writer.add_expert_gating_func(gating.SIGMOID if sigmoid else gating.SOFTMAX)
    writer.add_expert_group_count(routing.n_group)
    writer.add_expert_group_used_count(routing.topk_group)


def write_mla(writer: Any, spec: ModelSpec) -> None:
    """llama.cpp's ``deepseek2`` attention keys: one KV head of the cached latent and the
    rotary key, the per-head widths, the ranks, DeepSeek's YaRN softmax factor."""
    mla = spec.mla
    assert mla is not None
    writer.add_head_count_kv(1)
    writer.add_key_length(mla.kv_lora_rank + mla.qk_rope_head_dim)
    writer.add_value_length(mla.kv_lora_rank)
    writer.add_key_length_mla(mla.qk_head_dim)
    writer.add_value_length_mla(mla.v_head_dim)
    writer.add_q_lora_rank(mla.q_lora_rank or 0)
    writer.add_kv_lora_rank(mla.kv_lora_rank)
    if (spec.rope_scaling or {}).get("rope_type") == "yarn":  # the softmax's YaRN factor
        writer.add_rope_scaling_yarn_log_mul(0.1 * spec.rope_scaling["mscale_all_dim"])


def deepseek_yarn(scaling: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek's YaRN ``scaling`` as llama.cpp's deepseek2 computes it (then checked as any
    YaRN): ``mscale_all_dim`` scales the softmax (``yarn_log_multiplier``) and ``mscale`` equal
    to it leaves the rotated features unscaled; other values raise :class:`ValueError`.

    Example::

        >>> deepseek_yarn({"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
        ...                "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096})
        {'rope_type': 'yarn', 'factor': 40.0, 'original_max_position_embeddings': 4096}
    """
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale is None or mscale != mscale_all_dim or "attention_factor" in scaling:
        raise ValueError(
            f"llama.cpp's deepseek2 computes YaRN with mscale == mscale_all_dim and no "
            f"attention_factor; this one has mscale={mscale!r}, mscale_all_dim="
            f"{mscale_all_dim!r}, attention_factor={scaling.get('attention_factor')!r}"
        )
    return {k: v for k, v in scaling.items() if k not in ("mscale", "mscale_all_dim")}
