"""apply_lora on whole models: merge == unmerged, disable == base, only adapters train."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.peft.conftest import randomize_adapters_, token_batch
from tunesmith.models import from_hf
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.modules.peft import (
    DoRALinear,
    LoRALinear,
    adapter_modules,
    adapter_state_dict,
    apply_lora,
    disable_adapters,
    find_linear_targets,
    init_adapters,
    merge_adapters,
    trainable_parameters,
)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
VARIANTS = {
    "lora": {},
    "rslora": {"use_rslora": True},
    "dora": {"use_dora": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("folder", ["llama_dir", "qwen2_dir"])
def test_merged_logits_equal_adapted_logits(variant, folder, request, tmp_path):
    model = from_hf(request.getfixturevalue(folder)).eval()
    apply_lora(model, target_modules=ALL, rank=4, alpha=8, **VARIANTS[variant])
    randomize_adapters_(trainable_parameters(model), seed=1)
    ids = token_batch()
    with torch.no_grad():
        adapted = model(ids)
        with disable_adapters(model):
            base = model(ids)
        assert (adapted - base).abs().max() > 1e-2  # the adapters really change the output
        merge_adapters(model)
        assert not adapter_modules(model)
        torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)
    # A merged model is a plain HF model again: it saves and reloads as one.
    save_hf_checkpoint(model, tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(from_hf(tmp_path / "merged")(ids), adapted, rtol=1e-5, atol=1e-5)


def test_disable_adapters_gives_exactly_the_base_logits(llama_dir):
    ids = token_batch()
    plain = from_hf(llama_dir).eval()
    with torch.no_grad():
        expected = plain(ids)
    model = apply_lora(plain, target_modules=ALL, rank=4, alpha=8, use_dora=True)
    randomize_adapters_(trainable_parameters(model))
    with torch.no_grad(), disable_adapters(model) as same:
        assert same is model
        assert torch.equal(model(ids), expected)
    assert not any(m.adapters_disabled for m in adapter_modules(model).values())
    with pytest.raises(ValueError, match="no adapters"), disable_adapters(nn.Linear(2, 2)):
        pass


def test_base_keys_stay_hf_keys_and_only_adapters_are_trainable(llama_dir):
    model = from_hf(llama_dir)
    hf_keys = set(model.state_dict())
    apply_lora(model, target_modules=["q_proj", "v_proj"], rank=4, alpha=8, use_dora=True)
    keys = set(model.state_dict())
    assert hf_keys <= keys
    adapter_keys = keys - hf_keys
    assert adapter_keys == set(adapter_state_dict(model)) == set(trainable_parameters(model))
    assert "model.layers.1.self_attn.v_proj.lora_magnitude_vector" in adapter_keys
    assert len(adapter_keys) == 2 * 2 * 3  # 2 layers x (q, v) x (A, B, magnitude)
    assert isinstance(model.model.layers[0].self_attn.q_proj, DoRALinear)
    assert type(model.model.layers[0].self_attn.k_proj) is nn.Linear


def test_training_changes_only_adapters_and_lowers_the_loss(llama_dir):
    torch.manual_seed(0)
    model = apply_lora(from_hf(llama_dir), target_modules=ALL, rank=4, alpha=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(trainable_parameters(model).values(), lr=1e-2)
    ids = token_batch(batch=2, seq=12, seed=7)
    losses = []
    for _ in range(8):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    trainable = set(trainable_parameters(model))
    for key, value in model.state_dict().items():
        if key in trainable:
            assert not torch.equal(value, before[key]), key
        else:
            assert torch.equal(value, before[key]), f"{key} changed"
    # The frozen base takes no optimizer state.
    assert len(optimizer.state) == len(trainable)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def test_target_selection_rules(llama_dir):
    model = from_hf(llama_dir)
    layers = find_linear_targets(model, ["self_attn.o_proj", "lm_head"])
    assert layers == [
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
        "lm_head",
    ]
    everything = find_linear_targets(model, "all-linear")
    assert len(everything) == 2 * 7 and "lm_head" not in everything
    assert find_linear_targets(model, r"model\.layers\.1\..*_proj") == everything[7:]
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] match no linear layer.*q_proj"):
        find_linear_targets(model, ["q_proj", "qkv_proj"])
    apply_lora(model, target_modules=["q_proj"], rank=2, alpha=2)
    with pytest.raises(ValueError, match="already have adapters"):
        apply_lora(model, target_modules=["q_proj"], rank=2, alpha=2)
    assert find_linear_targets(model, ["k_proj"]) == [
        "model.layers.0.self_attn.k_proj",
        "model.layers.1.self_attn.k_proj",
    ]


def test_tied_head_and_bad_options_are_refused(tmp_path):
    from tests.models.conftest import write_tiny_hf_checkpoint

    write_tiny_hf_checkpoint(tmp_path, "qwen2", tie_word_embeddings=True)
    model = from_hf(tmp_path)
    with pytest.raises(ValueError, match=r"'lm_head.weight' is tied to \['model.embed_tokens"):
        apply_lora(model, target_modules=["lm_head"], rank=2, alpha=2)
    with pytest.raises(ValueError, match="quantize_base='int8' is not supported"):
        apply_lora(model, target_modules=["q_proj"], rank=2, alpha=2, quantize_base="int8")
    with pytest.raises(ValueError, match="adapter_dtype 'int8'"):
        apply_lora(model, target_modules=["q_proj"], rank=2, alpha=2, adapter_dtype="int8")


def test_meta_build_then_init_adapters(llama_dir):
    """Build adapters on the meta device (as before FSDP sharding), materialise, load, init."""
    from tunesmith.models import build_model
    from tunesmith.models.hf import spec_from_hf_folder

    model = build_model(spec_from_hf_folder(llama_dir), device="meta")
    apply_lora(model, target_modules=["q_proj", "down_proj"], rank=4, alpha=8, use_dora=True)
    model.to_empty(device="cpu")
    hf_keys = {k for k in model.state_dict() if ".lora_" not in k}
    assert len(hf_keys) == len(from_hf(llama_dir).state_dict())
    # Base weights come from the HF folder; adapters are then initialised on real data.
    load_state = from_hf(llama_dir).state_dict()
    model.load_state_dict(load_state, strict=False)
    model.init_buffers()
    init_adapters(model)
    for name, module in adapter_modules(model).items():
        assert isinstance(module, LoRALinear)
        assert torch.equal(module.lora_B.weight, torch.zeros_like(module.lora_B.weight))
        torch.testing.assert_close(
            module.lora_magnitude_vector, load_state[f"{name}.weight"].norm(dim=1)
        )
    ids = token_batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), from_hf(llama_dir)(ids), rtol=1e-5, atol=1e-5)
