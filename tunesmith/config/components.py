"""Resolve ``_component_`` dotted paths to callables, behind an allow-list.

A config names what to build by a dotted path (``torch.optim.AdamW``). Resolving one imports
its module, which runs code, so only paths under :data:`ALLOWED_COMPONENT_PREFIXES` are
resolved unless the caller allows any component: ``allow_any_component=True``, or the
environment variable ``TUNESMITH_ALLOW_ANY_COMPONENT=1`` (what ``--allow-any-component`` on
the command line sets, so that it also reaches processes started by torchrun).

Example::

    >>> resolve_component("torch.nn.Linear")
    <class 'torch.nn.modules.linear.Linear'>
    >>> resolve_component("os.system")
    Traceback (most recent call last):
    ...
    tunesmith.config.errors.ConfigError: component 'os.system' is not allowed ...
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tunesmith.config.errors import ConfigError, did_you_mean, type_name

__all__ = [
    "ALLOWED_COMPONENT_PREFIXES",
    "ALLOW_ANY_COMPONENT_ENV",
    "COMPONENT_KEY",
    "DENIED_COMPONENT_PREFIXES",
    "any_component_allowed",
    "is_component_allowed",
    "resolve_component",
]

COMPONENT_KEY = "_component_"

# Dotted-path prefixes whose components may be resolved without opting in. Extend it in place
# (``ALLOWED_COMPONENT_PREFIXES.append("mylab.")``) to trust another package.
ALLOWED_COMPONENT_PREFIXES: list[str] = [
    "tunesmith.",
    "torch.",
    "torchao.",
    "bitsandbytes.",
    "transformers.",
    "peft.",
    "datasets.",
]

# Paths under an allowed prefix that still load or run code from files or the network
# (pickles, TorchScript, torch.hub repos, C++ extensions): refused like paths off the list.
DENIED_COMPONENT_PREFIXES: list[str] = [
    "torch.load",
    "torch.hub.",
    "torch.jit.load",
    "torch.package.",
    "torch.utils.cpp_extension.",
    "torch.serialization.",
    "transformers.dynamic_module_utils.",
]

ALLOW_ANY_COMPONENT_ENV = "TUNESMITH_ALLOW_ANY_COMPONENT"

_DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


def any_component_allowed(allow_any_component: bool | None = None) -> bool:
    """The explicit choice when given, else whether the environment variable is set truthy."""
    if allow_any_component is not None:
        return allow_any_component
    flag = os.environ.get(ALLOW_ANY_COMPONENT_ENV, "").strip().lower()
    return flag in {"1", "true", "yes", "on"}


def is_component_allowed(path: str) -> bool:
    """Whether ``path`` lies under one of :data:`ALLOWED_COMPONENT_PREFIXES` and under none of
    :data:`DENIED_COMPONENT_PREFIXES`."""
    if any(path == p or path.startswith(p) for p in DENIED_COMPONENT_PREFIXES):
        return False
    return any(path.startswith(prefix) for prefix in ALLOWED_COMPONENT_PREFIXES)


def resolve_component(
    path: object, *, allow_any_component: bool | None = None
) -> Callable[..., Any]:
    """Import and return the callable at dotted ``path``.

    Raises :class:`ConfigError` (message without the config path; callers add it) when the
    value is not a dotted-path string, is outside the allow-list, does not import (with the
    closest existing name suggested), or is not callable.
    """
    if not isinstance(path, str):
        raise ConfigError(
            f"_component_ must be a dotted path string such as 'torch.optim.AdamW', "
            f"got {type_name(path)} {_shown(path)}"
        )
    if not _DOTTED_PATH.match(path):
        raise ConfigError(
            f"_component_ {path!r} is not a full dotted path such as 'torch.optim.AdamW'"
        )
    if not any_component_allowed(allow_any_component) and not is_component_allowed(path):
        prefixes = ", ".join(ALLOWED_COMPONENT_PREFIXES)
        raise ConfigError(
            f"component {path!r} is not allowed: only paths under {prefixes} (and not "
            "loaders of pickles/TorchScript/hub code such as torch.load) are resolved; "
            "to allow any component pass --allow-any-component (allow_any_component=True, "
            f"or set {ALLOW_ANY_COMPONENT_ENV}=1)"
        )
    target = _locate(path)
    if not callable(target):
        raise ConfigError(f"component {path!r} is a {type(target).__name__}, not a callable")
    return target


def _shown(value: object) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        return repr(OmegaConf.to_container(value, resolve=False))
    return repr(value)


def _locate(path: str) -> object:
    parts = path.split(".")
    obj: object = None
    found = 0
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing = exc.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                continue  # this module (or a parent of it) does not exist: try a shorter one
            raise ConfigError(f"importing {module_name!r} for {path!r} failed: {exc}") from exc
        except Exception as exc:
            raise ConfigError(
                f"importing {module_name!r} for {path!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        found = end
        break
    if found == 0:
        raise ConfigError(f"component {path!r}: no module named {parts[0]!r}")
    for index in range(found, len(parts)):
        name = parts[index]
        if not hasattr(obj, name):
            owner = ".".join(parts[:index])
            hint = ""
            best = did_you_mean(name, _public_names(obj))
            if best is not None:
                fixed = ".".join([*parts[:index], best, *parts[index + 1 :]])
                hint = f"; did you mean {fixed!r}?"
            raise ConfigError(f"component {path!r}: {owner!r} has no attribute {name!r}{hint}")
        obj = getattr(obj, name)
    return obj


def _public_names(obj: object) -> list[str]:
    names = [name for name in dir(obj) if not name.startswith("_")]
    if isinstance(obj, ModuleType) and hasattr(obj, "__path__"):
        names += [info.name for info in pkgutil.iter_modules(obj.__path__)]
    return names
