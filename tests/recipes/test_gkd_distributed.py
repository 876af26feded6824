"""On-policy distillation under FSDP2 on two CPU ranks (gloo) == one process, full fine-tuning
and LoRA: the same on-policy draws, the same sampled completions (their lengths), the same
losses and the same weights.

Why the runs see the same rows: the sampler hands rank r ``perm[r::2]`` of one seeded
permutation (see ``test_sft_distributed``), the on-policy draw is keyed by the seed and the
step, and each completion by the seed, the step and its sample's index, never by the rank or
the batch it is decoded in. The counting answers differ in length, so on the dataset steps the
ranks train different numbers of tokens: only a global token mean matches one process.
"""

from __future__ import annotations

import pytest

from tests.recipes.sft_world import (
    assert_same_as_single,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    recipe_overrides,
    run_recipe,
)
from tunesmith.rl.on_policy_distillation import on_policy_step

PER_RANK, STEPS = 2, 3
TEACHER_SIZE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gkd_fsdp")
    teacher = make_model_dir(root / "teacher", seed=1, **TEACHER_SIZE)
    common = [f"teacher_dir={teacher}", f"max_steps={STEPS}", "generation.max_new_tokens=6"]
    assert {on_policy_step(0, s, 0.5) for s in range(STEPS)} == {True, False}
    return (
        root,
        make_model_dir(root / "student"),
        make_counting_data(root / "count.jsonl", 24),
        common,
    )


@pytest.mark.parametrize("config", ["tiny", "tiny_lora"])
def test_two_gloo_ranks_equal_one_process(world, tmp_path, config):
    root, student, data, common = world
    single = run_recipe(
        "gkd", config, student, data, tmp_path / "single", f"batch_size={2 * PER_RANK}", *common
    )
    out = tmp_path / "fsdp"
    overrides = recipe_overrides(student, data, out, f"batch_size={PER_RANK}", *common)
    launch_ranks(overrides, tmp_path, recipe="gkd", config=config, timeout=240)

    assert_same_as_single(student, single, out, steps=STEPS, lora=config == "tiny_lora")
    one, two = read_metrics(single), read_metrics(out)
    assert {one[s]["on_policy"] for s in one} == {0.0, 1.0}
    for step in one:
        for key in ("on_policy", "completion_length", "completion_length_max"):
            assert two[step][key] == one[step][key], f"{key} at step {step}"
        assert two[step]["kd_loss"] == pytest.approx(one[step]["kd_loss"], rel=1e-5)
