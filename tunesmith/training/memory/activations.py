"""Activation memory: checkpoint decoder layers (recompute in backward) or offload to CPU.

:func:`apply_activation_checkpointing` makes decoder layers recompute their activations during
backward instead of keeping them (``torch.utils.checkpoint``, non-reentrant):

* ``mode="full"``: the layer keeps only its inputs; everything inside is recomputed.
* ``mode="selective"``: the layer keeps the outputs of its matmuls and attention kernels
  (the expensive ops) and recomputes the cheap ones (norms, RoPE, activations, residual
  adds, dtype casts), whose outputs take as much memory but cost little to redo. This is
  op-level selective checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_
  contexts``): less memory saved than ``"full"`` but nearly no extra compute.
* ``every_k``: only every ``k``-th layer (layers 0, k, 2k, ...) is checkpointed, trading
  memory for speed between "all layers" (``every_k=1``) and "none".

The layers are not wrapped: each one gets a checkpointing ``forward``, so parameter names
(the Hugging Face ones), ``isinstance`` checks, FSDP2 sharding (apply either before or after
``fully_shard``) and ``state_dict`` are untouched. Outside autograd (``torch.no_grad``,
generation) a layer runs plainly.

:func:`activation_offloading` moves the tensors that autograd saves for backward to pinned
CPU memory during forward and back during backward (``torch.autograd.graph.save_on_cpu``).
It pays on GPUs; on a CPU there is nothing to offload to, so it warns and does nothing.
Combined with checkpointing, only the layers' saved inputs are offloaded.

Example::

    >>> from tunesmith.models import llama3
    >>> model = llama3.llama3_tiny()
    >>> apply_activation_checkpointing(model, mode="selective", every_k=2)
    1
    >>> input_ids = torch.randint(0, 256, (1, 8))
    >>> with activation_offloading(torch.cuda.is_available()):  # offloads on a GPU only
    ...     loss = model(input_ids).logsumexp(-1).mean()
    >>> loss.backward()
    >>> model.lm_head.weight.grad is not None
    True
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from tunesmith.modules.decoder import decoder_layers

__all__ = [
    "CHECKPOINT_MODES",
    "activation_offloading",
    "apply_activation_checkpointing",
    "is_checkpointed",
]

CHECKPOINT_MODES = ("full", "selective")

# Ops whose outputs selective checkpointing keeps: the matmuls and attention kernels.
_aten = torch.ops.aten
_SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._efficient_attention_forward.default,
    _aten._flash_attention_forward.default,
}


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in _SAVED_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> tuple[Any, Any]:
    return create_selective_checkpoint_contexts(_save_matmuls)


class _CheckpointedForward:
    """A layer's ``forward`` that runs the class's forward under ``torch.utils.checkpoint``.

    Holds the module itself (not a bound method) so ``copy.deepcopy`` of a model rebinds it
    to the copied layer.
    """

    def __init__(self, module: nn.Module, mode: str) -> None:
        self.module = module
        self.mode = mode

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = partial(type(self.module).forward, self.module)
        if not torch.is_grad_enabled() or kwargs.get("kv_cache") is not None:
            return forward(*args, **kwargs)
        # full mode passes no context_fn: under torch.compile one must make dispatch modes
        if self.mode == "selective":
            kwargs["context_fn"] = _selective_contexts
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`apply_activation_checkpointing` has made ``module`` checkpoint itself."""
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    mode: Literal["full", "selective"] = "full",
    every_k: int = 1,
    layer_type: type[nn.Module] | None = None,
) -> int:
    """Make every ``every_k``-th ``layer_type`` module of ``model`` (in order: layers
    ``0, k, 2k, ...``) checkpoint its activations; return how many layers now do.

    Args:
        mode: ``"full"`` (recompute the whole layer) or ``"selective"`` (keep matmul and
            attention outputs, recompute the rest); see the module docstring.
        every_k: checkpoint one layer in ``every_k`` (1: all layers).
        layer_type: the block class to checkpoint (default: the decoder layers,
            :func:`~tunesmith.modules.decoder.decoder_layers`).

    Raises:
        ValueError: unknown ``mode``, ``every_k < 1``, no ``layer_type`` module in
            ``model``, or layers that are already checkpointed.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"activation_checkpointing.mode must be one of {list(CHECKPOINT_MODES)}, got {mode!r}"
        )
    if isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"activation_checkpointing.every_k must be an int >= 1, got {every_k!r}")
    layers = (
        decoder_layers(model)
        if layer_type is None
        else [module for module in model.modules() if isinstance(module, layer_type)]
    )
    if not layers:
        raise ValueError(
            f"apply_activation_checkpointing found no {'decoder layer' if layer_type is None else layer_type.__name__} in "
            f"{type(model).__name__}"
        )
    if any(is_checkpointed(layer) for layer in layers):
        raise ValueError("activation checkpointing is already applied to this model")
    chosen = layers[::every_k]
    for layer in chosen:
        layer.forward = _CheckpointedForward(layer, mode)  # type: ignore[method-assign]
    return len(chosen)


@contextlib.contextmanager
def activation_offloading(
    enabled: bool = True, *, device: torch.device | str | None = None
) -> Iterator[None]:
    """Within the block, tensors saved for backward live in pinned CPU memory.

    ``device`` is where the model runs (default: CUDA if available, else CPU). On a non-CUDA
    device, or with ``enabled=False``, nothing changes (a CPU gets a warning, since
    offloading was asked for but cannot help there).

    Example::

        >>> model = torch.nn.Linear(4, 4)
        >>> with activation_offloading(torch.cuda.is_available()):  # True on a GPU
        ...     loss = model(torch.randn(2, 4)).sum()
        >>> loss.backward()                      # saved tensors come back to the GPU
    """
    if not enabled:
        yield
        return
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type != "cuda":
        warnings.warn(
            f"activation_offloading: the model runs on {device.type}, so activations already "
            "live in host memory; offloading is a no-op",
            stacklevel=3,
        )
        yield
        return
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        yield
