"""Format reward: does the completion lay out its reasoning and answer as asked?

:class:`ThinkAnswerFormat` scores 1.0 when the completion is ``<think>...</think>`` followed
by ``<answer>...</answer>`` and nothing else (whitespace aside), else 0.0. Chat templates that
open the think block in the generation prompt (Qwen3 with thinking on) leave the completion
starting inside it, so when the prompt ends with ``<think>`` the text checked is
``"<think>" + completion``.

Example::

    >>> reward = ThinkAnswerFormat()
    >>> reward([Sample("Q", "<think>2+2=4</think>\\n<answer>4</answer>"),
    ...         Sample("Q", "<answer>4</answer>"),
    ...         Sample("Q <think>\\n", "2+2=4</think><answer>4</answer>")])
    [1.0, 0.0, 1.0]
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tunesmith.config.registry import component
from tunesmith.rl.rewards.base import Sample

__all__ = ["THINK_ANSWER_PATTERN", "ThinkAnswerFormat"]

# One think block then one answer block; neither body may open or close another block.
THINK_ANSWER_PATTERN = (
    r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*"
)


@component
class ThinkAnswerFormat:
    """1.0 when the whole completion matches ``pattern`` (``re.fullmatch``, ``re.DOTALL``),
    else 0.0.

    Args:
        pattern: the regex; default :data:`THINK_ANSWER_PATTERN` (exactly one think block,
            then exactly one answer block, only whitespace around them).

    Example (YAML)::

        format: {_component_: tunesmith.rl.rewards.ThinkAnswerFormat}
    """

    name = "think_answer_format"

    def __init__(self, pattern: str | None = None, name: str = "think_answer_format") -> None:
        self.pattern = THINK_ANSWER_PATTERN if pattern is None else pattern
        try:
            self._regex = re.compile(self.pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(
                f"ThinkAnswerFormat: pattern {self.pattern!r} is invalid: {exc}"
            ) from exc
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s) for s in samples]

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        text = sample.completion
        if sample.prompt.rstrip().endswith("<think>"):
            text = "<think>" + text
        return 1.0 if self._regex.fullmatch(text) else 0.0
