"""GGUF export: a Hugging Face folder of a native family -> one ``.gguf`` file that llama.cpp,
Ollama and transformers (``from_pretrained(folder, gguf_file=...)``) load.

``tunesmith export RUN_OR_FOLDER --output-dir DIR --format gguf --outtype f16`` calls
:func:`export_gguf` (an adapter is merged into its base first). The file holds:

- the model's hyperparameters under llama.cpp's keys for its architecture (:data:`GGUF_ARCHES`:
  Llama and Mistral are llama.cpp's ``llama``, Qwen2/2.5 ``qwen2``, Qwen3 ``qwen3``, Qwen3-MoE
  ``qwen3moe`` with its experts stacked ``[experts, ...]`` as llama.cpp keeps them, Mixtral
  llama.cpp's ``llama`` with such experts (``ffn_gate_exps`` ...; transformers' GGUF reader
  does not read it back: llama.cpp does); any other family is refused by name);
- every weight under llama.cpp's tensor names (the ``gguf`` package's own name map), 2-D
  weights in ``outtype`` (``f32``, ``f16``, ``bf16`` or ``q8_0``: blocks of 32 int8 values
  with one f16 scale; a weight whose rows are not a multiple of 32 stays f16, as llama.cpp
  does), norms and biases in f32. For ``llama`` the q/k rows of each head are reordered from
  the Hugging Face rotate-half layout to llama.cpp's interleaved pairs (transformers' GGUF
  loader undoes it); Llama 3's RoPE scaling is written as llama.cpp's ``rope_freqs`` factors;
- the byte-level BPE tokenizer: every token with its type (normal, control for special added
  tokens, user-defined for other added tokens, unused for the rows past the tokenizer's
  vocabulary), the merges, the special token ids, ``add_bos_token`` and the folder's chat
  template; its pre-tokenizer is named from the ``tokenizer.json`` split pattern
  (:data:`PRE_TOKENIZERS`), another pattern is refused rather than guessed.

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
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from tunesmith.models.hf import from_hf, read_hf_config
from tunesmith.models.safetensors_io import CheckpointFileNotFoundError
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.moe import stacked_state

__all__ = ["GGUF_ARCHES", "OUTTYPES", "PRE_TOKENIZERS", "GGUFExportError", "export_gguf"]

GGUF_ARCHES = {
    "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe", "mixtral": "llama",
}  # fmt: skip
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
}
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
    arch = GGUF_ARCHES[model_type]
    model = from_hf(folder, dtype=torch.float32, backend="native")
    spec: ModelSpec = model.spec
    with stacked_state(model):  # experts as [experts, ...] tensors, as llama.cpp stores them
        state = model.state_dict()
    vocab = _Vocab.read(folder, spec.vocab_size)

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    partial.unlink(missing_ok=True)  # a leftover, or a link planted there: never written through
    writer = gguf.GGUFWriter(partial, arch)
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


def _write_hyperparameters(writer: Any, spec: ModelSpec, arch: str, *, name: str, outtype: str):
    import gguf

    writer.add_name(name)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_hidden_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_attention_heads)
    writer.add_head_count_kv(spec.num_key_value_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_vocab_size(spec.vocab_size)
    if spec.num_experts:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.num_experts_per_tok)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    writer.add_file_type(
        {
            "f32": gguf.LlamaFileType.ALL_F32,
            "f16": gguf.LlamaFileType.MOSTLY_F16,
            "bf16": gguf.LlamaFileType.MOSTLY_BF16,
            "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        }[outtype]
    )
    _check_supported(spec, arch)


def _check_supported(spec: ModelSpec, arch: str) -> None:
    """Refuse what the GGUF file could not say, naming the setting."""
    scaling = (spec.rope_scaling or {}).get("rope_type")
    if scaling not in (None, "default") and not (arch == "llama" and scaling == "llama3"):
        raise GGUFExportError(f"GGUF export of rope_scaling {scaling!r} is not supported yet")
    if spec.sliding_window is not None and spec.sliding_window < spec.max_position_embeddings:
        raise GGUFExportError(
            f"sliding_window {spec.sliding_window} (< max_position_embeddings "
            f"{spec.max_position_embeddings}): llama.cpp's {arch} attends to the whole context, "
            "so the exported model would not be this one"
        )
    # llama.cpp's qwen3moe, and its llama with experts (Mixtral): every layer sparse, softmax
    # top-k weights renormalised
    if spec.num_experts:
        moe = {"norm_topk_prob": spec.norm_topk_prob, "mlp_only_layers": spec.mlp_only_layers,
               "decoder_sparse_step": spec.decoder_sparse_step}  # fmt: skip
        sparse_arch = arch == "qwen3moe" or (arch == "llama" and spec.model_type == "mixtral")
        if not sparse_arch or moe != {
            "norm_topk_prob": True,
            "mlp_only_layers": (),
            "decoder_sparse_step": 1,
        }:
            raise GGUFExportError(
                f"GGUF export of this mixture of experts ({moe}) is not supported: llama.cpp's "
                "qwen3moe and llama (Mixtral) need every layer sparse with renormalised top-k "
                "weights"
            )
    plain = (
        spec.partial_rotary_factor == 1.0
        and not spec.rope_interleaved
        and spec.norm_layout == "pre"
        and spec.norm_style == "plain"
        and spec.attention_multiplier is None
        and spec.embedding_multiplier == 1.0
        and spec.residual_multiplier == 1.0
        and spec.logits_scaling == 1.0
        and spec.hidden_act == "silu"
    )
    if not plain:
        raise GGUFExportError(f"GGUF export: this {spec.model_type} model's spec is not plain")


# -- tensors -----------------------------------------------------------------------------------


def _tensors(
    state: Mapping[str, torch.Tensor], spec: ModelSpec, arch: str, outtype: str
) -> Iterator[tuple[str, np.ndarray, Any]]:
    """``(llama.cpp name, data, its GGML type)`` of every weight to write."""
    import gguf

    model_arch = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(model_arch, spec.num_hidden_layers)
    for key, tensor in state.items():
        if key == "lm_head.weight" and spec.tie_word_embeddings:
            continue  # tied: llama.cpp (and transformers' reader) use token_embd
        if key.endswith("rotary_emb.inv_freq"):
            continue
        stem, _, suffix = key.rpartition(".")
        if key.endswith(_STACKED_EXPERTS):  # "...mlp.experts.gate_proj": no ".weight"
            stem, suffix = key, "weight"
        target = names.get_name(stem)
        if target is None:
            raise GGUFExportError(f"GGUF export: no llama.cpp name for tensor {key}")
        data = tensor.detach().float()
        if arch == "llama" and stem.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = spec.num_attention_heads if "q_proj" in stem else spec.num_key_value_heads
            data = interleave_rope_rows(data, heads)
        yield (f"{target}.{suffix}", *_encode(data.numpy(), outtype))
    if arch == "llama" and (spec.rope_scaling or {}).get("rope_type") == "llama3":
        yield "rope_freqs.weight", *_encode(llama3_rope_factors(spec).numpy(), "f32")


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
    from tunesmith.modules.rope import rope_inv_freq

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
    """The byte-level BPE tokenizer of a folder as GGUF metadata."""

    def __init__(self, tokens: list[str], types: list[int], pre: str) -> None:
        self.tokens, self.types, self.pre = tokens, types, pre

    @classmethod
    def read(cls, folder: Path, vocab_size: int) -> _Vocab:
        import gguf

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise CheckpointFileNotFoundError(f"GGUF export needs {path} (the tokenizer)")
        data = json.loads(path.read_text(encoding="utf-8"))
        model = data.get("model") or {}
        if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(data.get("pre_tokenizer")):
            raise GGUFExportError(
                f"{path}: GGUF export supports byte-level BPE tokenizers; this one is "
                f"{model.get('type')!r} (sentencepiece-style vocabularies are not supported yet)"
            )
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
