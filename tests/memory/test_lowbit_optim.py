"""Low-precision AdamW (bitsandbytes 8-bit, torchao 8-bit and 4-bit) on CPU: built from a
config ``_component_``, updates like float32 AdamW up to the quantisation of its moments,
trains, and saves/resumes bit for bit (torch.save and the recipe's distributed Checkpointer),
plain or inside :class:`OptimizerInBackward`.

torchao's optimizers ``torch.compile`` their per-parameter step; on this two-core CPU machine
Inductor needs tens of seconds per parameter shape, so the fast tests run that same step
function eagerly (``torch.compile`` patched to return the function: the quantised state
tensors dispatch their ops eagerly); ``test_torchao_compiled_step_matches_eager`` (slow) runs
the real compiled step.
"""

from __future__ import annotations

import io
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from tunesmith.config import instantiate
from tunesmith.models import llama3
from tunesmith.modules.losses import CrossEntropyLoss
from tunesmith.training.checkpoint.checkpointer import Checkpointer
from tunesmith.training.memory.optim_in_backward import OptimizerInBackward
from tunesmith.training.parallel.distributed import close_distributed, init_distributed

BNB_8BIT = "bitsandbytes.optim.AdamW8bit"
AO_8BIT = "torchao.optim.AdamW8bit"
AO_4BIT = "torchao.optim.AdamW4bit"
COMPONENTS = [BNB_8BIT, AO_8BIT, AO_4BIT]
# Relative error of the dequantised moments vs float32 AdamW's (measured ~0.016 / ~0.2).
MOMENT_TOLERANCE = {BNB_8BIT: 0.05, AO_8BIT: 0.05, AO_4BIT: 0.35}
# Serialized state size vs float32 AdamW's (8 bytes per element there).
STATE_SIZE_RATIO = {BNB_8BIT: 0.35, AO_8BIT: 0.35, AO_4BIT: 0.22}


@pytest.fixture(autouse=True)
def _eager_torchao(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


def _node(component, **options):
    return OmegaConf.create({"_component_": component, "lr": 1e-3, "weight_decay": 0.0, **options})


def _model(seed=0):
    torch.manual_seed(seed)
    # every matrix has >= 4096 elements (a multiple of 256), so its moments are quantised
    return llama3.llama3_tiny(intermediate_size=256, num_hidden_layers=1)


def _batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(n)]


def _step_loss(model, input_ids):
    labels = input_ids.roll(-1, dims=1)
    return CrossEntropyLoss()(model(input_ids), labels) / labels.numel()


def _train(model, optimizer, batches, in_backward=False):
    losses = []
    for input_ids in batches:
        loss = _step_loss(model, input_ids)
        loss.backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _dequantised_moments(component, state):
    if component == BNB_8BIT:
        from bitsandbytes.functional import dequantize_blockwise

        def deq(i):
            codes, absmax = state[f"state{i}"], state[f"absmax{i}"]
            blocksize = codes.numel() // absmax.numel()
            return dequantize_blockwise(
                codes, absmax=absmax, code=state[f"qmap{i}"], blocksize=blocksize
            )

        return deq(1), deq(2)
    return state["exp_avg"].dequantize(), state["exp_avg_sq"].dequantize()


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("component", COMPONENTS)
def test_built_from_config_and_updates_like_float32_adamw(component):
    """First update == float32 AdamW's (it uses the freshly computed moments); after three
    steps the stored moments equal float32 AdamW's up to their quantisation error; the state
    takes a fraction of the float32 state's bytes."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen)
    grads = [
        torch.randn(64, 256, generator=gen) * (1 + 3 * torch.rand(64, 1, generator=gen))
        for _ in range(3)
    ]

    def run(make):
        param = torch.nn.Parameter(weight.clone())
        opt = make([param])
        updates = []
        for grad in grads:
            before = param.detach().clone()
            param.grad = grad.clone()
            opt.step()
            updates.append(param.detach() - before)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        return opt, opt.state[param], updates, buffer.getbuffer().nbytes

    opt, state, updates, size = run(lambda params: instantiate(_node(component), params))
    assert type(opt).__module__.split(".")[0] == component.split(".")[0]
    assert type(opt).__name__ == component.rsplit(".", 1)[1]
    _, ref_state, ref_updates, ref_size = run(partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0))
    assert _rel(updates[0], ref_updates[0]) < 1e-4
    exp_avg, exp_avg_sq = _dequantised_moments(component, state)
    assert _rel(exp_avg, ref_state["exp_avg"]) < MOMENT_TOLERANCE[component]
    assert _rel(exp_avg_sq, ref_state["exp_avg_sq"]) < MOMENT_TOLERANCE[component]
    assert _rel(exp_avg, ref_state["exp_avg"]) > 1e-4  # really quantised
    assert size < STATE_SIZE_RATIO[component] * ref_size


@pytest.mark.parametrize("component", COMPONENTS)
def test_trains_a_tiny_model(component):
    model = _model()
    opt = instantiate(_node(component, lr=1e-2), model.parameters())
    batch = _batches(1)[0]
    losses = _train(model, opt, [batch] * 8)
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("component", COMPONENTS)
def test_torch_save_resume_is_bitwise(component):
    def fresh(seed=0):
        model = _model(seed)
        return model, instantiate(_node(component, lr=1e-2), model.parameters())

    batches = _batches(4)
    model, opt = fresh()
    _train(model, opt, batches)

    first, first_opt = fresh()
    _train(first, first_opt, batches[:2])
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, resumed_opt = fresh(seed=1)
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    _train(resumed, resumed_opt, batches[2:])
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)


@pytest.fixture
def ctx():
    context = init_distributed("cpu")
    yield context
    close_distributed()


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("component", COMPONENTS)
def test_distributed_checkpointer_resume_is_bitwise(component, in_backward, ctx, tmp_path):
    """The recipe's Checkpointer path: get/set_optimizer_state_dict + dcp.save/load."""

    def fresh(seed=0):
        model = _model(seed)
        build = partial(instantiate, _node(component, lr=1e-2))
        opt = (
            OptimizerInBackward(model.parameters(), build)
            if in_backward
            else build(model.parameters())
        )
        return model, opt

    batches = _batches(4)
    model, opt = fresh()
    _train(model, opt, batches, in_backward)

    first, first_opt = fresh()
    _train(first, first_opt, batches[:2], in_backward)
    checkpointer = Checkpointer(tmp_path, ctx)
    path = checkpointer.save(2, first, first_opt, {}, {"step": 2})
    resumed, resumed_opt = fresh(seed=1)
    checkpointer.load(path, resumed, resumed_opt, {})
    _train(resumed, resumed_opt, batches[2:], in_backward)
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)

    control, control_opt = fresh(seed=1)  # weights alone do not resume the run
    control.load_state_dict(first.state_dict())
    _train(control, control_opt, batches[2:], in_backward)
    assert not all(torch.equal(p, q) for p, q in zip(control.parameters(), model.parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("component", [AO_8BIT, AO_4BIT])
def test_torchao_compiled_step_matches_eager(component, monkeypatch):
    batches = _batches(3)
    model = _model()
    _train(model, instantiate(_node(component, lr=1e-2), model.parameters()), batches)
    monkeypatch.undo()  # the real torch.compile from here on
    compiled = _model()
    _train(compiled, instantiate(_node(component, lr=1e-2), compiled.parameters()), batches)
    # Fused arithmetic may round a value across a quantisation boundary: compare updates.
    for p, q, p0 in zip(compiled.parameters(), model.parameters(), _model().parameters()):
        assert _rel(p - p0, q - p0) < 1e-3
