"""Every config shipped with a recipe validates against the real signatures and the recipe's
own keys (values the user must supply, `???`, filled with placeholders)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tunesmith.cli import catalog
from tunesmith.cli.launch import load_recipe_module
from tunesmith.config import check_keys, load_config, validate_config

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
    module = load_recipe_module(catalog.recipe_path(recipe))
    issues = validate_config(
        cfg,
        runtime_args=getattr(module, "RUNTIME_ARGS", {}),
        runtime_kwargs=getattr(module, "RUNTIME_KWARGS", {}),
    )
    issues += check_keys(cfg, module.KEYS)
    assert not issues, "\n".join(map(str, issues))
