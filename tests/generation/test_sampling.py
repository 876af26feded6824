"""Logits processors and sampling, checked against hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from tunesmith.generation.sampling import (
    Temperature,
    TopK,
    TopP,
    build_processors,
    policy_logprobs,
    sample,
)


def _logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def _kept(logits: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(logits[0].tolist()) if v != float("-inf")}


@pytest.mark.parametrize(
    ("probs", "p", "expected"),
    [
        # sorted: 0.40 (1), 0.25 (3), 0.20 (4), 0.10 (2), 0.05 (0)
        ([0.05, 0.40, 0.10, 0.25, 0.20], 0.30, {1}),
        ([0.05, 0.40, 0.10, 0.25, 0.20], 0.60, {1, 3}),
        ([0.05, 0.40, 0.10, 0.25, 0.20], 0.66, {1, 3, 4}),
        ([0.05, 0.40, 0.10, 0.25, 0.20], 0.90, {1, 3, 4, 2}),
        ([0.05, 0.40, 0.10, 0.25, 0.20], 0.97, {0, 1, 2, 3, 4}),
        ([0.05, 0.40, 0.10, 0.25, 0.20], 1.00, {0, 1, 2, 3, 4}),
        ([0.9, 0.05, 0.05], 0.10, {0}),
    ],
)
def test_top_p_keeps_minimal_set_on_hand_built_logits(probs, p, expected):
    assert _kept(TopP(p)(_logits_from_probs(probs))) == expected


def test_top_p_matches_brute_force_minimal_set():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 12, generator=gen) * 2
    for p in (0.2, 0.5, 0.8, 0.95):
        out = TopP(p)(logits)
        for row in range(logits.shape[0]):
            probs = torch.softmax(logits[row].double(), dim=-1).tolist()
            order = sorted(range(len(probs)), key=lambda i: -probs[i])
            # smallest k whose top-k mass reaches p
            k = next(k for k in range(1, len(probs) + 1) if sum(probs[i] for i in order[:k]) >= p)
            expected = set(order[:k])
            assert _kept(out[row : row + 1]) == expected, (p, row)
            assert sum(probs[i] for i in expected) >= p


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[0.1, 3.0, -2.0, 2.5, 1.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = TopK(2)(logits)
    assert _kept(out[:1]) == {1, 3}
    assert _kept(out[1:]) == {0, 1}
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])
    assert _kept(TopK(10)(logits[:1])) == {0, 1, 2, 3, 4}


def test_temperature_scales():
    assert torch.allclose(
        Temperature(0.5)(torch.tensor([[1.0, -2.0]])), torch.tensor([[2.0, -4.0]])
    )


def test_build_processors_order_and_greedy():
    assert build_processors(0.0, top_k=5, top_p=0.5) == []
    kinds = [type(p) for p in build_processors(0.7, top_k=5, top_p=0.5)]
    assert kinds == [Temperature, TopK, TopP]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": 1.0, "top_k": 0},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_p": 1.5},
    ],
)
def test_bad_settings_raise(kwargs):
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 4), **kwargs)


def test_bad_logits_shape_raises():
    with pytest.raises(ValueError, match="2-D"):
        sample(torch.zeros(4))


def test_greedy_and_raw_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, -1.0, 0.5]])
    out = sample(logits)
    assert out.tokens.tolist() == [1, 0]
    for row, tok in enumerate(out.tokens.tolist()):
        z = sum(math.exp(v) for v in logits[row].tolist())
        assert out.logprobs[row].item() == pytest.approx(logits[row, tok].item() - math.log(z))


def test_top_k_1_sampling_equals_greedy():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(256, 50, generator=gen)
    sampled = sample(logits, temperature=1.3, top_k=1, generator=gen)
    greedy = sample(logits)
    assert torch.equal(sampled.tokens, greedy.tokens)


def test_sampled_logprob_is_raw_policy_not_filtered():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    temperature = 0.8
    out = sample(
        logits, temperature=temperature, top_k=2, generator=torch.Generator().manual_seed(0)
    )
    tok = out.tokens.item()
    assert tok in (0, 1)
    scaled = [v / temperature for v in logits[0].tolist()]
    expected = scaled[tok] - math.log(sum(math.exp(v) for v in scaled))
    assert out.logprobs.item() == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(
        policy_logprobs(logits, temperature)[0, tok], torch.tensor(expected), atol=1e-6
    )


def test_same_seed_same_samples():
    logits = torch.randn(32, 40, generator=torch.Generator().manual_seed(3))
    a = sample(logits, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    b = sample(logits, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    c = sample(logits, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_temperature_sampling_matches_distribution():
    raw = [1.0, 0.0, -0.5, 2.0, 0.3]
    temperature = 1.7
    weights = [math.exp(v / temperature) for v in raw]
    expected = [w / sum(weights) for w in weights]
    n = 40_000
    logits = torch.tensor(raw).expand(n, -1)
    out = sample(logits, temperature=temperature, generator=torch.Generator().manual_seed(11))
    counts = torch.bincount(out.tokens, minlength=len(raw)).tolist()
    # 4 degrees of freedom: P(chi2 > 18.47) = 0.001
    assert _chi_square(counts, expected) < 18.47
    # A wrong temperature (plain softmax) is rejected by the same test.
    plain = [math.exp(v) / sum(math.exp(u) for u in raw) for v in raw]
    assert _chi_square(counts, plain) > 100


def test_top_p_sampling_matches_renormalised_nucleus():
    probs = [0.05, 0.40, 0.10, 0.25, 0.20]
    n = 30_000
    logits = _logits_from_probs(probs).expand(n, -1)
    out = sample(logits, temperature=1.0, top_p=0.6, generator=torch.Generator().manual_seed(5))
    counts = torch.bincount(out.tokens, minlength=5).tolist()
    assert counts[0] == counts[2] == counts[4] == 0
    # nucleus {1, 3} renormalised: 0.4/0.65, 0.25/0.65; 1 degree of freedom: P(chi2 > 10.83) = 0.001
    assert _chi_square([counts[1], counts[3]], [0.4 / 0.65, 0.25 / 0.65]) < 10.83
