"""The loop's settings are declared once (``tunesmith/training/settings.py``) and everything
else is derived from that: the keys and rules checked up front, the resumable set, the table of
``docs/training_config.md``; a run reads them once into ``LoopSettings``, and the library below
``recipes/`` reads no config key with a default of its own.

``python -m tests.training.test_settings`` rewrites the table in the docs.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import tunesmith
from tunesmith.config import ConfigError
from tunesmith.recipes import sft
from tunesmith.rl.settings import ASYNC_SETTINGS, RL_SETTINGS
from tunesmith.training.loop_config import RunRecord, check_resume
from tunesmith.training.precision import Precision
from tunesmith.training.rules import check_rules
from tunesmith.training.settings import (
    LOOP_KEYS,
    LOOP_RULES,
    LOOP_SETTINGS,
    MODEL_SETTINGS,
    RESUMABLE_KEYS,
    LoopSettings,
    markdown_table,
)

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
TABLES = {  # page -> (its opening marker, its closing marker, the declarations it shows)
    "training_config.md": ("<!-- settings table:", "<!-- end of settings table -->",
                           (LOOP_SETTINGS, MODEL_SETTINGS)),
    "rl.md": ("<!-- rl settings table:", "<!-- end of rl settings table -->",
              (RL_SETTINGS, ASYNC_SETTINGS)),
}  # fmt: skip
PACKAGE = Path(tunesmith.__file__).parent

SETTINGS_READERS = (
    "training/trainer.py",
    "training/sources.py",
    "training/settings.py",
    "rl/ppo/trainer.py",
    "rl/settings.py",
    "rl/asynchronous/workers.py",
)
"""Files that read their settings from a settings object, never from a config (the Ray workers
included: they are sent a :class:`~tunesmith.rl.asynchronous.workers.WorkerSettings`)."""


def _span(text: str, begin: str, end: str) -> tuple[int, int]:
    """Where the table between the two marker lines of ``text`` starts and ends."""
    start = text.index("\n", text.index(begin)) + 1
    return start, text.index(end)


@pytest.mark.parametrize("page", TABLES)
def test_docs_tables_are_the_declared_settings(page):
    begin, end, tables = TABLES[page]
    text = (DOCS_DIR / page).read_text()
    start, stop = _span(text, begin, end)
    assert text[start:stop].rstrip("\n") == markdown_table(*tables), (
        f"docs/{page}'s settings table is out of date: python -m tests.training.test_settings"
    )


def test_keys_rules_and_resumable_set_come_from_the_declarations():
    declared = [s.name for s in LOOP_SETTINGS]
    assert declared == LOOP_KEYS and len(set(declared)) == len(declared)
    assert {f.name for f in dataclasses.fields(LoopSettings)} <= set(LOOP_KEYS)
    assert set(LOOP_RULES) == set(LOOP_KEYS)  # every loop key has a rule
    # what a resume may change, as the docs of loop_config list it
    assert {
        "max_steps",
        "epochs",
        "stop_after_steps",
        "save_every_n_steps",
        "save_every_minutes",
        "keep_last",
        "log_every_n_steps",
        "log_grad_norm",
        "eval_every_n_steps",
        "val_dataset",
        "metric_loggers",
        "progress_bar",
        "sample_prompts",
        "sample_every_n_steps",
        "sample_max_new_tokens",
        "output_dir",
        "resume",
        "overwrite",
        "preflight",
        "distributed_timeout_s",
        "activation_checkpointing",
        "activation_offloading",
        "compile",
        "attention_backend",
        "on_nonfinite_loss",
    } == RESUMABLE_KEYS
    assert set(sft.KEYS) >= set(LOOP_KEYS) and set(sft.RULES) >= set(LOOP_RULES)


def test_defaults_are_the_loops():
    s = LoopSettings(output_dir="out", batch_size=2)
    assert (
        s.seed,
        s.device,
        s.mixed_precision,
        s.shuffle,
        s.gradient_accumulation_steps,
        s.epochs,
        s.max_steps,
        s.max_grad_norm,
        s.log_grad_norm,
        s.val_fraction,
        s.log_every_n_steps,
        s.resume,
        s.overwrite,
        s.on_nonfinite_loss,
        s.progress_bar,
        s.optimizer_in_backward,
        s.preflight,
        s.sample_max_new_tokens,
    ) == (
        0,
        "auto",
        None,
        True,
        1,
        1,
        None,
        None,
        False,
        0.0,
        1,
        False,
        False,
        "stop",
        "auto",
        False,
        False,
        64,
    )
    assert s.precision == Precision()


def test_from_config_reads_every_key_once_typed():
    cfg = OmegaConf.create(
        {
            "output_dir": "out",
            "batch_size": 4,
            "seed": 3,
            "max_steps": 10,
            "precision": {"weights": "bf16", "master_weights": "fp32"},
            "parallelism": {"dp_shard": 2},
            "optimizer": {"_component_": "torch.optim.SGD"},
            "recipe_key": 1,
        }
    )
    s = LoopSettings.from_config(cfg)
    assert (s.output_dir, s.batch_size, s.seed, s.max_steps) == ("out", 4, 3, 10)
    assert s.precision == Precision(torch.bfloat16, torch.float32, torch.float32)
    assert s.parallelism == {"dp_shard": 2} and isinstance(s.parallelism, dict)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]


def test_bad_values_are_named_as_the_up_front_check_names_them():
    with pytest.raises(ConfigError) as error:
        LoopSettings(output_dir="out", batch_size=2, seed=-1, on_nonfinite_loss="STOP")
    cfg = OmegaConf.create(
        {"output_dir": "out", "batch_size": 2, "seed": -1, "on_nonfinite_loss": "STOP"}
    )
    up_front = [str(i) for i in check_rules(cfg, {k: LOOP_RULES[k] for k in cfg})]
    assert (
        str(error.value).splitlines()
        == up_front
        == [
            "seed: expected an int >= 0, got -1",
            "on_nonfinite_loss: expected one of 'stop', 'skip', got 'STOP' (a string)",
        ]
    )


def test_a_recipes_own_resumable_keys_join_the_loops():
    saved = RunRecord({"max_steps": 4, "rollout": {"workers": 1}}, 4, 8, step=2)
    changed = RunRecord({"max_steps": 4, "rollout": {"workers": 2}}, 4, 8)
    with pytest.raises(ConfigError, match="rollout.workers: 1 -> 2"):
        check_resume(Path("ckpt"), saved, changed)
    notes = check_resume(Path("ckpt"), saved, changed, resumable=RESUMABLE_KEYS | {"rollout"})
    assert notes == ["resume: rollout.workers 1 -> 2"]


def _inline_defaults(path: Path) -> int:
    """Calls ``cfg.get(key, default)`` / ``self.cfg.get(...)`` in ``path``."""
    count = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and len(node.args) == 2
        ):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            count += name == "cfg"
    return count


def test_no_library_code_reads_the_config_with_an_inline_default():
    """Below recipes/, no ``cfg.get(key, default)``: a key's default is declared once, with
    its setting (:mod:`tunesmith.training.settings`, :mod:`tunesmith.rl.settings`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if not relative.startswith("recipes/") and _inline_defaults(path):
            found[relative] = _inline_defaults(path)
    assert found == {}, (
        f"reads of the run's config with an inline default: {found}; declare the key's "
        "default once with its setting and read it from there (a settings object, value_of)"
    )


def test_the_inline_default_count_sees_what_it_counts(tmp_path):
    source = tmp_path / "reader.py"
    source.write_text("a = cfg.get('seed', 0)\nb = self.cfg.get('x', 1)\nc = cfg.get('y')\n")
    assert _inline_defaults(source) == 2


@pytest.mark.parametrize("relative", SETTINGS_READERS)
def test_the_loop_reads_its_settings_not_the_config(relative):
    text = (PACKAGE / relative).read_text()
    reads = [
        n
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Attribute | ast.Name)
        and getattr(n.value, "attr", getattr(n.value, "id", None)) == "cfg"
        and n.attr == "get"
    ]
    assert reads == [], f"{relative} reads the config with .get: use its LoopSettings"


def _write_docs() -> None:
    for page, (begin, end, tables) in TABLES.items():
        path = DOCS_DIR / page
        text = path.read_text()
        start, stop = _span(text, begin, end)
        path.write_text(text[:start] + markdown_table(*tables) + "\n" + text[stop:])
        print(f"wrote the settings table of {path}", file=sys.stderr)


if __name__ == "__main__":
    _write_docs()
