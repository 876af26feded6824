"""A config as plain data that is safe to write down: no value read from the environment.

:func:`plain_config` resolves every interpolation (``${output_dir}/logs`` becomes
``outputs/run/logs``) except the ones that read environment variables, ``${oc.env:NAME}``
(and ``${oc.env:NAME,default}``): those stay as written, wherever they appear, also when
another key refers to them (``b: ${a}`` with ``a: ${oc.env:KEY}`` renders as
``${oc.env:KEY}``). What the run writes (``config.yaml``, the config printed or sent to
TensorBoard and W&B, the config stored in each checkpoint) is this rendering, so an API key
passed through the environment is used but never persisted. The running code still reads the
real values from the config itself.

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

__all__ = ["ENV_RESOLVERS", "plain_config"]

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
