"""The run's secret values, and how every log we write leaves them out.

A value a config reads from the environment (``${oc.env:HF_TOKEN}``) is a secret: the config
files we write keep the interpolation's text (:func:`~tunesmith.config.plain_config`), and the
logs (the torchrun log, each rank's lines and error, the metrics and console loggers, the
``tunesmith: error:`` line, a Ray trainer group's ``rank<N>.log``, ``console.log`` and
``driver.log``) show it as that text too: :func:`redact` replaces each value by
``${oc.env:NAME}``, and :class:`RedactingStream` is a log file that writes every text so.
The values are collected when the config is resolved: the ``oc.env`` resolver is wrapped
(:func:`install_env_recorder`, done when :mod:`tunesmith.config` is imported) so that each
value it returns from the environment is remembered. A process that never resolves the config
(the torchrun launcher) learns the variables' names, never their values, from
:data:`SECRET_NAMES_ENV`, which the CLI sets for it (and the Ray trainer-group driver for each
rank).

Values shorter than :data:`MIN_SECRET_CHARS` are not redacted: they would blank out ordinary
words and numbers everywhere (``${oc.env:WORLD,1}``); keys and tokens are longer.

Example::

    >>> import os
    >>> os.environ["DEMO_TOKEN"] = "hf_abcdefghijkl"
    >>> from omegaconf import OmegaConf
    >>> OmegaConf.create({"token": "${oc.env:DEMO_TOKEN}"}).token
    'hf_abcdefghijkl'
    >>> redact("401 Unauthorized for token hf_abcdefghijkl")
    '401 Unauthorized for token ${oc.env:DEMO_TOKEN}'
    >>> del os.environ["DEMO_TOKEN"]
"""

from __future__ import annotations

import os
import threading
from typing import Any

from omegaconf import OmegaConf
from omegaconf.resolvers import oc

__all__ = [
    "MIN_SECRET_CHARS",
    "SECRET_NAMES_ENV",
    "RedactingStream",
    "install_env_recorder",
    "redact",
    "remember",
    "secret_names",
    "secret_values",
]

MIN_SECRET_CHARS = 8
SECRET_NAMES_ENV = "TUNESMITH_SECRET_ENV"
"""Comma-separated names of the environment variables the run's config read (names only)."""

_SEEN: dict[str, str] = {}  # environment variable -> the value the config got from it
_LOCK = threading.Lock()
_NO_DEFAULT = object()


def remember(name: str, value: Any) -> None:
    """Record that the config read ``value`` from the environment variable ``name``."""
    if isinstance(value, str):
        with _LOCK:
            _SEEN[name] = value


def _recording_env(key: str, default: Any = _NO_DEFAULT) -> Any:
    """omegaconf's own ``oc.env``, remembering each value that came from the environment."""
    value = oc.env(key) if default is _NO_DEFAULT else oc.env(key, default)
    if key in os.environ:
        remember(key, os.environ[key])
    return value


def install_env_recorder() -> None:
    """Make ``${oc.env:...}`` remember what it reads (idempotent)."""
    OmegaConf.register_resolver("oc.env", _recording_env, replace=True, annotation_validation="off")


def secret_names() -> list[str]:
    """The environment variables the config read, and those :data:`SECRET_NAMES_ENV` names.

    Example::

        >>> remember("DEMO_API_KEY", "k3y-value-long-enough")
        >>> os.environ[SECRET_NAMES_ENV] = "DEMO_HUB_TOKEN,DEMO_WANDB_KEY"  # set by the CLI
        >>> secret_names()[-3:]
        ['DEMO_API_KEY', 'DEMO_HUB_TOKEN', 'DEMO_WANDB_KEY']
        >>> del os.environ[SECRET_NAMES_ENV]
    """
    with _LOCK:
        names = list(_SEEN)
    inherited = [n for n in os.environ.get(SECRET_NAMES_ENV, "").split(",") if n]
    return list(dict.fromkeys([*names, *inherited]))


def secret_values() -> dict[str, str]:
    """``{value: NAME}`` of every secret long enough to redact, longest value first."""
    with _LOCK:
        found = {value: name for name, value in _SEEN.items()}
    for name in secret_names():
        value = os.environ.get(name)
        if value is not None:
            found.setdefault(value, name)
    long_enough = [v for v in found if len(v) >= MIN_SECRET_CHARS]
    return {v: found[v] for v in sorted(long_enough, key=len, reverse=True)}


def redact(text: str) -> str:
    """``text`` with every secret value replaced by its ``${oc.env:NAME}``.

    >>> remember("DEMO_KEY", "s3cr3t-value-42")
    >>> redact("failed: s3cr3t-value-42 is not a path")
    'failed: ${oc.env:DEMO_KEY} is not a path'
    """
    if not isinstance(text, str) or not text:
        return text
    for value, name in secret_values().items():
        if value in text:
            text = text.replace(value, f"${{oc.env:{name}}}")
    return text


class RedactingStream:
    """A text stream that writes to ``file`` with :func:`redact` applied to every text; other
    attributes (``flush``, ``fileno``, ``close``, ...) are the file's.

    >>> import io
    >>> remember("DEMO_PASS", "p4ssw0rd-long-enough")
    >>> log = RedactingStream(io.StringIO())
    >>> log.write("login p4ssw0rd-long-enough\\n")
    27
    >>> log.getvalue()
    'login ${oc.env:DEMO_PASS}\\n'
    """

    def __init__(self, file: Any) -> None:
        self.file = file

    def write(self, text: str) -> int:
        self.file.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)
