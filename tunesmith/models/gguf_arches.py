"""How each family exported as GGUF maps onto a llama.cpp architecture (:data:`ARCHES`).

An :class:`Arch` says what llama.cpp's architecture computes, so that
:func:`unsupported` can name every setting of a model the file could not say (an exported
model that llama.cpp runs differently is refused, not written):

- ``llama`` (Llama, Mistral without a window, Mixtral) and ``granite`` rotate interleaved
  pairs (llama.cpp's "norm" RoPE): the q/k rows are reordered on export; the others rotate
  halves as Hugging Face does;
- ``phi3`` stores q/k/v fused (``attn_qkv``) and gate/up fused (``ffn_up``), and may rotate
  only part of each head;
- ``olmo2`` normalises after attention and after the MLP (no pre-norms), its q/k norms over
  the whole projection;
- ``granite`` scales the embeddings, the residual branches, the attention softmax and the
  logits (``granite.embedding_scale`` ...);
- ``gemma2``/``gemma3`` scale the embeddings by ``sqrt(hidden)`` and the attention by
  ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` at the 46/62 layers of their 27B), multiply
  by norm weights stored as ``1 + w`` and attend in a window on all but every 2nd (Gemma 2) or
  6th (Gemma 3, RoPE base 10000 there) layer; OLMo 3 is ``olmo2`` with a window on all but
  every 4th layer, a RoPE scaling (YaRN) on the global layers only;
- ``smollm3`` skips RoPE on every 4th layer; ``glm4`` rotates interleaved pairs of half of each
  head, as GLM-4 itself does;
- ``deepseek2`` (DeepSeek-V2/V3, Moonlight, Kimi K2) runs multi-head latent attention and
  ``glm4moe`` (GLM-4.5) grouped-query attention with q/k norms and half-rotary RoPE, both with
  DeepSeek's routing and shared experts after leading dense layers
  (:mod:`tunesmith.models.gguf_deepseek`);
- ``gpt-oss`` adds a learned sink logit per head to every softmax, attends in a window on every
  other layer (the first of each pair), routes by a softmax over the top-k router logits (with
  a bias) and runs experts with biases through SwiGLU clamped at 7 with ``alpha`` 1.702;
- ``llama4`` (Llama 4 text) attends in chunks of 8192 on RoPE layers, globally with a query
  temperature on every 4th (NoPE) layer, routes by sigmoid top-k beside a shared expert on every
  ``interleave_moe_layer_step``-th layer, all fixed as published
  (:mod:`tunesmith.models.gguf_llama4`).

Example::

    >>> ARCHES["phi3"].name, ARCHES["granite"].interleave_rope
    ('phi3', True)
    >>> from tunesmith.models.zoo import olmo2
    >>> unsupported(olmo2.spec("olmo2_tiny"), ARCHES["olmo2"])
    []
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tunesmith.models.gguf_deepseek import deepseek_unsupported
from tunesmith.models.gguf_llama4 import llama4_unsupported
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.gpt_oss_experts import ClampedExperts

__all__ = ["ARCHES", "Arch", "swa_layer_types", "unsupported"]


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture as a family's export writes it.

    Example::

        >>> Arch("qwen2").norm_layout
        'pre'
    """

    name: str  # llama.cpp's architecture (``general.architecture``)
    interleave_rope: bool = False  # llama.cpp rotates (x_2i, x_2i+1): q/k rows reordered
    fused: bool = False  # attn_qkv and ffn_up = gate|up, as llama.cpp's phi3 loads them
    partial_rotary: bool = False  # rope.dimension_count may be less than the head
    experts: bool = False  # every layer a softmax top-k mixture, weights renormalised
    scales: bool = False  # embedding / residual / attention / logit scales (granite)
    norm_layout: str = "pre"
    norm_style: str = "plain"
    qk_norm_per_head: bool = True
    output_always: bool = False  # write output.weight even when tied to token_embd
    rope_interleaved: bool = False  # the family's own RoPE rotates interleaved pairs (GLM-4)
    nope_every: int = 0  # llama.cpp skips RoPE on every n-th layer (SmolLM3: 4)
    swa_every: int = 0  # every n-th layer attends globally, the others in the window (Gemma)
    gemma: bool = False  # sqrt(hidden) embeddings, tanh GELU, 1/sqrt(d) attention, norms 1 + w
    softcaps: bool = False  # attention and final logits capped (Gemma 2), values in the file
    rope_local_theta: float | None = None  # the window layers' RoPE base (Gemma 3: 10000)
    big_layers: int = 0  # llama.cpp's "27B" by its layer count: attention 1/sqrt(hidden/heads)
    deepseek_routing: bool = False  # DeepSeek's routing, shared experts, leading dense layers
    mla: bool = False  # multi-head latent attention (llama.cpp's deepseek2)
    gpt_oss: bool = False  # attention sinks, clamped SwiGLU experts with biases (gpt-oss)
    plain_window_rope: bool = False  # a RoPE scaling on the global layers only (OLMo 3)
    llama4: bool = False  # chunked/NoPE layers, temperature, sigmoid routing fixed (Llama 4)


_GPT_OSS_EXPERTS = ClampedExperts(swiglu_alpha=1.702, swiglu_limit=7.0)  # llama.cpp's, fixed
_DEEPSEEK2 = Arch("deepseek2", experts=True, rope_interleaved=True, deepseek_routing=True, mla=True)

ARCHES = {
    "llama": Arch("llama", interleave_rope=True),
    "mistral": Arch("llama", interleave_rope=True),
    "mixtral": Arch("llama", interleave_rope=True, experts=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "qwen3_moe": Arch("qwen3moe", experts=True),
    "phi3": Arch("phi3", fused=True, partial_rotary=True, output_always=True),
    "olmo2": Arch("olmo2", norm_layout="post", norm_style="float_weight",
                  qk_norm_per_head=False, output_always=True),
    "olmo3": Arch("olmo2", norm_layout="post", norm_style="float_weight",
                  qk_norm_per_head=False, output_always=True, swa_every=4,
                  plain_window_rope=True),
    "granite": Arch("granite", interleave_rope=True, scales=True, output_always=True),
    "smollm3": Arch("smollm3", interleave_rope=True, nope_every=4, output_always=True),
    "gemma2": Arch("gemma2", norm_layout="sandwich", norm_style="unit_offset", swa_every=2,
                   gemma=True, softcaps=True, big_layers=46),
    "gemma3_text": Arch("gemma3", norm_layout="sandwich", norm_style="unit_offset", swa_every=6,
                        gemma=True, rope_local_theta=10000.0, big_layers=62),
    "glm4": Arch("glm4", fused=True, partial_rotary=True, norm_layout="sandwich_glm",
                 rope_interleaved=True, output_always=True),
    "glm4_moe": Arch("glm4moe", experts=True, partial_rotary=True, deepseek_routing=True),
    "gpt_oss": Arch("gpt-oss", experts=True, swa_every=2, gpt_oss=True),
    "deepseek_v2": _DEEPSEEK2,
    "deepseek_v3": _DEEPSEEK2,
    "kimi_k2": _DEEPSEEK2,  # read as deepseek_v3
    "llama4_text": Arch("llama4", experts=True, rope_interleaved=True, nope_every=4,
                        llama4=True),
}  # fmt: skip
"""Hugging Face ``model_type`` -> its llama.cpp architecture, for the families exported."""


def unsupported(spec: ModelSpec, arch: Arch) -> list[str]:
    """``"setting=value"`` for every setting of ``spec`` that llama.cpp's ``arch`` does not
    compute (empty when the file says the whole model).

    Example::

        >>> from tunesmith.models.zoo import qwen3
        >>> unsupported(qwen3.spec("qwen3_tiny", hidden_act="gelu"), ARCHES["qwen3"])
        ["hidden_act='gelu'"]
    """
    wanted = {
        "norm_layout": arch.norm_layout,
        "norm_style": arch.norm_style,
        "hidden_act": "silu",
        "rope_interleaved": arch.rope_interleaved,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "nope_layers": tuple(
            i
            for i in range(spec.num_hidden_layers)
            if arch.nope_every and (i + 1) % arch.nope_every == 0
        ),
        "mla": None,
        "moe_router": "softmax",
        "attention_sinks": False,
        "rope_local_theta": arch.rope_local_theta,
        "attention_multiplier": None,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "logits_scaling": 1.0,
    }
    if spec.qk_norm:
        wanted["qk_norm_per_head"] = arch.qk_norm_per_head
    if not arch.partial_rotary:
        wanted["partial_rotary_factor"] = 1.0
    if arch.gemma:  # llama.cpp's gemma2/gemma3: these fixed
        width = spec.hidden_size // spec.num_attention_heads
        scale = (width if spec.num_hidden_layers == arch.big_layers else spec.head_dim) ** -0.5
        wanted.update(hidden_act="gelu_pytorch_tanh", embedding_multiplier=spec.hidden_size**0.5,
                      attention_multiplier=scale, tie_word_embeddings=True)  # fmt: skip
    if arch.softcaps:  # their values are in the file
        del wanted["attn_logit_softcapping"], wanted["final_logit_softcapping"]
    if arch.swa_every:  # llama.cpp's fixed pattern, and a window it reads from the file
        wanted["layer_types"] = swa_layer_types(spec.num_hidden_layers, arch.swa_every)
    if arch.mla:  # llama.cpp's deepseek2: latent attention, DeepSeek routing
        del wanted["mla"]
    scaled = (spec.rope_scaling or {}).get("rope_type", "default") != "default"
    if arch.plain_window_rope and (scaled or spec.rope_local_theta is not None):
        wanted["rope_local_theta"] = spec.rope_theta  # window layers: plain RoPE, same base
    if arch.llama4:  # llama.cpp's llama4: sigmoid top-k scaling the experts' inputs
        wanted["moe_router"] = "llama4"
    if arch.gpt_oss:  # llama.cpp's gpt-oss: sinks on every layer
        wanted["attention_sinks"] = True
    if arch.scales:  # their values are in the file
        for key in ("attention_multiplier", "embedding_multiplier", "residual_multiplier",
                    "logits_scaling"):  # fmt: skip
            del wanted[key]
    found = [f"{key}={getattr(spec, key)!r}" for key, value in wanted.items()
             if not _same(getattr(spec, key), value)]  # fmt: skip
    if arch.deepseek_routing:
        found += deepseek_unsupported(spec, mla=arch.mla)
    if arch.llama4:
        found += llama4_unsupported(spec)
    if arch.gpt_oss and spec.clamped_experts != _GPT_OSS_EXPERTS:
        found.append(f"clamped_experts={spec.clamped_experts!r}")
    if arch.swa_every and spec.sliding_window is None:
        found.append("sliding_window=None")
    if arch.softcaps:  # llama.cpp's gemma2 always caps: a missing cap has no value to write
        caps = ("attn_logit_softcapping", "final_logit_softcapping")
        found += [f"{key}=None" for key in caps if getattr(spec, key) is None]
    return found


def _same(value: object, wanted: object) -> bool:
    """``value == wanted``, floats within rounding (``sqrt(hidden)`` written as a literal)."""
    if isinstance(value, float) and isinstance(wanted, float):
        return math.isclose(value, wanted, rel_tol=1e-6)
    return value == wanted


def swa_layer_types(layers: int, every: int) -> tuple[str, ...]:
    """llama.cpp's layer pattern for ``every``: the last of each ``every`` layers global.

    Example::

        >>> swa_layer_types(4, 2)
        ('sliding_attention', 'full_attention', 'sliding_attention', 'full_attention')
    """
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(layers))  # fmt: skip
