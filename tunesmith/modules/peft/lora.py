"""LoRA: a frozen linear layer plus a trainable low-rank update ``scaling * B @ A``.

The module keeps the base layer's own parameters under their own names (``weight``,
``bias``), so a model's base keys stay the Hugging Face keys; the adapter lives in
``lora_A.weight`` ``[rank, in]`` and ``lora_B.weight`` ``[out, rank]``, the names PEFT
saves (without its ``base_model.model.`` prefix).

Example::

    >>> layer = LoRALinear.from_linear(nn.Linear(32, 16), rank=4, alpha=8)
    >>> layer(torch.randn(2, 32)).shape
    torch.Size([2, 16])
    >>> sorted(name for name, p in layer.named_parameters() if p.requires_grad)
    ['lora_A.weight', 'lora_B.weight']
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.modules.peft.nf4 import dequantize_nf4, is_nf4, linear_nf4, quantize_nf4

__all__ = ["LoRALinear", "lora_scaling"]


def lora_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """``alpha / rank``, or ``alpha / sqrt(rank)`` with rank-stabilised LoRA (rsLoRA).

    >>> lora_scaling(8, 16), lora_scaling(16, 16, use_rslora=True)
    (2.0, 4.0)
    """
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


class LoRALinear(nn.Module):
    """``y = x W^T + b + scaling * B(A(dropout(x)))`` with ``W``, ``b`` frozen.

    ``A`` starts Kaiming-uniform (``a=sqrt(5)``), ``B`` at zero, as in PEFT, so a new adapter
    leaves the output unchanged. The base weight may be an NF4 tensor (QLoRA, see
    :meth:`quantize_base`). Adapters may use another dtype than the base (e.g. fp32 adapters
    on a bf16 base): their input is cast to their dtype and their output back.

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        rank: rank ``r`` of the update.
        alpha: scale numerator; ``scaling = alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).
        dropout: dropout on the adapter's input only.
        use_rslora: rank-stabilised scaling.
        device, dtype: of the base weight; ``adapter_dtype`` defaults to ``dtype``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        bias: bool = False,
        dropout: float = 0.0,
        use_rslora: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        adapter_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        base = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_from(base, rank, alpha, dropout, use_rslora, adapter_dtype)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        adapter_dtype: torch.dtype | None = None,
    ) -> LoRALinear:
        """Wrap ``linear``, sharing its weight and bias parameter objects (no copy: tied
        weights stay tied) and freezing them."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__} wraps an nn.Linear, got {type(linear).__name__}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._init_from(linear, rank, alpha, dropout, use_rslora, adapter_dtype)
        return layer

    def _init_from(
        self,
        base: nn.Linear,
        rank: int,
        alpha: float,
        dropout: float,
        use_rslora: bool,
        adapter_dtype: torch.dtype | None,
    ) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.rank = rank
        self.alpha = alpha
        self.use_rslora = use_rslora
        self.dropout = dropout
        self.scaling = lora_scaling(rank, alpha, use_rslora)
        self.adapters_disabled = False
        # (activation, weight) fake quantizers of the frozen base (QAT + LoRA; see
        # tunesmith.training.qat): the base's input and weight are rounded, the adapters' not
        self.base_fake_quantizers: tuple[nn.Module | None, nn.Module] | None = None
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kwargs = {"device": self.weight.device, "dtype": adapter_dtype or self.weight.dtype}
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kwargs)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kwargs)
        self.reset_adapter_parameters()

    # -- parameters --------------------------------------------------------------------------

    @torch.no_grad()
    def reset_adapter_parameters(self) -> None:
        """PEFT's default init: ``A`` Kaiming-uniform (``a=sqrt(5)``), ``B`` zeros. Call after
        materialising a meta-built model (``to_empty``) and loading its base weights."""
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def adapter_parameter_names(self) -> tuple[str, ...]:
        """Local names of the trainable adapter parameters."""
        return ("lora_A.weight", "lora_B.weight")

    @property
    def is_quantized(self) -> bool:
        """Whether the base weight is stored as NF4."""
        return is_nf4(self.weight)

    def quantize_base(self) -> None:
        """Replace the base weight with a frozen NF4 copy (QLoRA); the bias stays dense."""
        if self.is_quantized:
            return
        self.weight = nn.Parameter(quantize_nf4(self.weight), requires_grad=False)

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight as a dense tensor (dequantised if NF4)."""
        return dequantize_nf4(self.weight, dtype)

    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` in float32, shape ``[out, in]``."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def effective_weight(self) -> torch.Tensor:
        """The weight this layer multiplies by, differentiable in the adapters: ``W + s·B A``
        (``W`` dequantised if NF4), in ``W``'s dtype; for a loss that owns the projection
        (an adapted ``lm_head`` under linear cross-entropy). Adapter dropout in training has
        no such weight: refused.

        >>> layer = LoRALinear.from_linear(nn.Linear(4, 3), rank=2, alpha=2)
        >>> torch.equal(layer.effective_weight(), layer.weight)  # B starts at zero
        True
        """
        base = self.dense_weight()
        if self.adapters_disabled:
            return base
        if self.training and not isinstance(self.lora_dropout, nn.Identity):
            raise ValueError(
                f"an adapter with dropout {self.dropout} has no single weight to hand to a loss "
                "that owns the projection (e.g. on lm_head with linear cross-entropy): set its "
                "dropout to 0 or leave the layer out of target_modules"
            )
        return base + (self.scaling * (self.lora_B.weight @ self.lora_A.weight)).to(base.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The dense weight that makes a plain linear layer equal to this one (eval mode)."""
        base = self.dense_weight()
        return (base.float() + self.delta_weight()).to(base.dtype)

    # -- forward -----------------------------------------------------------------------------

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b`` (the frozen layer alone)."""
        if self.is_quantized:
            out = linear_nf4(x, self.weight)
            return out if self.bias is None else out + self.bias
        if self.base_fake_quantizers is not None:
            activation, weight = self.base_fake_quantizers
            x = x if activation is None else activation(x)
            return F.linear(x, weight(self.weight), self.bias)
        return F.linear(x, self.weight, self.bias)

    def adapter_forward(self, x: torch.Tensor) -> torch.Tensor:
        """``B(A(x))`` computed in the adapters' dtype (no scaling, no dropout)."""
        return self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        if self.adapters_disabled:
            return out
        update = self.adapter_forward(self.lora_dropout(x))
        return out + (update * self.scaling).to(out.dtype)

    def extra_repr(self) -> str:
        quant = ", base=nf4" if self.is_quantized else ""
        rs = ", rslora" if self.use_rslora else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, rank={self.rank}, alpha={self.alpha}{rs}{quant}"
        )
