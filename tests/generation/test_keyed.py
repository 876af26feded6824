"""Keyed sampling: a row's draws depend on its key and step alone, and follow softmax."""

from __future__ import annotations

import math

import torch

from tunesmith.generation.keyed import keyed_gumbel, keyed_sample, row_key


def test_rows_do_not_depend_on_their_batch():
    keys = torch.tensor([row_key(0, i) for i in range(6)])
    full = keyed_gumbel(keys, step=3, vocab_size=17)
    alone = torch.cat([keyed_gumbel(keys[i : i + 1], 3, 17) for i in range(6)])
    reordered = keyed_gumbel(keys.flip(0), 3, 17).flip(0)
    assert torch.equal(full, alone) and torch.equal(full, reordered)
    assert not torch.equal(full, keyed_gumbel(keys, step=4, vocab_size=17))  # a new step
    assert not torch.equal(full[0], full[1])  # a new key


def test_row_key_mixes_every_part_and_its_order():
    seen = {
        row_key(s, r, p, j) for s in range(3) for r in range(3) for p in range(3) for j in range(3)
    }
    assert len(seen) == 81
    assert row_key(1, 2) != row_key(2, 1) and row_key(5) != row_key(5, 0)
    assert row_key(2**40 + 1) != row_key(1)  # the high word counts


def test_noise_is_standard_gumbel():
    noise = keyed_gumbel(torch.arange(64), step=0, vocab_size=4096).double().flatten()
    euler_gamma = 0.5772156649
    # mean and variance of Gumbel(0, 1); 262144 draws: standard errors ~0.0025 and ~0.01
    assert abs(noise.mean().item() - euler_gamma) < 0.02
    assert abs(noise.var().item() - math.pi**2 / 6) < 0.06


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
