"""The recipes: one file per method (``sft``, ``dpo``, ``kd``, ``reward_model``, ``grpo``,
``grpo_async``, ``ppo``), each reading like its paper's algorithm box, with its configs in
``configs/<name>/``. The catalogue that finds, checks and runs them is
:mod:`tunesmith.recipes.catalog`; its public names are re-exported here (``tunesmith.run`` is
:func:`~tunesmith.recipes.catalog.run`).

Example::

    >>> from tunesmith.recipes import recipe_names
    >>> recipe_names()[:3]
    ['dpo', 'grpo', 'grpo_async']
"""

from tunesmith.recipes.catalog import (
    CONFIGS_DIR,
    RECIPES_DIR,
    CatalogError,
    Recipe,
    RecipeError,
    check_config,
    check_local_folders,
    config_names,
    config_path,
    infer_recipe,
    prepare_run,
    recipe_header,
    recipe_names,
    recipe_of_config,
    recipe_path,
    run,
    run_recipe,
)

__all__ = [
    "CONFIGS_DIR",
    "RECIPES_DIR",
    "CatalogError",
    "Recipe",
    "RecipeError",
    "check_config",
    "check_local_folders",
    "config_names",
    "config_path",
    "infer_recipe",
    "prepare_run",
    "recipe_header",
    "recipe_names",
    "recipe_of_config",
    "recipe_path",
    "run",
    "run_recipe",
]
