"""What a reward sees (:class:`Sample`), what it is (:class:`Reward`), and how several combine
(:class:`RewardSet`).

A reward is any object with a ``name`` and a batched ``__call__(samples) -> list[float]``.
A :class:`RewardSet` calls each of its rewards on the whole batch and returns the weighted sum
plus every unweighted score (:class:`RewardResult`). A reward that raises is not fatal: the
set retries it sample by sample, scores each sample that still raises 0, counts it in
:attr:`RewardResult.failures` and logs the exception once per reward and exception type. A
reward that answers wrongly (not one score per sample, or a NaN/inf score) is a bug and raises
a :class:`ValueError` naming it.

Example::

    >>> class Short:
    ...     name = "short"
    ...     def __call__(self, samples):
    ...         return [1.0 if len(s.completion) < 5 else 0.0 for s in samples]
    >>> rewards = RewardSet({"short": Short()}, weights={"short": 0.5})
    >>> result = rewards([Sample("Q:", "yes"), Sample("Q:", "a long answer")])
    >>> result.total.tolist(), result.per_reward["short"].tolist(), result.failures
    ([0.5, 0.0], [1.0, 0.0], {'short': 0})
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from tunesmith.config.registry import component

__all__ = ["Reward", "RewardResult", "RewardSet", "Sample"]

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    """One completion to score, with what its prompt source knows.

    Attributes:
        prompt: the prompt as rendered text (chat template applied).
        completion: the decoded completion, special tokens removed.
        answer: the reference answer from the prompt source (str, number, list...), or None.
        metadata: anything else the prompt source attached, e.g. ``{"gym_entry": ...}`` for
            reasoning-gym tasks or ``{"tests": [...]}`` for code tasks.
        completion_tokens: length of the completion in tokens.
        finish_reason: ``"stop"`` (a stop token ended it) or ``"length"`` (cut at the limit).

    Example::

        >>> Sample("What is 2+2?", "<answer>4</answer>", answer=4, completion_tokens=6).answer
        4
    """

    prompt: str
    completion: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    completion_tokens: int = 0
    finish_reason: str = "stop"


@runtime_checkable
class Reward(Protocol):
    """A reward component: ``name`` and one float per sample, batched.

    Example::

        >>> class Constant:
        ...     name = "constant"
        ...     def __call__(self, samples):
        ...         return [1.0] * len(samples)
        >>> isinstance(Constant(), Reward)
        True
    """

    name: str

    def __call__(self, samples: Sequence[Sample]) -> list[float]: ...


@dataclass
class RewardResult:
    """What a :class:`RewardSet` returns for ``n`` samples.

    Attributes:
        total: ``[n]`` float32, the weighted sum of the rewards.
        per_reward: name -> ``[n]`` float32 unweighted scores.
        failures: name -> number of samples whose scoring raised (scored 0).

    Example::

        >>> result = RewardResult(torch.ones(2), {"a": torch.ones(2)}, {"a": 0})
        >>> result.total.sum().item()
        2.0
    """

    total: torch.Tensor
    per_reward: dict[str, torch.Tensor]
    failures: dict[str, int]


@component
class RewardSet:
    """Several rewards, each with a weight; ``__call__`` scores a batch with all of them.

    Args:
        rewards: ``{name: reward}`` (the key names the reward in results and weights), or a
            sequence of rewards named by their ``name`` attribute (names must be unique).
        weights: ``{name: weight}``; a reward without an entry weighs 1.0, and a name that is
            not a reward is an error.

    Example (YAML, built by :func:`~tunesmith.config.instantiate`)::

        rewards:
          _component_: tunesmith.rl.rewards.RewardSet
          rewards:
            correct: {_component_: tunesmith.rl.rewards.MathAnswer}
            format: {_component_: tunesmith.rl.rewards.ThinkAnswerFormat}
          weights: {correct: 1.0, format: 0.2}
    """

    def __init__(
        self,
        rewards: Mapping[str, Reward] | Sequence[Reward],
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if isinstance(rewards, Mapping):
            named = {str(key): reward for key, reward in rewards.items()}
        elif isinstance(rewards, Sequence) and not isinstance(rewards, (str, bytes)):
            named = {}
            for index, reward in enumerate(rewards):
                name = getattr(reward, "name", None)
                if not isinstance(name, str) or not name:
                    raise ValueError(
                        f"RewardSet: reward {index} ({type(reward).__name__}) has no name; "
                        "give it a `name` or pass the rewards as a {name: reward} mapping"
                    )
                if name in named:
                    raise ValueError(
                        f"RewardSet: two rewards are named {name!r}; pass them as a "
                        "{name: reward} mapping to name them apart"
                    )
                named[name] = reward
        else:
            raise TypeError(
                f"RewardSet: rewards must be a mapping or a list of rewards, got "
                f"{type(rewards).__name__}"
            )
        if not named:
            raise ValueError("RewardSet: no rewards given")
        for name, reward in named.items():
            if not callable(reward):
                raise TypeError(
                    f"RewardSet: reward {name!r} is a {type(reward).__name__}, not callable"
                )
        unknown = sorted(set(weights or {}) - set(named))
        if unknown:
            raise ValueError(
                f"RewardSet: weights name {unknown}, which are not rewards (rewards: "
                f"{sorted(named)})"
            )
        self.rewards: dict[str, Reward] = named
        self.weights: dict[str, float] = {}
        for name in named:
            weight = (weights or {}).get(name, 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise TypeError(f"RewardSet: weight of {name!r} must be a number, got {weight!r}")
            if not math.isfinite(weight):
                raise ValueError(f"RewardSet: weight of {name!r} is {weight}")
            self.weights[name] = float(weight)
        self._logged: set[tuple[str, str]] = set()

    def __call__(self, samples: Sequence[Sample]) -> RewardResult:
        n = len(samples)
        total = torch.zeros(n, dtype=torch.float32)
        per_reward: dict[str, torch.Tensor] = {}
        failures: dict[str, int] = {}
        for name, reward in self.rewards.items():
            scores, failed = self._score(name, reward, samples)
            per_reward[name] = torch.tensor(scores, dtype=torch.float32).reshape(n)
            failures[name] = failed
            total += self.weights[name] * per_reward[name]
        return RewardResult(total=total, per_reward=per_reward, failures=failures)

    def _score(self, name: str, reward: Reward, samples: Sequence[Sample]) -> tuple[list, int]:
        """Scores of one reward (whole batch, else sample by sample) and its failure count."""
        if not samples:
            return [], 0
        try:
            scores = reward(samples)
        except Exception:
            pass  # retried below, sample by sample, so one bad sample costs only itself
        else:
            return _checked(name, scores, len(samples)), 0
        scores, failed = [], 0
        for sample in samples:
            try:
                one = reward([sample])
            except Exception as exc:
                scores.append(0.0)
                failed += 1
                self._log_failure(name, exc)
            else:
                scores.extend(_checked(name, one, 1))
        return scores, failed

    def _log_failure(self, name: str, exc: Exception) -> None:
        key = (name, type(exc).__name__)
        if key in self._logged:
            return
        self._logged.add(key)
        logger.warning(
            "reward %r raised %s: %s (the sample scores 0; counted in failures[%r]; logged "
            "once per reward and exception type)",
            name,
            type(exc).__name__,
            exc,
            name,
            exc_info=exc,
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}={self.weights[name]:g}" for name in self.rewards)
        return f"RewardSet({parts})"


def _checked(name: str, scores: Any, n: int) -> list[float]:
    """``scores`` as ``n`` finite floats, or a ValueError naming the reward."""
    if isinstance(scores, torch.Tensor):
        scores = scores.detach().reshape(-1).tolist()
    try:
        values = [float(s) for s in scores]
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reward {name!r} returned {type(scores).__name__}, not floats: {exc}"
        ) from exc
    if len(values) != n:
        raise ValueError(f"reward {name!r} returned {len(values)} scores for {n} samples")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(
            f"reward {name!r} returned non-finite scores at samples {bad[:8]} "
            f"({[values[i] for i in bad[:8]]})"
        )
    return values
