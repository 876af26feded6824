"""Unit contracts of the building blocks against independent references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from tunesmith.models import build_model, llama3, qwen2_5, qwen3, qwen3_moe
from tunesmith.modules import (
    Attention,
    KVCache,
    MoE,
    RMSNorm,
    RotaryEmbedding,
    build_attention_mask,
    causal_mask,
    document_causal_mask,
    document_position_ids,
    document_spans,
    load_balancing_loss,
    padding_position_ids,
    rope_inv_freq,
)

# --- norms -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_transformers(dtype):
    ours, theirs = RMSNorm(16, eps=1e-5), LlamaRMSNorm(16, eps=1e-5)
    weight = torch.randn(16)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    x = torch.randn(3, 5, 16, dtype=dtype) * 3
    assert torch.equal(ours(x), theirs(x))


# --- rotary embeddings -------------------------------------------------------------------

ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
}


def _hf_rope_config(scaling):
    params = {"rope_type": "default", "rope_theta": 50000.0} if scaling is None else dict(scaling)
    params["rope_theta"] = 50000.0
    return transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        rope_parameters=params,
    )


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_and_tables_match_transformers(case):
    scaling = ROPE_CASES[case]
    config = _hf_rope_config(scaling)
    inv_freq, scale = rope_inv_freq(32, 50000.0, scaling)
    if scaling is None:
        ref_inv_freq = 1.0 / 50000.0 ** (torch.arange(0, 32, 2).float() / 32)
        ref_scale = 1.0
    else:
        ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    assert torch.allclose(inv_freq, ref_inv_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)

    # Per-row positions, as with left padding.
    positions = torch.tensor([[0, 0, 0, 1, 2, 3], [5, 70, 200, 300, 400, 511]])
    cos, sin = RotaryEmbedding(32, 50000.0, scaling)(positions)
    ref_cos, ref_sin = LlamaRotaryEmbedding(config)(torch.zeros(1), positions)
    assert torch.allclose(cos, ref_cos, atol=1e-5, rtol=0)
    assert torch.allclose(sin, ref_sin, atol=1e-5, rtol=0)


def test_rope_buffer_stays_float32_and_survives_meta():
    rope = RotaryEmbedding(16, 10000.0, ROPE_CASES["llama3"])
    exact = rope.inv_freq.clone()
    rope.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, exact)
    with torch.device("meta"):
        meta_rope = RotaryEmbedding(16, 10000.0, ROPE_CASES["llama3"])
    with pytest.raises(RuntimeError, match="meta"):
        meta_rope(torch.arange(3))
    meta_rope.to_empty(device="cpu")
    assert torch.equal(meta_rope.inv_freq, exact)


# --- masks -------------------------------------------------------------------------------


def test_causal_and_window_masks():
    expected = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 4), expected)
    window = causal_mask(4, sliding_window=2).int().tolist()
    assert window == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_document_mask_and_positions_match_brute_force():
    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
    mask = document_causal_mask(docs)
    assert mask.shape == (2, 1, 6, 6)
    for b in range(2):
        for i in range(6):
            for j in range(6):
                assert bool(mask[b, 0, i, j]) == (j <= i and bool(docs[b, i] == docs[b, j]))
    assert document_position_ids(docs).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    pad = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert padding_position_ids(pad).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_build_attention_mask_fast_paths_and_padding():
    kw = {"batch_size": 2, "device": "cpu"}
    assert build_attention_mask(None, q_len=5, kv_len=5, **kw) is None  # is_causal path
    assert build_attention_mask(None, q_len=1, kv_len=9, **kw) is None  # one decode step
    assert build_attention_mask(None, q_len=5, kv_len=5, sliding_window=8, **kw) is None
    windowed = build_attention_mask(None, q_len=5, kv_len=5, sliding_window=2, **kw)
    assert torch.equal(windowed[0, 0], causal_mask(5, sliding_window=2))
    chunk = build_attention_mask(None, q_len=2, kv_len=5, **kw)
    assert torch.equal(chunk[0, 0], causal_mask(2, 5))

    pad = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    mask = build_attention_mask(pad, q_len=4, kv_len=4, **kw)
    assert torch.equal(mask[1, 0], causal_mask(4))
    assert torch.equal(mask[0, 0, 2:], torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.bool))
    assert mask[0, 0, :2].all()  # padding queries see everything: finite, ignored
    with pytest.raises(ValueError, match=r"\[2, 6\]"):
        build_attention_mask(pad, q_len=2, kv_len=6, **kw)
    with pytest.raises(ValueError, match="bool"):
        build_attention_mask(torch.zeros(2, 1, 4, 4), q_len=4, kv_len=4, **kw)


# --- attention ---------------------------------------------------------------------------


def _reference_attention(attn: Attention, x, cos, sin, allowed):
    """Naive GQA attention: explicit head repetition, masked softmax, no SDPA."""
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))

    def rotate(t):
        half = t.shape[-1] // 2
        return torch.cat([-t[..., half:], t[..., :half]], dim=-1)

    q = q * cos[:, None] + rotate(q) * sin[:, None]
    k = k * cos[:, None] + rotate(k) * sin[:, None]
    group = attn.num_heads // attn.num_kv_heads
    k = torch.stack([k[:, h // group] for h in range(attn.num_heads)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(attn.num_heads)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_matches_naive_reference_on_both_sdpa_paths(qk_norm):
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 8, qkv_bias=True, qk_norm=qk_norm)
    if qk_norm:
        attn.q_norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 6, 32)
    cos, sin = RotaryEmbedding(8)(torch.arange(6)[None].expand(2, 6))
    expected = _reference_attention(attn, x, cos, sin, causal_mask(6))
    fast = attn(x, cos, sin)  # is_causal path
    explicit = attn(x, cos, sin, mask=causal_mask(6)[None, None])
    assert torch.allclose(fast, expected, atol=1e-5, rtol=0)
    assert torch.allclose(explicit, expected, atol=1e-5, rtol=0)


def test_kv_cache_bookkeeping():
    cache = KVCache(num_layers=1, batch_size=1, max_seq_len=4, num_kv_heads=2, head_dim=3)
    k1, v1 = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    k, v = cache.update(0, k1, v1)
    assert torch.equal(k, k1) and torch.equal(v, v1)
    cache.advance(3)
    k2 = torch.randn(1, 2, 1, 3)
    k, _ = cache.update(0, k2, k2)
    assert torch.equal(k, torch.cat([k1, k2], dim=2))
    cache.advance(1)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.update(0, k2, k2)
    cache.reset()
    assert cache.seq_len == 0


# --- mixture of experts ------------------------------------------------------------------


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_moe_matches_per_token_reference(norm_topk_prob):
    torch.manual_seed(0)
    moe = MoE(16, 8, num_experts=6, top_k=2, norm_topk_prob=norm_topk_prob)
    x = torch.randn(2, 5, 16)
    out, logits = moe(x)
    tokens = x.reshape(-1, 16)
    assert torch.allclose(logits, tokens @ moe.gate.weight.T, atol=1e-6, rtol=0)
    expected = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        probs = logits[t].softmax(-1)
        top = probs.topk(2)
        weights = top.values / top.values.sum() if norm_topk_prob else top.values
        for w, e in zip(weights, top.indices):
            ex, e = moe.experts, int(e)  # expert e's weights: slice e of the stacked tensors
            h = F.silu(ex.gate_proj[e] @ tokens[t]) * (ex.up_proj[e] @ tokens[t])
            expected[t] += w * (ex.down_proj[e] @ h)
    assert torch.allclose(out.reshape(-1, 16), expected, atol=1e-5, rtol=0)


def test_load_balancing_loss_matches_definition():
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(6, 4, generator=gen) for _ in range(2)]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # By hand: count assignments and average probabilities over real tokens of all layers.
    counts, prob_sum, rows = torch.zeros(4), torch.zeros(4), 0
    for layer in layers:
        for r, keep in enumerate(mask.flatten().tolist()):
            if keep:
                probs = layer[r].softmax(-1)
                for e in probs.topk(2).indices.tolist():
                    counts[e] += 1
                prob_sum += probs
                rows += 1
    expected = 4 * ((counts / rows) * (prob_sum / rows)).sum()
    got = load_balancing_loss(layers, top_k=2, attention_mask=mask)
    assert torch.allclose(got, expected, atol=1e-6, rtol=0)


# --- TransformerLM: ties, meta builds, init ----------------------------------------------


def test_tied_head_state_dict_is_hf_shaped_and_loads_both_ways():
    model = qwen3.qwen3_tiny()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    keys = model.state_dict().keys()
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert "lm_head.weight" in llama3.llama3_tiny(tie_word_embeddings=False).state_dict()

    reference = torch.randn(1, 7).abs().mul(50).long()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    expected = model(reference)
    # Meta build + assignment (how checkpoints are loaded): tie and RoPE buffers come back.
    meta = qwen3.qwen3_tiny(device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.load_state_dict(state, strict=True, assign=True)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert torch.equal(meta(reference), expected)
    # A dict that also carries lm_head.weight (transformers' in-memory state_dict) loads too.
    with_head = dict(state, **{"lm_head.weight": state["model.embed_tokens.weight"]})
    qwen3.qwen3_tiny().load_state_dict(with_head, strict=True)
    # to_empty / dtype moves keep the tie.
    meta2 = qwen3.qwen3_tiny(device="meta").to_empty(device="cpu")
    assert meta2.lm_head.weight is meta2.model.embed_tokens.weight
    double = model.to(torch.float64)
    assert double.lm_head.weight is double.model.embed_tokens.weight


def test_build_model_initialises_like_transformers():
    spec = qwen2_5.spec(
        "qwen2_5_tiny", initializer_range=0.05, hidden_size=128, intermediate_size=256
    )
    model = build_model(spec)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.bias is None and torch.all(attn.q_proj.bias == 0)
    assert all(torch.all(m.weight == 1) for m in model.modules() if isinstance(m, RMSNorm))
    weights = torch.cat(
        [attn.q_proj.weight.flatten(), model.model.layers[1].mlp.up_proj.weight.flatten()]
    )
    assert weights.std().item() == pytest.approx(0.05, rel=0.05)
    assert abs(weights.mean().item()) < 0.005

    bf16 = build_model(spec, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32
    assert bf16(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


def test_moe_model_returns_router_logits_and_dense_returns_none():
    moe = qwen3_moe.qwen3_moe_tiny()
    logits, router = moe(torch.tensor([[1, 2, 3]]), output_router_logits=True)
    assert logits.shape == (1, 3, 256) and len(router) == 2  # layer 1 is dense
    _, dense_router = llama3.llama3_tiny()(torch.tensor([[1, 2]]), output_router_logits=True)
    assert dense_router == ()


def test_logits_to_keep_projects_only_the_last_positions():
    torch.manual_seed(0)
    model = llama3.llama3_tiny()
    ids = torch.randint(0, model.spec.vocab_size, (2, 9))
    full = model(ids)
    for keep in (1, 4, 9):
        assert torch.allclose(model(ids, logits_to_keep=keep), full[:, -keep:], atol=1e-6)
    assert model(ids, logits_to_keep=3).shape == (2, 3, model.spec.vocab_size)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)


def _packed_document_ids() -> torch.Tensor:
    return torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1, -1], [7, 7, 7, 7, 7, 7, 3, 3, 3, 3, 3]])


def test_packed_rows_attend_document_by_document_exactly_as_the_block_causal_mask():
    """The per-document path (``document_ids``) equals the explicit block-causal mask on
    every real position, in outputs and in every parameter's gradient; padding is zeros."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny().double()  # 4 heads over 2 KV heads: grouped
    ids = torch.randint(0, model.spec.vocab_size, (2, 11))
    docs = _packed_document_ids()
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0], [*range(6), *range(5)]])
    real = (docs >= 0)[..., None]

    def run(**inputs):
        model.zero_grad()
        out = model(ids, position_ids=positions, **inputs)
        (out * real).pow(2).sum().backward()
        return out * real, {n: p.grad.clone() for n, p in model.named_parameters()}

    by_document, grads = run(document_ids=docs)
    masked, mask_grads = run(attention_mask=document_causal_mask(docs))
    torch.testing.assert_close(by_document, masked, rtol=1e-10, atol=1e-10)
    for name in grads:
        torch.testing.assert_close(grads[name], mask_grads[name], rtol=1e-9, atol=1e-10)
    attn = model.model.layers[0].self_attn
    x = torch.randn(2, 11, model.spec.hidden_size, dtype=torch.float64)
    cos, sin = model.model.rotary_emb(positions, dtype=x.dtype)
    out = attn(x, cos, sin, spans=document_spans(docs))
    assert torch.equal(out[0, 9:], attn.o_proj(torch.zeros_like(x[0, 9:])))  # padding: zeros


def test_document_spans_and_their_fallbacks():
    assert document_spans(_packed_document_ids()) == [
        [(0, 3), (3, 5), (5, 9)],
        [(0, 6), (6, 11)],
    ]
    assert document_spans(torch.tensor([[0, 0, 1, 0]])) is None  # id 0 in two runs
    assert document_spans(torch.tensor([[-1, -1]])) == [[]]
    model = llama3.llama3_tiny()
    ids = torch.randint(0, model.spec.vocab_size, (1, 3))
    with pytest.raises(ValueError, match="document_ids must be shaped like input_ids"):
        model(ids, document_ids=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="takes no attention_mask"):
        model(
            ids, document_ids=torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 3)
        )
