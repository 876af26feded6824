"""Estimate the peak training memory of a decoder for one configuration, before training.

:func:`estimate_memory` adds up what one training step keeps alive on one rank, from the
parameter shapes of the model and the sizes in its ``spec`` (hidden ``H``, intermediate
``I``, heads ``nh``, key/value heads ``nkv``, head width ``hd``, vocab ``V``, layers ``L``),
for ``T = batch_size * seq_len`` tokens (one data-parallel rank's micro-batch). The parallel
layout (``parallel``, a :class:`~tunesmith.training.parallel.distributed.ParallelDims`) has ``tp``
tensor-parallel ranks (``sp``: sequence parallel on), ``d = dp_shard`` ranks FSDP2 shards over
and ``dp_replicate`` copies; one device is ``tp = d = 1``. The numbers are those of the
heaviest rank (rank 0: uneven shards are rounded up):

* **weights** ``W``: every parameter, its shard on this rank: a tensor-parallel weight
  (q/k/v, gate/up, o/down, embedding and head over the vocabulary) holds ``1/tp`` of its
  size, a replicated one (norms, MoE router and experts) all of it; FSDP2 then splits dim 0
  of that over ``d`` (rounded up: its padded shard). Under FSDP2 (``dp_replicate * d > 1``)
  **gathered weights** are in flight, at their tensor-parallel size: the root's parameters
  ``Ur`` (embedding, final norm, head; gathered from the root's forward to the end of
  backward) and, while a layer runs its backward, two layers ``Ul`` (the gathered layer
  and its unsharded gradients before their reduce-scatter, or the next layer prefetched);
* **optimizer states** ``O``: per trainable parameter's shard, AdamW keeps two tensors of the
  parameter's dtype (bitsandbytes' ``AdamW32bit`` two float32 ones), 8-bit AdamW about 2
  bytes, 4-bit about 1, SGD none (one with momentum);
* **gradients** ``G``: one per trainable parameter's shard (only the largest shard at a time
  with the optimizer in backward);
* **activations** ``A``: what autograd saves for backward. For a layer that is not
  checkpointed, bytes per token of the sequence (``a`` = activation bytes, ``r`` = the
  residual stream's, i.e. the weights' dtype; RMSNorm computes in float32)::

      norms        n * (4H + rH + 4) / s       input kept in fp32 and normed, for each of the
                                               layer's n norms (2; 4 in the sandwich layouts)
      layer inputs 2rH                         the normed, weighted input attention and the
                                               MLP save for their weight gradients (under SP
                                               the all-gathered input: the whole sequence)
      attention    (a*(2*nh + 2*nkv)*hd + 4*nh) / tp   q, k, v after RoPE, output, log-sum-exp
                   (a block-causal mask with grouped heads: k and v are repeated to nh
                    heads, a*4*nh*hd / tp; and SDPA keeps the mask as a float a*s per token)
      qk-norm      ((4 + a)*(nh + nkv)*hd) / tp (Qwen3) the per-head norms' inputs and outputs
      soft-cap     nh * S * (2a + 4) / tp      capped attention scores written out (Gemma 2):
                                               tanh, float32 softmax and its copy, for the
                                               S keys each query sees (on CUDA flex attention
                                               caps inside its kernel: an upper bound there)
      MLP          4*a*I / tp                  gate, SiLU(gate), up, their product
                   (MoE: top_k experts * (4*a*I_moe + a*H), plus router tensors; experts
                    are replicated under TP: not divided)
      autocast     10H                         16-bit copies of the q/k/v/gate/up inputs
                                               (fp32 weights under bf16/fp16 autocast)

  where ``s = tp`` with sequence parallel (each rank keeps ``T / tp`` positions of the
  residual stream and its norms) and ``s = 1`` without. A layer under full checkpointing
  keeps only its input (``rH / s`` per token); selective checkpointing keeps its input, the
  matmul outputs and the attention outputs (``rH / s + (a*(nh + 2nkv)*hd + a*nh*hd + 4nh +
  2aI) / tp + 2aH``: the row-wise o/down outputs are whole partial sums). Either way one
  layer is recomputed at a time in backward, so one full layer's activations are added
  once. The final norm adds ``(4H + rH) / s + rH`` per token (its output, gathered, feeds
  the head);
* **logits** ``Lg``: full cross-entropy materialises the ``[T, V]`` logits (under TP the
  head's output is gathered: whole on every rank) and, at the start of backward, about three
  float32 copies (saved log-softmax, its gradient, the logits' gradient): ``12 * T * V``
  bytes (``+ a*T*V`` for 16-bit logits). Linear cross-entropy keeps the trained rows and
  their gradient, and one chunk of ``c`` rows of float32 logits that become their own
  gradient (``4 * c * V / tp``: under TP the loss is vocabulary-parallel, each rank scores
  its own shard of the head; ``c`` rows as the loss chunks ``T``, see
  ``LinearCrossEntropyLoss.rows_per_chunk``), plus a float32 weight-gradient sum for a
  16-bit head (``4 * V * H / tp``); ``T`` is taken as all tokens trained (an upper bound);
  the head's gradient ``Hg`` is ``r * V * H / tp``;
* **step temporaries** ``S``: the optimizer step's scratch (none for torch's fused AdamW;
  the ``foreach`` kernels of a CUDA optimizer about one copy of the trainable shards;
  otherwise two copies of the largest shard; a low-bit optimizer off CUDA about five float32
  copies of the largest one, as measured for bitsandbytes' CPU step, which allocates them
  outside torch's dispatcher).

The peak is ``W + O + max(A + Hg + C + Ur + max(Lg, R + Ul), G + S)``: at the start of
backward every activation, the logits' gradients and the head's gradient ``Hg`` are alive
(``C``: the autocast weight cache, 16-bit copies of the matmul weights under autocast); the
first layers' backward (``R``: the layer recomputed under checkpointing) comes once the
logits are freed; by the optimizer step the activations are gone and every gradient
exists. In between, gradients grow as activations are freed. LoRA is accounted for through
``requires_grad``: only trainable parameters get gradients and states (activations are
estimated as for full fine-tuning, an upper bound).
**The transformers backend** (a :class:`~tunesmith.models.transformers_backend.TransformersLM`,
``spec.backend == "transformers"``): weights, gradients and optimizer states are priced from
its parameters as for any model (exact), but its layers are transformers' own code, whose
norms, MLP shape and extras the planner cannot know; their activations are estimated from the
config sizes alone (``hidden_size``, ``intermediate_size``, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``num_hidden_layers``) as a generic llama-like layer:
two pre-norms, attention as above, a gated MLP ``4*a*I`` (a model with routed experts:
``top_k`` experts of ``moe_intermediate_size``, or ``intermediate_size`` where the config has
no such key, in every layer), no qk-norm, soft cap or sandwich norms. The plan's table says so
on its last line (:data:`GENERIC_LAYER_BASIS`). Checked against measured activations of
StarCoder 2 (a plain GELU MLP: the estimate is high, about 1.6x) in
``tests/memory/test_planner_transformers.py``.
**Context parallel** (``cp``): each rank keeps ``ceil(seq_len / 2cp) * 2`` positions of every
row (its zigzag share, padding included), so every per-token term above (attention and the
other sequence-sharded activations, the loss rows, the RoPE tables and masks) is that of the
rank's share; FSDP2 shards over ``dp_shard x cp`` ranks (``d = dp_shard * cp``).
**Expert parallel** (``ep``): the stacked experts keep ``E / ep`` experts per rank, not split by
FSDP2 (nor gathered), and so do their gradients and optimizer states; each MoE layer adds its
all-to-all buffers, ``2 * top_k * a * H`` per token (the rows received by this rank's experts
and the rows sent back; routing taken as balanced, so the experts see ``top_k`` rows per local
token as without EP). Both checked against measured per-rank peaks (cp 2 on a dense model,
ep 2 on a Qwen3-MoE, within 6%): ``benchmarks/results/parallel_memory_cp_ep.md``. Not modelled: the
very end of backward, where the embedding's gradient is built while every other gradient exists
(from a buffer of the whole vocabulary, even under TP; with a tied head, plus its sum with the
head's gradient), which sets the peak only when the activations are small next to the embedding (one
short sequence through one or two layers), not at the shapes ``benchmarks/parallel_memory.py``
checks the model on (its measured per-rank peaks: ``benchmarks/results/parallel_memory.md``).

Example::

    >>> from tunesmith.models import qwen3
    >>> model = qwen3.qwen3_0_6b(device="meta")  # real size, no memory
    >>> plan = estimate_memory(model, batch_size=4, seq_len=1024, optimizer="adamw")
    >>> print(plan.table())
    memory plan: batch 4 x seq 1024
      weights                                 2.22 GiB
      gradients                               2.22 GiB
      optimizer states                        4.44 GiB
      activations (120.16 KiB/token/layer)   13.19 GiB
      logits / loss                           6.96 GiB
      head gradient (start of backward)     593.50 MiB
      optimizer step temporaries              1.16 GiB
      estimated peak (backward)              27.39 GiB
    >>> plan.total > plan.weights
    True
    >>> per_rank = estimate_memory(model, batch_size=1, seq_len=1024,
    ...                            parallel=ParallelDims(tp=2, dp_shard=2))
    >>> per_rank.weights < plan.weights
    True
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tunesmith.modules.decoder import NORM_LAYOUTS
from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.training.memory.usage import storage_bytes
from tunesmith.training.parallel.distributed import ParallelDims

__all__ = [
    "GENERIC_LAYER_BASIS",
    "OPTIMIZER_KINDS",
    "MemoryPlan",
    "activation_bytes_per_token",
    "estimate_memory",
    "optimizer_kind",
    "tp_shard_dim",
]

# Optimizer state bytes per trainable parameter, as a function of the parameter's bytes.
_STATE_BYTES = {
    "adamw": lambda p: 2 * p,
    "adamw_fused": lambda p: 2 * p,  # torch's fused kernel: no step scratch
    "adamw32bit": lambda p: 8,  # float32 moments whatever the parameter's dtype
    "sgd": lambda p: 0,
    "sgd_momentum": lambda p: p,
    "adamw8bit": lambda p: 2 + 2 * 4 / 256,  # int8 moments + one float32 scale per block
    "adamw4bit": lambda p: 1 + 2 * 4 / 128,
}
OPTIMIZER_KINDS = tuple(_STATE_BYTES)

Checkpointing = Literal["full", "selective"] | None

GENERIC_LAYER_BASIS = (
    "estimated from config sizes as a generic llama-like layer; transformers backend"
)
"""How the activations of a transformers-backend model are priced (the plan's table says it)."""

# The tensor-parallel plan by parameter name (tunesmith.training.parallel.tensor_parallel):
# column-wise projections and the vocabulary-sharded embedding and head split dim 0, row-wise ones
# dim 1; an adapter follows its base layer (tunesmith.training.parallel.tp_adapters: LoRA's B and
# DoRA's magnitude column-wise, A row-wise); the rest is replicated.
_TP_DIM0 = re.compile(
    r"(?:^|\.)(?:self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)"
    r"\.(?:weight|bias|lora_B\.weight|lora_magnitude_vector)$"
    r"|(?:^|\.)(?:embed_tokens|lm_head)\.weight$"
)
_TP_DIM1 = re.compile(r"(?:^|\.)(?:self_attn\.o_proj|mlp\.down_proj)\.(?:weight|lora_A\.weight)$")
# The stacked experts ([E, ...]) that expert parallel splits over the ep ranks.
_EXPERTS = re.compile(r"(?:^|\.)experts\.(?:gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes of each term of a training step on one rank and the resulting peak
    (``total``).

    Terms as in the module docstring: ``weights`` W, ``gradients`` G, ``optimizer_states``
    O, ``activations`` A, ``logits`` Lg, ``head_gradient`` Hg, ``recompute`` R,
    ``autocast_weights`` C, ``gathered_root`` Ur, ``gathered_layers`` Ul,
    ``step_temporaries`` S. ``activations_per_token_layer`` is the bytes one un-checkpointed
    layer keeps per token; ``tokens`` the tokens of the batch on this rank (``batch_size *
    seq_len``; under context parallel ``seq_len`` is the rank's share of each row);
    ``world_size`` the ranks of ``parallel`` (the layout; None: one device);
    ``activation_basis`` how the activations were estimated where that is not from the
    native family's own layout (:data:`GENERIC_LAYER_BASIS` for the transformers backend),
    stated on the table's last line.
    """

    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int
    head_gradient: int
    recompute: int
    autocast_weights: int
    step_temporaries: int
    activations_per_token_layer: int
    batch_size: int
    seq_len: int
    world_size: int = 1
    gathered_root: int = 0
    gathered_layers: int = 0
    parallel: ParallelDims | None = None
    activation_basis: str = ""

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def backward_peak(self) -> int:
        """Bytes above weights and states at the start of backward."""
        kept = self.activations + self.head_gradient + self.autocast_weights + self.gathered_root
        return kept + max(self.logits, self.recompute + self.gathered_layers)

    @property
    def step_peak(self) -> int:
        """Bytes above weights and states during the optimizer step."""
        return self.gradients + self.step_temporaries

    @property
    def total(self) -> int:
        return self.weights + self.optimizer_states + max(self.backward_peak, self.step_peak)

    def table(self) -> str:
        """A small aligned table of the terms and the peak, in MiB/GiB."""
        rows = [
            ("weights", self.weights),
            ("gradients", self.gradients),
            ("optimizer states", self.optimizer_states),
            (f"activations ({_size(self.activations_per_token_layer)}/token/layer)",
             self.activations),
            ("logits / loss", self.logits),
            ("recomputed layer (checkpointing)", self.recompute),
            ("head gradient (start of backward)", self.head_gradient),
            ("autocast weight copies", self.autocast_weights),
            ("gathered root weights (FSDP2)", self.gathered_root),
            ("gathered layers (FSDP2, in backward)", self.gathered_layers),
            ("optimizer step temporaries", self.step_temporaries),
        ]  # fmt: skip
        per_rank = ""
        if self.world_size > 1:
            per_rank = f", per rank of {self.world_size}"
            if self.parallel is not None:
                per_rank += f" ({_layout_name(self.parallel)})"
        lines = [f"memory plan: batch {self.batch_size} x seq {self.seq_len}{per_rank}"]
        width = max(len(name) for name, _ in rows)
        lines += [f"  {name:<{width}}  {_size(value):>10}" for name, value in rows if value]
        phase = "backward" if self.backward_peak >= self.step_peak else "optimizer step"
        lines.append(f"  {'estimated peak (' + phase + ')':<{width}}  {_size(self.total):>10}")
        if self.activation_basis:
            lines.append(f"  activations ({self.activation_basis})")
        return "\n".join(lines)


def _layout_name(dims: ParallelDims) -> str:
    """A short name of a parallel layout, e.g. ``"dp_shard 2 x tp 2, sequence parallel"``.

    Example::

        >>> _layout_name(ParallelDims(dp_replicate=2, dp_shard=2))
        'dp_replicate 2 x dp_shard 2'
    """
    sizes = [
        f"{name} {getattr(dims, name)}"
        for name in ("dp_replicate", "dp_shard", "cp", "tp")
        if getattr(dims, name) > 1
    ]
    if dims.ep > 1:
        sizes.append(f"ep {dims.ep}")
    name = " x ".join(sizes) or "one device"
    if dims.tp > 1:
        name += ", sequence parallel" if dims.sequence_parallel else ", no sequence parallel"
    return name


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def optimizer_kind(component: str, options: Mapping[str, Any] | None = None) -> str:
    """The :data:`OPTIMIZER_KINDS` entry for an optimizer ``_component_`` path and its options.

    Example::

        >>> optimizer_kind("torchao.optim.AdamW8bit"), optimizer_kind("torch.optim.SGD")
        ('adamw8bit', 'sgd')
        >>> optimizer_kind("torch.optim.AdamW", {"fused": True})
        'adamw_fused'
    """
    name = component.rsplit(".", 1)[-1].lower()
    if name in ("adam", "adamw") and (options or {}).get("fused"):
        return "adamw_fused"
    if "8bit" in name:
        return "adamw8bit"
    if "4bit" in name:
        return "adamw4bit"
    if "32bit" in name:
        return "adamw32bit"
    if name == "sgd":
        return "sgd_momentum" if (options or {}).get("momentum") else "sgd"
    return "adamw"  # Adam, AdamW and others keeping two moments


def tp_shard_dim(name: str) -> int | None:
    """The dimension tensor parallel splits the parameter called ``name`` on (HF names, as
    :mod:`~tunesmith.training.parallel.tensor_parallel` does), or None for a replicated one (norms,
    MoE router and stacked experts, heads other than ``lm_head``).

    Example::

        >>> tp_shard_dim("model.layers.0.self_attn.q_proj.weight")
        0
        >>> tp_shard_dim("model.layers.0.mlp.down_proj.weight")
        1
        >>> tp_shard_dim("model.layers.0.mlp.experts.gate_proj") is None  # stacked [E, I, H]
        True
    """
    if _TP_DIM0.search(name):
        return 0
    if _TP_DIM1.search(name):
        return 1
    return None


def activation_bytes_per_token(
    spec: Any,
    *,
    act_bytes: int,
    residual_bytes: int,
    seq_len: int,
    masked: bool = False,
    autocast: bool = False,
    layer_idx: int = 0,
    tp: int = 1,
    sequence_parallel: bool = False,
    ep: int = 1,
) -> int:
    """Bytes one un-checkpointed decoder layer keeps for backward on one rank per token of
    the sequence (see the module docstring), for a ``spec`` with the fields of
    :class:`~tunesmith.models.ModelSpec`, over ``tp`` tensor-parallel ranks; with ``ep`` > 1
    an MoE layer adds its all-to-all buffers, ``2 * top_k * a * H`` (the rows received and
    the rows sent back). ``seq_len`` is this rank's (under context parallel: its share).

    Example::

        >>> from tunesmith.models import qwen3
        >>> spec = qwen3.spec("qwen3_0_6b")
        >>> per_token = activation_bytes_per_token(spec, act_bytes=4, residual_bytes=4,
        ...                                        seq_len=1024)
        >>> per_token / 2**10  # KiB per token per layer, as the plan's table shows it
        120.16...
    """
    a, r = act_bytes, residual_bytes
    h, nh, nkv, hd = _dims(spec)
    stream = tp if sequence_parallel else 1
    norms = len(NORM_LAYOUTS[getattr(spec, "norm_layout", "pre")].names())  # 2, or 4: sandwich
    total = _ceil(norms * (4 * h + r * h + 4), stream) + 2 * r * h
    sharded = 0  # bytes split over the tensor-parallel ranks
    if getattr(spec, "attn_logit_softcapping", None) is not None:
        # soft-capped scores are written out: tanh (a), float32 softmax, its a-byte copy
        sharded += nh * seq_len * (2 * a + 4)
    mla = getattr(spec, "mla", None)
    if mla is not None:  # latent attention: its latents, then expanded q, k, v per head
        total += a * 2 * (mla.latent_width + (mla.q_lora_rank or 0))
        sharded += a * nh * 2 * (mla.qk_head_dim + mla.v_head_dim) + 4 * nh
    elif masked and nh > nkv:
        sharded += a * 4 * nh * hd + 4 * nh
    else:
        sharded += a * (2 * nh + 2 * nkv) * hd + 4 * nh
    if masked:
        total += a * seq_len
    if getattr(spec, "qk_norm", False):
        sharded += (4 + a) * (nh + nkv) * hd + 4 * (nh + nkv)
    is_moe = getattr(spec, "is_moe_layer", None)
    if is_moe is not None and is_moe(layer_idx):  # replicated experts: every token, whole
        k, experts = spec.num_experts_per_tok, spec.num_experts
        total += k * (4 * a * spec.moe_intermediate_size + a * h) + 8 * experts
        routing = getattr(spec, "moe_routing", None)
        if routing is not None:  # shared experts beside the routed ones (DeepSeek)
            total += 4 * a * spec.moe_intermediate_size * routing.n_shared_experts
        if ep > 1:  # the all-to-all buffers: rows received, rows returned
            total += 2 * k * a * h
    else:
        sharded += 4 * a * spec.intermediate_size
    if autocast:
        total += 10 * h
    return total + _ceil(sharded, tp)


@dataclass(frozen=True)
class _GenericLayer:
    """The sizes a generic llama-like decoder layer is priced from (what
    :func:`activation_bytes_per_token` reads of a spec; the native-family fields it reads with
    ``getattr`` are absent: two pre-norms, no qk-norm, no soft cap)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_hidden_layers: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        return bool(self.num_experts and self.num_experts_per_tok)


def _generic_layer(spec: Any) -> _GenericLayer:
    """A :class:`~tunesmith.models.transformers_backend.TransformersSpec`'s config sizes as a
    generic llama-like layer (routed experts in every layer of a model that has them).

    >>> from tunesmith.models.transformers_backend import TransformersSpec
    >>> spec = TransformersSpec({"model_type": "starcoder2", "hidden_size": 32,
    ...                          "intermediate_size": 64, "num_attention_heads": 4,
    ...                          "num_key_value_heads": 2, "num_hidden_layers": 2})
    >>> _generic_layer(spec)  # head_dim: hidden_size / num_attention_heads
    _GenericLayer(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8, ...)
    """
    sizes = {
        name: getattr(spec, name, None)
        for name in ("hidden_size", "intermediate_size", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "num_hidden_layers")
    }  # fmt: skip
    missing = [name for name, value in sizes.items() if not value]
    if missing:
        raise ValueError(
            f"estimate_memory: the config of {getattr(spec, 'model_type', '?')} has no "
            f"{', '.join(missing)}; the transformers backend's activations are estimated from "
            "these sizes"
        )
    layer = _GenericLayer(**{name: int(value) for name, value in sizes.items()})
    if getattr(spec, "is_moe", False):
        config = getattr(spec, "config", None) or {}
        moe_width = (
            config.get("moe_intermediate_size")
            or (config.get("text_config") or {}).get("moe_intermediate_size")
            or layer.intermediate_size
        )
        layer = dataclasses.replace(
            layer,
            num_experts=int(spec.num_experts),
            num_experts_per_tok=int(spec.num_experts_per_tok),
            moe_intermediate_size=int(moe_width),
        )
    return layer


def _ceil(n: int, k: int) -> int:
    return -(-n // k)


def _dims(spec: Any) -> tuple[int, int, int, int]:
    """hidden, query heads, key/value heads, head width."""
    return spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim


def _selective_bytes_per_token(
    spec: Any, act_bytes: int, residual_bytes: int, tp: int = 1, sequence_parallel: bool = False
) -> int:
    a, r = act_bytes, residual_bytes
    h, nh, nkv, hd = _dims(spec)
    layer_input = _ceil(r * h, tp if sequence_parallel else 1)
    # q/k/v, gate/up and the attention output (+ log-sum-exp) are this rank's heads/columns;
    # the row-wise o/down outputs are whole (partial sums before their reduction)
    sharded = a * (nh + 2 * nkv) * hd + 2 * a * spec.intermediate_size + a * nh * hd + 4 * nh
    return layer_input + _ceil(sharded, tp) + 2 * a * h


def estimate_memory(
    model: nn.Module,
    *,
    batch_size: int,
    seq_len: int,
    optimizer: str = "adamw",
    mixed_precision: str | None = None,
    activation_checkpointing: Checkpointing | Mapping[str, Any] = None,
    loss: Literal["full", "linear"] | LinearCrossEntropyLoss = "full",
    optimizer_in_backward: bool = False,
    packed: bool = False,
    world_size: int = 1,
    parallel: ParallelDims | None = None,
    device: torch.device | str = "cpu",
) -> MemoryPlan:
    """Estimate the peak memory of one training step of ``model`` (a decoder with a
    ``spec``) on one rank, for ``batch_size`` rows of ``seq_len`` tokens per data-parallel
    rank; see the module docstring.

    Args:
        optimizer: one of :data:`OPTIMIZER_KINDS` (see :func:`optimizer_kind`).
        mixed_precision: ``"bf16"``/``"fp16"`` autocast, or None.
        activation_checkpointing: None, ``"full"``, ``"selective"``, or the recipe's mapping
            ``{mode: ..., every_k: k}``.
        loss: ``"full"`` (logits, then cross-entropy), ``"linear"`` (linear cross-entropy
            chunked as by default; vocabulary-parallel under TP), or the
            :class:`LinearCrossEntropyLoss` in use (its chunking).
        packed: rows carry a block-causal mask (packing).
        world_size: FSDP2 ranks sharing weights, gradients and states; shorthand for
            ``parallel=ParallelDims(dp_shard=world_size)``.
        parallel: the parallel layout (``tp``, ``sequence_parallel``, ``dp_shard``,
            ``dp_replicate``, ``cp``, ``ep``; e.g. ``ctx.dims``); None: ``world_size`` FSDP2
            ranks.
        device: where training runs (the optimizer's ``foreach`` scratch is CUDA's).

    Raises:
        ValueError: an unknown optimizer, checkpointing mode or loss kind, a model without a
            ``spec``, or a ``world_size`` other than ``parallel``'s ``dp_shard`` (or
            ``dp_shard x cp``, the FSDP2 ranks under context parallel).
    """
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ValueError(f"estimate_memory needs a model with a .spec, got {type(model).__name__}")
    if optimizer not in _STATE_BYTES:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZER_KINDS)}, got {optimizer!r}")
    if loss == "linear":
        loss = LinearCrossEntropyLoss()
    if not (loss == "full" or isinstance(loss, LinearCrossEntropyLoss)):
        raise ValueError(f"loss must be 'full', 'linear' or a LinearCrossEntropyLoss, got {loss!r}")
    mode, every_k = _checkpointing(activation_checkpointing)
    if mixed_precision not in AUTOCAST:
        raise ValueError(f"mixed_precision must be bf16, fp16 or None, got {mixed_precision!r}")
    dims = _layout(parallel, world_size)
    tp, sp, cp, ep = dims.tp, dims.tp > 1 and dims.sequence_parallel, dims.cp, dims.ep
    fsdp = dims.dp_cp > 1  # FSDP2 (HSDP) is applied when there is data or context parallelism
    shard = dims.dp_shard * cp  # FSDP2 shards over dp_shard x cp
    seq_len = _ceil(seq_len, 2 * cp) * 2 if cp > 1 else seq_len  # this rank's zigzag share

    named = list(model.named_parameters())  # a tied parameter once
    # (bytes of the whole parameter over the tp ranks, of its shard on this rank), per name
    sizes = {name: _rank_bytes(name, p, tp, shard, ep) for name, p in named}
    weight_bytes = sum(local for _, local in sizes.values())
    trainable = [(name, p) for name, p in named if p.requires_grad]
    trainable_bytes = sum(sizes[name][1] for name, _ in trainable)
    largest = max((sizes[name][1] for name, _ in trainable), default=0)
    r = spec_dtype_bytes(model)
    autocast = mixed_precision is not None
    a = 2 if autocast else r
    tokens = batch_size * seq_len

    # weights (+ FSDP2's gathered root and two layers in flight), gradients, optimizer states
    weights = weight_bytes
    gathered_root, gathered_layers = _gathered_bytes(model, sizes) if fsdp else (0, 0)
    gradients = largest if optimizer_in_backward else trainable_bytes
    states = int(
        sum(
            _STATE_BYTES[optimizer](p.element_size()) * _rank_numel(name, p, tp, shard, ep)
            for name, p in trainable
        )
    )
    on_cuda = torch.device(device).type == "cuda"
    largest_numel = max((_rank_numel(name, p, tp, shard, ep) for name, p in trainable), default=0)
    if optimizer in ("adamw8bit", "adamw4bit") and not on_cuda:
        step_temporaries = 5 * 4 * largest_numel
    elif optimizer == "adamw_fused":
        step_temporaries = 0
    elif on_cuda and optimizer in ("adamw", "sgd_momentum") and not optimizer_in_backward:
        step_temporaries = trainable_bytes  # foreach kernels
    else:
        step_temporaries = 2 * largest

    # activations: a native family's own layout; a transformers-backend model's config sizes
    # as a generic llama-like layer (its layers are transformers' code)
    generic = getattr(spec, "backend", "native") == "transformers"
    layer_spec = _generic_layer(spec) if generic else spec
    num_layers = layer_spec.num_hidden_layers
    stream = tp if sp else 1
    layer_bytes = partial(
        activation_bytes_per_token,
        layer_spec,
        act_bytes=a,
        residual_bytes=r,
        seq_len=seq_len,
        masked=packed,
        autocast=autocast and r > 2,
        tp=tp,
        sequence_parallel=sp,
        ep=ep,
    )
    per_layer = [layer_bytes(layer_idx=i) for i in range(num_layers)]
    checkpointed = set(range(0, num_layers, every_k)) if mode else set()
    kept = 0
    for i, full in enumerate(per_layer):
        if i not in checkpointed:
            kept += full
        elif mode == "full":
            kept += _ceil(r * layer_spec.hidden_size, stream)
        else:
            kept += _selective_bytes_per_token(layer_spec, a, r, tp, sp)
    recompute = max(per_layer) if checkpointed else 0
    shared = 2 * layer_spec.head_dim * r + (2 * seq_len if packed else 0)  # RoPE, bool masks
    hidden = layer_spec.hidden_size
    final_norm = _ceil(4 * hidden + r * hidden, stream) + r * hidden
    activations = tokens * (kept + shared + final_norm)
    recompute *= tokens

    # logits / loss, the head's gradient, autocast weight copies
    vocab = spec.vocab_size
    local_vocab = _ceil(vocab, tp)  # the head's vocabulary shard (loss parallel)
    if loss == "full":  # the head's output is gathered under TP: whole logits on every rank
        logits = tokens * vocab * (12 + (a if a != 4 else 0))
    else:
        chunk = min(tokens, loss.rows_per_chunk(tokens, local_vocab * hidden * a))
        # the trained rows and their gradient, one chunk of float32 logits (turned into their
        # gradient in place; a 16-bit matmul's output besides), the float32 weight-gradient
        # sum where the head's own gradient is narrower
        logits = tokens * (2 * a * hidden + 4) + chunk * local_vocab * (4 + (a if a != 4 else 0))
        logits += (4 - r) * local_vocab * hidden if r < 4 else 0
    head = getattr(model, "lm_head", None)
    head_trainable = head is not None and head.weight.requires_grad
    head_gradient = local_vocab * hidden * r if head_trainable else 0
    autocast_weights = 0
    if autocast and r > 2:
        untied_embedding = not getattr(spec, "tie_word_embeddings", False)
        autocast_weights = 2 * sum(
            _rank_numel(name, p, tp, 1)
            for name, p in named
            if p.dim() == 2 and not (untied_embedding and name.endswith("embed_tokens.weight"))
        )

    return MemoryPlan(
        weights=int(weights),
        gradients=int(gradients),
        optimizer_states=int(states),
        activations=int(activations),
        logits=int(logits),
        head_gradient=int(head_gradient),
        recompute=int(recompute),
        autocast_weights=int(autocast_weights),
        step_temporaries=int(step_temporaries),
        activations_per_token_layer=int(max(per_layer)),
        batch_size=batch_size,
        seq_len=seq_len,
        world_size=dims.world_size,
        gathered_root=int(gathered_root),
        gathered_layers=int(gathered_layers),
        parallel=dims if dims.world_size > 1 else None,
        activation_basis=GENERIC_LAYER_BASIS if generic else "",
    )


def spec_dtype_bytes(model: nn.Module) -> int:
    """Bytes per element of the model's floating-point weights (the residual stream's)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def _layout(parallel: ParallelDims | None, world_size: int) -> ParallelDims:
    if parallel is None:
        return ParallelDims(dp_shard=max(1, world_size))
    if world_size not in (1, parallel.dp_shard, parallel.dp_shard * parallel.cp):
        raise ValueError(
            f"world_size {world_size} and parallel (dp_shard {parallel.dp_shard} x cp "
            f"{parallel.cp}) disagree: give parallel alone"
        )
    return parallel


def _checkpointing(value: Checkpointing | Mapping[str, Any]) -> tuple[str | None, int]:
    if not value:
        return None, 1
    if isinstance(value, str):
        mode, every_k = value, 1
    else:
        mode, every_k = value.get("mode", "full"), int(value.get("every_k", 1))
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing mode must be full or selective, got {mode!r}")
    return mode, max(1, every_k)


def _bytes(p: torch.Tensor) -> int:
    """Bytes of a parameter: its full logical size for a plain tensor or a ``DTensor`` (the
    plan divides by the layout itself), its actual storage for a quantised subclass
    (an NF4 weight reports its original dtype but holds 4-bit codes)."""
    if is_traceable_wrapper_subclass(p) and type(p).__name__ != "DTensor":
        return storage_bytes([p])
    return p.numel() * p.element_size()


def _rank_numel(name: str, p: torch.Tensor, tp: int, shard: int, ep: int = 1) -> int:
    """Elements of ``p``'s shard on the heaviest rank: its tensor-parallel shard (rounded
    up), then dim 0 of that split over ``shard`` FSDP2 ranks (rounded up: the padded shard).
    With ``ep`` > 1 the stacked experts keep ``E / ep`` experts, not split by FSDP2."""
    shape = list(p.shape)
    if ep > 1 and _EXPERTS.search(name):
        return _ceil(shape[0], ep) * math.prod(shape[1:])
    dim = tp_shard_dim(name) if tp > 1 else None
    if dim is not None and dim < len(shape):
        shape[dim] = _ceil(shape[dim], tp)
    if shard > 1 and shape:
        shape[0] = _ceil(shape[0], shard)
    return math.prod(shape)


def _rank_bytes(name: str, p: torch.Tensor, tp: int, shard: int, ep: int = 1) -> tuple[int, int]:
    """(bytes FSDP2 gathers of ``p``: over the tp ranks alone, none for expert-parallel
    experts, which FSDP2 leaves alone; bytes of its shard on this rank)."""
    numel = p.numel()
    if numel == 0:
        return 0, 0
    whole = _bytes(p)
    local = whole * _rank_numel(name, p, tp, shard, ep) // numel
    if ep > 1 and _EXPERTS.search(name):
        return 0, local
    return whole * _rank_numel(name, p, tp, 1) // numel, local


def _gathered_bytes(model: nn.Module, sizes: Mapping[str, tuple[int, int]]) -> tuple[int, int]:
    """FSDP2's gathered weights in flight: (the root's parameters, everything outside the
    decoder layers; two of the largest layer), each at its tensor-parallel size."""
    names = {id(p): n for n, p in model.named_parameters()}
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None) or []
    layer_sizes = [sum(sizes[names[id(p)]][0] for p in layer.parameters()) for layer in layers]
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = sum(sizes[n][0] for i, n in names.items() if i not in in_layers)
    return root, 2 * max(layer_sizes, default=0)
