"""torch.compile and the preflight step change how the SFT recipe runs, never what it computes:
a compiled run gives the eager run's weights, a run with a preflight step (through the CLI's
``--preflight``) gives the plain run's weights bit for bit, and the first step's time (compile,
warm-up) is logged apart from the throughput. The memory plan is printed at the start."""

from __future__ import annotations

import copy
import re

import pytest
import torch

from tests.recipes.sft_world import (
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_sft,
    sft_overrides,
)
from tunesmith.cli.main import main as cli_main
from tunesmith.config import ConfigError
from tunesmith.models import llama3
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training.memory.compile import (
    compile_loss,
    compile_model,
    compile_options,
    is_compiled,
)

# SGD, as in test_sft_memory_switches: Adam would magnify rounding-level differences.
STEPS = ["max_steps=3", "max_grad_norm=null", "lr_scheduler.num_warmup_steps=1",
         "optimizer=torch.optim.SGD", "optimizer.lr=0.5"]  # fmt: skip
# The cheap backend in the default set: dynamo traces each layer and AOTAutograd builds its
# joint forward/backward graph, run eagerly (inductor's code generation: the slow test).
COMPILE = "compile={backend: aot_eager}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    model_dir, data = make_model_dir(root), make_chat_data(root / "chat.jsonl", rows=24)
    plain = run_sft(model_dir, data, root / "plain", *STEPS)
    return model_dir, data, plain


def _assert_same_run(out, expected_out, exact: bool) -> None:
    weights, expected = final_weights(out), final_weights(expected_out)
    assert weights.keys() == expected.keys()
    for key in expected:
        if exact:
            assert torch.equal(weights[key], expected[key]), key
        else:
            torch.testing.assert_close(weights[key], expected[key], atol=2e-6, rtol=1e-5, msg=key)
    losses, expected_losses = read_metrics(out), read_metrics(expected_out)
    for step in (1, 2, 3):
        if exact:
            assert losses[step]["loss"] == expected_losses[step]["loss"]
        else:
            assert losses[step]["loss"] == pytest.approx(expected_losses[step]["loss"], rel=1e-5)


def test_compiled_run_gives_the_eager_run(world, tmp_path):
    model_dir, data, plain = world
    out = run_sft(model_dir, data, tmp_path / "compiled", *STEPS, COMPILE)
    _assert_same_run(out, plain, exact=False)
    metrics = read_metrics(out)
    # the first step (compilation) is timed apart and kept out of the throughput
    assert metrics[1]["first_step_s"] > 0 and "tokens_per_s" not in metrics[1]
    for step in (2, 3):
        assert metrics[step]["step_time_s"] > 0 and metrics[step]["tokens_per_s"] > 0
        assert "first_step_s" not in metrics[step]


def test_compile_works_with_checkpointing_and_linear_ce(world, tmp_path):
    model_dir, data, plain = world
    out = run_sft(
        model_dir,
        data,
        tmp_path / "all",
        *STEPS,
        COMPILE,
        "activation_checkpointing={mode: full}",
        "loss._component_=tunesmith.modules.losses.LinearCrossEntropyLoss",  # stays eager
    )
    _assert_same_run(out, plain, exact=False)


@pytest.mark.parametrize(
    "switches",
    [[], ["packed=true", "optimizer_in_backward=true"]],
    ids=["plain", "packed_optimizer_in_backward"],
)
def test_preflight_changes_nothing(world, tmp_path, capsys, switches):
    """Weights, losses, RNG and data order of a run with the preflight step are those of the
    same run without it, bit for bit; an optimizer in backward does not step during it."""
    model_dir, data, plain = world
    expected = (
        plain if not switches else run_sft(model_dir, data, tmp_path / "b", *STEPS, *switches)
    )
    capsys.readouterr()
    out = tmp_path / "preflight"
    args = ["run", "sft", "--config", "tiny", "--preflight"]
    assert cli_main([*args, *sft_overrides(model_dir, data, out, *STEPS, *switches)]) == 0
    _assert_same_run(out, expected, exact=True)

    printed = capsys.readouterr().out
    assert "memory plan: batch 4 x seq" in printed and "estimated peak" in printed
    match = re.search(r"peak ([\d.]+) MiB measured vs ([\d.]+) MiB estimated", printed)
    assert match, printed
    measured, estimated = float(match[1]), float(match[2])
    assert 0.65 * measured <= estimated <= 1.35 * measured


def test_plan_is_printed_without_preflight(world, tmp_path, capsys):
    model_dir, data, _ = world
    run_sft(model_dir, data, tmp_path / "out", "max_steps=2", "packed=true")
    printed = capsys.readouterr().out
    assert "memory plan: batch" in printed and "preflight:" not in printed


def test_bad_compile_config_names_the_key(world, tmp_path):
    model_dir, data, _ = world
    with pytest.raises(ConfigError, match=r"compile\.layer: unknown option"):
        run_sft(model_dir, data, tmp_path / "a", "max_steps=1", "compile={layer: true}")
    with pytest.raises(ConfigError, match="compile: must be true, false or a mapping"):
        compile_options("yes")
    assert (
        compile_options(False) is None and compile_options({"layers": False, "loss": False}) is None
    )
    assert compile_options(True).backend == "inductor"


# -- the compile functions -----------------------------------------------------------------------


def test_compile_model_keeps_names_and_refuses_twice():
    torch.manual_seed(0)
    model = llama3.llama3_tiny()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    assert compile_model(model, backend="eager") == 2
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert all(is_compiled(layer) for layer in model.model.layers)
    assert not is_compiled(model) and not is_compiled(model.lm_head)
    with pytest.raises(ValueError, match="compiled already"):
        compile_model(model, backend="eager")
    with pytest.raises(ValueError, match="found no decoder layer"):
        compile_model(torch.nn.Linear(2, 2))
    linear = LinearCrossEntropyLoss(num_chunks=3)  # its in-place chunk step stays eager
    assert compile_loss(linear) is linear and not linear.compile


def _loss_and_grads(model, loss_fn, ids, labels, linear=False):
    model.zero_grad(set_to_none=True)
    if linear:
        loss = loss_fn(model(ids, return_hidden_states=True), model.lm_head.weight, labels)
    else:
        loss = loss_fn(model(ids), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("linear", [False, True], ids=["cross_entropy", "linear_ce"])
def test_inductor_compiled_layers_and_loss_match_eager(linear):
    """Inductor-generated kernels (about a minute to compile on a small CPU, cached after)."""
    torch.manual_seed(0)
    model = llama3.llama3_tiny()
    ids = torch.randint(0, 256, (2, 16))
    labels = ids.roll(-1, dims=1)
    labels[:, :3] = -100
    loss_fn = LinearCrossEntropyLoss(num_chunks=2) if linear else CrossEntropyLoss()
    expected_loss, expected = _loss_and_grads(model, loss_fn, ids, labels, linear)
    compiled = copy.deepcopy(model)
    compile_model(compiled)
    if linear:  # compile_loss leaves it eager: ask for its compiled chunk step
        compiled_loss_fn = LinearCrossEntropyLoss(num_chunks=2, compile=True)
    else:
        compiled_loss_fn = compile_loss(copy.deepcopy(loss_fn))
    for _ in range(2):  # compiles, then runs the cached kernels
        loss, grads = _loss_and_grads(compiled, compiled_loss_fn, ids, labels, linear)
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
