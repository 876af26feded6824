"""Preflight: one forward and backward on the longest batch before training starts, so a
configuration that does not fit fails in the first seconds rather than at step 300.

:func:`longest_batch` collates the ``batch_size`` longest items of a dataset (the longest
samples, or the fullest packs); :func:`preflight` runs the loss on it, backpropagates, then
drops the gradients. It never steps an optimizer and runs under a forked RNG, so weights,
random streams and the data order of the run that follows are exactly those of a run
without it. Run it before the optimizer exists (an optimizer in backward would step from
its gradient hooks); with ``free_grads_in_backward`` each gradient is dropped as soon as it
is complete, as an optimizer in backward would, so the measured peak matches that run.

Example::

    >>> from tunesmith.data import PackedDataset, collate_packed
    >>> from tunesmith.models import llama3
    >>> from tunesmith.modules.losses import CrossEntropyLoss
    >>> from tunesmith.training.memory.planner import estimate_memory
    >>> model, loss_fn = llama3.llama3_tiny(), CrossEntropyLoss()
    >>> dataset = PackedDataset([{"input_ids": [1, 2, 3], "labels": [2, 3, -100]}] * 5, 8, 0)
    >>> batch = longest_batch(dataset, batch_size=2, collate=collate_packed)
    >>> report = preflight(model, batch, lambda b: loss_fn(model(b["input_ids"]), b["labels"]),
    ...                    device=torch.device("cpu"))
    >>> plan = estimate_memory(model, batch_size=2, seq_len=8)
    >>> print(report.summary(plan))  # doctest: +NORMALIZE_WHITESPACE
    preflight: forward+backward on the longest batch (2 x 8) in ... s, peak ... MiB measured
    vs ... MiB estimated (weights + activations + logits)
    preflight: with optimizer states and gradients the estimated peak is ... MiB
    >>> all(p.grad is None for p in model.parameters())  # nothing left behind
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tunesmith.training.memory.planner import MemoryPlan
from tunesmith.training.memory.usage import PeakMemory, storage_bytes

__all__ = ["PreflightReport", "longest_batch", "preflight"]

Batch = dict[str, torch.Tensor]


def _real_length(item: Mapping[str, Sequence[int]]) -> int:
    """Tokens of a sample (of both sequences of a preference pair: ``chosen_input_ids`` and
    ``rejected_input_ids``), or the non-padding tokens of a pack (``document_ids >= 0``)."""
    if "document_ids" in item:
        return sum(1 for d in item["document_ids"] if d >= 0)
    return sum(len(ids) for key, ids in item.items() if key.endswith("input_ids"))


def _trained(item: Mapping[str, Sequence[int]]) -> int:
    """Trained labels of a sample (of every ``*labels`` sequence of a pair)."""
    return sum(
        sum(1 for label in labels if label >= 0)
        for key, labels in item.items()
        if key.endswith("labels")
    )


def longest_batch(
    dataset: Sequence[Mapping[str, Sequence[int]]],
    batch_size: int,
    collate: Callable[[list[Any]], Batch],
) -> Batch:
    """Collate the ``batch_size`` items of ``dataset`` with the most tokens (ties: the most
    trained labels, then dataset order): the batch that needs the most memory.

    Raises:
        ValueError: the dataset holds fewer than ``batch_size`` items.

    Example::

        >>> items = [{"input_ids": [1] * n, "labels": [-100] * n} for n in (3, 9, 5)]
        >>> longest_batch(items, 2, lambda b: b)[0]["input_ids"]
        [1, 1, 1, 1, 1, 1, 1, 1, 1]
    """
    if len(dataset) < batch_size:
        raise ValueError(
            f"the dataset has {len(dataset)} items, fewer than batch_size {batch_size}"
        )
    items = [dataset[i] for i in range(len(dataset))]
    order = sorted(
        range(len(items)), key=lambda i: (-_real_length(items[i]), -_trained(items[i]), i)
    )
    return collate([items[i] for i in order[:batch_size]])


@dataclass(frozen=True)
class PreflightReport:
    """What the preflight step measured.

    ``step_bytes``: the peak bytes allocated during forward and backward above what existed
    before (the CPU allocator's peak, the CUDA allocator's on a GPU);
    ``resident_bytes``: what existed before on the device (weights and buffers).
    """

    seconds: float
    step_bytes: int
    resident_bytes: int
    batch_shape: tuple[int, ...]

    @property
    def peak_bytes(self) -> int:
        return self.resident_bytes + self.step_bytes

    def summary(self, plan: MemoryPlan | None = None) -> str:
        """One or two lines: time and measured peak, next to the plan's estimate for the same
        phase (weights + the start of backward; optimizer states are created at the first
        step, after the preflight)."""
        shape = " x ".join(str(n) for n in self.batch_shape)
        line = (
            f"preflight: forward+backward on the longest batch ({shape}) in {self.seconds:.2f} s, "
            f"peak {_mib(self.peak_bytes)} measured"
        )
        if plan is None:
            return line
        estimate = plan.weights + plan.backward_peak
        return (
            f"{line} vs {_mib(estimate)} estimated (weights + activations + logits)\n"
            f"preflight: with optimizer states and gradients the estimated peak is "
            f"{_mib(plan.total)}"
        )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def preflight(
    model: nn.Module,
    batch: Batch,
    loss_fn: Callable[[Batch], torch.Tensor],
    *,
    device: torch.device | str,
    free_grads_in_backward: bool = False,
) -> PreflightReport:
    """Run ``loss_fn(batch)`` (a scalar loss of ``model``) and its backward once; measure the
    peak memory; leave every gradient of ``model`` None and the RNG state as it was.

    Args:
        batch: tensors already on ``device`` (see :func:`longest_batch`).
        free_grads_in_backward: drop each parameter's gradient as soon as it is complete
            (what an optimizer in backward does after its step).
    """
    device = torch.device(device)
    params = [p for p in model.parameters() if p.requires_grad]
    resident = storage_bytes([*model.parameters(), *model.buffers()])
    handles = []
    if free_grads_in_backward:
        handles = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
    rng_devices = [device] if device.type == "cuda" else []
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=rng_devices), PeakMemory(device) as memory:
            loss = loss_fn(batch)
            loss.backward()
            del loss
    finally:
        for handle in handles:
            handle.remove()
        for p in params:
            p.grad = None
    seconds = time.perf_counter() - start
    if device.type == "cuda":
        resident = torch.cuda.memory_allocated(device)
    return PreflightReport(
        seconds=seconds,
        step_bytes=memory.peak,
        resident_bytes=resident,
        batch_shape=tuple(batch["input_ids"].shape),
    )


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None
