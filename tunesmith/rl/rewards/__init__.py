"""Rewards as components: each scores a batch of :class:`Sample`; a :class:`RewardSet`
combines them with weights and survives rewards that raise.

* :mod:`~tunesmith.rl.rewards.base`: :class:`Sample`, the :class:`Reward` protocol,
  :class:`RewardSet` and :class:`RewardResult`;
* :mod:`~tunesmith.rl.rewards.answers`: :func:`extract_answer`, :class:`ExactAnswer`,
  :class:`MathAnswer` (math-verify);
* :mod:`~tunesmith.rl.rewards.format`: :class:`ThinkAnswerFormat`;
* :mod:`~tunesmith.rl.rewards.length`: :class:`OverlongPenalty` (DAPO);
* :mod:`~tunesmith.rl.rewards.sandbox` and :mod:`~tunesmith.rl.rewards.code`:
  :func:`run_sandboxed` and :class:`CodeTests`;
* :mod:`~tunesmith.rl.rewards.model`: :class:`RewardModelScore` (a trained reward model);
* :mod:`~tunesmith.rl.rewards.gym`: :class:`ReasoningGymScore` (reasoning-gym verifiers).

Example (YAML, built by :func:`~tunesmith.config.instantiate`)::

    rewards:
      _component_: tunesmith.rl.rewards.RewardSet
      rewards:
        correct: {_component_: tunesmith.rl.rewards.MathAnswer}
        format: {_component_: tunesmith.rl.rewards.ThinkAnswerFormat}
        overlong: {_component_: tunesmith.rl.rewards.OverlongPenalty, max_length: 4096,
                   cache_length: 512}
      weights: {correct: 1.0, format: 0.2, overlong: 1.0}
"""

from tunesmith.rl.rewards.answers import (
    EXTRACT_MODES,
    ExactAnswer,
    MathAnswer,
    extract_answer,
    parse_number,
)
from tunesmith.rl.rewards.base import Reward, RewardResult, RewardSet, Sample
from tunesmith.rl.rewards.code import CodeTests, extract_code
from tunesmith.rl.rewards.format import THINK_ANSWER_PATTERN, ThinkAnswerFormat
from tunesmith.rl.rewards.gym import ReasoningGymScore
from tunesmith.rl.rewards.length import OverlongPenalty
from tunesmith.rl.rewards.model import RewardModelScore
from tunesmith.rl.rewards.sandbox import (
    ISOLATION_MODES,
    SandboxResult,
    available_isolation,
    namespaces_available,
    run_sandboxed,
)
from tunesmith.rl.rewards.strings import CharacterMatch, StringMatch, character_match

__all__ = [
    "EXTRACT_MODES",
    "ISOLATION_MODES",
    "THINK_ANSWER_PATTERN",
    "CharacterMatch",
    "CodeTests",
    "ExactAnswer",
    "MathAnswer",
    "OverlongPenalty",
    "ReasoningGymScore",
    "Reward",
    "RewardModelScore",
    "RewardResult",
    "RewardSet",
    "Sample",
    "SandboxResult",
    "StringMatch",
    "ThinkAnswerFormat",
    "available_isolation",
    "character_match",
    "extract_answer",
    "extract_code",
    "namespaces_available",
    "parse_number",
    "run_sandboxed",
]
