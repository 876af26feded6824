"""Count the bytes of live tensors created inside a block: a CPU stand-in for
``torch.cuda.max_memory_allocated`` that tests can assert on.

Every tensor an aten op returns inside :class:`LiveTensorBytes` is recorded by its storage;
a storage counts until the last tensor using it is freed (autograd keeping a tensor for
backward keeps it alive, and counted). Tensors that existed before the block are not counted.

Example::

    >>> with LiveTensorBytes() as mem:
    ...     y = torch.randn(1024) * 2
    >>> mem.peak >= 4096
    True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """``current``: bytes of tracked storages alive now; ``peak``: the most at any moment."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self._track(leaf.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._sizes:
            return
        self._sizes[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key)
