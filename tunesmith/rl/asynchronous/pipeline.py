"""The rollout pipeline of asynchronous GRPO: rank 0 of the trainer drives rollout and reward
workers (Ray actors, :mod:`tunesmith.rl.asynchronous.workers`) and keeps the replay buffer.

Batch ``k`` (a step of the prompt stream, drawn in its own collection round) is first
trained on at policy version ``k * updates_per_batch`` (versions count optimizer updates). Its
prompts may be sent to a rollout worker once the workers have been sent a policy at most
``lead`` versions older than that:

* ``sync``: ``lead = 0``, every batch is sampled by the policy that trains on it (the
  synchronous recipe, with the generation in another process);
* ``overlap``: ``lead = updates_per_batch``, batch ``k + 1`` is sampled while the trainer
  trains on batch ``k`` (on-policy up to one batch);
* ``off_policy``: ``lead = max_staleness``, the workers run up to that many versions ahead.

A worker is sent its prompts in chunks (one per rollout worker per batch) and each result goes
on to a reward worker; both run in order on their actor, so weights sent after a chunk reach
the worker before the next one: a group's ``version`` is the policy that really sampled it.
Groups wait in the :class:`~tunesmith.rl.asynchronous.replay.ReplayBuffer` (at most ``capacity``
groups sampled or in flight: backpressure) until their batch is due. Weights go through Ray's object
store or a broadcast from trainer rank 0 (``rollout.weight_sync``,
:mod:`tunesmith.rl.asynchronous.weight_sync`). A worker that dies is restarted by Ray and sent the
current weights (a broadcast first re-forms its group with every rollout worker); its chunks are
sent again (same keys: same completions for the same policy), so no prompt is lost or trained
twice, and a run in ``sync`` mode ends with the weights it would have had without the failure.
:meth:`RolloutPipeline.state_dict` first waits for the chunks in flight (drain), so a resumed
run continues with exactly the groups it would have used.

With ``dynamic_sampling`` (DAPO, the config's key, as in the synchronous recipe) a batch is
*open* until its groups are fixed: once every group drawn for it is scored, the pipeline
applies the synchronous rule (:func:`dynamic_selection`: per data-parallel share, the groups
whose rewards differ, in draw order, then all-equal ones to fill up); while a share is short
and fewer than ``max_refills`` refills were drawn, it draws the next step of the stream as a
refill of that batch (a new collection round, sent with the policy published then, gated by
version as the batch's own prompts), and the batch waits for it. The next batch is drawn only
once the open one is fixed, so the stream's order (a batch's prompts, its refills, the next
batch's prompts) and the rounds are the synchronous recipe's in every mode, whatever the
timing, and a batch is fixed while the trainer waits for it: its refills are sampled by the
policy that trains on it. The cost: with ``off_policy`` the workers sample one batch ahead,
not ``max_staleness`` versions; refills may take the buffer past ``buffer_size`` by
``max_refills`` steps' groups (the groups a batch does not use are discarded once it is fixed).

Example::

    pipeline = RolloutPipeline(PipelineSettings.from_config(config), stream,
                               workers=worker_settings(cfg), mode="overlap", total_batches=10)
    pipeline.start()  # starts Ray (or joins ray.address) and the rollout / reward workers
    groups, metrics = pipeline.next_batch(0, version=0)
    # -> batch 0's groups, sampled by policy version 0, and metrics such as
    #    {'wait_s': 3.2, 'staleness_mean': 0.0, 'staleness_max': 0.0, ...}
    pipeline.close()
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from tunesmith.config import ALLOW_ANY_COMPONENT_ENV, ConfigError, any_component_allowed
from tunesmith.config.nodes import read_child
from tunesmith.rl.asynchronous.replay import ReplayBuffer
from tunesmith.rl.asynchronous.weight_sync import (
    DEFAULT_TIMEOUT_S,
    SYNC_MODES,
    CollectiveSync,
    ObjectStoreSync,
    collective_backend,
)
from tunesmith.rl.asynchronous.workers import RewardWorker, RolloutWorker, WorkerSettings
from tunesmith.rl.groups import Group
from tunesmith.rl.prompts import Prompt, PromptStream

__all__ = [
    "ALLOW_RUNTIME_ENV_ENV", "CONNECT_TIMEOUT_S", "MODES", "RAY_KEYS", "PipelineSettings",
    "RolloutPipeline", "WorkerResources",
    "actor_cause", "check_runtime_env", "dynamic_selection", "init_ray", "lead_versions",
    "ray_address_problem", "require_ray", "runtime_env", "runtime_env_allowed",
    "runtime_env_problem", "section_runtime_env_problem",
]  # fmt: skip

MODES = ("sync", "overlap", "off_policy")


def require_ray() -> Any:
    """The ``ray`` module, or one line naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            "asynchronous GRPO needs Ray, which is not installed: pip install 'tunesmith[rl]'"
        ) from None
    return ray


ALLOW_RUNTIME_ENV_ENV = "TUNESMITH_ALLOW_RUNTIME_ENV"  # set by --allow-runtime-env
CONNECT_TIMEOUT_S = 30.0  # ray.connect_timeout_s: how long joining ray.address may take
RAY_KEYS = ("address", "num_cpus", "temp_dir", "log_to_driver", "connect_timeout_s")
_RAY_SECTION = "ray.address"


def init_ray(ray: Any, options: Mapping[str, Any]) -> bool:
    """Connect this process to Ray as the run's ``ray:`` options say: join the cluster at
    ``address`` (``auto``, ``host:port``; refused with one line within ``connect_timeout_s``
    when nothing answers there), else start a local instance of ``num_cpus`` CPUs (null: the
    machine's) in ``temp_dir``. Whether it started a local instance (which the run then shuts
    down); an already connected process (a test's instance) is left as it is.

    Ray puts the working directory of the process that calls ``ray.init`` first on every
    worker's ``sys.path``; it is called from the folder that holds the ``tunesmith`` package
    instead (:func:`_code_dir`), so a ``torch.py`` or ``json.py`` in the run's folder is never
    imported by a worker.

    Example::

        init_ray(ray, {"address": "auto"})  # join the running cluster
        # -> False (the run leaves the cluster running)
        init_ray(ray, {"num_cpus": 4})  # nothing to join: start a local instance
        # -> True (the run shuts it down at the end)
    """
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "namespace": "tunesmith",
                              "log_to_driver": bool(options.get("log_to_driver", False))}  # fmt: skip
    address = options.get("address")
    timeout_s = float(options.get("connect_timeout_s") or CONNECT_TIMEOUT_S)
    if address:
        kwargs["address"] = _reachable(str(address), timeout_s, options.get("temp_dir"))
    else:
        kwargs["num_cpus"] = options.get("num_cpus")
        if options.get("temp_dir"):
            kwargs["_temp_dir"] = str(Path(str(options["temp_dir"])).resolve())
    with _working_directory(_code_dir()):
        if address:
            _init_within(ray, kwargs, timeout_s, str(address))
        else:
            ray.init(**kwargs)
    return not address


def _code_dir() -> str:
    """The folder that holds the imported ``tunesmith`` package: a source checkout's root, or
    ``site-packages``; what Ray may put on its workers' ``sys.path`` instead of the run's folder.

    >>> Path(_code_dir(), "tunesmith", "__init__.py").is_file()
    True
    """
    depth = len(__name__.split(".")) - 1  # tunesmith.rl.asynchronous.pipeline: 3 folders up
    return str(Path(__file__).resolve().parents[depth])


@contextlib.contextmanager
def _working_directory(folder: str) -> Iterator[None]:
    """Run the block in ``folder``, then go back to the working directory of before."""
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def ray_address_problem(address: Any) -> str | None:
    """What is wrong with a ``ray.address`` as written (before anything connects), or None.

    >>> ray_address_problem("head-node")
    "expected null, 'auto' or HOST:PORT (e.g. 10.0.0.5:6379, ray://head:10001), got 'head-node'"
    """
    if address is None or address == "auto":
        return None
    if isinstance(address, str) and _host_port(address) is not None:
        return None
    return (
        f"expected null, 'auto' or HOST:PORT (e.g. 10.0.0.5:6379, ray://head:10001), "
        f"got {address!r}"
    )


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port``, or None.

    >>> _host_port("ray://[::1]:10001"), _host_port("10.0.0.5:6379"), _host_port("auto")
    (('::1', 10001), ('10.0.0.5', 6379), None)
    """
    rest = address.split("://", 1)[1] if "://" in address else address
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def _reachable(address: str, timeout_s: float, temp_dir: Any) -> str:
    """``address`` once a TCP connection to it (for ``auto``: to the cluster Ray would find)
    succeeds within ``timeout_s``; else one line naming ``ray.address``: Ray itself would retry
    for many minutes."""
    target = address
    if address == "auto":
        target = _auto_address(temp_dir)
    where = _host_port(target)
    if where is None:
        raise ConnectionError(f"{_RAY_SECTION}: {ray_address_problem(target)}")
    shown = address if target == address else f"auto (the cluster at {target})"
    try:
        with socket.create_connection(where, timeout=timeout_s):
            pass
    except TimeoutError:
        raise ConnectionError(
            f"{_RAY_SECTION}: {shown}: no answer within {timeout_s:g} s (ray.connect_timeout_s); "
            "is the Ray head running there and reachable? (null: a Ray instance of this run)"
        ) from None
    except OSError as error:
        raise ConnectionError(
            f"{_RAY_SECTION}: {shown}: cannot connect ({error.strerror or error}); start the "
            f"cluster (`ray start --head --port {where[1]}` on {where[0]}) or set ray.address "
            "to null (a Ray instance of this run)"
        ) from None
    return address


def _auto_address(temp_dir: Any) -> str:
    """The ``host:port`` ``ray.address: auto`` means here (``RAY_ADDRESS``, or the cluster
    ``ray start`` last started on this machine), or one line saying there is none."""
    from ray._private.services import get_ray_address_from_environment

    try:
        found = get_ray_address_from_environment("auto", str(temp_dir) if temp_dir else None)
    except ConnectionError:
        found = None
    if not found or found == "auto":
        raise ConnectionError(
            f"{_RAY_SECTION}: auto, but no Ray cluster runs on this machine (none started with "
            "`ray start`, RAY_ADDRESS unset): start one (`ray start --head`), give its "
            "HOST:PORT, or set ray.address to null (a Ray instance of this run)"
        )
    return str(found)


def _init_within(ray: Any, kwargs: Mapping[str, Any], timeout_s: float, address: str) -> None:
    """``ray.init(**kwargs)`` joining ``address``, refused with one line when it has not
    connected within ``timeout_s`` (something answers there, but not a Ray head)."""
    done = threading.Event()
    failure: list[BaseException] = []

    def connect() -> None:
        try:
            ray.init(**kwargs)
        except BaseException as error:  # handed to the caller
            failure.append(error)
        finally:
            done.set()

    threading.Thread(target=connect, name="tunesmith-ray-init", daemon=True).start()
    if not done.wait(timeout_s):
        raise ConnectionError(
            f"{_RAY_SECTION}: {address}: Ray did not connect within {timeout_s:g} s "
            "(ray.connect_timeout_s): something answers there, but not a Ray head"
        )
    if failure:
        first = (str(failure[0]).strip().splitlines() or [type(failure[0]).__name__])[0]
        raise ConnectionError(f"{_RAY_SECTION}: {address}: {first}") from failure[0]


def actor_cause(error: BaseException) -> str:
    """One line of a Ray actor error: the exception its constructor raised (the last line of
    Ray's traceback), or the first and last lines of a system failure; no colour codes.

    >>> actor_cause(RuntimeError("ray::W.__init__()\\n  File ...\\nImportError: no vllm"))
    'ray::W.__init__() ImportError: no vllm'
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if getattr(error, "actor_init_failed", False) or len(lines) == 1:
        return lines[-1]
    return f"{lines[0]} {lines[-1]}"


def lead_versions(mode: str, max_staleness: int, updates_per_batch: int) -> int:
    """How many policy versions a batch's rollouts may lag the first update that trains on
    them (see the module docs).

    >>> lead_versions("sync", 3, 1), lead_versions("overlap", 3, 2), lead_versions("off_policy", 3, 1)
    (0, 2, 3)
    """
    if mode not in MODES:
        raise ValueError(f"async_mode must be one of {list(MODES)}, got {mode!r}")
    return {"sync": 0, "overlap": updates_per_batch, "off_policy": max_staleness}[mode]


def _flat(group: Group) -> bool:
    """Whether a scored group's rewards are all equal (no signal: zero advantages)."""
    return bool((group.rewards == group.rewards[0]).all())


def _worker_env() -> dict[str, str]:
    """What a worker needs of this process's environment: the allow-list decisions (so the
    workers build exactly what the trainer's config check allowed), a safe import path
    (``PYTHONSAFEPATH``: no script or working folder put first on ``sys.path``) and this
    process's own ``PYTHONPATH`` (how a user adds a module folder deliberately), less its
    empty entries, which would mean the working folder.

    >>> _worker_env()["PYTHONSAFEPATH"]
    '1'
    """
    env = {"PYTHONSAFEPATH": "1", "PYTHONPATH": _python_path(os.environ.get("PYTHONPATH", ""))}
    for name in (ALLOW_ANY_COMPONENT_ENV, ALLOW_RUNTIME_ENV_ENV):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


def _python_path(value: str) -> str:
    """A ``PYTHONPATH`` with its empty entries (the working folder) dropped and its relative
    ones made absolute (a worker may run in another folder).

    >>> _python_path(":/opt/mine::")
    '/opt/mine'
    """
    parts = [os.path.abspath(p) for p in value.split(os.pathsep) if p.strip()]
    return os.pathsep.join(parts)


def runtime_env_allowed() -> bool:
    """Whether a config may give Ray workers a runtime environment: ``--allow-runtime-env``
    (``TUNESMITH_ALLOW_RUNTIME_ENV=1``) or ``--allow-any-component``."""
    flag = os.environ.get(ALLOW_RUNTIME_ENV_ENV, "").strip().lower()
    return flag in {"1", "true", "yes", "on"} or any_component_allowed()


_RUNS = {  # what each runtime_env key of Ray does in a worker (each one runs code)
    "py_executable": "runs its command as the workers' Python interpreter",
    "env_vars": "sets the workers' environment (PYTHONWARNINGS, PYTHONSTARTUP, LD_PRELOAD, "
    "BROWSER... run code)",
    "pip": "installs packages (their build and import code runs)",
    "uv": "installs packages (their build and import code runs)",
    "conda": "installs an environment (its packages' code runs)",
    "working_dir": "puts its files first on the workers' import path",
    "py_modules": "puts its modules on the workers' import path",
    "container": "runs the workers in that container image",
    "image_uri": "runs the workers in that container image",
    "worker_process_setup_hook": "calls that function in every worker",
}


def runtime_env_problem(value: Any) -> str | None:
    """Why a section's ``runtime_env`` (resolved) is refused, as ``runtime_env.KEY: ...``, or
    None: null and ``{}`` pass; anything else is code execution, allowed by
    :func:`runtime_env_allowed` only.

    >>> print(runtime_env_problem({"env_vars": {"LD_PRELOAD": "/tmp/x.so"}}))  # doctest: +ELLIPSIS
    runtime_env.env_vars.LD_PRELOAD: a Ray runtime environment runs code: env_vars sets ...
    """
    try:
        value = _plain(value)
    except Exception as error:  # an interpolation that does not resolve
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"runtime_env: cannot be resolved: {first}"
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        return f"runtime_env: expected a mapping of Ray runtime_env keys, or null, got {value!r}"
    if runtime_env_allowed():
        return None
    key = str(next(iter(value)))
    where = f"runtime_env.{key}"
    inner = value[key]
    if key == "env_vars" and isinstance(inner, dict) and inner:
        where += f".{next(iter(inner))}"
    what = _RUNS.get(key, "is part of a Ray runtime environment")
    return (
        f"{where}: a Ray runtime environment runs code: {key} {what}; pass "
        f"--allow-runtime-env (or --allow-any-component; {ALLOW_RUNTIME_ENV_ENV}=1) "
        "to use it"
    )


def section_runtime_env_problem(section: Mapping[str, Any]) -> str | None:
    """:func:`runtime_env_problem` of ``section``'s ``runtime_env``, read here so that a value
    that does not resolve is named by its key too (a ``DictConfig``'s ``get`` would raise a
    bare resolver error).

    >>> cfg = OmegaConf.create({"runtime_env": "${oc.env:UNSET}"})
    >>> print(section_runtime_env_problem(cfg))  # doctest: +ELLIPSIS
    runtime_env: interpolation '${oc.env:UNSET}' cannot be resolved: ...
    """
    if "runtime_env" not in section.keys():  # noqa: SIM118 (a DictConfig or a dict)
        return None
    try:
        value = read_child(section, "runtime_env", "runtime_env")
    except ConfigError as error:  # missing (???), or an interpolation that does not resolve
        return str(error)
    return runtime_env_problem(value)


def _plain(value: Any) -> Any:
    """A config value as plain data, interpolations resolved."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def check_runtime_env(resources: Mapping[str, Any], section: str) -> None:
    """Raise one line (as the config check does) when ``resources`` (``config[section]``)
    holds a runtime environment that is not allowed.

    >>> check_runtime_env({"runtime_env": None}, "rollout")
    """
    problem = section_runtime_env_problem(resources)
    if problem is not None:
        raise ValueError(f"{section}.{problem}")


def runtime_env(resources: Mapping[str, Any], section: str = "rollout") -> dict[str, Any]:
    """A role's Ray runtime environment: :func:`_worker_env`, with the ``runtime_env`` of
    ``config[section]`` when it is allowed (e.g. vLLM's own ``pip`` packages when its torch
    differs from the trainer's, with ``--allow-runtime-env``)."""
    check_runtime_env(resources, section)
    env = dict(_plain(resources.get("runtime_env")) or {})
    env["env_vars"] = {**_worker_env(), **dict(env.get("env_vars") or {})}
    return env


def dynamic_selection(
    flat: Sequence[bool], per_round: int, shares: int = 1
) -> tuple[list[int], bool]:
    """Dynamic sampling's choice among the groups drawn for one batch (the synchronous rule,
    :class:`tunesmith.rl.source.LocalGroups`): ``flat[i]`` says whether group ``i``
    has all-equal rewards, the groups being rounds of ``per_round``, one after the other. Each
    of ``shares`` (data-parallel ranks) takes its contiguous slice of every round: the groups
    with a signal in draw order, then flat ones to fill up, cut at ``per_round // shares``.
    Returns the positions chosen (share after share) and whether a share is short of groups
    with a signal (another refill could help).

    >>> dynamic_selection([True, False, False, True, False, True], per_round=3)
    ([1, 2, 4], False)
    >>> dynamic_selection([True, False, True, True], per_round=2)
    ([1, 0], True)
    >>> dynamic_selection([True, False, False, True], per_round=2, shares=2)  # [0, 2] | [1, 3]
    ([2, 1], False)
    """
    if per_round < 1 or per_round % shares or len(flat) % per_round:
        raise ValueError(
            f"dynamic_selection: {len(flat)} groups are not rounds of {per_round} "
            f"split into {shares} shares"
        )
    per_share, chosen, short = per_round // shares, [], False
    for share in range(shares):
        mine = [
            start + share * per_share + i
            for start in range(0, len(flat), per_round)
            for i in range(per_share)
        ]
        kept = [i for i in mine if not flat[i]]
        short = short or len(kept) < per_share
        chosen += (kept + [i for i in mine if flat[i]])[:per_share]
    return chosen, short


@dataclass
class _Chunk:
    """Prompts of batch ``batch`` (drawn in collection ``round``) on their way through a
    rollout and a reward worker."""

    batch: int
    round: int
    prompts: list[Prompt]
    worker: int = -1
    scorer: int = -1
    sent_s: float = 0.0


def _chunk_from_state(item: Sequence[Any], prompts: Mapping[int, Prompt]) -> _Chunk:
    """A chunk still to send, from ``[batch, round, prompt indices]`` (``[batch, indices]``
    before refills: its round is its batch)."""
    batch, indices = int(item[0]), item[-1]
    return _Chunk(
        batch, int(item[1]) if len(item) == 3 else batch, [prompts[int(i)] for i in indices]
    )


@dataclass(frozen=True)
class WorkerResources:
    """One role's Ray workers (the ``rollout`` or ``reward_workers`` section): how many, what
    each reserves, and the ``runtime_env`` the config gives them (checked when they start).

    >>> WorkerResources.of({"workers": 2, "num_gpus": 1})
    WorkerResources(workers=2, num_cpus=1.0, num_gpus=1.0, runtime_env=None)
    """

    workers: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    runtime_env: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> WorkerResources:
        """The resources a config section asks for (absent keys: the defaults)."""
        given = {k: v for k, v in dict(section or {}).items() if v is not None}
        default = cls()
        return cls(
            workers=int(given.get("workers", default.workers)),
            num_cpus=float(given.get("num_cpus", default.num_cpus)),
            num_gpus=float(given.get("num_gpus", default.num_gpus)),
            runtime_env=_plain(given.get("runtime_env")) or None,
        )


@dataclass(frozen=True)
class PipelineSettings:
    """What the pipeline reads of the run, once (:meth:`from_config`): its two roles'
    resources, Ray's options (:data:`RAY_KEYS`), and how weights reach the rollout workers.

    >>> settings = PipelineSettings.from_config({"rollout": {"weight_sync": "collective"}})
    >>> settings.weight_sync, settings.collective_backend, settings.reward.workers
    ('collective', 'gloo', 1)
    """

    rollout: WorkerResources = WorkerResources()
    reward: WorkerResources = WorkerResources()
    ray: Mapping[str, Any] = field(default_factory=dict)
    weight_sync: str = "object_store"
    weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S
    collective_backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.weight_sync not in SYNC_MODES:
            raise ValueError(
                f"rollout.weight_sync must be one of {list(SYNC_MODES)}, got {self.weight_sync!r}"
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> PipelineSettings:
        """The settings of a run's config (a plain, resolved mapping): its ``rollout``,
        ``reward_workers`` and ``ray`` sections, and ``device`` for the collective's backend."""
        rollout = dict(config.get("rollout") or {})
        return cls(
            rollout=WorkerResources.of(rollout),
            reward=WorkerResources.of(config.get("reward_workers")),
            ray={k: v for k, v in dict(config.get("ray") or {}).items() if k in RAY_KEYS},
            weight_sync=str(rollout.get("weight_sync") or "object_store"),
            weight_sync_timeout_s=float(rollout.get("weight_sync_timeout_s") or DEFAULT_TIMEOUT_S),
            collective_backend=collective_backend(config),
        )


class RolloutPipeline:
    """Rollout and reward workers feeding a replay buffer (see the module docs).

    ``settings`` are the pipeline's own (worker counts and resources, Ray, weight sync);
    ``workers`` is what every rollout and reward worker is sent (its settings and the config
    sections it builds the policy, tokenizer, rewards and reference from); ``prompts`` the whole
    prompt stream (every data-parallel rank's share); ``dynamic_sampling`` and ``max_refills``
    turn on refills (see the module docs) for ``shares`` data-parallel ranks.
    """

    def __init__(
        self,
        settings: PipelineSettings,
        prompts: PromptStream,
        *,
        workers: WorkerSettings,
        mode: str = "sync",
        max_staleness: int = 0,
        updates_per_batch: int = 1,
        total_batches: int,
        capacity: int | None = None,
        max_restarts: int = 3,
        initial_version: int = 0,
        shares: int = 1,
        dynamic_sampling: bool = False,
        max_refills: int = 4,
    ) -> None:
        self.settings, self.workers = settings, workers
        self.stream, self.mode = prompts, mode
        self.updates_per_batch = int(updates_per_batch)
        self.lead = lead_versions(mode, int(max_staleness), self.updates_per_batch)
        self.total_batches = int(total_batches)
        self.group_size = workers.group_size
        per_step = prompts.prompts_per_step
        depth = max(1, math.ceil(self.lead / self.updates_per_batch))  # batches sampled ahead
        self.capacity = int(capacity) if capacity else per_step * (depth + 1)
        if self.capacity < per_step:
            raise ValueError(
                f"buffer_size={self.capacity} groups cannot hold one step's "
                f"{per_step} groups (prompts_per_step): set buffer_size >= {per_step}"
            )
        self.buffer = ReplayBuffer(max_staleness=self.lead, capacity=self.capacity)
        self.n_rollout, self.n_reward = settings.rollout.workers, settings.reward.workers
        self.depth, self.max_restarts = depth, int(max_restarts)
        self.published = int(initial_version)  # the policy version the workers were sent last
        self.next_draw = 0  # the next batch to draw prompts for
        self.round = 0  # the next collection round (a batch's prompts, or a refill of them)
        self.batch_ids: dict[int, list[tuple[int, int]]] = {}  # every group drawn, in order
        self.dynamic, self.max_refills = bool(dynamic_sampling), int(max_refills)
        self.shares = int(shares)
        if self.shares < 1 or per_step % self.shares:
            raise ValueError(
                f"prompts_per_step={per_step} cannot be shared by {self.shares} data-parallel ranks"
            )
        self.open: int | None = None  # the batch whose groups dynamic sampling may still replace
        self.refills = 0  # refill rounds drawn for the open batch
        self.outcome: dict[int, dict[str, float]] = {}  # fixed batches: groups drawn, flat ...
        self.todo: deque[_Chunk] = deque()
        self.inflight: dict[Any, _Chunk] = {}
        self.load = [0] * self.n_rollout
        self.restarts = self.requeued = 0
        self.restarts_of: dict[tuple[str, int], int] = defaultdict(int)
        self.pids: dict[str, list[int]] = {"rollout": [], "reward": []}
        self.batch_stats: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.failures: dict[str, int] = {}
        self.busy = {"rollout_s": 0.0, "reward_s": 0.0}
        self.worker_tokens = [[0.0, 0.0] for _ in range(self.n_rollout)]  # tokens, seconds
        self.weight_sync = settings.weight_sync
        self._sync: ObjectStoreSync | CollectiveSync | None = None  # made at the first publish
        self._next_reward = 0
        self._ray: Any = None
        self._owns_ray = False
        self.rollout_workers: list[Any] = []
        self.reward_workers: list[Any] = []

    # -- workers

    def start(self) -> None:
        """Start Ray (in this process, or join ``ray.address``) and the workers."""
        ray = self._ray = require_ray()
        if not ray.is_initialized():
            init_ray(ray, self.settings.ray)
            self._owns_ray = True  # a joined cluster: disconnect at the end
        rollout, reward = self.settings.rollout, self.settings.reward
        self.rollout_workers = [
            self._actor(RolloutWorker, rollout, "rollout") for _ in range(self.n_rollout)
        ]
        self.reward_workers = [
            self._actor(RewardWorker, reward, "reward_workers") for _ in range(self.n_reward)
        ]
        built = [("rollout", w.pid.remote()) for w in self.rollout_workers]
        built += [("reward", w.pid.remote()) for w in self.reward_workers]
        self.pids = {"rollout": [], "reward": []}
        for role, ref in built:
            try:
                self.pids[role].append(ray.get(ref))
            except ray.exceptions.RayActorError as error:  # its constructor failed
                self.close()
                raise RuntimeError(
                    f"a {role} worker could not start: {actor_cause(error)}"
                ) from error

    def _actor(self, role: type, resources: WorkerResources, section: str) -> Any:
        actor = self._ray.remote(
            num_cpus=resources.num_cpus,
            num_gpus=resources.num_gpus,
            max_restarts=-1,
            max_task_retries=0,
            runtime_env=runtime_env({"runtime_env": resources.runtime_env}, section),
        )(role)
        # relative paths of the config mean what they mean here
        threads = max(1, int(resources.num_cpus))
        return actor.remote(self.workers, threads=threads, cwd=os.getcwd())

    def worker_pids(self) -> dict[str, list[int]]:
        """The process ids of the rollout and reward workers."""
        ray = self._ray
        return {"rollout": ray.get([w.pid.remote() for w in self.rollout_workers]),
                "reward": ray.get([w.pid.remote() for w in self.reward_workers])}  # fmt: skip

    def close(self) -> None:
        """Stop the workers (and Ray, when this pipeline started it)."""
        if self._ray is None:
            return
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        for worker in self.rollout_workers + self.reward_workers:
            self._ray.kill(worker)
        self.rollout_workers, self.reward_workers = [], []
        if self._owns_ray:
            self._ray.shutdown()
        self._ray = None

    @property
    def sync_on_device(self) -> bool:
        """Whether the published tensors stay on the trainer's GPU (``collective`` over NCCL)."""
        return self.weight_sync == "collective" and self.settings.collective_backend == "nccl"

    def publish(self, named: Mapping[str, torch.Tensor], version: int) -> None:
        """Send the policy of ``version`` (its trainable tensors by name) to every rollout
        worker, through Ray's object store or a broadcast (``rollout.weight_sync``,
        :mod:`tunesmith.rl.asynchronous.weight_sync`); each takes it after the chunks it was sent
        before."""
        self.published = int(version)
        self._weight_sync().publish(self.rollout_workers, named, self.published)

    def _weight_sync(self) -> ObjectStoreSync | CollectiveSync:
        if self._sync is None:
            if self.weight_sync == "collective":
                self._sync = CollectiveSync(
                    self._ray,
                    backend=self.settings.collective_backend,
                    timeout_s=self.settings.weight_sync_timeout_s,
                    host=self._ray.util.get_node_ip_address(),
                )
            else:
                self._sync = ObjectStoreSync(self._ray)
        return self._sync

    def _check_sync(self) -> None:
        """Restart handling for the rollout workers the weight sync saw die (its calls are
        not waited for); a sync that failed otherwise raises."""
        if self._sync is not None:
            for index, error in self._sync.poll():
                self._restarted("rollout", index, error)

    # -- batches

    def next_batch(self, batch: int, version: int) -> tuple[list[Group], dict[str, float]]:
        """The groups of ``batch`` for the update at policy ``version`` (waiting for them,
        sampling again the ones that came too stale), and the pipeline's metrics."""
        if batch >= self.total_batches:
            raise ValueError(f"batch {batch}: the run has {self.total_batches} batches")
        start = time.perf_counter()
        while True:
            self._check_sync()
            for group in self.buffer.drop_stale(version):  # sample again with a newer policy
                self._requeue(_Chunk(self._batch_of(group.id), group.round, [group.prompt]))
            self._settle()
            self._launch()
            ids = self.batch_ids.get(batch)
            if ids is not None and batch != self.open and self.buffer.has(ids):
                groups = self.buffer.take(ids, version)
                break
            if not self.inflight:
                raise RuntimeError(
                    f"rollout pipeline stalled before batch {batch}: nothing in flight, "
                    f"{len(self.todo)} chunk(s) waiting, workers at version {self.published}, "
                    f"trainer at {version}, {len(self.buffer)} group(s) buffered"
                )
            self._harvest()
        del self.batch_ids[batch]
        self._launch()  # sample ahead while the trainer trains on this batch
        stats = self.batch_stats.pop(batch, {})
        drawn = self.outcome.pop(batch, None) or {
            "drawn_groups": float(len(groups)),
            "flat_groups": float(sum(map(_flat, groups))),
            "refill_rounds": 0.0,
        }
        behind = [version - g.version for g in groups]
        metrics = {
            "wait_s": time.perf_counter() - start,
            "staleness_mean": sum(behind) / len(behind), "staleness_max": float(max(behind)),
            "buffer_groups": float(len(self.buffer)), "dropped_stale": float(self.buffer.dropped),
            "requeued_groups": float(self.requeued), "worker_restarts": float(self.restarts),
            "rollout_busy_s": self.busy["rollout_s"], "reward_busy_s": self.busy["reward_s"],
            "rollout_workers": float(self.n_rollout), "reward_workers": float(self.n_reward),
            **{k: float(v) for k, v in stats.items()}, **drawn,
            **{f"rollout{w}_tokens_per_s": tokens / max(seconds, 1e-9)
               for w, (tokens, seconds) in enumerate(self.worker_tokens)},
            **{f"staleness_{lag}_groups": float(behind.count(lag)) for lag in range(self.lead + 1)},
        }  # fmt: skip
        return groups, metrics

    def _draw(self) -> bool:
        """Draw the prompts of the next batch when its policy is out, there is room and no
        batch is open (dynamic sampling)."""
        k, per_step = self.next_draw, self.stream.prompts_per_step
        if k >= self.total_batches or not self._policy_out(k) or self.open is not None:
            return False
        if len(self.buffer) + self._inflight_groups() + per_step > self.capacity:
            return False
        self.batch_ids[k] = []
        self._draw_round(k)
        self.next_draw += 1
        if self.dynamic:
            self.open, self.refills = k, 0
        return True

    def _policy_out(self, batch: int) -> bool:
        """Whether the workers have a policy recent enough to sample ``batch``."""
        return self.published >= batch * self.updates_per_batch - self.lead

    def _draw_round(self, batch: int) -> None:
        """The next step of the stream for ``batch``, as a new collection round, in chunks."""
        prompts, round_ = self.stream.next_prompts(), self.round
        self.batch_ids[batch] += [(round_, p.index) for p in prompts]
        size = math.ceil(len(prompts) / self.n_rollout)
        for begin in range(0, len(prompts), size):
            self.todo.append(_Chunk(batch, round_, prompts[begin : begin + size]))
        self.round += 1

    def _settle(self) -> None:
        """Dynamic sampling: once every group of the open batch is scored, draw a refill for
        it while a share is short of groups with a signal and refills remain; else fix its
        groups (:func:`dynamic_selection`) and discard the others."""
        k = self.open
        if k is None or not self.buffer.has(self.batch_ids[k]):
            return
        ids = self.batch_ids[k]
        flat = [_flat(self.buffer.groups[i]) for i in ids]
        chosen, short = dynamic_selection(flat, self.stream.prompts_per_step, self.shares)
        if short and self.refills < self.max_refills and self._policy_out(k):
            self._draw_round(k)
            self.refills += 1
            return
        keep = [ids[i] for i in chosen]
        unused = set(ids) - set(keep)
        self.buffer.discard([i for i in ids if i in unused])
        self.batch_ids[k] = keep
        self.outcome[k] = {"drawn_groups": float(len(ids)), "flat_groups": float(sum(flat)),
                           "refill_rounds": float(self.refills)}  # fmt: skip
        self.open = None

    def _batch_of(self, group_id: tuple[int, int]) -> int:
        """The batch that drew the group ``group_id``."""
        for batch, ids in self.batch_ids.items():
            if group_id in ids:
                return batch
        raise KeyError(f"rollout pipeline: group {group_id} belongs to no batch waiting")

    def _launch(self) -> None:
        while self.todo or self._draw():
            chunk = self.todo[0]
            free = [w for w in range(self.n_rollout) if self.load[w] < self.depth]
            if not free:
                return
            worker = min(free, key=lambda w: (self.load[w], w))
            self.todo.popleft()
            chunk.worker, chunk.sent_s = worker, time.perf_counter()
            rolled = self.rollout_workers[worker].rollout.remote(chunk.prompts, chunk.round)
            chunk.scorer = self._next_reward % self.n_reward
            self._next_reward += 1
            self.inflight[self.reward_workers[chunk.scorer].score.remote(rolled)] = chunk
            self.load[worker] += 1

    def _harvest(self, timeout: float | None = None) -> None:
        """Wait for one chunk and put its groups in the buffer (or send it again when a
        worker died on it)."""
        ray = self._ray
        ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=timeout)
        for ref in ready:
            chunk = self.inflight.pop(ref)
            self.load[chunk.worker] -= 1
            try:
                groups, failures, stats = ray.get(ref)
            except ray.exceptions.RayActorError as error:  # a worker died: sample it again
                self._worker_died(chunk, error)
                continue
            except ray.exceptions.RayTaskError as error:  # a bug, not a death: one clear line
                cause = error.cause if error.cause is not None else error
                raise RuntimeError(
                    f"rollout pipeline: a worker failed on batch {chunk.batch} (prompts "
                    f"{[p.index for p in chunk.prompts]}): {type(cause).__name__}: {cause}"
                ) from error
            for group in groups:
                self.buffer.put(group)
            for key, count in failures.items():
                self.failures[key] = self.failures.get(key, 0) + count
            for key, value in stats.items():
                self.batch_stats[chunk.batch][key] += value
            per_worker = self.worker_tokens[chunk.worker]
            per_worker[0] += stats.get("generated_tokens", 0.0)
            per_worker[1] += stats.get("generate_s", 0.0)
            self.busy["rollout_s"] += stats.get("generate_s", 0.0)
            self.busy["reward_s"] += stats.get("reward_s", 0.0) + stats.get("reference_s", 0.0)

    def _worker_died(self, chunk: _Chunk, error: BaseException) -> None:
        """A worker of ``chunk`` died: restart handling for both of its workers, and sample
        the chunk again."""
        for role, index in (("rollout", chunk.worker), ("reward", chunk.scorer)):
            self._restarted(role, index, error)
        self._requeue(chunk)

    def _restarted(self, role: str, index: int, error: BaseException) -> None:
        """After a worker died: count each restarted worker once (by its new process id: one
        death fails every call queued on it) and send a restarted rollout worker the current
        weights (with ``collective`` sync: a new group of all the rollout workers) before any
        new work."""
        actor = (self.rollout_workers if role == "rollout" else self.reward_workers)[index]
        pid = self._pid_after_restart(actor, role, error)
        if pid == self.pids[role][index]:
            return
        self.pids[role][index] = pid
        self.restarts += 1
        self.restarts_of[(role, index)] += 1
        if self.restarts_of[(role, index)] > self.max_restarts:
            raise RuntimeError(
                f"rollout pipeline: {role} worker {index} died "
                f"{self.restarts_of[(role, index)]} times (max_worker_restarts="
                f"{self.max_restarts}); last: {actor_cause(error)}"
            ) from error
        if role == "rollout" and self._sync is not None:  # it starts from the config
            self._sync.resend(self.rollout_workers, index)

    def _pid_after_restart(self, actor: Any, role: str, error: BaseException) -> int:
        """The worker's process id once Ray has it running again."""
        ray = self._ray
        for _ in range(600):
            try:
                return int(ray.get(actor.pid.remote()))
            except ray.exceptions.RayActorError:  # still restarting
                time.sleep(0.1)
        raise RuntimeError(
            f"rollout pipeline: a {role} worker did not come back after dying: {actor_cause(error)}"
        ) from error

    def _requeue(self, chunk: _Chunk) -> None:
        self.requeued += len(chunk.prompts)
        self.todo = deque(sorted([*self.todo, chunk], key=lambda c: c.batch))

    def _inflight_groups(self) -> int:
        return sum(len(c.prompts) for c in [*self.inflight.values(), *self.todo])

    # -- checkpoints

    def drain(self) -> None:
        """Wait until no chunk is in flight (their groups are then in the buffer)."""
        while self.inflight:
            self._harvest()

    def state_dict(self) -> dict[str, Any]:
        """Plain data after a :meth:`drain`: the prompt stream, the next round, the batches
        drawn and not yet trained on (the open one with its refills), the buffer, and the
        chunks still to send."""
        self.drain()
        return {
            "stream": self.stream.state_dict(), "next_draw": self.next_draw, "round": self.round,
            "batch_ids": {str(k): [list(i) for i in ids] for k, ids in self.batch_ids.items()},
            "open": self.open, "refills": self.refills,
            "outcome": {str(k): dict(v) for k, v in self.outcome.items()},
            "todo": [[c.batch, c.round, [p.index for p in c.prompts]] for c in self.todo],
            "buffer": self.buffer.state_dict(), "restarts": self.restarts,
            "requeued": self.requeued,
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        prompts = {p.index: p for p in self.stream.dataset}
        self.stream.load_state_dict(state["stream"])
        self.next_draw = int(state["next_draw"])
        self.round = int(state.get("round", self.next_draw))  # before refills: one per batch
        self.batch_ids = {
            int(k): [(int(r), int(i)) for r, i in ids] for k, ids in state["batch_ids"].items()
        }
        self.open = None if state.get("open") is None else int(state["open"])
        self.refills = int(state.get("refills", 0))
        self.outcome = {
            int(k): {n: float(v) for n, v in d.items()} for k, d in state.get("outcome", {}).items()
        }
        self.todo = deque(_chunk_from_state(item, prompts) for item in state["todo"])
        self.buffer.load_state_dict(state["buffer"], prompts)
        self.restarts, self.requeued = int(state["restarts"]), int(state["requeued"])
