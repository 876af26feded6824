"""YAML configs with ``_component_`` dotted paths: load, override, validate, instantiate.

Example::

    >>> import torch
    >>> from pathlib import Path
    >>> from tunesmith.config import load_config, validate_config, instantiate, ConfigError
    >>> _ = Path("sft.yaml").write_text(
    ...     "optimizer: {_component_: torch.optim.AdamW, lr: 2.0e-5}\\nprofiler: {enabled: true}\\n")
    >>> cfg = load_config("sft.yaml", ["optimizer.lr=1e-4", "~profiler"])
    >>> issues = validate_config(cfg, runtime_args={"optimizer": 1})
    >>> if issues:
    ...     raise ConfigError.from_issues(issues)
    >>> optimizer = instantiate(cfg.optimizer, torch.nn.Linear(2, 2).parameters())
    >>> optimizer.defaults["lr"], "profiler" in cfg
    (0.0001, False)
"""

from tunesmith.config.components import (
    ALLOW_ANY_COMPONENT_ENV,
    ALLOWED_COMPONENT_PREFIXES,
    CHECKED_LIBRARIES,
    COMPONENT_KEY,
    DENIED_COMPONENTS,
    any_component_allowed,
    component_refusal,
    is_component_allowed,
    resolve_component,
)
from tunesmith.config.errors import ConfigError, ConfigIssue
from tunesmith.config.instantiate import instantiate
from tunesmith.config.loading import config_to_yaml, load_config
from tunesmith.config.overrides import apply_overrides, parse_override
from tunesmith.config.registry import component, is_marked
from tunesmith.config.render import display_config, plain_config
from tunesmith.config.validate import check_keys, validate_config

__all__ = [
    "ALLOWED_COMPONENT_PREFIXES",
    "DENIED_COMPONENTS",
    "ALLOW_ANY_COMPONENT_ENV",
    "CHECKED_LIBRARIES",
    "COMPONENT_KEY",
    "ConfigError",
    "ConfigIssue",
    "any_component_allowed",
    "apply_overrides",
    "check_keys",
    "component",
    "component_refusal",
    "config_to_yaml",
    "display_config",
    "instantiate",
    "is_component_allowed",
    "is_marked",
    "load_config",
    "parse_override",
    "plain_config",
    "resolve_component",
    "validate_config",
]
