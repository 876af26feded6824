"""Tensor-parallel styles for LoRA/DoRA layers: each adapter follows its base layer's sharding.

:func:`~tunesmith.training.parallel.tensor_parallel.apply_tensor_parallel` picks these styles for
the layers :func:`~tunesmith.modules.peft.apply_lora` adapted (it runs before ``parallelize``), so
every number is the one-device number:

* **column-wise** base (``q/k/v/gate/up_proj``, ``W`` ``Shard(0)``): ``lora_A`` replicated,
  ``lora_B`` and the bias ``Shard(0)`` (output features), DoRA's magnitude ``Shard(0)``. Each
  rank computes its slice of the output; DoRA's per-output-row norm of ``W + s B A`` is taken
  over whole local rows (no communication);
* **row-wise** base (``o/down_proj``, ``W`` ``Shard(1)``): ``lora_A`` ``Shard(1)`` (input
  features), ``lora_B``, the bias and DoRA's magnitude replicated. ``A`` on this rank's input
  slice gives a partial sum that ``B`` keeps partial; it is added to the base's partial sum and
  the sum takes the one reduction of the layer (reduce-scatter to the sequence-sharded stream,
  or all-reduce). DoRA's norm sums over the sharded input features: the per-rank partial norms
  are combined over the ranks (an all-reduce of ``[out]`` values), so it is exact too.
* **dropout** on the adapters' input (``dropout > 0``): every rank draws the mask of the whole
  (one-device) input from its own generator and keeps its part of it (all of it column-wise,
  its input features row-wise). The ranks of a TP group are seeded alike and draw alike, so
  their masks agree and, as long as the forward's shapes are the one-device shapes, the masks
  *are* the one-device masks (exactly so on CPU). Under sequence parallel a sequence that
  ``tp`` does not divide is padded for the forward: its masks are then other (equally random)
  masks than one device would draw.

QLoRA (an NF4 base) cannot be split:
:func:`~tunesmith.training.parallel.tensor_parallel.check_tp_shardable` refuses it by name before
any sharding.

Example::

    parallelize_module(layer, mesh, {"q_proj": AdapterColwise()})
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ColwiseParallel

from tunesmith.modules.peft.lora import LoRALinear
from tunesmith.training.parallel.tp_styles import RowwiseToStream

__all__ = [
    "COLWISE_ADAPTER",
    "ROWWISE_ADAPTER",
    "AdapterColwise",
    "AdapterRowwiseToStream",
    "FullMaskDropout",
    "shard_adapter_layer",
]

COLWISE_ADAPTER: Mapping[str, Placement] = {
    "weight": Shard(0),
    "bias": Shard(0),
    "lora_A.weight": Replicate(),
    "lora_B.weight": Shard(0),
    "lora_magnitude_vector": Shard(0),
}
"""Placement of each parameter of a column-wise adapted layer (by its local name)."""

ROWWISE_ADAPTER: Mapping[str, Placement] = {
    "weight": Shard(1),
    "bias": Replicate(),
    "lora_A.weight": Shard(1),
    "lora_B.weight": Replicate(),
    "lora_magnitude_vector": Replicate(),
}
"""Placement of each parameter of a row-wise adapted layer (by its local name)."""


class FullMaskDropout(nn.Dropout):
    """Dropout on a DTensor that draws the whole tensor's mask on every rank and keeps this
    rank's part of it (a plain tensor gets ``nn.Dropout``'s own): ranks with the same
    generator state agree, and the mask is the one a single device draws for that shape.

    Example::

        layer.lora_dropout = FullMaskDropout(layer.dropout)
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, DTensor) or not self.training or self.p == 0:
            return super().forward(x)
        ones = torch.ones(x.shape, dtype=x.dtype, device=x.to_local().device)
        mask = F.dropout(ones, self.p, training=True)  # 0 or 1 / (1 - p), as dropout scales
        whole = (Replicate(),) * x.device_mesh.ndim
        mask = DTensor.from_local(mask, x.device_mesh, whole, run_check=False)
        return x * mask.redistribute(placements=x.placements)  # Replicate -> Shard: a slice


def shard_adapter_layer(
    layer: LoRALinear, mesh: DeviceMesh, placements: Mapping[str, Placement]
) -> None:
    """Make every parameter of ``layer`` (base weight and bias, ``lora_A``, ``lora_B``, DoRA's
    magnitude) a DTensor on ``mesh`` with its placement in ``placements``
    (:data:`COLWISE_ADAPTER` or :data:`ROWWISE_ADAPTER`), and its dropout a
    :class:`FullMaskDropout`; in place.

    Example::

        shard_adapter_layer(model.model.layers[0].self_attn.q_proj, mesh, COLWISE_ADAPTER)
    """
    if not isinstance(layer, LoRALinear):
        raise TypeError(f"shard_adapter_layer takes a LoRA/DoRA layer, got {type(layer).__name__}")
    if layer.is_quantized:
        raise ValueError(f"{layer!r}: an NF4 (QLoRA) base weight cannot be tensor-parallel sharded")
    for name, param in list(layer.named_parameters()):
        if name not in placements:
            raise ValueError(f"no tensor-parallel placement for adapter parameter '{name}'")
        owner_name, _, local = name.rpartition(".")
        owner = layer.get_submodule(owner_name)
        dist = distribute_tensor(param.data, mesh, [placements[name]])
        owner.register_parameter(local, nn.Parameter(dist, requires_grad=param.requires_grad))
    if isinstance(layer.lora_dropout, nn.Dropout):
        dropout = FullMaskDropout(layer.lora_dropout.p)
        layer.lora_dropout = dropout.train(layer.lora_dropout.training)


class AdapterColwise(ColwiseParallel):
    """``ColwiseParallel`` for a LoRA/DoRA layer (:data:`COLWISE_ADAPTER`); same arguments,
    same input and output layouts. Any other module is left to ``ColwiseParallel``.

    Example::

        parallelize_module(attn, mesh, {"q_proj": AdapterColwise()})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, LoRALinear):
            return super()._apply(module, device_mesh)
        shard_adapter_layer(module, device_mesh, COLWISE_ADAPTER)
        layouts = (self.input_layouts, self.desired_input_layouts)
        return distribute_module(
            module,
            device_mesh,
            None,  # the parameters are all DTensors now
            partial(self._prepare_input_fn, *layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class AdapterRowwiseToStream(RowwiseToStream):
    """The row-wise layer of the residual stream (``RowwiseToStream``: its reduced output
    takes the stream's layout) for a LoRA/DoRA layer (:data:`ROWWISE_ADAPTER`): the adapter's
    partial sum joins the base's before the one reduction.

    Example::

        parallelize_module(attn, mesh, {"o_proj": AdapterRowwiseToStream(stream)})
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, LoRALinear):
            shard_adapter_layer(module, device_mesh, ROWWISE_ADAPTER)
        return super()._apply(module, device_mesh)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if isinstance(module, LoRALinear) or name:  # sharded above; lora_A/lora_B with it
            return
        super()._partition_linear_fn(name, module, device_mesh)
