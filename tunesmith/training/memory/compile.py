"""``torch.compile`` for training: each decoder layer on its own, and the loss.

Compiling layer by layer (instead of the whole model) keeps compile time to one graph per
distinct layer, works with activation checkpointing (the checkpointed forward is traced)
and leaves the module tree alone: :meth:`torch.nn.Module.compile` compiles a module's call in
place, so parameter names stay the Hugging Face ones (no ``_orig_mod.`` prefix) and
``state_dict``, checkpoints and FSDP2 see the same model.

The first calls are slow (tracing and code generation, about a minute on a small CPU for a
fresh cache; inductor caches the result on disk); a new input shape may compile again (with
``dynamic=None``, a second shape makes torch compile a shape-generic graph).

Example::

    >>> from tunesmith.models import llama3
    >>> from tunesmith.modules.losses import CrossEntropyLoss
    >>> model = llama3.llama3_tiny()
    >>> compile_model(model, backend="eager")      # 2 layers, compiled on first call
    2
    >>> loss_fn = compile_loss(CrossEntropyLoss(), backend="eager")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import nn

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.modules.decoder import decoder_layers
from tunesmith.modules.losses import LinearCrossEntropyLoss

__all__ = ["CompileOptions", "compile_loss", "compile_model", "compile_options", "is_compiled"]


@dataclass(frozen=True)
class CompileOptions:
    """What to compile, and how (``backend``, ``mode``, ``fullgraph``, ``dynamic`` are
    :func:`torch.compile`'s arguments)."""

    layers: bool = True
    loss: bool = True
    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None


def compile_options(
    value: bool | Mapping[str, Any] | None, key: str = "compile"
) -> CompileOptions | None:
    """The recipe key ``compile``: ``false``/null (None: compile nothing), ``true`` (layers
    and loss, inductor) or a mapping of :class:`CompileOptions` fields.

    Raises:
        ConfigError: a value of another type or an unknown field, naming ``key.<field>``.

    Example::

        >>> compile_options({"loss": False, "mode": "max-autotune"}).layers
        True
    """
    if value is None or value is False:
        return None
    if value is True:
        return CompileOptions()
    if not isinstance(value, Mapping):
        raise ConfigError.from_issues(
            [ConfigIssue(key, f"must be true, false or a mapping, got {value!r}")]
        )
    known = {f.name for f in fields(CompileOptions)}
    unknown = [name for name in value if name not in known]
    if unknown:
        raise ConfigError.from_issues(
            [
                ConfigIssue(f"{key}.{name}", f"unknown option; known: {sorted(known)}")
                for name in unknown
            ]
        )
    options = CompileOptions(**dict(value))
    if not (options.layers or options.loss):
        return None
    return options


def is_compiled(module: nn.Module) -> bool:
    """Whether :meth:`~torch.nn.Module.compile` has been called on ``module``."""
    return getattr(module, "_compiled_call_impl", None) is not None


def compile_model(
    model: nn.Module,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    fullgraph: bool = False,
    dynamic: bool | None = None,
    layer_type: type[nn.Module] | None = None,
) -> int:
    """Compile every ``layer_type`` module of ``model`` in place (``module.compile``);
    return how many. Apply it after activation checkpointing.

    Raises:
        ValueError: ``model`` has no ``layer_type`` module, or its layers are compiled
            already.
    """
    layers = (
        decoder_layers(model)
        if layer_type is None
        else [module for module in model.modules() if isinstance(module, layer_type)]
    )
    if not layers:
        raise ValueError(
            f"compile_model found no {'decoder layer' if layer_type is None else layer_type.__name__} in {type(model).__name__}"
        )
    if any(is_compiled(layer) for layer in layers):
        raise ValueError("compile_model: the layers of this model are compiled already")
    for layer in layers:
        layer.compile(backend=backend, mode=mode, fullgraph=fullgraph, dynamic=dynamic)
    return len(layers)


def compile_loss(
    loss_fn: nn.Module,
    *,
    backend: str = "inductor",
    mode: str | None = None,
    dynamic: bool | None = None,
) -> nn.Module:
    """``loss_fn`` compiled in place and returned; a
    :class:`~tunesmith.modules.losses.LinearCrossEntropyLoss` is returned as it is.

    Linear cross-entropy turns each chunk's logits into their gradient in place in one reused
    block; inductor's kernels for that step write two more chunks of logits and run no faster,
    the matmuls dominating it (``benchmarks/results/linear_ce_compile.md``: 293 vs 168 MiB,
    1.05x the time, at 2048 rows x vocab 32000 on a CPU). ``LinearCrossEntropyLoss(compile=True)``
    still compiles it where that pays.
    """
    if isinstance(loss_fn, LinearCrossEntropyLoss):
        return loss_fn
    if not isinstance(loss_fn, nn.Module):
        raise TypeError(f"compile_loss expects a loss module, got {type(loss_fn).__name__}")
    if not is_compiled(loss_fn):
        loss_fn.compile(backend=backend, mode=mode, dynamic=dynamic)
    return loss_fn
