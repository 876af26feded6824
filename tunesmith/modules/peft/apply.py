"""Put LoRA/DoRA adapters on chosen linear layers of any model, and take them off again.

Layers are chosen by name, as PEFT does: a list entry matches a module whose dotted name
equals it or ends with ``"." + entry`` (``q_proj``, ``self_attn.o_proj``, ``lm_head``); a
single string other than ``"all-linear"`` is a regular expression the whole name must match;
``"all-linear"`` is every linear layer except ``lm_head`` and MoE routers.

Stacked MoE experts (:class:`~tunesmith.modules.moe.GroupedExperts`, ``[E, ...]`` tensors)
are not linear layers: ``"all-linear"`` leaves them frozen and without adapters, while a list
entry or regex naming their projections (``gate_proj``, ``up_proj``, ``down_proj``; the
stacked name or an expert's ``experts.{i}.gate_proj``) gives every expert its own LoRA
adapter, stacked (:class:`~tunesmith.modules.moe.ExpertLoRA`, computed with grouped matmuls).
``gate_proj`` and ``up_proj`` go together (the PEFT format fuses them); DoRA and QLoRA on
experts are refused.

A family whose checkpoints store projections fused (Phi-3's ``qkv_proj`` and
``gate_up_proj``, GLM-4's ``gate_up_proj``) has them apart in memory; a list entry naming the
fused module (``qkv_proj``, ``self_attn.qkv_proj``) selects its parts (``q_proj``, ``k_proj``,
``v_proj``), as :func:`target_aliases` reads them from the model's ``spec``.

Adapted layers keep their base parameters under the original names, so the base part of
``model.state_dict()`` still has the Hugging Face keys; adapter tensors add
``<layer>.lora_A.weight``, ``<layer>.lora_B.weight`` and, for DoRA,
``<layer>.lora_magnitude_vector``.

Example (also usable from YAML, the model argument being a nested component)::

    >>> from tunesmith.models import llama3
    >>> model = apply_lora(llama3.llama3_tiny(), target_modules=["q_proj", "v_proj"], rank=8, alpha=16)
    >>> sorted(trainable_parameters(model))[:2]
    ['model.layers.0.self_attn.q_proj.lora_A.weight', 'model.layers.0.self_attn.q_proj.lora_B.weight']
    >>> with disable_adapters(model):   # the base model, e.g. as a DPO reference
    ...     ref_logits = model(torch.randint(0, 256, (1, 4)))
    >>> merged = merge_adapters(model)  # plain nn.Linear layers again
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated

import torch
from torch import nn

from tunesmith.config.registry import component
from tunesmith.config.typecheck import Check
from tunesmith.modules.dtypes import DTypeName, dtype_from_name
from tunesmith.modules.moe import PROJECTIONS, ExpertLoRA, GroupedExperts, MoE
from tunesmith.modules.peft.dora import DoRALinear
from tunesmith.modules.peft.lora import LoRALinear
from tunesmith.modules.peft.nf4 import quantize_nf4
from tunesmith.modules.peft.peft_compat import peft_misread_names, warn_peft_misread

__all__ = [
    "ADAPTER_KEY_SUFFIXES",
    "adapter_modules",
    "adapter_state_dict",
    "add_adapter",
    "apply_lora",
    "disable_adapters",
    "find_expert_targets",
    "find_linear_targets",
    "init_adapters",
    "is_adapter_key",
    "mark_adapters_trainable",
    "merge_adapters",
    "peft_misread_modules",
    "resolve_quantize_base",
    "target_aliases",
    "trainable_parameters",
]

# Endings of every adapter tensor name in a state dict (PEFT's names, adapter name dropped).
ADAPTER_KEY_SUFFIXES: tuple[str, ...] = (
    ".lora_A.weight",
    ".lora_B.weight",
    ".lora_magnitude_vector",
    ".lora_A",  # stacked MoE expert adapters (ExpertLoRA): [E, r, in] / [E, out, r]
    ".lora_B",
)


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names an adapter tensor (not a base weight)."""
    return key.endswith(ADAPTER_KEY_SUFFIXES)


def _resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    return None if dtype is None else dtype_from_name(dtype, what="adapter_dtype")


def resolve_quantize_base(quantize_base: bool | str | None) -> str | None:
    """``"nf4"`` for ``True``/``"nf4"``, None for ``False``/None/``"none"``; else an error."""
    if quantize_base is None or quantize_base is False:
        return None
    if quantize_base is True:
        return "nf4"
    if isinstance(quantize_base, str) and quantize_base.lower() in ("nf4", "none"):
        return None if quantize_base.lower() == "none" else "nf4"
    raise ValueError(
        f"quantize_base={quantize_base!r} is not supported: use false, true or 'nf4' (QLoRA)"
    )


QuantizeBase = Annotated[str, Check.raises(resolve_quantize_base)]
"""``quantize_base`` given as text (``nf4``, ``none``): checked by :func:`resolve_quantize_base`
in ``tunesmith validate`` and every run before anything is built."""


# ----------------------------------------------------------------------------- finding layers


def _routers(model: nn.Module) -> set[int]:
    return {id(m.gate) for m in model.modules() if isinstance(m, MoE)}


def _matches(name: str, targets: Sequence[str]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


def target_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Target names that stand for several layers of ``model``: the projections its Hugging
    Face checkpoints store fused, with the layers they are in memory (Phi-3:
    ``{"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}``).

    Read from the ``spec.fused_projections`` of ``model`` or of a module inside it (tunesmith's
    ``ModelSpec``; this layer does not know model families); empty for other models.

    Example::

        >>> from tunesmith.models import llama3, phi3
        >>> target_aliases(phi3.phi3_tiny())["qkv_proj"], target_aliases(llama3.llama3_tiny())
        (('q_proj', 'k_proj', 'v_proj'), {})
    """
    aliases: dict[str, tuple[str, ...]] = {}
    for module in model.modules():
        fused = getattr(getattr(module, "spec", None), "fused_projections", None)
        if isinstance(fused, Mapping):
            aliases.update({name: tuple(parts) for name, parts in fused.items()})
    return aliases


def _expand_aliases(model: nn.Module, target_modules: str | Sequence[str]) -> str | Sequence[str]:
    """``target_modules`` with each list entry that names a fused module (``qkv_proj``,
    ``self_attn.qkv_proj``) and no layer of ``model`` replaced by the names of its parts."""
    if isinstance(target_modules, str):
        return target_modules
    aliases = target_aliases(model)
    if not aliases:
        return target_modules
    names = [name for name, _ in model.named_modules()]
    out: list = []
    for target in target_modules:
        prefix, _, leaf = target.rpartition(".") if isinstance(target, str) else ("", "", "")
        if leaf in aliases and not any(_matches(n, [target]) for n in names):
            out.extend(f"{prefix}.{part}" if prefix else part for part in aliases[leaf])
        else:
            out.append(target)
    return out


def _stacked_projections(model: nn.Module) -> dict[str, tuple[str, GroupedExperts, str]]:
    """``"<experts>.<proj>"`` -> (experts name, module, projection) for every stacked expert."""
    return {
        f"{name}.{proj}": (name, module, proj)
        for name, module in model.named_modules()
        if isinstance(module, GroupedExperts)
        for proj in PROJECTIONS
    }


def _names_expert(target: str, stacked: str, experts: str, proj: str, n: int) -> bool:
    """Whether a ``target_modules`` list entry selects a stacked projection: by the projection
    name (``gate_proj``), the stacked name or one expert's Hugging Face name
    (``experts.0.gate_proj``)."""
    return _matches(stacked, [target]) or any(
        _matches(f"{experts}.{i}.{proj}", [target]) for i in range(n)
    )


def find_expert_targets(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """Names ``<experts>.<proj>`` (e.g. ``model.layers.0.mlp.experts.gate_proj``) of the stacked
    MoE expert projections that ``target_modules`` selects (``"all-linear"``: none).

    A regex must select all experts of a projection or none (it is matched against the stacked
    name and each expert's Hugging Face name ``...experts.{i}.gate_proj``). ``ValueError`` for
    an entry naming the experts container itself, for a projection already adapted and for
    ``gate_proj`` without ``up_proj`` or the reverse (the PEFT format fuses them).

    Example::

        >>> from tunesmith.modules.moe import MoE
        >>> find_expert_targets(nn.ModuleDict({"mlp": MoE(8, 4, num_experts=2, top_k=1)}), ["down_proj"])
        ['mlp.experts.down_proj']
    """
    stacked = _stacked_projections(model)
    if not stacked or target_modules == "all-linear":
        return []
    target_modules = _expand_aliases(model, target_modules)
    containers = sorted({experts for experts, _, _ in stacked.values()})
    if isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        if any(pattern.fullmatch(c) for c in containers):
            raise ValueError(
                f"target_modules regex {target_modules!r} names the MoE experts container "
                f"{containers[0]}; name its projections (gate_proj, up_proj, down_proj)"
            )
        chosen = []
        for name, (experts, module, proj) in stacked.items():
            hits = [
                bool(pattern.fullmatch(name) or pattern.fullmatch(f"{experts}.{i}.{proj}"))
                for i in range(module.num_experts)
            ]
            if any(hits) and not all(hits) and not pattern.fullmatch(name):
                raise ValueError(
                    f"target_modules regex {target_modules!r} selects only some experts of "
                    f"{name}; LoRA goes on all experts of a projection or none"
                )
            if any(hits):
                chosen.append(name)
    else:
        entries = [t for t in target_modules if isinstance(t, str) and t]
        bad = [t for t in entries for c in containers if _matches(c, [t])]
        if bad:
            raise ValueError(
                f"target_modules {sorted(set(bad))} name the MoE experts container (e.g. "
                f"{containers[0]}); name its projections (gate_proj, up_proj, down_proj)"
            )
        chosen = [
            name
            for name, (experts, module, proj) in stacked.items()
            if any(_names_expert(t, name, experts, proj, module.num_experts) for t in entries)
        ]
    chosen_set = set(chosen)
    for name, (experts, module, proj) in stacked.items():
        if name not in chosen_set:
            continue
        if proj in module.lora:
            raise ValueError(f"{name} already has an adapter; apply LoRA once")
        pair = {"gate_proj": "up_proj", "up_proj": "gate_proj"}.get(proj)
        if pair is not None and f"{experts}.{pair}" not in chosen_set:
            raise ValueError(
                f"target_modules select {name} without {experts}.{pair}: adapt gate_proj and "
                f"up_proj of the experts together (the PEFT format fuses them into gate_up_proj)"
            )
    return chosen


def find_linear_targets(model: nn.Module, target_modules: str | Sequence[str]) -> list[str]:
    """Names of the ``nn.Linear`` layers of ``model`` that ``target_modules`` selects.

    Raises ``ValueError`` when an entry matches no linear layer and no stacked MoE expert
    projection (listing the available layer names), and when a selected layer already carries
    an adapter. Stacked experts are not linear layers: :func:`find_expert_targets` finds them.
    An entry naming a fused checkpoint module (:func:`target_aliases`) selects its parts.

    Example::

        >>> from tunesmith.models import phi3
        >>> find_linear_targets(phi3.phi3_tiny(), ["layers.1.self_attn.qkv_proj"])[1]
        'model.layers.1.self_attn.k_proj'
    """
    target_modules = _expand_aliases(model, target_modules)
    experts = find_expert_targets(model, target_modules)
    adapted = adapter_modules(model)
    inside = tuple(f"{name}." for name in adapted)  # lora_A/lora_B are linears too
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, LoRALinear)) and not name.startswith(inside)
    }
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            routers = _routers(model)
            chosen = [
                n
                for n, m in linears.items()
                if n.rpartition(".")[2] != "lm_head" and id(m) not in routers
            ]
        else:
            pattern = re.compile(target_modules)
            chosen = [n for n in linears if pattern.fullmatch(n)]
            if not chosen and not experts:
                raise ValueError(
                    f"target_modules regex {target_modules!r} matches no linear layer; "
                    f"layer names look like {sorted(linears)[:5]}"
                )
    else:
        targets = list(target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"target_modules must be non-empty layer names, got {targets!r}")
        stacked = _stacked_projections(model)
        unmatched = [
            t
            for t in targets
            if not any(_matches(n, [t]) for n in linears)
            and not any(
                _names_expert(t, n, experts_name, proj, module.num_experts)
                for n, (experts_name, module, proj) in stacked.items()
            )
        ]
        if unmatched:
            convs = sorted(  # transformers' GPT-2-style Conv1D: a linear stored [in, out]
                {n.rpartition(".")[2] for n, m in model.named_modules()
                 if type(m).__name__ == "Conv1D" and _matches(n, unmatched)}
            )  # fmt: skip
            if convs:
                raise ValueError(
                    f"target_modules {convs} are transformers Conv1D layers (GPT-2 style, the "
                    "weight stored [in, out]); LoRA adapts nn.Linear layers only"
                )
            leaves = sorted({n.rpartition(".")[2] for n in linears})
            fused = "; ".join(
                f"{name} ({', '.join(parts)})" for name, parts in target_aliases(model).items()
            )
            raise ValueError(
                f"target_modules {unmatched} match no linear layer of "
                f"{type(model).__name__}; linear layer names: {leaves}"
                + (f"; fused checkpoint names: {fused}" if fused else "")
            )
        chosen = [n for n in linears if _matches(n, targets)]
    again = [n for n in chosen if n in adapted]
    if again:
        raise ValueError(f"layers {again[:5]} already have adapters; apply LoRA once")
    return chosen


def _tied_elsewhere(model: nn.Module, name: str, weight: torch.Tensor) -> list[str]:
    own = f"{name}.weight"
    return [
        n for n, p in model.named_parameters(remove_duplicate=False) if p is weight and n != own
    ]


# ----------------------------------------------------------------------------- applying


def add_adapter(
    model: nn.Module,
    name: str,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    use_dora: bool = False,
    quantize_base: bool | QuantizeBase = False,
    adapter_dtype: torch.dtype | DTypeName | None = None,
) -> LoRALinear:
    """Replace the ``nn.Linear`` at ``name`` in ``model`` with a LoRA (or DoRA) layer that
    shares its parameters; returns the new layer. ``apply_lora`` does this for many layers."""
    linear = model.get_submodule(name)
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"'{name}' is a {type(linear).__name__}, not an nn.Linear")
    tied = _tied_elsewhere(model, name, linear.weight)
    if tied:
        raise ValueError(
            f"'{name}.weight' is tied to {tied} (tie_word_embeddings); adapters on tied weights "
            f"are not supported: leave '{name}' out of target_modules"
        )
    if resolve_quantize_base(quantize_base) == "nf4":
        try:
            linear.weight = nn.Parameter(quantize_nf4(linear.weight), requires_grad=False)
        except ValueError as e:
            raise ValueError(f"cannot quantise '{name}.weight' to NF4: {e}") from e
    cls = DoRALinear if use_dora else LoRALinear
    layer = cls.from_linear(
        linear,
        rank=rank,
        alpha=alpha,
        dropout=dropout,
        use_rslora=use_rslora,
        adapter_dtype=_resolve_dtype(adapter_dtype),
    )
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, layer)
    return layer


@component
def apply_lora(
    model: nn.Module,
    *,
    target_modules: str | Sequence[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_rslora: bool = False,
    use_dora: bool = False,
    quantize_base: bool | QuantizeBase = False,
    adapter_dtype: torch.dtype | DTypeName | None = None,
) -> nn.Module:
    """Add adapters to the layers ``target_modules`` selects, freeze everything else.

    Args:
        model: any module (a ``TransformerLM`` of any family); changed in place and returned.
        target_modules: layer names (``["q_proj", "v_proj", "lm_head"]``), a regex over full
            names, or ``"all-linear"`` (see the module docs).
        rank, alpha: LoRA rank ``r`` and ``alpha``; ``scaling = alpha / r``.
        dropout: dropout on the adapters' input.
        use_rslora: ``scaling = alpha / sqrt(r)``.
        use_dora: DoRA layers (a learned magnitude per output feature).
        quantize_base: ``"nf4"`` (or ``True``): store the adapted layers' base weights as NF4
            (QLoRA / QDoRA; needs torchao). Cast the model to its training dtype first.
        adapter_dtype: dtype of the adapter parameters (default: the base weight's).

    After this, only adapter parameters require grad: build the optimizer from
    :func:`trainable_parameters`. Adapters start as an exact no-op.
    Adapters on non-expert MLPs of a MoE model that peft would misread in a PEFT folder log
    one warning (:mod:`tunesmith.modules.peft.peft_compat`).
    """
    names = find_linear_targets(model, target_modules)
    expert_targets = find_expert_targets(model, target_modules)
    if expert_targets and (use_dora or resolve_quantize_base(quantize_base)):
        raise ValueError(
            f"target_modules select MoE expert projections ({expert_targets[0]}, ...): "
            f"{'DoRA' if use_dora else 'QLoRA (quantize_base)'} on experts is not supported; "
            f"use plain LoRA on them or leave gate_proj/up_proj/down_proj out"
        )
    for name in expert_targets:
        experts_name, _, proj = name.rpartition(".")
        experts = model.get_submodule(experts_name)
        assert isinstance(experts, GroupedExperts)
        experts.add_lora(
            proj,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            use_rslora=use_rslora,
            dtype=_resolve_dtype(adapter_dtype),
        )
    for name in names:
        add_adapter(
            model,
            name,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            use_rslora=use_rslora,
            use_dora=use_dora,
            quantize_base=quantize_base,
            adapter_dtype=adapter_dtype,
        )
    mark_adapters_trainable(model)
    warn_peft_misread(model, peft_misread_modules(model))
    return model


# ----------------------------------------------------------------------------- inspecting


def peft_misread_modules(model: nn.Module) -> list[str]:
    """Names of ``model``'s adapted non-expert layers that peft would drop from a PEFT folder
    (:mod:`tunesmith.modules.peft.peft_compat`); empty for experts-only adapters."""
    adapted = adapter_modules(model).items()
    return peft_misread_names(model, [n for n, m in adapted if not isinstance(m, ExpertLoRA)])


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear | ExpertLoRA]:
    """Name -> adapter layer for every LoRA/DoRA layer of ``model`` and every stacked MoE
    expert adapter (``<experts>.lora.<proj>``, an :class:`ExpertLoRA`)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, (LoRALinear, ExpertLoRA))}


def mark_adapters_trainable(model: nn.Module) -> None:
    """Freeze every parameter of ``model`` except the adapters' (which get ``requires_grad``)."""
    for param in model.parameters():
        param.requires_grad_(False)
    for module in adapter_modules(model).values():
        for local in module.adapter_parameter_names():
            module.get_parameter(local).requires_grad_(True)


def trainable_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter for the parameters that require grad (what the optimizer gets)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors of ``model`` under their state-dict names (detached, not copied).

    >>> from tunesmith.models import llama3
    >>> model = apply_lora(llama3.llama3_tiny(), target_modules=["q_proj"], rank=4, alpha=8)
    >>> sorted(adapter_state_dict(model))[0]
    'model.layers.0.self_attn.q_proj.lora_A.weight'
    """
    state = {}
    for name, module in adapter_modules(model).items():
        prefix = f"{name}." if name else ""
        for local in module.adapter_parameter_names():
            state[prefix + local] = module.get_parameter(local).detach()
    return state


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """Re-initialise every adapter (A random, B zero, DoRA magnitude = base norm), e.g. after
    building on the meta device, ``to_empty()`` and loading the base weights."""
    for module in adapter_modules(model).values():
        module.reset_adapter_parameters()


@contextlib.contextmanager
def disable_adapters(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, adapter layers compute their base layer only (the frozen model).

    Raises ``ValueError`` for a model without adapters, so that a full fine-tuning model is
    never silently used as its own reference.
    """
    modules = list(adapter_modules(model).values())
    if not modules:
        raise ValueError(f"{type(model).__name__} has no adapters to disable")
    previous = [m.adapters_disabled for m in modules]
    for m in modules:
        m.adapters_disabled = True
    try:
        yield model
    finally:
        for m, state in zip(modules, previous):
            m.adapters_disabled = state


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain ``nn.Linear`` layers back.

    In place; returns ``model``, whose state dict is then a plain (Hugging Face) one. NF4
    bases are dequantised; the merged weight has the base's (original) dtype and the update
    is computed in float32. Merged weights do not require grad. A tensor-parallel model stays
    one: the merged weight keeps the base's sharding and the layer its input/output hooks.
    """
    for experts in model.modules():
        if isinstance(experts, GroupedExperts):
            experts.merge_lora()
    for name, module in adapter_modules(model).items():
        if not name:
            raise ValueError("merge_adapters takes a model that contains adapter layers")
        weight = module.merged_weight()
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = module.bias
        _take_forward_hooks(linear, module)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
    return model


_FORWARD_HOOK_TABLES = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _take_forward_hooks(linear: nn.Linear, layer: LoRALinear) -> None:
    """Give ``linear`` the forward hooks of the adapter ``layer`` it replaces (those a parallel
    plan put there: tensor parallel's input and output layouts)."""
    for table in _FORWARD_HOOK_TABLES:
        getattr(linear, table).update(getattr(layer, table))
