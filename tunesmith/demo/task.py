"""The demo's task: sort a short string of distinct capital letters alphabetically.

Every example is a three-turn chat (a fixed short system prompt, ``"sort QZXAB"``, the
answer ``"ABQXZ"``). Train and held-out strings are drawn from the same distribution but never
overlap, so held-out accuracy measures whether the model learned the rule, not the examples.

Example::

    >>> train, held_out = make_splits(num_train=4, num_held_out=2, seed=0)
    >>> ex = held_out[0]
    >>> ex.answer == "".join(sorted(ex.letters)), score(ex.answer + "\\n", ex)
    (True, True)
"""

from __future__ import annotations

import json
import math
import os
import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ALPHABET",
    "SYSTEM_PROMPT",
    "Example",
    "accuracy",
    "make_splits",
    "read_jsonl",
    "score",
    "write_jsonl",
]

ALPHABET = string.ascii_uppercase
SYSTEM_PROMPT = "sort the letters"
COMMAND = "sort"
MIN_LEN, MAX_LEN = 3, 8


@dataclass(frozen=True)
class Example:
    """One task instance: ``letters`` to sort; the expected reply is :attr:`answer`."""

    letters: str

    @property
    def answer(self) -> str:
        return "".join(sorted(self.letters))

    def prompt_messages(self) -> list[dict[str, str]]:
        """The conversation up to the assistant's turn (what the model is asked)."""
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"{COMMAND} {self.letters}"},
        ]

    def messages(self) -> list[dict[str, str]]:
        """The full conversation, answer included (a training row)."""
        return [*self.prompt_messages(), {"role": "assistant", "content": self.answer}]


def make_splits(
    num_train: int,
    num_held_out: int,
    *,
    seed: int = 0,
    min_len: int = MIN_LEN,
    max_len: int = MAX_LEN,
) -> tuple[list[Example], list[Example]]:
    """Random strings of ``min_len..max_len`` distinct letters: ``(train, held_out)``.

    No letter repeats within a string, and no string is in both splits (nor twice in one), so a held-out prompt is never seen in
    training.
    """
    if not 1 <= min_len <= max_len <= len(ALPHABET):
        raise ValueError(
            f"need 1 <= min_len <= max_len, got {min_len} and {max_len}"
            f" (at most {len(ALPHABET)}: letters do not repeat)"
        )
    if num_train < 0 or num_held_out < 0:
        raise ValueError(f"split sizes must be >= 0, got {num_train} and {num_held_out}")
    possible = sum(math.perm(len(ALPHABET), n) for n in range(min_len, max_len + 1))
    if num_train + num_held_out > possible:
        raise ValueError(
            f"{num_train + num_held_out} distinct strings requested, only {possible} exist "
            f"with lengths {min_len}..{max_len}"
        )
    rng = random.Random(seed)
    seen: set[str] = set()
    drawn: list[Example] = []
    while len(drawn) < num_train + num_held_out:
        letters = "".join(rng.sample(ALPHABET, k=rng.randint(min_len, max_len)))
        if letters not in seen:
            seen.add(letters)
            drawn.append(Example(letters))
    return drawn[num_held_out:], drawn[:num_held_out]


def score(reply: str, example: Example) -> bool:
    """True when ``reply`` (surrounding whitespace ignored) is exactly the sorted string."""
    return reply.strip() == example.answer


def accuracy(replies: Sequence[str], examples: Sequence[Example]) -> float:
    """Fraction of ``replies`` that :func:`score` accepts, paired with ``examples`` in order."""
    if len(replies) != len(examples):
        raise ValueError(f"{len(replies)} replies for {len(examples)} examples")
    if not examples:
        raise ValueError("accuracy of no examples is undefined")
    return sum(score(r, ex) for r, ex in zip(replies, examples)) / len(examples)


def write_jsonl(examples: Iterable[Example], path: str | os.PathLike[str]) -> Path:
    """Write training rows ``{"messages": [...]}`` (the SFT ``messages`` format) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"messages": ex.messages()}) + "\n")
    return path


def read_jsonl(path: str | os.PathLike[str]) -> list[Example]:
    """Read back the examples of a file :func:`write_jsonl` wrote."""
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                user = json.loads(line)["messages"][1]["content"]
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a demo task row ({e})") from e
            prefix = f"{COMMAND} "
            if not (isinstance(user, str) and user.startswith(prefix)):
                raise ValueError(f"{path}:{lineno}: user turn {user!r} is not '{COMMAND} LETTERS'")
            examples.append(Example(user[len(prefix) :]))
    return examples
