"""Command-line overrides: ``key=value``, ``~key``, component swaps.

Grammar (one override per string; applied in order):

- ``a.b=value`` sets ``a.b``, creating missing mappings on the way (``a.b.c=1`` on a config
  without ``a`` creates ``a: {b: {c: 1}}``). A numeric segment indexes a list: ``layers.0=5``.
- The text is split at the first ``=`` only, so ``prompt=a=b`` sets ``"a=b"`` and
  ``url=http://x?a=b`` sets the whole URL.
- Values are read as YAML scalars or flow collections: ``3`` int, ``1e-5`` / ``0.1`` float,
  ``true`` bool, ``null`` (or ``None``, ``~``) None, ``[1, 2]`` list, ``{a: 1}`` mapping (which
  replaces the node, it is not merged). Quote to keep a string: ``name='"007"'``. Any other
  text stays the exact string typed (``a=hello world`` gives ``"hello world"``); ``a=`` gives
  ``""``. ``${...}`` stays an interpolation.
- ``~a.b`` deletes ``a.b``; deleting a key that is not there is an error.
- Component swap: ``optimizer=torch.optim.SGD``, where ``optimizer`` is currently a node with a
  ``_component_``, replaces only its ``_component_`` and keeps its other arguments, so
  ``optimizer=torch.optim.SGD optimizer.momentum=0.9`` reads naturally; arguments the new
  component does not accept are reported by :func:`~tunesmith.config.validate_config`
  (delete them with ``~optimizer.betas``). To replace the whole node give a mapping:
  ``optimizer={_component_: torch.optim.SGD, lr: 0.1}``. ``optimizer._component_=...`` sets
  the component directly.

Every bad override is reported, each naming the override text, in one :class:`ConfigError`.

Example::

    >>> cfg = OmegaConf.create({"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3}})
    >>> new = apply_overrides(cfg, ["optimizer=torch.optim.SGD", "optimizer.lr=0.1", "seed=7"])
    >>> OmegaConf.to_container(new)
    {'optimizer': {'_component_': 'torch.optim.SGD', 'lr': 0.1}, 'seed': 7}
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tunesmith.config.components import COMPONENT_KEY
from tunesmith.config.errors import ConfigError, suggestion
from tunesmith.config.nodes import has_key

__all__ = ["Override", "apply_overrides", "parse_override", "parse_value"]

_SEGMENT = re.compile(r"^(?:[A-Za-z_][\w\-]*|\d+)$")
_NULLS = {"null", "Null", "NULL", "~", "None"}


class _ValueLoader(yaml.SafeLoader):
    """SafeLoader reading ``1e-5`` as a float (like YAML 1.2 and omegaconf) and no dates."""


_ValueLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


@dataclass(frozen=True)
class Override:
    """A parsed override: ``keys`` is the dotted path split; ``value`` is unused for deletes."""

    text: str
    keys: tuple[str, ...]
    delete: bool
    value: Any = None

    @property
    def path(self) -> str:
        return ".".join(self.keys)


def parse_value(text: str) -> Any:
    """The Python value of override text ``text`` (see the module docstring for the rules)."""
    stripped = text.strip()
    if not stripped:
        return ""
    if stripped == "None":
        return None
    quoted_or_flow = stripped[0] in "[{\"'"
    try:
        value = yaml.load(stripped, Loader=_ValueLoader)  # _ValueLoader is a SafeLoader
    except yaml.YAMLError as exc:
        if quoted_or_flow:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(f"cannot parse value {stripped!r}: {problem}") from None
        return text
    if isinstance(value, (list, dict)):
        return value if stripped[0] in "[{" else text
    if isinstance(value, str):
        return value if quoted_or_flow else text
    if value is None and stripped not in _NULLS:
        return text
    if not isinstance(value, (bool, int, float)) and value is not None:
        return text
    return value


def parse_override(text: str) -> Override:
    """Parse one override string; raises ConfigError naming it when malformed."""
    if not isinstance(text, str):
        raise ConfigError(f"override {text!r} is not a string")
    delete = text.startswith("~")
    if delete:
        if "=" in text:
            raise ConfigError(f"override {text!r}: a deletion '~key' takes no '=value'")
        key_text, value_text = text[1:], None
    elif "=" not in text:
        raise ConfigError(
            f"override {text!r} has no '=': write key=value to set, or ~key to delete"
        )
    else:
        key_text, value_text = text.split("=", 1)
    keys = tuple(key_text.strip().split("."))
    bad = [segment for segment in keys if not _SEGMENT.match(segment)]
    if bad:
        raise ConfigError(
            f"override {text!r}: {key_text.strip()!r} is not a dotted key path "
            f"(bad part {bad[0]!r})"
        )
    if value_text is None:
        return Override(text, keys, delete=True)
    try:
        value = parse_value(value_text)
    except ValueError as exc:
        raise ConfigError(f"override {text!r}: {exc}") from None
    return Override(text, keys, delete=False, value=value)


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """A copy of ``cfg`` with ``overrides`` applied in order; ``cfg`` is left unchanged.

    Raises one ConfigError listing every bad override (one per line).
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    result = copy.deepcopy(cfg)
    problems: list[str] = []
    for text in overrides:
        try:
            _apply(result, parse_override(text))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("\n".join(problems))
    return result


def _apply(cfg: DictConfig, override: Override) -> None:
    parent = _parent(cfg, override)
    last = override.keys[-1]
    try:
        if override.delete:
            _delete(parent, last, override)
        else:
            _set(parent, last, override)
    except OmegaConfBaseException as exc:
        message = str(exc).strip().splitlines()[0]
        raise ConfigError(f"override {override.text!r}: {message}") from exc


def _fail(override: Override, message: str) -> ConfigError:
    return ConfigError(f"override {override.text!r}: {message}")


def _parent(cfg: DictConfig, override: Override) -> DictConfig | ListConfig:
    node: DictConfig | ListConfig = cfg
    for depth, key in enumerate(override.keys[:-1]):
        here = ".".join(override.keys[: depth + 1])
        if isinstance(node, ListConfig):
            child = node[_index(node, key, here, override)]
        else:
            exists = has_key(node, key)
            if exists and OmegaConf.is_interpolation(node, key):
                raise _fail(
                    override,
                    f"{here!r} is an interpolation; override the key it refers to instead",
                )
            if not exists or OmegaConf.is_missing(node, key) or node[key] is None:
                if override.delete:
                    raise _fail(
                        override,
                        f"cannot delete {override.path!r}: {here!r} is not set"
                        + suggestion(key, map(str, node.keys())),
                    )
                node[key] = {}
            child = node[key]
        if not isinstance(child, (DictConfig, ListConfig)):
            raise _fail(
                override, f"{here!r} holds a {type(child).__name__}, not a mapping or a list"
            )
        node = child
    return node


def _index(node: ListConfig, key: str, here: str, override: Override) -> int:
    if not key.isdigit():
        raise _fail(override, f"{here!r}: {key!r} is not an index into a list")
    index = int(key)
    if index >= len(node):
        raise _fail(
            override,
            f"{here!r}: index {index} is out of range for a list of length {len(node)} "
            "(set the whole list instead, e.g. key=[1, 2, 3])",
        )
    return index


def _delete(parent: DictConfig | ListConfig, key: str, override: Override) -> None:
    if isinstance(parent, ListConfig):
        del parent[_index(parent, key, override.path, override)]
        return
    if not has_key(parent, key):
        raise _fail(
            override,
            f"cannot delete {override.path!r}: key {key!r} not found"
            + suggestion(key, map(str, parent.keys())),
        )
    del parent[key]


def _set(parent: DictConfig | ListConfig, key: str, override: Override) -> None:
    value = override.value
    if isinstance(parent, ListConfig):
        parent[_index(parent, key, override.path, override)] = value
        return
    if (
        key != COMPONENT_KEY
        and isinstance(value, str)
        and "${" not in value
        and has_key(parent, key)
        and not OmegaConf.is_interpolation(parent, key)
        and not OmegaConf.is_missing(parent, key)
    ):
        current = parent[key]
        if isinstance(current, DictConfig) and has_key(current, COMPONENT_KEY):
            current[COMPONENT_KEY] = value
            return
    parent[key] = value
