"""A config as plain data that is safe to write down: no value read from the environment.

:func:`plain_config` resolves every interpolation (``${output_dir}/logs`` becomes
``outputs/run/logs``) except the ones that read environment variables, ``${oc.env:NAME}``
(and ``${oc.env:NAME,default}``): those stay as written, wherever they appear, also when
another key refers to them (``b: ${a}`` with ``a: ${oc.env:KEY}`` renders as
``${oc.env:KEY}``). What the run writes (``config.yaml``, the config printed or sent to
TensorBoard and W&B, the config stored in each checkpoint) is this rendering, so an API key
passed through the environment is used but never persisted. The running code still reads the
real values from the config itself.

:func:`display_config` is the rendering ``tunesmith cat`` prints: the same, except that an
interpolation that cannot be resolved yet (``${model_dir}`` while ``model_dir`` is still
``???``) is shown as written instead of failing.

Example::

    >>> cfg = OmegaConf.create({"out": "runs/a", "logs": "${out}/logs",
    ...                         "key": "${oc.env:WANDB_KEY}"})
    >>> plain_config(cfg)
    {'out': 'runs/a', 'logs': 'runs/a/logs', 'key': '${oc.env:WANDB_KEY}'}
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.basecontainer import BaseContainer
from omegaconf.errors import OmegaConfBaseException

from tunesmith.config.secrets import install_env_recorder

__all__ = ["ENV_RESOLVERS", "display_config", "plain_config"]

# Resolvers that read the environment: rendered as their own text, never as the value.
ENV_RESOLVERS = ("oc.env",)
_NO_DEFAULT = object()
_LOCK = threading.Lock()


def plain_config(cfg: DictConfig | ListConfig) -> Any:
    """``cfg`` as plain dicts and lists, interpolations resolved except environment reads.

    Values still to be given (``???``) stay ``"???"``. Raises what omegaconf raises for an
    interpolation that does not resolve (:func:`~tunesmith.config.validate_config` reports
    those first).

    Example::

        >>> plain_config(OmegaConf.create({"token": "${oc.env:HF_TOKEN,null}"}))
        {'token': '${oc.env:HF_TOKEN,null}'}
    """
    with _environment_as_text():
        return OmegaConf.to_container(cfg, resolve=True)


def display_config(cfg: DictConfig | ListConfig) -> Any:
    """``cfg`` as plain dicts and lists for showing: interpolations resolved where they can be,
    the others (a reference to a ``???`` value, a missing key, a cycle) kept as written;
    environment reads kept as written, as in :func:`plain_config`; ``???`` stays ``"???"``.

    Example::

        >>> display_config(OmegaConf.create({"model_dir": "???", "path": "${model_dir}",
        ...                                  "out": "runs", "logs": "${out}/logs"}))
        {'model_dir': '???', 'path': '${model_dir}', 'out': 'runs', 'logs': 'runs/logs'}
    """
    with _environment_as_text():
        return _shown(cfg)


def _shown(node: DictConfig | ListConfig) -> Any:
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    out = [_shown_child(node, key) for key in keys]
    return dict(zip(keys, out)) if isinstance(node, DictConfig) else out


def _shown_child(node: DictConfig | ListConfig, key: Any) -> Any:
    if OmegaConf.is_missing(node, key):
        return "???"
    try:
        value = node[key]
    except (OmegaConfBaseException, RecursionError):
        return node._get_node(key)._value()  # the interpolation's own text
    return _shown(value) if isinstance(value, (DictConfig, ListConfig)) else value


@contextmanager
def _environment_as_text() -> Iterator[None]:
    """While inside, every resolver of :data:`ENV_RESOLVERS` returns its interpolation's text."""
    registry = BaseContainer._resolvers  # omegaconf's own table: restored exactly as it was
    with _LOCK:
        saved = {name: registry.get(name) for name in ENV_RESOLVERS}
        try:
            for name in ENV_RESOLVERS:
                OmegaConf.register_resolver(name, _as_text(name), replace=True)
            yield
        finally:
            for name, resolver in saved.items():
                if resolver is None:
                    registry.pop(name, None)
                else:
                    registry[name] = resolver


def _as_text(name: str):
    def resolver(key: str, default: Any = _NO_DEFAULT) -> str:
        if default is _NO_DEFAULT:
            return f"${{{name}:{key}}}"
        return f"${{{name}:{key},{'null' if default is None else default}}}"

    return resolver


install_env_recorder()  # every ${oc.env:...} value resolved is remembered: logs redact it
