"""The recipe catalogue, as the CLI uses it: defined in :mod:`tunesmith.recipes` (names -> files).

Example::

    >>> recipe_path("sft").name
    'sft.py'
"""

from tunesmith.recipes import (
    CONFIGS_DIR,
    RECIPES_DIR,
    CatalogError,
    config_names,
    config_path,
    recipe_header,
    recipe_names,
    recipe_of_config,
    recipe_path,
)

__all__ = [
    "CONFIGS_DIR",
    "RECIPES_DIR",
    "CatalogError",
    "config_names",
    "config_path",
    "recipe_header",
    "recipe_names",
    "recipe_of_config",
    "recipe_path",
]
