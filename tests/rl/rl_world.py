"""The RL tests' world: a tiny policy folder (``tests.recipes.sft_world.make_model_dir``),
addition prompts with answers, and a dense test reward so that every group's rewards differ
and every step has a gradient (a tiny random model is never right, so an answer check alone
would give all-zero advantages)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

from tunesmith.rl.rewards import Sample

DIGIT_REWARD = "tests.rl.rl_world.DigitFraction"


def make_prompts(path: Path, rows: int = 32, seed: int = 0) -> Path:
    """JSONL of ``{"prompt": "add A and B", "answer": "A+B"}`` rows."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"add {a} and {b}", "answer": str(a + b)}) + "\n")
    return path


class DigitFraction:
    """The fraction of a completion's characters that are digits (0 for an empty one)."""

    name = "digits"

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [
            sum(ch.isdigit() for ch in s.completion) / len(s.completion) if s.completion else 0.0
            for s in samples
        ]


def grpo_overrides(model_dir: Path, prompts: Path, output_dir: Path, *extra: str) -> list[str]:
    """The tiny GRPO config pointed at this world, scored by :class:`DigitFraction`."""
    return [
        f"model_dir={model_dir}", f"prompts.source={prompts}", f"output_dir={output_dir}",
        "progress_bar=false", f"rewards.rewards={{digits: {{_component_: {DIGIT_REWARD}}}}}",
        *extra,
    ]  # fmt: skip
