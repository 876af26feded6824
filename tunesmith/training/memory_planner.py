"""Estimate the peak training memory of a decoder for one configuration, before training.

:func:`estimate_memory` adds up what one training step keeps alive, from the parameter
counts of the model and the sizes in its ``spec`` (hidden ``H``, intermediate ``I``, heads
``nh``, key/value heads ``nkv``, head width ``hd``, vocab ``V``, layers ``L``), for ``T =
batch_size * seq_len`` tokens:

* **weights** ``W``: every parameter (divided over ``world_size`` ranks under FSDP, plus
  two unsharded layers in flight);
* **optimizer states** ``O``: per trainable parameter, AdamW keeps two tensors of the
  parameter's dtype, 8-bit AdamW about 2 bytes, 4-bit about 1, SGD none (one with momentum);
* **gradients** ``G``: one per trainable parameter (only the largest one at a time with the
  optimizer in backward);
* **activations** ``A``: what autograd saves for backward. For a layer that is not
  checkpointed, bytes per token (``a`` = activation bytes, ``r`` = the residual stream's,
  i.e. the weights' dtype; RMSNorm computes in float32)::

      norms        2 * (4H + 2rH + 4)         input kept in fp32, normed and weighted outputs
      attention    a*(2*nh + 2*nkv)*hd + 4*nh  q, k, v after RoPE, output, log-sum-exp
                   (a block-causal mask with grouped heads: k and v are repeated to nh
                    heads, a*4*nh*hd; and SDPA keeps the mask as a float a*s per token)
      qk-norm      (4 + a)*(nh + nkv)*hd       (Qwen3) the per-head norms' inputs and outputs
      MLP          4*a*I                       gate, SiLU(gate), up, their product
                   (MoE: top_k experts * (4*a*I_moe + a*H), plus router tensors)
      autocast     10H                         16-bit copies of the q/k/v/gate/up inputs
                                               (fp32 weights under bf16/fp16 autocast)

  A layer under full checkpointing keeps only its input (``r*H`` per token); selective
  checkpointing keeps its input, the matmul outputs and the attention outputs
  (``rH + a*(nh + 2nkv)*hd + a*nh*hd + 4nh + 2aH + 2aI``). Either way one layer is
  recomputed at a time in backward, so one full layer's activations are added once. The
  final norm adds ``4H + 2rH`` per token;
* **logits** ``Lg``: full cross-entropy materialises the ``[T, V]`` logits and, at the start
  of backward, about three float32 copies (saved log-softmax, its gradient, the logits'
  gradient): ``12 * T * V`` bytes (``+ a*T*V`` for 16-bit logits). Linear cross-entropy
  keeps the trained rows and their gradient, and one chunk of ``c`` rows of float32 logits
  that become their own gradient (``4 * c * V``; ``c`` rows as the loss chunks ``T``, see
  ``LinearCrossEntropyLoss.rows_per_chunk``), plus a float32 weight-gradient sum for a
  16-bit head; ``T`` is taken as all tokens trained (an upper bound);
* **step temporaries** ``S``: the optimizer step's scratch (none for torch's fused AdamW;
  the ``foreach`` kernels of a CUDA optimizer about one copy of the trainable parameters;
  otherwise two copies of the largest one; a low-bit optimizer off CUDA about five float32 copies of the largest one,
  as measured for bitsandbytes' CPU step, which allocates them outside torch's dispatcher).

The peak is ``W + O + max(A + Lg + Hg + C, G + S)``: at the start of backward every
activation, the logits' gradients and the head's gradient ``Hg`` are alive (``C``: the
autocast weight cache, 16-bit copies of the matmul weights under autocast); by the optimizer
step the activations are gone and every gradient exists. In between, gradients grow as
activations are freed. LoRA is accounted for through ``requires_grad``: only trainable
parameters get gradients and states (activations are estimated as for full fine-tuning, an
upper bound).

Example::

    >>> plan = estimate_memory(model, batch_size=4, seq_len=1024, optimizer="adamw")
    >>> print(plan.table())                                                 # doctest: +SKIP
    >>> plan.total > plan.weights
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tunesmith.modules.dtypes import AUTOCAST
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.training.memory import storage_bytes

__all__ = [
    "OPTIMIZER_KINDS",
    "MemoryPlan",
    "activation_bytes_per_token",
    "estimate_memory",
    "optimizer_kind",
]

# Optimizer state bytes per trainable parameter, as a function of the parameter's bytes.
_STATE_BYTES = {
    "adamw": lambda p: 2 * p,
    "adamw_fused": lambda p: 2 * p,  # torch's fused kernel: no step scratch
    "sgd": lambda p: 0,
    "sgd_momentum": lambda p: p,
    "adamw8bit": lambda p: 2 + 2 * 4 / 256,  # int8 moments + one float32 scale per block
    "adamw4bit": lambda p: 1 + 2 * 4 / 128,
}
OPTIMIZER_KINDS = tuple(_STATE_BYTES)

Checkpointing = Literal["full", "selective"] | None


@dataclass(frozen=True)
class MemoryPlan:
    """Estimated bytes of each term of a training step and the resulting peak (``total``).

    Terms as in the module docstring: ``weights`` W, ``gradients`` G, ``optimizer_states``
    O, ``activations`` A, ``logits`` Lg, ``head_gradient`` Hg, ``autocast_weights`` C,
    ``step_temporaries`` S. ``activations_per_token_layer`` is the bytes one un-checkpointed
    layer keeps per token; ``tokens`` the tokens of the batch (``batch_size * seq_len``).
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

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def backward_peak(self) -> int:
        """Bytes above weights and states at the start of backward."""
        kept = self.activations + self.head_gradient + self.autocast_weights
        return kept + max(self.logits, self.recompute)

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
            ("optimizer step temporaries", self.step_temporaries),
        ]  # fmt: skip
        per_rank = f", per rank of {self.world_size}" if self.world_size > 1 else ""
        lines = [f"memory plan: batch {self.batch_size} x seq {self.seq_len}{per_rank}"]
        width = max(len(name) for name, _ in rows)
        lines += [f"  {name:<{width}}  {_size(value):>10}" for name, value in rows if value]
        phase = "backward" if self.backward_peak >= self.step_peak else "optimizer step"
        lines.append(f"  {'estimated peak (' + phase + ')':<{width}}  {_size(self.total):>10}")
        return "\n".join(lines)


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
    if name == "sgd":
        return "sgd_momentum" if (options or {}).get("momentum") else "sgd"
    return "adamw"  # Adam, AdamW and others keeping two moments


def activation_bytes_per_token(
    spec: Any,
    *,
    act_bytes: int,
    residual_bytes: int,
    seq_len: int,
    masked: bool = False,
    autocast: bool = False,
    layer_idx: int = 0,
) -> int:
    """Bytes one un-checkpointed decoder layer keeps for backward per token (see the
    module docstring), for a ``spec`` with the fields of :class:`~tunesmith.models.ModelSpec`.
    """
    a, r = act_bytes, residual_bytes
    h, nh, nkv, hd = _dims(spec)
    total = 2 * (4 * h + 2 * r * h + 4)
    if masked and nh > nkv:
        total += a * 4 * nh * hd + 4 * nh
    else:
        total += a * (2 * nh + 2 * nkv) * hd + 4 * nh
    if masked:
        total += a * seq_len
    if getattr(spec, "qk_norm", False):
        total += (4 + a) * (nh + nkv) * hd + 4 * (nh + nkv)
    is_moe = getattr(spec, "is_moe_layer", None)
    if is_moe is not None and is_moe(layer_idx):
        k, experts = spec.num_experts_per_tok, spec.num_experts
        total += k * (4 * a * spec.moe_intermediate_size + a * h) + 8 * experts
    else:
        total += 4 * a * spec.intermediate_size
    if autocast:
        total += 10 * h
    return total


def _dims(spec: Any) -> tuple[int, int, int, int]:
    """hidden, query heads, key/value heads, head width."""
    return spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim


def _selective_bytes_per_token(spec: Any, act_bytes: int, residual_bytes: int) -> int:
    a, r = act_bytes, residual_bytes
    h, nh, nkv, hd = _dims(spec)
    inputs_and_matmuls = (
        r * h + a * (nh + 2 * nkv) * hd + 2 * a * h + 2 * a * spec.intermediate_size
    )
    return inputs_and_matmuls + a * nh * hd + 4 * nh  # + attention output, log-sum-exp


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
    device: torch.device | str = "cpu",
) -> MemoryPlan:
    """Estimate the peak memory of one training step of ``model`` (a decoder with a
    ``spec``) on ``batch_size`` rows of ``seq_len`` tokens; see the module docstring.

    Args:
        optimizer: one of :data:`OPTIMIZER_KINDS` (see :func:`optimizer_kind`).
        mixed_precision: ``"bf16"``/``"fp16"`` autocast, or None.
        activation_checkpointing: None, ``"full"``, ``"selective"``, or the recipe's mapping
            ``{mode: ..., every_k: k}``.
        loss: ``"full"`` (logits, then cross-entropy), ``"linear"`` (linear cross-entropy
            chunked as by default), or the :class:`LinearCrossEntropyLoss` in use (its
            chunking).
        packed: rows carry a block-causal mask (packing).
        world_size: ranks sharing weights, gradients and states (FSDP2).
        device: where training runs (the optimizer's ``foreach`` scratch is CUDA's).

    Raises:
        ValueError: an unknown optimizer, checkpointing mode or loss kind, or a model
            without a ``spec``.
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

    params = list(model.parameters())  # a tied parameter once
    weight_bytes = sum(_bytes(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(_bytes(p) for p in trainable)
    largest = max((_bytes(p) for p in trainable), default=0)
    r = spec_dtype_bytes(model)
    autocast = mixed_precision is not None
    a = 2 if autocast else r
    tokens = batch_size * seq_len
    ws = max(1, world_size)

    # weights (+ two gathered layers in flight under FSDP), gradients, optimizer states
    weights = weight_bytes // ws
    if ws > 1:
        weights += 2 * _largest_layer_bytes(model)
    gradients = largest if optimizer_in_backward else trainable_bytes // ws
    states = int(sum(_STATE_BYTES[optimizer](p.element_size()) * p.numel() for p in trainable))
    states //= ws
    on_cuda = torch.device(device).type == "cuda"
    if optimizer in ("adamw8bit", "adamw4bit") and not on_cuda:
        step_temporaries = 5 * 4 * max((p.numel() for p in trainable), default=0)
    elif optimizer == "adamw_fused":
        step_temporaries = 0
    elif on_cuda and optimizer in ("adamw", "sgd_momentum") and not optimizer_in_backward:
        step_temporaries = trainable_bytes // ws  # foreach kernels
    else:
        step_temporaries = 2 * largest

    # activations
    num_layers = spec.num_hidden_layers
    layer_bytes = partial(
        activation_bytes_per_token, spec, act_bytes=a, residual_bytes=r, seq_len=seq_len,
        masked=packed, autocast=autocast and r > 2,
    )  # fmt: skip
    per_layer = [layer_bytes(layer_idx=i) for i in range(num_layers)]
    checkpointed = set(range(0, num_layers, every_k)) if mode else set()
    kept = 0
    for i, full in enumerate(per_layer):
        if i not in checkpointed:
            kept += full
        elif mode == "full":
            kept += r * spec.hidden_size
        else:
            kept += _selective_bytes_per_token(spec, a, r)
    recompute = max(per_layer) if checkpointed else 0
    shared = 2 * spec.head_dim * r + (2 * seq_len if packed else 0)  # RoPE tables, bool masks
    final_norm = 4 * spec.hidden_size + 2 * r * spec.hidden_size
    activations = tokens * (kept + shared + final_norm)
    recompute *= tokens

    # logits / loss, the head's gradient, autocast weight copies
    vocab, hidden = spec.vocab_size, spec.hidden_size
    if loss == "full":
        logits = tokens * vocab * (12 + (a if a != 4 else 0))
    else:
        chunk = min(tokens, loss.rows_per_chunk(tokens, vocab * hidden * a))
        # the trained rows and their gradient, one chunk of float32 logits (turned into their
        # gradient in place; a 16-bit matmul's output besides), the float32 weight-gradient
        # sum where the head's own gradient is narrower
        logits = tokens * (2 * a * hidden + 4) + chunk * vocab * (4 + (a if a != 4 else 0))
        logits += (4 - r) * vocab * hidden if r < 4 else 0
    head = getattr(model, "lm_head", None)
    head_trainable = head is not None and head.weight.requires_grad
    head_gradient = vocab * hidden * r if head_trainable else 0
    autocast_weights = 0
    if autocast and r > 2:
        embed_only = 0 if getattr(spec, "tie_word_embeddings", False) else vocab * hidden
        autocast_weights = 2 * (sum(p.numel() for p in params if p.dim() == 2) - embed_only)

    return MemoryPlan(
        weights=int(weights), gradients=int(gradients), optimizer_states=int(states),
        activations=int(activations), logits=int(logits), head_gradient=int(head_gradient),
        recompute=int(recompute),
        autocast_weights=int(autocast_weights), step_temporaries=int(step_temporaries),
        activations_per_token_layer=int(max(per_layer)), batch_size=batch_size,
        seq_len=seq_len, world_size=ws,
    )  # fmt: skip


def spec_dtype_bytes(model: nn.Module) -> int:
    """Bytes per element of the model's floating-point weights (the residual stream's)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


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
    plan divides by the world size itself), its actual storage for a quantised subclass
    (an NF4 weight reports its original dtype but holds 4-bit codes)."""
    if is_traceable_wrapper_subclass(p) and type(p).__name__ != "DTensor":
        return storage_bytes([p])
    return p.numel() * p.element_size()


def _largest_layer_bytes(model: nn.Module) -> int:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not layers:
        return 0
    return max(sum(_bytes(p) for p in layer.parameters()) for layer in layers)
