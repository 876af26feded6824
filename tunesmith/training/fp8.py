"""FP8 training: the linear layers' matmuls in float8 (torchao's ``torchao.float8``), asked for
by ``precision.matmuls`` (``fp8_rowwise`` or ``fp8_tensorwise``; null: the weights' dtype).

Each converted ``nn.Linear`` becomes torchao's ``Float8Linear``: its input, weight and output
gradient are scaled and cast to float8 (e4m3; tensorwise: e5m2 for the gradient) for the three
matmuls of a step, with dynamic scales (per row with ``fp8_rowwise``, one per tensor with
``fp8_tensorwise``); the weights, their gradients, the optimizer and the checkpoints stay in
the ``precision`` dtypes (a converted model saves the same Hugging Face folder). Rowwise
scaling follows outliers better (closer to bf16); tensorwise is faster and lets FSDP2 all-gather
the weights in float8 (half the bytes of bf16), which :func:`apply_fp8` switches on for a model
FSDP2 will shard on CUDA (gloo cannot all-gather float8).

Which layers (:func:`fp8_layer`): every plain ``nn.Linear`` whose input and output sizes divide
by 16 (what the float8 kernels need), except ``lm_head`` (the logits keep their precision, as
torchao and torchtitan leave the output projection) and a mixture of experts' router (a module
named ``gate`` or ``router``: its softmax over experts picks the routes). The experts of a
MoE layer (grouped weights, not ``nn.Linear``), attention's own matmuls and the embedding stay
in the weights' dtype.

Needs (:func:`device_problem`, one line naming the requirement): a CUDA GPU of compute
capability 8.9 or newer (Ada, Hopper, Blackwell) and bf16 compute (``precision.weights: bf16``
or ``mixed_precision: bf16``: the float8 matmuls return bf16). Refused too: with LoRA/DoRA/
QLoRA adapters (their frozen base and low-rank matmuls are no plain linear layers), with
``quantization.qat`` (both replace the linear layers) and with tensor parallel (torchao's
float8 layers need their own TP plan). torchao recommends ``compile: true`` with it: without
compile, the casts and scales are separate kernels and FP8 is slower than bf16.

The conversion happens when the trained model is built
(:func:`~tunesmith.training.setup.build_policy`), before
:func:`~tunesmith.training.parallelize.parallelize`: checkpointing then wraps layers whose
linears are float8 already, compile traces the float8 casts into the layers' kernels, and
FSDP2 shards the float8 layers' weights (the float8 all-gather hooks into that sharding).

Example::

    >>> settings = FP8Settings.from_config({"precision": {"matmuls": "fp8_rowwise"}})
    >>> settings.recipe
    'rowwise'
    >>> device_problem(torch.device("cpu"), "fp8_rowwise")
    'matmuls: fp8_rowwise needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); this run is on the CPU'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.training.precision import MATMULS, MIN_CAPABILITY, device_problem, machine_problem

__all__ = [
    "FP8_MATMULS",
    "MIN_CAPABILITY",
    "FP8Settings",
    "apply_fp8",
    "check_fp8",
    "device_problem",
    "fp8_layer",
    "fp8_layers",
    "machine_problem",
    "prepare",
]

FP8_MATMULS = MATMULS
"""The values of ``precision.matmuls`` that train with float8 matmuls."""
_ROUTERS = ("gate", "router")


@dataclass(frozen=True)
class FP8Settings:
    """``precision.matmuls`` read once: the torchao recipe (``rowwise`` or ``tensorwise``).

    >>> FP8Settings("tensorwise").matmuls
    'fp8_tensorwise'
    """

    recipe: str = "rowwise"

    def __post_init__(self) -> None:
        if self.matmuls not in FP8_MATMULS:
            raise ValueError(f"FP8 recipe must be rowwise or tensorwise, got {self.recipe!r}")

    @property
    def matmuls(self) -> str:
        """The ``precision.matmuls`` value of these settings."""
        return f"fp8_{self.recipe}"

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> FP8Settings | None:
        """The FP8 settings of ``cfg.precision.matmuls``; None when it asks for none.

        >>> FP8Settings.from_config({"precision": {"weights": "bf16"}}) is None
        True
        """
        matmuls = (cfg.get("precision") or {}).get("matmuls")
        return None if matmuls is None else cls(str(matmuls).removeprefix("fp8_"))


def check_fp8(cfg: Mapping[str, Any], model: nn.Module, device: torch.device) -> None:
    """Refuse what float8 matmuls cannot run with (see the module docs), each as a
    :class:`~tunesmith.config.ConfigError` naming the key: the device, fp32 compute, adapters,
    QAT, tensor parallel.

    >>> check_fp8({"precision": {"matmuls": "fp8_rowwise"}}, nn.Linear(16, 16), torch.device("cpu"))
    Traceback (most recent call last):
    tunesmith.config.errors.ConfigError: precision: matmuls: fp8_rowwise needs a CUDA GPU ...
    """
    settings = FP8Settings.from_config(cfg)
    if settings is None:
        return
    problem = device_problem(device, settings.matmuls)
    if problem is not None:
        raise ConfigError.from_issues([ConfigIssue("precision", problem)])
    issues = [ConfigIssue(key, words) for key, words in _combination_problems(cfg, model)]
    if issues:
        raise ConfigError.from_issues(issues)


def _combination_problems(cfg: Mapping[str, Any], model: nn.Module) -> list[tuple[str, str]]:
    from tunesmith.modules.peft import adapter_modules

    matmuls = cfg["precision"]["matmuls"]
    problems = []
    if cfg["precision"].get("weights") != "bf16" and cfg.get("mixed_precision") != "bf16":
        problems.append(
            ("precision.matmuls", f"{matmuls} needs bf16 compute: set precision.weights: bf16 "
             "(with master_weights: fp32) or mixed_precision: bf16")
        )  # fmt: skip
    if adapter_modules(model):
        problems.append(
            ("precision.matmuls", f"{matmuls} trains full weights; it does not combine with "
             "LoRA/DoRA/QLoRA adapters (set precision.matmuls: null)")
        )  # fmt: skip
    if cfg.get("quantization"):
        problems.append(("quantization", f"QAT with precision.matmuls: {matmuls}: both "
                         "replace the linear layers; use one of them"))  # fmt: skip
    if ((cfg.get("parallelism") or {}).get("tp") or 1) > 1:
        problems.append(("parallelism.tp", f"tensor parallel with precision.matmuls: "
                         f"{matmuls} is not supported; set tp: 1"))  # fmt: skip
    return problems


def fp8_layer(module: nn.Module, name: str) -> bool:
    """Whether the layer ``name`` trains with float8 matmuls: a plain ``nn.Linear`` with
    input and output sizes divisible by 16, not ``lm_head``, not a router (``gate``,
    ``router``).

    >>> fp8_layer(nn.Linear(64, 32), "model.layers.0.mlp.gate_proj")
    True
    >>> router = "model.layers.0.mlp.gate"
    >>> fp8_layer(nn.Linear(64, 32), "lm_head"), fp8_layer(nn.Linear(64, 32), router)
    (False, False)
    >>> fp8_layer(nn.Linear(64, 24), "model.layers.0.self_attn.k_proj")
    False
    """
    leaf = name.rsplit(".", 1)[-1]
    return (
        type(module) is nn.Linear
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
        and leaf != "lm_head"
        and leaf not in _ROUTERS
    )


def fp8_layers(model: nn.Module) -> list[str]:
    """The names of ``model``'s layers that :func:`fp8_layer` picks (or that are float8
    already).

    >>> fp8_layers(nn.ModuleDict({"up": nn.Linear(32, 64), "lm_head": nn.Linear(64, 32)}))
    ['up']
    """
    from torchao.float8.float8_linear import Float8Linear

    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, Float8Linear) or fp8_layer(module, name)
    ]


def apply_fp8(model: nn.Module, settings: FP8Settings, *, fsdp: bool = False) -> nn.Module:
    """``model`` with the layers of :func:`fp8_layers` swapped for torchao's ``Float8Linear``
    (in place; returned), on any device: no device check (that is :func:`prepare`'s; the float8
    maths run on the CPU too, slowly, which the tests use). ``fsdp``: the parameters will be
    sharded by FSDP2, so tensorwise weights are all-gathered in float8.

    >>> model = apply_fp8(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)), FP8Settings())
    >>> [type(m).__name__ for m in model]
    ['Float8Linear', 'Linear']
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(settings.recipe)
    if fsdp and settings.recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_layer)
    return model


def prepare(
    model: nn.Module, cfg: Mapping[str, Any], device: torch.device, *, fsdp: bool = False
) -> nn.Module:
    """``model`` converted as ``cfg.precision.matmuls`` asks (:func:`apply_fp8`), after
    :func:`check_fp8`; as it is when the key asks for no float8 matmuls.

    >>> model = nn.Linear(16, 16)
    >>> prepare(model, {"precision": {"weights": "bf16"}}, torch.device("cpu")) is model
    True
    """
    settings = FP8Settings.from_config(cfg)
    if settings is None:
        return model
    check_fp8(cfg, model, device)
    return apply_fp8(model, settings, fsdp=fsdp)
