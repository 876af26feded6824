"""FSDP2 on two CPU ranks (gloo) == one process: same logged losses and same exported weights.

Why the two runs see the same samples: the DistributedSampler draws one permutation ``perm``
per epoch from the seed alone (not from the world size) and hands rank r ``perm[r::2]``. With
a per-rank batch of B, step k's batches on the two ranks are ``perm[2kB : 2kB + 2B]`` split by
parity, exactly the samples of the single process's step-k batch of 2B. The samples train
different numbers of tokens, so the ranks' token counts differ and only a global token mean
(not a mean of per-rank means) matches the single process.

The default-set test starts the two ranks itself (``python -m tunesmith.cli.launch`` with the
torchrun environment variables); the slow one goes through ``tunesmith run --nproc-per-node 2``.
The newer families (:data:`FAMILIES`) run one after another in the ranks of a single 2-rank
world (:func:`tests.gloo_world.run_on_ranks`), so together they cost one start of two processes.
"""

from __future__ import annotations

import subprocess
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import tunesmith.training.loop
from tests.gloo_world import run_on_ranks
from tests.recipes.sft_world import (
    assert_same_as_single,
    cli_command,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    recipe_config,
    run_config,
    run_sft,
    sft_overrides,
    subprocess_env,
)
from tunesmith.models.zoo import gemma2, gemma3, glm4, granite, olmo2, olmo3, phi3, smollm3

PER_RANK, STEPS = 2, 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    model_dir = make_model_dir(root)
    data = make_counting_data(root / "count.jsonl", rows=24)
    single = run_sft(
        model_dir, data, root / "single", f"batch_size={2 * PER_RANK}", f"max_steps={STEPS}"
    )
    return model_dir, data, single


def test_two_gloo_ranks_equal_one_process(world, tmp_path):
    model_dir, data, single = world
    out = tmp_path / "fsdp"
    overrides = sft_overrides(model_dir, data, out, f"batch_size={PER_RANK}", f"max_steps={STEPS}")
    launch_ranks(overrides, tmp_path)  # what torchrun would start, without torchrun
    assert_same_as_single(model_dir, single, out, steps=STEPS)


@pytest.mark.slow
def test_cli_nproc_per_node_2_equals_one_process(world, tmp_path):
    model_dir, data, single = world
    out = tmp_path / "cli"
    overrides = sft_overrides(model_dir, data, out, f"batch_size={PER_RANK}", f"max_steps={STEPS}")
    result = subprocess.run(
        cli_command("run", "sft", "--config", "tiny", "--nproc-per-node", "2", *overrides),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert_same_as_single(model_dir, single, out, steps=STEPS)


def test_for_loop_adamw_on_two_ranks_equals_fused_in_one_process(world, tmp_path):
    """torch's for-loop AdamW on FSDP2's sharded parameters takes the steps of the single
    process's fused AdamW kernel (the shipped setting; two ranks with the fused kernel are
    the test above)."""
    model_dir, data, single = world
    out = tmp_path / "for-loop"
    overrides = sft_overrides(
        model_dir,
        data,
        out,
        f"batch_size={PER_RANK}",
        f"max_steps={STEPS}",
        "optimizer.fused=false",
    )
    launch_ranks(overrides, tmp_path)
    assert_same_as_single(model_dir, single, out, steps=STEPS)


def test_hsdp_on_four_gloo_ranks_equals_one_process(world, tmp_path):
    """``parallelism: {dp_replicate: 2, dp_shard: 2}``: each parameter sharded over 2 ranks
    and replicated twice (HSDP on a 2-D mesh); 4 data-parallel ranks of batch 1 take the
    single process's batch of 4."""
    model_dir, data, single = world
    out = tmp_path / "hsdp"
    overrides = sft_overrides(
        model_dir,
        data,
        out,
        f"batch_size={2 * PER_RANK // 4}",
        f"max_steps={STEPS}",
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=2",
    )
    launch_ranks(overrides, tmp_path, world_size=4, timeout=240)
    mesh = "parallelism: ('dp_replicate', 'dp_shard') mesh of (2, 2) ranks, 4 data-parallel"
    assert mesh in (tmp_path / "rank0.log").read_text()
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


@pytest.mark.slow
def test_cli_hsdp_nproc_per_node_4_equals_one_process(world, tmp_path):
    model_dir, data, single = world
    out = tmp_path / "cli_hsdp"
    overrides = sft_overrides(
        model_dir,
        data,
        out,
        f"batch_size={2 * PER_RANK // 4}",
        f"max_steps={STEPS}",
        "parallelism.dp_replicate=2",
        "parallelism.dp_shard=auto",
    )
    result = subprocess.run(
        cli_command("run", "sft", "--config", "tiny", "--nproc-per-node", "4", *overrides),
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


@pytest.mark.slow
def test_hsdp_stop_and_resume_equals_uninterrupted(world, tmp_path):
    """Checkpoints of an HSDP run (2-D DTensors, optimizer state through DCP) resume bitwise."""
    model_dir, data, _ = world
    hsdp = ["batch_size=1", f"max_steps={STEPS}", "parallelism.dp_replicate=2",
            "parallelism.dp_shard=2"]  # fmt: skip
    runs = [("full", tmp_path / "full", []), ("stop", tmp_path / "part", ["stop_after_steps=2"]),
            ("resume", tmp_path / "part", ["resume=true"])]  # fmt: skip
    for name, out, extra in runs:
        (tmp_path / name).mkdir()
        overrides = sft_overrides(model_dir, data, out, *hsdp, *extra)
        launch_ranks(overrides, tmp_path / name, world_size=4, timeout=240)
    full, resumed = final_weights(tmp_path / "full"), final_weights(tmp_path / "part")
    assert full.keys() == resumed.keys()
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    full_log, resumed_log = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "part")
    assert full_log[STEPS]["loss"] == resumed_log[STEPS]["loss"]


def test_dp_shard_2_is_exactly_todays_fsdp2(world, tmp_path):
    """``parallelism: {dp_shard: 2}`` on 2 ranks is the run without the key, bitwise: same
    logged losses and grad norms, same weights."""
    model_dir, data, _ = world
    runs = {}
    for name, extra in (("plain", []), ("dp_shard", ["parallelism.dp_shard=2"])):
        runs[name] = tmp_path / name
        overrides = sft_overrides(
            model_dir, data, runs[name], f"batch_size={PER_RANK}", f"max_steps={STEPS}", *extra
        )
        (tmp_path / f"logs_{name}").mkdir()
        launch_ranks(overrides, tmp_path / f"logs_{name}")
    plain, sharded = read_metrics(runs["plain"]), read_metrics(runs["dp_shard"])
    for step in plain:
        for key in ("loss", "grad_norm", "trained_tokens_in_window", "tokens_seen"):
            assert plain[step][key] == sharded[step][key], (step, key)
    weights_1, weights_2 = final_weights(runs["plain"]), final_weights(runs["dp_shard"])
    assert weights_1.keys() == weights_2.keys()
    for name in weights_1:
        assert torch.equal(weights_1[name], weights_2[name]), name


# -- the newer families: all of them in one 2-rank world ---------------------------------------

FAMILIES = {m.__name__.rsplit(".", 1)[-1]: m
            for m in (gemma2, gemma3, olmo2, olmo3, granite, smollm3, phi3, glm4)}  # fmt: skip
"""Soft caps and sandwich norms, local RoPE, post norms and whole-projection qk-norm (with
sliding windows in OLMo 3), multipliers, NoPE layers, partial/LongRoPE and interleaved rotary."""
FAMILY_STEPS = 5


def _sft_runs_in_one_group(rank: int, runs: list[tuple[str, str, str, str]]) -> list[str]:
    """Rank ``rank`` of a gloo world (:func:`~tests.gloo_world.run_on_ranks`): the SFT recipe
    for each ``(name, model_dir, data, output_dir)`` of ``runs`` in turn, FSDP2 over the whole
    world (``dp_shard`` 2, per-rank batch PER_RANK), each run's output in
    ``<output_dir>.rank<N>.log``. The recipe would close the process group at its end; here
    the group stays for the next run (``run_on_ranks`` closes it after the last)."""
    tunesmith.training.loop.close_distributed = lambda: None  # in this rank's process only
    for _, model_dir, data, output_dir in runs:
        cfg = recipe_config(
            "sft",
            "tiny",
            Path(model_dir),
            Path(data),
            Path(output_dir),
            f"batch_size={PER_RANK}",
            f"max_steps={FAMILY_STEPS}",
            "parallelism.dp_shard=2",
        )
        with open(f"{output_dir}.rank{rank}.log", "w") as log, redirect_stdout(log):
            run_config("sft", cfg)
    return [name for name, *_ in runs]


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (its model folder, the single process's run, the 2-rank run): every family
    trained FAMILY_STEPS steps in this process at batch 2 x PER_RANK, and on two ranks of one
    gloo world (one launch for all) at PER_RANK each."""
    root = tmp_path_factory.mktemp("fsdp_families")
    data = make_counting_data(root / "count.jsonl", rows=24)
    runs, folders = [], {}
    for name, family in FAMILIES.items():
        model_dir = make_model_dir(root / name, family=family)
        single = run_sft(
            model_dir,
            data,
            root / name / "single",
            f"batch_size={2 * PER_RANK}",
            f"max_steps={FAMILY_STEPS}",
        )
        folders[name] = (model_dir, single, root / name / "fsdp")
        runs.append((name, str(model_dir), str(data), str(root / name / "fsdp")))
    done = run_on_ranks(_sft_runs_in_one_group, 2, runs, timeout_s=300)
    assert done == [list(FAMILIES)] * 2
    return folders


@pytest.mark.parametrize("family", list(FAMILIES))
def test_newer_families_on_two_gloo_ranks_equal_one_process(family_runs, family):
    model_dir, single, fsdp = family_runs[family]
    mesh = "parallelism: ('dp_shard',) mesh of (2,) ranks, 2 data-parallel"
    assert mesh in Path(f"{fsdp}.rank0.log").read_text()
    assert_same_as_single(model_dir, single, fsdp, steps=FAMILY_STEPS)
