"""DeepSeek routing (V2 and V3) and the MoE block around it: routed experts plus shared experts.

The routing decision stays in :meth:`MoE.route`'s place (:meth:`DeepSeekMoE.route` overrides
it), so :meth:`MoE.forward` (sorting, grouped experts, expert parallel, statistics) is the one
that serves every family. Methods (``topk_method`` of DeepSeek's configs):

- ``noaux_tc`` (V3): sigmoid scores; the choice adds ``e_score_correction_bias`` (a buffer,
  moved by bias-based balancing, never by gradients); experts come from the ``topk_group``
  groups of ``n_group`` whose two best biased scores sum highest; the weights are the unbiased
  scores of the chosen experts, renormalised with ``norm_topk_prob``;
- ``greedy`` (V2): softmax scores, plain top-k;
- ``group_limited_greedy`` (V2): softmax, only the ``topk_group`` groups of highest max score.

The weights are then multiplied by ``routed_scaling_factor``.

Bias-based balancing (DeepSeek-V3's auxiliary-loss-free load balancing, off by default): with
:func:`track_expert_load`, each training forward counts the experts' assignments, and
:func:`update_correction_bias` (after each optimizer step) moves every expert's
``e_score_correction_bias`` by ``update_rate`` towards balance, ``b_i += rate * sign(mean load -
load_i)``, outside the gradient; it changes which experts are chosen, never their weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.moe import MoE

__all__ = [
    "ROUTING_METHODS",
    "DeepSeekGate",
    "DeepSeekMoE",
    "DeepSeekRouting",
    "deepseek_route",
    "track_expert_load",
    "update_correction_bias",
]

ROUTING_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepSeekRouting:
    """How a DeepSeek MoE layer routes (``config.json`` names).

    Example::

        >>> DeepSeekRouting("noaux_tc", n_group=4, topk_group=2).uses_correction_bias
        True
    """

    method: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1

    def __post_init__(self) -> None:
        if self.method not in ROUTING_METHODS:
            raise ValueError(
                f"topk_method {self.method!r} is not supported; supported: {ROUTING_METHODS}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(
                f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})"
            )
        if self.n_shared_experts < 1:
            raise ValueError(f"n_shared_experts must be >= 1, got {self.n_shared_experts}")

    @property
    def uses_correction_bias(self) -> bool:
        """Whether the router has an ``e_score_correction_bias`` (V3's ``noaux_tc``)."""
        return self.method == "noaux_tc"

    def check_experts(self, num_experts: int, top_k: int) -> None:
        """Refuse groups that do not split ``num_experts`` or leave fewer than ``top_k``."""
        if num_experts % self.n_group:
            raise ValueError(
                f"n_group ({self.n_group}) must divide n_routed_experts ({num_experts})"
            )
        per_group = num_experts // self.n_group
        if self.method == "noaux_tc" and per_group < 2:
            raise ValueError(f"noaux_tc routing needs >= 2 experts per group, got {per_group}")
        if self.method != "greedy" and self.topk_group * per_group < top_k:
            raise ValueError(
                f"topk_group ({self.topk_group}) groups of {per_group} experts hold fewer than "
                f"num_experts_per_tok ({top_k})"
            )


class DeepSeekGate(nn.Module):
    """The router's weight ``[E, hidden]`` and, for ``noaux_tc``, ``e_score_correction_bias``
    ``[E]`` (a persistent buffer kept in float32 whatever the model's dtype, as transformers
    keeps it: in bfloat16 its fine differences, and the balancing updates of 0.001, would be
    lost); ``forward`` gives float32 logits ``[n, E]``.

    Example::

        >>> DeepSeekGate(8, 4, correction_bias=True).to(torch.bfloat16).e_score_correction_bias.dtype
        torch.float32
    """

    float32_buffers = ("e_score_correction_bias",)  # read by loaders: never cast on load

    def __init__(self, hidden_size: int, num_experts: int, *, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if correction_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32)
            )
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn: Any, recurse: bool = True) -> DeepSeekGate:
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def init_weights(self, std: float) -> None:
        """Weight ~ ``N(0, std)``, correction bias zero (as transformers initialises them)."""
        nn.init.normal_(self.weight, mean=0.0, std=std)
        if self.e_score_correction_bias is not None:
            nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


def deepseek_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    routing: DeepSeekRouting,
    top_k: int,
    norm_topk_prob: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 router ``logits`` ``[n, E]`` -> (weights ``[n, k]`` float32, experts ``[n, k]``).

    Example::

        >>> logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])  # groups (0, 1) and (2, 3)
        >>> w, e = deepseek_route(logits, torch.zeros(4), DeepSeekRouting(n_group=2,
        ...                       topk_group=1), top_k=1, norm_topk_prob=True)
        >>> e.tolist(), w.tolist()  # expert 1 scores best, but group (2, 3) sums higher
        ([[3]], [[1.0]])
    """
    n, experts = logits.shape
    if routing.method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(n, routing.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        fill = float("-inf")
    else:
        scores = logits.softmax(dim=-1)
        choice = scores
        group_scores = scores.view(n, routing.n_group, -1).max(dim=-1).values
        fill = 0.0
    if routing.method != "greedy":
        groups = group_scores.topk(routing.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.repeat_interleave(experts // routing.n_group, dim=1)
        choice = choice.masked_fill(~keep, fill)
    chosen = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if norm_topk_prob and routing.method == "noaux_tc":  # V2's router never renormalises
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, chosen


class DeepSeekMoE(MoE):
    """A DeepSeek MoE block: :class:`~tunesmith.modules.moe.MoE`'s grouped experts routed by
    :func:`deepseek_route`, plus ``shared_experts`` (one SwiGLU of width
    ``n_shared_experts * intermediate_size``) that every token goes through.

    Example::

        >>> moe = DeepSeekMoE(32, 8, num_experts=6, top_k=2, routing=DeepSeekRouting(
        ...     n_group=3, topk_group=2, routed_scaling_factor=2.5))
        >>> out, logits = moe(torch.randn(2, 3, 32))
        >>> out.shape, logits.shape, moe.shared_experts.gate_proj.out_features
        (torch.Size([2, 3, 32]), torch.Size([6, 6]), 8)
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        routing: DeepSeekRouting,
        norm_topk_prob: bool = False,
        mlp_bias: bool = False,
    ) -> None:
        super().__init__(
            hidden_size,
            intermediate_size,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
        )
        routing.check_experts(num_experts, top_k)
        self.routing = routing
        self.gate = DeepSeekGate(
            hidden_size, num_experts, correction_bias=routing.uses_correction_bias
        )
        self.shared_experts = FeedForward(
            hidden_size, intermediate_size * routing.n_shared_experts, bias=mlp_bias
        )
        self.expert_load: torch.Tensor | None = None  # see track_expert_load
        self.real_tokens: torch.Tensor | None = None  # [n] bool of the forward, when known

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[n, hidden]`` -> (float32 router logits ``[n, E]``, weights ``[n, k]``,
        experts ``[n, k]``)."""
        logits = self.gate(x)
        weights, experts = deepseek_route(
            logits, self.gate.e_score_correction_bias, self.routing, self.top_k,
            self.norm_topk_prob,
        )  # fmt: skip
        if self.expert_load is not None and self.training and _outside_backward():
            self._count(experts)
        return logits, weights.to(x.dtype), experts

    def _count(self, experts: torch.Tensor) -> None:
        """Add the assignments of the forward's real tokens (padding left out) to the load."""
        real = self.real_tokens
        if real is not None and real.shape[0] == experts.shape[0]:
            experts = experts[real.to(experts.device)]
        self.expert_load += torch.bincount(experts.flatten(), minlength=self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = super().forward(x)
        return out + self.shared_experts(x), logits


def _outside_backward() -> bool:
    """False while autograd runs a backward (activation checkpointing recomputing a forward,
    whose routing was counted the first time)."""
    return torch._C._current_graph_task_id() == -1


def _balanced_layers(model: nn.Module) -> Iterator[DeepSeekMoE]:
    for module in model.modules():
        if isinstance(module, DeepSeekMoE) and module.gate.e_score_correction_bias is not None:
            yield module


def track_expert_load(model: nn.Module) -> int:
    """Make every DeepSeek MoE layer with a correction bias count its experts' assignments in
    training forwards (``expert_load``, from zero); returns how many layers count.

    Example::

        >>> from tunesmith.models import deepseek_v3
        >>> model = deepseek_v3.deepseek_v3_tiny()
        >>> track_expert_load(model)
        2
    """
    layers = list(_balanced_layers(model))
    for moe in layers:
        bias = moe.gate.e_score_correction_bias
        moe.expert_load = torch.zeros(moe.num_experts, dtype=torch.long, device=bias.device)
    body = getattr(model, "model", None)
    if layers and isinstance(body, nn.Module):
        body.register_forward_pre_hook(partial(_mark_real_tokens, layers), with_kwargs=True)
    return len(layers)


def _mark_real_tokens(
    layers: list[DeepSeekMoE], body: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Forward pre-hook of the decoder body: tell the tracked layers which of the forward's
    ``[b * s]`` positions are real tokens (not rows' padding, packed rows' gaps or the
    positions tensor parallel pads the sequence with: ``_tp_cut``), as the body sees them."""
    ids = args[0] if args else kwargs["input_ids"]
    real = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    mask, docs = kwargs.get("attention_mask"), kwargs.get("document_ids")
    if mask is not None and mask.dim() == 2:
        real &= mask[:, -ids.shape[1] :].bool()
    if docs is not None and docs.shape == ids.shape:
        real &= docs >= 0
    cut = getattr(body, "_tp_cut", None)
    if cut is not None:
        real[:, cut:] = False
    for moe in layers:
        moe.real_tokens = real.reshape(-1)


@torch.no_grad()
def update_correction_bias(
    model: nn.Module, update_rate: float, group: dist.ProcessGroup | None = None
) -> None:
    """Bias-based balancing, once per optimizer step: per tracked layer, the loads counted
    since the last update (summed over the ranks of ``group``, default the whole world when
    torch.distributed is initialised: each rank routed its own tokens; a rank counted twice
    changes nothing, the update takes only the sign) move each expert's bias by
    ``update_rate`` up when below the mean load and down when above; then the counts restart.

    Example::

        >>> from tunesmith.models import deepseek_v3
        >>> model = deepseek_v3.deepseek_v3_tiny()
        >>> _ = track_expert_load(model)
        >>> moe = model.model.layers[1].mlp
        >>> moe.expert_load += torch.tensor([6, 0, 3, 3, 3, 3])
        >>> update_correction_bias(model, 0.001)
        >>> moe.gate.e_score_correction_bias.tolist()
        [-0.0010000000474974513, 0.0010000000474974513, 0.0, 0.0, 0.0, 0.0]
    """
    layers = [moe for moe in _balanced_layers(model) if moe.expert_load is not None]
    if not layers:
        return
    loads = torch.stack([moe.expert_load for moe in layers]).float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(loads, group=group)
    step = update_rate * torch.sign(loads.mean(dim=1, keepdim=True) - loads)
    for moe, delta in zip(layers, step, strict=True):
        bias = moe.gate.e_score_correction_bias
        bias += delta.to(bias.device, bias.dtype)
        moe.expert_load.zero_()
