"""Quantization-aware training (QAT): the ``quantization.qat`` section of a config.

``quantization: {qat: {scheme: int8da-int4w, group_size: 32, fake_quant_after_n_steps: 0}}``
in any recipe's config makes every linear layer of the trained model but ``lm_head`` compute
with its weights (and, for ``int8da-int4w``, its inputs) rounded as the deployed quantized
model will round them (:mod:`tunesmith.modules.fake_quant`: the schemes, LoRA's frozen base),
while the float weights are what the optimizer updates and the checkpoints hold (Hugging Face
folders and PEFT adapters as without QAT). The first ``fake_quant_after_n_steps`` optimizer
steps train without rounding (:func:`step_hook` switches it on; a resumed run switches it
from the step it resumes at). After training, ``tunesmith export --quantize SCHEME`` writes
the torchao-quantized folder, which computes what the fake-quantized model did.

Example::

    >>> settings = QATSettings(scheme="int4w", group_size=32)
    >>> model = prepare(nn.Sequential(nn.Linear(64, 8)), settings)
    >>> type(model[0]).__name__, fake_quant_enabled(model)
    ('FakeQuantizedLinear', True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from tunesmith.config.errors import ConfigError, ConfigIssue
from tunesmith.modules.fake_quant import (
    QAT_SCHEMES,
    QATScheme,
    fake_quant_enabled,
    prepare_fake_quant,
    set_fake_quant,
)

__all__ = ["QATSettings", "fake_quant_enabled", "prepare", "step_hook"]


@dataclass(frozen=True)
class QATSettings:
    """The ``quantization.qat`` section of a config, read once (:meth:`from_config`)."""

    scheme: QATScheme = "int8da-int4w"
    group_size: int = 32
    fake_quant_after_n_steps: int = 0

    def __post_init__(self) -> None:
        issues = []
        if self.scheme not in QAT_SCHEMES:
            issues.append(("scheme", f"one of {', '.join(QAT_SCHEMES)}", self.scheme))
        if not (isinstance(self.group_size, int) and self.group_size > 0):
            issues.append(("group_size", "an int > 0", self.group_size))
        steps = self.fake_quant_after_n_steps
        if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0):
            issues.append(("fake_quant_after_n_steps", "an int >= 0", steps))
        if issues:
            raise ConfigError.from_issues(
                ConfigIssue(f"quantization.qat.{key}", f"must be {allowed}, got {value!r}")
                for key, allowed, value in issues
            )

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> QATSettings | None:
        """The config's ``quantization.qat`` (None: no QAT); unknown keys are named.

        >>> QATSettings.from_config({"quantization": {"qat": {"scheme": "int4w"}}}).scheme
        'int4w'
        >>> QATSettings.from_config({}) is None
        True
        """
        section = cfg.get("quantization")
        if section is None:
            return None
        section = dict(section)
        unknown = sorted(set(section) - {"qat"})
        qat = section.get("qat")
        known = set(cls.__dataclass_fields__)
        unknown += [f"qat.{k}" for k in sorted(set(qat or {}) - known)]
        if unknown:
            raise ConfigError.from_issues(
                ConfigIssue(f"quantization.{k}", f"unknown key (known: qat.{', qat.'.join(known)})")
                for k in unknown
            )
        return None if qat is None else cls(**dict(qat))


def prepare(model: nn.Module, settings: QATSettings) -> nn.Module:
    """:func:`~tunesmith.modules.fake_quant.prepare_fake_quant` as ``settings`` say, switched
    off until ``fake_quant_after_n_steps`` steps are done (see :func:`step_hook`)."""
    prepare_fake_quant(model, settings.scheme, settings.group_size)
    set_fake_quant(model, settings.fake_quant_after_n_steps == 0)
    return model


def step_hook(settings: QATSettings) -> Any:
    """A trainer hook (``on_step_end``) that switches fake quantization on once
    ``fake_quant_after_n_steps`` steps are done; call it with the resumed step at start too.

    >>> model = prepare(nn.Sequential(nn.Linear(32, 4)), QATSettings(fake_quant_after_n_steps=2))
    >>> hook = step_hook(QATSettings(fake_quant_after_n_steps=2))
    >>> class T: pass
    >>> trainer = T(); trainer.model = model
    >>> hook(trainer, 1, {}); fake_quant_enabled(model)
    False
    >>> hook(trainer, 2, {}); fake_quant_enabled(model)
    True
    """

    def hook(trainer: Any, step: int, metrics: Mapping[str, float]) -> None:
        set_fake_quant(trainer.model, step >= settings.fake_quant_after_n_steps)

    return hook
