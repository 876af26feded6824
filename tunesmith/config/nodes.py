"""Reading values out of omegaconf nodes, with failures turned into path-named errors.

Example::

    >>> cfg = OmegaConf.create({"lr": "${base_lr}", "opt": {"x": 1}})
    >>> read_child(cfg, "lr", "lr")
    Traceback (most recent call last):
    ...
    tunesmith.config.errors.ConfigError: lr: interpolation '${base_lr}' cannot be resolved: ...
    >>> node_path(cfg.opt)
    'opt'
"""

from __future__ import annotations

from typing import Any

from omegaconf import Container, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from tunesmith.config.errors import ConfigError

__all__ = ["MISSING_VALUE", "has_key", "is_tree_node", "node_path", "read_child", "raw_child"]

MISSING_VALUE = "value is missing (???); set it in the config or with an override"
"""What is wrong with a ``???`` value, wherever it is read."""


def has_key(node: DictConfig, key: Any) -> bool:
    """Whether ``key`` is set in ``node``, even to ``???`` (``key in node`` says no for those)."""
    return key in node.keys()  # noqa: SIM118


def node_path(node: object) -> str:
    """Dotted path of ``node`` inside its root config (``""`` for a root or a plain object, or
    for a node a resolver made, ``${oc.create:...}``, which has no key in the tree).

    List indices are path segments too: ``cfg.stages[0].heads[1]`` is ``"stages.0.heads.1"``.
    """
    if not isinstance(node, Container):
        return ""
    parts: list[str] = []
    try:
        while node._get_parent() is not None:
            key = node._key()
            if key is None:  # made by a resolver: its place in the tree is not known here
                return ""
            parts.append(str(key))
            node = node._get_parent()
    except Exception:  # an unusual node: report paths relative to it
        return ""
    return ".".join(reversed(parts))


def is_tree_node(node: Container) -> bool:
    """Whether ``node`` is a node of its config tree (what ``${a.b}`` resolves to), not one a
    resolver made (``${oc.create:{...}}``: no key, a new object at every access).

    >>> cfg = OmegaConf.create({"a": {"x": 1}, "b": "${a}", "c": "${oc.create:{x: 1}}"})
    >>> is_tree_node(cfg.b), is_tree_node(cfg.c)
    (True, False)
    """
    try:
        while node._get_parent() is not None:
            if node._key() is None:
                return False
            node = node._get_parent()
    except Exception:
        return False
    return True


def raw_child(parent: DictConfig | ListConfig, key: Any) -> Any:
    """The value at ``parent[key]`` with interpolations left as written (``"${a.b}"``)."""
    try:
        return OmegaConf.to_container(parent, resolve=False)[key]  # type: ignore[index]
    except Exception:
        return None


def read_child(parent: DictConfig | ListConfig, key: Any, path: str) -> Any:
    """``parent[key]`` with interpolations resolved; problems raise ConfigError at ``path``."""
    try:
        return parent[key]
    except MissingMandatoryValue as exc:
        raise ConfigError(MISSING_VALUE, path=path) from exc
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe(exc, raw_child(parent, key)), path=path) from exc
    except RecursionError as exc:
        raise ConfigError(
            f"circular interpolation: {raw_child(parent, key)!r} refers back to itself",
            path=path,
        ) from exc


def _describe(exc: Exception, raw: Any) -> str:
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "Recursive interpolation" in first_line:
        return f"circular interpolation: {raw!r} refers back to itself"
    if isinstance(raw, str) and "${" in raw:
        return f"interpolation {raw!r} cannot be resolved: {first_line}"
    return f"{type(exc).__name__}: {first_line}"
