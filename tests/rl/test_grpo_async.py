"""Asynchronous GRPO end to end on a tiny policy, with real Ray workers (one local instance
for the module, in a temp dir of its own):

* ``sync`` mode == the synchronous ``grpo`` recipe: the same rollouts (keyed sampling in
  another process) and bitwise-equal weights after N updates, with and without a KL term
  (reference log-probs from the reward worker);
* ``overlap`` and ``off_policy`` use every batch's groups once, in order, never staler than
  the mode allows (read back from ``rollouts.jsonl``); ``off_policy`` with ``max_staleness: 0``
  is ``sync``;
* a resumed ``overlap`` run (the buffer drained into the checkpoint) == the uninterrupted one;
* with ``dynamic_sampling``: ``sync`` mode == the synchronous recipe, refills included (bitwise,
  on one trainer process and, marked slow, on two ranks: each share keeps its own groups);
  ``overlap`` replaces the groups whose rewards are all equal while refills remain, samples
  the refills with the policy being trained, uses each group once, and resumes exactly;
* a rollout worker killed (SIGKILL) while it samples loses and duplicates nothing, with the
  weights sent through Ray's object store or a broadcast (``rollout.weight_sync``).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf

from tests.recipes.sft_world import (
    _any_component_allowed,
    assert_same_weights,
    final_weights,
    launch_ranks,
    make_model_dir,
    read_metrics,
)
from tests.rl.rl_world import (
    EVEN_FLAT_REWARD,
    grpo_overrides,
    launch_async_ranks,
    local_ray,
    make_prompts,
    run_killing_the_rollout_worker,
    run_rl,
)
from tunesmith.cli.main import main as cli_main
from tunesmith.recipes import config_path
from tunesmith.rl.asynchronous.pipeline import dynamic_selection

STEPS = 4
FAST = [f"max_steps={STEPS}", "optimizer.lr=1e-2", "generation.max_new_tokens=8"]
# long enough to SIGKILL a rollout worker while it samples: the sync-mode runs that the killed
# worker's run is compared with (test_a_killed_rollout_worker_loses_and_duplicates_nothing)
LONG = "generation.max_new_tokens=48"
DYNAMIC = [f"rewards.rewards={{flat: {{_component_: {EVEN_FLAT_REWARD}}}}}",
           "dynamic_sampling=true"]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_async")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    """One local Ray instance for the module (the runs join it instead of starting their own)."""
    with local_ray():
        yield


def run(world, recipe: str, config: str, name: str, *extra: str, model=None):
    """Run ``recipe`` on its ``config`` in this process (one torch thread, as the workers;
    ``model``: another model node)."""
    root, model_dir, prompts = world
    out = root / name
    run_rl(recipe, config, grpo_overrides(model_dir, prompts, out, *FAST, *extra), model=model)
    return out


_SHARED: dict[tuple[str, ...], Path] = {}


def shared(world, recipe: str, *extra: str, lora: bool = False) -> Path:
    """``recipe`` on ``tiny`` with ``extra`` (``lora``: the model of ``tiny_lora``), run once
    for the module: the reference runs that several tests compare with (read only)."""
    key = (recipe, *extra, "lora" if lora else "full")
    if key not in _SHARED:
        name = "-".join(["shared", *key]).replace("=", "_")
        _SHARED[key] = run(world, recipe, "tiny", name, *extra, model=_lora() if lora else None)
    return _SHARED[key]


def _lora():
    """The model node of ``tiny_lora`` (``${model_dir}``: the run's)."""
    return OmegaConf.load(config_path("tiny_lora", "sft")).model


def rollouts(out):
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "kl",
    [
        "0.0",
        # the reward workers' reference log-probs: test_a_lora_policy_sends_its_adapters (kl 0.1)
        pytest.param("0.05", marks=pytest.mark.slow),
    ],
)
def test_sync_mode_equals_the_synchronous_recipe(world, kl):
    coef = [] if kl == "0.0" else [f"kl.coef={kl}"]  # 0.0: the config's own
    plain = shared(world, "grpo", LONG, *coef)
    remote = shared(world, "grpo_async", "async_mode=sync", LONG, *coef)
    assert_same_weights(final_weights(remote), final_weights(plain), atol=0.0)
    ours, theirs = read_metrics(remote), read_metrics(plain)
    for step in range(1, STEPS + 1):
        for key in ("reward", "completion_length", "loss"):
            assert ours[step][key] == theirs[step][key], (step, key)
        assert ours[step]["staleness_max"] == 0.0
    used = [tuple(g[:2]) for r in rollouts(remote) for g in r["groups"]]
    assert len(used) == len(set(used)) == STEPS * 4  # prompts_per_step 4, each once
    for step, record in enumerate(rollouts(remote), start=1):  # each group's mean reward
        group_means = [g[3] for g in record["groups"]]
        assert sum(group_means) / len(group_means) == pytest.approx(ours[step]["reward"], abs=1e-5)


@pytest.mark.parametrize(
    ("mode", "allowed"),
    [
        # overlap's lag of exactly one batch, each group once: the overlap run of
        # test_overlap_with_dynamic_sampling (below) and the async demo (test_demo_rl_async)
        pytest.param("overlap", 1, marks=pytest.mark.slow),
        ("off_policy", 2),
    ],
)
def test_async_modes_use_each_group_once_and_never_too_stale(world, mode, allowed):
    out = run(world, "grpo_async", "tiny", mode, f"async_mode={mode}", "max_staleness=2")
    records = rollouts(out)
    assert [r["batch"] for r in records] == list(range(STEPS))
    used = [tuple(g[:2]) for r in records for g in r["groups"]]
    assert len(used) == len(set(used)) == STEPS * 4
    lags = [r["version"] - g[2] for r in records for g in r["groups"]]
    assert min(lags) >= 0 and max(lags) <= allowed
    assert max(lags) == allowed or mode == "off_policy"  # overlap: batch k+1 sampled by v(k)
    assert all(r["groups"][0][0] == r["batch"] for r in records)  # batch k is round k
    logged = read_metrics(out)  # the staleness histogram of each step == its groups' lags
    for step, record in enumerate(records, start=1):
        lags = [record["version"] - g[2] for g in record["groups"]]
        histogram = [logged[step][f"staleness_{lag}_groups"] for lag in range(allowed + 1)]
        assert histogram == [float(lags.count(lag)) for lag in range(allowed + 1)], step


@pytest.mark.slow  # off_policy's bound is checked by the staleness case above (off_policy-2)
def test_off_policy_with_no_staleness_is_sync(world):
    sync = shared(world, "grpo_async", "async_mode=sync", LONG)
    off = run(world, "grpo_async", "tiny", "off0", "async_mode=off_policy", "max_staleness=0", LONG)
    assert_same_weights(final_weights(off), final_weights(sync), atol=0.0)


@pytest.mark.slow  # overlap resumes exactly with dynamic sampling too: the case below (default)
def test_a_resumed_overlap_run_equals_the_uninterrupted_one(world):
    whole = shared(world, "grpo_async", "async_mode=overlap")
    out = run(
        world, "grpo_async", "tiny", "overlap-resumed", "async_mode=overlap", "stop_after_steps=2"
    )
    run(world, "grpo_async", "tiny", "overlap-resumed", "async_mode=overlap", "resume=true")
    assert_same_weights(final_weights(out), final_weights(whole), atol=0.0)
    assert [r["groups"] for r in rollouts(out)] == [r["groups"] for r in rollouts(whole)]


def first_rounds(records: list[dict]) -> list[int]:
    """The round of each batch's own prompts, checking that its groups come from that round
    and its refills (the next steps of the stream), and the next batch's prompts after them
    (the synchronous recipe's order)."""
    firsts, first = [], 0
    for record in records:
        rounds = {g[0] for g in record["groups"]}
        assert rounds <= set(range(first, first + int(record["refill_rounds"]) + 1)), record
        firsts.append(first)
        first += int(record["refill_rounds"]) + 1
    return firsts


def test_dynamic_selection_of_two_shares_is_each_shares_own_selection():
    """Two data-parallel shares choose as two ``grpo`` ranks do: each from its own half of
    every round, short when either is (then both refill)."""
    rng = random.Random(0)
    for _ in range(200):
        flat = [rng.random() < 0.6 for _ in range(4 * rng.randint(1, 4))]
        chosen, short = dynamic_selection(flat, per_round=4, shares=2)
        mine, shorts = [], []
        for share in range(2):
            where = [r + share * 2 + i for r in range(0, len(flat), 4) for i in range(2)]
            own, own_short = dynamic_selection([flat[i] for i in where], per_round=2)
            mine += [where[i] for i in own]
            shorts.append(own_short)
        assert (chosen, short) == (mine, any(shorts)), flat


def test_sync_mode_with_dynamic_sampling_equals_the_synchronous_recipe(world):
    plain = run(world, "grpo", "tiny", "grpo-dynamic", *DYNAMIC, "max_refills=2")
    remote = run(
        world, "grpo_async", "tiny", "sync-dynamic", *DYNAMIC, "max_refills=2", "async_mode=sync"
    )
    ours, theirs = read_metrics(remote), read_metrics(plain)
    assert max(theirs[s]["zero_variance_groups"] for s in theirs) > 0  # groups were replaced
    records = rollouts(remote)
    assert sum(r["refill_rounds"] for r in records) > 0  # ... by refills
    first_rounds(records)
    for step in range(1, STEPS + 1):
        for key in (
            "reward",
            "completion_length",
            "loss",
            "zero_variance_groups",
            "rollout_samples",
        ):
            assert ours[step][key] == theirs[step][key], (step, key)
    assert_same_weights(final_weights(remote), final_weights(plain), atol=0.0)


def test_overlap_with_dynamic_sampling_replaces_flat_groups_and_resumes_exactly(world):
    extra = [*DYNAMIC, "max_refills=1", "async_mode=overlap"]
    whole = run(world, "grpo_async", "tiny", "overlap-dynamic", *extra)
    records = rollouts(whole)
    used = [tuple(g[:2]) for r in records for g in r["groups"]]
    assert len(used) == len(set(used)) == STEPS * 4
    logged = read_metrics(whole)
    for step, (record, first) in enumerate(zip(records, first_rounds(records)), start=1):
        lags = [record["version"] - g[2] for g in record["groups"]]
        assert min(lags) >= 0 and max(lags) <= 1  # overlap: at most one batch behind
        for g in record["groups"]:
            if g[0] > first:  # a refill: sampled by the policy being trained
                assert g[2] == record["version"], record
        spreads = [g[4] for g in record["groups"]]
        if 0.0 in spreads:  # a flat group is used only once the refills ran out, and last
            assert record["refill_rounds"] == 1, record
            assert spreads == sorted(spreads, key=lambda x: x == 0.0), record
        if record["refill_rounds"]:
            assert logged[step]["zero_variance_groups"] > 0
    assert sum(r["refill_rounds"] for r in records) > 0
    out = run(world, "grpo_async", "tiny", "overlap-dynamic-resumed", *extra, "stop_after_steps=2")
    run(world, "grpo_async", "tiny", "overlap-dynamic-resumed", *extra, "resume=true")
    assert [r["groups"] for r in rollouts(out)] == [r["groups"] for r in records]
    assert_same_weights(final_weights(out), final_weights(whole), atol=0.0)


@pytest.mark.parametrize(
    "weight_sync",
    [
        "object_store",
        # collective == object store, bitwise: test_weight_sync; its restarts: test_weight_sync's units
        pytest.param("collective", marks=pytest.mark.slow),
    ],
)
def test_a_killed_rollout_worker_loses_and_duplicates_nothing(world, tmp_path, weight_sync):
    """SIGKILL the rollout worker while it samples: Ray restarts it (``collective``: in a new
    weight-sync group), its prompts are sampled again with the same keys and policy, and the
    run ends with the weights of a run where nothing died (sync mode: every batch sampled by
    the policy that trains on it; weights through the object store). The run is a child of
    the fork server (:mod:`tests.forked`): the CLI, in a process of its own to kill from."""
    root, model_dir, prompts = world
    quiet = shared(world, "grpo_async", "async_mode=sync", LONG)  # of test_sync_mode_equals...
    out, log = tmp_path / "killed", tmp_path / "run.log"
    address = ray.get_runtime_context().gcs_address  # the run joins the module's instance
    overrides = [*grpo_overrides(model_dir, prompts, out, *FAST), LONG, "async_mode=sync",
                 f"ray.address={address}", f"rollout.weight_sync={weight_sync}"]  # fmt: skip
    run_killing_the_rollout_worker(overrides, log)
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))  # every update made
    assert metrics[STEPS]["worker_restarts"] >= 1 and metrics[STEPS]["requeued_groups"] >= 1
    used = [tuple(g[:2]) for r in rollouts(out) for g in r["groups"]]
    assert used == [tuple(g[:2]) for r in rollouts(quiet) for g in r["groups"]]  # once each
    assert_same_weights(final_weights(out), final_weights(quiet), atol=0.0)


LORA_KL = ("kl.coef=0.1", "async_mode=sync")  # the reward workers' reference log-probs too


def test_a_lora_policy_sends_its_adapters_and_equals_the_synchronous_recipe(world):
    plain = run(world, "grpo", "tiny", "grpo-lora", "kl.coef=0.1", model=_lora())
    remote = shared(world, "grpo_async", *LORA_KL, lora=True)
    assert (remote / "checkpoints" / f"step_{STEPS:06d}" / "adapter_config.json").is_file()
    assert_same_weights(final_weights(remote), final_weights(plain), atol=0.0)
    assert read_metrics(remote)[STEPS]["kl"] > 0.0


def test_a_teacher_scored_by_the_reward_workers_equals_the_synchronous_recipe(world):
    """On-policy distillation as RL (``TeacherReverseKL``, the teacher as ``reference_model``):
    the reward workers score every completion with the teacher, as the trainer does in
    ``grpo``; the runs are the same."""
    teacher = make_model_dir(world[0] / "teacher", seed=1)
    distill = (
        "advantage={_component_: tunesmith.rl.advantages.TeacherReverseKL}",
        f"reference_model={{_component_: tunesmith.models.from_hf, path: {teacher}}}",
    )
    plain = run(world, "grpo", "tiny", "grpo-teacher", *distill)
    remote = run(world, "grpo_async", "tiny", "async-teacher", "async_mode=sync", *distill)
    assert_same_weights(final_weights(remote), final_weights(plain), atol=0.0)
    ours, theirs = read_metrics(remote), read_metrics(plain)
    for step in range(1, STEPS + 1):
        assert ours[step]["teacher_reverse_kl"] == theirs[step]["teacher_reverse_kl"] != 0.0


@pytest.mark.slow  # two rollout workers in the default tier: test_weight_sync (rollout.workers=2)
def test_two_rollout_and_reward_workers_share_the_batches(world):
    one = shared(world, "grpo_async", "async_mode=overlap")
    two = run(
        world,
        "grpo_async",
        "tiny",
        "two-workers",
        "async_mode=overlap",
        "rollout.workers=2",
        "reward_workers.workers=2",
    )
    assert [r["groups"] for r in rollouts(two)] == [r["groups"] for r in rollouts(one)]
    ours, theirs = read_metrics(two), read_metrics(one)
    for step in range(1, STEPS + 1):  # the same completions, sampled in two halves
        assert ours[step]["reward"] == pytest.approx(theirs[step]["reward"], abs=1e-6)
        assert ours[step]["completion_length"] == theirs[step]["completion_length"]
    assert {"rollout0_tokens_per_s", "rollout1_tokens_per_s"} <= set(ours[STEPS])
    assert_same_weights(final_weights(two), final_weights(one), atol=1e-5)


def test_a_missing_ray_is_one_line_naming_the_extra(world, tmp_path, monkeypatch, capsys):
    root, model_dir, prompts = world
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    overrides = grpo_overrides(model_dir, prompts, tmp_path / "out", *FAST, "async_mode=sync")
    argv = ["run", "grpo_async", "--config", "tiny", *overrides]
    with _any_component_allowed():  # the test reward
        assert cli_main(argv) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert errors == [errors[0]] and "pip install 'tunesmith[rl]'" in errors[0], errors


def test_lora_workers_with_a_merged_copy_sample_what_the_adapters_would(world):
    adapters = shared(world, "grpo_async", *LORA_KL, lora=True)
    merged = run(
        world,
        "grpo_async",
        "tiny",
        "lora-merged",
        *LORA_KL,
        "rollout.merge_adapters=true",
        model=_lora(),
    )
    ours, theirs = read_metrics(merged), read_metrics(adapters)
    for step in range(1, STEPS + 1):  # the same completions from the merged dense weights
        assert ours[step]["reward"] == theirs[step]["reward"]
        assert ours[step]["completion_length"] == theirs[step]["completion_length"]
        assert ours[step]["logprob_mismatch_max"] < 1e-5
    assert_same_weights(final_weights(merged), final_weights(adapters), atol=1e-6)


@pytest.mark.slow
def test_two_trainer_ranks_resume_on_one(world, tmp_path):
    """A checkpoint of 2 trainer ranks resumes in one process (rank 0 held the pipeline) and
    ends where a 1-process run ends."""
    root, model_dir, prompts = world
    single = run(world, "grpo_async", "tiny", "single-for-resume", "async_mode=overlap")
    out = root / "two-then-one"
    launch_async_ranks(
        [
            *grpo_overrides(model_dir, prompts, out, *FAST),
            "async_mode=overlap",
            "stop_after_steps=2",
        ],
        tmp_path,
    )
    run(world, "grpo_async", "tiny", "two-then-one", "async_mode=overlap", "resume=true")
    assert [r["groups"] for r in rollouts(out)] == [r["groups"] for r in rollouts(single)]
    assert_same_weights(final_weights(out), final_weights(single), 1e-5)


@pytest.mark.slow
def test_two_trainer_ranks_with_dynamic_sampling_equal_grpo_on_two_ranks(world, tmp_path):
    """Each data-parallel share keeps its own groups as a ``grpo`` rank does (both refill
    while either is short): ``sync`` mode on 2 ranks == ``grpo`` on 2 ranks, bitwise."""
    root, model_dir, prompts = world
    extra = [*FAST, *DYNAMIC, "max_refills=2"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "async").mkdir()
    with _any_component_allowed():
        launch_ranks(
            grpo_overrides(model_dir, prompts, root / "grpo-two-dynamic", *extra),
            tmp_path / "plain",
            recipe="grpo",
            timeout=300,
        )
    launch_async_ranks(
        [*grpo_overrides(model_dir, prompts, root / "sync-two-dynamic", *extra), "async_mode=sync"],
        tmp_path / "async",
    )
    plain, remote = root / "grpo-two-dynamic", root / "sync-two-dynamic"
    ours, theirs = read_metrics(remote), read_metrics(plain)
    assert sum(r["refill_rounds"] for r in rollouts(remote)) > 0  # not vacuous
    for step in range(1, STEPS + 1):
        for key in ("reward", "zero_variance_groups", "loss", "rollout_samples"):
            assert ours[step][key] == theirs[step][key], (step, key)
    assert_same_weights(final_weights(remote), final_weights(plain), atol=0.0)


@pytest.mark.slow  # the transformers backend's own file covers grpo; this adds the workers
def test_sync_mode_on_the_transformers_backend_equals_the_synchronous_recipe(world):
    """LFM2 (no native family: transformers' own modules, a convolution cache) in the rollout
    workers and the trainer: the same rollouts and bitwise-equal weights as ``grpo``."""
    from tests.models.transformers_world import make_transformers_model_dir

    root, _, prompts = world
    model_dir = make_transformers_model_dir(root / "lfm2", "lfm2")
    outs = {}
    for recipe, extra in (("grpo", ()), ("grpo_async", ("async_mode=sync",))):
        outs[recipe] = root / f"lfm2-{recipe}"
        run_rl(recipe, "tiny", grpo_overrides(model_dir, prompts, outs[recipe], *FAST, *extra))
    ours, theirs = read_metrics(outs["grpo_async"]), read_metrics(outs["grpo"])
    for step in range(1, STEPS + 1):
        for key in ("reward", "completion_length", "loss", "logprob_mismatch_max"):
            assert ours[step][key] == theirs[step][key], (step, key)
    assert_same_weights(final_weights(outs["grpo_async"]), final_weights(outs["grpo"]), atol=0.0)
