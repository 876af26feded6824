"""``reference_offload`` (dpo) and ``teacher_offload`` (kd) keep a frozen model's FSDP2 shards in
CPU memory on a GPU. On a CPU there is nothing to offload to: the switch warns, changes nothing,
and the run equals the run without it."""

from __future__ import annotations

import pytest

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    assert_same_weights,
    final_weights,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_recipe,
)

COMMON = ["max_steps=2", "batch_size=4", "lr_scheduler.num_warmup_steps=0", "optimizer.lr=1e-3"]


@pytest.mark.parametrize(
    ("recipe", "switch", "data_kind"),
    [("dpo", "reference_offload", "pairs"), ("kd", "teacher_offload", "chat")],
)
def test_offloading_a_frozen_model_on_cpu_warns_and_changes_nothing(
    tmp_path, recipe, switch, data_kind
):
    model_dir = make_model_dir(tmp_path / "model")
    if data_kind == "pairs":
        data = make_preference_data(tmp_path / "pairs.jsonl", rows=8, seed=0, task="add")
        extra = []
    else:
        data = make_chat_data(tmp_path / "chat.jsonl", rows=8)
        extra = [f"teacher_dir={make_model_dir(tmp_path / 'teacher', seed=1)}"]
    plain = run_recipe(recipe, "tiny", model_dir, data, tmp_path / "plain", *COMMON, *extra)
    with pytest.warns(UserWarning, match="cpu_offload needs a CUDA device"):
        offloaded = run_recipe(
            recipe,
            "tiny",
            model_dir,
            data,
            tmp_path / "offloaded",
            *COMMON,
            *extra,
            f"{switch}=true",
        )
    assert read_metrics(plain)[2]["loss"] == read_metrics(offloaded)[2]["loss"]
    assert_same_weights(final_weights(offloaded), final_weights(plain), atol=0.0)
