"""One training run per output dir: a lock file with the owner's pid, host and start time.

``output_dir/.tunesmith.lock`` is created when a run starts (before it writes anything) and
removed when it ends, on success, on an error and after a SIGTERM save alike. While it is
held, the file carries ``{"pid": ..., "host": ..., "started": ...}`` and the owner holds an
exclusive ``flock`` on it, which the kernel drops when the process dies however it dies.
A second run in the same output dir:

* on this host, while the owner lives: refused, naming the owner's pid and start time;
* on this host, after the owner died (SIGKILL, OOM, power loss): the lock is stale; it is taken
  over with a message naming the dead pid (a fault sweep that kills and resumes just works);
* from another host: refused, naming that host and the lock file to delete if that run is
  dead (a pid cannot be checked on another machine, nor, on every network filesystem, a
  ``flock``).

The lock file is opened without following a symbolic link: a link planted as
``.tunesmith.lock`` is refused with one line naming it (its target is never written).

Under torchrun only rank 0 takes the lock (see :func:`hold_run_lock`); the other ranks learn
the outcome from it, so every rank refuses with the same line.

Example::

    >>> lock = RunLock.acquire(Path("runs/exp1"))
    >>> lock.path
    PosixPath('runs/exp1/.tunesmith.lock')
    >>> RunLock.acquire(Path("runs/exp1"))  # a second run while the first holds it
    Traceback (most recent call last):
    tunesmith.training.checkpoint.run_lock.OutputDirInUseError: runs/exp1 is in use by ...
    >>> lock.release()
    >>> lock.path.exists()
    False
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tunesmith.models.atomic import UnsafePathError, open_fd_no_follow
from tunesmith.training.checkpoint.directory import pid_alive
from tunesmith.training.parallel.distributed import DistributedContext

__all__ = ["LOCK_NAME", "OutputDirInUseError", "RunLock", "hold_run_lock"]

LOCK_NAME = ".tunesmith.lock"


class OutputDirInUseError(RuntimeError):
    """Another run holds the output dir's lock; the message names it and the lock file."""


def _owner_text(owner: dict[str, Any]) -> str:
    return (
        f"pid {owner.get('pid', '?')} on host {owner.get('host', '?')}, "
        f"started {owner.get('started', '?')}"
    )


def _read_owner(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        owner = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


@dataclass
class RunLock:
    """The held lock of one output dir: release it with :meth:`release` (idempotent).

    ``took_over`` describes the stale lock that was replaced (None when there was none).
    """

    path: Path
    fd: int | None
    took_over: str | None = None
    created_dir: bool = False

    @classmethod
    def acquire(cls, output_dir: Path) -> RunLock:
        """Take ``output_dir``'s lock or raise :class:`OutputDirInUseError` naming its holder.

        Example::

            >>> with RunLock.acquire(Path("runs/exp1")) as lock:
            ...     lock.path.exists()  # train here
            True
            >>> lock.path.exists()
            False
        """
        created = not output_dir.exists()
        output_dir.mkdir(parents=True, exist_ok=True)
        path = output_dir / LOCK_NAME
        try:
            return cls._acquire(path, created)
        except BaseException:
            if created:
                with contextlib.suppress(OSError):
                    output_dir.rmdir()
            raise

    @classmethod
    def _acquire(cls, path: Path, created: bool) -> RunLock:
        host = socket.gethostname()
        while True:
            fd = open_fd_no_follow(path, "r+", create=True)  # a planted link: refused
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                owner = _read_owner(fd)
                os.close(fd)
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if owner.get("host") == host and not pid_alive(owner.get("pid")):
                    raise OutputDirInUseError(  # a child that inherited the lock outlived it
                        f"{path.parent}: the lock {path} of the dead run ({_owner_text(owner)})"
                        " is still held by a process it started: end that process, then start "
                        "again"
                    ) from None
                raise OutputDirInUseError(
                    f"{path.parent} is in use by another run ({_owner_text(owner)}; lock file "
                    f"{path}): wait for it to finish, or choose another output_dir"
                ) from None
            try:
                if os.fstat(fd).st_ino != os.lstat(path).st_ino:  # released (unlinked) meanwhile
                    os.close(fd)
                    continue
            except FileNotFoundError:
                os.close(fd)
                continue
            owner = _read_owner(fd)
            took_over = None
            if owner:
                if owner.get("host") != host:
                    os.close(fd)
                    raise OutputDirInUseError(
                        f"{path.parent} is in use by a run on another host ({_owner_text(owner)}"
                        f"); if that run is dead, delete {path} and start again"
                    )
                if pid_alive(owner.get("pid")) and owner.get("pid") != os.getpid():
                    # alive but not holding the flock: a pid reused by an unrelated process
                    took_over = f"{_owner_text(owner)}; that pid now belongs to another process"
                else:
                    took_over = f"{_owner_text(owner)}, which is no longer running"
            me = {
                "pid": os.getpid(),
                "host": host,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)  # no fsync: only for messages
            return cls(path, fd, took_over, created)

    def release(self) -> None:
        """Remove the lock file and drop the lock (and the output dir if the lock created it
        and it is still empty)."""
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # while still locked: a waiter then sees a new inode
        os.close(self.fd)
        self.fd = None
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.path.parent.rmdir()

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_run_lock(output_dir: str | os.PathLike[str], ctx: DistributedContext) -> RunLock | None:
    """Rank 0 takes ``output_dir``'s lock; every rank raises its refusal (one line) or goes on.
    Returns the lock on rank 0 (release it when the run ends), None on the other ranks.

    Example::

        lock = hold_run_lock(cfg.output_dir, ctx)
        try: train(cfg, ctx)
        finally: lock and lock.release()
    """
    lock, refusal = None, None
    if ctx.is_rank_zero:
        try:
            lock = RunLock.acquire(Path(output_dir))
        except (OutputDirInUseError, UnsafePathError) as err:
            refusal = str(err)
        except OSError as err:  # say it on every rank, not only here
            refusal = f"{Path(output_dir) / LOCK_NAME}: cannot create the run lock: {err}"
        if lock is not None and lock.took_over:
            print(f"taking over the stale lock {lock.path} of {lock.took_over}")
    box = [refusal]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise OutputDirInUseError(box[0])
    return lock
