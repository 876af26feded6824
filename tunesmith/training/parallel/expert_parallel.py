"""Expert parallel: each MoE layer's stacked experts split over the ``ep`` ranks, tokens sent to
the rank that holds their expert by an all-to-all and brought back by a second one.

:func:`apply_expert_parallel` rewrites every :class:`~tunesmith.modules.moe.MoE` layer of a
model on a 2-D expert mesh ``("expert_dp", "ep")`` (``DistributedContext.expert_mesh``):

- **Parameters.** The experts' stacked parameters (``gate_proj``/``up_proj`` ``[E, I, H]``,
  ``down_proj`` ``[E, H, I]``) become DTensors ``(Replicate(), Shard(0))``: rank ``j`` of an
  ``ep`` group keeps experts ``j * E/ep ... (j + 1) * E/ep - 1``; the ``expert_dp`` ranks hold
  the same experts. Names and global shapes are unchanged, so checkpoints gather them as
  any DTensor. FSDP2 leaves them alone (they carry ``expert_parallel = True``,
  :func:`~tunesmith.training.parallel.distributed.shard_model` passes them as ``ignored_params``).
- **Forward.** The router stays replicated: each rank routes its own tokens (so the
  load-balancing loss is the one without EP) and sorts their copies by expert, as ``MoE``
  does. The experts module then exchanges its per-expert counts with the ``ep`` ranks, sends
  each rank the rows of its experts (``all_to_all_single`` with variable splits; no capacity,
  no token dropped), runs its local experts on what it received (regrouped by expert), and
  returns each row to the rank it came from by the reverse all-to-all. Both all-to-alls are
  differentiable (their backward is the opposite all-to-all).
- **LoRA on the experts.** The stacked adapters of ``GroupedExperts.lora`` (``lora_A``
  ``[E, r, in]``, ``lora_B`` ``[E, out, r]``) follow their experts: the same ``(Replicate(),
  Shard(0))`` placements, so each rank keeps the adapters of its own experts, applied by the
  local expert compute; their gradients are averaged like the experts' (below). A PEFT folder
  gathers them with ``full_tensor`` into the one-process tensors.
- **Gradients.** A local expert's gradient holds the contributions of every token of its
  ``ep`` group. FSDP2 averages the other gradients over the data-parallel ranks; the experts'
  are summed over the ``expert_dp`` ranks (the other holders of the same experts) and divided
  by the mesh size (``expert_dp x ep`` = the data-parallel ranks), which is the same average.

Example::

    apply_expert_parallel(model, ctx.expert_mesh)
    model.model.layers[0].mlp.experts.gate_proj.placements
    # -> (Replicate(), Shard(dim=0))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tunesmith.modules.moe import MoE

__all__ = [
    "ADAPTER_PARAMS",
    "EXPERT_PARAMS",
    "ExpertParallel",
    "all_to_all",
    "apply_expert_parallel",
]

EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")
"""The stacked expert parameters (dim 0: the expert) that are split over the ``ep`` ranks."""

ADAPTER_PARAMS = ("lora_A", "lora_B")
"""The stacked parameters of each expert LoRA adapter, split over the ``ep`` ranks as well."""


@dataclass(frozen=True)
class _Plan:
    ep_group: ProcessGroup
    ep: int
    replica_group: ProcessGroup | None  # None: no other rank holds these experts
    scale: float  # 1 / data-parallel ranks


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` to the group's ranks; returns the rows received
    (``recv`` from each rank, in rank order). The backward sends the gradients back."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


def all_to_all(
    x: torch.Tensor, send: list[int], recv: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` with variable splits: rows ``x[sum(send[:j]) :
    sum(send[:j + 1])]`` go to rank ``j`` of ``group``; the result holds ``recv[j]`` rows from
    each rank ``j``, in rank order. The gradient takes the reverse route.

    Example::

        received = all_to_all(rows, send=[2, 1], recv=[2, 3], group=ep_group)
    """
    return _AllToAll.apply(x, send, recv, group)


class _AverageExpertGrads(torch.autograd.Function):
    """Identity on the local expert tensors; the backward sums their gradients over the
    ranks holding the same experts and scales them to a data-parallel average (one
    collective for all of them, in a fixed order)."""

    @staticmethod
    def forward(ctx: Any, plan: _Plan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.plan
        flat = torch.cat([g.reshape(-1) for g in grads]) * plan.scale
        if plan.replica_group is not None:
            dist.all_reduce(flat, group=plan.replica_group)
        out = [part.view_as(g) for part, g in zip(flat.split([g.numel() for g in grads]), grads)]
        return None, *out


class ExpertParallel:
    """Mixed into an MoE layer's experts module by :func:`apply_expert_parallel` (its class
    becomes ``ExpertParallel<Name>``): ``forward(tokens_sorted, counts)`` keeps the experts
    module's contract (rows sorted by global expert, ``counts[e]`` rows for expert ``e``;
    returns the rows' outputs in the same order) but runs each row on the ``ep`` rank that
    holds its expert.

    Example::

        experts = model.model.layers[0].mlp.experts
        out = experts(tokens_sorted, counts)
    """

    _ep_plan: _Plan

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        plan, ep = self._ep_plan, self._ep_plan.ep
        local_experts = counts.numel() // ep
        counts = counts.to(torch.long)
        received_counts = torch.empty_like(counts)  # [ep sources x local experts]
        dist.all_to_all_single(received_counts, counts.contiguous(), group=plan.ep_group)
        # one host read for both split lists: the collectives need them on the host
        splits = torch.stack([counts.view(ep, -1).sum(1), received_counts.view(ep, -1).sum(1)])
        send, recv = splits.tolist()
        received = all_to_all(tokens, send, recv, plan.ep_group)
        # received rows come by source rank, then by local expert: regroup by local expert
        per_source = received_counts.view(ep, local_experts)
        expert_of_row = torch.repeat_interleave(
            torch.arange(local_experts, device=counts.device).repeat(ep), per_source.reshape(-1)
        )
        order = expert_of_row.argsort(stable=True)
        out = self._local_forward(received[order], per_source.sum(0))
        back = torch.empty_like(out).index_copy(0, order, out)
        return all_to_all(back, recv, send, plan.ep_group)

    def _local_forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The wrapped module's own forward on this rank's experts and their LoRA adapters
        (plain local tensors in place of the DTensors while it runs)."""
        owners = _sharded_params(self)  # (module, name, DTensor parameter)
        local = [p.to_local() for _, _, p in owners]
        trained = [i for i, (_, _, p) in enumerate(owners) if p.requires_grad]
        if not torch.is_grad_enabled():
            trained = []
        if trained:  # one all-reduce for the trained tensors' gradients
            averaged = _AverageExpertGrads.apply(self._ep_plan, *(local[i] for i in trained))
            for i, tensor in zip(trained, averaged, strict=True):
                local[i] = tensor
        if tokens.shape[0] == 0:  # no row here: an empty output that still links the rows'
            # gradients (the all-to-alls' backward) and the trained tensors' (their all-reduce)
            return tokens + sum(local[i].sum() for i in trained) * 0
        try:
            for (module, name, _), tensor in zip(owners, local, strict=True):
                module._parameters[name] = tensor  # type: ignore[assignment]
            return super().forward(tokens, counts)  # type: ignore[misc]
        finally:
            for module, name, param in owners:
                module._parameters[name] = param


def _sharded_params(experts: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """The experts module's split parameters, in a fixed order: the stacked experts, then each
    LoRA adapter's ``lora_A``/``lora_B`` (by projection name). Expert biases (gpt-oss:
    ``gate_proj_bias`` ``[E, out]`` ...) are stacked on the experts too and split alike."""
    biases = [f"{name}_bias" for name in EXPERT_PARAMS]
    names = [*EXPERT_PARAMS, *(b for b in biases if experts._parameters.get(b) is not None)]
    owners = [(experts, name, experts._parameters[name]) for name in names]
    adapters = getattr(experts, "lora", {})
    for proj in sorted(adapters):
        adapter = adapters[proj]
        owners += [(adapter, name, adapter._parameters[name]) for name in ADAPTER_PARAMS]
    return owners  # type: ignore[return-value]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split the experts of every :class:`~tunesmith.modules.moe.MoE` layer of ``model`` over
    ``mesh``: a 2-D ``("expert_dp", "ep")`` mesh (see the module docs), in place, before FSDP2
    and after loading the full weights (each rank keeps its slice). Returns ``model``.
    Refuses, naming the numbers, experts that ``ep`` does not divide.

    Example::

        apply_expert_parallel(model, ctx.expert_mesh)
    """
    if tuple(mesh.mesh_dim_names or ()) != ("expert_dp", "ep"):
        raise ValueError(f"expected an ('expert_dp', 'ep') mesh, got {mesh.mesh_dim_names}")
    ep, replicas = mesh.size(1), mesh.size(0)
    plan = _Plan(
        ep_group=mesh.get_group("ep"),
        ep=ep,
        replica_group=mesh.get_group("expert_dp") if replicas > 1 else None,
        scale=1.0 / (ep * replicas),
    )
    index = mesh.get_local_rank("ep")
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if module.num_experts % ep:
            raise ValueError(
                f"{name}: ep {ep} does not divide its {module.num_experts} experts; use an ep "
                f"that divides {module.num_experts}"
            )
        per_rank = module.num_experts // ep
        for owner, pname, full in _sharded_params(experts):
            if isinstance(full, DTensor):  # already split (applied twice)
                continue
            if full.shape[0] != module.num_experts:
                raise ValueError(
                    f"{name}.experts: {pname} {list(full.shape)} is not stacked "
                    f"on {module.num_experts} experts"
                )
            local = full.detach()[index * per_rank : (index + 1) * per_rank].clone()
            shard = DTensor.from_local(
                local,
                mesh,
                [Replicate(), Shard(0)],
                run_check=False,
                shape=full.shape,
                stride=full.stride(),
            )
            param = nn.Parameter(shard, requires_grad=full.requires_grad)
            param.expert_parallel = True  # FSDP2 ignores it (shard_model)
            owner.register_parameter(pname, param)
        if not isinstance(experts, ExpertParallel):
            cls = type(experts)
            experts.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
        experts._ep_plan = plan
    return model
