"""Keyed sampling: a row's draws depend on its key and step alone, and follow softmax."""

from __future__ import annotations

import torch

from tunesmith.generation import keyed
from tunesmith.generation.keyed import keyed_sample, keyed_sample_probs, keyed_uniform, row_key


def test_rows_do_not_depend_on_their_batch():
    keys = torch.tensor([row_key(0, i) for i in range(6)])
    full = keyed_uniform(keys, step=3)
    alone = torch.cat([keyed_uniform(keys[i : i + 1], 3) for i in range(6)])
    reordered = keyed_uniform(keys.flip(0), 3).flip(0)
    assert torch.equal(full, alone) and torch.equal(full, reordered)
    assert not torch.equal(full, keyed_uniform(keys, step=4))  # a new step
    assert len(set(full.tolist())) == 6  # a new key
    logits = torch.randn(6, 50)
    tokens = keyed_sample(logits, keys, 3)
    assert all(keyed_sample(logits[i : i + 1], keys[i : i + 1], 3) == tokens[i] for i in range(6))


def test_row_key_mixes_every_part_and_its_order():
    seen = {
        row_key(s, r, p, j) for s in range(3) for r in range(3) for p in range(3) for j in range(3)
    }
    assert len(seen) == 81
    assert row_key(1, 2) != row_key(2, 1) and row_key(5) != row_key(5, 0)
    assert row_key(2**40 + 1) != row_key(1)  # the high word counts


def test_uniforms_are_uniform_over_keys_and_steps():
    u = torch.cat([keyed_uniform(torch.arange(20000), step) for step in range(5)])
    assert u.min() > 0 and u.max() < 1
    # 100000 draws: each decile holds 10% +- 0.3% (3 standard errors ~0.28%)
    deciles = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / u.numel()
    assert torch.allclose(deciles, torch.full((10,), 0.1), atol=0.003), deciles


def test_draws_follow_the_softmax_and_respect_masked_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(5000, 5)
    keys = torch.tensor([row_key(7, i) for i in range(5000)])
    counts = torch.zeros(5)
    for step in range(8):
        counts += torch.bincount(keyed_sample(logits, keys, step), minlength=5)
    freq = counts / counts.sum()
    assert counts[4] == 0  # a -inf logit is never drawn
    # 40000 draws: the standard error of each frequency is below 0.0025
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_the_two_level_draw_is_the_full_cumulative_sum_s_and_never_a_zero(monkeypatch):
    """Chunk sums then one chunk pick the token one cumulative sum over the vocabulary picks;
    a draw rounded up to the total (float32) takes the last token with mass, not a zero."""
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(64, 1000) * 3, dim=-1)  # 1000 = 3 chunks of 256 + 232
    keys = torch.arange(64)
    for step in range(5):
        cdf = torch.cumsum(probs.double(), -1)
        u = keyed_uniform(keys, step)[:, None] * cdf[:, -1:]
        full = torch.searchsorted(cdf, u, right=True).squeeze(-1)
        two_level = keyed_sample_probs(probs, keys, step)
        assert (two_level != full).sum() <= 1  # a float32 rounding at a boundary, at most
    zeros_after = probs.clone()
    zeros_after[:, 700:] = 0.0  # the last chunk and the end of the one before: no mass
    monkeypatch.setattr(
        keyed, "keyed_uniform", lambda k, s: torch.ones(len(k), dtype=torch.float64)
    )
    tokens = keyed_sample_probs(zeros_after, keys, 0)
    assert torch.equal(tokens, torch.full((64,), 699))
