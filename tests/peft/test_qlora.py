"""QLoRA / QDoRA: NF4 bases (torchao) behave as LoRA over the dequantised weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.peft.conftest import randomize_adapters_, token_batch
from tunesmith.models import from_hf
from tunesmith.modules.peft import (
    adapter_modules,
    adapter_state_dict,
    apply_lora,
    dequantize_nf4,
    disable_adapters,
    is_nf4,
    merge_adapters,
    quantize_nf4,
    trainable_parameters,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _qlora(folder, **kwargs) -> nn.Module:
    model = from_hf(folder).eval()
    return apply_lora(model, target_modules=TARGETS, rank=4, alpha=8, quantize_base="nf4", **kwargs)


def _lora_over_dequantised(qmodel: nn.Module, folder, **kwargs) -> nn.Module:
    """The same model in plain LoRA form, base weights = the NF4 weights dequantised."""
    model = from_hf(folder).eval()
    with torch.no_grad():
        for name, module in adapter_modules(qmodel).items():
            model.get_submodule(name).weight.copy_(dequantize_nf4(module.weight))
    apply_lora(model, target_modules=TARGETS, rank=4, alpha=8, **kwargs)
    model.load_state_dict(adapter_state_dict(qmodel), strict=False)
    return model


@pytest.mark.parametrize("use_dora", [False, True])
def test_qlora_forward_equals_lora_over_the_dequantised_base(qlora_dir, use_dora):
    qmodel = _qlora(qlora_dir, use_dora=use_dora)
    ids = token_batch()
    with torch.no_grad():
        with disable_adapters(qmodel):
            fresh_base = qmodel(ids)
        # A new adapter is a no-op on the quantised model (QDoRA magnitudes = dequantised norms).
        torch.testing.assert_close(qmodel(ids), fresh_base, rtol=1e-5, atol=1e-5)
    randomize_adapters_(trainable_parameters(qmodel), seed=2)
    reference = _lora_over_dequantised(qmodel, qlora_dir, use_dora=use_dora)
    with torch.no_grad():
        got, expected = qmodel(ids), reference(ids)
        assert (got - fresh_base).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # 4-bit storage: NF4 codes are half a byte per weight.
    for module in adapter_modules(qmodel).values():
        assert is_nf4(module.weight) and not module.weight.requires_grad
        assert module.weight.quantized_data.dtype == torch.uint8
        assert module.weight.quantized_data.numel() * 2 == module.weight.numel()


@pytest.mark.parametrize("use_dora", [False, True])
def test_merging_qlora_writes_dequantised_weights(qlora_dir, use_dora):
    qmodel = _qlora(qlora_dir, use_dora=use_dora)
    randomize_adapters_(trainable_parameters(qmodel), seed=3)
    ids = token_batch()
    layer = qmodel.model.layers[1].mlp.down_proj
    w, a, b = dequantize_nf4(layer.weight), layer.lora_A.weight, layer.lora_B.weight
    with torch.no_grad():
        expected_w = w + 2.0 * b @ a
        if use_dora:
            expected_w = (
                layer.lora_magnitude_vector[:, None]
                * expected_w
                / expected_w.norm(dim=1, keepdim=True)
            )
        adapted = qmodel(ids)
        merge_adapters(qmodel)
        merged = qmodel.model.layers[1].mlp.down_proj
        assert type(merged) is nn.Linear and not is_nf4(merged.weight)
        assert not any(is_nf4(t) for t in qmodel.state_dict().values())
        torch.testing.assert_close(merged.weight, expected_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(qmodel(ids), adapted, rtol=1e-5, atol=1e-5)


def test_qlora_training_keeps_the_nf4_base_and_lowers_the_loss(qlora_dir):
    torch.manual_seed(0)
    model = _qlora(qlora_dir).train()
    bases = {n: dequantize_nf4(m.weight).clone() for n, m in adapter_modules(model).items()}
    optimizer = torch.optim.AdamW(trainable_parameters(model).values(), lr=1e-2)
    ids = token_batch(seq=12, seed=5)
    losses = []
    for _ in range(6):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    for name, module in adapter_modules(model).items():
        assert is_nf4(module.weight) and module.weight.grad is None
        assert torch.equal(dequantize_nf4(module.weight), bases[name])
        assert module.lora_B.weight.abs().sum() > 0


def test_quantisation_errors_name_the_weight():
    model = nn.Sequential(nn.Linear(10, 10))
    with pytest.raises(ValueError, match=r"cannot quantise '0.weight' to NF4.*multiple of 64"):
        apply_lora(model, target_modules=["0"], rank=2, alpha=2, quantize_base=True)
    with pytest.raises(ValueError, match="meta device"):
        quantize_nf4(torch.empty(64, 64, device="meta"))


def test_small_weights_use_smaller_scaler_groups():
    w = torch.randn(32, 64)  # 32 blocks of 64: fewer than torchao's 256 scalers per group
    q = quantize_nf4(w)
    assert is_nf4(q)
    assert (dequantize_nf4(q) - w).abs().max() < 0.2 * w.abs().max()


def test_fsdp2_refuses_an_nf4_weight_it_cannot_split_and_names_it(qlora_dir):
    from tunesmith.training.parallel.distributed import check_nf4_shardable

    model = _qlora(qlora_dir)
    nf4 = {n: p for n, p in model.named_parameters() if type(p.data).__name__ == "NF4Tensor"}
    name, weight = next(iter(nf4.items()))
    groups = weight.numel() // (weight.data.block_size * weight.data.scaler_block_size)
    fits = [w for w in range(1, 9) if groups % w == 0 and weight.shape[0] % w == 0]
    misfit = next(w for w in range(2, 64) if groups % w)
    for world in fits:  # every weight of this model shares the layout of the first one checked
        if all(
            (p.numel() // (p.data.block_size * p.data.scaler_block_size)) % world == 0
            and p.shape[0] % world == 0
            for p in nf4.values()
        ):
            check_nf4_shardable(model, world)
    with pytest.raises(ValueError) as info:
        check_nf4_shardable(model, misfit)
    assert str(info.value).split(":")[0] in nf4 and f"over {misfit} ranks" in str(info.value)
