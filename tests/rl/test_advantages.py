"""Advantage estimators against hand-computed values (GRPO's unbiased std, Dr. GRPO, RLOO's
leave-one-out mean, REINFORCE++'s batch std), tied and single-sample groups; the batch std
over 2 gloo ranks == one process on the concatenated batch; GAE == a per-row Python loop on
random padded data; masked whitening by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.gloo_world import run_on_ranks
from tunesmith.config import instantiate
from tunesmith.rl.advantages import BatchNormalized, GroupNormalized, LeaveOneOut, gae, whiten

# 3 groups of 4: mixed, all equal (0.1 does not average back to 0.1 exactly), one outlier
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1, 3.0, 0.0, 0.0, 1.0])
EPS = 1e-4


def _close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-7)


# -- GRPO / Dr. GRPO ---------------------------------------------------------------------------


def test_group_normalized_is_grpo_with_the_unbiased_std():
    # group 0: mean 0.5, deviations ±0.5, unbiased var 4 * 0.25 / 3 = 1/3
    # group 2: mean 1, deviations [2, -1, -1, 0], unbiased var 6 / 3 = 2
    s0, s2 = math.sqrt(1 / 3) + EPS, math.sqrt(2) + EPS
    out = GroupNormalized()(REWARDS, group_size=4)
    _close(out, [0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, 0, 0, 0, 0, 2 / s2, -1 / s2, -1 / s2, 0])
    assert (out[4:8] == 0).all()  # tied group: exactly zero, not rounding crumbs or NaN
    assert out.dtype == torch.float32


def test_dr_grpo_only_subtracts_the_group_mean():
    out = GroupNormalized(std_normalize=False)(REWARDS, group_size=4)
    _close(out, [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 2, -1, -1, 0])
    assert (out[4:8] == 0).all()


@pytest.mark.parametrize(
    "estimator",
    [GroupNormalized(), GroupNormalized(std_normalize=False), LeaveOneOut(), BatchNormalized()],
)
def test_a_tied_group_gets_exact_zeros(estimator):
    # in float32 mean([0.9] * 3) != 0.9: the subtraction alone would leave ±6e-8
    out = estimator(torch.tensor([0.9, 0.9, 0.9, 1.0, 0.0, 0.0]), group_size=3)
    assert out[:3].tolist() == [0.0, 0.0, 0.0]
    assert (out[3:] != 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("std_normalize", [True, False])
def test_group_of_one_has_zero_advantage(std_normalize):
    out = GroupNormalized(std_normalize=std_normalize)(torch.tensor([1.0, 0.0, 5.0]), 1)
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_integer_rewards_and_config():
    estimator = instantiate(
        {"_component_": "tunesmith.rl.advantages.GroupNormalized", "std_normalize": False}
    )
    _close(estimator(torch.tensor([2, 0]), group_size=2), [1.0, -1.0])


def test_group_layout_errors():
    with pytest.raises(ValueError, match="do not split into groups of group_size=4"):
        GroupNormalized()(torch.zeros(6), group_size=4)
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        GroupNormalized()(torch.zeros(6), group_size=0)
    with pytest.raises(ValueError, match=r"rewards must be \[n\]"):
        GroupNormalized()(torch.zeros(2, 3), group_size=3)


# -- RLOO --------------------------------------------------------------------------------------


def test_leave_one_out_baseline():
    out = LeaveOneOut()(REWARDS, group_size=4)
    # group 0: 1 - (0+0+1)/3, 0 - (1+0+1)/3; group 2: 3 - 1/3, 0 - 4/3, 0 - 4/3, 1 - 3/3
    _close(out, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, 8 / 3, -4 / 3, -4 / 3, 0])
    assert (out[4:8] == 0).all()
    # the identity r_i - mean(others) = G/(G-1) (r_i - mean)
    dr_grpo = GroupNormalized(std_normalize=False)(REWARDS, group_size=4)
    torch.testing.assert_close(out, dr_grpo * 4 / 3)
    _close(LeaveOneOut()(torch.tensor([1.0, 0.0]), group_size=2), [1.0, -1.0])


def test_leave_one_out_refuses_groups_of_one():
    with pytest.raises(ValueError, match="needs group_size >= 2"):
        LeaveOneOut()(torch.tensor([1.0, 0.0]), group_size=1)


# -- REINFORCE++ baseline ----------------------------------------------------------------------


def test_batch_normalized_by_hand():
    out = BatchNormalized()(REWARDS, group_size=4)
    # centred: [.5 -.5 -.5 .5 | 0 0 0 0 | 2 -1 -1 0]; sum 0, sum of squares 7, N 12
    std = math.sqrt(7 / 11) + EPS
    _close(
        out,
        [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0, 0, 0, 0, 2 / std, -1 / std, -1 / std, 0],
    )
    assert BatchNormalized()(torch.tensor([1.0, 2.0]), group_size=1).tolist() == [0.0, 0.0]
    assert BatchNormalized()(torch.tensor([1.0]), group_size=1).tolist() == [0.0]


def _batch_worker(rank: int) -> torch.Tensor:
    local = REWARDS[:8] if rank == 0 else REWARDS[8:]  # whole groups per rank
    return BatchNormalized(process_group=dist.group.WORLD)(local, group_size=4)


def test_batch_normalized_over_two_ranks_equals_one_process():
    parts = run_on_ranks(_batch_worker, 2)
    single = BatchNormalized()(REWARDS, group_size=4)
    torch.testing.assert_close(torch.cat(parts), single, rtol=1e-6, atol=1e-7)
    # and not what each rank alone would give
    assert not torch.allclose(parts[0], BatchNormalized()(REWARDS[:8], group_size=4))


# -- GAE ---------------------------------------------------------------------------------------


def _reference_gae(rewards, values, mask, gamma, lam):
    """Per row, a Python loop backwards over its trained positions; V after the last is 0."""
    b, t_len = len(rewards), len(rewards[0])
    adv = [[0.0] * t_len for _ in range(b)]
    for i in range(b):
        positions = [t for t in range(t_len) if mask[i][t]]
        running = 0.0
        for k in reversed(range(len(positions))):
            t = positions[k]
            next_value = values[i][positions[k + 1]] if k + 1 < len(positions) else 0.0
            delta = rewards[i][t] + gamma * next_value - values[i][t]
            running = delta + gamma * lam * running
            adv[i][t] = running
    returns = [
        [adv[i][t] + values[i][t] if mask[i][t] else 0.0 for t in range(t_len)] for i in range(b)
    ]
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


@pytest.mark.parametrize(
    ("gamma", "lam"), [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.9, 0.0), (0.5, 0.7)]
)
def test_gae_equals_a_per_row_loop(gamma, lam):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    b, t_len = 5, 9
    # prompt padding before, end padding after; one full row, one empty row
    spans = [(0, 9), (2, 7), (0, 1), (4, 9), (0, 0)]
    mask = torch.zeros(b, t_len, dtype=torch.bool)
    for i, (start, end) in enumerate(spans):
        mask[i, start:end] = True
    rewards = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    values = torch.randn(b, t_len, generator=g, dtype=torch.float64)
    rewards[~mask] = 1e6  # padding values must not leak in
    values[~mask] = -1e6
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-12, atol=1e-12)


def test_gae_by_hand():
    # one row of 3 tokens, reward 1 at the end; γ = 0.5, λ = 0.5; values 0.2, 0.4, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 0.8, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.5, lam=0.5)
    d2 = 1.0 - 0.8  # last token bootstraps to 0
    d1 = 0.0 + 0.5 * 0.8 - 0.4
    d0 = 0.0 + 0.5 * 0.4 - 0.2
    a2 = d2
    a1 = d1 + 0.25 * a2
    a0 = d0 + 0.25 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.2, a1 + 0.4, a2 + 0.8, 0.0]]))
    assert adv.dtype == torch.float32 and not adv.requires_grad


def test_gae_refuses_holes_and_bad_gamma():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    with pytest.raises(ValueError, match="mask row 1 has holes"):
        gae(torch.zeros(2, 4), torch.zeros(2, 4), mask)
    with pytest.raises(ValueError, match="gamma must be in"):
        gae(torch.zeros(2, 4), torch.zeros(2, 4), mask[:1].expand(2, 4), gamma=1.5)


# -- whiten ------------------------------------------------------------------------------------


def test_whiten_by_hand():
    x = torch.tensor([[1.0, 3.0, 1e6], [5.0, -1e6, -1e6]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # masked values 1, 3, 5: mean 3, unbiased var (4 + 0 + 4) / 2 = 4, std 2
    out = whiten(x, mask, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]).double())
    kept = whiten(x, mask, shift_mean=False, eps=0.0)
    torch.testing.assert_close(kept, torch.tensor([[2.0, 3.0, 0.0], [4.0, 0.0, 0.0]]).double())
    with pytest.raises(ValueError, match="at least 2 masked positions"):
        whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))
