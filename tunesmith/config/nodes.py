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

__all__ = ["has_key", "node_path", "read_child", "raw_child"]


def has_key(node: DictConfig, key: Any) -> bool:
    """Whether ``key`` is set in ``node``, even to ``???`` (``key in node`` says no for those)."""
    return key in node.keys()  # noqa: SIM118


def node_path(node: object) -> str:
    """Dotted path of ``node`` inside its root config (``""`` for a root or a plain object).

    List indices are path segments too: ``cfg.stages[0].heads[1]`` is ``"stages.0.heads.1"``.
    """
    if not isinstance(node, Container):
        return ""
    parts: list[str] = []
    try:
        while node._get_parent() is not None:
            parts.append(str(node._key()))
            node = node._get_parent()
    except Exception:  # an unusual node: report paths relative to it
        return ""
    return ".".join(reversed(parts))


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
        raise ConfigError(
            "value is missing (???); set it in the config or with an override", path=path
        ) from exc
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
