"""Llama 4's pieces beyond the generic decoder: its weightless qk-norm, the attention
temperature of its NoPE layers, and its mixture of experts (sigmoid top-k routing whose score
scales the expert's *input*, a shared expert beside the routed ones, experts stored fused on
disk as ``gate_up_proj`` ``[E, hidden, 2 * inter]`` and ``down_proj`` ``[E, inter, hidden]``).

Example::

    >>> moe = Llama4MoE(16, 8, num_experts=3, top_k=1)
    >>> out, logits = moe(torch.randn(2, 5, 16))
    >>> out.shape, logits.shape
    (torch.Size([2, 5, 16]), torch.Size([10, 3]))
    >>> sorted(k for k in moe.state_dict() if k.startswith("experts."))
    ['experts.down_proj', 'experts.gate_up_proj']
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tunesmith.modules.attention_backends import AttentionBatch
from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.moe import MoE

__all__ = ["AttentionTemperature", "InputMajorFusedLayout", "L2Norm", "Llama4MoE"]


class L2Norm(nn.Module):
    """``x / sqrt(mean(x**2) + eps)`` over the last dimension, in float32, no weight (Llama 4's
    qk-norm). It commutes with RoPE (a rotation keeps each head's norm), so it may run before.

    Example::

        >>> L2Norm()(torch.full((1, 4), 3.0))
        tensor([[1.0000, 1.0000, 1.0000, 1.0000]])
    """

    def __init__(self, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"


class AttentionTemperature(nn.Module):
    """Scale a NoPE layer's queries by ``1 + attn_scale * log1p(floor((pos + 1) / floor_scale))``
    (Llama 4's temperature tuning for long context), ``pos`` each query's position (the
    batch's ``position_ids``; without a batch, the next positions of the cache).

    Example::

        >>> temp = AttentionTemperature(floor_scale=2.0, attn_scale=1.0)
        >>> q = torch.ones(1, 1, 4, 2)                    # [b, heads, s, d]
        >>> temp(q, AttentionBatch(position_ids=torch.arange(4)[None]), 0)[0, 0, :, 0]
        tensor([1.0000, 1.6931, 1.6931, 2.0986])
    """

    def __init__(self, floor_scale: float, attn_scale: float) -> None:
        super().__init__()
        self.floor_scale = floor_scale
        self.attn_scale = attn_scale

    def forward(self, q: torch.Tensor, batch: AttentionBatch | None, cached: int) -> torch.Tensor:
        positions = batch.position_ids if batch is not None else None
        if positions is None:
            positions = torch.arange(cached, cached + q.shape[2], device=q.device)[None]
        floor = torch.floor((positions.float() + 1.0) / self.floor_scale)
        scales = torch.log1p(floor) * self.attn_scale + 1.0  # [b|1, s]
        return (q * scales[:, None, :, None]).to(q.dtype)

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale:g}, attn_scale={self.attn_scale:g}"


class InputMajorFusedLayout:
    """The ``checkpoint_layout`` of Llama 4's experts (see
    :class:`~tunesmith.modules.moe.GroupedExperts`): on disk ``gate_up_proj``
    ``[E, hidden, 2 * inter]`` (gate columns then up columns) and ``down_proj``
    ``[E, inter, hidden]``, the transposes of the stacked ``nn.Linear`` weights in memory.

    A ``down_proj`` is read as the disk layout when its shape says so, or, for a square
    expert (``inter == hidden``), when its ``gate_up_proj`` comes in the same call.
    ``input_major`` tells PEFT folders to transpose expert adapters
    (``tunesmith.models.peft_io``).
    """

    input_major = True

    def split(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        gate, up = state_dict.pop(prefix + "gate_proj"), state_dict.pop(prefix + "up_proj")
        down = state_dict.pop(prefix + "down_proj")
        state_dict[prefix + "gate_up_proj"] = torch.cat(
            [gate.transpose(1, 2), up.transpose(1, 2)], dim=-1
        )
        state_dict[prefix + "down_proj"] = down.transpose(1, 2)

    def stack(
        self, module: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> None:
        fused = state_dict.pop(prefix + "gate_up_proj", None)
        inter, hidden = module.intermediate_size, module.hidden_size
        if fused is not None:
            if tuple(fused.shape[1:]) != (hidden, 2 * inter):
                error_msgs.append(
                    f"{prefix}gate_up_proj: shape {list(fused.shape)}, expected "
                    f"[{module.num_experts}, {hidden}, {2 * inter}]"
                )
                return
            # contiguous copies: a load by assignment makes them the parameters themselves
            state_dict[prefix + "gate_proj"] = fused[..., :inter].transpose(1, 2).contiguous()
            state_dict[prefix + "up_proj"] = fused[..., inter:].transpose(1, 2).contiguous()
        down = state_dict.get(prefix + "down_proj")
        on_disk = inter != hidden or fused is not None
        if down is not None and tuple(down.shape[1:]) == (inter, hidden) and on_disk:
            state_dict[prefix + "down_proj"] = down.transpose(1, 2).contiguous()


class Llama4MoE(MoE):
    """Llama 4's mixture of experts: router logits ``gate(x)``, the top ``top_k`` experts
    weighted by ``sigmoid(logit)`` (no softmax), each weight scaling the token *before* its
    expert (``expert(w * x)``, as transformers computes it), plus a SwiGLU ``shared_expert``
    of the same width on every token. The routing decision is :meth:`route`; sorting, expert
    counts and the grouped call are :class:`~tunesmith.modules.moe.MoE`'s.
    """

    scale_inputs = True  # MoE.forward scales each expert's input, not its output

    def __init__(
        self, hidden_size: int, intermediate_size: int, *, num_experts: int, top_k: int
    ) -> None:
        super().__init__(hidden_size, intermediate_size, num_experts=num_experts, top_k=top_k)
        self.experts.checkpoint_layout = InputMajorFusedLayout()
        self.shared_expert = FeedForward(hidden_size, intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[n, hidden]`` -> (logits ``[n, E]``, ``sigmoid`` weights ``[n, k]``, experts)."""
        logits = self.gate(x)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return logits, torch.sigmoid(top.float()).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed, logits = super().forward(x)
        return self.shared_expert(x) + routed, logits
