"""One process or many, the same code: a process group and a device mesh of any size.

A single process gets a gloo group of size 1 (an in-memory store, no ports), so recipes call
``all_reduce``/``barrier``/distributed checkpointing the same way on one CPU and on 64 GPUs.
Under torchrun each rank joins the launcher's group (NCCL on GPUs, gloo on CPUs).

**The mesh.** ``parallelism: {dp_replicate, dp_shard, tp, cp, ep}`` (:class:`ParallelDims`)
gives the world one named n-D :class:`~torch.distributed.device_mesh.DeviceMesh`, its
dimensions in the order ``("dp_replicate", "dp_shard", "cp", "tp")`` (outermost first: ``tp``
neighbours are adjacent ranks). ``dp_shard`` is always a dimension (of size 1 on one process);
``dp_replicate``, ``cp`` and ``tp`` only when larger than 1, so the default mesh is 1-D over
every rank (the mesh FSDP2 has always used). ``ep`` is no factor of the world: it splits each
``dp_shard`` group into groups of ``ep`` neighbouring ``dp_shard`` ranks (one ``tp`` coordinate)
that share their experts (``ctx.expert_mesh``, :mod:`~tunesmith.training.parallel.expert_parallel`).
``tp`` > 1 shards each layer over the ``tp`` ranks
(:mod:`~tunesmith.training.parallel.tensor_parallel`; ``sequence_parallel``, on by default, also
shards the residual stream on the sequence). ``cp`` > 1 splits every row over the ``cp`` ranks
(:mod:`~tunesmith.training.parallel.context_parallel`: zigzag halves, ring attention); FSDP2 then
shards over ``dp_shard x cp`` flattened (``ctx.fsdp_mesh``).

**Data-parallel conventions** (every count, sampler and reduction asks the context, never
assumes world = data parallel):

- ``ctx.dp_rank`` / ``ctx.dp_size`` (``dp_replicate x dp_shard``): who gets which samples (the
  samplers, evaluation's split, DPO's reference precompute). ``tp`` and ``cp`` ranks of one
  ``dp_rank`` see the same samples.
- ``ctx.dp_cp_size`` / ``ctx.dp_cp_group`` (``dp x cp``): the ranks whose tokens together make
  the global batch: units, metrics and token counts are summed over it, and FSDP2 averages
  gradients over it, so a summed loss is scaled by ``dp_cp_size / units``.
- A group is ``None`` (the default group) when it spans the world.

Example::

    >>> ctx = init_distributed("cpu")
    >>> ctx.world_size, ctx.is_rank_zero, ctx.dp_size, ctx.mesh.mesh_dim_names
    (1, True, 1, ('dp_shard',))
    >>> close_distributed()
"""

from __future__ import annotations

import gc
import math
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tunesmith.config import ConfigError, ConfigIssue
from tunesmith.modules.decoder import decoder_layers
from tunesmith.modules.peft.nf4 import is_nf4
from tunesmith.training.settings import LOOP_RULES

__all__ = [
    "MESH_DIMS",
    "DistributedContext",
    "ParallelDims",
    "PeerFailureError",
    "all_reduce_sum",
    "close_distributed",
    "expert_mesh_of",
    "expert_rank_layout",
    "full_tensor",
    "init_distributed",
    "peer_failure",
    "shard_model",
]


MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimension names, outermost first."""
_LATER: dict[str, str] = {}  # dimensions refused until implemented (none now)


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the parallel dimensions; their product (``ep`` aside) is the world size.

    >>> dims = ParallelDims.resolve({"dp_replicate": 2, "dp_shard": "auto"}, world_size=4)
    >>> dims.dp_shard, dims.dp, dims.dp_rank(3), dims.mesh_shape()
    (2, 4, 3, ((2, 2), ('dp_replicate', 'dp_shard')))
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sequence_parallel: bool = True  # with tp > 1: the residual stream sharded on the sequence

    @classmethod
    def resolve(cls, section: Mapping[str, Any] | None, world_size: int) -> ParallelDims:
        """The ``parallelism`` config section on a world of ``world_size`` ranks (None or
        absent keys: defaults, ``dp_shard`` what is left of the world). Raises
        :class:`~tunesmith.config.ConfigError` naming the numbers for a product other than
        the world size, or a dimension not implemented yet."""
        problem = LOOP_RULES["parallelism"].problem(section)  # the config key's rule
        if problem is not None:
            raise ConfigError.from_issues([ConfigIssue("parallelism", problem)])
        sizes = dict(section or {})
        sequence_parallel = bool(sizes.pop("sequence_parallel", True))
        shard = sizes.pop("dp_shard", -1)
        rest = {k: int(sizes.get(k, 1)) for k in ("dp_replicate", "cp", "tp")}
        others = rest["dp_replicate"] * rest["cp"] * rest["tp"]
        named = " x ".join(f"{k} {v}" for k, v in rest.items())
        if shard in (-1, "auto"):
            if world_size % others:
                raise _refused(
                    f"{named} = {others} does not divide the world of {world_size} "
                    "rank(s), so dp_shard: auto has no size"
                )
            shard = world_size // others
        dims = cls(
            dp_shard=int(shard),
            ep=int(sizes.get("ep", 1)),
            sequence_parallel=sequence_parallel,
            **rest,
        )
        if dims.world_size != world_size:
            auto = ", or set dp_shard: auto" if world_size % others == 0 else ""
            raise _refused(
                f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x cp {dims.cp} x "
                f"tp {dims.tp} = {dims.world_size} rank(s), but the world has {world_size}: "
                f"make the product {world_size}{auto}"
            )
        if dims.ep > 1 and dims.dp_shard % dims.ep:
            raise _refused(
                f"ep {dims.ep} does not divide dp_shard {dims.dp_shard}: the experts "
                "are split over data-parallel shard ranks; use an ep dividing "
                f"{dims.dp_shard}"
            )
        for name, later in _LATER.items():
            if getattr(dims, name) > 1:
                raise _refused(
                    f"{name} {getattr(dims, name)}: not implemented yet ({later}); use {name}: 1"
                )
        return dims

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each a different share of the samples."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks whose tokens make the global batch (gradients are averaged over them)."""
        return self.dp * self.cp

    def dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel index (ranks differing only in cp or tp share it)."""
        return rank // (self.cp * self.tp)

    def dp_cp_rank(self, rank: int) -> int:
        return rank // self.tp

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The mesh's sizes and names: ``dp_shard`` always, the others when > 1."""
        keep = [n for n in MESH_DIMS if n == "dp_shard" or getattr(self, n) > 1]
        return tuple(getattr(self, n) for n in keep), tuple(keep)


def _refused(message: str) -> ConfigError:
    return ConfigError.from_issues([ConfigIssue("parallelism", message)])


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: its rank, the world, its device, the mesh over all ranks and
    the parallel dimensions (``dims`` None: every rank data-parallel shard). See the module
    docs for the ``dp_*`` conventions."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh
    timeout_s: float | None = None  # the bound on collectives (None: the backend's default)
    dims: ParallelDims | None = None
    dp_group: ProcessGroup | None = None  # None: the default group (dp spans the world)
    dp_cp_group: ProcessGroup | None = None
    expert_mesh: DeviceMesh | None = None  # ("expert_dp", "ep") with ep > 1: expert_mesh_of()
    cp_group: ProcessGroup | None = None  # with cp > 1 (None: the default group, or no cp)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def dp_size(self) -> int:
        return self.world_size if self.dims is None else self.dims.dp

    @property
    def dp_rank(self) -> int:
        return self.rank if self.dims is None else self.dims.dp_rank(self.rank)

    @property
    def dp_cp_size(self) -> int:
        return self.world_size if self.dims is None else self.dims.dp_cp

    @property
    def cp_size(self) -> int:
        """Ranks each row is split over (context parallel; 1 without)."""
        return 1 if self.dims is None else self.dims.cp

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group."""
        return 0 if self.dims is None else (self.rank // self.dims.tp) % self.dims.cp

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's context-parallel group (None without context parallel)."""
        if self.dims is None or self.dims.cp == 1:
            return None
        return self.mesh["cp"]

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh FSDP2 shards over: ``dp_shard``, or 2-D ``(dp_replicate, dp_shard)``
        for HSDP (replicated over the first dimension, sharded over the second). With context
        parallel, ``dp_shard x cp`` flattened (``dp_shard_cp``) takes ``dp_shard``'s place, so
        that gradients are averaged over the ``dp_cp_size`` ranks."""
        if self.dims is None:
            return self.mesh
        shard = "dp_shard"
        if self.dims.cp > 1:
            shard = "dp_shard_cp"
            self.mesh[("dp_shard", "cp")]._flatten(shard)  # cached after the first call
        names = ("dp_replicate", shard) if self.dims.dp_replicate > 1 else (shard,)
        with warnings.catch_warnings():  # torch's note on slicing a flattened dimension
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return _submesh(self.mesh, names)

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D mesh of this rank's tensor-parallel group (None without tensor parallel)."""
        if self.dims is None or self.dims.tp == 1:
            return None
        return self.mesh["tp"]

    @property
    def shard_size(self) -> int:
        """Ranks each FSDP2 parameter is split over."""
        return self.world_size if self.dims is None else self.dims.dp_shard * self.dims.cp


def _submesh(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    if tuple(mesh.mesh_dim_names or ()) == names:
        return mesh
    return mesh[names[0]] if len(names) == 1 else mesh[names]


def _group(mesh: DeviceMesh, names: tuple[str, ...], world_size: int) -> ProcessGroup | None:
    """The process group of the mesh dimensions ``names`` (present ones) flattened; None (the
    default group) when it spans the world."""
    names = tuple(n for n in names if n in (mesh.mesh_dim_names or ()))
    if math.prod(mesh.size(mesh.mesh_dim_names.index(n)) for n in names) == world_size:
        return None
    sub = _submesh(mesh, names)
    return sub.get_group() if sub.ndim == 1 else sub._flatten().get_group()


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(
    device: str = "auto",
    timeout_s: float | None = None,
    parallelism: Mapping[str, Any] | None = None,
) -> DistributedContext:
    """Join (or create) the process group and build the named device mesh of
    ``parallelism`` (:class:`ParallelDims`; None: every rank data-parallel shard).

    ``device`` is ``"auto"`` (CUDA when available), ``"cpu"`` or ``"cuda"``. ``timeout_s``
    bounds every collective: a rank whose peer died or hangs raises an error after that long
    instead of waiting (None: the backend's default, 30 min for gloo, 10 min for NCCL).
    Sizes that do not make the world are refused before any group is started.
    """
    problem = LOOP_RULES["distributed_timeout_s"].problem(timeout_s)  # the config key's rule
    if problem is not None:
        raise ConfigError.from_issues([ConfigIssue("distributed_timeout_s", problem)])
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=float(timeout_s))}
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = (
        dist.get_world_size()
        if dist.is_initialized()
        else int(os.environ["WORLD_SIZE"])
        if launched
        else 1
    )
    dims = ParallelDims.resolve(parallelism, world)
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
    shape, names = dims.mesh_shape()
    mesh = init_device_mesh(dev.type, shape, mesh_dim_names=names)
    world = dist.get_world_size()
    expert_mesh = expert_mesh_of(dims, dev.type) if dims.ep > 1 else None
    return DistributedContext(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        device=dev,
        mesh=mesh,
        timeout_s=None if timeout_s is None else float(timeout_s),
        dims=dims,
        dp_group=_group(mesh, ("dp_replicate", "dp_shard"), world),
        dp_cp_group=_group(mesh, ("dp_replicate", "dp_shard", "cp"), world),
        cp_group=_group(mesh, ("cp",), world) if dims.cp > 1 else None,
        expert_mesh=expert_mesh,
    )


def expert_mesh_of(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The 2-D ``("expert_dp", "ep")`` mesh of expert parallel: ``ep`` groups are ``ep``
    contiguous ranks of one ``dp_shard`` group (same ``dp_replicate``, ``cp`` and ``tp``
    coordinates); ``expert_dp`` are the ``dp / ep x cp`` ranks that hold the same experts
    (their gradients are summed). Every rank must call it (it creates process groups).

    Example::

        expert_mesh_of(ParallelDims(dp_shard=4, ep=2), "cpu").mesh.tolist()
        # -> [[0, 1], [2, 3]]
    """
    ranks = expert_rank_layout(dims)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("ep_tp", "expert_dp", "ep"))
    return mesh[("expert_dp", "ep")]


def expert_rank_layout(dims: ParallelDims) -> torch.Tensor:
    """The global ranks of :func:`expert_mesh_of`, ``[tp, expert_dp, ep]``: ``[t, i]`` is one
    ``ep`` group, ranks that differ only in their ``dp_shard`` coordinate (so they share the
    ``tp`` coordinate ``t``: under tensor parallel each tp rank exchanges tokens only with its
    own tp coordinate's ranks). Creates no process group.

    >>> expert_rank_layout(ParallelDims(dp_shard=4, tp=2, ep=2)).tolist()
    [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    """
    d = dims
    ranks = torch.arange(d.world_size).view(d.dp_replicate, d.dp_shard // d.ep, d.ep, d.cp, d.tp)
    return ranks.permute(4, 0, 1, 3, 2).reshape(d.tp, -1, d.ep)


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
        >>> ctx = DistributedContext(rank=0, world_size=2, local_rank=0,  # rank 0 of 2
        ...                          device=torch.device("cpu"), mesh=None, timeout_s=60)
        >>> print(peer_failure(err, ctx))  # doctest: +NORMALIZE_WHITESPACE
        rank 0 of 2: a collective operation with the other ranks failed (Connection closed by
        peer [127.0.0.1]:1234); another rank has probably died or hangs, see its log
        (collectives wait at most distributed_timeout_s: 60 s)
        >>> peer_failure(ValueError("batch_size: expected > 0"), ctx) is None  # not a collective
        True
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


def all_reduce_sum(
    value: torch.Tensor | float | int, device: torch.device, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Sum of ``value`` over the ranks of ``group`` (None: all ranks), a float64 tensor on
    ``device``; e.g. ``all_reduce_sum(tokens, ctx.device, ctx.dp_cp_group)``."""
    tensor = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def shard_model(
    model: nn.Module, ctx: DistributedContext, *, cpu_offload: bool = False
) -> nn.Module:
    """FSDP2: ``fully_shard`` each decoder layer, then the root; a no-op on a world of one.

    Parameters become DTensors sharded on dim 0 over ``ctx.fsdp_mesh`` (HSDP on its 2-D
    ``(dp_replicate, dp_shard)`` mesh: sharded over ``dp_shard``, replicated over
    ``dp_replicate``); gradients are averaged over the ``ctx.dp_cp_size`` ranks (the loop
    scales its loss by that to get a global token mean).
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
    if ctx.dp_cp_size == 1 and not offload:  # one process, or tensor parallel only
        return model
    check_nf4_shardable(model, ctx.shard_size)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    mesh = ctx.fsdp_mesh
    # expert-parallel experts are already split (expert_parallel.py): FSDP2 leaves them alone
    experts = {p for p in model.parameters() if getattr(p, "expert_parallel", False)}
    policy = {**policy, "ignored_params": experts} if experts else policy
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
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
