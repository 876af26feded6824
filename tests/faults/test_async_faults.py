"""Faults of asynchronous GRPO (``tunesmith run grpo_async``): rank 0 of the trainer starts a
Ray instance of its own, with rollout and reward workers as Ray actors (their pids are on the
``async_mode ...`` line of its output). Each case is a real run in a child of the suite's fork
server, with its Ray instance in a short temp dir of its own (Ray's sockets live there), so
the processes of that instance can be told from any other: its ``raylet``, ``gcs_server`` and
helpers name the dir on their command line, its workers carry the raylet's pid in their
environment (:class:`RayProcesses`).

* a trainer rank SIGKILLed after the step-2 checkpoint: rank 0 exits 1 with one line naming
  the failed collective, takes its Ray instance and workers down with it, and the step-2
  checkpoint verifies and a resumed run (2 ranks: the async source's state does not reshard
  to another data-parallel size) goes on from batch 2;
* with the trainer as Ray actors (``trainer_group.launcher: ray``), rank 1's actor SIGKILLed
  after the step-2 checkpoint: the driver exits 1 with one line naming the rank, every process
  of the run is gone, and the resumed run ends bitwise where the uninterrupted one ends;
* the reward worker SIGKILLed while it scores (a test reward that marks each call and takes a
  second, so the kill lands inside one): Ray restarts it, its prompts are sampled again, and
  every prompt of the stream is trained on exactly once, in order;
* workers that fail in their constructor (``rollout.engine: vllm`` without vLLM): one line
  naming the role and the cause, and no Ray process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.faults.catalogue import params
from tests.faults.harness import assert_same_weights, finish, read_mark, start_child, stop
from tests.recipes.sft_world import final_weights, free_port, make_model_dir, read_metrics
from tests.rl.rl_world import DigitFraction, grpo_overrides, make_prompts, ray_temp_dir
from tunesmith.rl.prompts import PromptStream
from tunesmith.training import CheckpointDirectory

STEPS = 4
PROMPTS = 24
PER_STEP = 4  # prompts_per_step of the tiny config
BOUND_S = 60  # the survivor must be gone this long after the fault
GONE_S = 30  # Ray's processes must be gone this long after the run's exit
ENV = {"RAY_AUTH_MODE": "disabled"}  # a local instance needs no token
_PIDS = re.compile(r"rollout workers \(pids \[([\d, ]+)\]\), reward workers \(pids \[([\d, ]+)\]\)")
TRAINER_PIDS = re.compile(r"2 trainer ranks as Ray actors on \d+ nodes? \(pids \[(\d+), (\d+)\]\)")
RAY_GROUP = ("trainer_group.launcher=ray", "trainer_group.workers=2", "ray.num_cpus=4")


@dataclass(frozen=True)
class AsyncWorld:
    model_dir: Path
    prompts: Path  # 24 addition prompts


@pytest.fixture(scope="module")
def async_world(tmp_path_factory) -> AsyncWorld:
    root = tmp_path_factory.mktemp("async_faults")
    return AsyncWorld(make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=PROMPTS))


@pytest.fixture
def ray_dir():
    """A temp dir for the run's Ray instance."""
    with ray_temp_dir() as temp:
        yield Path(temp)


def async_argv(world: AsyncWorld, out: Path, ray_dir: Path, *extra: str) -> list[str]:
    """``run grpo_async --config tiny`` on the world (test reward: ``--allow-any-component``)."""
    overrides = grpo_overrides(
        world.model_dir,
        world.prompts,
        out,
        f"max_steps={STEPS}",
        "generation.max_new_tokens=8",
        f"ray.temp_dir={ray_dir}",
        *extra,
    )
    return ["--allow-any-component", "run", "grpo_async", "--config", "tiny", *overrides]


class MarkedDigits(DigitFraction):
    """The digit reward, slowed down: each call first writes ``<marks>/<pid>-<n>`` (its ``n``-th
    call in this process) and then sleeps ``delay_s``, so a test can SIGKILL the reward worker
    while it is inside a call."""

    def __init__(self, marks: str, delay_s: float) -> None:
        self.marks, self.delay_s, self.calls = Path(marks), float(delay_s), 0

    def __call__(self, samples):
        self.calls += 1
        (self.marks / f"{os.getpid()}-{self.calls}").write_text("")
        time.sleep(self.delay_s)
        return super().__call__(samples)


class RayProcesses:
    """The processes of the Ray instance in ``temp_dir``, collected by :meth:`scan` while the
    run lives: those that name the dir on their command line (raylet, gcs_server, Ray's
    monitors) and those whose ``RAY_RAYLET_PID`` is such a raylet's (the workers)."""

    def __init__(self, temp_dir: Path) -> None:
        self.temp_dir = str(temp_dir)
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, name)

    def scan(self) -> None:
        raylets = {str(pid) for pid, (_, name) in self.seen.items() if name == "raylet"}
        for proc in psutil.process_iter(["pid", "name", "cmdline", "create_time"]):
            if proc.pid in self.seen:
                continue
            try:
                mine = self.temp_dir in " ".join(proc.info["cmdline"] or [])
                mine = mine or proc.environ().get("RAY_RAYLET_PID") in raylets
            except (psutil.Error, OSError):
                continue
            if mine:
                self.seen[proc.pid] = (proc.info["create_time"], proc.info["name"])

    def alive(self, extra: Sequence[int] = ()) -> list[str]:
        """``name (pid)`` of every seen process (and of ``extra`` pids) still running."""
        left = []
        for pid in {*self.seen, *extra}:
            try:
                proc = psutil.Process(pid)
                created = self.seen.get(pid, (proc.create_time(), ""))[0]
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{proc.name()} ({pid})")
            except psutil.NoSuchProcess:
                continue
        return sorted(left)

    def wait_gone(self, extra: Sequence[int] = ()) -> float:
        """Seconds until every one has exited (fails the test after :data:`GONE_S`)."""
        start = time.monotonic()
        while left := self.alive(extra):
            if time.monotonic() - start > GONE_S:
                raise AssertionError(f"Ray processes left behind after {GONE_S} s: {left}")
            time.sleep(0.5)
        return time.monotonic() - start


def wait_for(check: Callable[[], object], timeout: float, what: str, log: Path) -> object:
    """Poll ``check`` until it returns something true."""
    deadline = time.monotonic() + timeout
    while not (found := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    return found


def watch_until_exit(process, log: Path, ray: RayProcesses, *, timeout: float, started: float):
    """Wait for ``process`` while scanning for its Ray processes; then :func:`finish` it."""
    deadline = time.monotonic() + timeout
    while process.exitcode is None and time.monotonic() < deadline:
        ray.scan()
        process.join(0.5)
    return finish(process, log, timeout=1, started=started)


def start_ranks(argv: list[str], logs: Path, probes: dict | None = None) -> tuple[list, list]:
    """Two trainer ranks started as torchrun starts them (``probes``: rank 1's); their
    processes and logs (``<logs>0.log``, ``<logs>1.log``)."""
    port, ranks, paths = str(free_port()), [], []
    for rank in range(2):
        env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}  # fmt: skip
        paths.append(Path(f"{logs}{rank}.log"))
        ranks.append(start_child(argv, paths[-1], env=env, probes=probes if rank else None))
    return ranks, paths


def worker_pids(output: str) -> dict[str, list[int]]:
    """The pids on rank 0's ``async_mode ...`` line."""
    found = _PIDS.search(output)
    assert found, output[-3000:]
    return {
        role: [int(p) for p in found.group(i).split(",")]
        for i, role in ((1, "rollout"), (2, "reward"))
    }


def one_error(output: str) -> str:
    """The run's single ``tunesmith: error:`` line (and no traceback)."""
    assert "Traceback" not in output and 'File "' not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("tunesmith: error: ")]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def rollouts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


def verified_checkpoints(out: Path) -> list[str]:
    """The committed checkpoints of a run, each checked against its manifest."""
    root = out / "checkpoints"
    names = [p.name for p in CheckpointDirectory(root, clean_stale=False).list()]
    for name in names:
        assert CheckpointDirectory.is_complete(root / name, verify=True), name
    return names


def case(case_id: str) -> list:
    """The catalogue's ``pytest.param`` of one case of kind ``async_rl``."""
    return [p for p in params("fault", "async_rl") if p.id == case_id]


@pytest.mark.parametrize("case", case("async-trainer-rank-killed"))
def test_a_dead_trainer_rank_ends_the_run_and_its_ray_workers(
    case, async_world, ray_dir, tmp_path, outcome
):
    """2 trainer ranks (gloo, FSDP2): rank 1 SIGKILLs itself at its 5th forward, the first
    after the step-2 checkpoint (each step runs two forwards on a rank: the log-probs before
    the update, and the update's)."""
    out, mark = tmp_path / "out", tmp_path / "mark.json"
    settings = ("save_every_n_steps=2", "distributed_timeout_s=300")  # Ray starts slowly
    argv = async_argv(async_world, out, ray_dir, *settings)
    ray, started = RayProcesses(ray_dir), time.monotonic()
    ranks, logs = start_ranks(argv, tmp_path / "run", {"on": "forward", "nth": 5, "mark": mark})
    try:
        done = watch_until_exit(ranks[0], logs[0], ray, timeout=400, started=started)
        assert mark.is_file(), "rank 1 never reached its fifth forward pass"
        after_s = time.monotonic() - read_mark(mark)["time"]
    finally:
        for process in ranks:
            stop(process)
    assert ranks[1].exitcode == -signal.SIGKILL
    assert done.exitcode == 1, done.output[-3000:]
    assert after_s < BOUND_S, f"rank 0 took {after_s:.0f} s to give up"
    error = one_error(done.output)
    assert "rank 0 of 2: a collective operation with the other ranks failed" in error
    assert "another rank has probably died or hangs" in error

    pids = worker_pids(done.output)
    assert {*pids["rollout"], *pids["reward"]} <= set(ray.seen), ray.seen  # it was watched
    gone_s = ray.wait_gone()

    assert sorted(read_metrics(out)) == [1, 2]  # it died in step 3, after the step-2 save
    left = verified_checkpoints(out)
    assert left == ["step_000002"]
    assert [r["batch"] for r in rollouts(out)][:2] == [0, 1]

    resumed, logs = start_ranks([*argv, "resume=true"], tmp_path / "resumed")
    try:
        for rank in range(2):
            done = finish(resumed[rank], logs[rank], timeout=400, started=time.monotonic())
            assert done.exitcode == 0, f"rank {rank}: {done.output[-3000:]}"
    finally:
        for process in resumed:
            stop(process)
    assert sorted(read_metrics(out)) == list(range(1, STEPS + 1))
    assert verified_checkpoints(out)[-1] == f"step_{STEPS:06d}"
    records = rollouts(out)[-(STEPS - 2) :]  # the resumed run's: it went on from batch 2
    assert [r["batch"] for r in records] == list(range(2, STEPS)), rollouts(out)
    stream = PromptStream(list(range(PROMPTS)), PER_STEP, shuffle=True, seed=0)
    draws = [sorted(stream.next_prompts()) for _ in range(STEPS)]
    for record in records:  # the prompt stream's position came back with the checkpoint
        assert sorted(g[1] for g in record["groups"]) == draws[record["batch"]]
    outcome.update(
        exit_code=1,
        seconds_after_fault=round(after_s, 1),
        error=error,
        ray_processes_gone_after_s=round(gone_s, 1),
        checkpoints_left=left,
        resumed_from=left[-1],
        lost_checkpoints=0,
    )


@pytest.mark.parametrize("case", case("async-trainer-actor-killed"))
def test_a_killed_trainer_actor_ends_the_run_in_one_line_and_resumes(
    case, async_world, tmp_path, outcome
):
    """The driver's console names the actors' pids; rank 1's is SIGKILLed when the step-2
    checkpoint line appears (a reward call takes a second, so step 3 is under way)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    slow = (
        f"rewards.rewards={{digits: {{_component_: {__name__}.MarkedDigits, "
        f"marks: {marks}, delay_s: 1.0}}}}"
    )
    settings = ("async_mode=sync", *RAY_GROUP, slow, "save_every_n_steps=2")
    reference, out = tmp_path / "reference", tmp_path / "out"
    with ray_temp_dir() as temp:
        argv = async_argv(async_world, reference, Path(temp), *settings)
        done = finish(
            start_child(argv, tmp_path / "reference.log", env=ENV),
            tmp_path / "reference.log",
            timeout=400,
            started=time.monotonic(),
        )
        assert done.exitcode == 0, done.output[-3000:]

    with ray_temp_dir() as temp:
        ray, log, started = RayProcesses(Path(temp)), tmp_path / "killed.log", time.monotonic()
        process = start_child(async_argv(async_world, out, Path(temp), *settings), log, env=ENV)
        try:
            found = wait_for(lambda: TRAINER_PIDS.search(log.read_text()), 300, "actors", log)
            actors = [int(found.group(1)), int(found.group(2))]
            wait_for(
                lambda: ray.scan() or "checkpoint: " in log.read_text(),
                300,
                "step-2 checkpoint line",
                log,
            )
            os.kill(actors[1], signal.SIGKILL)
            killed_at = time.monotonic()
            done = watch_until_exit(process, log, ray, timeout=300, started=started)
            after_s = time.monotonic() - killed_at
        finally:
            stop(process)
        assert done.exitcode == 1, done.output[-3000:]
        assert after_s < BOUND_S, f"the driver took {after_s:.0f} s to give up"
        error = one_error(done.output)
        assert error.startswith(
            f"tunesmith: error: rank 1 of 2: its process (pid {actors[1]}) died: killed by a signal"
        ), error
        workers = worker_pids(done.output)
        assert any(name == "raylet" for _, name in ray.seen.values()), ray.seen  # watched
        gone_s = ray.wait_gone([*actors, *workers["rollout"], *workers["reward"]])
    assert sorted(read_metrics(out)) == [1, 2]  # it died in step 3, after the step-2 save
    left = verified_checkpoints(out)
    assert left == ["step_000002"]

    with ray_temp_dir() as temp:
        argv = async_argv(async_world, out, Path(temp), *settings, "resume=auto")
        done = finish(
            start_child(argv, tmp_path / "resumed.log", env=ENV),
            tmp_path / "resumed.log",
            timeout=400,
            started=time.monotonic(),
        )
        assert done.exitcode == 0, done.output[-3000:]
    assert [r["batch"] for r in rollouts(out)] == [0, 1, 2, 3]  # went on from batch 2
    assert [r["groups"] for r in rollouts(out)] == [r["groups"] for r in rollouts(reference)]
    assert_same_weights(final_weights(out), final_weights(reference), "final weights")
    resumed, uninterrupted = read_metrics(out), read_metrics(reference)
    assert [resumed[s]["loss"] for s in range(1, STEPS + 1)] == [
        uninterrupted[s]["loss"] for s in range(1, STEPS + 1)
    ]
    outcome.update(
        exit_code=1,
        seconds_after_fault=round(after_s, 1),
        error=error,
        ray_processes_gone_after_s=round(gone_s, 1),
        checkpoints_left=left,
        resumed_from=left[-1],
        lost_checkpoints=0,
        resumed_equals_uninterrupted="bitwise",
    )


@pytest.mark.parametrize("case", case("async-reward-worker-killed"))
def test_a_killed_reward_worker_loses_and_duplicates_nothing(
    case, async_world, ray_dir, tmp_path, outcome
):
    """``overlap`` mode; the reward worker is SIGKILLed inside its second call (batch 1)."""
    out, marks, log = tmp_path / "out", tmp_path / "marks", tmp_path / "run.log"
    marks.mkdir()
    reward = (
        f"rewards.rewards={{digits: {{_component_: {__name__}.MarkedDigits, "
        f"marks: {marks}, delay_s: 1.0}}}}"
    )
    # One death fails every chunk queued on the worker and those sent while Ray restarts it
    # (ActorUnavailableError); the pipeline counts each as a restart (2 to 6 seen here), so
    # the default budget (3 per worker) is not what this case is about.
    argv = async_argv(
        async_world, out, ray_dir, "async_mode=overlap", "max_worker_restarts=20", reward
    )
    started, ray = time.monotonic(), RayProcesses(ray_dir)
    process = start_child(argv, log, env=ENV)
    try:
        wait_for(lambda: _PIDS.search(log.read_text()), 300, "async_mode line", log)
        victim = worker_pids(log.read_text())["reward"][0]
        wait_for(lambda: (marks / f"{victim}-2").exists(), 300, "second reward call", log)
        ray.scan()
        os.kill(victim, signal.SIGKILL)
        done = watch_until_exit(process, log, ray, timeout=300, started=started)
    finally:
        stop(process)
    assert done.exitcode == 0, done.output[-3000:]
    gone_s = ray.wait_gone()  # a run that ends well takes its Ray instance down too
    metrics = read_metrics(out)
    assert sorted(metrics) == list(range(1, STEPS + 1))  # every update made
    assert metrics[STEPS]["worker_restarts"] >= 1 and metrics[STEPS]["requeued_groups"] >= 1
    restarted = {m.name.split("-")[0] for m in marks.iterdir()} - {str(victim), str(process.pid)}
    assert restarted, "no restarted reward worker scored anything"

    records = rollouts(out)
    assert [r["batch"] for r in records] == list(range(STEPS))  # in order, each once
    stream = PromptStream(list(range(PROMPTS)), PER_STEP, shuffle=True, seed=0)
    for record in records:  # the stream's prompts of that step, each once, of that round
        expected = sorted(stream.next_prompts())
        assert sorted(g[1] for g in record["groups"]) == expected, record["batch"]
        assert {g[0] for g in record["groups"]} == {record["batch"]}
        assert all(0 <= record["version"] - g[2] <= 1 for g in record["groups"])  # overlap
    used = [tuple(g[:2]) for r in records for g in r["groups"]]
    assert len(used) == len(set(used)) == STEPS * PER_STEP
    outcome.update(
        killed="reward worker (SIGKILL, inside a call)",
        updates=len(metrics),
        worker_restarts=int(metrics[STEPS]["worker_restarts"]),
        requeued_groups=int(metrics[STEPS]["requeued_groups"]),
        groups_lost=0,
        groups_duplicated=0,
        ray_processes_gone_after_s=round(gone_s, 1),
    )


@pytest.mark.parametrize("case", case("async-worker-cannot-start"))
def test_workers_that_cannot_start_stop_the_run_in_one_line(
    case, async_world, ray_dir, tmp_path, outcome
):
    """``rollout.engine=vllm`` on a machine without vLLM: the rollout worker's constructor
    raises ImportError."""
    log, ray = tmp_path / "run.log", RayProcesses(ray_dir)
    argv = async_argv(async_world, tmp_path / "out", ray_dir, "rollout.engine=vllm")
    started = time.monotonic()
    process = start_child(argv, log, env=ENV)
    try:
        done = watch_until_exit(process, log, ray, timeout=300, started=started)
    finally:
        stop(process)
    assert done.exitcode == 1, done.output[-3000:]
    error = one_error(done.output)
    assert error.startswith(
        "tunesmith: error: a rollout worker could not start: ImportError: "
        "VLLMEngine needs vLLM, which is not installed"
    ), error
    assert any(name == "raylet" for _, name in ray.seen.values()), ray.seen  # it was watched
    gone_s = ray.wait_gone()
    outcome.update(exit_code=1, error=error, ray_processes_gone_after_s=round(gone_s, 1))
