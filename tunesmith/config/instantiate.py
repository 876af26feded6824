"""Build objects from config nodes that name a ``_component_``.

``instantiate(node, *args, **kwargs)`` calls the node's component with ``args`` first
(runtime values such as ``model.parameters()``), then the node's other keys as keyword
arguments, which ``kwargs`` override. Nested nodes are built first: a mapping with a
``_component_`` becomes its object, any other mapping a plain ``dict``, a list a plain
``list``. Interpolations resolve against the whole config, even when ``node`` is a sub-node;
a ``${...}`` reference to a component node builds a second, separate object.
Every failure is a :class:`ConfigError` naming the dotted path of the node, with the
original exception as its ``__cause__``.

Example::

    >>> import torch
    >>> cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1}})
    >>> model = torch.nn.Linear(2, 2)
    >>> opt = instantiate(cfg.optimizer, model.parameters(), momentum=0.9)
    >>> opt.defaults["lr"], opt.defaults["momentum"]
    (0.1, 0.9)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tunesmith.config.components import (
    ALLOW_ANY_COMPONENT_ENV,
    COMPONENT_KEY,
    any_component_allowed,
    resolve_component,
    unsafe_arguments,
)
from tunesmith.config.errors import ConfigError, join_path, qualify_hints
from tunesmith.config.nodes import has_key, node_path, read_child

__all__ = ["instantiate"]


def instantiate(
    node: Any, *args: Any, allow_any_component: bool | None = None, **kwargs: Any
) -> Any:
    """Build ``node`` (a DictConfig/ListConfig, a plain dict/list, a scalar or None).

    ``allow_any_component`` lifts the component allow-list (None: follow the
    ``TUNESMITH_ALLOW_ANY_COMPONENT`` environment variable). A node without ``_component_``
    accepts ``kwargs`` (merged into the returned dict) but no positional ``args``.
    """
    path = node_path(node)
    if isinstance(node, (Mapping, list, tuple)) and not isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.create(node, flags={"allow_objects": True})  # type: ignore[arg-type]
    return _build(node, path, args, kwargs, allow_any_component)


def _build(
    node: Any, path: str, args: tuple, kwargs: dict[str, Any], allow_any: bool | None
) -> Any:
    if isinstance(node, DictConfig) and has_key(node, COMPONENT_KEY):
        return _call_component(node, path, args, kwargs, allow_any)
    if args:
        raise ConfigError(
            f"got {len(args)} positional argument(s), but the node has no _component_ to "
            "pass them to",
            path=path,
        )
    if isinstance(node, DictConfig):
        built = {key: _child(node, key, path, allow_any) for key in node if key not in kwargs}
        built.update(kwargs)
        return built
    if kwargs:
        raise ConfigError(
            f"got keyword argument(s) {sorted(kwargs)}, but the node is not a mapping",
            path=path,
        )
    if isinstance(node, ListConfig):
        return [_child(node, index, path, allow_any) for index in range(len(node))]
    return node


def _child(parent: DictConfig | ListConfig, key: Any, path: str, allow_any: bool | None) -> Any:
    child_path = join_path(path, key)
    value = read_child(parent, key, child_path)
    if isinstance(value, (DictConfig, ListConfig)):
        return _build(value, child_path, (), {}, allow_any)
    return value


def _call_component(
    node: DictConfig, path: str, args: tuple, kwargs: dict[str, Any], allow_any: bool | None
) -> Any:
    component_path = join_path(path, COMPONENT_KEY)
    spec = read_child(node, COMPONENT_KEY, component_path)
    try:
        target = resolve_component(spec, allow_any_component=allow_any)
    except ConfigError as exc:
        raise ConfigError(exc.message, path=component_path) from exc.__cause__
    if not any_component_allowed(allow_any):  # before anything nested is built
        _refuse_unsafe(node, spec, path, kwargs)
    call_kwargs = {
        key: _child(node, key, path, allow_any)
        for key in node
        if key != COMPONENT_KEY and key not in kwargs
    }
    call_kwargs.update(kwargs)
    try:
        return target(*args, **call_kwargs)
    except ConfigError as exc:
        raise ConfigError(f"building {spec}: {exc}", path=path) from exc
    except Exception as exc:
        message = qualify_hints(f"{type(exc).__name__}: {exc}", path, _arguments(target, node))
        raise ConfigError(message, path=path) from exc


def _arguments(target: Callable[..., Any], node: DictConfig) -> set[str]:
    """The names a config may set on ``target``: its parameters and the node's keys."""
    names = {str(key) for key in node}
    with contextlib.suppress(TypeError, ValueError):  # no signature to read (some builtins)
        names |= set(inspect.signature(target).parameters)
    return names


def _refuse_unsafe(node: DictConfig, spec: object, path: str, kwargs: dict[str, Any]) -> None:
    """Raise for the first ``trust_remote_code`` / ``weights_only`` other than its safe value
    among the node's resolved values (at any depth; keys the caller passes are judged on what
    the caller passes)."""
    own = ((key, value) for key, value in _resolved_items(node) if key not in kwargs)
    found = next(unsafe_arguments(dict(own), path), None)
    found = found or next(unsafe_arguments(kwargs, path), None)
    if found is not None:
        arg_path, reason = found
        raise ConfigError(
            f"{reason} ({spec}); refused unless any component is allowed "
            f"(--allow-any-component, or {ALLOW_ANY_COMPONENT_ENV}=1)",
            path=arg_path,
        )


def _resolved_items(node: DictConfig) -> list[tuple[Any, Any]]:
    """(key, resolved value) of ``node``'s keys but ``_component_``; a value that does not
    resolve is left out (reading it for the call reports it)."""
    items = []
    for key in node:
        if key == COMPONENT_KEY:
            continue
        try:
            items.append((key, node[key]))
        except Exception:
            continue
    return items
