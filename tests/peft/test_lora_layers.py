"""LoRALinear / DoRALinear against the formulas of the LoRA, rsLoRA and DoRA papers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.peft.conftest import randomize_adapters_
from tunesmith.modules.peft import DoRALinear, LoRALinear, lora_scaling


def _layer(cls, *, bias: bool = True, seed: int = 0, **kwargs) -> tuple[nn.Linear, LoRALinear]:
    torch.manual_seed(seed)
    base = nn.Linear(24, 16, bias=bias)
    reference = nn.Linear(24, 16, bias=bias)
    reference.load_state_dict(base.state_dict())
    layer = cls.from_linear(base, **{"rank": 4, "alpha": 8, **kwargs})
    return reference, layer


@pytest.mark.parametrize("cls", [LoRALinear, DoRALinear])
def test_new_adapter_is_a_no_op_and_shares_the_base_parameters(cls):
    reference, layer = _layer(cls)
    x = torch.randn(3, 5, 24)
    assert torch.equal(layer.lora_B.weight, torch.zeros(16, 4))
    bound = 1 / math.sqrt(24)  # kaiming_uniform(a=sqrt(5)) on a fan-in of 24
    assert layer.lora_A.weight.abs().max() <= bound and layer.lora_A.weight.std() > bound / 4
    torch.testing.assert_close(layer(x), reference(x), rtol=0, atol=1e-6)
    assert not layer.weight.requires_grad and not layer.bias.requires_grad
    assert layer.state_dict().keys() >= {"weight", "bias", "lora_A.weight", "lora_B.weight"}


def test_scaling_rules():
    assert lora_scaling(8, 16) == 2.0
    assert lora_scaling(16, 8, use_rslora=True) == 2.0
    assert _layer(LoRALinear, rank=4, alpha=8, use_rslora=True)[1].scaling == 4.0


@pytest.mark.parametrize("use_rslora", [False, True])
def test_lora_forward_is_base_plus_scaled_low_rank_update(use_rslora):
    reference, layer = _layer(LoRALinear, use_rslora=use_rslora)
    randomize_adapters_(dict(layer.named_parameters()))
    a, b = layer.lora_A.weight, layer.lora_B.weight
    scaling = 8 / (math.sqrt(4) if use_rslora else 4)
    x = torch.randn(2, 7, 24)
    expected = reference(x) + scaling * (x @ a.T @ b.T)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    merged = reference.weight + scaling * b @ a
    torch.testing.assert_close(layer.merged_weight(), merged, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_dora_forward_follows_the_paper(bias):
    reference, layer = _layer(DoRALinear, bias=bias)
    w = reference.weight
    torch.testing.assert_close(layer.lora_magnitude_vector.detach(), w.norm(dim=1))
    randomize_adapters_(dict(layer.named_parameters()))
    a, b, m = layer.lora_A.weight, layer.lora_B.weight, layer.lora_magnitude_vector
    directed = w + 2.0 * b @ a  # scaling = 8 / 4
    w_dora = m[:, None] * directed / directed.norm(dim=1, keepdim=True)
    x = torch.randn(2, 7, 24)
    expected = x @ w_dora.T + (reference.bias if bias else 0)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.merged_weight(), w_dora, rtol=1e-5, atol=1e-6)


def test_dora_norm_is_detached_in_backward():
    """Section 4.3 of the DoRA paper: ||W + sBA|| is a constant for the gradient."""
    _, layer = _layer(DoRALinear, bias=False)
    randomize_adapters_(dict(layer.named_parameters()))
    x = torch.randn(4, 24)
    layer(x).square().sum().backward()
    got = layer.lora_A.weight.grad.clone()
    a = layer.lora_A.weight.detach().requires_grad_()
    b, m, w = layer.lora_B.weight.detach(), layer.lora_magnitude_vector.detach(), layer.weight
    norm = (w + 2.0 * b @ a).norm(dim=1).detach()
    out = (m / norm) * (x @ w.T + 2.0 * x @ a.T @ b.T)
    out.square().sum().backward()
    torch.testing.assert_close(got, a.grad, rtol=1e-5, atol=1e-6)


def test_dropout_only_touches_the_adapter_input():
    reference, layer = _layer(LoRALinear, dropout=0.5)
    x = torch.randn(64, 24)
    layer.train()
    with torch.no_grad():
        layer.lora_B.weight.zero_()
    torch.testing.assert_close(layer(x), reference(x))  # B = 0: dropout has nothing to act on
    randomize_adapters_(dict(layer.named_parameters()))
    assert not torch.allclose(layer(x), layer(x))
    layer.eval()
    assert torch.equal(layer(x), layer(x))


def test_disabled_layer_computes_exactly_the_base():
    reference, layer = _layer(DoRALinear)
    randomize_adapters_(dict(layer.named_parameters()))
    layer.adapters_disabled = True
    x = torch.randn(3, 24)
    assert torch.equal(layer(x), reference(x))


def test_fp32_adapters_on_a_bf16_base_keep_the_base_dtype():
    torch.manual_seed(0)
    base = nn.Linear(24, 16, dtype=torch.bfloat16)
    layer = LoRALinear.from_linear(base, rank=4, alpha=4, adapter_dtype=torch.float32)
    randomize_adapters_(dict(layer.named_parameters()))
    assert layer.lora_A.weight.dtype == torch.float32 and layer.weight.dtype == torch.bfloat16
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    expected = base(x).float() + x.float() @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


def test_constructor_builds_its_own_base_and_rejects_bad_arguments():
    layer = LoRALinear(8, 4, rank=2, alpha=4, bias=True)
    assert layer.weight.shape == (4, 8) and layer.bias.shape == (4,)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LoRALinear(8, 4, rank=0, alpha=4)
    with pytest.raises(ValueError, match="dropout"):
        LoRALinear(8, 4, rank=2, alpha=4, dropout=1.0)
    with pytest.raises(TypeError, match="wraps an nn.Linear"):
        LoRALinear.from_linear(nn.Embedding(4, 8), rank=2, alpha=4)
