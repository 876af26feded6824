"""String rewards: the completion compared with a reference string as it is, character by
character (no answer extraction, no case folding, no number parsing).

- :class:`StringMatch`: 1.0 when the completion is exactly the reference, else 0.0 (a strict
  verifier for tasks whose answer is a string: sorted letters, a reversed word, a code);
- :class:`CharacterMatch`: partial credit, the fraction of positions where the completion and
  the reference agree, so a near miss scores more than a far one (reward shaping).

Surrounding whitespace of the completion is ignored by both (``strip=False`` keeps it). A
list/tuple reference accepts any of its items (the best score counts); a sample without a
reference, or with a reference that is not a string, raises (a
:class:`~tunesmith.rl.rewards.RewardSet` scores it 0 and counts it).

Example::

    >>> samples = [Sample("", "ABD", answer="ABD"), Sample("", "ABC", answer="ABD"),
    ...            Sample("", "abd", answer="ABD")]
    >>> StringMatch()(samples), CharacterMatch()(samples)
    ([1.0, 0.0, 0.0], [1.0, 0.6666666666666666, 0.0])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tunesmith.config.registry import component
from tunesmith.rl.rewards.base import Sample

__all__ = ["CharacterMatch", "StringMatch", "character_match"]


def _references(answer: Any) -> list[str]:
    references = list(answer) if isinstance(answer, (list, tuple)) else [answer]
    if answer is None or not references:
        raise ValueError("the sample has no reference answer (Sample.answer is None or empty)")
    for ref in references:
        if not isinstance(ref, str):
            raise ValueError(f"reference answer {ref!r} is a {type(ref).__name__}, not a str")
    return references


def character_match(text: str, reference: str) -> float:
    """The fraction of positions where ``text`` and ``reference`` hold the same character:
    ``matches / max(len(text), len(reference))``, so missing and extra characters both cost;
    1.0 exactly when the strings are equal (two empty strings included).

    Example::

        >>> character_match("ACE", "ACE"), character_match("AC", "ACE")
        (1.0, 0.6666666666666666)
        >>> character_match("CAE", "ACE")  # only E is in its place
        0.3333333333333333
    """
    longest = max(len(text), len(reference))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(text, reference)) / longest


class _StrippedText:
    """A reward scored sample by sample on the completion (whitespace around it stripped
    unless ``strip=False``)."""

    name = "text"

    def __init__(self, strip: bool = True, name: str | None = None) -> None:
        self.strip = bool(strip)
        self.name = name or type(self).name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s) for s in samples]

    def text(self, sample: Sample) -> str:
        return sample.completion.strip() if self.strip else sample.completion

    def score(self, sample: Sample) -> float:
        raise NotImplementedError


@component
class StringMatch(_StrippedText):
    """1.0 when the completion is exactly the reference string, else 0.0.

    Args:
        strip: ignore whitespace around the completion (not inside it).
        name: the reward's name in logs.

    Example (YAML)::

        correct: {_component_: tunesmith.rl.rewards.strings.StringMatch}
    """

    name = "string_match"

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        return 1.0 if self.text(sample) in _references(sample.answer) else 0.0


@component
class CharacterMatch(_StrippedText):
    """Partial credit: :func:`character_match` of the completion and the reference (the best
    over a list of references), in [0, 1], 1.0 only for an exact match.

    Args:
        strip: ignore whitespace around the completion (not inside it).
        name: the reward's name in logs.

    Example (YAML)::

        rewards:
          _component_: tunesmith.rl.rewards.RewardSet
          rewards:
            correct: {_component_: tunesmith.rl.rewards.strings.StringMatch}
            characters: {_component_: tunesmith.rl.rewards.strings.CharacterMatch}
          weights: {correct: 1.0, characters: 0.5}
    """

    name = "character_match"

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        text = self.text(sample)
        return max(character_match(text, ref) for ref in _references(sample.answer))
