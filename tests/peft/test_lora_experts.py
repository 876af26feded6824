"""LoRA on stacked MoE experts: equal to per-expert LoRA linears, PEFT's folder format for
transformers' Qwen3-MoE (fused ``gate_up_proj``), merging, refusals."""

from __future__ import annotations

import math
import warnings

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from tests.models.hf_moe import tiny_hf_qwen3_moe
from tunesmith.models import from_hf, qwen3_moe
from tunesmith.models.peft_io import load_peft_adapter, save_peft_adapter
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.modules.moe import MoE
from tunesmith.modules.peft import (
    adapter_modules,
    adapter_state_dict,
    apply_lora,
    disable_adapters,
    merge_adapters,
    trainable_parameters,
)

PROJ = ("gate_proj", "up_proj", "down_proj")


def _randomise_adapters(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_parameters(model).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=torch.float64))


def _reference(moe: MoE, x: torch.Tensor, rank: int, alpha: float) -> torch.Tensor:
    """Per token and slot, expert ``e`` as three ``nn.Linear`` + LoRA built from the stacked
    tensors (the old per-expert layout)."""
    experts = moe.experts
    linears = {}
    for proj in PROJ:
        w = getattr(experts, proj)
        lora = experts.lora[proj]
        for e in range(experts.num_experts):
            lin = torch.nn.Linear(w.shape[2], w.shape[1], bias=False, dtype=w.dtype)
            lin.weight = torch.nn.Parameter(w[e])
            linears[proj, e] = (lin, lora.lora_A[e], lora.lora_B[e])
    scaling = alpha / rank

    def apply(proj: str, e: int, h: torch.Tensor) -> torch.Tensor:
        lin, a, b = linears[proj, e]
        return lin(h) + F.linear(F.linear(h, a), b) * scaling

    flat = x.reshape(-1, x.shape[-1])
    _, weights, chosen = moe.route(flat)
    rows = []
    for t in range(flat.shape[0]):
        out = torch.zeros_like(flat[t])
        for slot in range(moe.top_k):
            e, tok = int(chosen[t, slot]), flat[t]
            h = F.silu(apply("gate_proj", e, tok)) * apply("up_proj", e, tok)
            out = out + weights[t, slot].to(h.dtype) * apply("down_proj", e, h)
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["grouped", "loop"])
def test_lora_on_experts_equals_per_expert_lora_linears_values_and_gradients(dtype):
    torch.manual_seed(0)
    moe = MoE(32, 16, num_experts=4, top_k=2, norm_topk_prob=True).to(dtype)
    model = apply_lora(
        torch.nn.ModuleDict({"mlp": moe}), target_modules=list(PROJ), rank=4, alpha=8
    )
    assert sorted(trainable_parameters(model)) == sorted(
        f"mlp.experts.lora.{p}.lora_{ab}" for p in PROJ for ab in "AB"
    )
    lora = moe.experts.lora["gate_proj"]
    assert lora.lora_A.shape == (4, 4, 32) and lora.lora_B.shape == (4, 16, 4)
    assert moe.experts.lora["down_proj"].lora_B.shape == (4, 32, 4)
    _randomise_adapters(model, seed=1)
    x = torch.randn(2, 5, 32, dtype=dtype, requires_grad=True)
    cotangent = torch.randn(2, 5, 32, dtype=dtype)
    out, _ = moe(x)
    (out * cotangent).sum().backward()
    got = {n: p.grad.clone() for n, p in trainable_parameters(model).items()} | {"x": x.grad}
    x2 = x.detach().clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    ref = _reference(moe, x2, rank=4, alpha=8)
    (ref * cotangent).sum().backward()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    torch.testing.assert_close(out, ref, **tol)
    want = {n: p.grad for n, p in trainable_parameters(model).items()} | {"x": x2.grad}
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)
    assert moe.experts.gate_proj.grad is None  # frozen base


def test_new_adapters_follow_peft_init_and_are_a_no_op():
    torch.manual_seed(3)
    model = qwen3_moe.qwen3_moe_tiny()
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        base = model(ids)
    apply_lora(model, target_modules=["q_proj", *PROJ], rank=4, alpha=8)
    lora = model.model.layers[0].mlp.experts.lora["up_proj"]
    assert torch.count_nonzero(lora.lora_B) == 0
    bound = 1 / math.sqrt(lora.in_features)  # kaiming_uniform(a=sqrt(5)) = 1/sqrt(fan_in)
    for a in lora.lora_A:  # every expert drawn separately, spanning the bound
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound
    assert not torch.equal(lora.lora_A[0], lora.lora_A[1])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), base, rtol=0, atol=0)
    assert all("lora" in n for n in trainable_parameters(model))


def _hf_model(seed: int, mlp_only_layers: tuple[int, ...] = ()) -> transformers.PreTrainedModel:
    return tiny_hf_qwen3_moe(seed, mlp_only_layers=mlp_only_layers)


IDS = torch.tensor([[3, 17, 99, 5, 64, 8, 2, 41], [7, 7, 120, 33, 1, 90, 12, 6]])


@pytest.mark.parametrize(
    "targets", [["q_proj", *PROJ], ["down_proj"], ["gate_proj", "up_proj"]], ids=str
)
def test_peft_folder_matches_peft_and_loads_in_peft_and_back(tmp_path, targets):
    hf = _hf_model(seed=4)
    hf.save_pretrained(tmp_path / "hf")
    ours = apply_lora(from_hf(tmp_path / "hf").eval(), target_modules=targets, rank=2, alpha=4)
    _randomise_adapters(ours, seed=5)
    folder = save_peft_adapter(ours, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = peft.get_peft_model(
            _hf_model(seed=4), peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets)
        )
        want = {k: v.shape for k, v in peft.get_peft_model_state_dict(reference).items()}
        got = {k: v.shape for k, v in load_file(folder / "adapter_model.safetensors").items()}
        assert got == want
        # peft computes our adapters from the folder: equal logits
        loaded = peft.PeftModel.from_pretrained(_hf_model(seed=4), folder).eval()
    with torch.no_grad():
        expected = ours(IDS)
        with disable_adapters(ours):
            base = ours(IDS)
        assert (expected - base).abs().max() > 1e-3  # the adapters do something
        torch.testing.assert_close(loaded(IDS).logits, expected, rtol=0, atol=2e-5)
        # ... and our loader reads it back, into a plain model and into an adapted one
        back = load_peft_adapter(from_hf(tmp_path / "hf").eval(), folder)
        assert sorted(adapter_state_dict(back)) == sorted(adapter_state_dict(ours))
        for k, v in adapter_state_dict(ours).items():
            torch.testing.assert_close(adapter_state_dict(back)[k], v, rtol=0, atol=0, msg=k)
        again = apply_lora(from_hf(tmp_path / "hf").eval(), target_modules=targets, rank=2, alpha=4)
        load_peft_adapter(again, folder)
        torch.testing.assert_close(again(IDS), expected, rtol=0, atol=0)


def test_merge_equals_the_unmerged_logits():
    torch.manual_seed(6)
    model = apply_lora(
        qwen3_moe.qwen3_moe_tiny(), target_modules=["v_proj", *PROJ], rank=4, alpha=8
    )
    _randomise_adapters(model, seed=7)
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        unmerged = model(ids)
        merge_adapters(model)
        assert not adapter_modules(model)
        assert not any("lora" in k for k in model.state_dict())
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in model.state_dict()
        torch.testing.assert_close(model(ids), unmerged, rtol=1e-5, atol=1e-5)


def test_dense_fused_peft_adapter_is_refused(tmp_path):
    hf = _hf_model(seed=8)
    hf.save_pretrained(tmp_path / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = peft.get_peft_model(
            hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(PROJ))
        )
        with torch.no_grad():
            for name, p in trained.named_parameters():
                if "lora_" in name:
                    p.normal_()  # a dense lora_B mixes gate and up
        trained.save_pretrained(tmp_path / "peft")
    with pytest.raises(CheckpointError, match="dense fused gate_up_proj"):
        load_peft_adapter(from_hf(tmp_path / "hf"), tmp_path / "peft")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_modules": ["gate_proj"]}, "without .*up_proj"),
        ({"target_modules": ["experts"]}, "experts container"),
        ({"target_modules": r".*mlp\.experts"}, "experts container"),
        ({"target_modules": r".*experts\.0\.down_proj"}, "only some experts"),
        ({"target_modules": list(PROJ), "use_dora": True}, "DoRA on experts"),
        ({"target_modules": list(PROJ), "quantize_base": "nf4"}, "QLoRA"),
    ],
)
def test_clear_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        apply_lora(qwen3_moe.qwen3_moe_tiny(), rank=2, alpha=4, **kwargs)


def test_all_linear_leaves_the_experts_alone():
    model = apply_lora(qwen3_moe.qwen3_moe_tiny(), target_modules="all-linear", rank=2, alpha=4)
    assert not any(".experts." in n for n in trainable_parameters(model))


def test_dense_and_expert_mlps_round_trip_through_our_folder(tmp_path):
    # peft 0.21 maps gate/up/down_proj to the experts' fused parameters on transformers 5's
    # Qwen3-MoE and drops the dense MLP layers' adapters; ours keeps both and reads them back.
    _hf_model(seed=9, mlp_only_layers=(1,)).save_pretrained(tmp_path / "hf")
    ours = apply_lora(from_hf(tmp_path / "hf").eval(), target_modules=list(PROJ), rank=2, alpha=4)
    adapted = set(trainable_parameters(ours))
    assert "model.layers.1.mlp.gate_proj.lora_A.weight" in adapted
    assert "model.layers.0.mlp.experts.lora.gate_proj.lora_A" in adapted
    _randomise_adapters(ours, seed=10)
    folder = save_peft_adapter(ours, tmp_path / "adapter")
    back = load_peft_adapter(from_hf(tmp_path / "hf").eval(), folder)
    with torch.no_grad():
        torch.testing.assert_close(back(IDS), ours(IDS), rtol=0, atol=0)


def test_rslora_scaling_survives_the_fused_gate_up_format(tmp_path):
    _hf_model(seed=11).save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf").eval()
    apply_lora(ours, target_modules=list(PROJ), rank=4, alpha=3, use_rslora=True)
    assert ours.model.layers[0].mlp.experts.lora["up_proj"].scaling == 1.5  # 3 / sqrt(4)
    _randomise_adapters(ours, seed=12)
    folder = save_peft_adapter(ours, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(_hf_model(seed=11), folder).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, ours(IDS), rtol=0, atol=2e-5)
