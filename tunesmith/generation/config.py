"""How completions are sampled: the settings every rollout decodes with, whatever the engine.

:class:`GenerationConfig` is the ``generation:`` section of an RL config; the synchronous
recipes (their trainer's own policy) and the Ray rollout workers hand it to a
:class:`~tunesmith.generation.engine.RolloutEngine` through
:func:`~tunesmith.generation.engine.generate_with`.

Example::

    >>> GenerationConfig(max_new_tokens=8, top_p=0.9).temperature
    1.0
    >>> GenerationConfig(temperature=0.0)
    Traceback (most recent call last):
    ValueError: generation.temperature must be > 0 for RL sampling, got 0.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GenerationConfig"]


@dataclass
class GenerationConfig:
    """How completions are sampled (the ``generation:`` section of an RL config).

    ``stop_strings`` end a completion after the token that completes one; ``stop_tokens``
    (token strings such as ``"<|im_end|>"``) and the tokenizer's end-of-sequence token end
    it at that token.
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_strings: Sequence[str] = ()
    stop_tokens: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"generation.temperature must be > 0 for RL sampling, got {self.temperature}"
            )
