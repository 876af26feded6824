"""What a loader leaves out of, or converts in, a Hugging Face folder before the model sees it:
multi-token-prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``, stored as layers
after the last; skipped with a message), block-scaled FP8 weights and MXFP4 experts (each
computed from its stored data and scales as it is loaded, see
:mod:`~tunesmith.models.fp8_weights` and :mod:`~tunesmith.models.mxfp4_weights`).

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

from tunesmith.models.fp8_weights import BlockFp8Folder, block_fp8_size
from tunesmith.models.mxfp4_weights import Mxfp4Folder, is_mxfp4_config
from tunesmith.models.safetensors_io import DerivedTensor, TensorInfo

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
    """``rename`` (None: leave the tensor out) and ``derive`` (the tensors computed from
    others as they are loaded) for :func:`~tunesmith.models.safetensors_io.load_into_module`."""

    num_layers: int
    mtp_layers: int = 0
    fp8: BlockFp8Folder | None = None
    mxfp4: Mxfp4Folder | None = None
    skipped: int = 0

    def rename(self, name: str) -> str | None:
        match = _LAYER.match(name)
        if self.mtp_layers and match and int(match[1]) >= self.num_layers:
            self.skipped += 1
            return None
        return name if self.fp8 is None else self.fp8.rename(name)

    def derive(self, infos: Mapping[str, TensorInfo]) -> dict[str, DerivedTensor]:
        """FP8 weights and MXFP4 experts of ``infos`` (stored name -> header), dequantized."""
        derived = {} if self.fp8 is None else self.fp8.derive(infos)
        return derived | ({} if self.mxfp4 is None else self.mxfp4.derive(infos))

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
        if self.mxfp4 is not None:
            logger.info(
                "%s: %d MXFP4 tensor(s) dequantized on load", folder, self.mxfp4.dequantized
            )


def load_filters(config: Mapping[str, Any]) -> LoadFilters | None:
    """The filters ``config`` (a folder's ``config.json``) asks for, None when none.

    >>> load_filters({"num_hidden_layers": 2, "quantization_config": {"quant_method": "mxfp4"}})
    LoadFilters(num_layers=2, mtp_layers=0, fp8=None, mxfp4=Mxfp4Folder(), skipped=0)
    >>> load_filters({"num_hidden_layers": 2}) is None
    True
    """
    mtp = mtp_layers(config)
    block = block_fp8_size(config)
    mxfp4 = Mxfp4Folder() if is_mxfp4_config(config) else None
    if not mtp and block is None and mxfp4 is None:
        return None
    fp8 = None if block is None else BlockFp8Folder(block)
    return LoadFilters(num_layers=config["num_hidden_layers"], mtp_layers=mtp, fp8=fp8, mxfp4=mxfp4)
