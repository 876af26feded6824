"""Precision modes (tunesmith.training.precision): the config's refusals, the fp32 master copies
against a hand-written reference, their checkpoint state, and the fp32 loss paths on bf16
inputs."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tunesmith.config import ConfigError
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training.precision import (
    MasterWeightOptimizer,
    Precision,
    build_optimizer,
    cast_weights,
    check_precision,
    precision_problem,
)
from tunesmith.training.rules import check_rules
from tunesmith.training.settings import LOOP_RULES

BF16, FP32 = torch.bfloat16, torch.float32


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, Precision()),
        ({"weights": "bf16"}, Precision(BF16, None, BF16)),
        ({"weights": "bf16", "master_weights": "fp32"}, Precision(BF16, FP32, FP32)),
        (
            {"weights": "bf16", "master_weights": "fp32", "optimizer_states": "bf16"},
            Precision(BF16, FP32, BF16),
        ),
        ({"weights": "fp32", "save_dtype": "fp32"}, Precision(FP32, None, FP32, FP32)),
        ({"weights": "bf16", "save_dtype": "float32"}, Precision(BF16, None, BF16, FP32)),
    ],
)
def test_accepted_modes(value, expected):
    assert precision_problem(value) is None
    assert Precision.from_mapping(value) == expected


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"weights": "fp32", "master_weights": "fp32"}, "their own master copy"),
        ({"master_weights": "fp32"}, "needs weights: bf16"),
        ({"weights": "bf16", "master_weights": "bf16"}, "no master copy"),
        ({"weights": "bf16", "optimizer_states": "fp32"}, "needs master_weights: fp32"),
        ({"weights": "fp32", "optimizer_states": "bf16"}, "needs weights: bf16"),
        ({"weights": "fp16"}, "weights: expected 'fp32' or 'bf16', got 'fp16'"),
        ({"weights": "bf16", "save_dtype": "fp16"}, "narrower than the bf16 weights"),
        ({"weights": "fp32", "save_dtype": "bf16"}, "narrower than the fp32 weights"),
        ({"weights": "bf16", "save_dtype": "int8"}, "unknown save_dtype 'int8'"),
        ({"weight": "bf16"}, "unknown key 'weight'"),
    ],
)
def test_refused_modes_say_why(value, words):
    problem = precision_problem(value)
    assert problem is not None and words in problem
    with pytest.raises(ValueError, match="precision: "):
        Precision.from_mapping(value)


def test_the_loop_rule_reports_the_problem_with_its_key():
    rule = {"precision": LOOP_RULES["precision"]}
    cfg = OmegaConf.create({"precision": {"weights": "bf16", "optimizer_states": "fp32"}})
    (issue,) = check_rules(cfg, rule)
    assert str(issue).startswith("precision: optimizer_states: fp32 with bf16 weights")
    assert check_rules(OmegaConf.create({"precision": None}), rule) == []
    assert check_rules(OmegaConf.create({"precision": {"weights": "bf16"}}), rule) == []
    (issue,) = check_rules(OmegaConf.create({"precision": "bf16"}), rule)
    assert "expected a mapping of weights" in str(issue)


def test_combinations_with_other_keys_are_refused():
    bf16_master = {"weights": "bf16", "master_weights": "fp32"}
    with pytest.raises(ConfigError, match="mixed_precision: bf16 autocast with precision"):
        check_precision({"precision": {"weights": "bf16"}, "mixed_precision": "bf16"})
    with pytest.raises(ConfigError, match="optimizer_in_backward: true with precision"):
        check_precision({"precision": bf16_master, "optimizer_in_backward": True})
    # autocast over fp32 weights is the existing mixed precision, still allowed
    assert (
        check_precision({"precision": {"weights": "fp32"}, "mixed_precision": "bf16"}).weights
        == FP32
    )


def test_cast_weights_only_when_asked():
    model = nn.Linear(3, 2)
    assert cast_weights(model, Precision()).weight.dtype == FP32
    assert cast_weights(model, Precision(BF16)).weight.dtype == BF16
    assert model.bias.dtype == BF16


# ----------------------------------------------------------------------------- master weights


def _params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=gen) * 0.05, torch.randn(7, generator=gen) * 0.05]


def _grads(step: int, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=gen).to(BF16) for s in shapes]


def _reference_adamw(steps: int, *, lr: float, wd: float, state_dtype: torch.dtype):
    """AdamW written out by hand on fp32 masters: grads of the bf16 weights cast up, the moments
    kept (rounded) in ``state_dtype`` between steps; the bf16 weights are the rounded masters."""
    masters = [p.to(BF16).float() for p in _params()]  # the copies start at the bf16 weights
    m = [torch.zeros_like(p).to(state_dtype) for p in masters]
    v = [torch.zeros_like(p).to(state_dtype) for p in masters]
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):
        for i, (w, g) in enumerate(zip(masters, _grads(t, [p.shape for p in masters]))):
            g = g.float()
            w.mul_(1 - lr * wd)
            mi = m[i].float().mul(beta1).add(g, alpha=1 - beta1)
            vi = v[i].float().mul(beta2).addcmul(g, g, value=1 - beta2)
            denom = (vi.sqrt() / (1 - beta2**t) ** 0.5).add(eps)
            w.addcdiv_(mi, denom, value=-lr / (1 - beta1**t))
            m[i], v[i] = mi.to(state_dtype), vi.to(state_dtype)
    return masters, m, v


def _bf16_model() -> nn.ParameterList:
    return nn.ParameterList([nn.Parameter(p.to(BF16)) for p in _params()])


def _train(model, opt, steps, start=0, scheduler=None):
    for t in range(start + 1, start + steps + 1):
        for p, g in zip(model.parameters(), _grads(t, [p.shape for p in model.parameters()])):
            p.grad = g
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32-states", "bf16-states"])
def test_master_weights_match_a_hand_written_fp32_adamw(state_dtype):
    lr, wd, steps = 3e-3, 0.1, 6
    model = _bf16_model()
    opt = MasterWeightOptimizer(
        model.parameters(),
        lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=wd, foreach=False),
        state_dtype=state_dtype,
    )
    _train(model, opt, steps)
    masters, m, v = _reference_adamw(steps, lr=lr, wd=wd, state_dtype=state_dtype)
    for i, p in enumerate(model.parameters()):
        state = opt.state[p]
        assert p.dtype == BF16 and state["master"].dtype == FP32
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == state_dtype
        torch.testing.assert_close(state["master"], masters[i], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(
            state["exp_avg"], m[i], rtol=1e-2 if state_dtype == BF16 else 1e-6, atol=1e-7
        )
        assert torch.equal(p.detach(), state["master"].to(BF16))  # the rounded master
    # the updates are below bf16's resolution of some weights: pure bf16 AdamW loses them
    pure = _bf16_model()
    _train(pure, torch.optim.AdamW(pure.parameters(), lr=lr, weight_decay=wd), steps)
    assert any(not torch.equal(a, b) for a, b in zip(pure.parameters(), model.parameters()))


def test_the_lr_schedule_reaches_the_inner_optimizer():
    model = _bf16_model()
    opt = build_optimizer(
        Precision(BF16, FP32, FP32), model.parameters(), lambda p: torch.optim.SGD(p, lr=0.1)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0 if s == 0 else 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, 1, scheduler=sched)  # lr 0 at step 1: nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    _train(model, opt, 1, start=1, scheduler=sched)
    assert opt.inner.param_groups[0]["lr"] == 1.0 * 0.1
    assert not torch.equal(before[0], model[0].detach())


@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["fp32-states", "bf16-states"])
def test_checkpointed_state_resumes_bitwise(state_dtype):
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4)).to(BF16)
        model[0].weight.data = _params()[0][:4, :3].repeat(1, 2)[:, :4].to(BF16).contiguous()
        opt = MasterWeightOptimizer(
            model.parameters(),
            lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
            state_dtype=state_dtype,
        )
        return model, opt

    def run(model, opt, steps, start):
        for t in range(start + 1, start + steps + 1):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(t)).to(BF16)
            model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    model, opt = make()
    run(model, opt, 3, 0)
    saved = get_optimizer_state_dict(model, opt)
    assert {"master", "exp_avg", "exp_avg_sq", "step"} <= set(saved["state"]["0.weight"])
    assert saved["state"]["0.weight"]["master"].dtype == FP32
    assert saved["state"]["0.weight"]["exp_avg"].dtype == state_dtype
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = {"state": {k: {n: t.clone() for n, t in s.items()} for k, s in saved["state"].items()},
             "param_groups": saved["param_groups"]}  # fmt: skip
    run(model, opt, 3, 3)  # uninterrupted

    resumed, opt2 = make()  # a fresh run: weights from the "checkpoint", then its state
    resumed.load_state_dict(weights)
    set_optimizer_state_dict(resumed, opt2, saved)
    assert opt2.state[resumed[0].weight]["master"].dtype == FP32
    run(resumed, opt2, 3, 3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(opt.state[p]["master"], opt2.state[q]["master"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])


def test_a_never_stepped_optimizer_has_a_full_state_and_keeps_its_weights():
    model = _bf16_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = MasterWeightOptimizer(model.parameters(), lambda p: torch.optim.AdamW(p, lr=1.0))
    state = opt.state_dict()["state"]
    assert set(state) == {0, 1} and {"master", "exp_avg", "exp_avg_sq", "step"} <= set(state[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.param_groups[0]["lr"] == opt.inner.param_groups[0]["lr"] == 1.0


# ----------------------------------------------------------------------------- loss paths


def test_losses_on_bf16_inputs_compute_in_fp32():
    """CE and linear CE of bf16 hidden states/logits equal an fp32 log-softmax of the same
    (upcast) bf16 values, not a bf16 one."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 16, generator=gen).to(BF16)
    weight = (torch.randn(50, 16, generator=gen) * 0.3).to(BF16)
    labels = torch.randint(0, 50, (2, 6), generator=gen)
    labels[0, :2] = -100
    logits = hidden @ weight.T  # bf16 matmul, as the model's head would run it
    keep = labels != -100
    expected = -torch.log_softmax(logits.float(), -1)[keep].gather(1, labels[keep][:, None]).sum()
    bf16_logsoftmax = -torch.log_softmax(logits, -1)[keep].gather(1, labels[keep][:, None])
    got = CrossEntropyLoss()(logits, labels)
    assert got.dtype == FP32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-5)
    assert abs(bf16_logsoftmax.float().sum() - expected) > abs(got - expected)
    linear = LinearCrossEntropyLoss()(hidden, weight, labels)
    assert linear.dtype == FP32
    torch.testing.assert_close(linear, expected, rtol=1e-5, atol=1e-4)
