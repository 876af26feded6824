"""Tensor parallel (TP) and sequence parallel (SP) for the generic decoder: one plan, every family.

The plan is written against Hugging Face parameter names, so it serves every family:

* ``self_attn.{q,k,v}_proj`` and ``mlp.{gate,up}_proj`` column-wise (each rank computes its
  own heads / its own slice of the intermediate width), ``self_attn.o_proj`` and
  ``mlp.down_proj`` row-wise (each rank's partial sums are reduced); attention then runs on
  ``num_heads / tp`` query and ``num_kv_heads / tp`` key/value heads per rank (GQA groups stay
  whole; the per-head qk-norm weights are replicated and their gradients summed over the
  ranks, a qk-norm over the whole projection (OLMo) has its weight sharded with the columns
  and its mean of squares all-reduced; attention biases are sharded with their projection);
  every RMSNorm of a layer's layout (pre, post, sandwich) runs on the residual stream;
* ``model.embed_tokens`` row-wise over the vocabulary (uneven shards allowed: any vocabulary),
  ``lm_head`` column-wise over the vocabulary; a tied head *is* the embedding's sharded
  parameter. Calling ``lm_head`` gathers the logits (generation, full-logits losses); the
  chunked losses (:mod:`tunesmith.modules.losses`) instead read its local vocabulary shard and
  combine max / sum-exp / target logit over the ranks (loss parallel): full logits never exist;
* with ``sequence_parallel`` the residual stream between blocks and the RMSNorms are sharded
  on the sequence dimension (each rank holds ``seq / tp`` positions, so the activations saved
  for backward shrink by ``tp``); attention and MLP inputs are all-gathered, their outputs
  reduce-scattered. A sequence whose length ``tp`` does not divide is right-padded for the
  forward and cut back after it (padding is never attended by a real position). Forwards with
  a KV cache (generation: one new token per step) run with a replicated stream. Without SP
  the stream is replicated and the row-wise outputs are all-reduced;
* LoRA/DoRA layers (``apply_lora`` runs before this) keep their adapters sharded like their
  base layer (:mod:`~tunesmith.training.parallel.tp_adapters`); NF4 (QLoRA) bases are refused;
* MoE layers keep their router and experts replicated over ``tp`` (every rank routes every
  token); ``ep`` splits the experts over data-parallel ranks instead
  (:mod:`~tunesmith.training.parallel.expert_parallel`);
* the body's output (after the final norm) is a plain tensor, the same on every ``tp`` rank,
  so any head (``lm_head``, a reward ``score``, a critic's value head) and any loss sees the
  full hidden states.

Example::

    apply_tensor_parallel(model, ctx.mesh["tp"], sequence_parallel=True)
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from tunesmith.modules.attention import Attention
from tunesmith.modules.moe import MoE
from tunesmith.modules.peft.lora import LoRALinear
from tunesmith.modules.peft.nf4 import is_nf4
from tunesmith.training.parallel.tp_adapters import AdapterColwise, AdapterRowwiseToStream
from tunesmith.training.parallel.tp_styles import (
    Gathered,
    HeadNorm,
    ProjectionNorm,
    RowwiseToStream,
    Stream,
    StreamNorm,
)

__all__ = ["apply_tensor_parallel", "check_tp_shardable"]


def _colwise(linear: nn.Module, **kwargs: Any) -> ParallelStyle:
    """``ColwiseParallel(**kwargs)``, for a LoRA/DoRA layer its adapter form (the adapters
    follow the base's sharding: :mod:`~tunesmith.training.parallel.tp_adapters`)."""
    return AdapterColwise(**kwargs) if isinstance(linear, LoRALinear) else ColwiseParallel(**kwargs)


def _rowwise(linear: nn.Module, stream: Stream) -> ParallelStyle:
    """``RowwiseToStream(stream)``, for a LoRA/DoRA layer its adapter form."""
    return (
        AdapterRowwiseToStream(stream)
        if isinstance(linear, LoRALinear)
        else RowwiseToStream(stream)
    )


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = True
) -> nn.Module:
    """Shard ``model`` (a :class:`~tunesmith.modules.decoder.TransformerLM`, or any model with
    a ``.model`` decoder body and optional ``lm_head``) over the 1-D ``mesh`` in place, as the
    module docs say; returns it. Head counts must divide by the mesh size (checked before:
    :func:`~tunesmith.training.parallelize.check_model_fits`)."""
    tp = mesh.size()
    check_tp_shardable(model)
    body = model.model
    stream = Stream(sequence_parallel)
    parallelize_module(body, mesh, {"embed_tokens": RowwiseToStream(stream)})
    for layer in body.layers:
        attn = layer.self_attn
        if not isinstance(attn, Attention):
            raise TypeError(f"tensor parallel needs tunesmith's Attention, got {type(attn)}")
        after = (layer.layout.attn_out, layer.layout.mlp_out)
        plan: dict[str, ParallelStyle] = {
            "self_attn": Gathered(stream),
            "self_attn.q_proj": _colwise(attn.q_proj),
            "self_attn.k_proj": _colwise(attn.k_proj),
            "self_attn.v_proj": _colwise(attn.v_proj),
            "self_attn.o_proj": _rowwise(attn.o_proj, stream),
            # Norms before a block feed it; norms after one are added to the stream.
            **{name: StreamNorm(stream, local_output=name in after) for name in layer.norm_names},
        }
        if attn.q_norm is not None:
            norm = HeadNorm() if attn.qk_norm_per_head else ProjectionNorm()
            plan["self_attn.q_norm"] = plan["self_attn.k_norm"] = norm
        if isinstance(layer.mlp, MoE):
            plan["mlp"] = Gathered(stream, local=True)
        else:
            plan["mlp"] = Gathered(stream)
            plan["mlp.gate_proj"] = _colwise(layer.mlp.gate_proj)
            plan["mlp.up_proj"] = _colwise(layer.mlp.up_proj)
            plan["mlp.down_proj"] = _rowwise(layer.mlp.down_proj, stream)
        parallelize_module(layer, mesh, plan)
        attn.num_heads //= tp
        attn.num_kv_heads //= tp
    parallelize_module(body, mesh, {"norm": StreamNorm(stream)})
    body.norm.register_forward_hook(
        lambda mod, inputs, out: out.redistribute(placements=(Replicate(),)).to_local()
    )
    body.register_forward_pre_hook(partial(_pad_sequence, stream, tp), with_kwargs=True)
    body.register_forward_hook(_cut_padding, with_kwargs=True)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        _shard_head(model, head, mesh)
    return model


def _pad_sequence(
    stream: Stream, tp: int, body: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Forward pre-hook of the body: pick the stream's layout for this forward and, under SP,
    right-pad a sequence ``tp`` does not divide (padding attends, and is attended by, nothing
    that is kept)."""
    stream.active = stream.sequence_parallel and kwargs.get("kv_cache") is None
    input_ids = args[0] if args else kwargs["input_ids"]
    s = input_ids.shape[-1]
    pad = (-s) % tp if stream.active else 0
    body._tp_cut = s if pad else None
    if not pad:
        return args, kwargs
    kwargs = dict(kwargs)
    ids = F.pad(input_ids, (0, pad))
    args = (ids, *args[1:]) if args else args
    if not args:
        kwargs["input_ids"] = ids
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = F.pad(kwargs["position_ids"], (0, pad), mode="replicate")
    if kwargs.get("document_ids") is not None:
        kwargs["document_ids"] = F.pad(kwargs["document_ids"], (0, pad), value=-1)
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        kwargs["attention_mask"] = F.pad(mask, (0, pad), value=0)
    elif mask is not None:  # [b, 1, s, s] bool: a padded query attends to itself only
        padded = F.pad(mask, (0, pad, 0, pad), value=False)
        eye = torch.eye(s + pad, dtype=torch.bool, device=mask.device)
        eye[:s] = False
        kwargs["attention_mask"] = padded | eye
    return args, kwargs


def _cut_padding(body: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
    """Forward hook of the body: drop the positions :func:`_pad_sequence` added."""
    s = body._tp_cut
    if s is None:
        return out
    if isinstance(out, tuple):  # (hidden, router logits [b * s_padded, experts] per layer)
        hidden, router_logits = out
        b, padded = hidden.shape[:2]
        cut = tuple(r.view(b, padded, -1)[:, :s].reshape(b * s, -1) for r in router_logits)
        return hidden[:, :s], cut
    return out[:, :s]


def _shard_head(model: nn.Module, head: nn.Module, mesh: DeviceMesh) -> None:
    """``lm_head`` column-wise over the vocabulary, its logits gathered when called; a tied
    head takes the embedding's (already sharded) parameter."""
    style = _colwise(head, output_layouts=Replicate())
    if getattr(model, "tie_word_embeddings", False):
        head.weight = model.model.embed_tokens.weight
        style._partition_linear_fn = lambda *args: None  # the parameter is already sharded
    parallelize_module(head, mesh, style)


def check_tp_shardable(model: nn.Module) -> None:
    """Refuse, naming the weight, an NF4 (QLoRA) base weight: torchao's NF4 tensors cannot be
    split into tensor-parallel shards (use data parallel, ``dp_shard``, for QLoRA)."""
    for name, param in model.named_parameters():
        if is_nf4(param.data if isinstance(param, nn.Parameter) else param):
            raise ValueError(
                f"{name}: an NF4 (QLoRA) weight cannot be tensor-parallel sharded; train QLoRA "
                "with tp: 1 (shard it with dp_shard instead) or without quantize_base"
            )
