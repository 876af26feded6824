"""Where the built-in recipes and their configs live, and how names resolve to files.

A recipe is a module ``tunesmith/recipes/<name>.py`` defining ``main(cfg)``; its configs are
``tunesmith/recipes/configs/<name>/*.yaml``. Nothing is registered by hand: the files are the
catalogue.

Example::

    >>> recipe_path("sft").name
    'sft.py'
"""

from __future__ import annotations

from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
CONFIGS_DIR = RECIPES_DIR / "configs"


class CatalogError(LookupError):
    """A recipe or config name that matches no built-in file and no path."""


def recipe_names() -> list[str]:
    """Names of the built-in recipes, sorted."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def config_names(recipe: str) -> list[str]:
    """Names of the built-in configs of ``recipe`` (file stems), sorted."""
    return sorted(p.stem for p in (CONFIGS_DIR / recipe).glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """The file of a built-in recipe name, or ``name_or_path`` itself if it is a ``.py`` file."""
    path = Path(name_or_path)
    if path.suffix == ".py":
        if not path.is_file():
            raise CatalogError(f"recipe file not found: {path}")
        return path.resolve()
    if name_or_path in recipe_names():
        return RECIPES_DIR / f"{name_or_path}.py"
    raise CatalogError(
        f"unknown recipe {name_or_path!r}; built-in recipes: {', '.join(recipe_names()) or 'none'}"
        " (or give a path to a .py file)"
    )


def config_path(name_or_path: str, recipe: str | None = None) -> Path:
    """Resolve a config given as a path, ``recipe/name``, or a bare name of ``recipe``'s configs."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path.resolve()
    candidates: list[Path] = []
    if "/" in name_or_path and path.suffix == "":
        candidates.append(CONFIGS_DIR / f"{name_or_path}.yaml")
    if recipe is not None:
        candidates.append(CONFIGS_DIR / recipe / f"{name_or_path}.yaml")
    else:
        candidates += [CONFIGS_DIR / r / f"{name_or_path}.yaml" for r in recipe_names()]
    found = [c for c in candidates if c.is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        names = ", ".join(f"{c.parent.name}/{c.stem}" for c in found)
        raise CatalogError(f"config name {name_or_path!r} is ambiguous: {names}")
    if path.suffix in (".yaml", ".yml"):
        raise CatalogError(f"config file not found: {path}")
    where = f" of recipe {recipe!r}" if recipe else ""
    raise CatalogError(
        f"unknown config {name_or_path!r}{where}; see `tunesmith ls` (or give a path to a .yaml file)"
    )


def recipe_of_config(config_file: Path) -> str | None:
    """The built-in recipe a built-in config file belongs to, or None for a user's file."""
    try:
        return config_file.resolve().relative_to(CONFIGS_DIR).parts[0]
    except ValueError:
        return None
