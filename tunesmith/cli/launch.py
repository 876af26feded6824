"""Run a recipe file on a config: in this process, or as one rank under torchrun.

``python -m tunesmith.cli.launch RECIPE_FILE CONFIG_FILE [OVERRIDES...]`` is what
``tunesmith run --nproc-per-node N`` hands to torchrun for every rank.

Example::

    >>> run_recipe(Path("my_recipe.py"), load_config("my.yaml"))  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from omegaconf import DictConfig

from tunesmith.config import load_config


def load_recipe_module(recipe_file: Path) -> ModuleType:
    """Import a recipe file as a module; it must define ``main(cfg)``."""
    name = f"tunesmith_recipe_{recipe_file.stem}"
    spec = importlib.util.spec_from_file_location(name, recipe_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import recipe file {recipe_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    if not callable(getattr(module, "main", None)):
        raise AttributeError(f"recipe file {recipe_file} defines no main(cfg) function")
    return module


def run_recipe(recipe_file: Path, cfg: DictConfig) -> None:
    """Import ``recipe_file`` and call its ``main(cfg)``."""
    load_recipe_module(recipe_file).main(cfg)


def _main(argv: list[str]) -> None:
    recipe_file, config_file, *overrides = argv
    run_recipe(Path(recipe_file), load_config(config_file, overrides))


if __name__ == "__main__":
    _main(sys.argv[1:])
