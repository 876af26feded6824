"""Attention backends (sdpa, varlen, flex, loop) equal each other and a hand-written reference."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from tunesmith.models import (
    gemma2,
    glm4,
    llama3,
    mistral,
    olmo3,
    phi3,
    qwen2_5,
    qwen3,
    qwen3_moe,
    smollm3,
)
from tunesmith.modules.attention_backends import (
    ATTENTION_BACKENDS,
    AttentionBatch,
    resolve_attention_backend,
    varlen_layout,
)
from tunesmith.modules.masks import build_attention_mask, document_causal_mask

FAMILIES = {
    "llama3": llama3.llama3_tiny,
    "qwen2_5": qwen2_5.qwen2_5_tiny,  # tied embeddings, qkv bias
    "qwen3": qwen3.qwen3_tiny,  # qk norm
    "qwen3_moe": qwen3_moe.qwen3_moe_tiny,
    "mistral": mistral.mistral_tiny,  # sliding window 8 < the longest document
    # soft-capped scores (a cap that bites): written out, or a score_mod inside flex
    "gemma2": partial(gemma2.gemma2_tiny, attn_logit_softcapping=0.5),
    "olmo3": olmo3.olmo3_tiny,  # three windowed layers to one global
    "phi3": partial(phi3.phi3_tiny, rope_scaling=None),  # partial rotary
    "glm4": glm4.glm4_tiny,  # interleaved partial rotary
    "smollm3": smollm3.smollm3_tiny,  # NoPE layers
}
# Row 0: documents of 3, 1, 12 tokens and 4 padding; row 1: 9 then 11 tokens.
DOCS = torch.tensor([[0] * 3 + [1] + [2] * 12 + [-1] * 4, [5] * 9 + [3] * 11])


def _reference(q, k, v, document_ids, window=None):
    """Softmax attention written out: a query sees earlier keys of its own document (within
    ``window``); padding queries get zeros."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (document_ids[:, :, None] == document_ids[:, None, :]) & (j <= i)
    if window is not None:
        allowed &= j > i - window
    allowed &= (document_ids >= 0)[:, :, None]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1))  # all -inf rows (padding) -> 0
    return weights @ v


def _positions(document_ids):
    out = torch.zeros_like(document_ids)
    for row in range(document_ids.shape[0]):
        for j in range(1, document_ids.shape[1]):
            same = document_ids[row, j] == document_ids[row, j - 1]
            out[row, j] = out[row, j - 1] + 1 if same else 0
    return out


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("backend", ["varlen", "loop", "sdpa"])
def test_each_backend_equals_the_written_out_attention_with_gradients(backend, window):
    """Random q, k, v (grouped heads, float64) against the reference, outputs and input
    gradients, on every real position; many documents of scattered lengths (several buckets)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 5, 7, 8, 9, 17, 30, 4, 2]  # 88 tokens + 8 padding, two rows of 48
    ids = [d for d, n in enumerate(lengths) for _ in range(n)] + [-1] * 8
    docs = torch.tensor(ids).view(2, 48)  # document 7 is cut by the row end: 13 + 4 tokens
    q = torch.randn(2, 4, 48, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 48, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 48, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    real = (docs >= 0)[:, None, :, None]
    mask = build_attention_mask(
        document_causal_mask(docs), batch_size=2, q_len=48, kv_len=48, sliding_window=window
    )
    batch = AttentionBatch(backend, mask=mask, document_ids=docs, sliding_window=window)
    grad_out = torch.randn(2, 4, 48, 8, dtype=torch.float64, generator=gen) * real

    def run(fn):
        out = fn()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        return out * real, grads

    ours, our_grads = run(lambda: batch.prepare()(q, k, v, batch))
    ref, ref_grads = run(lambda: _reference(q, k, v, docs, window))
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(our_grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    if backend == "varlen" or (backend == "loop" and window is None):
        # Padding outputs are zeros (sdpa's, and loop's when it falls back to sdpa because a
        # document is longer than the window, are finite but meaningless).
        assert ours.abs().sum() > 0
        assert batch.prepare()(q, k, v, batch)[1, :, 40:].abs().max() == 0


def _loss_and_grads(model, ids, **inputs):
    model.zero_grad()
    logits = model(ids, **inputs)
    labels = ids.roll(-1, dims=1)
    real = inputs.get("document_ids", torch.zeros_like(ids)) >= 0
    loss = F.cross_entropy(logits[real], labels[real])
    loss.backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_backends_agree_on_every_family_packed_and_unpacked(family, hf_tiny):
    """fp32 models: logits and every parameter's gradient are the same with each backend,
    for packed rows (with padding and, for mistral, documents longer than the window) and
    for plain padded rows; flex (forward only on CPU) gives the same logits."""
    model = hf_tiny.randomize(FAMILIES[family](), seed=3).train()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.spec.vocab_size, DOCS.shape, generator=gen)
    packed = {"document_ids": DOCS, "position_ids": _positions(DOCS)}
    real = DOCS >= 0

    results = {}
    for backend in ("sdpa", "varlen", "loop"):
        model.model.attention_backend = backend
        results[backend] = _loss_and_grads(model, ids, **packed)
    logits, grads = results["sdpa"]
    for backend in ("varlen", "loop"):
        other, other_grads = results[backend]
        torch.testing.assert_close(other[real], logits[real], rtol=1e-5, atol=1e-5)
        assert other_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        model.model.attention_backend = "flex"
        flex = model(ids, **packed)
        torch.testing.assert_close(flex[real], logits[real], rtol=1e-5, atol=1e-5)

        pad = torch.ones_like(ids)
        pad[0, :5] = 0  # left padding
        plain = {"attention_mask": pad, "position_ids": (pad.cumsum(-1) - 1).clamp_min(0)}
        unpacked = {}
        for backend in ("auto", "sdpa", "varlen", "flex"):
            model.model.attention_backend = backend
            unpacked[backend] = model(ids, **plain)[pad.bool()]
        for backend in ("sdpa", "varlen", "flex"):
            torch.testing.assert_close(unpacked[backend], unpacked["auto"], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_packed_rows_equal_separate_documents_with_the_default_backend(hf_tiny):
    """``auto`` on CPU is varlen: each packed document's logits are those of the document alone
    (mistral: the window of 8 applies inside the 12-token document)."""
    model = hf_tiny.randomize(mistral.mistral_tiny(), seed=2).eval()
    ids = torch.randint(0, 256, DOCS.shape, generator=torch.Generator().manual_seed(2))
    packed = model(ids, document_ids=DOCS, position_ids=_positions(DOCS))
    for row in range(2):
        for doc in DOCS[row].unique().tolist():
            if doc < 0:
                continue
            where = (DOCS[row] == doc).nonzero().squeeze(-1)
            alone = model(ids[row : row + 1, where])
            torch.testing.assert_close(packed[row, where], alone[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["varlen", "flex", "loop"])
def test_kv_cache_generation_is_unchanged_by_the_knob(backend, hf_tiny):
    """With a KV cache every knob resolves to sdpa: a padded prefill plus token-by-token decode
    still equals one full pass (mistral: window 8 < 14 tokens)."""
    model = hf_tiny.randomize(mistral.mistral_tiny(), seed=5).eval()
    model.model.attention_backend = backend
    ids = torch.randint(3, 256, (2, 14), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    full = model(ids, attention_mask=mask, position_ids=pos)
    cache = model.init_kv_cache(2, 14)
    steps = [model(ids[:, :6], attention_mask=mask[:, :6], position_ids=pos[:, :6], kv_cache=cache)]
    for t in range(6, 14):
        step = model(
            ids[:, t : t + 1],
            attention_mask=mask[:, : t + 1],
            position_ids=pos[:, t : t + 1],
            kv_cache=cache,
        )
        steps.append(step)
    stepwise = torch.cat(steps, dim=1)
    torch.testing.assert_close(stepwise[mask.bool()], full[mask.bool()], rtol=1e-5, atol=1e-5)


def test_varlen_layout_by_hand():
    docs = torch.tensor([[0, 0, 0, 1, -1], [2, 2, 2, 2, 2]])
    layout = varlen_layout(docs)
    # Buckets by length: (0, 1] -> doc 1; (2, 4] -> doc 0 (3 tokens); (4, 8] -> doc 2.
    assert [g.tolist() for g in layout.gather] == [[[3]], [[0, 1, 2]], [[5, 6, 7, 8, 9]]]
    assert layout.targets.tolist() == [3, 0, 1, 2, 5, 6, 7, 8, 9]
    same_bucket = varlen_layout(torch.tensor([[0, 0, 0, 1, 1, 1, 1, -1]]))
    assert [g.tolist() for g in same_bucket.gather] == [[[0, 1, 2, 2], [3, 4, 5, 6]]]
    assert [r.tolist() for r in same_bucket.real] == [[0, 1, 2, 4, 5, 6, 7]]
    windowed = varlen_layout(torch.tensor([[0, 0, 0, 0, 0]]), sliding_window=2)
    assert windowed.windows[0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    assert varlen_layout(torch.tensor([[0, 0, 1, 0]])) is None  # id 0 in two runs
    assert varlen_layout(torch.tensor([[-1, -1]])).targets.numel() == 0


def test_non_contiguous_ids_fall_back_to_the_mask():
    """An id in two runs attends across them (as document_causal_mask says): varlen uses the
    dense mask then, and equals the reference."""
    docs = torch.tensor([[0, 0, 1, 1, 0, 0, -1]])
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 7, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    mask = build_attention_mask(document_causal_mask(docs), batch_size=1, q_len=7, kv_len=7)
    batch = AttentionBatch("varlen", mask=mask, document_ids=docs)
    out = batch.prepare()(q, k, v, batch)
    torch.testing.assert_close(out[..., :6, :], _reference(q, k, v, docs)[..., :6, :])


def test_resolution_rules_and_bad_names():
    resolve = resolve_attention_backend
    assert resolve("auto", device="cpu", packed=True, cached=False) == "varlen"
    assert resolve("auto", device="cpu", packed=False, cached=False) == "sdpa"
    assert resolve("auto", device="cuda", packed=True, cached=False) == "flex"
    assert resolve("flex", device="cpu", packed=True, cached=True) == "sdpa"
    assert resolve("loop", device="cpu", packed=False, cached=False) == "sdpa"
    assert resolve("flex", device="cpu", packed=False, cached=False) == "flex"
    assert set(ATTENTION_BACKENDS) >= {"sdpa", "varlen", "flex", "loop"}
    model = llama3.llama3_tiny()
    with pytest.raises(ValueError, match="got 'fast'"):
        model.model.attention_backend = "fast"
    assert model.model.attention_backend == "auto"


def test_flex_refuses_gradients_on_cpu():
    model = llama3.llama3_tiny()
    model.model.attention_backend = "flex"
    ids = torch.randint(0, 256, DOCS.shape)
    with pytest.raises(NotImplementedError, match="use 'varlen'"):
        model(ids, document_ids=DOCS)
