"""Measure memory: the process peak, and the bytes of live tensors created inside a block.

:func:`peak_memory_gb` is the whole-process high-water mark the recipes log. :class:`LiveTensorBytes`
counts the storages of tensors created inside a ``with`` block (a CPU stand-in for
``torch.cuda.max_memory_allocated``), and :class:`PeakMemory` picks the right counter for a
device: the CUDA allocator's statistics on a GPU, the live-tensor counter elsewhere.

Example::

    >>> peak_memory_gb(torch.device("cpu")) > 0
    True
    >>> with LiveTensorBytes() as mem:
    ...     y = torch.randn(1024) * 2          # two 4 KiB tensors, the first freed at once
    >>> mem.peak >= 8192, mem.current >= 4096
    (True, True)
"""

from __future__ import annotations

import resource
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes", "PeakMemory", "peak_memory_gb", "storage_bytes"]


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory (CUDA), else this process's peak resident set, in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)  # bytes on macOS, KiB elsewhere


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the block that are alive: ``current`` now,
    ``peak`` the most at any moment.

    Every tensor an aten op returns inside the block is recorded by its storage (forward,
    backward and optimizer ops alike); a storage counts until the last tensor using it is
    freed, so a tensor autograd keeps for backward stays counted. Storages that existed
    before the block (the weights) are not counted, nor are views or in-place results of
    them (an output sharing an input's storage is not new memory). Wrapper subclasses
    (``DTensor``) are counted by the plain tensors inside them. Meta tensors count nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in _plain_tensors(tree_leaves((args, kwargs)))}
        for tensor in _plain_tensors(tree_leaves(out)):
            if _key(tensor) not in inputs:
                self._track(tensor.untyped_storage())
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


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _plain_tensors(leaves: list[Any]) -> list[torch.Tensor]:
    """The non-meta plain tensors among ``leaves``, looking inside wrapper subclasses."""
    found: list[torch.Tensor] = []
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            found.extend(_plain_tensors([getattr(leaf, name) for name in names]))
        else:
            found.append(leaf)
    return found


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tied or shared tensor once; a
    ``DTensor`` by its local shard).

    Example::

        >>> w = torch.zeros(256)
        >>> storage_bytes([w, w[:10], torch.zeros(2)])
        1032
    """
    seen: dict[int, int] = {}
    for tensor in _plain_tensors(list(tensors)):
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class PeakMemory:
    """Peak bytes allocated inside a block *above* what was allocated when it began.

    On CUDA this is ``max_memory_allocated`` (its peak statistic is reset on entry); on other
    devices, the :class:`LiveTensorBytes` peak of the tensors created in the block. Either
    way ``peak`` excludes what already existed (weights, optimizer states), so add those to
    get the process's peak.

    Example::

        >>> with PeakMemory(torch.device("cpu")) as mem:
        ...     loss = model(batch).sum(); loss.backward()        # doctest: +SKIP
        >>> mem.peak                                              # doctest: +SKIP
        31457280
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.peak = 0
        self._live: LiveTensorBytes | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._live = LiveTensorBytes().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
            self.peak = self._live.peak
            self._live = None
        else:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
