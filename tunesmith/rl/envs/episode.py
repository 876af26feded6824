"""One trajectory through an environment, guarded: a turn limit and a per-step timeout.

:class:`Episode` spawns a fresh environment for a prompt row, keeps the conversation, adds up
the reward terms and ends the trajectory instead of raising: a ``reset`` or ``step`` that
raises or runs past ``step_timeout_s`` ends it with reward 0 (``ended`` = ``"error"`` or
``"timeout"``), and so does reaching ``max_turns`` assistant turns without the environment
saying done (``"turn_limit"``). A normal end is ``"done"``: the reward is the sum of every
turn's terms. ``terms`` (summed per name) and ``counts`` are kept in every case, for logging.

The step runs in a daemon thread; a step past its timeout is abandoned (Python cannot kill a
thread), together with its environment, which no one uses again. Tools that run code do so in
the sandbox (:func:`~tunesmith.rl.rewards.run_sandboxed`), which kills its own process tree.

Example::

    >>> from tunesmith.rl.envs.base import StepResult
    >>> class Guess:
    ...     def tool_schemas(self): return None
    ...     def reset(self, row): return [{"role": "user", "content": "Guess my number."}]
    ...     def step(self, message):
    ...         right = message["content"] == "7"
    ...         feedback = [] if right else [{"role": "user", "content": "No."}]
    ...         return StepResult(feedback, {"try": -0.1, "right": float(right)}, right)
    >>> episode = Episode(Guess(), row=None, limits=EpisodeLimits(max_turns=3))
    >>> for guess in ("3", "7"):
    ...     _ = episode.step({"role": "assistant", "content": guess})
    >>> episode.ended, round(episode.reward, 6), episode.terms
    ('done', 0.8, {'try': -0.2, 'right': 1.0})
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tunesmith.rl.envs.base import Environment, Message, StepResult, spawn

__all__ = ["ENDINGS", "Episode", "EpisodeLimits"]

logger = logging.getLogger(__name__)

ENDINGS = ("done", "turn_limit", "token_limit", "timeout", "error")
"""How a trajectory ends; every ending but ``"done"`` scores 0 (``"token_limit"``: the
rollout cut it at its token budget, :meth:`Episode.cut`)."""


@dataclass(frozen=True)
class EpisodeLimits:
    """Limits of one trajectory, read once from the config.

    Attributes:
        max_turns: assistant turns before the trajectory is cut (``"turn_limit"``).
        step_timeout_s: seconds one ``reset`` or ``step`` may take (``"timeout"``).

    Example::

        >>> EpisodeLimits(max_turns=0)
        Traceback (most recent call last):
        ...
        ValueError: EpisodeLimits: max_turns must be an int >= 1, got 0
    """

    max_turns: int = 8
    step_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ValueError(
                f"EpisodeLimits: max_turns must be an int >= 1, got {self.max_turns!r}"
            )
        if self.max_turns < 1:
            raise ValueError(f"EpisodeLimits: max_turns must be an int >= 1, got {self.max_turns}")
        timeout = self.step_timeout_s
        if not isinstance(timeout, (int, float)) or not (0 < timeout < math.inf):
            raise ValueError(f"EpisodeLimits: step_timeout_s must be a number > 0, got {timeout!r}")


class _Timeout(Exception):
    pass


def _call_with_timeout(function: Callable[[], Any], timeout_s: float) -> Any:
    """``function()`` in a daemon thread; its exception re-raised, or :class:`_Timeout`."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = function()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="tunesmith-env-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _Timeout(f"no answer within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _checked(result: Any) -> StepResult:
    """``result`` if it is a StepResult with finite float terms, else a TypeError/ValueError
    (which ends the trajectory as an ``"error"``)."""
    if not isinstance(result, StepResult):
        raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
    for name, value in result.terms.items():
        if not math.isfinite(float(value)):
            raise ValueError(f"reward term {name!r} is {value}")
    return result


class Episode:
    """One trajectory: a fresh environment for ``row`` and the conversation so far.

    Attributes:
        messages: the conversation (opening messages, then each assistant message and its
            observations, in order).
        done: the trajectory is over (check before sampling the next turn).
        ended: one of :data:`ENDINGS`, or None while running.
        turns: assistant turns taken.
        terms: reward terms summed per name over the turns.
        counts: counted events summed per name (``malformed_calls``, ``tool_errors``, ...).
        error: the exception text that ended it (``"timeout"`` or ``"error"``), else None.
    """

    def __init__(self, environment: Environment, row: Any, limits: EpisodeLimits) -> None:
        self.limits = limits
        self.env = spawn(environment)
        self.messages: list[Message] = []
        self.turns = 0
        self.terms: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.ended: str | None = None
        self.error: str | None = None
        opening = self._guarded("reset", lambda: self.env.reset(row))
        if opening is not None:
            self.messages = [dict(m) for m in opening]

    @property
    def done(self) -> bool:
        return self.ended is not None

    @property
    def reward(self) -> float:
        """Sum of the terms when the environment ended the trajectory, else 0."""
        return math.fsum(self.terms.values()) if self.ended == "done" else 0.0

    def step(self, message: Mapping[str, Any]) -> list[Message]:
        """Hand the policy's assistant message to the environment; returns the observations
        to append (empty once the trajectory is over). Never raises for what the environment
        does; stepping a finished episode is a caller bug (RuntimeError)."""
        if self.done:
            raise RuntimeError(f"Episode.step after the trajectory ended ({self.ended})")
        self.turns += 1
        result = self._guarded("step", lambda: _checked(self.env.step(message)))
        if result is None:
            self.messages.append(dict(message))
            return []
        self.messages.append(dict(result.assistant or message))
        self._add(result)
        if result.done:
            self.ended = "done"
            return []
        if self.turns >= self.limits.max_turns:
            self.ended = "turn_limit"
            return []
        observations = [dict(m) for m in result.observations]
        self.messages.extend(observations)
        return observations

    def cut(self, ending: str) -> None:
        """End the trajectory from outside (the rollout's token budget): reward 0.

        Example::

            >>> from tunesmith.rl.envs.base import StepResult
            >>> class Never:
            ...     def tool_schemas(self): return None
            ...     def reset(self, row): return []
            ...     def step(self, message): return StepResult([], {"ok": 1.0}, False)
            >>> e = Episode(Never(), None, EpisodeLimits())
            >>> e.cut("token_limit")
            >>> e.ended, e.reward
            ('token_limit', 0.0)
        """
        if ending not in ENDINGS or ending == "done":
            raise ValueError(f"Episode.cut: {ending!r} is not an ending other than done")
        if not self.done:
            self.ended = ending

    def _add(self, result: StepResult) -> None:
        for name, value in result.terms.items():
            self.terms[name] = self.terms.get(name, 0.0) + float(value)
        for name, count in result.counts.items():
            self.counts[name] = self.counts.get(name, 0) + int(count)

    def _guarded(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()``, or None after ending the trajectory on its timeout or exception."""
        try:
            return _call_with_timeout(call, self.limits.step_timeout_s)
        except _Timeout as exc:
            self.ended, self.error = "timeout", f"{what}: {exc}"
        except (Exception, SystemExit) as exc:  # an environment calling exit() is an error too
            self.ended, self.error = "error", f"{what}: {type(exc).__name__}: {exc}"
        logger.warning(
            "environment %s %s ended the trajectory (reward 0): %s",
            type(self.env).__name__,
            what,
            self.error,
        )
        return None

    def summary(self) -> dict[str, Any]:
        """What to log of the trajectory.

        Example::

            >>> from tunesmith.rl.envs.base import StepResult
            >>> class Stop:
            ...     def tool_schemas(self): return None
            ...     def reset(self, row): return [{"role": "user", "content": "?"}]
            ...     def step(self, message): return StepResult([], {"ok": 1.0}, True)
            >>> e = Episode(Stop(), None, EpisodeLimits())
            >>> _ = e.step({"role": "assistant", "content": "!"})
            >>> e.summary()
            {'ended': 'done', 'reward': 1.0, 'turns': 1, 'terms': {'ok': 1.0}, 'counts': {}, 'error': None}
        """
        return {
            "ended": self.ended,
            "reward": self.reward,
            "turns": self.turns,
            "terms": dict(self.terms),
            "counts": dict(self.counts),
            "error": self.error,
        }
