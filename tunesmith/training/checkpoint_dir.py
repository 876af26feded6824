"""Atomic, crash-safe checkpoint directories: ``root/step_000123``.

A checkpoint is written into a hidden temp directory ``root/.tmp-step_000123-<pid>``; every file
and directory in it is fsynced, a ``COMPLETE`` manifest (file sizes, optionally sha256) is written
and fsynced last, and only then is the temp directory renamed to ``root/step_000123`` and ``root``
fsynced. A crash or a full disk at any point therefore leaves either the old set of checkpoints or
the old set plus the new one, never a partially written ``step_*`` directory that
:meth:`CheckpointDirectory.latest` would pick up.

Housekeeping names, all hidden and all ignored by :meth:`~CheckpointDirectory.list`:

* ``.tmp-step_N-<pid>``: a write in progress (or one that crashed).
* ``.del-step_N-<pid>``: an old checkpoint being pruned (renamed first, so a half-deleted
  checkpoint is never visible as ``step_N``).
* ``.old-step_N-<pid>``: ``step_N`` moved aside while an ``overwrite=True`` write replaces it.

Stale housekeeping directories are cleaned when a :class:`CheckpointDirectory` is created: those
whose ``<pid>`` is no longer running on this host, or is this very process but not being written
by it (containers often give a restarted job the same pid). A directory of a live process is left
alone. An ``.old-step_N`` is moved back to ``step_N`` if ``step_N`` is missing (the crash happened
between the two renames of an overwrite). Because liveness is checked on this host only, exactly
one process (rank 0) should own a checkpoint root at a time; other ranks can write into the temp
directory it hands out (see :meth:`~CheckpointDirectory.begin`).

Example::

    >>> ckpts = CheckpointDirectory("runs/exp1/checkpoints", keep_last=2)
    >>> def save(tmp: Path) -> None:
    ...     (tmp / "model.safetensors").write_bytes(data)
    >>> ckpts.write(100, save)
    PosixPath('runs/exp1/checkpoints/step_000100')
    >>> ckpts.latest()
    PosixPath('runs/exp1/checkpoints/step_000100')
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "CheckpointDirectory", "CheckpointWriteError"]

#: Name of the manifest written last inside a checkpoint; its presence means "complete".
MARKER = "COMPLETE"

_STEP_RE = re.compile(r"^step_(\d+)$")
_HOUSEKEEPING_RE = re.compile(r"^\.(tmp|del|old)-step_(\d+)-(\d+)$")

# Housekeeping dirs this process is working on right now (so a second CheckpointDirectory on the
# same root in this process does not mistake them for stale ones).
_ACTIVE: set[Path] = set()
_ACTIVE_LOCK = threading.Lock()


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed; the temp dir was removed, older checkpoints are untouched.

    ``path`` is the checkpoint that was being written, ``step`` its step, ``errno`` the
    underlying ``OSError``'s errno (e.g. ``errno.ENOSPC``) or ``None``; ``__cause__`` holds the
    original exception.
    """

    def __init__(self, message: str, *, path: Path, step: int, errno: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.step = step
        self.errno = errno


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OSError:
        return False
    return True


def _fsync_path(path: Path, directory: bool) -> None:
    flags = os.O_RDONLY
    if directory:
        if not hasattr(os, "O_DIRECTORY"):  # Windows: directories cannot be fsynced
            return
        flags |= os.O_DIRECTORY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


class CheckpointDirectory:
    """A folder of ``step_NNNNNN`` checkpoints written atomically, optionally pruned.

    Args:
        root: the folder holding the checkpoints (created if missing).
        keep_last: keep at most this many complete checkpoints after each write (the one just
            written always survives); ``None`` keeps all.
        checksum: also record each file's sha256 in the manifest (costs a read of every byte).
        clean_stale: remove housekeeping dirs left by dead processes on construction.

    Example::

        >>> ckpts = CheckpointDirectory(tmp_path, keep_last=1)
        >>> _ = ckpts.write(1, lambda d: (d / "a.txt").write_text("hi"))
        >>> [p.name for p in ckpts.list()]
        ['step_000001']
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int | None = None,
        *,
        checksum: bool = False,
        clean_stale: bool = True,
    ) -> None:
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.checksum = checksum
        self.root.mkdir(parents=True, exist_ok=True)
        if clean_stale:
            self.clean_stale()

    # ----------------------------------------------------------------------------- naming
    def path_for(self, step: int) -> Path:
        """``root/step_000123`` for ``step=123`` (wider for steps >= 10**6)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        return self.root / f"step_{step:06d}"

    @staticmethod
    def step_of(path: str | os.PathLike[str]) -> int:
        """The step of a ``step_NNNNNN`` directory; ``ValueError`` naming the path otherwise."""
        m = _STEP_RE.match(Path(path).name)
        if m is None:
            raise ValueError(f"{path} is not a checkpoint directory named step_<number>")
        return int(m.group(1))

    def _housekeeping(self, kind: str, step: int) -> Path:
        return self.root / f".{kind}-step_{step:06d}-{os.getpid()}"

    # ----------------------------------------------------------------------------- reading
    def _step_dirs(self) -> builtins.list[tuple[int, Path]]:
        found = []
        for entry in self.root.iterdir():
            m = _STEP_RE.match(entry.name)
            if m is not None and entry.is_dir():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    @staticmethod
    def is_complete(path: str | os.PathLike[str], verify: bool = False) -> bool:
        """Whether ``path`` holds a readable manifest (and, with ``verify``, matching files).

        ``verify`` checks every listed file's size, and its sha256 when the manifest has one.
        """
        path = Path(path)
        try:
            manifest = json.loads((path / MARKER).read_text(encoding="utf-8"))
            files = manifest["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        if not verify:
            return True
        for rel, info in files.items():
            f = path / rel
            try:
                if f.stat().st_size != info["size"]:
                    return False
                if "sha256" in info and _sha256(f) != info["sha256"]:
                    return False
            except (OSError, KeyError, TypeError):
                return False
        return True

    def list(self) -> builtins.list[Path]:
        """Complete checkpoints, oldest step first (temp dirs and unmarked dirs skipped)."""
        return [p for _, p in self._step_dirs() if self.is_complete(p)]

    def latest(self, verify: bool = True) -> Path | None:
        """The newest complete checkpoint, or ``None``.

        With ``verify`` (the default, cheap: one ``stat`` per file, plus hashing if the manifest
        has sha256) a checkpoint whose files no longer match its manifest is skipped with a
        warning and the next older one is tried.
        """
        for _, path in reversed(self._step_dirs()):
            if not self.is_complete(path):
                continue
            if verify and not self.is_complete(path, verify=True):
                warnings.warn(
                    f"checkpoint {path} does not match its {MARKER} manifest; skipping it",
                    stacklevel=2,
                )
                continue
            return path
        return None

    # ----------------------------------------------------------------------------- writing
    def begin(self, step: int) -> Path:
        """Create and return an empty temp dir for ``step``; finish with :meth:`commit`/:meth:`abort`.

        For writers spread over several processes (rank 0 calls ``begin``, broadcasts the path,
        every rank writes its files, barrier, rank 0 calls ``commit``). :meth:`write` is the
        one-process shortcut.
        """
        self.path_for(step)  # validates step
        tmp = self._housekeeping("tmp", step)
        _remove_tree(tmp)  # left over from an earlier, aborted attempt of this process
        tmp.mkdir()
        with _ACTIVE_LOCK:
            _ACTIVE.add(tmp)
        return tmp

    def abort(self, tmp: Path) -> None:
        """Remove a temp dir from :meth:`begin` (previous checkpoints are not touched)."""
        _remove_tree(tmp)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)

    def commit(self, tmp: Path, *, overwrite: bool = False) -> Path:
        """Fsync ``tmp``, write the manifest, rename it to ``step_N``, fsync root, prune.

        If ``step_N`` already exists, ``overwrite=False`` raises ``FileExistsError``; with
        ``overwrite=True`` the old one is moved aside, the new one renamed in, then the old one
        removed. On error ``tmp`` is left for the caller to :meth:`abort`.
        """
        m = _HOUSEKEEPING_RE.match(tmp.name)
        if m is None or m.group(1) != "tmp" or tmp.parent != self.root:
            raise ValueError(f"{tmp} is not a temp dir from {self.root}.begin()")
        step = int(m.group(2))
        final = self.path_for(step)
        if (tmp / MARKER).exists():
            raise ValueError(f"{tmp / MARKER}: the writer must not create a file named {MARKER}")
        if final.exists() and not overwrite:
            raise FileExistsError(
                f"checkpoint {final} already exists; pass overwrite=True to replace it"
            )

        files: dict[str, dict[str, Any]] = {}
        for dirpath, dirnames, filenames in os.walk(tmp):
            d = Path(dirpath)
            for name in sorted(filenames):
                f = d / name
                _fsync_path(f, directory=False)
                info: dict[str, Any] = {"size": f.stat().st_size}
                if self.checksum:
                    info["sha256"] = _sha256(f)
                files[f.relative_to(tmp).as_posix()] = info
            for name in dirnames:
                _fsync_path(d / name, directory=True)
        manifest = json.dumps({"step": step, "files": files}, indent=1, sort_keys=True)
        with open(tmp / MARKER, "w", encoding="utf-8") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(tmp, directory=True)

        old = None
        if final.exists():
            old = self._housekeeping("old", step)
            with _ACTIVE_LOCK:
                _ACTIVE.add(old)
            os.rename(final, old)
        os.rename(tmp, final)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)
        _fsync_path(self.root, directory=True)
        if old is not None:
            _remove_tree(old)
            with _ACTIVE_LOCK:
                _ACTIVE.discard(old)
        self.prune(keep=final)
        return final

    def write(
        self, step: int, writer_fn: Callable[[Path], Any], *, overwrite: bool = False
    ) -> Path:
        """Write checkpoint ``step`` atomically and return its final path.

        ``writer_fn(tmp_dir)`` writes the checkpoint's files into ``tmp_dir``. If anything fails
        (``writer_fn`` raising, a full disk, ...) the temp dir is removed, existing checkpoints
        are left as they were, and :class:`CheckpointWriteError` is raised from the original
        error. ``KeyboardInterrupt``/``SystemExit`` also remove the temp dir and propagate as is.
        """
        final = self.path_for(step)
        if final.exists() and not overwrite:
            raise FileExistsError(
                f"checkpoint {final} already exists; pass overwrite=True to replace it"
            )
        try:
            tmp = self.begin(step)
        except OSError as err:
            raise self._error(step, final, err) from err
        try:
            writer_fn(tmp)
            return self.commit(tmp, overwrite=overwrite)
        except Exception as err:
            self.abort(tmp)
            raise self._error(step, final, err) from err
        except BaseException:
            self.abort(tmp)
            raise

    def _error(self, step: int, final: Path, err: Exception) -> CheckpointWriteError:
        code = getattr(err, "errno", None)
        hint = " (disk full)" if code == errno.ENOSPC else ""
        return CheckpointWriteError(
            f"failed to write checkpoint step {step} to {final}{hint}: "
            f"{type(err).__name__}: {err}. Older checkpoints in {self.root} are untouched.",
            path=final,
            step=step,
            errno=code,
        )

    # ----------------------------------------------------------------------------- cleanup
    def prune(self, keep: Path | None = None) -> builtins.list[Path]:
        """Apply ``keep_last``: keep ``keep`` plus the newest complete others; return removed.

        Every other ``step_*`` directory is removed, incomplete ones included; nothing that does
        not match ``step_<number>`` is ever touched. Each victim is first renamed to a hidden
        ``.del-*`` name, so a crash mid-delete never leaves a partial ``step_*`` behind.
        Errors while deleting are reported as warnings: the new checkpoint is already safe.
        """
        if self.keep_last is None:
            return []
        others = [(s, p) for s, p in self._step_dirs() if p != keep]
        budget = self.keep_last - (1 if keep is not None else 0)
        complete = [p for _, p in others if self.is_complete(p)]
        keepers = set(complete[len(complete) - budget :]) if budget > 0 else set()
        removed = []
        for step, path in others:
            if path in keepers:
                continue
            trash = self._housekeeping("del", step)
            try:
                with _ACTIVE_LOCK:
                    _ACTIVE.add(trash)
                os.rename(path, trash)
                shutil.rmtree(trash)
                removed.append(path)
            except OSError as err:
                warnings.warn(f"could not remove old checkpoint {path}: {err}", stacklevel=2)
            finally:
                with _ACTIVE_LOCK:
                    _ACTIVE.discard(trash)
        return removed

    def clean_stale(self) -> builtins.list[Path]:
        """Remove (or restore) housekeeping dirs of dead writers; return what was removed.

        A dir is stale if its pid is not running, or is this process's pid while this process
        is not using it. A stale ``.old-step_N`` is renamed back to ``step_N`` when ``step_N``
        is missing and the old copy is complete; everything else stale is deleted.
        """
        removed = []
        with _ACTIVE_LOCK:
            active = set(_ACTIVE)
        for entry in sorted(self.root.iterdir()):
            m = _HOUSEKEEPING_RE.match(entry.name)
            if m is None or not entry.is_dir() or entry in active:
                continue
            kind, step, pid = m.group(1), int(m.group(2)), int(m.group(3))
            if pid != os.getpid() and _pid_alive(pid):
                continue
            final = self.path_for(step)
            if kind == "old" and not final.exists() and self.is_complete(entry):
                os.rename(entry, final)
                continue
            _remove_tree(entry)
            removed.append(entry)
        if removed:
            _fsync_path(self.root, directory=True)
        return removed
