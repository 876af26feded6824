"""The Trainer computes the gradient norm only when clipping or logging needs it, and its
update equals a hand-written loop's bit for bit either way (torch's own ``clip_grad_norm_``
in the loop); its phases are named profiler ranges."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import make_counting_data, make_model_dir, read_metrics, run_sft
from tests.training.test_trainer import CTX, SPEC, NextToken, RandomTokens, config
from tunesmith.models.builder import build_model
from tunesmith.training import cosine_with_warmup
from tunesmith.training.rules import check_rules
from tunesmith.training.settings import LOOP_RULES
from tunesmith.training.trainer import LossOutput, Trainer

STEPS = 3


def run_trainer(tmp_path, **overrides) -> tuple[Trainer, list[dict[str, float]]]:
    torch.manual_seed(0)
    source = RandomTokens()
    trainer = Trainer.from_config(
        config(tmp_path, max_steps=STEPS, **overrides),
        CTX,
        model=build_model(SPEC),
        objective=NextToken(),
        source=source,
    )
    return trainer, [trainer.step(source.next_step()) for _ in range(STEPS)]


def hand_written(max_norm: float | None) -> tuple[torch.nn.Module, list[float]]:
    """The same steps in plain PyTorch: the summed loss over the step's token count, backward
    per micro-batch, torch's ``clip_grad_norm_`` when ``max_norm`` is set, AdamW; returns the
    model and each step's gradient norm (before clipping)."""
    torch.manual_seed(0)
    model, source = build_model(SPEC), RandomTokens()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    schedule = cosine_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=STEPS)
    norms = []
    for _ in range(STEPS):
        micro_batches = source.next_step()
        count = sum(mb["input_ids"][:, 1:].numel() for mb in micro_batches)
        for mb in micro_batches:
            logits = model(mb["input_ids"])[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                mb["input_ids"][:, 1:].reshape(-1),
                reduction="sum",
            )
            (loss / torch.tensor(float(count))).backward()
        grads = [p.grad for p in model.parameters()]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    return model, norms


def assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    expected_state = expected.state_dict()
    for name, tensor in got.state_dict().items():
        assert torch.equal(tensor, expected_state[name]), name


def test_without_clipping_or_logging_no_norm_is_computed_and_the_update_is_the_same(tmp_path):
    trainer, steps = run_trainer(tmp_path, max_grad_norm=None)
    assert not trainer.computes_grad_norm
    assert all("grad_norm" not in metrics for metrics in steps)
    reference, _ = hand_written(max_norm=None)
    assert_same_weights(trainer.model, reference)


def test_log_grad_norm_reports_the_norm_and_leaves_the_gradients_alone(tmp_path):
    trainer, steps = run_trainer(tmp_path, max_grad_norm=None, log_grad_norm=True)
    assert trainer.computes_grad_norm
    reference, norms = hand_written(max_norm=None)
    assert [m["grad_norm"] for m in steps] == pytest.approx(norms, rel=1e-6)
    assert_same_weights(trainer.model, reference)


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clips", "does-not-clip"])
def test_clipping_equals_torch_clip_grad_norm_bitwise(tmp_path, max_norm):
    trainer, steps = run_trainer(tmp_path, max_grad_norm=max_norm)
    reference, norms = hand_written(max_norm=max_norm)
    assert [m["grad_norm"] for m in steps] == pytest.approx(norms, rel=1e-6)
    if max_norm < 1:  # the clip ran: every step's norm was above it
        assert min(norms) > max_norm
    else:
        assert max(norms) < max_norm
    assert_same_weights(trainer.model, reference)


class NaNAtSecondStep(NextToken):
    def __call__(self, model, batch):
        out = super().__call__(model, batch)
        return LossOutput(out.loss * math.nan) if len(self.modes) > 2 else out


def test_a_nonfinite_loss_is_still_caught_without_the_norm(tmp_path):
    torch.manual_seed(0)
    source = RandomTokens()
    trainer = Trainer.from_config(
        config(tmp_path, max_grad_norm=None, on_nonfinite_loss="skip"),
        CTX,
        model=build_model(SPEC),
        objective=NaNAtSecondStep(),
        source=source,
    )
    trainer.step(source.next_step())
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.step(source.next_step())  # micro-batches 3 and 4: NaN
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    trainer.settings = dataclasses.replace(trainer.settings, on_nonfinite_loss="stop")
    with pytest.raises(FloatingPointError, match=r"loss nan at step 3; stopping"):
        trainer.step(source.next_step())


def test_the_step_phases_are_named_profiler_ranges(tmp_path):
    torch.manual_seed(0)
    source = RandomTokens()
    trainer = Trainer.from_config(
        config(tmp_path), CTX, model=build_model(SPEC), objective=NextToken(), source=source
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        trainer.step(source.next_step())
    counts = {e.key: e.count for e in prof.key_averages() if e.key.startswith("trainer/")}
    assert counts == {
        "trainer/units": 1,
        "trainer/objective": 2,
        "trainer/backward": 2,
        "trainer/grad_norm": 1,
        "trainer/optimizer": 1,
        "trainer/metrics": 1,
    }


def test_log_grad_norm_is_a_flag():
    cfg = OmegaConf.create({"log_grad_norm": "yes"})
    issues = [str(i) for i in check_rules(cfg, {"log_grad_norm": LOOP_RULES["log_grad_norm"]})]
    assert issues == [
        "log_grad_norm: expected true or false, got 'yes' (a string: write true or false, unquoted)"
    ]


def test_the_sft_recipe_logs_the_norm_as_the_rule_says(tmp_path):
    model_dir = make_model_dir(tmp_path)
    data = make_counting_data(tmp_path / "data.jsonl", rows=8)
    common = ["max_steps=2", "save_every_minutes=null"]
    plain = read_metrics(run_sft(model_dir, data, tmp_path / "a", *common, "max_grad_norm=null"))
    logged = read_metrics(
        run_sft(
            model_dir, data, tmp_path / "b", *common, "max_grad_norm=null", "log_grad_norm=true"
        )
    )
    clipped = read_metrics(run_sft(model_dir, data, tmp_path / "c", *common))  # shipped: 1.0
    assert all("grad_norm" not in plain[step] for step in (1, 2))
    assert all(logged[step]["grad_norm"] > 0 for step in (1, 2))
    assert all(clipped[step]["grad_norm"] > 0 for step in (1, 2))
    assert [plain[s]["loss"] for s in (1, 2)] == [logged[s]["loss"] for s in (1, 2)]
