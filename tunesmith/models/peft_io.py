"""PEFT-format LoRA/DoRA adapters in and out (merged export: :mod:`tunesmith.models.export`).

An adapter folder is what ``peft`` writes with ``save_pretrained``: ``adapter_config.json``
(``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` whose keys are the adapted model's keys with the prefix
``base_model.model.``, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
and, for DoRA, ``...q_proj.lora_magnitude_vector``. Our adapter keys are the same without the
prefix, so the mapping is only that prefix (stacked MoE expert adapters excepted: they are
written as PEFT writes them for transformers 5's fused Qwen3-MoE experts, see "MoE experts"
below; and so are the projections a family's checkpoints store fused, Phi-3's ``qkv_proj``
and ``gate_up_proj``, GLM-4's ``gate_up_proj``: see "Fused projections" below).
``peft.PeftModel.from_pretrained(hf_model, folder)``
loads what :func:`save_peft_adapter` writes, and :func:`load_peft_adapter` reads adapters
trained with ``peft``.

Example::

    >>> from tunesmith.models import build_model, from_hf, qwen3
    >>> from tunesmith.models.hf import save_hf_checkpoint
    >>> from tunesmith.modules.peft import apply_lora
    >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")  # the base
    >>> model = apply_lora(from_hf("Qwen3-tiny"), target_modules=["q_proj"], rank=4, alpha=8)
    >>> save_peft_adapter(model, "out/adapter", base_model_name_or_path="Qwen3-tiny")
    PosixPath('out/adapter')
    >>> model = load_peft_adapter(from_hf("Qwen3-tiny"), "out/adapter")
    >>> sorted(adapter_state_dict(model))[0]
    'model.layers.0.self_attn.q_proj.lora_A.weight'
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from tunesmith.models.base_record import BaseRecord
from tunesmith.models.builder import build_model
from tunesmith.models.family import family_for, language_model_config
from tunesmith.models.hf import CONFIG_NAME, from_hf, read_hf_config, resolve_dtype
from tunesmith.models.safetensors_io import (
    CheckpointError,
    CheckpointFileNotFoundError,
    atomic_directory,
    read_json_object,
)
from tunesmith.models.spec import ModelSpec, spec_from_hf_config
from tunesmith.modules.moe import ExpertLoRA, GroupedExperts
from tunesmith.modules.peft import (
    DoRALinear,
    LoRALinear,
    adapter_modules,
    adapter_state_dict,
    add_adapter,
    apply_lora,
    find_linear_targets,
    is_nf4,
    mark_adapters_trainable,
    peft_misread_modules,
    resolve_quantize_base,
)
from tunesmith.modules.peft.peft_compat import (
    PEFT_EXPERT_NAMES,
    peft_misread_message,
    peft_misread_names,
    warn_peft_misread,
)

__all__ = [
    "ADAPTER_CONFIG_NAME",
    "ADAPTER_WEIGHTS_NAME",
    "PEFT_KEY_PREFIX",
    "PeftAdapter",
    "load_peft_adapter",
    "peft_adapter_config",
    "peft_misread_in_config",
    "read_adapter_config",
    "read_peft_adapter",
    "save_peft_adapter",
    "write_peft_adapter",
]

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_KEY_PREFIX = "base_model.model."

_ADAPTER_KINDS = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector")
# adapter_config.json fields whose non-empty values change the model in ways not supported here.
_UNSUPPORTED_FIELDS = {
    "modules_to_save": "fully trained extra modules",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "layer replication",
    "lora_bias": "LoRA biases",
    "fan_in_fan_out": "Conv1D-style (fan_in_fan_out) weights",
    "use_qalora": "QALoRA",
    "alora_invocation_tokens": "activated LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
    "megatron_config": "Megatron parallel layers",
}
# init_lora_weights values that leave the base weights alone (PiSSA, OLoRA, LoftQ, EVA,
# CorDA... rewrite the base when the adapter is loaded into peft).
_PLAIN_INITS = (True, False, "gaussian", "orthogonal")


# ----------------------------------------------------------------------------- MoE experts
#
# PEFT (with transformers 5, whose Qwen3-MoE experts are fused ``gate_up_proj`` ``[E, 2I, H]``
# and ``down_proj`` ``[E, H, I]`` parameters) saves expert LoRA as ``target_parameters``
# adapters on ``<layer>.mlp.experts``: ``lora_A.weight`` ``[E * r, in]`` (expert-major) and
# ``lora_B.weight`` ``[out, r * E]`` (expert-minor). With both targeted, ``gate_up_proj`` is the
# inner wrapper (``experts.base_layer.lora_*``) and ``down_proj`` the outer (``experts.lora_*``).
# Our separate gate/up adapters are written fused: ``A = [A_gate; A_up]`` (rank 2r) and
# ``B = blockdiag(B_gate, B_up)``, with ``rank_pattern``/``alpha_pattern`` keeping the scaling;
# reading takes that form back (a dense fused ``B`` is refused).

_FUSED_KEY = r".*\.gate_up_proj"


def _expert_file_layers(experts_name: str, fused: bool, down: bool) -> dict[str, str]:
    """PEFT layer name (without prefix) of each fused parameter adapted on ``experts_name``."""
    if fused and down:
        return {"gate_up_proj": f"{experts_name}.base_layer", "down_proj": experts_name}
    return {("gate_up_proj" if fused else "down_proj"): experts_name}


def _experts_whose_layout(model: nn.Module, flag: str) -> set[str]:
    """Expert modules whose ``checkpoint_layout`` sets ``flag``."""
    return {
        name
        for name, m in model.named_modules()
        if getattr(getattr(m, "checkpoint_layout", None), flag, False)
    }


def _interleaved_experts(model: nn.Module) -> set[str]:
    """Expert modules whose checkpoints interleave gate and up rows (gpt-oss:
    ``checkpoint_layout.interleaved_gate_up``): their fused ``lora_B`` rows are interleaved too."""
    return _experts_whose_layout(model, "interleaved_gate_up")


def _input_major_experts(model: nn.Module) -> set[str]:
    """Expert modules whose checkpoints store ``[E, in, out]`` (Llama 4:
    ``checkpoint_layout.input_major``). peft reads every 3-D expert tensor as ``[E, out, in]``,
    so its ``lora_A``/``lora_B`` there are our ``B``/``A`` transposed (``(B A)^T = A^T B^T``)."""
    return _experts_whose_layout(model, "input_major")


def _to_peft_expert_tensors(
    state: Mapping[str, torch.Tensor],
    interleaved: Collection[str] = (),
    input_major: Collection[str] = (),
) -> dict[str, torch.Tensor]:
    """Our stacked expert adapter keys (``<experts>.lora.<proj>.lora_A``) -> PEFT's keys and
    layouts (without prefix); other keys pass through. ``interleaved``: experts names whose
    fused rows alternate gate and up (see :func:`_interleaved_experts`); ``input_major``: those
    stored ``[E, in, out]`` (see :func:`_input_major_experts`)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, value in state.items():
        match = re.fullmatch(r"(.*)\.lora\.(gate_proj|up_proj|down_proj)\.(lora_[AB])", key)
        if match is None:
            out[key] = value
            continue
        groups.setdefault(match[1], {}).setdefault(match[2], {})[match[3]] = value
    for experts_name, projs in groups.items():
        fused, down = "gate_proj" in projs, "down_proj" in projs
        if fused != ("up_proj" in projs):
            raise CheckpointError(
                f"{experts_name}: gate_proj and up_proj adapters must come together (PEFT fuses "
                f"them into gate_up_proj), got {sorted(projs)}"
            )
        layers = _expert_file_layers(experts_name, fused, down)
        if fused:
            g, u = projs["gate_proj"], projs["up_proj"]
            a = torch.cat([g["lora_A"], u["lora_A"]], dim=1)
            b = torch.stack(
                [torch.block_diag(bg, bu) for bg, bu in zip(g["lora_B"], u["lora_B"], strict=True)]
            )
            if experts_name in interleaved:  # rows gate_0, up_0, gate_1, up_1, ...
                half = b.shape[1] // 2
                b = torch.stack([b[:, :half], b[:, half:]], dim=2).flatten(1, 2)
            if experts_name in input_major:
                a, b = b.transpose(1, 2), a.transpose(1, 2)
            out[f"{layers['gate_up_proj']}.lora_A.weight"] = a.flatten(0, 1)
            out[f"{layers['gate_up_proj']}.lora_B.weight"] = b.permute(1, 2, 0).flatten(1, 2)
        if down:
            a, b = projs["down_proj"]["lora_A"], projs["down_proj"]["lora_B"]
            if experts_name in input_major:
                a, b = b.transpose(1, 2), a.transpose(1, 2)
            out[f"{layers['down_proj']}.lora_A.weight"] = a.flatten(0, 1)
            out[f"{layers['down_proj']}.lora_B.weight"] = b.permute(1, 2, 0).flatten(1, 2)
    return out


def _expert_adapters(
    model: nn.Module, adapter: PeftAdapter
) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Take the expert layers out of ``adapter.layers``: experts name -> projection ->
    (``A`` ``[E, r, in]``, ``B`` ``[E, out, r]``), unfused and checked against the model."""
    params = set(adapter.config.get("target_parameters") or [])
    file = adapter.weights_file
    unknown = params - {"gate_up_proj", "down_proj"}
    if unknown:
        raise CheckpointError(
            f"{file}: target_parameters {sorted(unknown)} (only MoE experts' gate_up_proj and "
            f"down_proj are supported)"
        )
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    if not params:
        return out
    fused, down = "gate_up_proj" in params, "down_proj" in params
    stacked = {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}
    for experts_name, module in stacked.items():
        layers = _expert_file_layers(experts_name, fused, down)
        if not any(layer in adapter.layers for layer in layers.values()):
            continue
        e = module.num_experts
        for param, layer in layers.items():
            parts = adapter.layers.pop(layer, None)
            if parts is None or set(parts) != {"lora_A.weight", "lora_B.weight"}:
                raise CheckpointError(
                    f"{file}: expert adapter '{layer}' ({param}) needs exactly lora_A.weight and "
                    f"lora_B.weight, got {sorted(parts or [])}"
                )
            a, b = parts["lora_A.weight"], parts["lora_B.weight"]
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] % e or a.shape[0] != b.shape[1]:
                raise CheckpointError(
                    f"{file}: expert adapter '{layer}': lora_A {list(a.shape)} and lora_B "
                    f"{list(b.shape)} are not [E*r, in] and [out, r*E] for E={e}"
                )
            a3 = a.reshape(e, -1, a.shape[-1])
            b3 = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)
            if getattr(module.checkpoint_layout, "input_major", False):  # see _input_major_experts
                a3, b3 = b3.transpose(1, 2), a3.transpose(1, 2)
            if param == "down_proj":
                out.setdefault(experts_name, {})["down_proj"] = (a3, b3)
                continue
            if getattr(getattr(module, "checkpoint_layout", None), "interleaved_gate_up", False):
                b3 = torch.cat([b3[:, 0::2], b3[:, 1::2]], dim=1)  # gate rows, then up rows
            r2, i2 = a3.shape[1], b3.shape[1]
            if r2 % 2 or i2 % 2:
                raise CheckpointError(f"{file}: '{layer}' (gate_up_proj) has odd rank or width")
            r, i = r2 // 2, i2 // 2
            off = torch.cat([b3[:, :i, r:].flatten(), b3[:, i:, :r].flatten()])
            if off.abs().max() > 0:
                raise CheckpointError(
                    f"{file}: '{layer}' is a dense fused gate_up_proj adapter (lora_B is not "
                    f"block-diagonal in gate/up); only separate gate_proj/up_proj adapters "
                    f"(as tunesmith writes them) can be loaded onto stacked experts"
                )
            out.setdefault(experts_name, {})["gate_proj"] = (a3[:, :r], b3[:, :i, :r])
            out[experts_name]["up_proj"] = (a3[:, r:], b3[:, i:, r:])
    return out


# ----------------------------------------------------------------------------- fused projections
#
# A family whose checkpoints store projections fused (``Family.fused``: Phi-3's ``qkv_proj``
# = q, k, v rows and ``gate_up_proj`` = gate, up rows; GLM-4's ``gate_up_proj``) keeps them
# apart in memory, with an adapter on each part, while peft adapts the fused module of the
# transformers model. Written: one adapter on the fused name, ``A = [A_q; A_k; A_v]`` (rank
# ``r_q + r_k + r_v``), ``B = blockdiag(B_q, B_k, B_v)``, DoRA magnitudes concatenated, and an
# alpha that keeps the parts' scaling (``n * alpha`` for n parts of rank r; ``alpha * sqrt(n)``
# with rsLoRA, as the scaling is then ``alpha / sqrt(r)``), in ``rank_pattern`` /
# ``alpha_pattern``. Row j of block i of ``B A`` is ``B_i[j] A_i``: every output row of the
# fused adapter is its part's, so the outputs and DoRA's per-row weight norms are the parts'.
# Parts adapted without the others, or with different scalings, are refused.
# Read: a ``B`` block-diagonal in the model's part ranks (resuming into an adapted model) or
# in n equal blocks (what is written here) gives each part its block back; any other (a
# peft-trained adapter: dense ``B``) gives every part the whole ``A`` (rank r) and its rows of
# ``B``, same alpha. Either is exact.


def _fused_of(model: nn.Module) -> tuple[str, Mapping[str, tuple[str, ...]]]:
    """(family name, ``Family.fused``) of the model's spec; ``("", {})`` without one."""
    for module in model.modules():
        spec = getattr(module, "spec", None)
        if isinstance(spec, ModelSpec):
            family = family_for(spec.model_type)
            return family.name, family.fused
    return "", {}


def _join(names: Collection[str]) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _sibling(parent: str, leaf: str) -> str:
    return f"{parent}.{leaf}" if parent else leaf


def _fused_groups(
    adapted: Collection[str], fused: Mapping[str, tuple[str, ...]], family: str
) -> dict[str, tuple[str, ...]]:
    """Fused module name (``model.layers.0.self_attn.qkv_proj``) -> its parts' names, for the
    ``adapted`` layers that are parts of a fused projection; ``ValueError`` when only some parts
    of one are adapted."""
    groups: dict[str, tuple[str, ...]] = {}
    adapted_set = set(adapted)
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        fused_name = next((f for f, parts in fused.items() if leaf in parts), None)
        if fused_name is None:
            continue
        parts = fused[fused_name]
        names = tuple(_sibling(parent, p) for p in parts)
        missing = [p for p, n in zip(parts, names, strict=True) if n not in adapted_set]
        if missing:
            present = [p for p in parts if p not in missing]
            raise ValueError(
                f"{parent or 'the model'}: {_join(present)} adapted without {_join(missing)}, "
                f"but {family}'s checkpoints fuse {_join(parts)} into {fused_name}, which peft "
                f"adapts as one layer: adapt {_join(parts)} together with the same rank and "
                f"alpha for {family} (target_modules: [{fused_name}]), or none of them"
            )
        groups[_sibling(parent, fused_name)] = names
    return groups


def _fused_rank_alpha(name: str, parts: Mapping[str, LoRALinear], family: str) -> tuple[int, float]:
    """Rank and alpha of the one adapter on fused module ``name`` equal to ``parts``' adapters
    (block-diagonal ``B``); ``ValueError`` when their scalings differ."""
    mods = list(parts.values())
    rslora = mods[0].use_rslora
    first = mods[0]

    def scaling(m: LoRALinear) -> float:
        return m.alpha / (math.sqrt(m.rank) if rslora else m.rank)

    if any(not math.isclose(scaling(m), scaling(first), rel_tol=1e-9) for m in mods):
        found = ", ".join(
            f"{n.rpartition('.')[2]} (rank {m.rank}, alpha {m.alpha})" for n, m in parts.items()
        )
        leaves = [n.rpartition(".")[2] for n in parts]
        raise ValueError(
            f"{name}: {found} cannot be written as one {name.rpartition('.')[2]} adapter "
            f"({family}'s checkpoints fuse them; peft scales the fused layer once): give "
            f"{_join(leaves)} the same rank and alpha"
        )
    rank = sum(m.rank for m in mods)
    equal = all(m.rank == first.rank for m in mods)
    ratio = len(mods) if equal else rank / first.rank  # alpha' / rank' = alpha / rank
    return rank, first.alpha * (math.sqrt(ratio) if rslora else ratio)


def _hf_names(names: list[str], fused: Mapping[str, tuple[str, ...]]) -> list[str]:
    """``names`` with every complete group of parts replaced by the fused module's name (where
    its first part was)."""
    present = set(names)
    out: dict[str, None] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        for fused_name, parts in fused.items():
            if leaf in parts and all(_sibling(parent, p) in present for p in parts):
                name = _sibling(parent, fused_name)
                break
        out[name] = None
    return list(out)


def _adapter_groups(model: nn.Module) -> tuple[str, dict[str, tuple[str, ...]]]:
    family, fused = _fused_of(model)
    names = [n for n, m in adapter_modules(model).items() if not isinstance(m, ExpertLoRA)]
    return family, _fused_groups(names, fused, family) if fused else {}


def _to_peft_fused_tensors(
    state: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """Our part adapters (``...q_proj.lora_A.weight``) -> one fused adapter per group
    (``...qkv_proj.lora_A.weight``: A stacked, B block-diagonal, magnitudes concatenated)."""
    out = dict(state)
    for fused_name, parts in groups.items():
        tensors = {
            kind: [out.pop(f"{p}.{kind}") for p in parts]
            for kind in _ADAPTER_KINDS
            if f"{parts[0]}.{kind}" in out
        }
        out[f"{fused_name}.lora_A.weight"] = torch.cat(tensors["lora_A.weight"])
        out[f"{fused_name}.lora_B.weight"] = torch.block_diag(*tensors["lora_B.weight"])
        if "lora_magnitude_vector" in tensors:
            out[f"{fused_name}.lora_magnitude_vector"] = torch.cat(tensors["lora_magnitude_vector"])
    return out


def _block_diagonal(b: torch.Tensor, rows: list[int], ranks: list[int]) -> bool:
    """Whether ``b`` ``[sum(rows), sum(ranks)]`` is zero outside the blocks ``rows x ranks``."""
    if sum(ranks) != b.shape[1]:
        return False
    row = col = 0
    for n_rows, rank in zip(rows, ranks, strict=True):
        block = b[row : row + n_rows]
        if block[:, :col].any() or block[:, col + rank :].any():
            return False
        row, col = row + n_rows, col + rank
    return True


def _tidy(x: float) -> float:
    """``x`` without float noise (``7.999999999999999`` -> 8.0) from scaling alphas."""
    return float(f"{x:.12g}")


def _split_fused(
    model: nn.Module, adapter: PeftAdapter, existing: Mapping[str, LoRALinear]
) -> None:
    """Replace the adapters on fused module names in ``adapter.layers`` by one per part (see
    "Fused projections" above); ``adapter.alphas`` gets the parts' alphas."""
    family, fused = _fused_of(model)
    if not fused:
        return
    file = adapter.weights_file
    use_rslora = bool(adapter.config.get("use_rslora", False))
    modules = dict(model.named_modules())
    for layer in list(adapter.layers):
        parent, _, leaf = layer.rpartition(".")
        if leaf not in fused or layer in modules:
            continue
        names = [_sibling(parent, p) for p in fused[leaf]]
        source = adapter.sources[f"{layer}.lora_B.weight"]
        outs = []
        for name in names:
            module = modules.get(name)
            if not isinstance(module, (nn.Linear, LoRALinear)):
                raise CheckpointError(
                    f"{file}: tensor '{source}' adapts '{layer}', {family}'s fused "
                    f"{_join(fused[leaf])}, but the model has no linear layer '{name}'"
                )
            outs.append(module.out_features)
        tensors = adapter.layers.pop(layer)
        a, b = tensors["lora_A.weight"], tensors["lora_B.weight"]
        magnitude = tensors.get("lora_magnitude_vector")
        for kind, tensor in (("lora_B.weight", b), ("lora_magnitude_vector", magnitude)):
            if tensor is not None and tensor.shape[0] != sum(outs):
                raise CheckpointError(
                    f"{file}: tensor '{adapter.sources[f'{layer}.{kind}']}' has "
                    f"{tensor.shape[0]} rows, the model's {_join(names)} "
                    f"{'+'.join(map(str, outs))} = {sum(outs)}"
                )
        rank, alpha = int(a.shape[0]), adapter.alpha(layer)
        adapted = [existing.get(n) for n in names]
        ranks: list[int] | None = None  # None: every part takes the whole A
        if all(m is not None for m in adapted):  # resuming: the model's ranks decide
            want = [m.rank for m in adapted]
            if any(r != rank for r in want):
                if not _block_diagonal(b, outs, want):
                    raise CheckpointError(
                        f"{file}: '{layer}' is rank {rank} in the file, its parts "
                        f"{_join(names)} have ranks {want} in the model, and lora_B is not "
                        f"block-diagonal in those"
                    )
                ranks = want
        elif rank % len(names) == 0 and _block_diagonal(b, outs, [rank // len(names)] * len(names)):
            ranks = [rank // len(names)] * len(names)
        row = col = 0
        for i, name in enumerate(names):
            if name in adapter.layers:
                raise CheckpointError(
                    f"{file}: adapts both '{layer}' and its part '{name}' ({family} fuses "
                    f"{_join(fused[leaf])} into {leaf})"
                )
            part_rank = rank if ranks is None else ranks[i]
            rows = slice(row, row + outs[i])
            cols = slice(0, rank) if ranks is None else slice(col, col + part_rank)
            part = {"lora_A.weight": a[cols], "lora_B.weight": b[rows, cols]}
            if magnitude is not None:
                part["lora_magnitude_vector"] = magnitude[rows]
            adapter.layers[name] = part
            for kind in part:
                adapter.sources[f"{name}.{kind}"] = adapter.sources[f"{layer}.{kind}"]
            part_alpha = alpha
            if ranks is not None:
                ratio = part_rank / rank
                part_alpha = _tidy(alpha * (math.sqrt(ratio) if use_rslora else ratio))
                model_alpha = adapted[i].alpha if adapted[i] is not None else None
                if model_alpha is not None and math.isclose(part_alpha, model_alpha, rel_tol=1e-9):
                    part_alpha = model_alpha
            adapter.alphas[name] = part_alpha
            row, col = row + outs[i], col + part_rank


# ----------------------------------------------------------------------------- config


def _pattern_value(pattern: Mapping[str, Any], module_name: str, default: Any) -> Any:
    """PEFT's rank/alpha pattern lookup: the first key that matches the end of the name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _one_value(values: dict[str, Any], what: str) -> Any:
    distinct = set(values.values())
    if len(distinct) > 1:
        raise ValueError(
            f"the PEFT format stores one {what} per adapter, but the layers differ: "
            f"{dict(list(values.items())[:6])}"
        )
    return distinct.pop()


def _most_common_and_pattern(values: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    common = Counter(values.values()).most_common(1)[0][0]
    return common, {name: v for name, v in values.items() if v != common}


def _target_modules(
    model: nn.Module, adapted: list[str], fused: Mapping[str, tuple[str, ...]]
) -> list[str]:
    """Leaf names (``q_proj``) when they select exactly the adapted layers, else full names;
    names as in the Hugging Face model (fused projections under their fused name)."""
    inside = tuple(f"{name}." for name in adapted)
    candidates = _hf_names(
        [
            name
            for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, LoRALinear)) and name and not name.startswith(inside)
        ],
        fused,
    )
    adapted = _hf_names(adapted, fused)
    adapted_set = set(adapted)
    leaves = sorted({name.rpartition(".")[2] for name in adapted})
    selected = {n for n in candidates if n.rpartition(".")[2] in leaves}
    return leaves if selected == adapted_set else sorted(adapted)


def peft_adapter_config(
    model: nn.Module, *, base_model_name_or_path: str | os.PathLike | None = None
) -> dict[str, Any]:
    """The ``adapter_config.json`` dict describing ``model``'s adapters.

    Reads module attributes only (works on sharded models). Different ranks or alphas per
    layer become ``rank_pattern``/``alpha_pattern`` entries; DoRA, rsLoRA and dropout must be
    the same on every layer, as the PEFT format has one value for each. Projections the
    family's checkpoints fuse (Phi-3's ``qkv_proj``) are one adapter of the summed rank on the
    fused name; their parts must be adapted together, with one scaling.

    Example::

        >>> from tunesmith.models import phi3
        >>> from tunesmith.modules.peft import apply_lora
        >>> model = apply_lora(phi3.phi3_tiny(), target_modules=["qkv_proj"], rank=4, alpha=8)
        >>> config = peft_adapter_config(model)
        >>> config["target_modules"], config["rank_pattern"], config["alpha_pattern"]
        (['qkv_proj'], {}, {})
        >>> config["r"], config["lora_alpha"]
        (12, 24)
        >>> model = apply_lora(phi3.phi3_tiny(), target_modules=["q_proj"], rank=4, alpha=8)
        >>> peft_adapter_config(model)
        Traceback (most recent call last):
        ValueError: model.layers.0.self_attn: q_proj adapted without k_proj and v_proj, but ...
    """
    every = adapter_modules(model)
    if not every:
        raise ValueError(f"{type(model).__name__} has no adapters (apply_lora first)")
    modules = {n: m for n, m in every.items() if not isinstance(m, ExpertLoRA)}
    experts = {n: m for n, m in every.items() if isinstance(m, ExpertLoRA)}
    names = list(modules)
    use_dora = _one_value({n: isinstance(m, DoRALinear) for n, m in every.items()}, "use_dora")
    use_rslora = _one_value({n: m.use_rslora for n, m in every.items()}, "use_rslora")
    dropout = _one_value({n: m.dropout for n, m in every.items()}, "lora_dropout")
    family, fused = _fused_of(model)
    groups = _fused_groups(names, fused, family) if fused else {}
    # (rank, alpha) of every adapted layer as peft sees it: fused projections as one layer.
    values = {n: (m.rank, m.alpha) for n, m in every.items()}
    for fused_name, parts in groups.items():
        for part in parts:
            del values[part]
        values[fused_name] = _fused_rank_alpha(fused_name, {p: modules[p] for p in parts}, family)
    layers = set(values) - set(experts)
    r, rank_pattern = _most_common_and_pattern({n: v[0] for n, v in values.items()})
    alpha, alpha_pattern = _most_common_and_pattern({n: v[1] for n, v in values.items()})
    rank_pattern = {n: v for n, v in rank_pattern.items() if n in layers}
    alpha_pattern = {n: v for n, v in alpha_pattern.items() if n in layers}
    target_parameters: list[str] = []
    if experts:
        e_rank = _one_value({n: m.rank for n, m in experts.items()}, "expert rank")
        e_alpha = _one_value({n: m.alpha for n, m in experts.items()}, "expert alpha")
        if (e_rank, e_alpha) != (r, alpha):
            raise ValueError(
                f"expert adapters have rank {e_rank}, alpha {e_alpha} but the other layers "
                f"rank {r}, alpha {alpha}: the PEFT format needs the same for both"
            )
        projs = {n.rpartition(".")[2] for n in experts}
        if "gate_proj" in projs:
            target_parameters.append("gate_up_proj")
            rank_pattern[_FUSED_KEY] = 2 * r  # gate and up fused: rank 2r, same scaling
            alpha_pattern[_FUSED_KEY] = alpha * (2**0.5 if use_rslora else 2)
        if "down_proj" in projs:
            target_parameters.append("down_proj")
    base = None if base_model_name_or_path is None else str(base_model_name_or_path)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "revision": None,
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _target_modules(model, names, fused) if names else [],
        "target_parameters": target_parameters or None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "use_rslora": use_rslora,
        "use_dora": use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "inference_mode": True,
    }


def read_adapter_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The checked ``adapter_config.json`` of ``folder``; unsupported adapters (other PEFT
    types, trained biases, ``modules_to_save``, base-rewriting inits...) are errors naming
    the file and every offending field."""
    path = Path(folder) / ADAPTER_CONFIG_NAME
    config = read_json_object(path, "a PEFT adapter")
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (only 'LORA' is supported)")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        problems.append(f"task_type {config.get('task_type')!r} (only 'CAUSAL_LM')")
    if config.get("bias", "none") != "none":
        problems.append(f"bias={config['bias']!r} (trained biases; only 'none' is supported)")
    if config.get("init_lora_weights", True) not in _PLAIN_INITS:
        problems.append(
            f"init_lora_weights={config['init_lora_weights']!r} (peft rewrites the base weights "
            f"for it; convert the adapter to plain LoRA first)"
        )
    for key, what in _UNSUPPORTED_FIELDS.items():
        if config.get(key):
            problems.append(f"{key}={config[key]!r} ({what} not supported)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        problems.append(f"r={r!r} (a positive int is required)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        problems.append(f"lora_alpha={alpha!r} (a number is required)")
    if problems:
        raise CheckpointError(f"{path}: unsupported adapter: " + "; ".join(problems))
    return config


# ----------------------------------------------------------------------------- writing


def _plain_cpu(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = ()  # noqa: N806
    if isinstance(tensor, DTensor):
        raise CheckpointError(
            f"adapter tensor '{name}' is a DTensor: gather the adapter state dict first and "
            f"pass it as state_dict="
        )
    if tensor.is_meta:
        raise CheckpointError(f"adapter tensor '{name}' is on the meta device")
    out = tensor.detach().to("cpu", dtype=dtype if dtype is not None else tensor.dtype)
    return out.clone(memory_format=torch.contiguous_format)


def write_peft_adapter(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    base_model_name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
) -> list[Path]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` into ``folder`` (not
    atomic; for callers that write more files inside one ``atomic_directory``).

    ``state_dict`` (our adapter keys, full plain tensors) replaces ``adapter_state_dict(model)``,
    e.g. a state dict gathered from an FSDP-sharded model. ``dtype`` casts the tensors. A
    ``base_model_name_or_path`` that is a local HF folder (as spelled at training, relative
    to the working directory) is written as its absolute path, and recorded with its weights'
    fingerprint in ``base_model.json`` (:mod:`tunesmith.models.base_record`): the adapter then
    finds and checks its base from anywhere. Returns the paths written.
    """
    folder = Path(folder)
    record = _base_record(base_model_name_or_path)
    base = record.path if record is not None else base_model_name_or_path
    config = peft_adapter_config(model, base_model_name_or_path=base)
    own = adapter_state_dict(model)
    expected = own if state_dict is None else dict(state_dict)
    if set(expected) != set(own):
        missing, extra = sorted(set(own) - set(expected)), sorted(set(expected) - set(own))
        raise CheckpointError(
            f"state_dict does not hold the model's adapter tensors: missing {missing[:10]}, "
            f"unexpected {extra[:10]}"
        )
    out_dtype = None if dtype is None else resolve_dtype(dtype)
    plain = {k: _plain_cpu(k, v, out_dtype) for k, v in expected.items()}
    plain = _to_peft_fused_tensors(plain, _adapter_groups(model)[1])
    tensors = {
        PEFT_KEY_PREFIX + k: v.contiguous()
        for k, v in _to_peft_expert_tensors(
            plain, _interleaved_experts(model), _input_major_experts(model)
        ).items()
    }
    tensors = _peft_renamed(model, tensors, to_file=True)
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / ADAPTER_WEIGHTS_NAME
    note = warn_peft_misread(
        model, peft_misread_modules(model)
    )  # peft would drop some adapters: said in the file too
    metadata = {"format": "pt"} | ({"tunesmith_peft_note": note} if note else {})
    save_file(tensors, str(weights), metadata=metadata)
    config_path = folder / ADAPTER_CONFIG_NAME
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return [weights, config_path] + ([record.write(folder)] if record is not None else [])


def _peft_renamed(model: nn.Module, named: Mapping[str, Any], *, to_file: bool) -> dict[str, Any]:
    """``named`` (state-dict or layer names) as the family's PEFT folders spell them
    (``to_file``) or as the model's modules do: renamed by ``Family.renames`` where
    transformers' modules carry the files' names (``renames_in_peft``, Llama 4's
    ``feed_forward``); unchanged for the other families (PEFT keeps in-memory names).

    Example::

        >>> from tunesmith.models import llama4
        >>> tiny = llama4.llama4_tiny(device="meta")
        >>> list(_peft_renamed(tiny, {"model.layers.1.mlp.experts": 0}, to_file=True))
        ['model.layers.1.feed_forward.experts']
    """
    specs = (getattr(m, "spec", None) for m in model.modules())
    spec = next((s for s in specs if isinstance(s, ModelSpec)), None)
    if spec is None or not family_for(spec.model_type).renames_in_peft:
        return dict(named)
    renames = spec.checkpoint_renames
    rename = renames.to_disk if to_file else renames.from_disk
    return {rename(f"{key}.")[:-1]: value for key, value in named.items()}


def _base_record(base: str | os.PathLike | None) -> BaseRecord | None:
    """The record of ``base`` when it is a local HF folder (a hub id or None: no record)."""
    if base is None or not (Path(base) / CONFIG_NAME).is_file():
        return None
    return BaseRecord.of(base)


def save_peft_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    base_model_name_or_path: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Atomically write ``model``'s adapters as a PEFT adapter folder; returns ``out_dir``.

    ``peft.PeftModel.from_pretrained(transformers_model, out_dir)`` loads it onto the base
    model. Arguments as :func:`write_peft_adapter`.

    Example::

        >>> from tunesmith.models import llama3
        >>> from tunesmith.modules.peft import apply_lora
        >>> model = apply_lora(llama3.llama3_tiny(), target_modules=["q_proj"], rank=4, alpha=8)
        >>> save_peft_adapter(model, "out/adapter", base_model_name_or_path="Llama-3.2-1B")
        PosixPath('out/adapter')
        >>> sorted(p.name for p in Path("out/adapter").iterdir())
        ['adapter_config.json', 'adapter_model.safetensors']
    """
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_peft_adapter(
            model,
            tmp,
            state_dict=state_dict,
            base_model_name_or_path=base_model_name_or_path,
            dtype=dtype,
        )
    return out_dir


# ----------------------------------------------------------------------------- reading


@dataclass
class PeftAdapter:
    """A PEFT adapter folder read into memory, keys in tunesmith's naming.

    ``layers`` maps a layer name (``model.layers.0.self_attn.q_proj``) to its tensors by kind
    (``lora_A.weight``, ``lora_B.weight``, ``lora_magnitude_vector``); ``base`` holds base
    weights the file replaces (``lm_head.weight`` from PEFT's ``lm_head.base_layer.weight``,
    saved when embedding layers are targeted); ``sources`` maps our keys to file keys;
    ``alphas`` holds layers' alphas that are not the config's (parts of a fused projection).
    """

    folder: Path
    config: dict[str, Any]
    layers: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    base: dict[str, torch.Tensor] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)

    @property
    def weights_file(self) -> Path:
        return self.folder / ADAPTER_WEIGHTS_NAME

    def rank(self, layer: str) -> int:
        return int(self.layers[layer]["lora_A.weight"].shape[0])

    def alpha(self, layer: str) -> float:
        if layer in self.alphas:
            return self.alphas[layer]
        return _pattern_value(
            self.config.get("alpha_pattern") or {}, layer, self.config["lora_alpha"]
        )


def read_peft_adapter(folder: str | os.PathLike) -> PeftAdapter:
    """Read and check a PEFT LoRA/DoRA adapter folder (config and tensors).

    Errors name the file and tensor: unsupported config fields, missing ``lora_A``/``lora_B``
    of a layer, a DoRA magnitude missing (or present without ``use_dora``), ranks that differ
    from ``r``/``rank_pattern``, keys without PEFT's prefix, embedding adapters.
    """
    folder = Path(folder)
    config = read_adapter_config(folder)
    weights = folder / ADAPTER_WEIGHTS_NAME
    if not weights.is_file():
        legacy = folder / "adapter_model.bin"
        hint = (
            f" ({legacy.name} found: only safetensors adapters are read)"
            if legacy.is_file()
            else ""
        )
        raise CheckpointFileNotFoundError(f"{weights} not found{hint}")
    try:
        tensors = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{weights}: not a valid safetensors file: {e}") from e
    adapter = PeftAdapter(folder, config)
    for file_key, tensor in tensors.items():
        if not file_key.startswith(PEFT_KEY_PREFIX):
            raise CheckpointError(
                f"{weights}: tensor '{file_key}' lacks the '{PEFT_KEY_PREFIX}' prefix PEFT writes"
            )
        key = file_key[len(PEFT_KEY_PREFIX) :]
        if "lora_embedding_" in key:
            raise CheckpointError(
                f"{weights}: tensor '{file_key}' is an embedding adapter (not supported)"
            )
        kind = next((k for k in _ADAPTER_KINDS if key.endswith("." + k)), None)
        if kind is not None:
            layer = key[: -len(kind) - 1]
            adapter.layers.setdefault(layer, {})[kind] = tensor
            adapter.sources[key] = file_key
            continue
        if ".lora_" in key:
            raise CheckpointError(
                f"{weights}: unexpected adapter tensor '{file_key}' (expected names ending in "
                f"{', '.join(_ADAPTER_KINDS)})"
            )
        key = key.replace(".base_layer.", ".")
        adapter.base[key] = tensor
        adapter.sources[key] = file_key
    if not adapter.layers:
        raise CheckpointError(f"{weights}: holds no lora_A/lora_B tensors")
    use_dora = bool(config.get("use_dora", False))
    rank_pattern = config.get("rank_pattern") or {}
    expert_layer = re.compile(r"(.*\.)?experts(\.base_layer)?")
    for layer, parts in adapter.layers.items():
        if config.get("target_parameters") and expert_layer.fullmatch(layer):
            continue  # fused MoE expert adapters: checked against the model when loading
        for kind in ("lora_A.weight", "lora_B.weight"):
            if kind not in parts:
                raise CheckpointError(f"{weights}: layer '{layer}' has no {kind} tensor")
        has_mag = "lora_magnitude_vector" in parts
        if use_dora != has_mag:
            state = "lacks" if use_dora else "has"
            raise CheckpointError(
                f"{weights}: layer '{layer}' {state} a lora_magnitude_vector but "
                f"{ADAPTER_CONFIG_NAME} says use_dora={use_dora}"
            )
        a, b = parts["lora_A.weight"], parts["lora_B.weight"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise CheckpointError(
                f"{weights}: layer '{layer}': lora_A {list(a.shape)} and lora_B "
                f"{list(b.shape)} are not [r, in] and [out, r]"
            )
        expected_r = _pattern_value(rank_pattern, layer, config["r"])
        if a.shape[0] != expected_r:
            raise CheckpointError(
                f"{weights}: layer '{layer}' has rank {a.shape[0]}, but {ADAPTER_CONFIG_NAME} "
                f"says r={expected_r}"
            )
    return adapter


def _copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """``param.copy_(tensor)``; a DTensor parameter (FSDP2-sharded model) takes its shard."""
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # torch built without distributed
        DTensor = ()  # noqa: N806
    if isinstance(param, DTensor):
        tensor = distribute_tensor(
            tensor.to(param.device, param.dtype), param.device_mesh, param.placements
        )
    param.copy_(tensor)


def _check_layer(adapter: PeftAdapter, layer: str, module: nn.Module) -> None:
    parts = adapter.layers[layer]
    file = adapter.weights_file
    out_f, in_f = module.out_features, module.in_features
    r = adapter.rank(layer)
    shapes = {"lora_A.weight": (r, in_f), "lora_B.weight": (out_f, r)}
    if "lora_magnitude_vector" in parts:
        shapes["lora_magnitude_vector"] = (out_f,)
    for kind, shape in shapes.items():
        got = tuple(parts[kind].shape)
        if got != shape:
            raise CheckpointError(
                f"{file}: tensor '{adapter.sources[f'{layer}.{kind}']}' has shape {list(got)}, "
                f"the model's '{layer}' needs {list(shape)}"
            )


def load_peft_adapter(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    quantize_base: bool | str = False,
    adapter_dtype: torch.dtype | str | None = None,
) -> nn.Module:
    """Load a PEFT LoRA/DoRA adapter folder into ``model``; returns ``model``.

    A plain model gets the adapters the file describes (layers from the tensor names, rank
    from their shapes, alpha, rsLoRA, DoRA and dropout from ``adapter_config.json``), then
    the weights. A model that already has adapters (e.g. built by ``apply_lora`` from the
    same config, to resume training) must have the same adapted layers, ranks, scalings and
    DoRA-ness; only the weights are loaded. Base weights stored in the file (PEFT saves
    ``lm_head``/embeddings when they are targeted) replace the model's. ``quantize_base``
    (``"nf4"``) quantises the adapted layers' bases after that (QLoRA); ``adapter_dtype``
    sets the dtype of new adapter parameters. Afterwards only adapters require grad.

    An adapter on a projection the family's checkpoints fuse (Phi-3's ``qkv_proj``) becomes
    one per part (``q_proj``, ``k_proj``, ``v_proj``), exactly: each part its block of a
    block-diagonal ``lora_B`` (as :func:`save_peft_adapter` writes it, or in the ranks of the
    model's adapters when resuming), else the whole ``lora_A`` and its rows of ``lora_B``.

    On an FSDP2-sharded model (adapters applied before sharding), every rank calls this and
    each parameter takes its own shard of the file's tensor.
    """
    adapter = read_peft_adapter(folder)
    adapter.layers = _peft_renamed(model, adapter.layers, to_file=False)
    adapter.base = _peft_renamed(model, adapter.base, to_file=False)
    file = adapter.weights_file
    config = adapter.config
    every = adapter_modules(model)
    existing = {n: m for n, m in every.items() if not isinstance(m, ExpertLoRA)}
    existing_experts = {n: m for n, m in every.items() if isinstance(m, ExpertLoRA)}
    use_dora = bool(config.get("use_dora", False))
    use_rslora = bool(config.get("use_rslora", False))
    expert_parts = {
        f"{name}.lora.{proj}": ab
        for name, projs in _expert_adapters(model, adapter).items()
        for proj, ab in projs.items()
    }
    if expert_parts and use_dora:
        raise CheckpointError(f"{file}: DoRA on MoE experts is not supported")
    if expert_parts and resolve_quantize_base(quantize_base) == "nf4":
        raise CheckpointError(f"{file}: QLoRA (quantize_base) on MoE experts is not supported")
    if every and set(existing_experts) != set(expert_parts):
        raise CheckpointError(
            f"{file}: the model's expert adapters differ from the file's: file "
            f"{sorted(expert_parts)[:6]}, model {sorted(existing_experts)[:6]}"
        )
    if not adapter.layers and not expert_parts:
        raise CheckpointError(f"{file}: holds no adapter for this model's layers")
    _split_fused(model, adapter, existing)
    if every and set(existing) != set(adapter.layers):
        missing = sorted(set(adapter.layers) - set(existing))
        extra = sorted(set(existing) - set(adapter.layers))
        raise CheckpointError(
            f"{file}: the model's adapted layers differ from the file's: in the file only "
            f"{missing[:10]}, in the model only {extra[:10]}"
        )
    # Base weights first, while the layers are still plain (and unquantised).
    for key, tensor in adapter.base.items():
        try:
            param = model.get_parameter(key)
        except AttributeError:
            raise CheckpointError(
                f"{file}: tensor '{adapter.sources[key]}' names a base weight '{key}' the "
                f"model does not have"
            ) from None
        if tuple(param.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"{file}: tensor '{adapter.sources[key]}' has shape {list(tensor.shape)}, "
                f"the model's '{key}' has {list(param.shape)}"
            )
        if is_nf4(param):
            raise CheckpointError(
                f"{file}: tensor '{adapter.sources[key]}' replaces '{key}', which is already "
                f"quantised; load the adapter before quantising (quantize_base=)"
            )
        with torch.no_grad():
            _copy_into(param, tensor)
    for layer in adapter.layers:
        rank, alpha = adapter.rank(layer), adapter.alpha(layer)
        if existing:
            module = existing[layer]
            _check_layer(adapter, layer, module)
            if (isinstance(module, DoRALinear), module.rank) != (use_dora, rank) or (
                module.use_rslora,
                module.alpha,
            ) != (use_rslora, alpha):
                raise CheckpointError(
                    f"{file}: layer '{layer}' is rank={rank}, alpha={alpha}, "
                    f"use_rslora={use_rslora}, use_dora={use_dora} in the file but rank="
                    f"{module.rank}, alpha={module.alpha}, use_rslora={module.use_rslora}, "
                    f"use_dora={isinstance(module, DoRALinear)} in the model"
                )
            continue
        try:
            linear = model.get_submodule(layer)
        except AttributeError:
            raise CheckpointError(
                f"{file}: tensor '{adapter.sources[layer + '.lora_A.weight']}' targets "
                f"'{layer}', which the model does not have"
            ) from None
        if not isinstance(linear, nn.Linear):
            raise CheckpointError(
                f"{file}: '{layer}' is a {type(linear).__name__} in the model, not a linear layer"
            )
        _check_layer(adapter, layer, linear)
        try:
            add_adapter(
                model,
                layer,
                rank=rank,
                alpha=alpha,
                dropout=float(config.get("lora_dropout", 0.0)),
                use_rslora=use_rslora,
                use_dora=use_dora,
                adapter_dtype=adapter_dtype,
            )
        except ValueError as e:
            raise CheckpointError(f"{file}: cannot adapt '{layer}': {e}") from e
    alpha = config["lora_alpha"]
    for name, (a, b) in expert_parts.items():
        experts_name, _, proj = name.rpartition(".lora.")
        experts = model.get_submodule(experts_name)
        weight = getattr(experts, proj)
        if (a.shape[0], b.shape[1], a.shape[2]) != (
            weight.shape[0],
            weight.shape[1],
            weight.shape[2],
        ):
            raise CheckpointError(
                f"{file}: expert adapter for '{experts_name}.{proj}' has A {list(a.shape)}, "
                f"B {list(b.shape)}; the model's stacked weight is {list(weight.shape)}"
            )
        module = existing_experts.get(name)
        if module is None:
            module = experts.add_lora(
                proj,
                rank=a.shape[1],
                alpha=alpha,
                dropout=float(config.get("lora_dropout", 0.0)),
                use_rslora=use_rslora,
                dtype=None if adapter_dtype is None else resolve_dtype(adapter_dtype),
            )
        elif (module.rank, module.alpha, module.use_rslora) != (a.shape[1], alpha, use_rslora):
            raise CheckpointError(
                f"{file}: '{name}' is rank={a.shape[1]}, alpha={alpha}, use_rslora={use_rslora} "
                f"in the file but rank={module.rank}, alpha={module.alpha}, "
                f"use_rslora={module.use_rslora} in the model"
            )
        with torch.no_grad():
            _copy_into(module.lora_A, a)
            _copy_into(module.lora_B, b)
    modules = adapter_modules(model)
    with torch.no_grad():
        for layer, parts in adapter.layers.items():
            for kind, tensor in parts.items():
                _copy_into(modules[layer].get_parameter(kind), tensor)
    if resolve_quantize_base(quantize_base) == "nf4":
        for module in modules.values():
            if isinstance(module, ExpertLoRA):
                continue
            module.quantize_base()
    mark_adapters_trainable(model)
    return model


# ----------------------------------------------------------------------------- checking a config


def _lora_on_hf_folder(cfg: Any, key: str) -> tuple[Path, Any] | None:
    """(base folder, ``target_modules``) of ``cfg[key]`` when it is ``apply_lora`` over
    ``from_hf(path)`` of a folder with a ``config.json``; None for any other node (or a broken
    one: the config checks report it)."""
    from tunesmith.config.components import resolve_component  # the allow-list applies

    try:
        node = cfg[key]
        outer, inner = resolve_component(node["_component_"]), node["model"]
        path, targets = inner.get("path"), node["target_modules"]
        if outer is not apply_lora or resolve_component(inner["_component_"]) is not from_hf:
            return None
    except Exception:
        return None
    if not isinstance(path, str) or not (Path(path) / CONFIG_NAME).is_file():
        return None
    return Path(path), targets if isinstance(targets, str) else [str(t) for t in targets]


def peft_misread_in_config(cfg: Any) -> list[str]:
    """One line per top-level LoRA model of ``cfg`` (``apply_lora`` over ``from_hf`` of a local
    folder) whose PEFT folders peft would misread (:mod:`tunesmith.modules.peft.peft_compat`),
    found on a meta-device build: ``tunesmith validate`` prints them, a run logs the same at
    LoRA setup.

    Example::

        >>> from omegaconf import OmegaConf
        >>> peft_misread_in_config(OmegaConf.create({"model": {"path": "nowhere"}}))
        []
    """
    lines = []
    for key in cfg:
        found = _lora_on_hf_folder(cfg, key)
        if found is None:
            continue
        config = language_model_config(read_hf_config(found[0]))[0]
        if config.get("model_type") not in PEFT_EXPERT_NAMES:
            continue
        model = build_model(spec_from_hf_config(config), device="meta")
        try:
            modules = peft_misread_names(model, find_linear_targets(model, found[1]))
        except ValueError:  # targets that match nothing: the run says so when it builds
            continue
        if modules:
            lines.append(f"{key}: warning: {peft_misread_message(model.spec.model_type, modules)}")
    return lines
