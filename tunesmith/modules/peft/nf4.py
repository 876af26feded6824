"""NF4 (4-bit NormalFloat) frozen weights for QLoRA, through torchao's ``NF4Tensor``.

The quantised weight is an ``NF4Tensor`` kept as a frozen ``nn.Parameter``: 4-bit codes in
blocks of ``block_size`` values, one int8 absmax scaler per block, and those scalers
quantised again in groups of ``scaler_block_size`` ("double quantisation", as in the QLoRA
paper). The tensor reports the original shape and dtype; ``dequantize_nf4`` gives back that
dtype. torchao is imported on first use, so tunesmith runs without it unless QLoRA is used
(``pip install tunesmith[qlora]``).

Example::

    w = torch.randn(128, 128)
    q = quantize_nf4(w)
    linear_nf4(torch.randn(2, 128), q).shape
    # -> torch.Size([2, 128])
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

__all__ = [
    "NF4_BLOCK_SIZE",
    "NF4_SCALER_BLOCK_SIZE",
    "dequantize_nf4",
    "is_nf4",
    "linear_nf4",
    "nf4_block_sizes",
    "quantize_nf4",
]

NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256


@functools.cache
def _nf4_module() -> ModuleType:
    """torchao's NF4 module (0.18 moved it from ``torchao.dtypes`` into ``torchao.quantization``)."""
    torchao_logger = logging.getLogger("torchao")
    level = torchao_logger.level
    if not torch.cuda.is_available():
        # A CPU build of torch cannot load torchao's CUDA kernels; torchao logs one warning per
        # kernel library, none of which NF4 needs.
        torchao_logger.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "QLoRA (quantize_base='nf4') needs torchao: pip install 'tunesmith[qlora]'"
        ) from e
    finally:
        torchao_logger.setLevel(level)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:  # torchao < 0.18
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def is_nf4(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a torchao ``NF4Tensor`` (False when torchao was never imported)."""
    cls = type(tensor)
    return cls.__name__ == "NF4Tensor" and cls.__module__.startswith("torchao.")


def nf4_block_sizes(numel: int) -> tuple[int, int]:
    """``(block_size, scaler_block_size)`` for a weight of ``numel`` values.

    QLoRA's 64 and 256 when they divide the weight; else the largest scaler group (at most
    256) that divides the number of blocks, so small weights quantise too.

    >>> nf4_block_sizes(4096 * 4096), nf4_block_sizes(64 * 128)
    ((64, 256), (64, 128))
    """
    if numel <= 0 or numel % NF4_BLOCK_SIZE:
        raise ValueError(
            f"NF4 needs a weight whose number of values ({numel}) is a positive multiple of "
            f"{NF4_BLOCK_SIZE}"
        )
    n_blocks = numel // NF4_BLOCK_SIZE
    scaler = max(d for d in range(1, min(NF4_SCALER_BLOCK_SIZE, n_blocks) + 1) if n_blocks % d == 0)
    return NF4_BLOCK_SIZE, scaler


def quantize_nf4(weight: torch.Tensor) -> torch.Tensor:
    """An ``NF4Tensor`` of ``weight`` (2-D, floating, a multiple of 64 values).

    Weights whose size is not a multiple of 64 * 256 use smaller scaler groups (see
    :func:`nf4_block_sizes`); torchao re-quantises with its defaults when such a tensor is
    cloned or deep-copied, which then fails, so deep-copy those models before quantising.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(
            f"NF4 quantises 2-D floating weights, got shape {list(weight.shape)} {weight.dtype}"
        )
    if weight.is_meta:
        raise ValueError("cannot quantise a weight on the meta device: load the weights first")
    block_size, scaler_block_size = nf4_block_sizes(weight.numel())
    module = _nf4_module()
    return module.to_nf4(weight.detach().contiguous(), block_size, scaler_block_size)


def dequantize_nf4(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dense weight of an ``NF4Tensor`` in ``dtype`` (default: the original dtype);
    a plain tensor is returned as is (cast to ``dtype`` if given)."""
    if is_nf4(weight):
        dense = weight.get_original_weight()
        return dense if dtype is None else dense.to(dtype)
    return weight if dtype is None else weight.to(dtype)


def linear_nf4(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ dequantize(weight).T`` in ``x``'s dtype, without keeping the dense weight for
    backward (it is dequantised again there)."""
    return _nf4_module().linear_nf4(x, weight)
