"""Projections a family stores fused on disk and tunesmith keeps apart in memory.

Phi-3 stores ``self_attn.qkv_proj`` (q, k and v rows stacked) and ``mlp.gate_up_proj`` (gate
then up); GLM-4 stores ``mlp.gate_up_proj``. tunesmith's modules keep ``q_proj``/``k_proj``/
``v_proj`` and ``gate_proj``/``up_proj``, so tensor parallel, LoRA targets and every plan
work unchanged; only the Hugging Face files see the fused names. A family declares them in
``Family.fused`` (``{"qkv_proj": ("q_proj", "k_proj", "v_proj")}``), and the checkpoint code
fuses on save (:func:`fuse_state`) and reads each part as rows of the fused tensor on load
(:func:`fused_parts`).

Example::

    >>> state = {"layers.0.q_proj.weight": torch.zeros(4, 2), "layers.0.k_proj.weight":
    ...     torch.ones(2, 2), "layers.0.v_proj.weight": torch.ones(2, 2)}
    >>> fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}
    >>> {k: list(v.shape) for k, v in fuse_state(state, fused).items()}
    {'layers.0.qkv_proj.weight': [8, 2]}
    >>> parts = fused_parts(state, fused)
    >>> parts["layers.0.k_proj.weight"]
    ('layers.0.qkv_proj.weight', 4, 6)
    >>> split_state(fuse_state(state, fused), parts).keys() == state.keys()
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["fuse_state", "fused_parts", "split_state"]


def _groups(
    keys: Mapping[str, Any], fused: Mapping[str, tuple[str, ...]]
) -> Iterator[tuple[str, list[str]]]:
    """``(fused key, [part keys in order])`` for every complete group of parts in ``keys``."""
    for key in keys:
        owner, _, leaf = key.rpartition(".")  # "...self_attn.q_proj", "weight"
        parent, _, module = owner.rpartition(".")
        for fused_name, parts in fused.items():
            if module != parts[0]:
                continue
            prefix = f"{parent}." if parent else ""
            names = [f"{prefix}{part}.{leaf}" for part in parts]
            if all(name in keys for name in names):
                yield f"{prefix}{fused_name}.{leaf}", names


def fuse_state(
    state: Mapping[str, torch.Tensor], fused: Mapping[str, tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """``state`` with each group of parts replaced by their rows stacked under the fused name
    (in ``state``'s order, the fused key where its first part was)."""
    if not fused:
        return dict(state)
    groups = dict(_groups(state, fused))
    firsts = {names[0]: key for key, names in groups.items()}
    merged = {name for names in groups.values() for name in names}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if key in firsts:
            out[firsts[key]] = torch.cat([state[name] for name in groups[firsts[key]]])
        elif key not in merged:
            out[key] = tensor
    return out


def fused_parts(
    state: Mapping[str, Any], fused: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, int, int]]:
    """For each part key of ``state`` (tensors, or anything with a ``.shape``): the fused key
    it is read from and its rows ``[start, stop)`` there."""
    parts: dict[str, tuple[str, int, int]] = {}
    for key, names in _groups(state, fused):
        start = 0
        for name in names:
            stop = start + int(state[name].shape[0])
            parts[name] = (key, start, stop)
            start = stop
    return parts


def split_state(
    state: Mapping[str, torch.Tensor], parts: Mapping[str, tuple[str, int, int]]
) -> dict[str, torch.Tensor]:
    """A state dict with fused tensors (HF keys) as tunesmith's parts: ``parts`` from
    :func:`fused_parts` of the model's own state dict; other keys pass through."""
    out = {key: tensor for key, tensor in state.items() if key not in _fused_keys(parts)}
    for key, (name, start, stop) in parts.items():
        if name in state:
            out[key] = state[name][start:stop]
    return out


def _fused_keys(parts: Mapping[str, tuple[str, int, int]]) -> set[str]:
    return {name for name, _, _ in parts.values()}
