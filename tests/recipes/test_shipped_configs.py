"""Every config shipped with a recipe validates against the real signatures and the recipe's
own keys (values the user must supply, `???`, filled with placeholders)."""

from __future__ import annotations

import importlib

import pytest
from omegaconf import OmegaConf

from tunesmith.cli import catalog
from tunesmith.config import check_keys, load_config, validate_config
from tunesmith.recipes import Recipe, RecipeError

SHIPPED = [(r, c) for r in catalog.recipe_names() for c in catalog.config_names(r)]


def _missing_paths(node, prefix: str = "") -> list[str]:
    """Dotted paths of the `???` values of a plain (unresolved) container."""
    paths = []
    for key, value in node.items():
        if value == "???":
            paths.append(f"{prefix}{key}")
        elif isinstance(value, dict):
            paths += _missing_paths(value, f"{prefix}{key}.")
    return paths


def test_there_are_shipped_configs():
    assert ("sft", "tiny") in SHIPPED and ("sft", "qwen3_0_6b") in SHIPPED


@pytest.mark.parametrize(("recipe", "config"), SHIPPED)
def test_shipped_config_is_valid(recipe, config):
    cfg = load_config(catalog.config_path(config, recipe))
    raw = OmegaConf.to_container(cfg, resolve=False)
    fills = [f"{p}=placeholder" for p in _missing_paths(raw)]
    cfg = load_config(catalog.config_path(config, recipe), fills)
    declared = Recipe.load(catalog.recipe_path(recipe))
    issues = validate_config(  # the config alone: its files are the user's
        cfg, runtime_args=declared.runtime_args, runtime_kwargs=declared.runtime_kwargs, files=False
    )
    issues += check_keys(cfg, declared.keys)
    assert not issues, "\n".join(map(str, issues))


@pytest.mark.parametrize("recipe", catalog.recipe_names())
def test_every_built_in_recipe_declares_the_whole_protocol(recipe):
    module = importlib.import_module(f"tunesmith.recipes.{recipe}")
    assert {"main", "KEYS", "RULES", "RUNTIME_ARGS", "RUNTIME_KWARGS"} <= set(vars(module))
    declared = Recipe.load(catalog.recipe_path(recipe))
    assert declared.main is module.main  # one module, under one name
    assert set(declared.rules) <= set(declared.keys), "a rule for a key the recipe does not take"


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("KEYS = 'batch_size'\ndef main(cfg): pass\n", "KEYS must be a list of key names"),
        ("RULES = {'x': 1}\ndef main(cfg): pass\n", "RULES must be a mapping of key -> Rule"),
        ("RUNTIME_ARGS = {'optimizer': '1'}\ndef main(cfg): pass\n", "RUNTIME_ARGS must be"),
        ("KEYS = []\n", "defines no main\\(cfg\\) function"),
    ],
)
def test_a_recipe_file_that_breaks_the_protocol_is_named(tmp_path, source, words):
    path = tmp_path / "mine.py"
    path.write_text(source)
    with pytest.raises(RecipeError, match=words) as error:
        Recipe.load(path)
    assert str(path) in str(error.value)


def test_a_recipe_file_of_yours_may_declare_only_main(tmp_path):
    path = tmp_path / "mine.py"
    path.write_text("def main(cfg):\n    return None\n")
    declared = Recipe.load(path)
    assert (declared.name, declared.keys, declared.rules, declared.check_launch) == (
        "mine",
        None,
        {},
        None,
    )
