"""GGUF export: a Hugging Face folder of a native family -> one ``.gguf`` file that llama.cpp,
Ollama and transformers (``from_pretrained(folder, gguf_file=...)``) load.

``tunesmith export RUN_OR_FOLDER --output-dir DIR --format gguf --outtype f16`` calls
:func:`export_gguf` (an adapter is merged into its base first). The file holds:

- the model's hyperparameters under llama.cpp's keys for its architecture (:data:`GGUF_ARCHES`,
  from :data:`tunesmith.models.gguf_arches.ARCHES`: Llama and Mistral are llama.cpp's
  ``llama``, Qwen2/2.5 ``qwen2``, Qwen3 ``qwen3``, Qwen3-MoE ``qwen3moe`` and Mixtral ``llama``
  with their experts stacked ``[experts, ...]`` as llama.cpp keeps them, Phi-3 ``phi3`` (q/k/v
  and gate/up fused, LongRoPE as ``rope_factors_long``/``rope_factors_short``), Gemma 2/3
  ``gemma2``/``gemma3`` (norms stored ``1 + w``, the window, softcaps, Gemma 3's linear RoPE
  scaling), OLMo 2/3 ``olmo2`` (OLMo 3's YaRN on its global layers), Granite ``granite``,
  SmolLM3 ``smollm3``, GLM-4 ``glm4``, GLM-4.5 ``glm4moe``, DeepSeek-V2/V3 (Moonlight, Kimi K2)
  ``deepseek2`` (latent attention and DeepSeek's routing: :mod:`tunesmith.models.gguf_deepseek`),
  gpt-oss ``gpt-oss`` (sinks, experts with biases, kept f32 as llama.cpp adds them)), Llama 4
  text ``llama4`` (chunked attention, NoPE layers, interleaved MoE layers:
  :mod:`tunesmith.models.gguf_llama4`); a setting
  llama.cpp's architecture does not compute, or any other family, is refused by name;
- every weight under llama.cpp's tensor names (the ``gguf`` package's own name map), 2-D
  weights in ``outtype`` (``f32``, ``f16``, ``bf16`` or ``q8_0``: blocks of 32 int8 values
  with one f16 scale; a weight whose rows are not a multiple of 32 stays f16, as llama.cpp
  does), norms and biases in f32. For ``llama``, ``granite`` and ``smollm3`` the q/k rows of
  each head are reordered from the Hugging Face rotate-half layout to llama.cpp's interleaved
  pairs (transformers' GGUF loader undoes it for ``llama``); Llama 3's RoPE scaling is written
  as llama.cpp's ``rope_freqs`` factors;
- the byte-level BPE tokenizer: every token with its type (normal, control for special added
  tokens, user-defined for other added tokens, unused for the rows past the tokenizer's
  vocabulary), the merges, the special token ids, ``add_bos_token`` and the folder's chat
  template; its pre-tokenizer is named from the ``tokenizer.json`` split pattern
  (:data:`PRE_TOKENIZERS`), another pattern is refused rather than guessed;
- or a sentencepiece-style tokenizer (BPE with ``byte_fallback``, ``<0xNN>`` byte pieces, spaces
  as "▁": Gemma's, Llama 2's) as llama.cpp's ``llama`` (SPM) vocabulary from ``tokenizer.json``
  alone: pieces scored by their merges' rank, byte/unknown/control types, ``add_space_prefix`` from
  the normalizer; merges or a normalizer llama.cpp would tokenise differently are refused.

The file is written next to its final name and renamed into place (atomic).

Example::

    >>> from tunesmith.models import build_model, qwen3
    >>> from tunesmith.models.hf import save_hf_checkpoint
    >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")
    >>> GGUF_ARCHES["qwen3"], sorted(OUTTYPES)
    ('qwen3', ['bf16', 'f16', 'f32', 'q8_0'])

With a tokenizer in the folder (``export_gguf`` refuses a folder without one)::

    export_gguf("Qwen3-tiny", "out/Qwen3-tiny-F16.gguf", outtype="f16")
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tunesmith.models.family import family_for
from tunesmith.models.fused_keys import fuse_state
from tunesmith.models.gguf_arches import ARCHES, Arch, unsupported
from tunesmith.models.gguf_deepseek import deepseek_yarn, split_kv_b, write_mla, write_routing
from tunesmith.models.gguf_llama4 import write_llama4
from tunesmith.models.hf import from_hf, read_hf_config
from tunesmith.models.safetensors_io import CheckpointFileNotFoundError
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.moe import stacked_state
from tunesmith.modules.rope import rope_inv_freq

__all__ = ["GGUF_ARCHES", "OUTTYPES", "PRE_TOKENIZERS", "GGUFExportError", "export_gguf"]

GGUF_ARCHES = {model_type: arch.name for model_type, arch in ARCHES.items()}
"""Hugging Face ``model_type`` -> llama.cpp architecture, for the families exported."""

OutType = Literal["f32", "f16", "bf16", "q8_0"]
OUTTYPES: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0")

PRE_TOKENIZERS = {  # llama.cpp's name of a byte-level BPE pre-tokenizer <- its split pattern
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "gpt-4o": (  # tiktoken's o200k_base (Phi-4-mini)
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
_ROPE_SCALINGS = {("llama", "llama3"), ("llama4", "llama3"), ("gemma3", "linear"),
                  ("phi3", "longrope"), ("qwen2", "yarn"), ("qwen3", "yarn"), ("qwen3moe", "yarn"),
                  ("deepseek2", "yarn"), ("gpt-oss", "yarn"), ("olmo2", "yarn")}  # fmt: skip
"""``(llama.cpp architecture, rope_type)`` written: Llama 3's and Llama 4 Scout's as
``rope_freqs``, Gemma 3's linear factor (llama.cpp applies it to the global layers only, as
Gemma 3 does), Phi-3's LongRoPE as ``rope_factors_long``/``rope_factors_short`` with its
attention factor, Qwen's, gpt-oss's and OLMo 2/3's YaRN (OLMo 3: on its global layers only, as
llama.cpp computes it) as its factor, original context and betas (llama.cpp derives YaRN's
attention factor ``0.1 ln(factor) + 1`` itself: another one is refused), DeepSeek's with its
softmax factor (:func:`~tunesmith.models.gguf_deepseek.deepseek_yarn`)."""
_YARN_KEYS = {"rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
_Q8_BLOCK = 32  # values per q8_0 block
_STACKED_EXPERTS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


class GGUFExportError(ValueError):
    """A model or tokenizer GGUF export cannot write faithfully; the message names why."""


def export_gguf(
    model_dir: str | os.PathLike, out_file: str | os.PathLike, *, outtype: OutType = "f16"
) -> Path:
    """Write the HF folder ``model_dir`` (a native family of :data:`GGUF_ARCHES`, with its
    tokenizer) as the GGUF file ``out_file`` in ``outtype``; returns ``out_file``.

    Example::

        export_gguf("out/merged", "out/model-Q8_0.gguf", outtype="q8_0")
    """
    import gguf

    folder, out = Path(model_dir), Path(out_file)
    if outtype not in OUTTYPES:
        raise GGUFExportError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    model_type = read_hf_config(folder).get("model_type")
    if model_type not in GGUF_ARCHES:
        raise GGUFExportError(
            f"{folder / 'config.json'}: GGUF export supports model_type "
            f"{', '.join(sorted(GGUF_ARCHES))}; {model_type!r} is not supported yet"
        )
    arch = ARCHES[model_type]
    model = from_hf(folder, dtype=torch.float32, backend="native")
    spec: ModelSpec = model.spec
    _check_supported(spec, arch)
    with stacked_state(model):  # experts as [experts, ...] tensors, as llama.cpp stores them
        state = model.state_dict()
    if arch.fused:  # attn_qkv, ffn_up = gate|up: the family's own fused checkpoint keys
        state = fuse_state(state, family_for(model_type).fused)
    vocab = _Vocab.read(folder, spec.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    partial.unlink(missing_ok=True)  # a leftover, or a link planted there: never written through
    writer = gguf.GGUFWriter(partial, arch.name)
    try:
        _write_hyperparameters(writer, spec, arch, name=folder.resolve().name, outtype=outtype)
        vocab.write(writer, folder)
        for name, array, qtype in _tensors(state, spec, arch, outtype):
            writer.add_tensor(name, array, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, out)
    finally:
        writer.close()
        partial.unlink(missing_ok=True)
    return out


# -- hyperparameters ---------------------------------------------------------------------------


def _write_hyperparameters(writer: Any, spec: ModelSpec, arch: Arch, *, name: str, outtype: str):
    import gguf

    writer.add_name(name)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_hidden_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_attention_heads)
    if arch.mla:  # llama.cpp: one KV head of the cached latent and the rotary key
        write_mla(writer, spec)
    else:
        writer.add_head_count_kv(spec.num_key_value_heads)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.rotary_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    if spec.num_experts:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.num_experts_per_tok)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    if arch.deepseek_routing:
        write_routing(writer, spec)
    if arch.llama4:
        write_llama4(writer, spec)
    if arch.scales:  # granite: llama.cpp divides the logits by its logit_scale
        writer.add_embedding_scale(spec.embedding_multiplier)
        writer.add_residual_scale(spec.residual_multiplier)
        writer.add_attention_scale(spec.attention_multiplier or spec.head_dim**-0.5)
        writer.add_logit_scale(spec.logits_scaling)
    if arch.softcaps:
        writer.add_attn_logit_softcapping(spec.attn_logit_softcapping or 0.0)
        writer.add_final_logit_softcapping(spec.final_logit_softcapping or 0.0)
    if arch.swa_every and spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    if (spec.rope_scaling or {}).get("rope_type") == "longrope":
        _, attention_factor = rope_inv_freq(spec.rotary_dim, spec.rope_theta, spec.rope_scaling)
        writer.add_rope_scaling_attn_factors(attention_factor)
        writer.add_rope_scaling_orig_ctx_len(spec.rope_scaling["original_max_position_embeddings"])
    if (spec.rope_scaling or {}).get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(spec.rope_scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(spec.rope_scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(float(spec.rope_scaling.get("beta_fast") or 32))
        writer.add_rope_scaling_yarn_beta_slow(float(spec.rope_scaling.get("beta_slow") or 1))
    if (spec.rope_scaling or {}).get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scaling["factor"])
    writer.add_file_type(
        {
            "f32": gguf.LlamaFileType.ALL_F32,
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        }[outtype]
    )


def _check_yarn(scaling: Mapping[str, Any]) -> None:
    """Refuse a YaRN llama.cpp would compute otherwise: its own attention factor, truncated
    correction range, no ``mscale`` pair."""
    default = 0.1 * math.log(scaling["factor"]) + 1.0
    factor = scaling.get("attention_factor")
    truncated = {"truncate"} if scaling.get("truncate", True) is True else set()
    other = sorted(set(scaling) - _YARN_KEYS - {"attention_factor"} - truncated)
    if other or (factor is not None and not math.isclose(factor, default, rel_tol=1e-6)):
        raise GGUFExportError(
            f"GGUF export of this YaRN ({dict(scaling)}): llama.cpp computes attention_factor "
            f"{default:.6g} itself and reads no {other or 'other factor'}"
        )


def _family_yarn(spec: ModelSpec, arch: Arch) -> Mapping[str, Any]:
    """The YaRN of ``spec`` as llama.cpp's ``arch`` reads it (DeepSeek's ``mscale`` pair
    removed, refused when llama.cpp computes it otherwise)."""
    if not arch.mla:
        return spec.rope_scaling
    try:
        return deepseek_yarn(spec.rope_scaling)
    except ValueError as error:
        raise GGUFExportError(f"GGUF export of this YaRN: {error}") from None


def _check_supported(spec: ModelSpec, arch: Arch) -> None:
    """Refuse what the GGUF file could not say, naming the setting."""
    scaling = (spec.rope_scaling or {}).get("rope_type")
    if scaling not in (None, "default") and (arch.name, scaling) not in _ROPE_SCALINGS:
        raise GGUFExportError(f"GGUF export of rope_scaling {scaling!r} is not supported yet")
    if scaling == "yarn":
        _check_yarn(_family_yarn(spec, arch))
    windowed = (
        spec.sliding_window is not None and spec.sliding_window < spec.max_position_embeddings
    )
    if windowed and not arch.swa_every:
        raise GGUFExportError(
            f"sliding_window {spec.sliding_window} (< max_position_embeddings "
            f"{spec.max_position_embeddings}): llama.cpp's {arch.name} attends to the whole "
            "context, so the exported model would not be this one"
        )
    # llama.cpp's qwen3moe, and its llama with experts (Mixtral): every layer sparse, softmax
    # top-k weights renormalised
    # gpt-oss's softmax over the top-k logits is a renormalised top-k softmax
    if spec.num_experts and not (arch.deepseek_routing or arch.gpt_oss or arch.llama4):
        moe = {"norm_topk_prob": spec.norm_topk_prob, "mlp_only_layers": spec.mlp_only_layers,
               "decoder_sparse_step": spec.decoder_sparse_step}  # fmt: skip
        if not arch.experts or moe != {
            "norm_topk_prob": True,
            "mlp_only_layers": (),
            "decoder_sparse_step": 1,
        }:
            raise GGUFExportError(
                f"GGUF export of this mixture of experts ({moe}) is not supported: llama.cpp's "
                "qwen3moe and llama (Mixtral) need every layer sparse with renormalised top-k "
                "weights"
            )
    settings = unsupported(spec, arch)
    if settings:
        raise GGUFExportError(
            f"GGUF export of this {spec.model_type} model: llama.cpp's {arch.name} does not "
            f"compute {', '.join(settings)}"
        )


# -- tensors -----------------------------------------------------------------------------------


def _tensors(
    state: Mapping[str, torch.Tensor], spec: ModelSpec, arch: Arch, outtype: str
) -> Iterator[tuple[str, np.ndarray, Any]]:
    """``(llama.cpp name, data, its GGML type)`` of every weight to write."""
    import gguf

    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch.name]
    names = gguf.get_tensor_name_map(model_arch, spec.num_hidden_layers)
    if spec.tie_word_embeddings and arch.output_always and "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    for key, tensor in state.items():
        if key == "lm_head.weight" and spec.tie_word_embeddings and not arch.output_always:
            continue  # tied: llama.cpp (and transformers' reader) use token_embd
        if key.endswith("rotary_emb.inv_freq"):
            continue
        stem, suffix = _stem_and_suffix(key)
        if arch.mla and stem.endswith("self_attn.kv_b_proj"):  # attn_k_b and attn_v_b
            parts = split_kv_b(tensor.detach().float(), spec.mla, spec.num_attention_heads)
            for part, data in zip(("k_b_proj", "v_b_proj"), parts, strict=True):
                target = names.get_name(stem.replace("kv_b_proj", part))
                yield (f"{target}.{suffix}", *_encode(data.numpy(), outtype))
            continue
        target = names.get_name(stem)
        if target is None:
            raise GGUFExportError(f"GGUF export: no llama.cpp name for tensor {key}")
        data = tensor.detach().float()
        if arch.norm_style == "unit_offset" and "norm" in stem:
            data = data + 1.0  # llama.cpp multiplies by the stored weight: store 1 + w
        if arch.interleave_rope and stem.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = spec.num_attention_heads if "q_proj" in stem else spec.num_key_value_heads
            data = interleave_rope_rows(data, heads)
        kind = "f32" if suffix == "bias" else outtype  # experts' [E, width] biases too
        yield (f"{target}.{suffix}", *_encode(data.numpy(), kind))
    scaling = spec.rope_scaling or {}
    if arch.name in ("llama", "llama4") and scaling.get("rope_type") == "llama3":
        yield "rope_freqs.weight", *_encode(llama3_rope_factors(spec).numpy(), "f32")
    if scaling.get("rope_type") == "longrope":  # llama.cpp: long past the original context
        for kind in ("long", "short"):
            factors = np.asarray(scaling[f"{kind}_factor"], dtype=np.float32)
            yield f"rope_factors_{kind}.weight", *_encode(factors, "f32")


def _stem_and_suffix(key: str) -> tuple[str, str]:
    """A state-dict key as the ``gguf`` name map's stem and llama.cpp's suffix: stacked experts
    and gpt-oss's sinks have no ``.weight``, the experts' biases end in ``_bias``, DeepSeek-V3's
    router bias is ``exp_probs_b.bias``.

    Example::

        >>> _stem_and_suffix("model.layers.1.mlp.experts.up_proj_bias")
        ('model.layers.1.mlp.experts.up_proj', 'bias')
        >>> _stem_and_suffix("model.layers.1.mlp.gate.e_score_correction_bias")
        ('model.layers.1.mlp.gate.e_score_correction', 'bias')
    """
    if key.endswith((*_STACKED_EXPERTS, "self_attn.sinks")):
        return key, "weight"
    if key.endswith(tuple(f"{name}_bias" for name in _STACKED_EXPERTS)):
        return key.removesuffix("_bias"), "bias"
    stem, _, suffix = key.rpartition(".")
    if suffix == "e_score_correction_bias":
        return f"{stem}.e_score_correction", "bias"
    return stem, suffix


def interleave_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q/k projection's output rows, per head, from the rotate-half layout (``x_i`` paired
    with ``x_{i+d/2}``) to interleaved pairs (``x_2i`` with ``x_2i+1``), llama.cpp's ``llama``
    RoPE layout.

    Example::

        >>> interleave_rope_rows(torch.arange(8.0).unsqueeze(1), heads=2).flatten().tolist()
        [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
    """
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def llama3_rope_factors(spec: ModelSpec) -> torch.Tensor:
    """Per rotary frequency, the factor llama.cpp divides it by (``rope_freqs``) so that
    plain RoPE gives Llama 3's scaled frequencies: ``plain / scaled``."""
    plain, _ = rope_inv_freq(spec.head_dim, spec.rope_theta)
    scaled, _ = rope_inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling)
    return (plain / scaled).float()


def _encode(array: np.ndarray, outtype: str) -> tuple[np.ndarray, Any]:
    """``array`` (float32) in its file type: 1-D tensors (norms, biases) stay f32."""
    import gguf

    kinds = gguf.GGMLQuantizationType
    if array.ndim == 1 or outtype == "f32":
        return array.astype(np.float32), kinds.F32
    if outtype == "q8_0" and array.shape[-1] % _Q8_BLOCK == 0:
        return gguf.quants.quantize(array, kinds.Q8_0), kinds.Q8_0
    if outtype == "bf16":
        return gguf.quants.quantize(array, kinds.BF16), kinds.BF16
    return array.astype(np.float16), kinds.F16


# -- tokenizer ---------------------------------------------------------------------------------


class _Vocab:
    """The byte-level BPE tokenizer of a folder as GGUF metadata (:meth:`read` gives a
    sentencepiece-style one as :class:`_SpmVocab`)."""

    def __init__(self, tokens: list[str], types: list[int], pre: str) -> None:
        self.tokens, self.types, self.pre = tokens, types, pre

    @classmethod
    def read(cls, folder: Path, vocab_size: int) -> _Vocab | _SpmVocab:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointFileNotFoundError(f"GGUF export needs {path} (the tokenizer)")
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        if model.get("type") == "BPE" and model.get("byte_fallback"):
            return _SpmVocab.read(path, data, vocab_size)
        if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
            raise GGUFExportError(
                f"{path}: GGUF export supports byte-level BPE and sentencepiece-style BPE "
                f"(byte_fallback) tokenizers; this one is {model.get('type')!r}"
            )
        tokens, types = _token_rows(path, data, vocab_size)
        return cls(tokens, types, _pre_tokenizer(path, data))

    def write(self, writer: Any, folder: Path) -> None:
        import gguf

        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=len(self.tokens))
        if not special.merges:
            raise GGUFExportError(f"{folder / 'tokenizer.json'}: no BPE merges found")
        special.add_to_gguf(writer, quiet=True)


def _token_rows(path: Path, data: Mapping[str, Any], vocab_size: int) -> tuple[list, list]:
    """Every id's token and type (normal, control/user-defined for added tokens, unused past
    the tokenizer's vocabulary) up to ``vocab_size``."""
    import gguf

    model = data["model"]
    ids = {token: i for token, i in model["vocab"].items()}
    added = {t["id"]: t for t in data.get("added_tokens", [])}
    size = max(vocab_size, max(ids.values(), default=-1) + 1, max(added, default=-1) + 1)
    by_id = {i: token for token, i in ids.items()}
    tokens, types = [], []
    kinds = gguf.TokenType
    for i in range(size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(kinds.CONTROL if added[i].get("special") else kinds.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(kinds.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(kinds.UNUSED)
    if size > vocab_size:
        raise GGUFExportError(
            f"{path}: the tokenizer has {size} ids, the model's vocabulary {vocab_size}"
        )
    return tokens, types


class _SpmVocab:
    """A sentencepiece-style BPE tokenizer (``byte_fallback``, ``<0xNN>`` byte pieces, spaces as
    "▁") as llama.cpp's ``llama`` (SPM) vocabulary, scored by :func:`_spm_scores` so that
    llama.cpp's join of the highest-scored adjacent pair is the tokenizer's merge of the
    lowest rank."""

    def __init__(self, tokens: list, scores: list, types: list, space_prefix: bool) -> None:
        self.tokens, self.scores, self.types = tokens, scores, types
        self.space_prefix = space_prefix

    @classmethod
    def read(cls, path: Path, data: Mapping[str, Any], vocab_size: int) -> _SpmVocab:
        import gguf

        model = data["model"]
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise GGUFExportError(f"{path}: GGUF export cannot write a BPE {key} to llama.cpp")
        if model.get("ignore_merges"):
            raise GGUFExportError(f"{path}: GGUF export cannot write BPE ignore_merges")
        space_prefix = _space_prefix(path, data)
        tokens, types = _token_rows(path, data, vocab_size)
        scores = _spm_scores(path, model, tokens)
        unk = model["vocab"].get(model.get("unk_token") or "")
        for i, token in enumerate(tokens):
            if i == unk:
                types[i] = gguf.TokenType.UNKNOWN
            elif types[i] == gguf.TokenType.NORMAL and _BYTE_PIECE.fullmatch(token):
                types[i] = gguf.TokenType.BYTE
        missing = sorted({f"<0x{b:02X}>" for b in range(256)} - set(model["vocab"]))
        if missing:
            raise GGUFExportError(f"{path}: byte_fallback without the byte pieces {missing[:3]}")
        return cls(tokens, scores, types, space_prefix)

    def write(self, writer: Any, folder: Path) -> None:
        import gguf

        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(self.tokens)
        writer.add_token_scores(self.scores)
        writer.add_token_types(self.types)
        writer.add_add_space_prefix(self.space_prefix)
        special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=len(self.tokens))
        special.add_to_gguf(writer, quiet=True)


_BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
_SPACE = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
_PREPEND = {"type": "Prepend", "prepend": "▁"}
_NO_SPLIT = (None, {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                    "invert": False})  # fmt: skip


def _space_prefix(path: Path, data: Mapping[str, Any]) -> bool:
    """llama.cpp's ``add_space_prefix`` of the tokenizer's "▁" normalizer: Gemma's (spaces
    replaced, no prefix) or Llama 2's (a "▁" prepended to each text between special tokens,
    then spaces replaced). Another normalizer or pre-tokenizer is refused: a Metaspace one
    (``prepend_scheme="first"``) skips the prefix after special tokens and before a leading
    space, where llama.cpp adds it."""
    normalizer, pre = data.get("normalizer"), data.get("pre_tokenizer")
    if pre in _NO_SPLIT and normalizer == _SPACE:
        return False
    if pre in _NO_SPLIT and (normalizer or {}).get("normalizers") == [_PREPEND, _SPACE]:
        return True
    raise GGUFExportError(
        f"{path}: GGUF export writes sentencepiece-style tokenizers whose normalizer replaces "
        f"spaces by '▁' (Gemma's, or Llama 2's with a '▁' prepended) and whose pre-tokenizer "
        f"does not split; this one has normalizer {json.dumps(normalizer)[:80]} and "
        f"pre-tokenizer {json.dumps(pre)[:80]}"
    )


def _spm_scores(path: Path, model: Mapping[str, Any], tokens: list[str]) -> list[float]:
    """Each piece's llama.cpp score: minus the rank of its first merge (pieces no merge makes:
    below every merged one). llama.cpp's SPM joins any adjacent pair whose concatenation is a
    piece, highest score first; it tokenises as the BPE merges only when they are every such
    pair with each piece's merges side by side (as a converted sentencepiece model has them):
    other merges are refused."""
    vocab = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    first: dict[str, int] = {}
    for rank, (a, b) in enumerate(merges):
        if (
            first.setdefault(a + b, rank) != rank
            and merges[rank - 1][0] + merges[rank - 1][1] != a + b
        ):
            raise GGUFExportError(
                f"{path}: the merges making {a + b!r} are not side by side (rank {first[a + b]} "
                f"and {rank}); llama.cpp's SPM vocabulary merges by piece score and would "
                "tokenise text differently"
            )
    pairs = {(t[:k], t[k:]) for t in vocab for k in range(1, len(t))}
    missing = sorted(p for p in pairs - set(merges) if p[0] in vocab and p[1] in vocab)
    if missing:
        raise GGUFExportError(
            f"{path}: its BPE merges leave out pairs of pieces that form a piece (e.g. "
            f"{missing[0]}); llama.cpp's SPM vocabulary joins those and would tokenise differently"
        )
    return [-float(first.get(token, len(merges) + i)) for i, token in enumerate(tokens)]


def _pre_tokenizer(path: Path, data: Mapping[str, Any]) -> str:
    """llama.cpp's name of the tokenizer's split pattern (:data:`PRE_TOKENIZERS`)."""
    patterns = [p for p in _split_patterns(data.get("pre_tokenizer"))]
    for name, pattern in PRE_TOKENIZERS.items():
        if pattern in patterns:
            return name
    raise GGUFExportError(
        f"{path}: its pre-tokenizer split pattern {patterns[:1]} is not one GGUF export "
        f"knows ({', '.join(PRE_TOKENIZERS)}); llama.cpp would tokenise text differently"
    )


def _split_patterns(node: Any) -> Iterator[str]:
    """Every ``Split`` regex in a ``tokenizer.json`` pre-tokenizer tree."""
    if isinstance(node, Mapping):
        if node.get("type") == "Split":
            pattern = node.get("pattern") or {}
            if "Regex" in pattern:
                yield pattern["Regex"]
        for value in node.values():
            yield from _split_patterns(value)
    elif isinstance(node, list):
        for value in node:
            yield from _split_patterns(value)
