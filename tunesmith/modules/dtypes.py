"""Names of floating dtypes, in one place: config strings (``"bf16"``, ``"torch.float16"``) to
``torch.dtype``.

Used by LoRA's ``adapter_dtype`` (here in ``modules``), ``from_hf``/export ``dtype`` (``models``)
and ``mixed_precision`` autocast (``training``); ``modules`` is the lowest layer that needs it.

Example::

    >>> dtype_from_name("bf16"), dtype_from_name("torch.float32")
    (torch.bfloat16, torch.float32)
    >>> AUTOCAST["fp16"]
    torch.float16
"""

from __future__ import annotations

from typing import Annotated

import torch

from tunesmith.config.typecheck import Check

__all__ = ["AUTOCAST", "DTYPE_NAMES", "DTypeName", "dtype_from_name"]

#: Every accepted name (lower case, without a ``torch.`` prefix) -> dtype.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

#: ``mixed_precision`` config values -> autocast dtype (None: full precision, no autocast).
AUTOCAST: dict[str | None, torch.dtype | None] = {
    None: None,
    "bf16": DTYPE_NAMES["bf16"],
    "fp16": DTYPE_NAMES["fp16"],
}


def dtype_from_name(dtype: torch.dtype | str, *, what: str = "dtype") -> torch.dtype:
    """``dtype`` itself, or the dtype a name stands for (case-insensitive, ``torch.`` optional).

    An unknown name raises ``ValueError`` naming ``what`` (the config key) and every accepted
    name.

    >>> dtype_from_name("Half")
    torch.float16
    >>> dtype_from_name("int4", what="adapter_dtype")
    Traceback (most recent call last):
    ...
    ValueError: unknown adapter_dtype 'int4'; use one of ['bf16', 'bfloat16', 'float', 'float16', 'float32', 'fp16', 'fp32', 'half']
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.").lower()
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown {what} {dtype!r}; use one of {sorted(DTYPE_NAMES)}")
    return DTYPE_NAMES[name]


DTypeName = Annotated[str, Check.raises(dtype_from_name)]
"""A dtype given by name in a config: checked by :func:`dtype_from_name` in ``tunesmith
validate`` and every run before anything is built."""
