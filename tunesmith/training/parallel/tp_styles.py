"""The tensor-parallel styles of the residual stream, shared by the plan
(:mod:`~tunesmith.training.parallel.tensor_parallel`) and the LoRA/DoRA styles built on them
(:mod:`~tunesmith.training.parallel.tp_adapters`): the stream's layout (:class:`Stream`: sharded on
the sequence under SP, else replicated), its norms, the gathered blocks and the row-wise layers that
reduce into it.

Example::

    stream = Stream(sequence_parallel=True)
    parallelize_module(layer, mesh, {"input_layernorm": StreamNorm(stream),
                                     "self_attn.o_proj": RowwiseToStream(stream)})
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = [
    "Gathered",
    "HeadNorm",
    "ProjectionNorm",
    "Replicated",
    "RowwiseToStream",
    "Stream",
    "StreamNorm",
    "replicate_params",
]


class Stream:
    """How the residual stream is laid out in the current forward: sharded on the sequence
    (``active``, SP) or replicated (no SP, or a forward with a KV cache)."""

    def __init__(self, sequence_parallel: bool) -> None:
        self.sequence_parallel = sequence_parallel
        self.active = sequence_parallel

    @property
    def placement(self) -> Shard | Replicate:
        return Shard(1) if self.active else Replicate()


def replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param.data, mesh, [Replicate()])
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class StreamNorm(ParallelStyle):
    """An RMSNorm on the residual stream: replicated weight, input/output laid out as the
    stream (its weight gradient is summed over the sequence shards). With ``local_output``
    the output is this rank's plain tensor, for a norm whose output is added to the stream
    (Gemma's post-attention and post-MLP norms), not fed to a block."""

    def __init__(self, stream: Stream, *, local_output: bool = False) -> None:
        self.stream = stream
        self.local_output = local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_stream(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
            x = DTensor.from_local(inputs[0], mesh, (self.stream.placement,), run_check=False)
            return (x, *inputs[1:])

        def to_local(mod: nn.Module, out: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return out.to_local()

        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: replicate_params(mod, mesh),
            to_stream,
            to_local if self.local_output else None,
        )


class HeadNorm(ParallelStyle):
    """A per-head norm (qk-norm) on this rank's heads ``[b, s, heads, d]``: replicated weight
    whose gradient is summed over the ranks' heads."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_heads(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
            return (DTensor.from_local(inputs[0], mesh, (Shard(2),), run_check=False),)

        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: replicate_params(mod, mesh),
            shard_heads,
            lambda mod, out, mesh: out.to_local(),
        )


class ProjectionNorm(ParallelStyle):
    """A norm over a whole column-sharded projection ``[b, s, heads * d]`` (OLMo's qk-norm):
    its weight sharded like the projection's columns, the mean of squares taken over every
    rank's columns (DTensor all-reduces it), the output this rank's columns again."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def shard_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dist = distribute_tensor(param.data, mesh, [Shard(0)])
                mod.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

        def shard_columns(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
            return (DTensor.from_local(inputs[0], mesh, (Shard(inputs[0].dim() - 1),),
                                       run_check=False),)  # fmt: skip

        return distribute_module(
            module, device_mesh, shard_params, shard_columns, lambda mod, out, mesh: out.to_local()
        )


class Replicated(ParallelStyle):
    """A module on a replicated (gathered) input ``DTensor``, e.g. multi-head latent
    attention's latent projections and norms: its parameters replicated, their gradients summed
    from every rank's part of the backward by DTensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, lambda name, mod, mesh: replicate_params(mod, mesh)
        )


class Gathered(ParallelStyle):
    """A block (attention, MLP, MoE) whose first input is gathered to the whole sequence; with
    ``local`` the block sees plain tensors (MoE: replicated experts) and its first output is
    cut back to the stream's layout."""

    def __init__(self, stream: Stream, *, local: bool = False) -> None:
        self.stream, self.local = stream, local

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple:
            x = inputs[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (self.stream.placement,), run_check=False)
            x = x.redistribute(placements=(Replicate(),))
            return (x.to_local() if self.local else x, *inputs[1:])

        def scatter(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
            first, rest = (
                (outputs[0], outputs[1:]) if isinstance(outputs, tuple) else (outputs, None)
            )
            if self.stream.active:
                first = DTensor.from_local(first, mesh, (Replicate(),), run_check=False)
                first = first.redistribute(placements=(Shard(1),)).to_local()
            return first if rest is None else (first, *rest)

        # hooks only: the parameters are left to their own styles (MoE's stay plain)
        module.register_forward_pre_hook(lambda mod, inputs: gather(mod, inputs, device_mesh))
        if self.local:
            module.register_forward_hook(lambda mod, i, out: scatter(mod, out, device_mesh))
        return module


class RowwiseToStream(RowwiseParallel):
    """Row-wise linear (or vocabulary-sharded embedding) whose reduced output takes the
    stream's layout: reduce-scattered on the sequence under SP, else all-reduced."""

    def __init__(self, stream: Stream) -> None:
        super().__init__()
        self.stream = stream

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        embedding = isinstance(module, nn.Embedding)
        partition = self._partition_embedding_fn if embedding else self._partition_linear_fn
        self.desired_input_layouts = (Replicate(),) if embedding else (Shard(-1),)
        input_layouts = (Replicate(),) if embedding else (Shard(-1),)

        def to_stream(mod: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return outputs.redistribute(placements=(self.stream.placement,)).to_local()

        return distribute_module(
            module,
            device_mesh,
            partition,
            partial(self._prepare_input_fn, input_layouts, self.desired_input_layouts),
            to_stream,
        )
