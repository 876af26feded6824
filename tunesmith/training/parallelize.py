"""One ``parallelize(model, ctx, cfg)`` for every recipe: the model's parallel plan, applied in
one fixed order.

1. **tensor / sequence parallel** over the mesh's ``tp`` dimension
   (:func:`~tunesmith.training.parallel.tensor_parallel.apply_tensor_parallel`; the model's head
   counts are checked against the sizes first: :func:`check_model_fits`), frozen models too, so a
   reference or teacher is laid out like the policy;
1b. **expert parallel** over ``ctx.expert_mesh`` (``ep`` > 1): each MoE layer's experts split
   over the ``ep`` ranks, tokens dispatched by all-to-all
   (:func:`~tunesmith.training.parallel.expert_parallel.apply_expert_parallel`), frozen models too;
   FSDP2 then shards only the other parameters;
1c. **context parallel** (``cp`` > 1): each decoder gets the ring's group
   (:func:`~tunesmith.training.parallel.context_parallel.install_context_parallel`; the Trainer
   splits the rows), frozen models too;
2. **activation checkpointing** (``cfg.activation_checkpointing``), trained models only;
3. **compile** of each decoder layer (``cfg.compile``), trained models only;
4. **FSDP2** over ``ctx.fsdp_mesh`` (:func:`~tunesmith.training.parallel.distributed.shard_model`):
   HSDP on the 2-D ``(dp_replicate, dp_shard)`` mesh, plain FSDP2 on ``dp_shard``; a frozen
   model (DPO reference, KD teacher) may keep its shards in CPU memory (``cpu_offload``).

The order matters: TP rewrites the layers' parameters into DTensors that FSDP2 then shards on
the remaining dimensions, checkpointing wraps the (parallel) layer's forward, compile traces
the checkpointed forward, and FSDP2's hooks go outermost.

Example::

    model = parallelize(instantiate(cfg.model).to(ctx.device), ctx, cfg)
    teacher = parallelize(teacher, ctx, frozen=True, cpu_offload=True)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.memory.compile import compile_model, compile_options
from tunesmith.training.parallel.context_parallel import install_context_parallel
from tunesmith.training.parallel.distributed import DistributedContext, ParallelDims, shard_model
from tunesmith.training.parallel.expert_parallel import apply_expert_parallel
from tunesmith.training.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["check_backend_plans", "check_model_fits", "parallelize"]


def parallelize(
    model: nn.Module,
    ctx: DistributedContext,
    cfg: Mapping[str, Any] | None = None,
    *,
    frozen: bool = False,
    cpu_offload: bool = False,
) -> nn.Module:
    """``model`` with the plan of the module docs applied, as ``cfg``'s
    ``activation_checkpointing`` and ``compile`` keys say (``frozen``: neither, a model that
    is never trained); returns the (sharded) model.

    Example::

        model = parallelize(model, ctx, {"activation_checkpointing": {"mode": "full"}})
    """
    cfg = cfg or {}
    if ctx.dims is not None:  # 1. tensor / sequence parallel: the sizes must fit
        check_model_fits(getattr(model, "spec", None), ctx.dims)
        check_backend_plans(getattr(model, "spec", None), ctx.dims)
    if ctx.tp_mesh is not None:
        apply_tensor_parallel(model, ctx.tp_mesh, sequence_parallel=ctx.dims.sequence_parallel)
    if ctx.expert_mesh is not None:  # 1b. expert parallel
        apply_expert_parallel(model, ctx.expert_mesh)
    if ctx.cp_size > 1:  # 1c. context parallel: the decoders attend over the cp ring
        install_context_parallel(model, ctx.cp_group)
    if not frozen and cfg.get("activation_checkpointing"):  # 2.
        apply_activation_checkpointing(model, **cfg["activation_checkpointing"])
    compiling = None if frozen else compile_options(cfg.get("compile"))
    if compiling is not None and compiling.layers:  # 3. each layer, in place: names unchanged
        compile_model(
            model,
            backend=compiling.backend,
            mode=compiling.mode,
            fullgraph=compiling.fullgraph,
            dynamic=compiling.dynamic,
        )
    return shard_model(model, ctx, cpu_offload=cpu_offload)  # 4.


def check_model_fits(spec: Any, dims: ParallelDims) -> None:
    """Refuse (:class:`~tunesmith.config.ConfigError`, the numbers named) a model whose
    attention heads or kv heads do not divide by ``tp`` or whose experts do not divide by
    ``ep``; call it on the spec before loading weights. A model without a spec passes.

    >>> from tunesmith.models import qwen3
    >>> from tunesmith.training.parallel.distributed import ParallelDims
    >>> check_model_fits(qwen3.spec("qwen3_0_6b"), ParallelDims(tp=2))  # fits
    >>> check_model_fits(qwen3.spec("qwen3_0_6b"), ParallelDims(tp=3))
    Traceback (most recent call last):
    tunesmith.config.errors.ConfigError: parallelism: tp 3 does not divide num_attention_heads ...
    parallelism: tp 3 does not divide num_key_value_heads 8 of the model
    """
    if spec is None:
        return
    needs = [("tp", dims.tp, "num_attention_heads"), ("tp", dims.tp, "num_key_value_heads"),
             ("ep", dims.ep, "num_experts")]  # fmt: skip
    issues = [
        ConfigIssue(
            "parallelism",
            f"{dim} {size} does not divide {field} {getattr(spec, field)} of the model",
        )
        for dim, size, field in needs
        if size > 1 and getattr(spec, field, 0) and getattr(spec, field) % size
    ]
    if issues:
        raise ConfigError.from_issues(issues)


def check_backend_plans(spec: Any, dims: ParallelDims) -> None:
    """Refuse the parallel layouts a model of the transformers backend has no plan for
    (context and expert parallel: its attention and experts are transformers' own; sequence
    parallel: its norms are), naming the backend and the model type, before anything is
    changed.

    >>> from tunesmith.models.transformers_backend import TransformersSpec
    >>> from tunesmith.training.parallel.distributed import ParallelDims
    >>> check_backend_plans(TransformersSpec({"model_type": "starcoder2"}), ParallelDims(cp=2))
    Traceback (most recent call last):
    tunesmith.config.errors.ConfigError: parallelism: cp 2: starcoder2 runs on the transformers ...
    """
    if getattr(spec, "backend", "native") != "transformers":
        return
    issues = [
        ConfigIssue(
            "parallelism",
            f"{dim} {size}: {spec.model_type} runs on the transformers backend, which has no "
            f"{what} (only native families do); set {dim}: 1",
        )
        for dim, size, what in (
            ("cp", dims.cp, "context parallel"),
            ("ep", dims.ep, "expert parallel"),
        )
        if size > 1
    ]
    if dims.tp > 1 and dims.sequence_parallel:
        issues.append(
            ConfigIssue(
                "parallelism.sequence_parallel",
                f"{spec.model_type} runs on the transformers backend, whose tensor parallel "
                "(transformers' own plan) has no sequence parallel; set "
                "parallelism.sequence_parallel: false",
            )
        )
    if issues:
        raise ConfigError.from_issues(issues)
