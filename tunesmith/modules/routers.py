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

Bias-based balancing (DeepSeek-V3's auxiliary-loss-free load balancing, off by default):
:func:`update_correction_bias` (after each optimizer step) moves every expert's
``e_score_correction_bias`` by ``update_rate`` towards balance, ``b_i += rate * sign(mean load -
load_i)``, outside the gradient; it changes which experts are chosen, never their weights. The
loads are the step's, as every :class:`~tunesmith.modules.moe.MoE` layer counts them for the
router statistics (:func:`~tunesmith.training.router_stats.read_expert_loads`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.moe import MoE

__all__ = [
    "ROUTING_METHODS",
    "DeepSeekGate",
    "DeepSeekMoE",
    "DeepSeekRouting",
    "balanced_layers",
    "deepseek_route",
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

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[n, hidden]`` -> (float32 router logits ``[n, E]``, weights ``[n, k]``,
        experts ``[n, k]``)."""
        logits = self.gate(x)
        weights, experts = deepseek_route(
            logits, self.gate.e_score_correction_bias, self.routing, self.top_k,
            self.norm_topk_prob,
        )  # fmt: skip
        return logits, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, logits = super().forward(x)
        return out + self.shared_experts(x), logits


def balanced_layers(model: nn.Module) -> Iterator[DeepSeekMoE]:
    """The DeepSeek MoE layers of ``model`` with a correction bias (V3's ``noaux_tc``).

    Example::

        >>> from tunesmith.models import deepseek_v3
        >>> len(list(balanced_layers(deepseek_v3.deepseek_v3_tiny())))
        2
    """
    for module in model.modules():
        if isinstance(module, DeepSeekMoE) and module.gate.e_score_correction_bias is not None:
            yield module


@torch.no_grad()
def update_correction_bias(loads: Mapping[nn.Module, torch.Tensor], update_rate: float) -> None:
    """Bias-based balancing, once per optimizer step: per layer of ``loads`` with a correction
    bias, its load (the tokens each expert got in the step, summed over the ranks whose tokens
    make the global batch, as :func:`~tunesmith.training.router_stats.read_expert_loads` gives
    it: ``[E + 1]``, the last entry the assignments no expert got) moves each expert's
    bias by ``update_rate`` up when below the layer's mean load and down when above. Ranks
    that routed the same tokens (tensor parallel) hold the same loads, so their biases stay
    equal.

    Example::

        >>> from tunesmith.models import deepseek_v3
        >>> moe = deepseek_v3.deepseek_v3_tiny().model.layers[1].mlp
        >>> update_correction_bias({moe: torch.tensor([6, 0, 3, 3, 3, 3, 0])}, 0.001)
        >>> moe.gate.e_score_correction_bias.tolist()
        [-0.0010000000474974513, 0.0010000000474974513, 0.0, 0.0, 0.0, 0.0]
    """
    for moe, load in loads.items():
        if not isinstance(moe, DeepSeekMoE) or moe.gate.e_score_correction_bias is None:
            continue
        load = load[: moe.num_experts].float()
        bias = moe.gate.e_score_correction_bias
        bias += (update_rate * torch.sign(load.mean() - load)).to(bias.device, bias.dtype)
