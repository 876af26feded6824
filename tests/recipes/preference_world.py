"""Preference data for the preference recipe tests (dpo, reward_model): synthetic preference
tasks written as JSONL pairs, the pairs as the recipes tokenize and collate them, and an
independent log-probability reference (transformers' own model in float64).

Model folders, recipe runners, metrics and checkpoints are :mod:`tests.recipes.sft_world`'s.

Example::

    model_dir = make_model_dir(tmp_path)
    data = make_preference_data(tmp_path / "pairs.jsonl", rows=32, seed=0, task="copy")
    run_recipe("dpo", "tiny", model_dir, data, tmp_path / "out", "max_steps=2")
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from tunesmith.data import PreferenceDataset, Tokenizer, collate_preference
from tunesmith.modules.losses import IGNORE_INDEX

DIGITS = "0123456789"
SYSTEM = "be brief"
"""The system message of the synthetic pairs: short, so the sequences are short too (Qwen's
template would otherwise add its long default system prompt)."""


def _copy_pair(rng: random.Random) -> tuple[str, str, str]:
    """'repeat 7' -> chosen '7', rejected another digit (the rule is visible in the prompt; a
    tiny model learns it slowly and unevenly; it learns 'sort' within 80 steps)."""
    digit, other = rng.sample(DIGITS, 2)
    return f"repeat {digit}", digit, other


def _add_pair(rng: random.Random) -> tuple[str, str, str]:
    """'add A and B' -> chosen the sum, rejected a sum off by 1..3 (numbers of 1 to 4 digits,
    so responses differ in length)."""
    a, b = rng.randint(0, 10 ** rng.randint(0, 3)), rng.randint(0, 9)
    offset = rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if a + b + d >= 0])
    return f"add {a} and {b}", str(a + b), str(a + b + offset)


def _sort_pair(rng: random.Random) -> tuple[str, str, str]:
    """'sort 3 1 2' -> chosen '1 2 3', rejected the same digits in another (unsorted) order."""
    digits = rng.sample(DIGITS, 3)
    chosen = sorted(digits)
    rejected = list(chosen)
    while rejected == chosen:
        rng.shuffle(rejected)
    return f"sort {' '.join(digits)}", " ".join(chosen), " ".join(rejected)


WORDS = ("red", "blue", "green", "hot")
FILLER = (  # words of the tiny tokenizer's training text, to vary the prompts
    "the", "of", "to", "and", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are",
    "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by",
    "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when",
    "up", "use",
)  # fmt: skip


def _say_pair(rng: random.Random) -> tuple[str, str, str]:
    """'<two filler words> say blue' -> chosen 'blue', rejected another word of :data:`WORDS`.
    Every word is chosen and rejected equally often, so a random reward model ranks the pairs
    at chance; the filler words make held-out prompts new ones. A tiny reward model learns it
    within ~100 steps (it does not learn 'copy')."""
    word, other = rng.sample(WORDS, 2)
    return f"{' '.join(rng.sample(FILLER, 2))} say {word}", word, other


TASKS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "copy": _copy_pair,
    "add": _add_pair,
    "sort": _sort_pair,
    "say": _say_pair,
}
"""task name -> a function drawing one (prompt, chosen reply, rejected reply)."""


def preference_rows(
    rows: int, seed: int = 0, task: str = "copy", system: str | None = SYSTEM
) -> list[dict]:
    """``rows`` pairs of ``task`` as ``messages``-format rows (chosen/rejected conversations),
    opening with the ``system`` message (None: none, and the template may add its own).

    Example::

        >>> preference_rows(1, task="copy")[0]["chosen"][-1]["role"]
        'assistant'
    """
    if task not in TASKS:
        raise ValueError(f"unknown preference task {task!r}; choose one of {sorted(TASKS)}")
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        prompt, chosen, rejected = TASKS[task](rng)
        shared = [{"role": "user", "content": prompt}]
        if system is not None:
            shared.insert(0, {"role": "system", "content": system})
        out.append(
            {
                "chosen": [*shared, {"role": "assistant", "content": chosen}],
                "rejected": [*shared, {"role": "assistant", "content": rejected}],
            }
        )
    return out


def make_preference_data(
    path: Path, rows: int = 32, seed: int = 0, task: str = "copy", system: str | None = SYSTEM
) -> Path:
    """Write ``rows`` pairs of ``task`` (see :data:`TASKS`, :func:`preference_rows`) to the
    JSONL file ``path``.

    Example::

        make_preference_data(tmp_path / "pairs.jsonl", rows=8, task="sort")
    """
    with open(path, "w") as f:
        for row in preference_rows(rows, seed, task, system):
            f.write(json.dumps(row) + "\n")
    return path


def make_held_out_data(
    path: Path,
    train: Path,
    rows: int,
    seed: int = 1,
    task: str = "copy",
    system: str | None = SYSTEM,
) -> Path:
    """Write ``rows`` pairs of ``task`` (opening with ``system``, as in
    :func:`preference_rows`) whose prompts appear nowhere in the JSONL file ``train``
    (held-out pairs for a validation set).

    Example::

        make_held_out_data(tmp_path / "val.jsonl", train, rows=48, task="sort")
    """
    seen = {
        json.dumps(json.loads(line)["chosen"][:-1]) for line in Path(train).read_text().splitlines()
    }
    kept: list[dict] = []
    for row in preference_rows(50 * rows, seed, task, system):
        if json.dumps(row["chosen"][:-1]) not in seen:
            kept.append(row)
    if len(kept) < rows:
        raise ValueError(f"only {len(kept)} {task} pairs have prompts outside {train}")
    with open(path, "w") as f:
        for row in kept[:rows]:
            f.write(json.dumps(row) + "\n")
    return path


def pair_dataset(model_dir: Path, data: Path) -> PreferenceDataset:
    """The pairs of ``data`` as the shipped configs build them (``max_seq_len`` 256)."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    return PreferenceDataset(tokenizer, source=str(data), max_seq_len=256, on_bad_row="error")


def collate_pairs(
    model_dir: Path, data: Path, indices: list[int] | None = None, pad_id: int | None = None
) -> dict:
    """One collated batch (chosen rows, then rejected rows) of the pairs ``indices`` of
    ``data`` (default: all), right-padded with ``pad_id`` (default: the tokenizer's pad id,
    like the recipes).

    Example::

        collate_pairs(model_dir, data, [0, 1])["input_ids"].shape[0]
        # -> 4
    """
    dataset = pair_dataset(model_dir, data)
    indices = list(range(len(dataset))) if indices is None else indices
    if pad_id is None:
        pad_id = Tokenizer.from_pretrained(model_dir).pad_id or 0
    return collate_preference([dataset[i] for i in indices], pad_id=pad_id)


def hf_sequence_logps(model_dir: Path, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a collated ``batch``: the summed log-probability of its trained labels and
    their number, computed by ``transformers``' own model of ``model_dir`` in float64 (an
    independent reference for the recipes' log-probs; labels are pre-shifted)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        logits = hf(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits.double()
    labels = batch["labels"]
    trained = labels != IGNORE_INDEX
    logps = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logps * trained).sum(-1), trained.sum(-1)
