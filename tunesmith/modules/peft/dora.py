"""DoRA: weight-decomposed LoRA (Liu et al., 2024, https://arxiv.org/abs/2402.09353).

The adapted weight is ``W' = m * (W + s B A) / ||W + s B A||``, the norm taken per output
feature (over each row of the ``[out, in]`` weight, the paper's "column-wise" norm of the
``[in, out]`` matrix). The magnitude ``m`` (``lora_magnitude_vector``, PEFT's name) starts
at ``||W||`` so that a new adapter changes nothing. As the paper (section 4.3) and PEFT do,
the norm is treated as a constant in backward: gradients reach ``m``, ``A`` and ``B`` but not
through the norm.

Example::

    >>> layer = DoRALinear.from_linear(nn.Linear(32, 16), rank=4, alpha=8)
    >>> sorted(name for name, p in layer.named_parameters() if p.requires_grad)
    ['lora_A.weight', 'lora_B.weight', 'lora_magnitude_vector']
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.peft.lora import LoRALinear

__all__ = ["DoRALinear"]


class DoRALinear(LoRALinear):
    """:class:`LoRALinear` with a learned per-output magnitude (DoRA); same arguments.

    ``forward`` computes, with ``x_d = dropout(x)`` and ``g = m / ||W + s B A||`` (detached norm):
    ``y = x W^T + b + (g - 1) * (x_d W^T) + g * s * B(A(x_d))`` — without dropout exactly
    ``x W'^T + b``; this is PEFT's formulation, so the numbers match PEFT's.
    """

    def _init_from(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float,
        use_rslora: bool,
        adapter_dtype: torch.dtype | None,
    ) -> None:
        out_features = base.out_features
        kwargs = {"device": base.weight.device, "dtype": adapter_dtype or base.weight.dtype}
        self.lora_magnitude_vector = nn.Parameter(torch.empty(out_features, **kwargs))
        super()._init_from(base, rank, alpha, dropout, use_rslora, adapter_dtype)

    @torch.no_grad()
    def reset_adapter_parameters(self) -> None:
        """LoRA's init, then ``m = ||W||`` per output feature (needs the real base weight)."""
        super().reset_adapter_parameters()
        if self.weight.is_meta:
            return
        self.lora_magnitude_vector.copy_(self.weight_norm(self.dense_weight(torch.float32)))

    def adapter_parameter_names(self) -> tuple[str, ...]:
        return (*super().adapter_parameter_names(), "lora_magnitude_vector")

    def weight_norm(
        self, weight: torch.Tensor, lora_weight: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``||weight + scaling * lora_weight||`` per output feature, in ``weight``'s dtype."""
        if lora_weight is not None:
            weight = weight + self.scaling * lora_weight
        return torch.linalg.vector_norm(weight, dim=1).to(weight.dtype)

    def effective_weight(self) -> torch.Tensor:
        """``g[:, None] * (W + s·B A)`` with ``g = m / ||W + s B A||`` (detached norm, as in
        ``forward``), differentiable in the adapters and the magnitude."""
        lora = super().effective_weight()
        if self.adapters_disabled:
            return lora
        norm = torch.linalg.vector_norm(lora.detach(), dim=1)
        gain = (self.lora_magnitude_vector / norm).to(lora.dtype)
        return gain[:, None] * lora

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        base = self.dense_weight()
        weight = base.float() + self.delta_weight()
        scale = self.lora_magnitude_vector.float() / torch.linalg.vector_norm(weight, dim=1)
        return (scale[:, None] * weight).to(base.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        if self.adapters_disabled:
            return out
        weight = self.dense_weight(x.dtype)
        lora_weight = (self.lora_B.weight @ self.lora_A.weight).to(x.dtype)
        norm = self.weight_norm(weight, lora_weight.detach()).detach()
        gain = (self.lora_magnitude_vector / norm).view(1, -1)
        if isinstance(self.lora_dropout, nn.Identity) or not self.training:
            x_d = x
            base_no_bias = out if self.bias is None else out - self.bias
        else:
            x_d = self.lora_dropout(x)
            base_no_bias = F.linear(x_d, weight)
        update = self.adapter_forward(x_d).to(x.dtype)
        dora = (gain - 1) * base_no_bias + gain * update * self.scaling
        return out + dora.to(out.dtype)
