import io
import math

import pytest
import torch

from tunesmith.training import constant_with_warmup, cosine_with_warmup, linear_with_warmup

PEAK = 1e-3


def _opt(lr: float = PEAK) -> torch.optim.Optimizer:
    # Two param groups with different lrs: the multiplier applies to each group's own lr.
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    return torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": lr / 10}], lr=lr)


def _run(sched, n: int) -> list[float]:
    """lr of group 0 at steps 0..n-1 (the value the optimizer uses for the update at that step)."""
    out = []
    for _ in range(n):
        out.append(sched.optimizer.param_groups[0]["lr"])
        sched.optimizer.step()
        sched.step()
    return out


# Independent closed forms, written out per phase.
def cosine_ref(s, w, t, floor=0.0, cycles=0.5):
    if s < w:
        return PEAK * s / w
    p = min(1.0, (s - w) / max(1, t - w))
    c = max(0.0, 0.5 * (1 + math.cos(2 * math.pi * cycles * p)))
    return PEAK * (floor + (1 - floor) * c)


def linear_ref(s, w, t, floor=0.0):
    if s < w:
        return PEAK * s / w
    return PEAK * (floor + (1 - floor) * max(0.0, (t - s) / (t - w)))


def constant_ref(s, w):
    return PEAK * (s / w if s < w else 1.0)


@pytest.mark.parametrize("w,t,floor", [(10, 50, 0.0), (0, 30, 0.0), (5, 40, 0.1), (7, 7, 0.0)])
def test_cosine_matches_closed_form(w, t, floor):
    sched = cosine_with_warmup(_opt(), num_warmup_steps=w, num_training_steps=t, min_lr_ratio=floor)
    got = _run(sched, t + 5)  # also a few steps past the end: held at the floor
    want = [cosine_ref(s, w, t, floor) for s in range(t + 5)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_cosine_landmarks_and_second_group():
    opt = _opt()
    sched = cosine_with_warmup(opt, num_warmup_steps=4, num_training_steps=12, min_lr_ratio=0.2)
    lrs0, lrs1 = [], []
    for _ in range(14):
        lrs0.append(opt.param_groups[0]["lr"])
        lrs1.append(opt.param_groups[1]["lr"])
        opt.step()
        sched.step()
    assert lrs0[0] == 0.0  # HF convention: step 0 has lr 0 during warmup
    assert lrs0[2] == pytest.approx(PEAK / 2)
    assert lrs0[4] == pytest.approx(PEAK)  # peak exactly at num_warmup_steps
    assert lrs0[8] == pytest.approx(PEAK * (0.2 + 0.8 * 0.5))  # half way: cos(pi/2) = 0
    assert lrs0[12] == pytest.approx(PEAK * 0.2)
    assert lrs0[13] == pytest.approx(PEAK * 0.2)  # past the end: held, not rising again
    assert lrs1 == pytest.approx([v / 10 for v in lrs0])


def test_cosine_num_cycles():
    sched = cosine_with_warmup(_opt(), num_warmup_steps=2, num_training_steps=22, num_cycles=1.0)
    got = _run(sched, 22)
    assert got == pytest.approx([cosine_ref(s, 2, 22, cycles=1.0) for s in range(22)])
    assert got[12] == pytest.approx(0.0, abs=1e-15)  # full cycle: trough in the middle
    assert got[21] > 0.9 * PEAK  # back near the peak at the end


@pytest.mark.parametrize("w,t,floor", [(10, 50, 0.0), (0, 20, 0.0), (3, 30, 0.25)])
def test_linear_matches_closed_form(w, t, floor):
    sched = linear_with_warmup(_opt(), num_warmup_steps=w, num_training_steps=t, min_lr_ratio=floor)
    got = _run(sched, t + 3)
    assert got == pytest.approx([linear_ref(s, w, t, floor) for s in range(t + 3)], abs=1e-15)
    assert got[t] == pytest.approx(PEAK * floor, abs=1e-15)


@pytest.mark.parametrize("w", [0, 1, 8])
def test_constant_matches_closed_form(w):
    sched = constant_with_warmup(_opt(), num_warmup_steps=w)
    assert _run(sched, 20) == pytest.approx([constant_ref(s, w) for s in range(20)])


@pytest.mark.parametrize(
    "make",
    [
        lambda o: cosine_with_warmup(
            o, num_warmup_steps=5, num_training_steps=40, min_lr_ratio=0.1
        ),
        lambda o: linear_with_warmup(o, num_warmup_steps=5, num_training_steps=40),
        lambda o: constant_with_warmup(o, num_warmup_steps=5),
    ],
)
def test_resume_continues_identical_sequence(make):
    uninterrupted = _run(make(_opt()), 40)

    opt = _opt()
    first = make(opt)
    head = _run(first, 17)
    buf = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "sched": first.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)  # the state dict holds plain numbers only

    # Resume order: build optimizer and scheduler as at the start, then load both states.
    opt2 = _opt()
    resumed = make(opt2)
    opt2.load_state_dict(state["opt"])
    resumed.load_state_dict(state["sched"])
    tail = _run(resumed, 23)
    assert head + tail == uninterrupted  # bitwise identical lr sequence


def test_state_dict_restores_schedule_parameters():
    opt = _opt()
    saved = cosine_with_warmup(opt, num_warmup_steps=3, num_training_steps=30, min_lr_ratio=0.1)
    _run(saved, 10)
    # Rebuilt with different numbers: the saved schedule's parameters win on load.
    opt2 = _opt()
    rebuilt = cosine_with_warmup(opt2, num_warmup_steps=8, num_training_steps=99)
    rebuilt.load_state_dict(saved.state_dict())
    opt2.param_groups[0]["lr"] = rebuilt.get_last_lr()[0]
    assert _run(rebuilt, 20) == pytest.approx([cosine_ref(s, 3, 30, 0.1) for s in range(10, 30)])


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_warmup_steps": -1, "num_training_steps": 10}, "num_warmup_steps"),
        ({"num_warmup_steps": 0, "num_training_steps": 0}, "num_training_steps"),
        ({"num_warmup_steps": 0, "num_training_steps": 10, "min_lr_ratio": 1.5}, "min_lr_ratio"),
    ],
)
@pytest.mark.parametrize("fn", [cosine_with_warmup, linear_with_warmup])
def test_bad_args_name_the_argument(fn, kwargs, name):
    with pytest.raises(ValueError, match=name):
        fn(_opt(), **kwargs)


def test_bad_args_other():
    with pytest.raises(ValueError, match="num_cycles"):
        cosine_with_warmup(_opt(), num_warmup_steps=0, num_training_steps=10, num_cycles=0)
    with pytest.raises(ValueError, match="num_warmup_steps"):
        constant_with_warmup(_opt(), num_warmup_steps=-3)
    with pytest.raises(ValueError, match="num_training_steps must be >= 1"):
        constant_with_warmup(_opt(), num_warmup_steps=2, num_training_steps=0)
    with pytest.raises(TypeError, match="num_warmup_steps"):
        linear_with_warmup(_opt(), num_warmup_steps=2.5, num_training_steps=10)


def test_warmup_longer_than_the_run_is_all_warmup():
    """max_steps=1 on a config with 2 warmup steps runs: the multiplier is s / warmup at every
    step of the run (0, then 1/4, 2/4, 3/4 for a 3-step run with warmup 4)."""
    for make in (cosine_with_warmup, linear_with_warmup):
        opt = _opt()
        sched = make(opt, num_warmup_steps=4, num_training_steps=3)
        seen = []
        for _ in range(4):
            seen.append(opt.param_groups[0]["lr"] / PEAK)
            opt.step()
            sched.step()
        assert seen == [0.0, 0.25, 0.5, 0.75]
