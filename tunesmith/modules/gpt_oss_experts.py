"""gpt-oss experts: the clamped SwiGLU and the fused, interleaved tensors of its checkpoints.

transformers' ``GptOssExperts`` keeps each layer's experts in four tensors:
``gate_up_proj`` ``[E, hidden, 2 * I]`` (input-major, gate in the even columns and up in the
odd ones), ``gate_up_proj_bias`` ``[E, 2 * I]`` (interleaved alike), ``down_proj``
``[E, I, hidden]`` and ``down_proj_bias`` ``[E, hidden]``. tunesmith runs them as a
:class:`~tunesmith.modules.moe.GroupedExperts` with biases (stacked ``gate_proj``/``up_proj``
``[E, I, hidden]``, ``down_proj`` ``[E, hidden, I]``, so grouped GEMM, expert parallel and
expert LoRA work unchanged) whose ``checkpoint_layout`` is :class:`GptOssCheckpointLayout`:
its state dict holds transformers' four tensors and it loads them back.

Example::

    >>> from tunesmith.modules.moe import GroupedExperts
    >>> experts = gpt_oss_experts(3, hidden_size=8, intermediate_size=4, alpha=1.702, limit=7.0)
    >>> {k: list(v.shape) for k, v in sorted(experts.state_dict().items())}
    {'down_proj': [3, 4, 8], 'down_proj_bias': [3, 8], 'gate_up_proj': [3, 8, 8], 'gate_up_proj_bias': [3, 8]}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tunesmith.modules.moe import GroupedExperts

__all__ = ["ClampedExperts", "ClampedSwiGLU", "GptOssCheckpointLayout", "gpt_oss_experts"]


@dataclass(frozen=True)
class ClampedExperts:
    """gpt-oss's mixture of experts, as a spec field (``ModelSpec.clamped_experts``): a router
    with a bias whose top-k logits are softmaxed, experts with biases and a
    :class:`ClampedSwiGLU` (``swiglu_alpha``, ``swiglu_limit``; None: no clamp), and
    transformers' fused tensors on disk (:class:`GptOssCheckpointLayout`).

    Example::

        >>> ClampedExperts().swiglu_limit
        7.0
    """

    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = 7.0


class ClampedSwiGLU:
    """gpt-oss's gated activation: ``(up + 1) * gate * sigmoid(alpha * gate)`` with the gate
    clamped to at most ``limit`` and up to ``[-limit, limit]`` (``limit`` None: no clamp).

    Example::

        >>> act = ClampedSwiGLU(alpha=1.702, limit=7.0)
        >>> act(torch.tensor([100.0]), torch.tensor([-100.0]))  # (1 - 7) * 7 * sigmoid(11.9)
        tensor([-41.9997])
    """

    def __init__(self, alpha: float, limit: float | None) -> None:
        self.alpha = float(alpha)
        self.limit = None if limit is None else float(limit)

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def __repr__(self) -> str:
        return f"ClampedSwiGLU(alpha={self.alpha:g}, limit={self.limit})"


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` gate and up -> ``[..., 2n]`` with gate in even and up in odd positions."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


class GptOssCheckpointLayout:
    """The ``checkpoint_layout`` of gpt-oss experts (see the module docs): ``split`` turns the
    stacked parameters into transformers' tensors, ``stack`` the reverse (each tensor on its
    own, so a streaming loader may pass them in any order and any number of calls)."""

    interleaved_gate_up = True  # PEFT's fused gate_up_proj adapters alternate rows alike

    def split(self, module: GroupedExperts, state: dict[str, Any], prefix: str) -> None:
        gate, up = state.pop(prefix + "gate_proj"), state.pop(prefix + "up_proj")
        state[prefix + "gate_up_proj"] = _interleave(gate.transpose(1, 2), up.transpose(1, 2))
        state[prefix + "down_proj"] = state[prefix + "down_proj"].transpose(1, 2)
        gate_bias, up_bias = (
            state.pop(prefix + "gate_proj_bias"),
            state.pop(prefix + "up_proj_bias"),
        )
        state[prefix + "gate_up_proj_bias"] = _interleave(gate_bias, up_bias)

    def stack(
        self, module: GroupedExperts, state: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> None:
        fused = state.pop(prefix + "gate_up_proj", None)
        if fused is not None:
            if fused.dim() != 3 or fused.shape[-1] % 2:
                error_msgs.append(f"{prefix}gate_up_proj: expected [E, hidden, 2 * I], got "
                                  f"{list(fused.shape)}")  # fmt: skip
                return
            state[prefix + "gate_proj"] = fused[..., 0::2].transpose(1, 2).contiguous()
            state[prefix + "up_proj"] = fused[..., 1::2].transpose(1, 2).contiguous()
        bias = state.pop(prefix + "gate_up_proj_bias", None)
        if bias is not None:
            state[prefix + "gate_proj_bias"] = bias[..., 0::2].contiguous()
            state[prefix + "up_proj_bias"] = bias[..., 1::2].contiguous()
        if prefix + "down_proj" in state:
            state[prefix + "down_proj"] = state[prefix + "down_proj"].transpose(1, 2).contiguous()


def gpt_oss_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    alpha: float,
    limit: float | None,
) -> GroupedExperts:
    """Stacked gpt-oss experts: biases, :class:`ClampedSwiGLU`, transformers' tensors on disk."""
    experts = GroupedExperts(
        num_experts,
        hidden_size,
        intermediate_size,
        bias=True,
        activation=ClampedSwiGLU(alpha, limit),
    )
    experts.checkpoint_layout = GptOssCheckpointLayout()
    return experts
