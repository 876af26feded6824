"""MXFP4 checkpoints (gpt-oss): experts stored as ``*_blocks`` and ``*_scales``, dequantized on load.

The OCP microscaling format MXFP4 stores 32 values per block: 16 bytes of FP4 (E2M1: a sign
bit, two exponent bits, one mantissa bit; the low nibble is the even element) and one
shared E8M0 scale byte, the power of two ``2 ** (scale - 127)``. A gpt-oss folder
(``quantization_config.quant_method == "mxfp4"``) stores each layer's expert tensors that way:
``mlp.experts.gate_up_proj_blocks`` ``[E, 2 * I, hidden / 32, 16]`` with
``..._scales`` ``[E, 2 * I, hidden / 32]`` for ``gate_up_proj`` ``[E, hidden, 2 * I]``
(transposed), and the same for ``down_proj``. Everything else is plain.

:class:`Mxfp4Folder` gives the loader (:func:`~tunesmith.models.safetensors_io.load_into_module`,
``derive=``) each ``X`` as a tensor computed from ``X_blocks`` and ``X_scales`` (wherever each
sits) as its shard is loaded: :func:`dequantize_experts` writes it in the load dtype one expert
at a time, so memory holds the packed inputs, the result and one expert's float32 values;
nothing is written to disk.

Example::

    >>> blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # 0.5, 1.0, 0, ...
    >>> dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))[0, :3]
    tensor([1., 2., 0.])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tunesmith.models.safetensors_io import CheckpointError, DerivedTensor, TensorInfo

__all__ = [
    "FP4_E2M1_VALUES",
    "Mxfp4Folder",
    "dequantize_experts",
    "dequantize_mxfp4",
    "is_mxfp4_config",
]

_BLOCKS, _SCALES = "_blocks", "_scales"


def _e2m1(code: int) -> float:
    """The value of a 4-bit E2M1 code: sign, exponent (bias 1), mantissa; exponent 0 is
    subnormal (``0.5 * mantissa``)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 0b1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa)
    return sign * magnitude


FP4_E2M1_VALUES: tuple[float, ...] = tuple(_e2m1(code) for code in range(16))
"""The 16 values of FP4 E2M1 by code (0, 0.5, 1, 1.5, 2, 3, 4, 6, then their negatives)."""


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``blocks`` ``[..., G, 16]`` (uint8, two FP4 codes a byte, low nibble first) and
    ``scales`` ``[..., G]`` (uint8 E8M0) -> ``[..., G * 32]`` values in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} must be scales {list(scales.shape)} + [16]"
        )
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    values = table[codes] * torch.exp2(scales.float() - 127.0)[..., None]
    return values.flatten(-2).to(dtype)


def is_mxfp4_config(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` dict says its weights are MXFP4
    (``quantization_config.quant_method == "mxfp4"``)."""
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


class Mxfp4Folder:
    """How to read an MXFP4 folder: :meth:`derive` turns each ``X_blocks``/``X_scales`` pair
    into ``X`` (transformers' parameter layout, as its own MXFP4 loader gives), checked from
    the headers; a lone or mis-shaped blocks or scales tensor is an error naming its file.

    Example::

        loader(folder, derive=Mxfp4Folder().derive)
    """

    def __init__(self) -> None:
        self.dequantized = 0

    def __repr__(self) -> str:
        return "Mxfp4Folder()"

    def derive(self, infos: Mapping[str, TensorInfo]) -> dict[str, DerivedTensor]:
        """Each MXFP4 pair of ``infos`` (stored name -> header) -> its dequantization."""
        blocks = {n.removesuffix(_BLOCKS) for n in infos if n.endswith(_BLOCKS)}
        scales = {n.removesuffix(_SCALES) for n in infos if n.endswith(_SCALES)}
        for name in sorted(blocks ^ scales):
            have, lack = (_BLOCKS, _SCALES) if name in blocks else (_SCALES, _BLOCKS)
            raise CheckpointError(
                f"{infos[name + have].file}: MXFP4 tensor '{name + have}' has no "
                f"'{name + lack}' in the checkpoint"
            )
        return {
            name: DerivedTensor(
                (name + _BLOCKS, name + _SCALES), _shape(name, infos), self._compute
            )
            for name in sorted(blocks)
        }

    def _compute(
        self, blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype
    ) -> torch.Tensor:
        self.dequantized += 1
        return dequantize_experts(blocks, scales, dtype)


def _shape(name: str, infos: Mapping[str, TensorInfo]) -> tuple[int, ...]:
    """``name``'s dequantized shape ``[E, G * 32, out]`` from its blocks' and scales' headers."""
    blocks, scales = infos[name + _BLOCKS], infos[name + _SCALES]
    problem = None
    if blocks.dtype != "U8" or scales.dtype != "U8":
        problem = f"dtypes {blocks.dtype} and {scales.dtype} (both must be U8)"
    elif len(blocks.shape) != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        problem = (
            f"shapes {list(blocks.shape)} and {list(scales.shape)} (blocks must be "
            "[experts, out, groups, 16], scales [experts, out, groups])"
        )
    if problem:
        raise CheckpointError(
            f"{blocks.file}: MXFP4 tensors '{name + _BLOCKS}' and '{name + _SCALES}' "
            f"({scales.file.name}) have {problem}"
        )
    experts, rows, groups, _ = blocks.shape
    return (experts, groups * 32, rows)


def dequantize_experts(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Experts' ``blocks`` ``[E, out, G, 16]`` and ``scales`` ``[E, out, G]`` -> ``[E, G * 32,
    out]`` in ``dtype`` (transposed, as transformers keeps them), one expert at a time.

    Example::

        >>> blocks = torch.full((2, 3, 1, 16), 0x22, dtype=torch.uint8)  # every value 1.0
        >>> dequantize_experts(blocks, torch.full((2, 3, 1), 127, dtype=torch.uint8)).shape
        torch.Size([2, 32, 3])
    """
    experts, rows, groups, _ = blocks.shape
    out = torch.empty(experts, groups * 32, rows, dtype=dtype, device=blocks.device)
    for expert in range(experts):
        out[expert] = dequantize_mxfp4(blocks[expert], scales[expert], dtype).T
    return out
