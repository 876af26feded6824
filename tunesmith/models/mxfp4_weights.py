"""MXFP4 checkpoints (gpt-oss): experts stored as ``*_blocks`` and ``*_scales``, dequantized on load.

The OCP microscaling format MXFP4 stores 32 values per block: 16 bytes of FP4 (E2M1: a sign
bit, two exponent bits, one mantissa bit; the low nibble is the even element) and one
shared E8M0 scale byte, the power of two ``2 ** (scale - 127)``. A gpt-oss folder
(``quantization_config.quant_method == "mxfp4"``) stores each layer's expert tensors that way:
``mlp.experts.gate_up_proj_blocks`` ``[E, 2 * I, hidden / 32, 16]`` with
``..._scales`` ``[E, 2 * I, hidden / 32]`` for ``gate_up_proj`` ``[E, hidden, 2 * I]``
(transposed), and the same for ``down_proj``. Everything else is plain.

:func:`dequantized_source` gives the folder to load from: the folder itself, or for an MXFP4
folder a temporary copy whose expert tensors are dequantized (one output file per tensor, so
memory holds one tensor at a time), which :func:`~tunesmith.models.hf.load_hf_weights` reads
as any folder and removes afterwards. The copy costs the dequantized experts' size on disk
(gpt-oss-20b in bfloat16: about 38 GB) under the temporary directory (``TMPDIR``).

Example::

    >>> blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # 0.5, 1.0, 0, ...
    >>> dequantize_mxfp4(blocks, torch.tensor([[128]], dtype=torch.uint8))[0, :3]
    tensor([1., 2., 0.])
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tunesmith.models.safetensors_io import find_weight_files, read_tensor_index

__all__ = [
    "FP4_E2M1_VALUES",
    "dequantize_mxfp4",
    "dequantized_source",
    "dequantize_mxfp4_folder",
    "is_mxfp4_config",
]

_BLOCKS, _SCALES = "_blocks", "_scales"
_INDEX_NAME = "model.safetensors.index.json"


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


def _quantized_pairs(names: list[str], where: Path) -> dict[str, tuple[str, str]]:
    """Dequantized name -> (blocks name, scales name); a blocks tensor without its scales (or
    the reverse) is an error naming it."""
    blocks = {n.removesuffix(_BLOCKS) for n in names if n.endswith(_BLOCKS)}
    scales = {n.removesuffix(_SCALES) for n in names if n.endswith(_SCALES)}
    lone = sorted(blocks ^ scales)
    if lone:
        raise ValueError(f"{where}: MXFP4 tensor(s) {lone} lack their _blocks or _scales")
    return {name: (name + _BLOCKS, name + _SCALES) for name in sorted(blocks)}


def dequantize_mxfp4_folder(
    folder: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write ``folder``'s weights into ``out`` with every ``X_blocks``/``X_scales`` pair
    dequantized to ``X`` in ``dtype`` (transposed to transformers' parameter layout, as its
    own MXFP4 loader does), an index mapping every tensor; returns ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    infos = read_tensor_index(folder)  # blocks and scales may sit in different shards
    pairs = _quantized_pairs(list(infos), Path(folder))
    quantized = {n for pair in pairs.values() for n in pair}
    weight_map: dict[str, str] = {}
    for number, path in enumerate(find_weight_files(folder)[0]):
        with safe_open(path, framework="pt") as f:
            plain = {n: f.get_tensor(n) for n in f.keys() if n not in quantized}  # noqa: SIM118
        weight_map.update(_save(plain, out / f"plain-{number:05d}.safetensors"))
    for number, (name, (blocks, scales)) in enumerate(pairs.items()):
        value = dequantize_mxfp4(
            _read(infos[blocks].file, blocks), _read(infos[scales].file, scales), dtype
        )
        file = out / f"mxfp4-{number:05d}.safetensors"
        weight_map.update(_save({name: value.transpose(1, 2).contiguous()}, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / _INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return out


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(name)


def _save(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    if not tensors:
        return {}
    save_file(tensors, str(path), metadata={"format": "pt"})
    return dict.fromkeys(tensors, path.name)


@contextlib.contextmanager
def dequantized_source(
    folder: str | os.PathLike, *, dtype: torch.dtype | None = None
) -> Iterator[Path]:
    """The folder to read weights from: ``folder`` itself, or for an MXFP4 folder a temporary
    dequantized copy (in ``dtype``, default bfloat16) removed on exit."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if not is_mxfp4_config(config):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="tunesmith-mxfp4-") as tmp:
        yield dequantize_mxfp4_folder(folder, tmp, dtype=dtype or torch.bfloat16)
