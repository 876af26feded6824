"""Measure memory: the process peak, and the bytes allocated inside a block.

:func:`peak_memory_gb` is the whole-process high-water mark the recipes log, under the name
:func:`peak_memory_metric` gives it (``peak_alloc_gb``: the CUDA allocator's peak;
``peak_rss_gb``: the process's peak resident set, on a CPU).
:class:`AllocatedBytes` is the CPU stand-in for ``torch.cuda.max_memory_allocated``: torch's
CPU allocator reports every allocation and free to the profiler, and the peak of what the
block allocated and has not yet freed is read from those reports; it also says where that
peak sits (the op, and the tensors alive at that moment). :class:`LiveTensorBytes` counts
tensor storages op by op from a dispatch mode, which lets a benchmark leave chosen tensors out.
:class:`PeakMemory` picks the right counter for a device: the CUDA allocator's statistics on
a GPU, :class:`AllocatedBytes` elsewhere.

Example::

    >>> peak_memory_gb(torch.device("cpu")) > 0
    True
    >>> with AllocatedBytes() as mem:
    ...     y = torch.randn(1024) * 2          # two 4 KiB tensors, the first freed at once
    >>> mem.peak >= 8192
    True
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = [
    "AllocatedBytes", "LiveTensorBytes", "PeakMemory", "peak_memory_gb", "peak_memory_metric",
    "storage_bytes",
]  # fmt: skip


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated accelerator memory (CUDA), else this process's peak resident set, in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1e9 if sys.platform == "darwin" else 1e6)  # bytes on macOS, KiB elsewhere


def peak_memory_metric(device: torch.device) -> tuple[str, float]:
    """:func:`peak_memory_gb` under a name that says what it measured: ``peak_alloc_gb`` (the
    CUDA caching allocator's peak of allocated tensors, ``torch.cuda.max_memory_allocated``)
    or ``peak_rss_gb`` (the process's peak resident set: weights, activations, the Python
    interpreter and every library, the high-water mark of the whole process).

    Example::

        >>> peak_memory_metric(torch.device("cpu"))[0]
        'peak_rss_gb'
    """
    name = "peak_alloc_gb" if device.type == "cuda" else "peak_rss_gb"
    return name, peak_memory_gb(device)


@dataclass(frozen=True)
class Allocation:
    """One block alive at the peak: its ``bytes`` and the ops that were running when it was
    allocated, outermost first (``"Optimizer.step#AdamW.step > aten::sqrt"``)."""

    bytes: int
    where: str


class AllocatedBytes:
    """Peak bytes that the CPU allocator handed out inside the block and had not taken back.

    torch's CPU allocator reports each allocation and free to the profiler when it records
    memory; this counter runs the profiler over the block and replays those reports. It
    counts what torch allocated (tensors, and scratch memory kernels take from torch's
    allocator), not memory a library mallocs itself. Unlike a dispatch mode it does not
    change what it measures: under any Python dispatch mode autograd adds a tied weight's two
    gradients out of place, one gradient's worth more than a plain run holds.

    After the block, ``peak`` is the most bytes allocated inside the block and alive at once
    (blocks that existed before, and their frees, are not counted), ``peak_op`` the ops
    running when that peak was reached, and ``peak_allocations`` the blocks alive at that
    moment, largest first.

    Example::

        >>> with AllocatedBytes() as mem:
        ...     y = torch.randn(1024, 1024).sqrt()     # 4 MiB input, 4 MiB result
        >>> mem.peak >= 8 * 2**20
        True
        >>> mem.peak_op
        'aten::sqrt'
    """

    def __init__(self) -> None:
        self.peak = 0
        self.peak_op = ""
        self.peak_allocations: list[Allocation] = []
        self._profile: profile | None = None

    def __enter__(self) -> AllocatedBytes:
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        prof, self._profile = self._profile, None
        assert prof is not None
        with _quiet_stderr():
            prof.__exit__(*exc)
        self._replay(prof.profiler.kineto_results.experimental_event_tree())

    def _replay(self, roots: list[Any]) -> None:
        events = sorted(
            (node for node in _walk(roots) if node.tag == _EventType.Allocation),
            key=lambda node: node.start_time_ns,
        )
        live: dict[int, tuple[int, Any]] = {}  # allocated in the block, not freed yet
        current = 0
        for node in events:
            fields = node.extra_fields
            if fields.device.type != "cpu":
                continue
            if fields.alloc_size > 0:
                live[fields.ptr] = (fields.alloc_size, node)
                current += fields.alloc_size
            elif fields.ptr in live:  # frees of older blocks are not this block's
                current -= live.pop(fields.ptr)[0]
            if current > self.peak:
                self.peak = current
                self.peak_op = _where(node)
                self.peak_allocations = [Allocation(size, _where(n)) for size, n in live.values()]
        self.peak_allocations.sort(key=lambda a: -a.bytes)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (the profiler's C++ side logs its start and stop there)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _where(node: Any) -> str:
    """The names of the ops enclosing a profiler event, outermost first."""
    names = []
    parent = node.parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.parent
    return " > ".join(reversed(names)) or "(outside any op)"


class LiveTensorBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the block that are alive: ``current`` now,
    ``peak`` the most at any moment.

    Every tensor an aten op returns inside the block is recorded by its storage (forward,
    backward and optimizer ops alike); a storage counts until the last tensor using it is
    freed, so a tensor autograd keeps for backward stays counted. Storages that existed
    before the block (the weights) are not counted, nor are views or in-place results of
    them (an output sharing an input's storage is not new memory). Wrapper subclasses
    (``DTensor``) are counted by the plain tensors inside them. Meta tensors count nothing.

    Under any Python dispatch mode autograd adds a tied weight's two gradients out of place
    (one gradient's worth more at that moment than a plain run): measure whole training
    steps with :class:`AllocatedBytes`.
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
    devices, the :class:`AllocatedBytes` peak of the CPU allocator in the block. Either
    way ``peak`` excludes what already existed (weights, optimizer states), so add those to
    get the process's peak.

    Example::

        >>> model = torch.nn.Linear(256, 256)
        >>> with PeakMemory(torch.device("cpu")) as mem:
        ...     loss = model(torch.randn(64, 256)).sum(); loss.backward()
        >>> mem.peak >= 2 * 64 * 256 * 4  # at least the input and the output, in float32
        True
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.peak = 0
        self._allocated: AllocatedBytes | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._allocated = AllocatedBytes().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._allocated is not None:
            self._allocated.__exit__(*exc)
            self.peak = self._allocated.peak
            self._allocated = None
        else:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
