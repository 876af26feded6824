"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1 and their derivatives), dequantized on load.

Such a folder's ``config.json`` has ``quantization_config: {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}``; each quantized linear stores ``weight`` in
``float8_e4m3fn`` and ``weight_scale_inv`` (float32, one number per ``128 x 128`` block,
``ceil(rows / 128) x ceil(cols / 128)``), the true weight being ``weight * scale`` block by block.
:class:`BlockFp8Folder` gives a loader what it needs: a ``derive`` that computes each FP8
weight from itself and its scale as it is loaded (in float32, then cast once to the load
dtype, so nothing is rounded twice); the model itself never sees FP8.

Example::

    >>> weight = torch.ones(3, 5).to(torch.float8_e4m3fn)
    >>> dequantize_block_fp8(weight, torch.tensor([[2.0, 4.0], [8.0, 16.0]]), (2, 4))[:, 3:]
    tensor([[ 2.,  4.],
            [ 2.,  4.],
            [ 8., 16.]])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tunesmith.models.family import UnsupportedModelError
from tunesmith.models.safetensors_io import DerivedTensor, TensorInfo

__all__ = ["SCALE_SUFFIX", "BlockFp8Folder", "block_fp8_size", "dequantize_block_fp8"]

SCALE_SUFFIX = "_scale_inv"
_FP8_CODES = ("F8_E4M3", "F8_E5M2")  # safetensors header dtypes
_FLOAT_CODES = ("F64", "F32", "F16", "BF16", *_FP8_CODES)


def block_fp8_size(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ``(rows, cols)`` block of a block-scaled FP8 config, None for any other config;
    a FP8 ``quantization_config`` tunesmith cannot dequantize is refused by name.

    Example::

        >>> block_fp8_size({"quantization_config": {"quant_method": "fp8",
        ...     "weight_block_size": [128, 128]}})
        (128, 128)
        >>> block_fp8_size({}) is None
        True
    """
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(
        isinstance(b, int) and b > 0 for b in block
    )):  # fmt: skip
        raise UnsupportedModelError(
            f"quantization_config.weight_block_size={block!r}: only block-scaled FP8 "
            "(two positive block sizes, as DeepSeek-V3 ships) is dequantized on load"
        )
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``weight`` ``[rows, cols]`` (FP8) times its per-block ``scale_inv``
    ``[ceil(rows / br), ceil(cols / bc)]``, in float32 (edge blocks may be partial)."""
    rows, cols = weight.shape
    br, bc = block
    grid = (-(-rows // br), -(-cols // bc))
    if weight.dim() != 2 or tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"FP8 weight {list(weight.shape)} with block {list(block)} needs a scale of shape "
            f"{list(grid)}, got {list(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scale


class BlockFp8Folder:
    """How to read a block-scaled FP8 folder: :meth:`derive` makes each FP8 weight a tensor
    computed from itself and its ``*_scale_inv`` (in whichever shard each sits) as it is loaded;
    :meth:`rename` leaves out a scale no FP8 weight uses. A FP8 weight without a float scale of
    its block grid's shape is an error naming the file and both tensors, from headers alone.

    Example::

        fp8 = BlockFp8Folder((128, 128))
        loader(folder, rename=fp8.rename, derive=fp8.derive)
    """

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = block
        self.dequantized = 0

    def rename(self, name: str) -> str | None:
        return None if name.endswith(SCALE_SUFFIX) else name

    def derive(self, infos: Mapping[str, TensorInfo]) -> dict[str, DerivedTensor]:
        """Each FP8 weight of ``infos`` (name -> header) -> its dequantization."""
        return {
            name: DerivedTensor((name, self._scale(name, info, infos)), info.shape, self._compute)
            for name, info in infos.items()
            if info.dtype in _FP8_CODES
        }

    def _scale(self, name: str, info: TensorInfo, infos: Mapping[str, TensorInfo]) -> str:
        """The name of ``name``'s scale, checked from its header."""
        scale_name = name + SCALE_SUFFIX
        scale = infos.get(scale_name)
        if scale is None:
            raise UnsupportedModelError(
                f"{info.file}: FP8 tensor '{name}' has no '{scale_name}' to dequantize it with"
            )
        if scale.dtype not in _FLOAT_CODES:
            raise UnsupportedModelError(
                f"{scale.file}: '{scale_name}' is {scale.dtype}; only float scales are read"
            )
        grid = [-(-size // block) for size, block in zip(info.shape, self.block)]
        if len(info.shape) != 2 or list(scale.shape) != grid:
            raise UnsupportedModelError(
                f"{scale.file}: '{scale_name}' has shape {list(scale.shape)}; FP8 tensor "
                f"'{name}' {list(info.shape)} with block {list(self.block)} needs {grid}"
            )
        return scale_name

    def _compute(
        self, weight: torch.Tensor, scale_inv: torch.Tensor, *, dtype: torch.dtype
    ) -> torch.Tensor:
        self.dequantized += 1
        return dequantize_block_fp8(weight, scale_inv, self.block).to(dtype)
