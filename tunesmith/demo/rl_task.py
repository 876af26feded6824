"""The RL demo's task: sort letters, learned from few demonstrations plus a verifier.

Draft (experiments).
"""

from __future__ import annotations

from collections.abc import Sequence

from tunesmith.rl.rewards.base import Sample

__all__ = ["SortedExact", "SortedPositions"]


class SortedExact:
    name = "correct"

    def __init__(self, name: str = "correct") -> None:
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [1.0 if s.completion.strip() == s.answer else 0.0 for s in samples]


class SortedPositions:
    name = "positions"

    def __init__(self, name: str = "positions") -> None:
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        out = []
        for s in samples:
            reply, answer = s.completion.strip(), str(s.answer)
            hits = sum(a == b for a, b in zip(reply, answer))
            out.append(hits / max(len(reply), len(answer), 1))
        return out
