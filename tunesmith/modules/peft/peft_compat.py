"""Adapters that ``peft`` would misread in a PEFT folder of a MoE model, named before it matters.

peft (0.21, with transformers 5, whose MoE experts are fused ``[E, ...]`` parameters) rewrites
the ``target_modules`` of some MoE model types when it loads an adapter folder: every target
named like an expert projection (``gate_proj``/``up_proj``/``down_proj``; Mixtral: ``w1``/
``w3``/``w2``), a full module path ending in one included, becomes the routed experts'
``target_parameters``. An adapter tunesmith put on a non-expert MLP of such a model (the dense
layers: Qwen3-MoE's ``mlp_only_layers``, DeepSeek's first ``first_k_dense_replace`` layers; the
shared experts: DeepSeek's ``shared_experts``) is then silently left out by peft, while
tunesmith reads the folder back exactly and merged exports are right. Llama 4 and gpt-oss
folders are read as written (measured per family in tests/peft/test_peft_moe_targets.py).

Example::

    >>> from tunesmith.models import deepseek_v3
    >>> from tunesmith.modules.peft import apply_lora, peft_misread_modules
    >>> model = deepseek_v3.deepseek_v3_tiny()  # layer 0 dense, shared experts
    >>> _ = apply_lora(model, target_modules=["experts.down_proj"], rank=2, alpha=4)
    >>> peft_misread_modules(model)
    []
    >>> _ = apply_lora(model, target_modules=["shared_experts.down_proj"], rank=2, alpha=4)
    >>> peft_misread_modules(model)[:1]
    ['model.layers.1.mlp.shared_experts.down_proj']
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

__all__ = [
    "PEFT_EXPERT_NAMES",
    "peft_misread_message",
    "peft_misread_names",
    "warn_peft_misread",
]

logger = logging.getLogger(__name__)

_GATE_UP_DOWN = frozenset({"gate_proj", "up_proj", "down_proj"})
# model_type -> the module names peft turns into the routed experts' target_parameters when it
# loads a folder for that model type (native MoE families; llama4_text and gpt_oss: none).
PEFT_EXPERT_NAMES: dict[str, frozenset[str]] = {
    "qwen3_moe": _GATE_UP_DOWN,
    "deepseek_v2": _GATE_UP_DOWN,
    "deepseek_v3": _GATE_UP_DOWN,
    "glm4_moe": _GATE_UP_DOWN,
    "mixtral": frozenset({"w1", "w2", "w3"}),
}
_SHOWN = 3  # names quoted in the message


def _model_type(model: nn.Module) -> str | None:
    """``model_type`` of the first module's ``spec`` (a ``TransformerLM``'s), else None."""
    for module in model.modules():
        model_type = getattr(getattr(module, "spec", None), "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return None


def peft_misread_names(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Those of ``names`` (``model``'s adapted non-expert layers, or the layers LoRA targets
    would adapt) whose leaf name peft maps to the experts for the model's type; empty for
    other model types.

    Example::

        >>> from tunesmith.models import qwen3_moe
        >>> model = qwen3_moe.qwen3_moe_tiny(device="meta")
        >>> peft_misread_names(model, ["model.layers.1.mlp.down_proj", "model.layers.1.o_proj"])
        ['model.layers.1.mlp.down_proj']
    """
    leaves = PEFT_EXPERT_NAMES.get(_model_type(model) or "", frozenset())
    return [name for name in names if name.rpartition(".")[2] in leaves]


def peft_misread_message(model_type: str, modules: list[str]) -> str:
    """One line on ``modules`` (non-empty) and what to do instead.

    Example::

        >>> peft_misread_message("qwen3_moe", ["model.layers.0.mlp.down_proj"])[:58]
        'peft would drop 1 LoRA adapter of this qwen3_moe model (mo'
    """
    shown = ", ".join(modules[:_SHOWN]) + (", ..." if len(modules) > _SHOWN else "")
    plural = "s" if len(modules) > 1 else ""
    leaves = "/".join(sorted(PEFT_EXPERT_NAMES.get(model_type, _GATE_UP_DOWN)))
    return (
        f"peft would drop {len(modules)} LoRA adapter{plural} of this {model_type} model "
        f"({shown}) when loading its PEFT folder: with transformers 5 it reads every "
        f"{leaves} target of a {model_type} adapter as the routed experts', so adapters on dense "
        f"or shared-expert MLPs are silently lost there (tunesmith reads the folder exactly). "
        f"For peft, target the experts only (experts.gate_proj, experts.up_proj, "
        f"experts.down_proj, as the deepseek_v2_lite_lora config does), or give peft users a merged "
        f"full model (`tunesmith export`)"
    )


def warn_peft_misread(model: nn.Module, modules: list[str]) -> str | None:
    """Log and return :func:`peft_misread_message` for ``modules`` (what
    :func:`~tunesmith.modules.peft.apply.peft_misread_modules` found in ``model``); None when
    there are none."""
    if not modules:
        return None
    message = peft_misread_message(_model_type(model) or "", modules)
    logger.warning(message)
    return message
