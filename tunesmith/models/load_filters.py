"""What a loader leaves out of, or converts in, a Hugging Face folder before the model sees it:
multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``, stored as layers
after the last; skipped with a message) and block-scaled FP8 weights (dequantized, see
:mod:`~tunesmith.models.fp8_weights`).

Example::

    >>> filters = LoadFilters(num_layers=2, mtp_layers=1)
    >>> filters.rename("model.layers.2.eh_proj.weight") is None, filters.skipped
    (True, 1)
    >>> filters.rename("model.layers.1.mlp.gate.weight")
    'model.layers.1.mlp.gate.weight'
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tunesmith.models.fp8_weights import SCALE_SUFFIX, BlockFp8Folder, block_fp8_size
from tunesmith.models.safetensors_io import read_tensor_index

__all__ = ["LoadFilters", "load_filters", "mtp_layers"]

logger = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_layers(config: Mapping[str, Any]) -> int:
    """Multi-token-prediction layers a config names (``num_nextn_predict_layers``, transformers'
    ``num_mtp_layers``).

    >>> mtp_layers({"num_nextn_predict_layers": 1}), mtp_layers({})
    (1, 0)
    """
    return int(config.get("num_nextn_predict_layers") or config.get("num_mtp_layers") or 0)


@dataclass
class LoadFilters:
    """``rename`` (None: leave the tensor out) and ``transform`` (a tensor as read -> as
    loaded) for :func:`~tunesmith.models.safetensors_io.load_into_module`."""

    num_layers: int
    mtp_layers: int = 0
    fp8: BlockFp8Folder | None = None
    skipped: int = 0

    def rename(self, name: str) -> str | None:
        match = _LAYER.match(name)
        if self.mtp_layers and match and int(match[1]) >= self.num_layers:
            self.skipped += 1
            return None
        return name if self.fp8 is None else self.fp8.rename(name)

    def transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.fp8 is None else self.fp8.transform(name, tensor)

    def report(self, folder: str | os.PathLike) -> None:
        if self.skipped:
            logger.warning(
                "%s: %d tensor(s) of the %d multi-token-prediction layer(s) "
                "(num_nextn_predict_layers) not loaded: tunesmith trains next-token prediction",
                folder, self.skipped, self.mtp_layers,
            )  # fmt: skip
        if self.fp8 is not None:
            logger.warning(
                "%s: %d block-scaled FP8 weight(s) dequantized on load (block %s)",
                folder, self.fp8.dequantized, list(self.fp8.block),
            )  # fmt: skip


def load_filters(folder: str | os.PathLike, config: Mapping[str, Any]) -> LoadFilters | None:
    """The filters ``config`` (the folder's ``config.json``) asks for, None when none."""
    mtp = mtp_layers(config)
    block = block_fp8_size(config)
    if not mtp and block is None:
        return None
    fp8 = None
    if block is not None:
        scales = {
            name: info.file
            for name, info in read_tensor_index(folder).items()
            if name.endswith(SCALE_SUFFIX)
        }
        fp8 = BlockFp8Folder(folder, block, scales)
    return LoadFilters(num_layers=config["num_hidden_layers"], mtp_layers=mtp, fp8=fp8)
