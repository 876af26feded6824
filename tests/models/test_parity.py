"""Equivalence contracts: our models == transformers (fp32), cache == no cache, packed == unpacked."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tunesmith.models import (
    build_model,
    gemma2,
    gemma3,
    glm4,
    granite,
    llama3,
    mistral,
    olmo2,
    phi3,
    qwen3,
    qwen3_moe,
    smollm3,
    spec_from_hf_config,
)
from tunesmith.models.family import family_for
from tunesmith.models.fused_keys import fuse_state, fused_parts, split_state
from tunesmith.modules.masks import (
    document_causal_mask,
    document_position_ids,
    padding_position_ids,
)
from tunesmith.modules.moe import load_balancing_loss

ATOL = 1e-4
SEQ = 12
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Tiny original context: wavelengths of the 16-dim heads straddle 4..16, so every
    # branch of the llama3 rule (keep, blend, divide) applies at the test positions.
    "original_max_position_embeddings": 16,
}
# Odd sizes: width 48, six heads over two kv heads (GQA 3), vocab 131 (not a power of two).
ODD = {"vocab_size": 131, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2}
DENSE_CASES = {
    "llama_rope_llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "qwen2_tied_qkv_bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_mixed_windows": (
        "qwen3",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    ),
    "mistral_sliding_window": ("mistral", {"sliding_window": 4}),
    # Window 4, both soft-caps, query_pre_attn_scalar 20, alternating layers (conftest).
    "gemma2_caps_window": ("gemma2", {**ODD, "num_hidden_layers": 3, "attention_bias": True}),
    # Local/global RoPE bases, linear scaling on global layers, per-head (1 + w) qk-norm.
    "gemma3_text_local_rope": (
        "gemma3_text",
        {**ODD, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    ),
    "olmo2_post_norms": ("olmo2", ODD),
    # Three sliding layers then a global one; YaRN on the global layers only.
    "olmo3_yarn_global": (
        "olmo3",
        {
            **ODD,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),  # fmt: skip
    "granite_multipliers": ("granite", {**ODD, "tie_word_embeddings": True}),
    # Fused qkv/gate_up on disk, half rotary, LongRoPE past 8 positions, window 5.
    "phi3_longrope_partial": ("phi3", {**ODD, "num_attention_heads": 3, "num_key_value_heads": 1}),
    # Fused gate_up on disk, half of each head rotated in interleaved pairs, GLM's norms.
    "glm4_interleaved_partial": ("glm4", ODD),
    "smollm3_nope_window": ("smollm3", {**ODD, "use_sliding_window": True, "sliding_window": 4}),
}


def _batch(vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of SEQ tokens; row 0 is left-padded by 3 (ids, 0/1 mask, positions)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (2, SEQ), generator=gen)
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask, padding_position_ids(mask)


@pytest.fixture(scope="module", params=list(DENSE_CASES))
def dense_pair(request, hf_tiny):
    family, overrides = DENSE_CASES[request.param]
    hf = hf_tiny.model(family, seed=1, **overrides)
    ours = build_model(spec_from_hf_config(hf.config.to_dict())).eval()
    # Strict: every HF key has a parameter of the same name here and vice versa (a fused
    # projection on the HF side is the rows of our parts).
    ours.load_state_dict(_as_ours(ours, hf.state_dict()), strict=True)
    return request.param, hf, ours


def _as_ours(model, hf_state):
    fused = family_for(model.spec.model_type).fused
    return split_state(hf_state, fused_parts(model.state_dict(), fused))


@torch.no_grad()
def test_dense_logits_match_transformers(dense_pair):
    case, hf, ours = dense_pair
    ids, mask, pos = _batch(vocab=ours.spec.vocab_size)
    full = ids[1:]
    assert torch.allclose(ours(full), hf(full).logits, atol=ATOL, rtol=0)

    ours_padded = ours(ids, attention_mask=mask, position_ids=pos)
    hf_padded = hf(ids, attention_mask=mask, position_ids=pos).logits
    real = mask.bool()
    assert (ours_padded - hf_padded)[real].abs().max() < ATOL
    # The padded row equals the same tokens run alone (padding is invisible).
    assert torch.allclose(ours_padded[0, 3:], ours(ids[:1, 3:])[0], atol=ATOL, rtol=0)


def test_dense_gradients_match_transformers(dense_pair):
    """Gradients of one summed loss (random weights on every logit) agree, parameter by
    parameter, within a relative 1e-4 of the gradient's largest entry."""
    case, hf, ours = dense_pair
    ids, mask, pos = _batch(vocab=ours.spec.vocab_size, seed=8)
    weights = torch.randn(2, SEQ, ours.spec.vocab_size, generator=torch.Generator().manual_seed(9))
    grads = []
    for model, logits_of in ((hf, lambda out: out.logits), (ours, lambda out: out)):
        model.zero_grad(set_to_none=True)
        out = logits_of(model(ids, attention_mask=mask, position_ids=pos))
        (out * weights * mask[..., None]).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    theirs, mine = grads
    mine = fuse_state(mine, family_for(ours.spec.model_type).fused)  # HF names throughout
    assert mine.keys() == theirs.keys()
    for name, grad in mine.items():
        scale = theirs[name].abs().max()
        assert scale > 0, name  # every parameter takes part
        assert (grad - theirs[name]).abs().max() <= 1e-4 * scale, name


@torch.no_grad()
@pytest.mark.parametrize(
    ("case", "ablation"),
    [
        ("llama_rope_llama3", {"rope_scaling": None}),
        ("mistral_sliding_window", {"sliding_window": None}),
        ("qwen3_mixed_windows", {"layer_types": None}),
        ("gemma2_caps_window", {"attn_logit_softcapping": None}),
        ("gemma2_caps_window", {"final_logit_softcapping": None}),
        ("gemma2_caps_window", {"sliding_window": None, "layer_types": None}),
        ("gemma2_caps_window", {"attention_multiplier": None}),
        ("gemma3_text_local_rope", {"rope_local_theta": None}),
        ("gemma3_text_local_rope", {"rope_scaling": None}),
        ("granite_multipliers", {"embedding_multiplier": 1.0}),
        ("granite_multipliers", {"residual_multiplier": 1.0}),
        ("granite_multipliers", {"attention_multiplier": None}),
        ("granite_multipliers", {"logits_scaling": 1.0}),
        ("smollm3_nope_window", {"nope_layers": ()}),
        ("phi3_longrope_partial", {"partial_rotary_factor": 1.0, "rope_scaling": None}),
        ("phi3_longrope_partial", {"sliding_window": None}),
        ("phi3_longrope_partial", {"rope_scaling": None}),
        ("glm4_interleaved_partial", {"rope_interleaved": False}),
        ("olmo3_yarn_global", {"rope_local_theta": None}),
        ("olmo3_yarn_global", {"sliding_window": None, "layer_types": None}),
        ("glm4_interleaved_partial", {"partial_rotary_factor": 1.0}),
        ("smollm3_nope_window", {"sliding_window": None, "layer_types": None}),
    ],
)
def test_config_only_features_change_the_logits(hf_tiny, case, ablation):
    """The parity above would be vacuous if a feature that lives only in the config (rope
    scaling, a window, a cap, a multiplier, NoPE layers) did not matter: turning it off moves
    the logits by more than 100x the tolerance."""
    family, overrides = DENSE_CASES[case]
    hf = hf_tiny.model(family, seed=1, **overrides)
    spec = spec_from_hf_config(hf.config.to_dict())
    ablated = build_model(spec.replace(**ablation)).eval()
    ablated.load_state_dict(_as_ours(ablated, hf.state_dict()))
    ids = _batch(vocab=spec.vocab_size)[0][1:]
    assert (ablated(ids) - hf(ids).logits).abs().max() > 100 * ATOL


@pytest.fixture(scope="module")
def moe_pair(hf_tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    # Three layers with the middle one dense: router logits come from layers 0 and 2.
    hf = hf_tiny.write_checkpoint(
        folder, "qwen3_moe", seed=2, num_hidden_layers=3, mlp_only_layers=[1]
    )
    ours = build_model(spec_from_hf_config(hf.config.to_dict())).eval()
    # transformers 5 fuses experts in memory; the checkpoint on disk keeps per-expert keys.
    ours.load_state_dict(hf_tiny.read_safetensors(folder), strict=True)
    return hf, ours


@torch.no_grad()
def test_moe_logits_router_logits_and_aux_loss_match_transformers(moe_pair):
    hf, ours = moe_pair
    ids, mask, pos = _batch(seed=3)
    hf_out = hf(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    logits, router_logits = ours(
        ids, attention_mask=mask, position_ids=pos, output_router_logits=True
    )
    real = mask.bool()
    assert (logits - hf_out.logits)[real].abs().max() < ATOL
    assert len(router_logits) == len(hf_out.router_logits) == 2
    for mine, theirs in zip(router_logits, hf_out.router_logits):
        assert mine.shape == theirs.shape == (2 * SEQ, 8)
        assert (mine - theirs)[real.flatten()].abs().max() < ATOL
    aux = load_balancing_loss(router_logits, top_k=2, attention_mask=mask)
    assert torch.allclose(aux, hf_out.aux_loss.float(), atol=1e-5, rtol=0)

    full = ids[1:]
    hf_full = hf(full, output_router_logits=True)
    logits, router_logits = ours(full, output_router_logits=True)
    assert torch.allclose(logits, hf_full.logits, atol=ATOL, rtol=0)
    aux = load_balancing_loss(router_logits, top_k=2)
    assert torch.allclose(aux, hf_full.aux_loss.float(), atol=1e-5, rtol=0)


# --- our model against itself ------------------------------------------------------------


def _random_model(factory, hf_tiny, **overrides):
    model = factory(**overrides)
    return hf_tiny.randomize(model, seed=4).eval()


@torch.no_grad()
@pytest.mark.parametrize(
    "factory",
    [
        qwen3.qwen3_tiny,
        mistral.mistral_tiny,
        gemma2.gemma2_tiny,
        gemma3.gemma3_tiny,
        olmo2.olmo2_tiny,
        granite.granite_tiny,
        smollm3.smollm3_tiny,
        # LongRoPE changes every position's rotation once a forward reaches past the original
        # context (keys cached before the switch keep the short one, as in transformers), so
        # cache == full holds only without the switch.
        partial(phi3.phi3_tiny, rope_scaling=None),
        glm4.glm4_tiny,
    ],
    ids=[
        "qwen3",
        "mistral_window8",
        "gemma2",
        "gemma3",
        "olmo2",
        "granite",
        "smollm3",
        "phi3",
        "glm4",
    ],  # fmt: skip
)
def test_kv_cache_decode_equals_full_forward(factory, hf_tiny):
    """Prefill, a chunked prefill and token-by-token decode with a padded batch == one pass."""
    model = _random_model(factory, hf_tiny)
    total = 20  # longer than mistral_tiny's window of 8
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (2, total), generator=gen)
    mask = torch.ones(2, total, dtype=torch.long)
    mask[1, :4] = 0
    pos = padding_position_ids(mask)
    full = model(ids, attention_mask=mask, position_ids=pos)

    cache = model.init_kv_cache(batch_size=2, max_seq_len=total)
    pieces = []
    bounds = [0, 6, 9] + list(range(10, total + 1))  # prefill 6, chunk of 3, then 1 by 1
    for start, end in zip(bounds, bounds[1:]):
        pieces.append(
            model(
                ids[:, start:end],
                attention_mask=mask[:, :end],
                position_ids=pos[:, start:end],
                kv_cache=cache,
            )
        )
    assert cache.seq_len == total
    stepwise = torch.cat(pieces, dim=1)
    real = mask.bool()
    assert (stepwise - full)[real].abs().max() < 1e-5


@torch.no_grad()
def test_kv_cache_without_masks_equals_full_forward(hf_tiny):
    """Unpadded decoding uses the mask-free fast paths (SDPA is_causal, single token)."""
    model = _random_model(llama3.llama3_tiny, hf_tiny)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(6))
    full = model(ids)
    cache = model.init_kv_cache(1, 10)
    steps = [model(ids[:, :4], kv_cache=cache)]
    steps += [model(ids[:, i : i + 1], kv_cache=cache) for i in range(4, 10)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize(
    "factory",
    [llama3.llama3_tiny, qwen3_moe.qwen3_moe_tiny, gemma2.gemma2_tiny, smollm3.smollm3_tiny],
    ids=["llama", "qwen3_moe", "gemma2", "smollm3"],
)
def test_document_mask_packing_equals_separate_documents(factory, hf_tiny):
    model = _random_model(factory, hf_tiny)
    gen = torch.Generator().manual_seed(7)
    doc_a = torch.randint(0, 256, (1, 5), generator=gen)
    doc_b = torch.randint(0, 256, (1, 9), generator=gen)
    packed = torch.cat([doc_a, doc_b], dim=1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 9])
    positions = document_position_ids(doc_ids)
    assert positions.tolist() == [list(range(5)) + list(range(9))]

    logits = model(packed, attention_mask=document_causal_mask(doc_ids), position_ids=positions)
    assert torch.allclose(logits[:, :5], model(doc_a), atol=1e-5, rtol=0)
    assert torch.allclose(logits[:, 5:], model(doc_b), atol=1e-5, rtol=0)
    # Without the document mask the second document would see the first.
    leaky = model(packed, position_ids=positions)
    assert (leaky[:, 5:] - model(doc_b)).abs().max() > 1e-3
