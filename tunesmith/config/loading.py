"""Load a YAML config file (and its overrides) into a DictConfig; dump one back to YAML.

Example::

    >>> _ = Path("demo.yaml").write_text(
    ...     "base_lr: 2.0e-5\\noptimizer: {lr: '${base_lr}'}\\nprofiler: {enabled: true}\\n")
    >>> cfg = load_config("demo.yaml", ["base_lr=1e-4", "~profiler"])
    >>> print(config_to_yaml(cfg))  # interpolations resolved
    base_lr: 0.0001
    optimizer:
      lr: 0.0001
    <BLANKLINE>
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tunesmith.config.errors import ConfigError, join_path
from tunesmith.config.nodes import node_path, read_child
from tunesmith.config.overrides import apply_overrides

__all__ = ["config_to_yaml", "load_config"]

_NODE_KINDS = {yaml.SequenceNode: "list", yaml.ScalarNode: "single value"}


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """Read YAML file ``path`` into a DictConfig and apply ``overrides`` to it.

    Interpolations (``${a.b}``) are kept lazy: they resolve on access, and
    :func:`~tunesmith.config.validate_config` reports the ones that cannot. Raises ConfigError
    naming the file (and line for syntax errors) when the file is missing, is not valid YAML,
    or does not hold a mapping at its top level.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc}") from exc
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None and not isinstance(root, yaml.MappingNode):
            kind = _NODE_KINDS.get(type(root), type(root).__name__)
            line = root.start_mark.line + 1
            raise ConfigError(
                f"{path}:{line}: the top level of a config must be a mapping of keys to "
                f"values, got a {kind}"
            )
        cfg = OmegaConf.load(io.StringIO(text))
    except yaml.YAMLError as exc:
        raise ConfigError(_yaml_message(path, exc)) from None
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).strip().splitlines()[0]}") from exc
    if not isinstance(cfg, DictConfig):  # defensive: compose() above already checked this
        raise ConfigError(f"{path}: the top level of a config must be a mapping")
    return apply_overrides(cfg, overrides) if overrides else cfg


def config_to_yaml(cfg: DictConfig, *, resolve: bool = True) -> str:
    """YAML text of ``cfg``, interpolations resolved unless ``resolve=False``.

    Values still to be given (``???``) are written as ``???``. Raises ConfigError naming the
    dotted path of the first interpolation that fails.
    """
    if resolve:
        _check_resolves(cfg, "")
    try:
        return OmegaConf.to_yaml(cfg, resolve=resolve)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc).strip().splitlines()[0], path=node_path(cfg)) from exc


def _check_resolves(node: DictConfig | ListConfig, path: str) -> None:
    keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if OmegaConf.is_missing(node, key):
            continue  # `???` is shown as is: it is a value still to be given, not an error here
        child_path = join_path(path, key)
        value = read_child(node, key, child_path)
        # An interpolated container is checked where it is defined, not again here.
        if isinstance(value, (DictConfig, ListConfig)) and not OmegaConf.is_interpolation(
            node, key
        ):
            _check_resolves(value, child_path)


def _yaml_message(path: Path, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
    context = getattr(exc, "context", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    detail = f"{problem} ({context})" if context else problem
    return f"{where}: YAML syntax error: {detail}"
