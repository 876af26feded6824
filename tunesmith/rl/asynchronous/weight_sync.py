"""Sending the policy's trainable weights from trainer rank 0 to the rollout workers after each
update (``rollout.weight_sync``):

* ``object_store`` (:class:`ObjectStoreSync`): one ``ray.put`` of the named tensors, one
  ``load_weights`` call per worker;
* ``collective`` (:class:`CollectiveSync`): a broadcast from trainer rank 0 to every worker over
  a process group of their own (gloo on CPU, NCCL when the trainer and the workers have GPUs),
  formed beside the trainer's default group, which it never touches.

The collective group is stateless: trainer rank 0 hosts a :class:`torch.distributed.TCPStore`
on a free port, and each *generation* of the group (trainer rank 0 = rank 0, worker ``i`` = rank
``i + 1``) lives under its own key prefix, so a new one forms after a worker restarts. The
tensors travel in a fixed name order, packed per dtype into flat buffers (:func:`pack`,
:func:`unpack`), one broadcast per buffer; their names, shapes and dtypes (the *layout*) go once
through Ray when a generation forms.

Both sides meet through the store before each step, so no rank waits inside a collective for a
peer that is busy or dead: a worker that reaches ``join``/``receive`` in its actor queue sets a
*ready* key and waits for the trainer's *go*; the trainer's side (a thread of its own per
generation, :class:`WeightSender`) waits for every worker's key, says go, forms the group or
broadcasts, and only then the next send. The trainer's main thread packs the tensors and
returns: it never waits for a worker that is generating. A generation that is replaced (a
worker restarted) says *abort* to everything still pending, so no worker waits for it.

Example (two ranks in one process; a rollout worker is another process in practice)::

    >>> import threading
    >>> named = {"w": torch.ones(2, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}
    >>> sender = WeightSender(timeout_s=30)
    >>> generation = sender.form(size=2)
    >>> seq = sender.send(pack(named, layout_of(named)))
    >>> receiver, got = WeightReceiver(), {}
    >>> def worker():
    ...     receiver.join(*sender.address, generation, rank=1, size=2, backend="gloo",
    ...                   timeout_s=30, layout=layout_of(named))
    ...     got.update(receiver.receive(generation, seq))
    >>> thread = threading.Thread(target=worker); thread.start(); thread.join(); sender.wait()
    >>> torch.equal(got["w"], named["w"]), got["b"].dtype
    (True, torch.bfloat16)
    >>> sender.close()
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "SYNC_MODES",
    "CollectiveSync",
    "ObjectStoreSync",
    "TensorSpec",
    "WeightReceiver",
    "WeightSender",
    "buffer_specs",
    "collective_backend",
    "layout_of",
    "nbytes",
    "pack",
    "unpack",
]

SYNC_MODES = ("object_store", "collective")
DEFAULT_TIMEOUT_S = 1800.0
_PREFIX = "weight_sync"


# ----------------------------------------------------------------------------- pack / unpack


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the layout: its Hugging Face name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def layout_of(named: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The layout of ``named``, in its order (the trainer's ``named_parameters`` order).

    >>> layout_of({"a.weight": torch.zeros(2, 3)})
    [TensorSpec(name='a.weight', shape=(2, 3), dtype=torch.float32)]
    """
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in named.items()]


def buffer_specs(layout: Sequence[TensorSpec]) -> list[tuple[torch.dtype, int]]:
    """The flat buffers of ``layout``: one per dtype, in the order the dtypes first appear,
    with their number of elements.

    >>> buffer_specs([TensorSpec("a", (2, 3), torch.float32), TensorSpec("b", (4,), torch.int64),
    ...               TensorSpec("c", (5,), torch.float32)])
    [(torch.float32, 11), (torch.int64, 4)]
    """
    sizes: dict[torch.dtype, int] = {}
    for spec in layout:
        sizes[spec.dtype] = sizes.get(spec.dtype, 0) + _numel(spec.shape)
    return list(sizes.items())


def pack(named: Mapping[str, torch.Tensor], layout: Sequence[TensorSpec]) -> list[torch.Tensor]:
    """The tensors of ``named`` copied in ``layout`` order into one flat buffer per dtype (see
    :func:`buffer_specs`), on their device; any strides. A missing tensor, or one whose shape
    or dtype differs from the layout, raises naming it.

    >>> named = {"a": torch.arange(6.0).reshape(2, 3).t(), "b": torch.tensor([7, 8])}
    >>> [b.tolist() for b in pack(named, layout_of(named))]
    [[0.0, 3.0, 1.0, 4.0, 2.0, 5.0], [7, 8]]
    """
    parts: dict[torch.dtype, list[torch.Tensor]] = {}
    for spec in layout:
        if spec.name not in named:
            raise KeyError(f"weight sync: {spec.name!r} is in the layout but was not given")
        tensor = named[spec.name].detach()
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"weight sync: {spec.name!r} is {tuple(tensor.shape)} {tensor.dtype}, the layout "
                f"says {spec.shape} {spec.dtype}"
            )
        parts.setdefault(spec.dtype, []).append(tensor.reshape(-1))
    return [torch.cat(group) for group in parts.values()]


def unpack(
    buffers: Sequence[torch.Tensor], layout: Sequence[TensorSpec]
) -> dict[str, torch.Tensor]:
    """The named tensors of ``layout`` as views of the flat ``buffers`` (:func:`pack`'s).

    >>> named = {"a": torch.ones(2, 2), "b": torch.tensor([1, 2]), "c": torch.zeros(3)}
    >>> out = unpack(pack(named, layout_of(named)), layout_of(named))
    >>> list(out), all(torch.equal(out[k], v) for k, v in named.items())
    (['a', 'b', 'c'], True)
    """
    index = {dtype: i for i, (dtype, _) in enumerate(buffer_specs(layout))}
    if len(buffers) != len(index):
        raise ValueError(f"weight sync: {len(buffers)} buffers for a layout of {len(index)} dtypes")
    offsets = [0] * len(buffers)
    out = {}
    for spec in layout:
        i, n = index[spec.dtype], _numel(spec.shape)
        out[spec.name] = buffers[i][offsets[i] : offsets[i] + n].view(spec.shape)
        offsets[i] += n
    return out


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for size in shape:
        n *= int(size)
    return n


def nbytes(tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> int:
    """The bytes of ``tensors`` (a mapping's values).

    >>> nbytes({"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.bfloat16)})
    20
    """
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    return sum(t.numel() * t.element_size() for t in values)


# ----------------------------------------------------------------------------- the group


def collective_backend(config: Mapping[str, Any]) -> str:
    """``nccl`` when the trainer (``device`` not ``cpu``) and the rollout workers
    (``rollout.num_gpus`` > 0) have GPUs and NCCL is built in, else ``gloo`` (CPU tensors).

    >>> collective_backend({"device": "cpu", "rollout": {"num_gpus": 1}})
    'gloo'
    """
    rollout = config.get("rollout") or {}
    gpus = float(rollout.get("num_gpus", 0) or 0) > 0
    cuda = torch.cuda.is_available() and config.get("device") != "cpu"
    return "nccl" if gpus and cuda and dist.is_nccl_available() else "gloo"


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


def _make_group(backend: str, store: Any, rank: int, size: int, timeout_s: float) -> Any:
    """A process group of ``size`` ranks on ``store`` that is not registered with
    ``torch.distributed`` (the default group, if any, is left alone)."""
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = _timedelta(timeout_s)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, _timedelta(timeout_s))
    raise ValueError(f"weight sync: backend must be 'gloo' or 'nccl', got {backend!r}")


def _broadcast(group: Any, buffers: Sequence[torch.Tensor], timeout_s: float) -> list[Any]:
    """One asynchronous broadcast from rank 0 per buffer (issued in order on every rank)."""
    works = []
    for buffer in buffers:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        options.timeout = _timedelta(timeout_s)
        works.append(group.broadcast([buffer], options))
    return works


def _keys(generation: int) -> dict[str, str]:
    g = f"{_PREFIX}/{generation}"
    return {"ready": f"{g}/ready", "go": f"{g}/go", "at": f"{g}/at", "group": f"{g}/group/"}


class _Abandoned(Exception):
    """A newer generation replaced this one."""


@dataclass
class _Job:
    kind: str  # "form" | "send"
    seq: int = 0
    buffers: list[torch.Tensor] | None = None
    done: threading.Event | None = None


class _Lane:
    """One generation of the group on trainer rank 0: a thread that forms it, then runs its
    sends in order (each waited before the next). It talks to the store through a client of
    its own: a generation stuck on a dead peer (inside the group's constructor) holds only
    its own connection."""

    def __init__(self, sender: WeightSender, generation: int, size: int) -> None:
        self.sender, self.generation, self.size = sender, generation, size
        self.keys = _keys(generation)
        host, port = sender.address
        self.store = dist.TCPStore(
            host,
            port,
            is_master=False,
            wait_for_workers=False,
            timeout=_timedelta(sender.timeout_s),
        )
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.abandoned = threading.Event()
        self.error: BaseException | None = None
        self.group: Any = None
        self.last: threading.Event | None = None
        self.thread = threading.Thread(
            target=self._run, name=f"weight-sync-{generation}", daemon=True
        )
        self.thread.start()

    def submit(self, job: _Job) -> None:
        job.done = self.last = threading.Event()
        self.jobs.put(job)

    def abandon(self) -> None:
        self.abandoned.set()
        if self.group is not None and self.sender.backend == "nccl":
            self.group.abort()  # a send stuck on a dead peer ends now, not at NCCL's watchdog
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                if self.error is not None or self.abandoned.is_set():
                    raise _Abandoned
                self._form() if job.kind == "form" else self._send(job.seq, job.buffers or [])
            except _Abandoned:
                self._say(job, "abort")
            except Exception as error:  # kept for the pipeline: WeightSender.error()
                self.error = error
                self._say(job, "abort")
            finally:
                job.buffers = None
                assert job.done is not None
                job.done.set()
        self.group = None

    def _say(self, job: _Job, word: str) -> None:
        key = self.keys["go"] if job.kind == "form" else f"{self.keys['go']}/{job.seq}"
        with contextlib.suppress(Exception):  # the store is closing: no worker is left to tell
            self.store.set(key, word)

    def _wait_for(self, prefix: str, what: str) -> None:
        """Until every worker rank has set ``prefix/<rank>`` (polling the store, so that a
        newer generation or the timeout ends the wait)."""
        keys = [f"{prefix}/{rank}" for rank in range(1, self.size)]
        store, timeout = self.store, self.sender.timeout_s
        deadline, pause = time.monotonic() + timeout, 0.001
        while not store.check(keys):
            if self.abandoned.is_set():
                raise _Abandoned
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(range(1, self.size), keys) if not store.check([k])]
                host, port = self.sender.address
                raise TimeoutError(
                    f"weight sync: rollout worker rank(s) {missing} of generation "
                    f"{self.generation} did not {what} within {timeout:g} s "
                    f"(rollout.weight_sync_timeout_s) at the trainer's store {host}:{port}"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.02)

    def _form(self) -> None:
        self._wait_for(self.keys["ready"], "join the group")
        self.store.set(self.keys["go"], "form")
        prefixed = dist.PrefixStore(self.keys["group"], self.store)
        self.group = _make_group(self.sender.backend, prefixed, 0, self.size, self.sender.timeout_s)

    def _send(self, seq: int, buffers: list[torch.Tensor]) -> None:
        self._wait_for(f"{self.keys['at']}/{seq}", f"reach receive {seq}")
        self.store.set(f"{self.keys['go']}/{seq}", "send")
        if buffers and buffers[0].is_cuda:
            torch.cuda.set_device(buffers[0].device)
        for work in _broadcast(self.group, buffers, self.sender.timeout_s):
            if self.sender.backend == "nccl":  # wait() would only order the CUDA streams
                while not work.is_completed():
                    if self.abandoned.is_set():
                        raise _Abandoned
                    time.sleep(0.001)
            else:
                work.wait()


class WeightSender:
    """Trainer rank 0's side of the collective (see the module docs): hosts the store on a
    free port of ``host``, forms generations of the group and broadcasts packed buffers,
    each generation in a thread of its own (the caller never waits for a worker)."""

    def __init__(
        self,
        *,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: str = "127.0.0.1",
    ) -> None:
        if float(timeout_s) <= 0:
            raise ValueError(f"rollout.weight_sync_timeout_s must be > 0, got {timeout_s}")
        self.backend, self.timeout_s, self.host = backend, float(timeout_s), host
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=_timedelta(self.timeout_s)
        )
        self.generation = 0
        self.seq = 0
        self._lane: _Lane | None = None

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` of the store the workers connect to."""
        return self.host, int(self.store.port)

    def form(self, size: int) -> int:
        """Start a new generation of ``size`` ranks (abandoning the current one); returns its
        number. The workers join it with :meth:`WeightReceiver.join`."""
        if self._lane is not None:
            self._lane.abandon()
        self.generation += 1
        self._lane = _Lane(self, self.generation, int(size))
        self._lane.submit(_Job("form"))
        return self.generation

    def send(self, buffers: list[torch.Tensor]) -> int:
        """Queue a broadcast of ``buffers`` to the current generation; returns its sequence
        number (the workers' :meth:`WeightReceiver.receive` takes it)."""
        if self._lane is None:
            raise RuntimeError("weight sync: form() a group before send()")
        self.seq += 1
        self._lane.submit(_Job("send", self.seq, list(buffers)))
        return self.seq

    def error(self) -> BaseException | None:
        """What failed in the current generation (None: nothing yet)."""
        return None if self._lane is None else self._lane.error

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the current generation has done everything queued; raise what failed."""
        lane = self._lane
        if lane is None or lane.last is None:
            return
        if not lane.last.wait(timeout):
            raise TimeoutError(f"weight sync: generation {lane.generation} busy after {timeout} s")
        if lane.error is not None:
            raise RuntimeError(str(lane.error)) from lane.error

    def close(self) -> None:
        """Abandon the current generation (pending sends say abort) and stop its thread."""
        if self._lane is not None:
            self._lane.abandon()
            self._lane.thread.join(timeout=5.0)
            self._lane = None


class WeightReceiver:
    """A rollout worker's side of the collective (see the module docs): joins a generation
    of the group and receives into buffers it keeps, on ``device`` (CUDA for NCCL)."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.store: Any = None
        self.address: tuple[str, int] | None = None
        self.timeout_s = DEFAULT_TIMEOUT_S
        self.generation: int | None = None
        self.rank = 0
        self.group: Any = None
        self.layout: list[TensorSpec] = []
        self.buffers: list[torch.Tensor] = []

    def join(
        self,
        host: str,
        port: int,
        generation: int,
        *,
        rank: int,
        size: int,
        backend: str,
        timeout_s: float,
        layout: Sequence[TensorSpec],
    ) -> bool:
        """Join ``generation`` as ``rank`` of ``size`` (waits for the trainer's go); False
        when the trainer abandoned it. A store that cannot be reached raises naming its
        address and the timeout."""
        self.group, self.generation, self.timeout_s = None, None, float(timeout_s)
        self._connect(host, int(port))
        keys = _keys(generation)
        self.store.set(f"{keys['ready']}/{rank}", "1")
        if self._go(keys["go"], f"the group of generation {generation}") != "form":
            return False
        prefixed = dist.PrefixStore(keys["group"], self.store)
        self.group = _make_group(backend, prefixed, int(rank), int(size), self.timeout_s)
        self.generation, self.rank, self.layout = int(generation), int(rank), list(layout)
        device = self.device if backend == "nccl" else torch.device("cpu")
        self.buffers = [
            torch.empty(n, dtype=dtype, device=device) for dtype, n in buffer_specs(self.layout)
        ]
        return True

    def receive(self, generation: int, seq: int) -> dict[str, torch.Tensor] | None:
        """The named tensors of send ``seq`` (views of this receiver's buffers), or None when
        this process is not in ``generation`` (it restarted) or the trainer abandoned it."""
        if self.group is None or generation != self.generation:
            return None
        keys = _keys(generation)
        self.store.set(f"{keys['at']}/{seq}/{self.rank}", "1")
        if self._go(f"{keys['go']}/{seq}", f"send {seq} of generation {generation}") != "send":
            return None
        for work in _broadcast(self.group, self.buffers, self.timeout_s):
            work.wait()
        if self.buffers and self.buffers[0].is_cuda:
            torch.cuda.current_stream(self.buffers[0].device).synchronize()
        return unpack(self.buffers, self.layout)

    def _connect(self, host: str, port: int) -> None:
        if self.address == (host, port):
            return
        try:
            self.store = dist.TCPStore(
                host,
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=_timedelta(self.timeout_s),
            )
        except Exception as error:
            raise RuntimeError(
                f"weight sync: could not reach the trainer's store at {host}:{port} within "
                f"{self.timeout_s:g} s (rollout.weight_sync_timeout_s): "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            ) from error
        self.address = (host, port)

    def _go(self, key: str, what: str) -> str:
        try:
            self.store.wait([key], _timedelta(self.timeout_s))
            return self.store.get(key).decode()
        except Exception as error:
            host, port = self.address or ("?", 0)
            raise RuntimeError(
                f"weight sync: no word from the trainer's store at {host}:{port} on {what} "
                f"within {self.timeout_s:g} s (rollout.weight_sync_timeout_s): "
                f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            ) from error


# ----------------------------------------------------------------------------- the two paths


class ObjectStoreSync:
    """``rollout.weight_sync: object_store``: the named tensors go into Ray's object store
    once; every worker's ``load_weights`` call takes them after the chunks sent before it."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self._weights: Any = None
        self._version = 0
        self._calls: dict[Any, int] = {}

    def publish(
        self, workers: Sequence[Any], named: Mapping[str, torch.Tensor], version: int
    ) -> None:
        self._weights, self._version = self.ray.put(dict(named)), int(version)
        for index, worker in enumerate(workers):
            self._calls[worker.load_weights.remote(self._weights, self._version)] = index

    def resend(self, workers: Sequence[Any], index: int) -> None:
        """The current weights again to worker ``index`` (restarted from the config)."""
        if self._weights is not None:
            self._calls[workers[index].load_weights.remote(self._weights, self._version)] = index

    def poll(self) -> list[tuple[int, BaseException]]:
        """Workers that died taking weights (without waiting); a failed load raises."""
        return _settle(self.ray, self._calls, timeout=0.0)[0]

    def close(self) -> None:
        self._calls.clear()


class CollectiveSync:
    """``rollout.weight_sync: collective``: a broadcast over a group of trainer rank 0 and the
    rollout workers (see the module docs); ``host`` is rank 0's address as the workers see it.

    The current weights (the last packed buffers) are kept to send them again when the group
    re-forms after a worker restarts."""

    def __init__(self, ray: Any, *, backend: str, timeout_s: float, host: str) -> None:
        self.ray = ray
        self.sender = WeightSender(backend=backend, timeout_s=timeout_s, host=host)
        self.layout: list[TensorSpec] | None = None
        self._current: tuple[list[torch.Tensor], int] | None = None
        self._calls: dict[Any, int] = {}

    def publish(
        self, workers: Sequence[Any], named: Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Queue the broadcast of ``named`` (``version``) and each worker's receive call,
        forming the group first (the first time, or when the layout changed)."""
        layout = layout_of(named)
        buffers = pack(named, layout)
        if layout != self.layout:
            self._form(workers, layout)
        self._send(workers, buffers, int(version))

    def resend(self, workers: Sequence[Any], index: int) -> None:
        """Re-form the group with every current worker (``index`` restarted) and send the
        current weights again."""
        if self._current is not None and self.layout is not None:
            self._form(workers, self.layout)
            self._send(workers, *self._current)

    def poll(self) -> list[tuple[int, BaseException]]:
        """Workers that died or restarted (without waiting); raises what failed otherwise."""
        dead, missed = _settle(self.ray, self._calls, timeout=0.0)
        if dead or missed:
            return dead + missed
        error = self.sender.error()
        if error is None:
            return []
        # the trainer's side failed: let the workers' calls of this generation settle (a
        # worker that died shows as such) before calling it an error
        dead, missed = _settle(self.ray, self._calls, timeout=min(self.sender.timeout_s, 60.0))
        if dead:
            return dead
        raise RuntimeError(str(error)) from error

    def close(self) -> None:
        self._calls.clear()
        self.sender.close()

    def _form(self, workers: Sequence[Any], layout: list[TensorSpec]) -> None:
        self._calls.clear()  # calls of older generations no longer matter
        size = len(workers) + 1
        generation = self.sender.form(size)
        host, port = self.sender.address
        for index, worker in enumerate(workers):
            call = worker.join_weight_sync.remote(
                host,
                port,
                generation,
                rank=index + 1,
                size=size,
                backend=self.sender.backend,
                timeout_s=self.sender.timeout_s,
                layout=layout,
            )
            self._calls[call] = index
        self.layout = layout

    def _send(self, workers: Sequence[Any], buffers: list[torch.Tensor], version: int) -> None:
        seq = self.sender.send(buffers)
        for index, worker in enumerate(workers):
            self._calls[worker.receive_weights.remote(self.sender.generation, seq, version)] = index
        self._current = (buffers, version)


def _settle(
    ray: Any, calls: dict[Any, int], timeout: float
) -> tuple[list[tuple[int, BaseException]], list[tuple[int, BaseException]]]:
    """Collect the worker calls of ``calls`` that are done (all of them within ``timeout``
    seconds when > 0), removing them: the workers that died, the workers whose receive found
    them outside the generation (a restarted process); a call that raised raises."""
    if not calls:
        return [], []
    ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout)
    dead, missed, failed = [], [], None
    for ref in ready:
        index = calls.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayActorError as error:
            dead.append((index, error))
            continue
        except ray.exceptions.RayTaskError as error:
            failed = failed or (index, error)
            continue
        if result is False:  # receive_weights: this process is not in the generation
            missed.append((index, RuntimeError(f"rollout worker {index} missed the weights")))
    if failed is not None and not dead:
        index, error = failed
        cause = error.cause if getattr(error, "cause", None) is not None else error
        raise RuntimeError(
            f"weight sync: rollout worker {index} failed: {type(cause).__name__}: {cause}"
        ) from error
    return dead, missed
