"""How completions are sampled: the settings every decode uses, whatever the engine.

:class:`GenerationConfig` is the ``generation:`` section of an RL config, and what every other
decode of the library (held-out rewards, in-training samples, ``tunesmith generate``/``chat``,
lm-eval, the demos) builds; each hands it to a
:class:`~tunesmith.generation.engine.RolloutEngine` through
:func:`~tunesmith.generation.engine.generate_with`. ``temperature=0`` is greedy decoding (RL
configs refuse it where they are read: a policy gradient needs samples).

Example::

    >>> GenerationConfig(max_new_tokens=8, top_p=0.9).temperature
    1.0
    >>> GenerationConfig(temperature=0.0).temperature  # greedy
    0.0
    >>> GenerationConfig(temperature=-1.0)
    Traceback (most recent call last):
    ValueError: temperature must be >= 0 (0 is greedy), got -1.0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GenerationConfig"]


@dataclass
class GenerationConfig:
    """How completions are sampled (the ``generation:`` section of an RL config).

    ``temperature`` 0 is greedy, > 0 samples (then ``top_p``/``top_k``/``min_p`` filter).
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
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
