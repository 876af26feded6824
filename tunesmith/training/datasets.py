"""The run's training and validation sets, built from its config.

:func:`build_datasets` instantiates ``dataset`` and the validation set: ``val_dataset`` (one
that gives only some settings, e.g. a ``source``, inherits the rest from ``dataset``:
:func:`inherit_val_dataset`) or a seeded ``val_fraction`` of the training samples.

Example::

    dataset, val_dataset = build_datasets(cfg, tokenizer, log)
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tunesmith.config import ConfigError, ConfigIssue, instantiate
from tunesmith.data import split_train_val
from tunesmith.training.settings import value_of

__all__ = ["build_datasets", "inherit_val_dataset"]


def inherit_val_dataset(cfg: DictConfig) -> DictConfig:
    """``cfg`` with its ``val_dataset`` completed (``cfg`` itself is left as it is): one with
    no ``_component_`` (e.g. only ``val_dataset.source=held.jsonl``) is the training
    ``dataset`` with those settings changed: same component, format, template and limits,
    another file.

    Example::

        >>> cfg = OmegaConf.create({"dataset": {"_component_": "D", "source": "a", "n": 1},
        ...                         "val_dataset": {"source": "b"}})
        >>> OmegaConf.to_container(inherit_val_dataset(cfg).val_dataset)
        {'_component_': 'D', 'source': 'b', 'n': 1}
        >>> OmegaConf.to_container(cfg.val_dataset)  # unchanged
        {'source': 'b'}
    """
    val, dataset = cfg.get("val_dataset"), cfg.get("dataset")
    if isinstance(val, DictConfig) and "_component_" not in val and isinstance(dataset, DictConfig):
        if "parts" in dataset:  # a mixture has no single set of settings to inherit
            raise ConfigError.from_issues(
                [
                    ConfigIssue(
                        "val_dataset",
                        f"gives only {sorted(val)}, but dataset is a mixture of "
                        f"{sorted(dataset.parts)}: give val_dataset its own _component_ (e.g. "
                        "tunesmith.data.SFTDataset) and settings",
                    )
                ]
            )
        cfg = copy.deepcopy(cfg)
        cfg.val_dataset = OmegaConf.merge(dataset, val)
    return cfg


def build_datasets(
    cfg: DictConfig, tokenizer: Any, log: Callable[[str], None] = print
) -> tuple[Sequence[Any], Sequence[Any] | None]:
    """``cfg.dataset`` and the validation set: ``cfg.val_dataset`` (one that gives only some
    settings, e.g. a ``source``, inherits the rest from ``cfg.dataset``), or a seeded
    ``cfg.val_fraction`` of the training samples (both sizes logged), or None. Logs the data
    report and whether the tokenised rows came from the cache."""
    cfg = inherit_val_dataset(cfg)
    dataset = instantiate(cfg.dataset, tokenizer)
    _log_cache(dataset, log)
    log(f"dataset: {dataset.report.summary()}")
    val_dataset = None
    if cfg.get("val_dataset"):
        val_dataset = instantiate(cfg.val_dataset, tokenizer)
        _log_cache(val_dataset, log)
        log(f"val_dataset: {val_dataset.report.summary()}")
    if val_dataset is None and value_of(cfg, "val_fraction") > 0:
        dataset, val_dataset = split_train_val(
            dataset, cfg.val_fraction, seed=int(value_of(cfg, "seed"))
        )
        log(
            f"val_fraction={cfg.val_fraction}: {len(dataset)} training samples, "
            f"{len(val_dataset)} validation samples"
        )
    return dataset, val_dataset


def _log_cache(dataset: Any, log: Callable[[str], None]) -> None:
    note = getattr(dataset, "cache_note", None)
    if note:
        log(note)
