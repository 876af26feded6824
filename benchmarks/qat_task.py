"""The QAT benchmark's task: the demo's letter sorting, every string ``length`` letters long.

The demo's task (:mod:`tunesmith.demo.task`) mixes strings of 3 to 8 letters; its model,
trained for 250 steps, loses nothing to int4 (``benchmarks/qat.py --task demo --steps 250``).
Here every string is ``length`` letters (8 by default: the longest the demo's scoring
decodes), so an answer is right only when all its letters are. Trained for 250 steps, such a
model still answers with logit margins above 4 nats on 99% of the answer tokens, and int4
weights move a margin by under 1 nat; a 100-step run leaves smaller margins, yet
(``benchmarks/results/qat_sort8.md``) int4 costs it under 0.01 of accuracy (0.770 -> 0.762):
the weights of a tiny model trained from a Gaussian initialisation have no outliers, and
int4's groups fit them well.

Pretrained LLMs do have outlier weights, and those are what int4 groups round badly: one large
weight sets its group's scale and the other 31 are rounded to a coarse grid. ``outlier`` gives
the base model that trait: a random one in ``outlier_every`` weights of every linear layer
inside the decoder layers is set to ``+-outlier`` (the embeddings and head untouched); the
task is the same.

:func:`make_task` writes the demo's layout (:class:`tunesmith.demo.assets.DemoAssets`: data,
the demo's tokenizer trained on this data, its tiny random Qwen2.5-style base model), so the
demo's SFT config, :func:`tunesmith.demo.run.train` and :func:`tunesmith.demo.run.evaluate`
serve it unchanged.

Example::

    >>> train, held_out = make_splits(TaskSettings(num_train=4, num_held_out=2))
    >>> [len(ex.letters) for ex in train + held_out]
    [8, 8, 8, 8, 8, 8]
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tunesmith.demo import task
from tunesmith.demo.assets import DemoAssets, build_base_model, build_tokenizer

__all__ = ["TaskSettings", "add_outliers", "make_splits", "make_task"]


@dataclass(frozen=True)
class TaskSettings:
    """The task's sizes; the base model is the demo's (``DEFAULT_MODEL``), with outlier
    weights of magnitude ``outlier`` (0: none; see :func:`add_outliers`)."""

    num_train: int = 4000
    num_held_out: int = 500
    length: int = 8
    seed: int = 0
    vocab_size: int = 320
    outlier: float = 0.0
    outlier_every: int = 64


def make_splits(settings: TaskSettings) -> tuple[list[task.Example], list[task.Example]]:
    """``(train, held_out)``: distinct strings of ``settings.length`` distinct letters, none in
    both splits (:func:`tunesmith.demo.task.make_splits`)."""
    if not 1 <= settings.length <= task.MAX_LEN:
        raise ValueError(
            f"TaskSettings.length must be 1..{task.MAX_LEN} (the demo's scoring decodes "
            f"{task.MAX_LEN} letters), got {settings.length}"
        )
    return task.make_splits(
        settings.num_train,
        settings.num_held_out,
        seed=settings.seed,
        min_len=settings.length,
        max_len=settings.length,
    )


def make_task(
    root: str | os.PathLike[str], settings: TaskSettings | None = None
) -> tuple[DemoAssets, list[task.Example]]:
    """Write the task's data, tokenizer and random base model under ``root``; return their
    paths and the held-out examples.

    Example::

        assets, held_out = make_task("outputs/qat_task")
        checkpoint = tunesmith.demo.run.train(assets, Path("outputs/qat_task/sft"))
    """
    settings = settings or TaskSettings()
    assets = DemoAssets.under(root)
    train, held_out = make_splits(settings)
    task.write_jsonl(train, assets.train_file)
    task.write_jsonl(held_out, assets.held_out_file)
    build_tokenizer(assets.tokenizer_dir, train, settings.vocab_size)
    build_base_model(assets.model_dir, assets.tokenizer_dir, seed=settings.seed)
    if settings.outlier:
        add_outliers(assets.model_dir, settings.outlier, settings.outlier_every, settings.seed)
    return assets, held_out


def add_outliers(model_dir: str | os.PathLike[str], value: float, every: int, seed: int) -> Path:
    """Set a random one in ``every`` entries of each linear weight under ``model.layers.`` of
    ``model_dir/model.safetensors`` to ``+-value`` (random signs), in place; returns the file.

    Example::

        add_outliers("outputs/qat_task/base_model", 0.3, 64, seed=0)
    """
    path = Path(model_dir) / "model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in sorted(weights):
        weight = weights[name]
        if name.startswith("model.layers.") and weight.dim() == 2:
            chosen = torch.rand(weight.shape, generator=generator) < 1 / every
            signs = torch.randint(0, 2, weight.shape, generator=generator) * 2 - 1
            weights[name] = torch.where(chosen, value * signs.to(weight.dtype), weight)
    save_file(weights, path, metadata={"format": "pt"})
    return path
