"""The recipe catalogue: names -> files, configs, the typed :class:`Recipe` a file declares,
config checking, and :func:`run`.

A recipe is a module ``tunesmith/recipes/<name>.py`` defining ``main(cfg)``; its configs are
``tunesmith/recipes/configs/<name>/*.yaml``. Nothing is registered by hand: the files are the
catalogue (a file whose name starts with ``_`` is not a recipe, nor is this one). :func:`run`
is the library's way to train, in this process: the ``tunesmith run`` command (one process)
and the demo call it. Everything heavy is imported inside the functions, so the catalogue
costs no torch import.

Example::

    >>> recipe_path("sft").name
    'sft.py'
    >>> "catalog" in recipe_names()
    False

Training (it builds the model and runs every step in this process)::

    run("sft", "demo", ["max_steps=2", "output_dir=out"])
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "CONFIGS_DIR",
    "RECIPES_DIR",
    "CatalogError",
    "Recipe",
    "RecipeError",
    "check_config",
    "check_local_folders",
    "check_run",
    "config_names",
    "config_path",
    "infer_recipe",
    "model_backends",
    "prepare_run",
    "recipe_header",
    "recipe_names",
    "recipe_of_config",
    "recipe_path",
    "run",
    "run_recipe",
]

RECIPES_DIR = Path(__file__).resolve().parent
CONFIGS_DIR = RECIPES_DIR / "configs"
# The first line `tunesmith cp` writes into a copied config: the recipe the config is for.
_HEADER = re.compile(r"#\s*recipe:\s*([A-Za-z_][\w.-]*)")
# What a Hugging Face Hub repository id looks like: owner/name, nothing else.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class CatalogError(LookupError):
    """A recipe or config name that matches no built-in file and no path."""


# ----------------------------------------------------------------------------- catalogue


def recipe_names() -> list[str]:
    """Names of the built-in recipes, sorted."""
    return sorted(
        p.stem
        for p in RECIPES_DIR.glob("*.py")
        if not p.stem.startswith("_") and p.stem != Path(__file__).stem
    )


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
    names = recipe_names()
    if name_or_path in names:
        return RECIPES_DIR / f"{name_or_path}.py"
    raise CatalogError(
        f"unknown recipe {name_or_path!r}{_did_you_mean(name_or_path, names)}; built-in recipes: "
        f"{', '.join(names) or 'none'} (or give a path to a .py file)"
    )


def _did_you_mean(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


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
    known = config_names(recipe) if recipe is not None else []
    known += [f"{r}/{c}" for r in recipe_names() for c in config_names(r)]
    raise CatalogError(
        f"unknown config {name_or_path!r}{where}{_did_you_mean(name_or_path, known)}; see "
        "`tunesmith ls` (or give a path to a .yaml file)"
    )


def recipe_header(recipe: str) -> str:
    """The line ``tunesmith cp`` puts first in a copied config: it names the config's recipe,
    so ``tunesmith validate my.yaml`` knows which arguments the recipe passes at run time and
    ``tunesmith run`` refuses the config under another recipe. Write it by hand in a config of
    your own to get the same.

    Example::

        >>> recipe_header("sft")
        '# recipe: sft  (read by tunesmith validate and run; written by tunesmith cp)'
    """
    return f"# recipe: {recipe}  (read by tunesmith validate and run; written by tunesmith cp)"


def recipe_of_config(config_file: Path) -> str | None:
    """The recipe a config file is for: the folder of a built-in config, or the ``# recipe:
    NAME`` line among the leading comment lines of a user's file (:func:`recipe_header`);
    None when neither says.

    Example::

        >>> recipe_of_config(config_path("dpo/tiny"))
        'dpo'
    """
    try:
        return config_file.resolve().relative_to(CONFIGS_DIR).parts[0]
    except ValueError:
        pass
    try:
        with open(config_file, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                if not line.lstrip().startswith("#"):
                    break  # only the comment block the file starts with is read
                match = _HEADER.match(line.strip())
                if match:
                    return match.group(1)
    except (OSError, UnicodeDecodeError):
        return None
    return None


def infer_recipe(cfg: Any) -> str | None:
    """The built-in recipe whose top-level keys (``KEYS``) accept every key of ``cfg``, the
    most specific one (fewest keys) when several do; None when none does.

    Example::

        >>> from tunesmith.config import load_config
        >>> _ = Path("my_sft.yaml").write_text("packed: true\\nbatch_size: 4\\n")
        >>> infer_recipe(load_config("my_sft.yaml"))
        'sft'
    """
    fits: list[tuple[int, str]] = []
    for name in recipe_names():
        try:
            keys = Recipe.load(RECIPES_DIR / f"{name}.py").keys
        except ImportError:  # a recipe whose optional dependencies are not installed
            continue
        if keys is not None and all(key in keys for key in cfg):
            fits.append((len(keys), name))
    return min(fits)[1] if fits else None


# ----------------------------------------------------------------------------- running


class RecipeError(TypeError):
    """A recipe file that does not declare what a recipe declares (named in the message)."""


@dataclass(frozen=True)
class Recipe:
    """A recipe file as the catalogue reads it: its ``main(cfg)`` and what its configs may hold,
    read and checked once when the file is loaded (:meth:`load`).

    The file defines ``main(cfg)`` and may declare ``KEYS`` (the top-level keys its configs may
    have; absent: any), ``RULES`` (key -> a :class:`~tunesmith.training.rules.Rule`: what each
    value may be), ``RUNTIME_ARGS`` (component key -> how many positional arguments the recipe
    passes it at run time) and ``RUNTIME_KWARGS`` (component key -> the keyword arguments it
    passes), which a config must leave out. Every built-in recipe declares all four. A recipe
    may also define ``check_launch(cfg, world_size)``: its own refusal of a launch on
    ``world_size`` ranks, called by ``tunesmith run --nproc-per-node`` before torchrun starts.

    Example::

        >>> recipe = Recipe.load(recipe_path("sft"))
        >>> recipe.name, "packed" in recipe.keys, recipe.runtime_args["optimizer"]
        ('sft', True, 1)
    """

    file: Path
    main: Callable[[Any], None]
    keys: tuple[str, ...] | None = None
    rules: Mapping[str, Any] = field(default_factory=dict)
    runtime_args: Mapping[str, int] = field(default_factory=dict)
    runtime_kwargs: Mapping[str, Sequence[str]] = field(default_factory=dict)
    check_launch: Callable[[Any, int], None] | None = None

    @property
    def name(self) -> str:
        return self.file.stem

    @classmethod
    def load(cls, recipe_file: Path) -> Recipe:
        """Import ``recipe_file`` (a built-in recipe under its one module name,
        ``tunesmith.recipes.<name>``; a file of yours as ``tunesmith_recipe_<name>``) and read
        what it declares; :class:`RecipeError` names the file and the attribute that is wrong."""
        module = _import_recipe(Path(recipe_file))
        main = getattr(module, "main", None)
        if not callable(main):
            raise RecipeError(f"recipe file {recipe_file} defines no main(cfg) function")

        def declared(attr: str, check: Callable[[Any], bool], expected: str, default: Any):
            value = getattr(module, attr, default)
            if value is not default and not check(value):
                raise RecipeError(
                    f"recipe file {recipe_file}: {attr} must be {expected}, got "
                    f"{type(value).__name__} {value!r:.80}"
                )
            return value

        keys = declared("KEYS", _strings, "a list of key names", None)
        return cls(
            file=Path(recipe_file),
            main=main,
            keys=None if keys is None else tuple(keys),
            rules=declared("RULES", _rules, "a mapping of key -> Rule", {}),
            runtime_args=declared("RUNTIME_ARGS", _counts, "a mapping of key -> int", {}),
            runtime_kwargs=declared(
                "RUNTIME_KWARGS", _keyword_lists, "a mapping of key -> list of names", {}
            ),
            check_launch=declared("check_launch", callable, "a function", None),
        )


def _strings(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _rules(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and callable(getattr(v, "problem", None)) for k, v in value.items()
    )


def _counts(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
        for k, v in value.items()
    )


def _keyword_lists(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and _strings(v) for k, v in value.items()
    )


def _import_recipe(recipe_file: Path) -> ModuleType:
    if recipe_file.resolve().parent == RECIPES_DIR and recipe_file.stem in recipe_names():
        return importlib.import_module(f"{__package__}.{recipe_file.stem}")
    name = f"tunesmith_recipe_{recipe_file.stem}"
    spec = importlib.util.spec_from_file_location(name, recipe_file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import recipe file {recipe_file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_recipe(recipe_file: Path, cfg: Any) -> None:
    """Import ``recipe_file`` and call its ``main(cfg)`` (``cfg``: a loaded ``DictConfig``)."""
    Recipe.load(recipe_file).main(cfg)


def check_config(cfg: Any, recipe_file: Path | None, *, files: bool = True) -> None:
    """Validate the whole config tree (against ``recipe_file``'s ``KEYS``, ``RULES`` and
    run-time arguments when given); raise one ``ConfigError`` listing every problem.
    ``files=False`` leaves out the files and folders the config names (see
    :func:`~tunesmith.config.validate_config`).

    Example::

        >>> from tunesmith.config import load_config
        >>> _ = Path("my.yaml").write_text("batch_size: 0\\nshufle: true\\n")
        >>> check_config(load_config("my.yaml"), recipe_path("sft"))
        Traceback (most recent call last):
        tunesmith.config.errors.ConfigError: shufle: unknown key; did you mean 'shuffle'?
        output_dir: required key is missing (a non-empty string)
        batch_size: expected an int >= 1, got 0
        ...
    """
    from tunesmith.config import ConfigError, check_keys, validate_config

    recipe = None if recipe_file is None else Recipe.load(recipe_file)
    args, kwargs = (recipe.runtime_args, recipe.runtime_kwargs) if recipe else ({}, {})
    issues = validate_config(cfg, runtime_args=args, runtime_kwargs=kwargs, files=files)
    if recipe and recipe.keys is not None:  # its own top-level keys, misspellings suggested
        issues += check_keys(cfg, recipe.keys)
    if recipe and recipe.rules:  # each top-level value's type, range or choices
        from tunesmith.training.rules import check_rules

        seen = {issue.path for issue in issues}  # a missing or broken value is reported once
        issues += [i for i in check_rules(cfg, recipe.rules) if i.path not in seen]
    if issues:
        raise ConfigError.from_issues(issues)


def prepare_run(
    recipe: str | os.PathLike[str],
    config: str | os.PathLike[str],
    overrides: Sequence[str] = (),
    *,
    files: bool = True,
) -> tuple[Path, Path, Any]:
    """The recipe file, the config file and the loaded, checked config of a run
    (:func:`check_run`); every problem is reported before anything is written. ``files=False``
    checks the config alone, before the files and folders it names exist (the demo checks its
    second run's config before the first has written its model).

    Example::

        >>> recipe_file, config_file, cfg = prepare_run("sft", "demo", ["max_steps=2"], files=False)
        >>> recipe_file.name, config_file.name, cfg.max_steps
        ('sft.py', 'demo.yaml', 2)
    """
    from tunesmith.config import load_config

    recipe_file = recipe_path(str(recipe))
    builtin = recipe_file.stem if recipe_file.parent == RECIPES_DIR else None
    config_file = config_path(str(config), builtin)
    owner = recipe_of_config(config_file)
    if builtin is not None and owner is not None and owner != builtin:
        raise CatalogError(
            f"config {config!r} is for recipe {owner!r}, not {builtin!r}: run `tunesmith run "
            f"{owner} --config {config}`, or give one of {builtin}'s configs: "
            f"{', '.join(config_names(builtin)) or 'none'}"
        )
    cfg = load_config(config_file, list(overrides))
    check_run(cfg, recipe_file, files=files)
    return recipe_file, config_file, cfg


def check_run(cfg: Any, recipe_file: Path | None, *, files: bool = True) -> list[str]:
    """Every check of a config before anything is built or read, the same for ``tunesmith
    validate`` and every run (so both name the same first problem): the Hub ids of a built-in
    recipe's ``*_dir`` keys (:func:`check_local_folders`), then the whole tree
    (:func:`check_config`: keys, types, choices, files and folders, required keys), then the
    backend of each model (:func:`model_backends`, whose lines it returns, followed by those of
    LoRA adapters peft would misread: :func:`~tunesmith.models.peft_io.peft_misread_in_config`).
    ``files=False``: the config alone, not the files and folders it names (nor the models'
    backends).

    Example::

        >>> from tunesmith.config import load_config
        >>> _ = Path("my.yaml").write_text("model_dir: Qwen/Qwen3-0.6B\\n")
        >>> check_run(load_config("my.yaml"), recipe_path("sft"))
        Traceback (most recent call last):
        ...
        FileNotFoundError: model_dir 'Qwen/Qwen3-0.6B' is not a local folder; ...
    """
    if files and recipe_file is not None and recipe_file.parent == RECIPES_DIR:
        check_local_folders(cfg)  # a recipe of your own may give `*_dir` keys other meanings
    check_config(cfg, recipe_file, files=files)
    if not files:
        return []
    from tunesmith.models.peft_io import peft_misread_in_config

    return model_backends(cfg) + peft_misread_in_config(cfg)


def check_local_folders(cfg: Any) -> None:
    """Refuse a top-level ``*_dir`` value of a built-in recipe's config (``model_dir``,
    ``teacher_dir``, ...; not ``output_dir``) that names no local folder but looks like a
    Hugging Face Hub id (``Qwen/Qwen3-0.6B``: ``owner/name`` where no folder ``owner`` exists
    here, nor is it ``models``), saying how to download it: models are read from local
    folders only.

    Example::

        >>> from omegaconf import OmegaConf
        >>> check_local_folders(OmegaConf.create({"model_dir": "Qwen/Qwen3-0.6B"}))
        Traceback (most recent call last):
        ...
        FileNotFoundError: model_dir 'Qwen/Qwen3-0.6B' is not a local folder; ...
    """
    for key in cfg:
        if not str(key).endswith("_dir") or key == "output_dir":
            continue
        try:
            value = cfg[key]
        except Exception:  # missing or broken: check_config has reported it
            continue
        if not isinstance(value, str) or not _HUB_ID.fullmatch(value) or Path(value).exists():
            continue
        owner, name = value.split("/")
        if owner == "models" or Path(owner).exists():
            continue  # a local path whose folder is not there yet, not a Hub id
        raise FileNotFoundError(
            f"{key} {value!r} is not a local folder; models are read from local folders: if it "
            f"is a Hub id, download it first with `tunesmith download {value}` (it writes "
            f"models/{name}), then give {key}=models/{name}"
        )


def model_backends(cfg: Any) -> list[str]:
    """One line per top-level model of ``cfg`` built by ``from_hf`` from a local folder: which
    backend builds it and why (``tunesmith validate`` prints them). A folder only its own
    code could build (``auto_map``) is refused here, before a run, naming ``trust_remote_code``.

    Example::

        >>> from omegaconf import OmegaConf
        >>> model_backends(OmegaConf.create({"model": {"path": "nowhere"}}))  # no folder yet
        []
    """
    from tunesmith.config.components import resolve_component
    from tunesmith.models.family import language_model_config
    from tunesmith.models.hf import CONFIG_NAME, from_hf, read_hf_config
    from tunesmith.models.transformers_backend import choose_backend

    lines = []
    for key in cfg:
        try:
            node = cfg[key]
            target = resolve_component(node["_component_"])  # the allow-list applies
            path, backend = node.get("path"), node.get("backend", "auto")
        except Exception:  # not a component, or broken: check_config has reported it
            continue
        if target is not from_hf or not isinstance(path, str):
            continue
        if not (Path(path) / CONFIG_NAME).is_file():
            continue
        config = language_model_config(read_hf_config(path))[0]
        where = f"{key}: {Path(path) / CONFIG_NAME}: "
        lines.append(f"{key}: {choose_backend(config, backend, where=where)}")
    return lines


def run(
    recipe: str | os.PathLike[str], config: str | os.PathLike[str], overrides: Sequence[str] = ()
) -> None:
    """Train: load ``config`` (a name of ``recipe``'s configs or a ``.yaml`` path) with
    ``overrides`` (``key=value``, ``~key``), check it, and run ``recipe`` (a built-in name or a
    ``.py`` path) in this process. Same as ``tunesmith run RECIPE --config CONFIG OVERRIDES...``.

    Example::

        import tunesmith
        tunesmith.run("sft", "demo", ["max_steps=10", "output_dir=outputs/try"])
    """
    recipe_file, _, cfg = prepare_run(recipe, config, overrides)
    run_recipe(recipe_file, cfg)
