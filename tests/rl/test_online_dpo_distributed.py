"""Online DPO under FSDP2 on two CPU ranks (gloo) == one process, full fine-tuning (a frozen
reference copy, sharded like the policy) and LoRA (the policy without its adapters).

Why the runs see the same pairs: the prompt stream hands rank r the r-th half of each step's
prompts and keyed sampling makes each completion independent of the batch it is decoded in
(see ``test_grpo``). The judge ties on some prompts, so the ranks' pair counts differ: with one
pair per micro-batch the rank with fewer pairs runs filler micro-batches, and the loss is
still the mean over the pairs of both ranks."""

from __future__ import annotations

import pytest

from tests.recipes.sft_world import (
    _any_component_allowed,
    assert_same_weights,
    checkpoint_weights,
    final_weights,
    largest_change,
    launch_ranks,
    make_model_dir,
    read_metrics,
)
from tests.rl.rl_world import make_prompts, run_rl
from tests.rl.test_online_dpo import JUDGE

STEPS = 4
FAST = [f"max_steps={STEPS}", "optimizer.lr=1e-3", "generation.max_new_tokens=8",
        "group_size=4", "batch_size=1"]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("online_dpo_fsdp")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


def _overrides(world, out, *extra: str) -> list[str]:
    _, model_dir, prompts = world
    return [
        f"model_dir={model_dir}", f"prompts.source={prompts}", f"output_dir={out}",
        "progress_bar=false", f"rewards.rewards={{judge: {{_component_: {JUDGE}}}}}",
        *FAST, *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("config", ["tiny", "tiny_lora"])
def test_two_gloo_ranks_equal_one_process(world, tmp_path, config):
    root, model_dir, _ = world
    single = root / f"single_{config}"
    run_rl("online_dpo", config, _overrides(world, single))
    with _any_component_allowed():  # inherited by the ranks
        launch_ranks(
            _overrides(world, tmp_path / "two"),
            tmp_path,
            recipe="online_dpo",
            config=config,
            timeout=300,
        )
    one, two = read_metrics(single), read_metrics(tmp_path / "two")
    # the ranks' pair counts differed (at step 4: 0 and 2): fillers ran
    assert sum(two[step]["filler_micro_batches"] for step in two) > 0
    assert sum(one[step]["filler_micro_batches"] for step in one) == 0
    for step in range(1, STEPS + 1):
        assert two[step]["pairs_in_window"] == one[step]["pairs_in_window"]
        for key in ("tied_groups", "reward", "score/chosen", "completion_length",
                    "rewards/margin", "rewards/accuracy"):  # fmt: skip
            if key in one[step]:  # the DPO rewards: small differences of log-probs
                assert two[step][key] == pytest.approx(one[step][key], abs=1e-5), key
        for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
            if key in one[step]:
                assert two[step][key] == pytest.approx(one[step][key], rel=1e-5), key
        assert two[step]["tokens_seen"] == one[step]["tokens_seen"]  # fillers see no token
    weights = final_weights(single)
    assert_same_weights(final_weights(tmp_path / "two"), weights, 1e-5)
    lora_b = [w.abs().max().item() for n, w in weights.items() if ".lora_B." in n]
    if lora_b:  # an adapter: every lora_B (zero at the start) moved
        assert min(lora_b) > 1e-4
    else:
        assert largest_change(weights, checkpoint_weights(model_dir)) > 1e-3
