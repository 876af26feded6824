"""reasoning-gym reward: each task's own verifier scores the answer.

:class:`ReasoningGymScore` reads the reasoning-gym entry that
:class:`~tunesmith.rl.prompts.ReasoningGymPrompts` stores in ``metadata["gym_entry"]``, finds
the scoring function of the dataset named by the entry's ``metadata["source_dataset"]``
(``reasoning_gym.get_score_answer_fn``, cached per dataset) and scores the extracted answer
with it: a float in [0, 1], 1.0 for a right answer, partial credit where the task gives some.

Example::

    >>> import reasoning_gym
    >>> entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)[0]
    >>> reward = ReasoningGymScore()
    >>> reward([Sample(entry["question"], f"<answer>{entry['answer']}</answer>",
    ...                metadata={"gym_entry": entry})])
    [1.0]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tunesmith.config.registry import component
from tunesmith.rl.rewards.answers import ExtractMode, check_extract_mode, extract_answer
from tunesmith.rl.rewards.base import Sample

__all__ = ["ReasoningGymScore"]


@component
class ReasoningGymScore:
    """The reasoning-gym task's score of the completion's answer.

    Args:
        extract: how to find the answer (see :func:`~tunesmith.rl.rewards.extract_answer`);
            default the ``<answer>`` tag content. When the mode finds nothing, the whole
            completion (stripped) is scored.

    A sample without a valid ``metadata["gym_entry"]`` raises (the
    :class:`~tunesmith.rl.rewards.RewardSet` scores it 0 and counts it).

    Example (YAML)::

        gym: {_component_: tunesmith.rl.rewards.ReasoningGymScore}
    """

    name = "reasoning_gym"

    def __init__(self, extract: ExtractMode = "answer_tag", name: str = "reasoning_gym") -> None:
        self.extract = check_extract_mode(extract)
        self.name = name
        self._score_fns: dict[str, Callable[[str | None, dict[str, Any]], float]] = {}
        import reasoning_gym  # noqa: F401  (fail at build time when the rl extra is missing)

    def _score_fn(self, dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
        if dataset not in self._score_fns:
            import reasoning_gym

            self._score_fns[dataset] = reasoning_gym.get_score_answer_fn(dataset)
        return self._score_fns[dataset]

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.score(s) for s in samples]

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        entry = sample.metadata.get("gym_entry")
        if not isinstance(entry, dict):
            raise KeyError(
                "ReasoningGymScore: the sample has no reasoning-gym entry in "
                f"metadata['gym_entry'] (metadata keys: {sorted(sample.metadata)})"
            )
        dataset = (entry.get("metadata") or {}).get("source_dataset")
        if not isinstance(dataset, str):
            raise KeyError(
                "ReasoningGymScore: metadata['gym_entry']['metadata']['source_dataset'] is "
                f"missing (entry keys: {sorted(entry)})"
            )
        answer = extract_answer(sample.completion, self.extract)
        if answer is None:
            answer = sample.completion.strip()
        return float(self._score_fn(dataset)(answer, entry))
