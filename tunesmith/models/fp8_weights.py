"""Block-scaled FP8 checkpoints (DeepSeek-V3/R1 and their derivatives), dequantized on load.

Such a folder's ``config.json`` has ``quantization_config: {"quant_method": "fp8",
"weight_block_size": [128, 128], ...}``; each quantized linear stores ``weight`` in
``float8_e4m3fn`` and ``weight_scale_inv`` (float32, one number per ``128 x 128`` block,
``ceil(rows / 128) x ceil(cols / 128)``), the true weight being ``weight * scale`` block by block.
:class:`BlockFp8Folder` gives a loader what it needs: a ``rename`` that leaves the scales out
and a ``transform`` that turns each FP8 weight into floats as it is read (the load dtype is
applied after, so nothing is rounded twice); the model itself never sees FP8.

Example::

    >>> weight = torch.ones(3, 5).to(torch.float8_e4m3fn)
    >>> dequantize_block_fp8(weight, torch.tensor([[2.0, 4.0], [8.0, 16.0]]), (2, 4))[:, 3:]
    tensor([[ 2.,  4.],
            [ 2.,  4.],
            [ 8., 16.]])
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tunesmith.models.family import UnsupportedModelError

__all__ = ["SCALE_SUFFIX", "BlockFp8Folder", "block_fp8_size", "dequantize_block_fp8"]

SCALE_SUFFIX = "_scale_inv"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


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
    """How to read a block-scaled FP8 folder: :meth:`rename` leaves every ``*_scale_inv`` out,
    :meth:`transform` dequantizes a FP8 tensor with its scale (read from whichever shard holds
    it). A FP8 tensor without a scale is an error that names it.

    Example::

        loader(folder, rename=fp8.rename, transform=fp8.transform)
    """

    def __init__(
        self, folder: str | os.PathLike, block: tuple[int, int], files: Mapping[str, Path]
    ) -> None:
        self.folder = Path(folder)
        self.block = block
        self.files = dict(files)  # scale name -> the shard that holds it
        self.dequantized = 0

    def rename(self, name: str) -> str | None:
        return None if name.endswith(SCALE_SUFFIX) else name

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in _FP8:
            return tensor
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.files:
            raise UnsupportedModelError(
                f"{self.folder}: FP8 tensor '{name}' has no '{scale_name}' to dequantize it with"
            )
        with safe_open(self.files[scale_name], framework="pt") as f:
            scale = f.get_tensor(scale_name)
        if not scale.dtype.is_floating_point:
            raise UnsupportedModelError(
                f"{self.folder}: '{scale_name}' is {scale.dtype}; only float scales are read"
            )
        self.dequantized += 1
        return dequantize_block_fp8(tensor, scale, self.block)
