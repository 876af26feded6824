"""Colocation, measured: a GRPO step that follows a rollout peaks exactly as the same step with
no rollout before it, because the rollout engine releases its KV cache when its call returns.

The peak is ``benchmarks/colocation.py``'s (on CPU: torch's CPU allocator's reports to the
profiler, replayed from before the rollout, so whatever the rollout leaves allocated counts
in the step's peak). The same measurement on an engine that keeps its pool alive (a reference
held to every cache it makes) must show the pool: that is what makes the equality able to fail.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.colocation import TOLERANCE, GrpoStep, step_peaks
from tunesmith.generation import LocalEngine
from tunesmith.generation.config import EngineSettings
from tunesmith.models import llama3
from tunesmith.training.memory.usage import storage_bytes

ROWS = [[5, 17, 99, 3, 42, 8, 61], [77, 12, 9]]
GROUP = 4
LIMIT = 12


@pytest.fixture(scope="module")
def world():
    """A tiny model, its engine (a 1 MiB pool: far above the tolerance), a rollout call, and the
    GRPO step on that rollout's rows, both run once to warm up (AdamW's state, rope tables)."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny(initializer_range=0.1).eval()
    rows = [r for r in ROWS for _ in range(GROUP)]
    engine = LocalEngine(model, None, pad_id=0, settings=EngineSettings(kv_cache_mib=1.0))

    def rollout():
        return engine.generate(rows, row_keys=list(range(len(rows))), max_new_tokens=LIMIT,
                               temperature=1.0, top_p=None, top_k=None, min_p=None,
                               stop_token_ids=[], stop_strings=[])  # fmt: skip

    step = GrpoStep(model, rows, rollout(), micro_batch=4)
    step()
    return model, rollout, step


def test_a_grpo_step_after_a_rollout_peaks_as_one_without(world, monkeypatch):
    model, rollout, step = world
    released = step_peaks(step, rollout)
    assert released.without_rollout > 0
    assert released.held_at_start == 0
    tolerance = TOLERANCE * released.without_rollout
    assert abs(released.with_rollout - released.without_rollout) <= tolerance, released

    # The same measurement on an engine that keeps every pool it makes: the pool shows.
    kept: list = []
    make = model.init_paged_kv_cache
    monkeypatch.setattr(model, "init_paged_kv_cache",
                        lambda *a, **k: kept.append(make(*a, **k)) or kept[-1])  # fmt: skip
    leaky = step_peaks(step, rollout)
    pool = storage_bytes([*kept[-1].k, *kept[-1].v])
    assert pool >= 2**20 - kept[-1].block_bytes > 10 * tolerance
    assert leaky.held_at_start >= pool, (leaky, pool)
    assert leaky.with_rollout - leaky.without_rollout >= pool - tolerance, (leaky, pool)
