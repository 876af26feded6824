"""The trainer of asynchronous GRPO as a group of Ray actors (``trainer_group.launcher: ray``).

``trainer_group: {launcher, workers, num_cpus, num_gpus}`` chooses who runs the trainer's
ranks. ``torchrun`` (the default): this process, or torchrun's ranks with ``--nproc-per-node``.
``ray``: this process (started without ``--nproc-per-node``) becomes a Ray driver. It starts
Ray (or joins ``ray.address``) and creates ``workers`` trainer actors of ``num_cpus`` CPUs
(also their torch threads) and ``num_gpus`` GPUs each. Each actor sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (a free port on rank 0's
host) and runs the recipe's per-rank ``train`` through
:func:`~tunesmith.training.loop.run_main`, as a torchrun rank does: the same process group
(gloo on CPU, NCCL on GPUs), ``parallelism`` (FSDP2, TP, ...) and checkpoints. Rank 0's actor
drives the rollout pipeline; its workers join the same Ray instance and are owned by that
actor, so they die with it.

* **Output.** Each rank writes its whole output (Python's, C++'s, its traceback) to
  ``<output_dir>/logs/trainer-group-<time>/rank<N>.log``. Rank 0 also writes what a
  single-process run prints (progress, metrics, checkpoints) to ``console.log`` there, which
  this process copies to its console as it grows. Ray's own messages go to ``driver.log``
  (unless ``ray.log_to_driver``). On several nodes ``output_dir`` must be a folder every node
  shares, as the checkpoints need.
* **Log files.** ``logs/`` and the ``trainer-group-<time>`` folder must be real folders, and
  each log is opened without following a link and refused when it is a hard link
  (:func:`~tunesmith.models.atomic.open_no_follow`): one planted there is refused with one
  line naming it, by the driver before Ray starts, and again by each rank when it opens its
  own. Every line written to the logs by Python has the run's secret values (the config's
  ``${oc.env:...}`` reads) replaced by their names (:mod:`tunesmith.config.secrets`; the
  ranks get the names in ``TUNESMITH_SECRET_ENV``); output that C/C++ code writes straight to
  a rank's file descriptors is not filtered.
* **Faults.** A rank that raises, or whose process dies (a signal, the OOM killer), ends the
  run with one line (``rank 1 of 2: ...``, the root cause: a dead process before a rank's own
  error before a collective that failed because of another rank). The driver then kills
  every trainer actor (and with rank 0 its rollout and reward workers), shuts Ray down when
  it started it, and exits 1. Checkpoints are atomic: the last one verifies and
  ``resume=auto`` goes on from it.
* **Signals.** Ctrl-C (SIGINT), SIGTERM or SIGHUP to this process
  (:mod:`~tunesmith.training.stop_signals`) is sent on to every trainer actor as SIGTERM. A
  rank in training then saves a checkpoint at the end of the step, as under torchrun, and the
  run ends with exit code 0 once every actor, rollout and reward worker (and the Ray instance
  it started) is gone; a rank still building its model stops at once. A second Ctrl-C kills
  the actors at once.

Example::

    cfg.trainer_group = {"launcher": "ray", "workers": 2, "num_gpus": 1}
    run_trainers(grpo.train, cfg, KEYS, RULES)  # as tunesmith.recipes.grpo_async.main does
    # -> returns once both ranks are done; their output is in
    #    <output_dir>/logs/trainer-group-<time>/rank0.log, rank1.log and console.log
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from omegaconf import DictConfig, OmegaConf

from tunesmith.config.errors import type_name
from tunesmith.config.secrets import SECRET_NAMES_ENV, RedactingStream, redact, secret_names
from tunesmith.models.atomic import UnsafePathError, open_no_follow, real_folder
from tunesmith.rl.asynchronous.pipeline import (
    WorkerResources,
    actor_cause,
    init_ray,
    require_ray,
    runtime_env,
)
from tunesmith.training.logging.console import Tee
from tunesmith.training.loop import resolve_resume, run_main
from tunesmith.training.parallel.distributed import (
    DistributedContext,
    ParallelDims,
    PeerFailureError,
)
from tunesmith.training.rules import Rule, choice, integer, number
from tunesmith.training.stop_signals import handle_stop_signals

__all__ = [
    "LAUNCHERS",
    "TRAINER_GROUP_RULE",
    "GroupSettings",
    "TrainerGroupError",
    "TrainerRank",
    "check_launch",
    "run_trainers",
]

LAUNCHERS = ("torchrun", "ray")
_KEY_RULES: dict[str, Rule] = {
    "launcher": choice(*LAUNCHERS), "workers": integer(1),
    "num_cpus": number(at_least=0), "num_gpus": integer(0),
}  # fmt: skip
_GRACE_S = 10.0  # how long a collective's failure waits for the rank that caused it to report
_POLL_S = 0.2  # how often the driver looks at the actors, its signals and rank 0's console

Train = Callable[[DictConfig, DistributedContext], None]
_NO_RUNTIME_ENV = (
    ": the trainer actors run in this process's Python environment; a Ray runtime environment "
    "runs code and is only for rollout and reward workers (with --allow-runtime-env)"
)


def _group_problem(value: Any) -> str | None:
    """What is wrong inside a ``trainer_group`` mapping, or None."""
    if value is None:
        return None
    for key in value.keys():  # noqa: SIM118 (a DictConfig or a dict)
        if key not in _KEY_RULES:
            why = _NO_RUNTIME_ENV if key == "runtime_env" else ""
            return f"unknown key {key!r} (allowed: {', '.join(_KEY_RULES)}){why}"
    for key, rule in _KEY_RULES.items():
        problem = rule.problem(value[key]) if key in value else None
        if problem is not None:
            return f"{key}: {problem}"
    return None


TRAINER_GROUP_RULE = Rule(
    "a mapping of launcher (torchrun or ray), workers, num_cpus, num_gpus, or null (torchrun)",
    lambda v: v is None or type_name(v) == "mapping",
    extra=_group_problem,
)
"""The rule of the ``trainer_group`` key.

>>> TRAINER_GROUP_RULE.problem({"launcher": "slurm"})
"launcher: expected one of 'torchrun', 'ray', got 'slurm' (a string)"
"""


@dataclass(frozen=True)
class GroupSettings:
    """The ``trainer_group`` section with its defaults.

    >>> GroupSettings.of(OmegaConf.create({"trainer_group": {"launcher": "ray", "workers": 2}}))
    GroupSettings(launcher='ray', workers=2, num_cpus=1.0, num_gpus=0)
    """

    launcher: str = "torchrun"
    workers: int = 1
    num_cpus: float = 1.0
    num_gpus: int = 0

    @classmethod
    def of(cls, cfg: DictConfig) -> GroupSettings:
        node = cfg.get("trainer_group")
        given = {} if node is None else dict(OmegaConf.to_container(node, resolve=True))
        return cls(
            str(given.get("launcher", "torchrun")),
            int(given.get("workers", 1)),
            float(given.get("num_cpus", 1)),
            int(given.get("num_gpus", 0)),
        )


class TrainerGroupError(RuntimeError):
    """A trainer rank of the group failed; the message is one line naming it and the cause."""


def check_launch(cfg: DictConfig, world_size: int) -> None:
    """Refuse ``trainer_group.launcher: ray`` inside ``world_size`` > 1 torchrun ranks: the Ray
    launcher starts the ranks itself.

    >>> check_launch(OmegaConf.create({"trainer_group": {"launcher": "ray"}}), 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: trainer_group.launcher: ray starts the trainer's ranks itself as Ray actors ...
    """
    group = GroupSettings.of(cfg)
    if group.launcher == "ray" and world_size > 1:
        raise ValueError(
            f"trainer_group.launcher: ray starts the trainer's ranks itself as Ray actors "
            f"(trainer_group.workers: {group.workers}), so it cannot run on {world_size} "
            "torchrun ranks: drop --nproc-per-node/--nnodes, or set "
            "trainer_group.launcher=torchrun"
        )


def run_trainers(
    train: Train, cfg: DictConfig, keys: Sequence[str], rules: Mapping[str, Rule]
) -> None:
    """A recipe's ``main`` with ``cfg.trainer_group``: ``train`` on this process's ranks
    (:func:`~tunesmith.training.loop.run_main`, the ``torchrun`` launcher), or on a group of
    Ray actors this process drives (``ray``; see the module docs)."""
    group = GroupSettings.of(cfg)
    if group.launcher != "ray":
        run_main(train, cfg, keys, rules)
        return
    check_launch(cfg, int(os.environ.get("WORLD_SIZE", 1)))
    ParallelDims.resolve(cfg.get("parallelism"), group.workers)  # a layout that does not fit
    cfg = resolve_resume(cfg)  # once for every rank: resume=auto decided here
    _Driver(train, cfg, list(keys), dict(rules), group).run()


# ----------------------------------------------------------------------------- the actor


@dataclass(frozen=True)
class RankJob:
    """What a trainer actor needs to run its rank (plain data and the recipe's functions)."""

    train: Train
    config: dict[str, Any]  # the run's config, interpolations kept
    keys: list[str]
    rules: dict[str, Rule]
    env: dict[str, str]  # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
    # TUNESMITH_SECRET_ENV (the names, never the values, of the config's oc.env reads)
    cwd: str  # the driver's: relative paths of the config mean the same
    log_dir: str
    threads: int
    console_tty: bool  # the driver's console is a terminal (``progress_bar: auto``)


class TrainerRank:
    """One trainer rank as a Ray actor (``ray.remote(...)(TrainerRank)``): :meth:`where` it
    runs, then :meth:`run` its rank of the recipe."""

    def where(self) -> dict[str, Any]:
        """Its pid, Ray node id, node address and a free TCP port there."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "port": port}  # fmt: skip

    def run(self, job: RankJob) -> dict[str, Any] | None:
        """Run the rank; None when it succeeded, else ``{"message", "peer"}``: its error in
        one line (``rank R of N: ...``) and whether it is a collective that failed because
        of another rank. The traceback goes to its log."""
        os.environ.update(job.env)
        if Path(job.cwd).is_dir():
            os.chdir(job.cwd)
        torch.set_num_threads(job.threads)
        rank, world = int(job.env["RANK"]), int(job.env["WORLD_SIZE"])
        try:
            log = _route_output(Path(job.log_dir), rank, job.console_tty)
        except OSError as error:  # a planted link as its log, an unwritable folder: one line
            return {"message": redact(f"rank {rank} of {world}: {error}"), "peer": False}
        try:
            run_main(job.train, OmegaConf.create(job.config), job.keys, job.rules)
        except Exception as error:
            log.write(
                f"rank {rank} of {world} failed:\n{''.join(traceback.format_exception(error))}"
            )
            message = str(error).strip() or type(error).__name__
            if not message.startswith(f"rank {rank} of {world}:"):
                message = f"rank {rank} of {world}: {message}"
            return {"message": redact(message), "peer": isinstance(error, PeerFailureError)}
        finally:
            sys.stdout.flush()
        return None


def _route_output(log_dir: Path, rank: int, tty: bool) -> TextIO:
    """Send this process's output to ``log_dir/rank<N>.log`` (its file descriptors too, for
    C++'s output); rank 0's Python output also to ``log_dir/console.log``. Both files are
    opened (:func:`_open_log`: a planted link refused) before any output is redirected."""
    real_folder(log_dir)
    log = _open_log(log_dir / f"rank{rank}.log")
    try:
        console = _open_log(log_dir / "console.log") if rank == 0 else None
    except BaseException:
        log.close()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log if console is None else Tee(console, log, tty)
    return log


def _open_log(path: Path) -> TextIO:
    """``path`` opened to append, line by line, as a log of the group: a symbolic link, a
    FIFO or a hard link there is refused (:class:`~tunesmith.models.atomic.UnsafePathError`,
    one line naming it), and every text written has the run's secret values redacted.

    Example::

        >>> folder = real_folder("out/logs/trainer-group-20260101-120000")
        >>> log = _open_log(folder / "rank1.log")
        >>> log.write("step 1: loss 2.31\\n")
        18
        >>> log.close()
        >>> (folder / "rank1.log").read_text()
        'step 1: loss 2.31\\n'
    """
    file = open_no_follow(path, "a", buffering=1, errors="replace")
    return RedactingStream(file)  # type: ignore[return-value]  # a TextIO with redaction


# ----------------------------------------------------------------------------- the driver


class _Driver:
    """Starts the trainer actors, shows rank 0's console, forwards signals, waits, and turns
    the first failure into one line (see the module docs)."""

    def __init__(
        self,
        train: Train,
        cfg: DictConfig,
        keys: list[str],
        rules: dict[str, Rule],
        group: GroupSettings,
    ) -> None:
        self.train, self.cfg, self.keys, self.rules, self.group = train, cfg, keys, rules, group
        self.ray = require_ray()
        node = cfg.get("ray")
        self.options = {} if node is None else dict(OmegaConf.to_container(node, resolve=True))
        self.log_dir = _log_dir(cfg)
        self.out, self.err = sys.stdout, sys.stderr  # the console
        self.actors: list[Any] = []
        self.where: list[dict[str, Any]] = []
        self.signals: list[int] = []
        self.forwarded = False
        self.need = _resources_needed(cfg, group)

    def run(self) -> None:
        if not self.options.get("address") and self.options.get("num_cpus") is not None:
            have = {"CPU": float(self.options["num_cpus"])}  # known before Ray starts
            _refuse_if_short(self.group.workers, self.need, have, kinds=("CPU",))
        quiet = not bool(self.options.get("log_to_driver", False))
        for name in ["console.log", *(f"rank{r}.log" for r in range(self.group.workers))]:
            _open_log(self.log_dir / name).close()  # a planted link: refused before Ray starts
        driver_log = _open_log(self.log_dir / "driver.log")
        owns = False
        try:
            with _redirected(driver_log, enabled=quiet):
                owns = init_ray(self.ray, self.options)
                try:
                    with self._signals_forwarded():  # after ray.init, which sets its own
                        failure = self._start_and_wait(owns)
                finally:
                    self._stop_actors()
                    if owns:
                        self.ray.shutdown()
        finally:
            driver_log.close()
        if failure is not None:
            raise TrainerGroupError(f"{failure}; the output of every rank is in {self.log_dir}")

    def _start_and_wait(self, owns: bool) -> str | None:
        ray, group = self.ray, self.group
        if owns:  # the CPUs and GPUs Ray found on this machine
            _refuse_if_short(group.workers, self.need, ray.cluster_resources())
        actor_class = ray.remote(
            num_cpus=group.num_cpus,
            num_gpus=group.num_gpus,
            max_restarts=0,
            max_task_retries=0,
            runtime_env=runtime_env({}),
        )(TrainerRank)
        self.actors = [actor_class.remote() for _ in range(group.workers)]
        try:
            self.where = ray.get([a.where.remote() for a in self.actors])
        except ray.exceptions.RayActorError as error:
            return f"a trainer rank could not start: {actor_cause(error)}"
        pids, nodes = [w["pid"] for w in self.where], len({w["node"] for w in self.where})
        print(
            f"tunesmith: {group.workers} trainer ranks as Ray actors on {nodes} "
            f"node{'s' * (nodes > 1)} (pids {pids}); the output of every rank goes to "
            f"{self.log_dir}",
            file=self.err,
        )
        refs = {
            actor.run.remote(job): rank
            for rank, (actor, job) in enumerate(zip(self.actors, self._jobs()))
        }
        return self._wait(refs)

    def _jobs(self) -> list[RankJob]:
        config = OmegaConf.to_container(self.cfg, resolve=False)
        nodes = [w["node"] for w in self.where]
        master = self.where[0]
        jobs = []
        for rank, node in enumerate(nodes):
            # its index among its node's ranks; with GPUs, Ray shows each actor its own only
            local = 0 if self.group.num_gpus else nodes[:rank].count(node)
            env = {"RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "LOCAL_RANK": str(local),
                   "LOCAL_WORLD_SIZE": str(nodes.count(node)),
                   "MASTER_ADDR": str(master["ip"]), "MASTER_PORT": str(master["port"]),
                   SECRET_NAMES_ENV: ",".join(secret_names())}  # fmt: skip
            jobs.append(
                RankJob(
                    self.train,
                    config,
                    self.keys,
                    self.rules,
                    env,
                    os.getcwd(),
                    str(self.log_dir),
                    threads=max(1, int(self.group.num_cpus)),
                    console_tty=self.out.isatty(),
                )
            )
        return jobs

    def _wait(self, refs: dict[Any, int]) -> str | None:
        """Wait for every rank, showing rank 0's console; the root failure's line, or None."""
        ray, tail = self.ray, _Tail(self.log_dir / "console.log", self.out)
        failures: list[tuple[int, float, str]] = []  # (kind: 0 died, 1 own, 2 peer; time; line)
        first_s = None
        try:
            while refs:
                ready, _ = ray.wait(list(refs), num_returns=1, timeout=_POLL_S)
                tail.pump()
                self._forward_signals()
                for ref in ready:
                    rank = refs.pop(ref)
                    failure = self._outcome(ref, rank)
                    if failure is not None:
                        failures.append((failure[0], time.monotonic(), failure[1]))
                if not failures:
                    continue
                first_s = first_s or time.monotonic()
                if min(f[0] for f in failures) < 2 or time.monotonic() - first_s > _GRACE_S:
                    break  # a root cause, or no other rank tells why a collective failed
        finally:
            tail.pump()
        return min(failures)[2] if failures else None

    def _outcome(self, ref: Any, rank: int) -> tuple[int, str] | None:
        """A finished rank's failure as (kind, line), or None when it succeeded."""
        ray, world = self.ray, len(self.actors)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            return 0, f"rank {rank} of {world}: {_death(error, self.where[rank]['pid'])}"
        if result is None:
            return None
        return (2 if result["peer"] else 1), str(result["message"])

    def _stop_actors(self) -> None:
        """Kill every trainer actor (rank 0's workers die with it) and wait until those on
        this node have exited."""
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
        here = self.ray.get_runtime_context().get_node_id() if self.where else None
        pids = [w["pid"] for w in self.where if w["node"] == here]
        deadline = time.monotonic() + 30
        while any(not _gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)

    # -- signals

    @contextlib.contextmanager
    def _signals_forwarded(self) -> Iterator[None]:
        """Each stop signal (SIGINT, SIGTERM, SIGHUP) asks the ranks to stop (forwarded in the
        wait loop); a second SIGINT aborts at once."""

        def handler(signum: int, frame: Any) -> None:
            if signum == signal.SIGINT and self.signals:
                raise KeyboardInterrupt
            self.signals.append(signum)

        restore = handle_stop_signals(handler)
        try:
            yield
        finally:
            restore()

    def _forward_signals(self) -> None:
        """Send SIGTERM to every trainer actor's process once a signal has come."""
        if not self.signals or self.forwarded:
            return
        self.forwarded = True
        name = signal.Signals(self.signals[0]).name
        print(
            f"\n{name}: sent SIGTERM to the trainer ranks: they save a checkpoint at the "
            "end of this step, then stop (Ctrl-C again aborts at once)",
            file=self.err,
        )
        here = self.ray.get_runtime_context().get_node_id()
        for w in self.where:
            if w["node"] == here:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w["pid"], signal.SIGTERM)
            else:  # a task on that node signals it
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                strategy = NodeAffinitySchedulingStrategy(w["node"], soft=False)
                self.ray.remote(num_cpus=0, scheduling_strategy=strategy)(_terminate).remote(
                    w["pid"]
                )


def _terminate(pid: int) -> None:
    """SIGTERM to ``pid`` (a Ray task on that process's node)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)


# ----------------------------------------------------------------------------- helpers


def _resources_needed(cfg: DictConfig, group: GroupSettings) -> dict[str, float]:
    """The CPUs and GPUs the trainer actors and the rollout and reward workers ask Ray for."""
    rollout = WorkerResources.of(cfg.get("rollout"))
    reward = WorkerResources.of(cfg.get("reward_workers"))
    return {
        "CPU": group.workers * group.num_cpus
        + rollout.workers * rollout.num_cpus
        + reward.workers * reward.num_cpus,
        "GPU": group.workers * group.num_gpus
        + rollout.workers * rollout.num_gpus
        + reward.workers * reward.num_gpus,
    }


def _refuse_if_short(
    ranks: int,
    need: Mapping[str, float],
    have: Mapping[str, float],
    kinds: Sequence[str] = ("CPU", "GPU"),
) -> None:
    """Refuse, before any actor waits forever, a local instance too small for what ``ranks``
    trainer actors and the workers ``need`` (checked before Ray starts when ``ray.num_cpus``
    is set, else once Ray has counted the machine).

    >>> _refuse_if_short(2, {"CPU": 4.0, "GPU": 0.0}, {"CPU": 3.0})
    Traceback (most recent call last):
    ValueError: trainer_group: 2 trainer ranks and the rollout and reward workers need 4 CPUs, \
the Ray instance has 3: set ray.num_cpus (CPUs Ray may count), or lower trainer_group.num_cpus, \
rollout.num_cpus or reward_workers.num_cpus
    """
    for kind in kinds:
        needed, there = need.get(kind, 0.0), have.get(kind, 0.0)
        if needed > there + 1e-9:
            raise ValueError(
                f"trainer_group: {ranks} trainer ranks and the rollout and reward workers need "
                f"{needed:g} {kind}s, the Ray instance has {there:g}: "
                f"set ray.num_cpus (CPUs Ray may count), or lower trainer_group.num_cpus, "
                f"rollout.num_cpus or reward_workers.num_cpus"
            )


def _death(error: BaseException, pid: int) -> str:
    """How a trainer actor's process ended, in words.

    >>> _death(RuntimeError("Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
    ...                     "unexpectedly exits with a connection error code 2. End of file."), 7)
    'its process (pid 7) died: killed by a signal (SIGKILL, the out-of-memory killer: see `dmesg`) or crashed'
    """
    text = str(error)
    detail = (
        text.split("Worker exit detail:", 1)[1].strip() if "Worker exit detail:" in text else ""
    )
    if "unexpectedly exits" in detail or not detail:
        how = "killed by a signal (SIGKILL, the out-of-memory killer: see `dmesg`) or crashed"
        return f"its process (pid {pid}) died: {how}"
    return f"its process (pid {pid}) ended: {detail.split('. ')[0].rstrip('.')}"


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _log_dir(cfg: DictConfig) -> Path:
    """``<output_dir>/logs/trainer-group-<date>-<time>`` (a temp folder without output_dir);
    ``logs/`` or that folder planted as a symbolic link is refused
    (:func:`~tunesmith.models.atomic.real_folder`).

    Example::

        >>> _log_dir(OmegaConf.create({"output_dir": "out"}))
        PosixPath('out/logs/trainer-group-...')
    """
    name = "trainer-group-" + time.strftime("%Y%m%d-%H%M%S")
    output_dir = cfg.get("output_dir")
    if not output_dir:
        return Path(tempfile.mkdtemp(prefix=f"tunesmith-{name}-"))
    return real_folder(real_folder(Path(str(output_dir)) / "logs") / name)


class _Tail:
    """Copies what is appended to ``path`` to ``out`` (rank 0's console on the driver's)."""

    def __init__(self, path: Path, out: TextIO) -> None:
        self.path, self.out, self.offset = path, out, 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def pump(self) -> None:
        try:
            with open_no_follow(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except (FileNotFoundError, UnsafePathError):  # rank 0 refuses a planted link itself
            return
        if data:
            self.offset += len(data)
            self.out.write(self.decoder.decode(data))
            self.out.flush()


@contextlib.contextmanager
def _redirected(log: TextIO, enabled: bool) -> Iterator[None]:
    """Ray's messages to the driver (its ``(raylet)`` notices, its logger) go to ``log``."""
    if not enabled:
        yield
        return
    handlers = [
        h
        for h in logging.getLogger("ray").handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
    streams = [h.stream for h in handlers]
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = log
    for h in handlers:
        h.setStream(log)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for h, stream in zip(handlers, streams):
            h.setStream(stream)
