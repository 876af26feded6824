"""Length reward: DAPO's soft overlong punishment.

With ``L`` the completion's token count, ``M = max_length`` and ``C = cache_length``, the
penalty is 0 while ``L <= M - C``, falls linearly to -1 over the last ``C`` tokens,
``(M - C - L) / C``, and is -1 beyond ``M``. Add it to a correctness reward with weight 1 to
discourage completions that run into the generation limit without throwing away their
answer.

Example::

    >>> penalty = OverlongPenalty(max_length=100, cache_length=20)
    >>> penalty([Sample("", "", completion_tokens=n) for n in (50, 80, 90, 100, 120)])
    [0.0, 0.0, -0.5, -1.0, -1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

from tunesmith.config.registry import component
from tunesmith.rl.rewards.base import Sample

__all__ = ["OverlongPenalty"]


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"OverlongPenalty: {what} must be a positive int, got {value!r}")
    return value


@component
class OverlongPenalty:
    """DAPO's soft overlong punishment on :attr:`Sample.completion_tokens` (see the module
    docs), in ``[-1, 0]``.

    Args:
        max_length: the generation limit ``M`` in tokens.
        cache_length: the length ``C`` of the punished interval before it,
            ``1 <= C <= M``.

    Example (YAML)::

        overlong: {_component_: tunesmith.rl.rewards.OverlongPenalty, max_length: 4096,
                   cache_length: 512}
    """

    name = "overlong_penalty"

    def __init__(self, max_length: int, cache_length: int, name: str = "overlong_penalty") -> None:
        self.max_length = _positive_int(max_length, "max_length")
        self.cache_length = _positive_int(cache_length, "cache_length")
        if self.cache_length > self.max_length:
            raise ValueError(
                f"OverlongPenalty: cache_length ({cache_length}) exceeds max_length ({max_length})"
            )
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s.completion_tokens) for s in samples]

    def score(self, length: int) -> float:
        """The penalty of a completion of ``length`` tokens."""
        start = self.max_length - self.cache_length
        if length <= start:
            return 0.0
        if length <= self.max_length:
            return (start - length) / self.cache_length
        return -1.0
