"""Fake and real quantization of linear layers on torchao: the rounding of a deployed
quantized model, faked in training (QAT) and applied at export.

Schemes (:data:`QAT_SCHEMES`), each torchao's post-training config whose rounding is faked:

- ``int8da-int4w``: int8 per-token asymmetric activations, int4 symmetric weights in groups of
  ``group_size`` along the input (``Int8DynamicActivationIntxWeightConfig``; ExecuTorch's);
- ``int4w``: int4 weights in groups, float activations (``IntxWeightOnlyConfig``);
- ``int8w``: int8 weights per output channel, float activations (``IntxWeightOnlyConfig``).

Every linear layer but ``lm_head`` takes part (embeddings and the output head stay float, as
transformers' torchao loading leaves them). ``nn.Linear`` layers become torchao's
``FakeQuantizedLinear`` (same parameter names); a LoRA layer fake-quantizes its frozen base's
input and weight with the same quantizers while its adapters see the float input.
:func:`quantize` applies the real quantization: a model so quantized computes exactly what the
fake-quantized one did.

Example::

    >>> model = prepare_fake_quant(torch.nn.Sequential(torch.nn.Linear(64, 8)), "int4w", 32)
    >>> type(model[0]).__name__, fake_quant_enabled(model)
    ('FakeQuantizedLinear', True)
"""

from __future__ import annotations

import copy
from typing import Any, Literal, get_args

import torch
from torch import nn

__all__ = [
    "QAT_SCHEMES",
    "fake_quant_enabled",
    "prepare_fake_quant",
    "quantize",
    "quantized_layers",
    "set_fake_quant",
    "torchao_config",
]

QATScheme = Literal["int8da-int4w", "int4w", "int8w"]
QAT_SCHEMES: tuple[str, ...] = get_args(QATScheme)
SKIPPED = ("lm_head",)  # module names (last part) left float


def torchao_config(scheme: str, group_size: int = 32) -> Any:
    """torchao's post-training config of ``scheme`` (the rounding QAT fakes)."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if scheme == "int8da-int4w":
        return Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)
        )
    if scheme == "int4w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))
    if scheme == "int8w":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    raise ValueError(f"scheme must be one of {', '.join(QAT_SCHEMES)}, got {scheme!r}")


def prepare_fake_quant(model: nn.Module, scheme: str, group_size: int = 32) -> nn.Module:
    """Fake quantization (switched on) on every linear layer of ``model`` but ``lm_head``,
    in place; returned. Refused on DoRA and NF4 (QLoRA) layers and on a model already
    prepared."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    from tunesmith.modules.peft import DoRALinear, LoRALinear

    if any(isinstance(m, FakeQuantizedLinear) or _quantizers(m) for m in model.modules()):
        raise ValueError("the model is already prepared for QAT")
    for name, module in model.named_modules():
        if isinstance(module, DoRALinear) or (
            isinstance(module, LoRALinear) and module.is_quantized
        ):
            raise ValueError(
                f"QAT on {type(module).__name__} {name} (DoRA, QLoRA) is not supported"
            )
    layers = quantized_layers(model)
    for name, module in layers.items():
        if scheme != "int8w" and module.in_features % group_size:  # int8w: per channel
            raise ValueError(
                f"quantization group_size {group_size} does not divide the "
                f"{module.in_features} inputs of {name}"
            )
    base = torchao_config(scheme, group_size)
    plain = {id(m) for m in layers.values() if type(m) is nn.Linear}
    quantize_(model, QATConfig(base, step="prepare"), filter_fn=lambda m, _: id(m) in plain)
    activation, weight = _probe_quantizers(base, group_size)
    for layer in layers.values():
        if isinstance(layer, LoRALinear):
            layer.base_fake_quantizers = (copy.deepcopy(activation), copy.deepcopy(weight))
    return model


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers quantization takes, by name: every ``nn.Linear`` and LoRA layer but those
    named in :data:`SKIPPED` (``lm_head``) and a LoRA layer's own adapters.

    >>> from tunesmith.modules.peft import LoRALinear
    >>> model = nn.ModuleDict({"q_proj": LoRALinear(4, 4, rank=2, alpha=2),
    ...                        "lm_head": nn.Linear(4, 9)})
    >>> list(quantized_layers(model))
    ['q_proj']
    """
    from tunesmith.modules.peft import LoRALinear

    adapters = {
        id(m) for layer in model.modules() if isinstance(layer, LoRALinear)
        for m in (layer.lora_A, layer.lora_B)
    }  # fmt: skip
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, LoRALinear))
        and id(module) not in adapters
        and name.rpartition(".")[2] not in SKIPPED
    }


def _probe_quantizers(base: Any, group_size: int) -> tuple[nn.Module | None, nn.Module]:
    """The activation and weight fake quantizers torchao derives from ``base`` (read off a
    probe layer it prepares: the derivation itself is not public)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    probe = nn.Sequential(nn.Linear(group_size, 1))
    quantize_(probe, QATConfig(base, step="prepare"))
    return probe[0].activation_fake_quantizer, probe[0].weight_fake_quantizer


def _quantizers(module: nn.Module) -> list[nn.Module]:
    """The fake quantizers of one layer (none: not prepared)."""
    found = [getattr(module, "activation_fake_quantizer", None)]
    found.append(getattr(module, "weight_fake_quantizer", None))
    found += list(getattr(module, "base_fake_quantizers", None) or ())
    return [q for q in found if q is not None]


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Switch every fake quantizer of ``model`` on or off."""
    for module in model.modules():
        for quantizer in _quantizers(module):
            quantizer.enabled = enabled


def fake_quant_enabled(model: nn.Module) -> bool | None:
    """Whether ``model``'s fake quantizers are on (None: it has none)."""
    states = {q.enabled for m in model.modules() for q in _quantizers(m)}
    return None if not states else all(states)


def quantize(model: nn.Module, scheme: str, group_size: int = 32) -> nn.Module:
    """``model`` (plain linear layers: merged adapters, fake quantizers removed or never
    added) quantized by torchao as ``scheme``, in place; it then computes what the
    fake-quantized model computed."""
    from torchao.quantization import quantize_

    plain = {id(m) for m in quantized_layers(model).values() if type(m) is nn.Linear}
    quantize_(model, torchao_config(scheme, group_size), filter_fn=lambda m, _: id(m) in plain)
    return model
