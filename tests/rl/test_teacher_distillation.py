"""On-policy distillation as RL in ``grpo`` (issue #36): ``advantage: TeacherReverseKL`` with
the teacher as ``reference_model`` trains each sampled token toward the teacher's log-prob
(the per-token stage itself is proven in ``test_source_stages.py``; asynchronous GRPO, where
the reward workers score with the teacher, in ``test_grpo_async.py``)."""

from __future__ import annotations

import pytest

from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    final_weights,
    make_model_dir,
    read_metrics,
)
from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl

STEPS = 3
FAST = [f"max_steps={STEPS}", "optimizer.lr=1e-2", "generation.max_new_tokens=8"]


def teacher_overrides(teacher) -> list[str]:
    """``grpo/tiny`` as on-policy distillation from ``teacher`` (no KL term: the default)."""
    return [
        "advantage={_component_: tunesmith.rl.advantages.TeacherReverseKL}",
        f"reference_model={{_component_: tunesmith.models.from_hf, path: {teacher}}}",
    ]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher")
    return root, make_model_dir(root / "student"), make_prompts(root / "prompts.jsonl", rows=12)


def run(world, name: str, *extra: str):
    root, model_dir, prompts = world
    out = root / name
    run_rl("grpo", "tiny", grpo_overrides(model_dir, prompts, out, *FAST, *extra))
    return out


def test_a_teacher_equal_to_the_student_leaves_it_as_it_is(world):
    _, student, _ = world
    out = run(world, "same", *teacher_overrides(student))
    logged = read_metrics(out)
    assert [logged[s]["teacher_reverse_kl"] for s in range(1, STEPS + 1)] == [0.0] * STEPS
    assert all(logged[s]["loss"] == 0.0 for s in logged)  # every advantage is exactly 0
    assert_same_weights(final_weights(out), checkpoint_weights(student), atol=0.0)
