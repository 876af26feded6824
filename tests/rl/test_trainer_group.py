"""The trainer of asynchronous GRPO as Ray actors (``trainer_group.launcher: ray``), end to end
on a tiny policy with real Ray actors and workers:

* 2 torchrun trainer ranks and 2 trainer actors each == the 1-process run (the same
  rollouts, rewards and lengths; loss and grad norm rel 1e-5; weights 1e-5), the actors'
  checkpoint recording 2 data-parallel ranks; actors == torchrun ranks bitwise (the same
  per-rank code in the same process group); the three runs are made once for the module.
  The 1-process run is the synchronous ``grpo`` recipe, which ``sync`` mode in one process
  equals bitwise (``tests/rl/test_grpo_async.py``, the same world): no Ray workers to start;
* on a Ray cluster of two nodes (two raylets on this machine), one actor per node == the
  one-node run bitwise;
* SIGTERM to the driver: the ranks save at the end of the step and the run exits 0; resumed,
  it ends bitwise where the uninterrupted run ends;
* refusals, each one line: ``--nproc-per-node 2`` with the Ray launcher, a bad launcher, an
  unknown key, a local Ray instance with too few CPUs for the actors and workers.

A trainer actor SIGKILLed mid-run is a case of the reliability suite
(``tests/faults/test_async_faults.py``, ``async-trainer-actor-killed``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import forked
from tests.faults.test_async_faults import (
    TRAINER_PIDS,
    RayProcesses,
    one_error,
    rollouts,
    verified_checkpoints,
)
from tests.recipes.sft_world import (
    _any_component_allowed,
    assert_same_weights,
    cli_command,
    final_weights,
    make_model_dir,
    read_metrics,
    subprocess_env,
)
from tests.rl.rl_world import (
    DigitFraction,
    grpo_overrides,
    launch_async_ranks,
    local_ray,
    make_prompts,
    ray_temp_dir,
    run_rl,
)
from tunesmith.cli.main import main as cli_main
from tunesmith.recipes import grpo_async
from tunesmith.training.loop_config import read_record

STEPS = 4
FAST = [f"max_steps={STEPS}", "optimizer.lr=1e-2", "generation.max_new_tokens=8"]
RAY_GROUP = ["trainer_group.launcher=ray", "trainer_group.workers=2"]
SLOW_REWARD = f"rewards.rewards={{digits: {{_component_: {__name__}.SlowDigits}}}}"


class SlowDigits(DigitFraction):
    """The digit reward, one second per call: a step lasts long enough to be interrupted."""

    def __call__(self, samples):
        time.sleep(1.0)
        return super().__call__(samples)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_group")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance for the in-process runs of the module (they join it)."""
    with local_ray():
        yield


def run(world, out: str | Path, *extra: str) -> Path:
    """``grpo_async`` on the tiny config in ``sync`` mode, in this process, into ``out`` (a
    folder, or a name in the world's)."""
    root, model_dir, prompts = world
    out = root / out if isinstance(out, str) else out
    run_rl(
        "grpo_async",
        "tiny",
        grpo_overrides(model_dir, prompts, out, *FAST, "async_mode=sync", *extra),
    )
    return out


@pytest.fixture(scope="module")
def two_actors(world, ray_instance) -> Path:
    """The uninterrupted run of 2 trainer actors."""
    return run(world, "two-actors", *RAY_GROUP)


@pytest.fixture(scope="module")
def one_process(world) -> Path:
    """The same run in one process: ``grpo``, which ``grpo_async``'s ``sync`` mode in one
    process equals bitwise (test_sync_mode_equals_the_synchronous_recipe)."""
    root, model_dir, prompts = world
    out = root / "one-process"
    run_rl("grpo", "tiny", grpo_overrides(model_dir, prompts, out, *FAST))
    return out


@pytest.fixture(scope="module")
def torchrun_ranks(world) -> Path:
    """The same run on 2 torchrun ranks (a Ray instance of the run's own)."""
    root, model_dir, prompts = world
    out, logs = root / "torchrun-ranks", root / "rank-logs"
    logs.mkdir()
    launch_async_ranks([*grpo_overrides(model_dir, prompts, out, *FAST), "async_mode=sync"], logs)
    return out


def _assert_equals_one_process(two: Path, single: Path) -> None:
    """2 data-parallel trainer ranks == 1 process: the same rollouts, rewards and lengths;
    loss and grad norm rel 1e-5; weights 1e-5."""
    one, ours = read_metrics(single), read_metrics(two)
    for step in range(1, STEPS + 1):
        assert ours[step]["rollout_samples"] == one[step]["rollout_samples"] == 16
        for key in ("reward", "completion_length"):  # the same rollouts, shared out
            assert ours[step][key] == pytest.approx(one[step][key], abs=1e-6), key
        for key in ("loss", "grad_norm"):
            assert ours[step][key] == pytest.approx(one[step][key], rel=1e-5), key
    assert_same_weights(final_weights(two), final_weights(single), 1e-5)


def test_two_torchrun_ranks_equal_one_process(torchrun_ranks, one_process):
    _assert_equals_one_process(torchrun_ranks, one_process)


def test_two_trainer_actors_equal_one_process(two_actors, one_process):
    _assert_equals_one_process(two_actors, one_process)
    last = two_actors / "checkpoints" / f"step_{STEPS:06d}"
    assert read_record(last, 0).data_parallel == 2  # two ranks trained, not two copies of one
    logs = sorted(p.name for p in (two_actors / "logs").glob("trainer-group-*/*"))
    assert logs == ["console.log", "driver.log", "rank0.log", "rank1.log"]


def _start(world, out: Path, temp: str, *extra: str) -> subprocess.Popen:
    """``tunesmith run grpo_async`` with 2 trainer actors, on a Ray instance of its own."""
    root, model_dir, prompts = world
    overrides = grpo_overrides(
        model_dir,
        prompts,
        out,
        *FAST,
        "async_mode=sync",
        *RAY_GROUP,
        SLOW_REWARD,
        f"ray.temp_dir={temp}",
        "ray.num_cpus=4",
        *extra,
    )
    command = cli_command(
        "--allow-any-component", "run", "grpo_async", "--config", "tiny", *overrides
    )
    return subprocess.Popen(
        command,
        env=subprocess_env(RAY_AUTH_MODE="disabled"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run_until(
    process: subprocess.Popen, ray_processes: RayProcesses, line_has: str, act
) -> tuple[str, list[int]]:
    """Read the run's output; at the first line containing ``line_has`` call ``act(trainer
    pids)`` (the Ray processes scanned just before). Returns the output and the pids."""
    lines, pids, acted = [], [], False
    try:
        for line in process.stdout:
            lines.append(line)
            found = TRAINER_PIDS.search(line)
            if found:
                pids = [int(found.group(1)), int(found.group(2))]
            if line_has in line and not acted:
                ray_processes.scan()
                act(pids)
                acted = True
        process.wait(timeout=300)
    finally:
        process.kill()
    output = "".join(lines)
    assert acted, output[-3000:]
    return output, pids


@pytest.mark.slow
def test_sigterm_to_the_driver_saves_and_resumes(world, two_actors, tmp_path):
    """SIGTERM to the driver during step 2: both ranks save at its end, the run exits 0."""
    out = tmp_path / "stopped"
    with ray_temp_dir() as temp:
        ray_processes = RayProcesses(Path(temp))
        process = _start(world, out, temp)
        output, pids = _run_until(
            process, ray_processes, "step 1/", lambda pids: process.send_signal(signal.SIGTERM)
        )
        assert process.returncode == 0, output[-3000:]
        stopped = re.search(r"SIGTERM: stopped after step (\d+); resume with resume=true", output)
        assert stopped and int(stopped.group(1)) < STEPS, output[-3000:]
        ray_processes.wait_gone(pids)
    assert verified_checkpoints(out) == [f"step_{int(stopped.group(1)):06d}"]
    run(world, out, *RAY_GROUP, SLOW_REWARD, "resume=auto")
    assert_same_weights(final_weights(out), final_weights(two_actors), atol=0.0)


def test_the_ray_launcher_under_torchrun_is_refused_in_one_line(world, capsys):
    root, model_dir, prompts = world
    argv = ["run", "grpo_async", "--config", "tiny", "--nproc-per-node", "2",
            *grpo_overrides(model_dir, prompts, root / "refused", *RAY_GROUP)]  # fmt: skip
    with _any_component_allowed():  # the test reward
        assert cli_main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "tunesmith: error: trainer_group.launcher: ray starts the trainer's ranks itself as Ray "
        "actors (trainer_group.workers: 2), so it cannot run on 2 torchrun ranks: drop "
        "--nproc-per-node/--nnodes, or set trainer_group.launcher=torchrun"
    ]
    assert not (root / "refused").exists()  # refused before anything was written


def test_the_ray_launcher_in_a_torchrun_rank_is_refused(world, monkeypatch):
    """``main(cfg)`` of a rank started by torchrun by hand (WORLD_SIZE=2): refused before Ray."""
    root, model_dir, prompts = world
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"cannot run on 2 torchrun ranks"):
        run_rl("grpo_async", "tiny", grpo_overrides(model_dir, prompts, root / "rank", *RAY_GROUP))
    assert not (root / "rank").exists()  # refused before anything was written


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "trainer_group.launcher=slurm",
            "trainer_group: launcher: expected one of 'torchrun', 'ray', got 'slurm' (a string)",
        ),
        ("trainer_group.workers=0", "trainer_group: workers: expected an int >= 1, got 0"),
        (
            "trainer_group.nodes=2",
            "trainer_group: unknown key 'nodes' (allowed: launcher, workers, num_cpus, num_gpus)",
        ),
    ],
)
def test_a_bad_trainer_group_is_refused_naming_the_key(world, capsys, override, problem):
    root, model_dir, prompts = world
    argv = ["run", "grpo_async", "--config", "tiny",
            *grpo_overrides(model_dir, prompts, root / "bad", override)]  # fmt: skip
    with _any_component_allowed():  # the test reward
        assert cli_main(argv) == 1
    assert problem in capsys.readouterr().err
    assert "trainer_group" in grpo_async.KEYS


def test_two_trainer_actors_equal_two_torchrun_ranks_bitwise(two_actors, torchrun_ranks):
    """The same per-rank code in the same process group: the same weights, bit for bit."""
    assert_same_weights(final_weights(two_actors), final_weights(torchrun_ranks), atol=0.0)
    assert [r["groups"] for r in rollouts(two_actors)] == [
        r["groups"] for r in rollouts(torchrun_ranks)
    ]


@pytest.fixture
def two_nodes() -> Iterator[str]:
    """A Ray cluster of two nodes on this machine, one CPU each (``ray.cluster_utils.Cluster``:
    a head and a worker node, each with a raylet of its own, as two hosts would have); its
    address. Ray records the newest cluster's address in its default temp folder (a plain
    ``ray.init()`` would join it); the record (and the folder, when there was none) is put
    back as it was."""
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    record = Path(get_ray_address_file(None))
    before = record.read_bytes() if record.is_file() else None
    made = not record.parent.exists()
    record.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with ray_temp_dir() as temp:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "temp_dir": temp, "include_dashboard": False},
        )
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()
            if before is not None:
                record.write_bytes(before)
            elif made:
                shutil.rmtree(record.parent, ignore_errors=True)
            else:
                record.unlink(missing_ok=True)


@pytest.mark.slow  # two raylets and a cluster of its own: the multi-node case, as in tests/cli
def test_two_trainer_actors_on_two_ray_nodes_equal_one_node_bitwise(
    world, two_actors, two_nodes, tmp_path
):
    """``ray.address`` of a 2-node cluster: one trainer actor per node (a CPU each; the rollout
    and reward workers take none), the process group formed across the nodes (rank 0's node
    address, LOCAL_RANK 0 on each), checkpoints in the shared output folder; the run ends
    bitwise where the one-node run ends, on the same groups."""
    root, model_dir, prompts = world
    out = tmp_path / "two-nodes"
    overrides = grpo_overrides(
        model_dir,
        prompts,
        out,
        *FAST,
        "async_mode=sync",
        *RAY_GROUP,
        f"ray.address={two_nodes}",
        "rollout.num_cpus=0",
        "reward_workers.num_cpus=0",
    )
    command = cli_command(
        "--allow-any-component", "run", "grpo_async", "--config", "tiny", *overrides
    )
    done = subprocess.run(
        command,
        env=subprocess_env(RAY_AUTH_MODE="disabled"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "tunesmith: 2 trainer ranks as Ray actors on 2 nodes (pids" in output, output[-3000:]
    assert_same_weights(final_weights(out), final_weights(two_actors), atol=0.0)
    assert [r["groups"] for r in rollouts(out)] == [r["groups"] for r in rollouts(two_actors)]


def test_a_ray_instance_too_small_is_refused_in_one_line(world, tmp_path):
    """2 trainer actors + a rollout and a reward worker need 4 CPUs; Ray is given 3."""
    root, model_dir, prompts = world
    with ray_temp_dir() as temp:
        overrides = grpo_overrides(
            model_dir,
            prompts,
            tmp_path / "out",
            *FAST,
            *RAY_GROUP,
            f"ray.temp_dir={temp}",
            "ray.num_cpus=3",
        )
        done = forked.run_cli(
            ["--allow-any-component", "run", "grpo_async", "--config", "tiny", *overrides],
            env=subprocess_env(RAY_AUTH_MODE="disabled"),
            timeout=300,
        )
    assert done.returncode == 1, done.stderr[-3000:]
    assert one_error(done.stdout + done.stderr) == (
        "tunesmith: error: trainer_group: 2 trainer ranks and the rollout and reward workers "
        "need 4 CPUs, the Ray instance has 3: set ray.num_cpus (CPUs Ray may count), or lower "
        "trainer_group.num_cpus, rollout.num_cpus or reward_workers.num_cpus"
    )
