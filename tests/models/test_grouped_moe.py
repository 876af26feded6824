"""The MoE layer with stacked experts (issue #16): equal to the per-expert loop it replaced
(values, gradients, router logits; experts that get no token), no host sync on the grouped
path, Hugging Face per-expert keys on disk both ways (our save -> transformers, transformers'
save -> ours, the training checkpointer), and LoRA refusing stacked experts clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

from tests.models.hf_moe import tiny_hf_qwen3_moe
from tunesmith.models import build_model, from_hf, qwen3_moe
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.modules.moe import (
    GroupedExperts,
    MoE,
    grouped_mm_supported,
    split_expert_keys,
    stack_expert_keys,
    stacked_state,
)
from tunesmith.modules.peft import apply_lora
from tunesmith.training.checkpoint.checkpointer import Checkpointer
from tunesmith.training.parallel.distributed import close_distributed, init_distributed


def _loop_moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer before #16, written out: route, then every expert on its own tokens in a
    Python loop (expert ``e``'s weights are slice ``e`` of the stacked tensors)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ moe.gate.weight.T
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, chosen = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(x.dtype)
    ex = moe.experts
    out = torch.zeros_like(tokens)
    for e in range(moe.num_experts):
        rows, slots = (chosen == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        t = tokens[rows]
        y = (F.silu(t @ ex.gate_proj[e].T) * (t @ ex.up_proj[e].T)) @ ex.down_proj[e].T
        out = out.index_add(0, rows, y * weights[rows, slots, None])
    return out.reshape(x.shape), logits


def _grads(module: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return [x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize(
    ("dtype", "hidden", "inter", "grouped"),
    [
        (torch.float32, 16, 8, True),  # rows of 64 / 32 bytes: torch._grouped_mm
        (torch.float64, 16, 8, False),  # no grouped kernel for float64: the loop fallback
        (torch.float32, 6, 5, False),  # rows not a multiple of 16 bytes: the fallback
    ],
)
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_layer_equals_the_per_expert_loop(dtype, hidden, inter, grouped, norm_topk_prob):
    torch.manual_seed(0)
    moe = MoE(hidden, inter, num_experts=8, top_k=2, norm_topk_prob=norm_topk_prob).to(dtype)
    with torch.no_grad():  # positive tokens: experts 5..7 always lose and get no token
        moe.gate.weight.abs_()
        moe.gate.weight[5:] *= -1
    x = torch.rand(2, 5, hidden, dtype=dtype) + 0.1
    assert grouped_mm_supported(x, moe.experts.gate_proj, moe.experts.down_proj) == grouped
    x.requires_grad_(True)
    g = torch.randn(2, 5, hidden, dtype=dtype)

    out, logits = moe(x)
    (out * g).sum().backward()
    new_grads = [t.clone() for t in _grads(moe, x)]
    x.grad = None
    moe.zero_grad(set_to_none=True)
    ref_out, ref_logits = _loop_moe(moe, x)
    (ref_out * g).sum().backward()

    chosen = logits.softmax(-1).topk(2).indices
    assert set(chosen.unique().tolist()) <= set(range(5))  # the empty experts are there
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=tol)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=tol)
    for mine, ref in zip(new_grads, _grads(moe, x), strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=tol)
    assert moe.experts.gate_proj.grad[5:].abs().max() == 0  # no token, zero gradient


def test_bf16_grouped_path_is_close_to_the_fp32_loop():
    torch.manual_seed(1)
    moe = MoE(32, 16, num_experts=4, top_k=2)
    x = torch.randn(3, 7, 32)
    ref, _ = _loop_moe(moe, x)
    out, _ = moe.to(torch.bfloat16)(x.bfloat16())
    assert (out.float() - ref).abs().max() < 0.03 * ref.abs().max()


def test_grouped_path_runs_on_meta_tensors_so_it_never_syncs_with_the_host():
    """On the meta device any read of a value on the host (``.item()``, ``.tolist()``, a
    data-dependent shape) fails; the bf16 grouped path runs forward and backward there."""
    with torch.device("meta"):
        moe = MoE(32, 16, num_experts=8, top_k=2).bfloat16()
        x = torch.randn(2, 6, 32, dtype=torch.bfloat16, requires_grad=True)
        out, logits = moe(x)
        out.sum().backward()
    assert out.shape == x.shape and out.is_meta and logits.shape == (12, 8)
    assert moe.experts.down_proj.grad.shape == (8, 32, 16)
    with torch.device("meta"):  # the fallback does read counts on the host
        fallback = MoE(6, 5, num_experts=2, top_k=1)
        with pytest.raises((RuntimeError, NotImplementedError)):
            fallback(torch.randn(1, 3, 6))


def test_empty_input_and_an_expert_with_every_token():
    moe = MoE(16, 8, num_experts=4, top_k=1)
    out, logits = moe(torch.randn(0, 16))
    assert out.shape == (0, 16) and logits.shape == (0, 4)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[2] = 1.0
    x = torch.rand(5, 16) + 0.1  # positive: expert 2 wins every token
    ex = moe.experts
    s = x.sum(-1, keepdim=True)  # logit of expert 2; the others are 0
    weight = s.exp() / (s.exp() + 3)
    expected = weight * (F.silu(x @ ex.gate_proj[2].T) * (x @ ex.up_proj[2].T)) @ ex.down_proj[2].T
    torch.testing.assert_close(moe(x)[0], expected, rtol=0, atol=1e-6)


# --- state dict: HF keys out, stacked in ---------------------------------------------------


def test_state_dict_has_hf_keys_and_loads_back():
    torch.manual_seed(2)
    moe = MoE(16, 8, num_experts=3, top_k=2)
    state = moe.state_dict()
    assert list(state) == ["gate.weight"] + [
        f"experts.{i}.{p}.weight" for i in range(3) for p in ("gate_proj", "up_proj", "down_proj")
    ]
    assert torch.equal(state["experts.1.down_proj.weight"], moe.experts.down_proj[1])
    assert state["experts.2.up_proj.weight"].shape == (8, 16)
    other = MoE(16, 8, num_experts=3, top_k=2)
    assert not other.load_state_dict({k: v.clone() for k, v in state.items()}).missing_keys
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert torch.equal(getattr(other.experts, name), getattr(moe.experts, name))
    with stacked_state(moe):
        stacked = moe.state_dict()
    assert sorted(stacked) == [
        "experts.down_proj",
        "experts.gate_proj",
        "experts.up_proj",
        "gate.weight",
    ]
    assert list(moe.state_dict()) == list(state)  # the switch is restored
    assert list(split_expert_keys(stacked)) == list(state)
    assert all(torch.equal(v, state[k]) for k, v in split_expert_keys(stacked).items())
    restacked = stack_expert_keys(state)
    assert all(torch.equal(restacked[k], v) for k, v in stacked.items())
    other.load_state_dict(stacked)  # the in-memory names load too


def test_streaming_load_over_several_calls_and_clear_errors():
    torch.manual_seed(3)
    moe = MoE(16, 8, num_experts=4, top_k=2)
    state = moe.state_dict()
    first = {k: v for k, v in state.items() if ".3." not in k}
    rest = {k: v for k, v in state.items() if ".3." in k}
    with torch.device("meta"):
        target = MoE(16, 8, num_experts=4, top_k=2)
    missing = target.load_state_dict(first, strict=False, assign=True).missing_keys
    assert missing == [f"experts.3.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    assert target.experts.up_proj.is_meta  # waits for expert 3
    assert target.load_state_dict(rest, strict=False, assign=True).missing_keys == ["gate.weight"]
    assert torch.equal(target.experts.up_proj, moe.experts.up_proj)

    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*experts\.3\.gate_proj\.weight"):
        MoE(16, 8, num_experts=4, top_k=2).load_state_dict(first)
    both = {**state, "experts.gate_proj": moe.experts.gate_proj.detach()}
    with pytest.raises(RuntimeError, match="both the stacked tensor and per-expert keys"):
        MoE(16, 8, num_experts=4, top_k=2).load_state_dict(both)
    with pytest.raises(ValueError, match=r"experts.up_proj: experts \[1\] are missing"):
        stack_expert_keys({k: v for k, v in state.items() if k != "experts.1.up_proj.weight"})


# --- with transformers, both ways ----------------------------------------------------------


def _hf_model(seed: int = 0) -> transformers.PreTrainedModel:
    return tiny_hf_qwen3_moe(seed, layers=3, experts=8, mlp_only_layers=(1,))


IDS = torch.tensor([[3, 17, 99, 5, 64, 8, 2, 41], [7, 7, 120, 33, 1, 90, 12, 6]])


def _keys(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return set(f.keys())


@torch.no_grad()
def test_transformers_save_loads_in_tunesmith_with_equal_logits(tmp_path):
    hf = _hf_model(seed=5)
    hf.save_pretrained(tmp_path / "hf")
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in _keys(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf").eval()
    assert ours.model.layers[0].mlp.experts.gate_proj.shape == (8, 32, 64)
    expected = hf(IDS).logits
    assert (ours(IDS) - expected).abs().max() < 1e-5
    assert (ours(IDS) - expected).abs().max() < 1e-3 * expected.abs().max()


@torch.no_grad()
def test_tunesmith_save_loads_in_transformers_with_equal_logits(tmp_path):
    spec = qwen3_moe.spec("qwen3_moe_tiny", vocab_size=128)
    ours = build_model(spec).eval()
    gen = torch.Generator().manual_seed(6)
    for p in ours.parameters():
        p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (p == 1).float())
    out = save_hf_checkpoint(ours, tmp_path / "ours")
    keys = _keys(out)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in keys
    assert not any(
        k.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj")) for k in keys
    )
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    assert not any(info.values()), info
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    torch.testing.assert_close(hf.eval()(IDS).logits, ours(IDS), rtol=0, atol=1e-5)


def test_training_checkpointer_saves_hf_keys_and_resumes_the_stacked_model(tmp_path):
    ctx = init_distributed("cpu")
    try:
        torch.manual_seed(7)
        model = qwen3_moe.qwen3_moe_tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(IDS).sum().backward()
        opt.step()
        checkpointer = Checkpointer(tmp_path, ctx)
        path = checkpointer.save(1, model, opt, {}, {"step": 1})
        assert "model.layers.0.mlp.experts.7.gate_proj.weight" in _keys(path)
        torch.manual_seed(8)
        other = qwen3_moe.qwen3_moe_tiny()
        other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
        checkpointer.load(path, other, other_opt, {})
        for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
            assert torch.equal(p, q), name
        state = other_opt.state[other.model.layers[0].mlp.experts.up_proj]
        torch.testing.assert_close(
            state["exp_avg"], opt.state[model.model.layers[0].mlp.experts.up_proj]["exp_avg"]
        )
    finally:
        close_distributed()


# --- init and LoRA -------------------------------------------------------------------------


def test_build_model_initialises_the_stacked_experts():
    model = qwen3_moe.qwen3_moe_tiny()
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, GroupedExperts)
    for w in (experts.gate_proj, experts.up_proj, experts.down_proj):
        assert torch.isfinite(w).all()
        assert (
            abs(w.std().item() - model.spec.initializer_range) < 0.2 * model.spec.initializer_range
        )


def test_lora_leaves_stacked_experts_alone_or_refuses_them():
    model = apply_lora(qwen3_moe.qwen3_moe_tiny(), target_modules="all-linear", rank=2, alpha=4)
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.1.mlp.gate_proj.lora_A.weight" in adapted  # the dense layer
    assert not any(".experts." in n for n in adapted)
    # LoRA on the experts' projections: tests/peft/test_lora_experts.py
    for targets in (["experts"], r".*mlp\.experts"):
        with pytest.raises(ValueError, match="experts container"):
            apply_lora(qwen3_moe.qwen3_moe_tiny(), target_modules=targets, rank=2, alpha=4)
