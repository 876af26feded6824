"""Token-choice mixture of experts (Qwen3-MoE) and its load-balancing loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.feed_forward import FeedForward

__all__ = ["MoE", "load_balancing_loss"]


class MoE(nn.Module):
    """Softmax top-k routing over SwiGLU experts.

    Parameters carry the names of Hugging Face checkpoints on disk: the router is
    ``gate`` (a bias-free linear) and expert ``i`` is ``experts.{i}.gate_proj`` /
    ``up_proj`` / ``down_proj``. Routing follows Qwen3-MoE: probabilities are a
    float32 softmax of the router logits, the top ``top_k`` experts are kept and,
    with ``norm_topk_prob``, their weights are renormalised to sum to one.

    ``forward`` returns the output and the router logits ``[b * s, num_experts]``
    (for :func:`load_balancing_loss` and parity checks).

    Example::

        >>> moe = MoE(32, 16, num_experts=4, top_k=2, norm_topk_prob=True)
        >>> out, router_logits = moe(torch.randn(2, 3, 32))
        >>> out.shape, router_logits.shape
        (torch.Size([2, 3, 32]), torch.Size([6, 4]))
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = False,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            FeedForward(hidden_size, intermediate_size) for _ in range(num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[n, hidden]`` -> (router logits ``[n, E]``, weights ``[n, k]``, experts ``[n, k]``)."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(tokens)
        if tokens.shape[0] == 0:
            return x.clone(), logits
        # Sort the (token, slot) assignments by expert so each expert sees one contiguous slice.
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        token_idx = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        outputs = []
        for expert, chunk in zip(self.experts, tokens[token_idx].split(counts), strict=True):
            if chunk.shape[0]:
                outputs.append(expert(chunk))
        expert_out = torch.cat(outputs) * weights.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add_(0, token_idx, expert_out)
        return out.reshape(shape), logits


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all MoE layers, as transformers computes it.

    ``num_experts * sum_e f_e * P_e`` where ``f_e`` is the fraction of top-k
    assignments that went to expert ``e`` and ``P_e`` its mean router probability,
    both pooled over layers and over the real (``attention_mask == 1``) tokens.
    ``router_logits`` holds one ``[b * s, num_experts]`` tensor per MoE layer.

    Example::

        >>> logits = [torch.zeros(6, 4)]          # a perfectly uniform router
        >>> float(load_balancing_loss(logits, top_k=2))
        2.0
    """
    if not router_logits:
        raise ValueError("router_logits is empty: the model has no MoE layers")
    num_experts = router_logits[0].shape[-1]
    logits = torch.cat([layer.float() for layer in router_logits])
    probs = F.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    assignments = F.one_hot(chosen, num_experts).sum(dim=1).float()  # [rows, E]
    if attention_mask is None:
        weight = torch.ones(logits.shape[0], device=logits.device)
    else:
        weight = attention_mask.reshape(-1).float().to(logits.device).repeat(len(router_logits))
    total = weight.sum()
    tokens_per_expert = (assignments * weight[:, None]).sum(0) / total
    prob_per_expert = (probs * weight[:, None]).sum(0) / total
    return num_experts * (tokens_per_expert * prob_per_expert).sum()
