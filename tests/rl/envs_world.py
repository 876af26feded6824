"""Test environments for multi-turn GRPO (importable by torchrun ranks and Ray workers, as
``tests.rl.envs_world.<Name>``): plain feedback loops without tools, so that a tiny random
policy produces real multi-turn rows."""

from __future__ import annotations

from tunesmith.rl.envs import StepResult

AGAIN_ENV = "tests.rl.envs_world.Again"
TURNS_ENV = "tests.rl.envs_world.TurnsByAnswer"


def _digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


class OneTurn:
    """Scores the first reply by its length and ends (no tools)."""

    def tool_schemas(self):
        return None

    def reset(self, row):
        return [dict(m) for m in row.messages]

    def step(self, message):
        return StepResult([], {"length": len(message["content"]) / 100}, True)


class Again:
    """Asks for another try until the third reply, which ends it; the reward term
    ``last_digits`` is the share of digits in the last reply."""

    turns_wanted = 3

    def tool_schemas(self):
        return None

    def reset(self, row):
        self.turns = 0
        self.wanted = self.turns_for(row)
        return [dict(m) for m in row.messages]

    def turns_for(self, row) -> int:
        return self.turns_wanted

    def step(self, message):
        self.turns += 1
        if self.turns < self.wanted:
            return StepResult([{"role": "user", "content": f"Again ({self.turns})."}], {}, False)
        return StepResult([], {"last_digits": _digit_share(message["content"])}, True)


class TurnsByAnswer(Again):
    """:class:`Again` for ``1 + answer % 3`` turns: trajectories (and data-parallel ranks)
    need different numbers of turns."""

    def turns_for(self, row) -> int:
        return 1 + int(row.answer) % 3


class FailsOnSecondTurn(Again):
    """:class:`Again` whose second step raises (a crashing tool)."""

    def step(self, message):
        if self.turns == 1:
            raise RuntimeError("tool crashed")
        return super().step(message)


SLOW_TURNS_ENV = "tests.rl.envs_world.SlowTurnsByAnswer"


class SlowTurnsByAnswer(TurnsByAnswer):
    """:class:`TurnsByAnswer` whose steps take 0.2 s (a slow tool): a rollout worker spends
    most of a batch between the turns of its trajectories, where a test kills it."""

    def step(self, message):
        import time

        time.sleep(0.2)
        return super().step(message)


class FailsToReset(Again):
    """:class:`Again` whose ``reset`` raises for prompts with an even answer."""

    def reset(self, row):
        if int(row.answer) % 2 == 0:
            raise RuntimeError("no such task")
        return super().reset(row)
