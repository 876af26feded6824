"""Preference data and recipe runners for the preference recipe tests (dpo, reward_model).

Builds on :mod:`tests.recipes.sft_world` (tiny model folders, metrics, checkpoints, rank
environment): this module adds synthetic preference tasks written as JSONL pairs, and runs any
recipe on its shipped config, in this process or on several local ranks.

Example::

    >>> model_dir = make_model_dir(tmp_path)  # doctest: +SKIP
    >>> data = make_preference_data(tmp_path / "pairs.jsonl", rows=32, seed=0, task="copy")
    >>> run_recipe("dpo", "tiny", model_dir, data, tmp_path / "out", "max_steps=2")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig, OmegaConf
from torch import nn

from tests.recipes import sft_world
from tests.recipes.sft_world import free_port, subprocess_env
from tunesmith.cli import catalog
from tunesmith.cli.launch import load_recipe_module
from tunesmith.config import ALLOW_ANY_COMPONENT_ENV, load_config
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


TASKS: dict[str, Callable[[random.Random], tuple[str, str, str]]] = {
    "copy": _copy_pair,
    "add": _add_pair,
    "sort": _sort_pair,
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

        >>> make_preference_data(tmp_path / "pairs.jsonl", rows=8, task="sort")  # doctest: +SKIP
    """
    with open(path, "w") as f:
        for row in preference_rows(rows, seed, task, system):
            f.write(json.dumps(row) + "\n")
    return path


def make_held_out_data(
    path: Path, train: Path, rows: int, seed: int = 1, task: str = "copy"
) -> Path:
    """Write ``rows`` pairs of ``task`` whose prompts appear nowhere in the JSONL file
    ``train`` (held-out pairs for a validation set).

    Example::

        >>> make_held_out_data(tmp_path / "val.jsonl", train, rows=48, task="sort")  # doctest: +SKIP
    """
    seen = {
        json.dumps(json.loads(line)["chosen"][:-1]) for line in Path(train).read_text().splitlines()
    }
    kept: list[dict] = []
    for row in preference_rows(50 * rows, seed, task):
        if json.dumps(row["chosen"][:-1]) not in seen:
            kept.append(row)
    if len(kept) < rows:
        raise ValueError(f"only {len(kept)} {task} pairs have prompts outside {train}")
    with open(path, "w") as f:
        for row in kept[:rows]:
            f.write(json.dumps(row) + "\n")
    return path


def val_dataset_override(path: Path, max_seq_len: int = 256) -> str:
    """The override that makes the preference pairs of ``path`` the run's validation set.

    Example::

        >>> run_recipe("dpo", "tiny", m, d, out, val_dataset_override(val))  # doctest: +SKIP
    """
    return (
        "val_dataset={_component_: tunesmith.data.PreferenceDataset, "
        f"source: {path}, max_seq_len: {max_seq_len}}}"
    )


def recipe_overrides(model_dir: Path, data: Path, output_dir: Path, *overrides: str) -> list[str]:
    """The overrides that point a shipped config at the local world, plus ``overrides``."""
    base = [f"model_dir={model_dir}", f"dataset.source={data}", f"output_dir={output_dir}"]
    return [*base, "progress_bar=false", *overrides]


def recipe_config(
    recipe: str, config: str, model_dir: Path, data: Path, output_dir: Path, *overrides: str
) -> DictConfig:
    """The shipped ``config`` of ``recipe`` pointed at the local world, with ``overrides``.

    Example::

        >>> cfg = recipe_config("dpo", "tiny", model_dir, data, out, "max_steps=2")  # doctest: +SKIP
    """
    return load_config(
        catalog.config_path(config, recipe),
        recipe_overrides(model_dir, data, output_dir, *overrides),
    )


def run_config(recipe: str, cfg: DictConfig) -> None:
    """Run ``recipe``'s ``main(cfg)`` in this process on one intra-op thread (so runs compare
    bitwise whatever thread count the caller has)."""
    module = load_recipe_module(catalog.recipe_path(recipe))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.main(cfg)
    finally:
        torch.set_num_threads(previous)


def run_recipe(
    recipe: str, config: str, model_dir: Path, data: Path, output_dir: Path, *overrides: str
) -> Path:
    """Run ``recipe`` on its shipped ``config`` in this process; returns ``output_dir``.

    Example::

        >>> run_recipe("dpo", "tiny_lora", model_dir, data, out, "max_steps=4")  # doctest: +SKIP
    """
    run_config(recipe, recipe_config(recipe, config, model_dir, data, output_dir, *overrides))
    return output_dir


def run_recipe_keeping_model(
    recipe: str, config: str, model_dir: Path, data: Path, output_dir: Path, *overrides: str
) -> tuple[Path, nn.Module]:
    """:func:`run_recipe`, also returning the model object the recipe trained, as it left it
    (the config's model is wrapped in :func:`tests.recipes.sft_world.keep_model`)."""
    cfg = recipe_config(recipe, config, model_dir, data, output_dir, *overrides)
    key = f"{recipe}:{output_dir}"
    cfg.model = OmegaConf.create(
        {"_component_": f"{sft_world.__name__}.keep_model", "model": cfg.model, "key": key}
    )
    previous = os.environ.get(ALLOW_ANY_COMPONENT_ENV)
    os.environ[ALLOW_ANY_COMPONENT_ENV] = "1"  # keep_model is outside the allow-list
    try:
        run_config(recipe, cfg)
    finally:
        if previous is None:
            os.environ.pop(ALLOW_ANY_COMPONENT_ENV)
        else:
            os.environ[ALLOW_ANY_COMPONENT_ENV] = previous
    return output_dir, sft_world._KEPT_MODELS.pop(key)


def launch_recipe_ranks(
    recipe: str,
    config: str,
    overrides: list[str],
    log_dir: Path,
    *,
    world_size: int = 2,
    timeout: float = 120,
) -> None:
    """Run ``recipe`` on ``world_size`` local ranks started the way torchrun would (one
    ``python -m tunesmith.cli.launch`` process per rank with the torchrun environment), and
    wait; a failing rank fails with the tail of its log (``log_dir/rank<N>.log``).

    Example::

        >>> launch_recipe_ranks("dpo", "tiny", recipe_overrides(m, d, out), tmp_path)  # doctest: +SKIP
    """
    args = [
        "-m", "tunesmith.cli.launch", str(catalog.recipe_path(recipe)),
        str(catalog.config_path(config, recipe)), *overrides,
    ]  # fmt: skip
    port = str(free_port())
    logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
    ranks = []
    for r, log in enumerate(logs):
        env = subprocess_env(
            RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        with open(log, "w") as f:
            ranks.append(subprocess.Popen([sys.executable, *args], env=env, stdout=f, stderr=f))
    try:
        for p in ranks:
            p.wait(timeout=timeout)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(ranks, logs)):
        if p.returncode != 0:
            raise AssertionError(f"rank {r} failed ({p.returncode}):\n{log.read_text()[-3000:]}")


def read_eval_metrics(output_dir: Path) -> dict[int, dict[str, float]]:
    """The JSONL logger's validation records (``val_*`` keys) by step."""
    records: dict[int, dict[str, float]] = {}
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val_loss" in record:
            records[record.pop("step")] = record
    return records


def pair_dataset(model_dir: Path, data: Path) -> PreferenceDataset:
    """The pairs of ``data`` as the shipped configs build them (``max_seq_len`` 256)."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    return PreferenceDataset(tokenizer, source=str(data), max_seq_len=256, on_bad_row="error")


def collate_pairs(model_dir: Path, data: Path, indices: list[int] | None = None) -> dict:
    """One collated batch (chosen rows, then rejected rows) of the pairs ``indices`` of
    ``data`` (default: all), padded with the tokenizer's pad id like the recipes."""
    dataset = pair_dataset(model_dir, data)
    indices = list(range(len(dataset))) if indices is None else indices
    pad_id = Tokenizer.from_pretrained(model_dir).pad_id
    return collate_preference([dataset[i] for i in indices], pad_id=pad_id or 0)


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
