"""One process or many, the same code: a process group and a device mesh of any size.

A single process gets a gloo group of size 1 (an in-memory store, no ports), so recipes call
``all_reduce``/``barrier``/distributed checkpointing the same way on one CPU and on 64 GPUs.
Under torchrun each rank joins the launcher's group (NCCL on GPUs, gloo on CPUs).

Example::

    >>> ctx = init_distributed("cpu")
    >>> ctx.world_size, ctx.is_rank_zero
    (1, True)
    >>> close_distributed()
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = [
    "DistributedContext",
    "all_reduce_sum",
    "close_distributed",
    "init_distributed",
    "shard_model",
]


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: its rank, the world, its device and the mesh over all ranks."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(device: str = "auto") -> DistributedContext:
    """Join (or create) the process group and build a 1-D device mesh over every rank.

    ``device`` is ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``.
    """
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = _pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        mesh=mesh,
    )


def close_distributed() -> None:
    """Destroy the process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(value: torch.Tensor | float | int, device: torch.device) -> torch.Tensor:
    """Sum of ``value`` over all ranks (a float64 tensor on ``device``)."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def shard_model(model: nn.Module, ctx: DistributedContext) -> nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root; a no-op on a world of one.

    Parameters become DTensors sharded on dim 0 over ``ctx.mesh``; gradients are averaged
    over ranks (the recipe scales its loss by the world size to get a global token mean).
    """
    if ctx.world_size == 1:
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model
