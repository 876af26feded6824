"""Colocation measured: a training step's peak memory with a rollout before it and without.

Between rollout and training the paged engine releases its KV cache (the "sleep" RL users ask
for), so a GRPO step that follows a generation call should peak exactly where the same step
peaks with no generation before it. :func:`step_peaks` measures that peak in bytes:

* **CUDA**: ``torch.cuda.max_memory_allocated`` over the step (its peak statistic reset just
  before), everything allocated on the device counted, so a cache the engine kept would show.
* **CPU** (torch has no peak counter there): torch's CPU allocator reports every allocation and
  free to the profiler (``profile_memory=True``, as :class:`~tunesmith.training.memory.usage.
  AllocatedBytes` reads them). The profiler runs from *before* the rollout to the end of the
  step; replaying its reports gives the bytes allocated since it started and still alive at
  each moment, and the step's peak is their maximum inside the step (a
  ``record_function`` span). What the rollout left alive is in it; the rollout's own peak is
  not (it lies outside the span). Weights and optimizer states allocated before are in
  neither case.

The step (:class:`GrpoStep`) is GRPO-shaped: the rollout rows (prompt + completion) through the
policy in micro-batches, :class:`~tunesmith.rl.objective.PolicyGradient`'s clipped loss against
the sampler's log-probs with per-row advantages, ``backward``, AdamW, ``zero_grad``.
``rollout.py``'s section G runs it on the benchmark's model;
``tests/generation/test_colocation_memory.py`` holds the engine to it on a tiny one.

Example::

    >>> from tunesmith.models import llama3
    >>> from tunesmith.generation.paged import generate_paged
    >>> model = llama3.llama3_tiny()
    >>> rows = [[1, 5, 7]] * 4
    >>> out = generate_paged(model, rows, max_new_tokens=4, row_keys=[1, 2, 3, 4], temperature=1.0)
    >>> step = GrpoStep(model, rows, out, micro_batch=2)
    >>> step()  # the warm-up: AdamW allocates its state
    >>> peaks = step_peaks(step, lambda: generate_paged(model, rows, max_new_tokens=4,
    ...                                                 row_keys=[1, 2, 3, 4], temperature=1.0))
    >>> peaks.with_rollout == peaks.without_rollout, peaks.held_at_start
    (True, 0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from tunesmith.generation.generate import GenerationOutput
from tunesmith.modules.losses.rl import PolicyLoss
from tunesmith.rl.objective import PolicyGradient
from tunesmith.rl.rollout import micro_batches, rollout_batch
from tunesmith.training.memory.usage import _quiet_stderr, _walk

__all__ = ["GrpoStep", "Peaks", "step_peak", "step_peaks"]

STEP_LABEL = "colocation::train_step"
TOLERANCE = 0.01  # of the step's peak: a released cache's step peaks within it (0 B measured)


class GrpoStep:
    """One GRPO-shaped optimizer step on fixed rollout rows (the same batch every call)."""

    def __init__(
        self,
        model: nn.Module,
        prompts: list[list[int]],
        rollout: GenerationOutput,
        *,
        micro_batch: int,
        lr: float = 1e-6,
    ) -> None:
        rewards = torch.tensor([float(len(set(s))) for s in rollout.sequences])
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
        batch = rollout_batch(
            prompts, rollout.sequences, 0,
            per_token={"old_logprobs": rollout.logprobs}, per_row={"advantages": advantages},
        )  # fmt: skip
        self.micro = micro_batches(batch, micro_batch)
        self.units = sum(int(mb["labels"].ne(-100).sum()) for mb in self.micro)
        self.model = model
        self.objective = PolicyGradient(PolicyLoss(clip_low=0.2), log_entropy=False)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)

    def __call__(self) -> None:
        was_training = self.model.training
        self.model.train()
        device = next(self.model.parameters()).device
        for mb in self.micro:
            mb = {k: v.to(device) for k, v in mb.items()}
            (self.objective(self.model, mb).loss / self.units).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.train(was_training)


@dataclass(frozen=True)
class Peaks:
    """A step's peak bytes without a rollout before it and with one, and the bytes the rollout
    left allocated when the step began (0 when the engine released everything)."""

    without_rollout: int
    with_rollout: int
    held_at_start: int


def step_peaks(step: Callable[[], Any], rollout: Callable[[], Any]) -> Peaks:
    """Measure ``step``'s peak alone, then after ``rollout`` (see the module docs)."""
    without, _ = step_peak(step)
    with_rollout, held = step_peak(step, rollout)
    return Peaks(without, with_rollout, held)


def step_peak(step: Callable[[], Any], rollout: Callable[[], Any] | None = None) -> tuple[int, int]:
    """``(step's peak bytes, bytes held when it began)``, both counted from before ``rollout``
    (None: no rollout); on the device of ``step.model``'s parameters (CPU without a model).

    >>> step_peak(lambda: torch.ones(1024).sum())  # 4 KiB of ones and the 4-byte sum at once
    (4100, 0)
    """
    model = getattr(step, "model", None)
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        if rollout is not None:
            rollout()
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - before
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, held
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.__enter__()
    try:
        if rollout is not None:
            rollout()
        with record_function(STEP_LABEL):
            step()
    finally:
        with _quiet_stderr():
            prof.__exit__(None, None, None)
    return _replay(prof.profiler.kineto_results.experimental_event_tree())


def _replay(roots: list[Any]) -> tuple[int, int]:
    """Replay the allocator's reports in time order: the most bytes alive (allocated since the
    profiler started) at any moment inside the step's span, and the bytes alive when it began."""
    nodes = list(_walk(roots))
    span = next(n for n in nodes if n.name == STEP_LABEL)
    start, end = span.start_time_ns, span.end_time_ns
    allocations = sorted(
        (n for n in nodes if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns
    )
    live: dict[int, int] = {}
    current, held, peak = 0, None, 0
    for node in allocations:
        fields, at = node.extra_fields, node.start_time_ns
        if fields.device.type != "cpu" or at > end:
            continue
        if at >= start and held is None:
            held = peak = current
        if fields.alloc_size > 0:
            live[fields.ptr] = fields.alloc_size
            current += fields.alloc_size
        elif fields.ptr in live:  # frees of blocks from before the profiler are not counted
            current -= live.pop(fields.ptr)
        if held is not None:
            peak = max(peak, current)
    return peak, current if held is None else held
