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

import gc
import os
import re
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.modules.peft.nf4 import is_nf4
from tunesmith.training.loop_config import LOOP_RULES

__all__ = [
    "DistributedContext",
    "PeerFailureError",
    "all_reduce_sum",
    "close_distributed",
    "full_tensor",
    "init_distributed",
    "peer_failure",
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
    timeout_s: float | None = None  # the bound on collectives (None: the backend's default)

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


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> DistributedContext:
    """Join (or create) the process group and build a 1-D device mesh over every rank.

    ``device`` is ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``. ``timeout_s``
    bounds every collective: a rank whose peer died or hangs raises an error after that long
    instead of waiting (None: the backend's default, 30 min for gloo, 10 min for NCCL).
    """
    problem = LOOP_RULES["distributed_timeout_s"].problem(timeout_s)  # the config key's rule
    if problem is not None:
        raise ConfigError.from_issues([ConfigIssue("distributed_timeout_s", problem)])
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = _pick_device(device, local_rank)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if launched:
            dist.init_process_group(backend, **timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, **timeout
            )
    mesh = init_device_mesh(dev.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        mesh=mesh,
        timeout_s=None if timeout_s is None else float(timeout_s),
    )


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died, hangs or cannot be reached."""


# What gloo and NCCL say when a peer is gone or silent (their errors are plain RuntimeErrors).
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "Watchdog caught collective operation timeout",
    "NCCL communicator was aborted",
)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*")  # gloo's "[.../pair.cc:553] "


def peer_failure(error: BaseException, ctx: DistributedContext) -> PeerFailureError | None:
    """A clear :class:`PeerFailureError` for ``error`` if it is a failed collective in a run
    of several ranks (another rank died or hangs), else None.

    Example::

        >>> err = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. ...")
        >>> str(peer_failure(err, ctx))  # doctest: +SKIP
        'rank 0 of 2: a collective operation failed (Connection closed by peer ...); ...'
    """
    text = str(error).strip()
    if ctx.world_size == 1 or not (
        isinstance(error, dist.DistError) or any(m in text for m in _PEER_FAILURE_MARKERS)
    ):
        return None
    detail = _SOURCE_PREFIX.sub("", text.splitlines()[0] if text else type(error).__name__)
    detail = detail.split(". ")[0].rstrip(".")
    bound = f"{ctx.timeout_s:g} s" if ctx.timeout_s is not None else "the backend's default"
    return PeerFailureError(
        f"rank {ctx.rank} of {ctx.world_size}: a collective operation with the other ranks "
        f"failed ({detail}); another rank has probably died or hangs, see its log "
        f"(collectives wait at most distributed_timeout_s: {bound})"
    )


def close_distributed() -> None:
    """Destroy the process group if one exists. Garbage is collected first: collectives whose
    results were dropped unread still hold the group, and freeing them after it is gone (at
    interpreter exit) can abort the process ("terminate called without an active exception",
    seen with gloo on torch 2.13 after FSDP2 gathers)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole value of ``tensor`` (a DTensor is gathered from every rank), the gather
    finished: ``DTensor.full_tensor()`` may hand back a tensor whose gather is still pending,
    and a rank that never reads it (only rank 0 writes a checkpoint) leaves gloo work behind
    that can abort the process at exit.

    >>> full_tensor(torch.ones(2))  # a plain tensor is returned as it is
    tensor([1., 1.])
    """
    if not hasattr(tensor, "full_tensor"):
        return tensor
    full = tensor.full_tensor()
    if isinstance(full, AsyncCollectiveTensor):
        full = full.wait()
    return full


def all_reduce_sum(value: torch.Tensor | float | int, device: torch.device) -> torch.Tensor:
    """Sum of ``value`` over all ranks (a float64 tensor on ``device``)."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def shard_model(
    model: nn.Module, ctx: DistributedContext, *, cpu_offload: bool = False
) -> nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root; a no-op on a world of one.

    Parameters become DTensors sharded on dim 0 over ``ctx.mesh``; gradients are averaged
    over ranks (the recipe scales its loss by the world size to get a global token mean).
    With ``cpu_offload`` (a CUDA device; e.g. a frozen DPO reference or KD teacher) the
    shards live in pinned CPU memory and each layer is copied to the GPU for its forward,
    on any world size; on a CPU device there is nothing to offload to: a warning, no-op.
    """
    offload = cpu_offload and ctx.device.type == "cuda"
    if cpu_offload and not offload:
        warnings.warn(
            f"cpu_offload needs a CUDA device; on {ctx.device} the model stays where it is",
            stacklevel=2,
        )
    if ctx.world_size == 1 and not offload:
        return model
    check_nf4_shardable(model, ctx.world_size)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=ctx.mesh, **policy)
    fully_shard(model, mesh=ctx.mesh, **policy)
    return model


def check_nf4_shardable(model: nn.Module, world_size: int) -> None:
    """FSDP2 splits each NF4 (QLoRA) weight's quantisation groups evenly over the ranks:
    refuse, naming the weight, a model where a weight's groups do not divide by
    ``world_size`` (torchao's own error names no weight)."""
    for name, param in model.named_parameters():
        if not is_nf4(param.data if isinstance(param, nn.Parameter) else param):
            continue
        weight = param.data
        groups = weight.numel() // (weight.block_size * weight.scaler_block_size)
        if groups % world_size or weight.shape[0] % world_size:
            raise ValueError(
                f"{name}: the NF4 weight {list(weight.shape)} has {groups} quantisation groups of "
                f"{weight.block_size}x{weight.scaler_block_size} values, which FSDP2 cannot "
                f"split over {world_size} ranks; use a world size dividing {groups} and "
                f"{weight.shape[0]}, or do not quantise this module"
            )
