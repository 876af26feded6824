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

A model of the transformers backend (:class:`~tunesmith.models.transformers_backend.TransformersLM`)
follows transformers' own plan for its class instead (:func:`transformers_plan`), translated
into torch's styles: ``colwise`` / ``rowwise`` as above (LoRA/DoRA layers too),
``colwise_gather_output`` (the head: logits gathered, a tied head the embedding's parameter)
and ``rowwise_split_input`` (a row-wise layer that cuts its replicated input itself),
``embedding_rowwise`` over the vocabulary, ``replicated_with_grad_allreduce`` (per-head
qk-norms) as the native per-head norm. transformers' attention finds the local head count
from the projections' widths, so nothing else changes; the residual stream stays replicated
(no sequence parallel) and the modules the plan leaves out (the residual stream's norms)
keep plain, replicated parameters, whose gradients are whole on every rank (each column-wise
layer all-reduces its input's gradient); a per-head norm's would not be, hence its style. Any other style, or a plan that leaves a decoder
layer out (transformers has none for LFM2's layers), is refused before anything is changed.

Example::

    apply_tensor_parallel(model, ctx.mesh["tp"], sequence_parallel=True)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.parallel.style import ParallelStyle

from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.modules.attention import Attention
from tunesmith.modules.mla import MultiHeadLatentAttention
from tunesmith.modules.moe import MoE
from tunesmith.modules.peft.lora import LoRALinear
from tunesmith.modules.peft.nf4 import is_nf4
from tunesmith.training.parallel.tp_adapters import AdapterColwise, AdapterRowwiseToStream
from tunesmith.training.parallel.tp_styles import (
    Gathered,
    HeadNorm,
    ProjectionNorm,
    Replicated,
    RowwiseToStream,
    Stream,
    StreamNorm,
)

__all__ = [
    "TRANSFORMERS_STYLES",
    "apply_tensor_parallel",
    "check_tp_shardable",
    "transformers_plan",
]

TRANSFORMERS_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
                       "embedding_rowwise", "replicated_with_grad_allreduce")  # fmt: skip
"""The styles of transformers' tensor-parallel plans that :func:`transformers_plan` translates."""


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
    a ``.model`` decoder body and optional ``lm_head``; a transformers-backend model by its
    own plan, :func:`transformers_plan`) over the 1-D ``mesh`` in place, as the module docs
    say; returns it. Head counts must divide by the mesh size (checked before:
    :func:`~tunesmith.training.parallelize.check_model_fits`)."""
    tp = mesh.size()
    check_tp_shardable(model)
    if isinstance(model, TransformersLM):
        return _apply_transformers_plan(model, mesh, sequence_parallel)
    body = model.model
    stream = Stream(sequence_parallel)
    parallelize_module(body, mesh, {"embed_tokens": RowwiseToStream(stream)})
    for layer in body.layers:
        attn = layer.self_attn
        if not isinstance(attn, (Attention, MultiHeadLatentAttention)):
            raise TypeError(f"tensor parallel needs tunesmith's Attention, got {type(attn)}")
        after = (layer.layout.attn_out, layer.layout.mlp_out)
        plan: dict[str, ParallelStyle] = {
            "self_attn": Gathered(stream),
            **_projections_plan(attn),
            "self_attn.o_proj": _rowwise(attn.o_proj, stream),
            # Norms before a block feed it; norms after one are added to the stream.
            **{name: StreamNorm(stream, local_output=name in after) for name in layer.norm_names},
        }
        if getattr(attn, "q_norm", None) is not None:
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
        _shard_sinks(attn, mesh)
        attn.num_heads //= tp
        if isinstance(attn, Attention):  # MLA's cached latent is one replicated "head"
            attn.num_kv_heads //= tp
    parallelize_module(body, mesh, {"norm": StreamNorm(stream)})
    body.norm.register_forward_hook(
        lambda mod, inputs, out: out.redistribute(placements=(Replicate(),)).to_local()
    )
    body.register_forward_pre_hook(partial(_pad_sequence, stream, tp), with_kwargs=True)
    body.register_forward_hook(_cut_padding, with_kwargs=True)
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        tied = getattr(model, "tie_word_embeddings", False)
        _shard_head(head, mesh, body.embed_tokens if tied else None)
    return model


def _projections_plan(attn: nn.Module) -> dict[str, ParallelStyle]:
    """The styles of an attention's input projections. GQA: q, k and v column-wise (by head).
    Multi-head latent attention: the query's and the keys/values' up-projections (``q_b_proj``
    or ``q_proj``, ``kv_b_proj``) column-wise by head; what makes the latents (``q_a_proj``,
    ``kv_a_proj_with_mqa``) and their norms replicated, so every rank holds the whole latent
    and its cache (the module takes the latents local; see ``mla._local``)."""
    if isinstance(attn, Attention):
        return {
            f"self_attn.{n}": _colwise(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")
        }
    names = ["q_proj"] if attn.mla.q_lora_rank is None else ["q_b_proj"]
    plan: dict[str, ParallelStyle] = {f"self_attn.{n}": _colwise(getattr(attn, n)) for n in names}
    plan["self_attn.kv_b_proj"] = _colwise(attn.kv_b_proj)
    replicated = ["kv_a_proj_with_mqa", "kv_a_layernorm"]
    if attn.mla.q_lora_rank is not None:
        replicated += ["q_a_proj", "q_a_layernorm"]
    plan.update({f"self_attn.{n}": Replicated() for n in replicated})
    return plan


def _shard_sinks(attn: Attention, mesh: DeviceMesh) -> None:
    """Attention sinks (gpt-oss, one per query head): each rank keeps its own heads'."""
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        shard = distribute_tensor(sinks.detach(), mesh, [Shard(0)])
        attn.sinks = nn.Parameter(shard, requires_grad=sinks.requires_grad)


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


def _shard_head(head: nn.Module, mesh: DeviceMesh, tied_to: nn.Module | None) -> None:
    """``lm_head`` column-wise over the vocabulary, its logits gathered when called; a head
    tied to an embedding (``tied_to``) takes its (already sharded) parameter."""
    style = _colwise(head, output_layouts=Replicate())
    if tied_to is not None:
        head.weight = tied_to.weight
        style._partition_linear_fn = lambda *args: None  # the parameter is already sharded
    parallelize_module(head, mesh, style)


# -- the transformers backend: transformers' own plan --------------------------------------------


def transformers_plan(model: TransformersLM, tp: int) -> dict[str, str]:
    """transformers' tensor-parallel plan of ``model``'s class (``hf_model.tp_plan``: the
    base model's ``base_model_tp_plan`` under its prefix, the embedding and ``lm_head``), as
    ``{module name: style}`` for each module it names; a :class:`ValueError` (one line naming
    the model type and the entry) for what :data:`TRANSFORMERS_STYLES` cannot run: another
    style, a style on a module of the wrong kind, an entry naming a parameter, a decoder layer
    the plan leaves out, head counts ``tp`` does not divide.

    Example::

        >>> from tunesmith.models.transformers_backend import build_transformers_model, tiny_config
        >>> model = build_transformers_model(tiny_config("starcoder2"))
        >>> plan = transformers_plan(model, 2)
        >>> plan["lm_head"], plan["model.layers.0.mlp.c_proj"]
        ('colwise_gather_output', 'rowwise')
        >>> transformers_plan(build_transformers_model(tiny_config("lfm2")), 2)
        Traceback (most recent call last):
        ValueError: tensor parallel: transformers' plan for lfm2 leaves decoder layer ...
    """
    model_type = model.spec.model_type
    where = f"tensor parallel: transformers' plan for {model_type}"
    for field in ("num_attention_heads", "num_key_value_heads"):
        if getattr(model.spec, field) % tp:
            raise ValueError(f"{where}: tp {tp} does not divide its {field}")
    modules = dict(model.named_modules())
    params = [name for name, _ in model.named_parameters()]
    plan: dict[str, str] = {}
    hf = model.hf_model
    hf_plan = getattr(hf, "tp_plan", None) or getattr(hf, "_tp_plan", None) or {}  # 4.x: _tp_plan
    for entry, style in hf_plan.items():
        pattern = re.compile(re.escape(entry).replace(r"\*", r"[^.]+"))
        names = [name for name in modules if pattern.fullmatch(name)]
        if style not in TRANSFORMERS_STYLES:
            raise ValueError(f"{where}: {entry!r} is {style!r}, which tunesmith does not run "
                             f"(it runs {', '.join(TRANSFORMERS_STYLES)}); use tp: 1")  # fmt: skip
        if not names and any(pattern.fullmatch(name) for name in params):
            raise ValueError(f"{where}: {entry!r} ({style!r}) names a parameter; use tp: 1")
        for name in names:
            if not _fits(style, modules[name]):
                kind = type(modules[name]).__name__
                raise ValueError(f"{where}: {name!r} is {style!r}, which cannot take a {kind}")
            plan[name] = style
    names = {id(module): name for name, module in modules.items()}
    for layer in model.layers:
        if not any(name.startswith(names[id(layer)] + ".") for name in plan):
            raise ValueError(f"{where} leaves decoder layer {names[id(layer)]!r} out; use tp: 1")
    head, embed = model.lm_head, model.hf_model.get_input_embeddings()
    if head.weight is embed.weight and (names[id(head)] in plan) != (names[id(embed)] in plan):
        raise ValueError(f"{where} shards only one of the tied embedding and lm_head")
    return plan


def _fits(style: str, module: nn.Module) -> bool:
    """Whether ``style`` runs on ``module``: linears (a LoRA/DoRA layer not
    ``rowwise_split_input``), an embedding, a norm (no children, 1-D parameters)."""
    if style == "embedding_rowwise":
        return isinstance(module, nn.Embedding)
    if style == "replicated_with_grad_allreduce":
        return not list(module.children()) and all(p.dim() == 1 for p in module.parameters())
    if isinstance(module, LoRALinear):
        return style != "rowwise_split_input"
    return isinstance(module, nn.Linear)


def _apply_transformers_plan(
    model: TransformersLM, mesh: DeviceMesh, sequence_parallel: bool
) -> TransformersLM:
    """Shard a transformers-backend model by :func:`transformers_plan` (module docs)."""
    if sequence_parallel:
        raise ValueError(
            f"sequence parallel: the transformers backend ({model.spec.model_type}) has none; "
            "set parallelism.sequence_parallel: false"
        )
    plan = transformers_plan(model, mesh.size())
    head, embed = model.lm_head, model.hf_model.get_input_embeddings()
    tied = head.weight is embed.weight
    replicated = Stream(sequence_parallel=False)
    styles: dict[str, Callable[[nn.Module], ParallelStyle]] = {
        "colwise": _colwise,
        "rowwise": lambda m: _rowwise(m, replicated),
        "colwise_gather_output": lambda m: _colwise(m, output_layouts=Replicate()),
        "rowwise_split_input": lambda m: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda m: RowwiseToStream(replicated),
        "replicated_with_grad_allreduce": lambda m: HeadNorm(),
    }
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if modules[name] is not head:
            parallelize_module(modules[name], mesh, styles[style](modules[name]))
    if head in (modules[name] for name in plan):  # whatever its style: full logits when called
        _shard_head(head, mesh, embed if tied else None)
    return model


def check_tp_shardable(model: nn.Module) -> None:
    """Refuse, naming the weight, an NF4 (QLoRA) base weight: torchao's NF4 tensors cannot be
    split into tensor-parallel shards (use data parallel, ``dp_shard``, for QLoRA)."""
    for name, param in model.named_parameters():
        if is_nf4(param.data if isinstance(param, nn.Parameter) else param):
            raise ValueError(
                f"{name}: an NF4 (QLoRA) weight cannot be tensor-parallel sharded; train QLoRA "
                "with tp: 1 (shard it with dp_shard instead) or without quantize_base"
            )
