"""Atomic, crash-safe, verified checkpoint directories: ``root/step_000123``.

A checkpoint is written into a hidden temp directory ``root/.tmp-step_000123-<pid>``; every file
and directory in it is fsynced, a ``COMPLETE`` manifest (each file's size and CRC-32, the step,
and the id of the run that wrote it) is written and fsynced last, and only then is the temp
directory renamed to ``root/step_000123`` and ``root`` fsynced. A crash or a full disk at any
point therefore leaves either the old set of checkpoints or the old set plus the new one, never
a partially written ``step_*`` directory that :meth:`CheckpointDirectory.latest` would pick up.
:meth:`~CheckpointDirectory.latest` re-reads every file of a candidate and skips (with a warning
naming the file) one whose size or content no longer matches its manifest, so a same-size
corruption is never resumed from (see :mod:`tunesmith.models.manifest` for the hash and its
cost: about 0.12 s per GB from the page cache, 0.35 s per GB from disk).

What is deleted, and when (nothing else ever is):

* :meth:`~CheckpointDirectory.prune` (``keep_last``) removes only *this run's* checkpoints: a
  complete ``step_*`` whose manifest carries this run's id (``run_id``: new for every
  :class:`CheckpointDirectory`, or continued from a resumed checkpoint with
  :meth:`~CheckpointDirectory.adopt`). A ``step_*`` without a manifest (a user's folder, a
  copy), another run's checkpoints and any other name are never removed, and do not count
  towards ``keep_last``.
* :meth:`~CheckpointDirectory.clean_stale` removes the housekeeping dirs of dead writers (below).
* ``commit(..., overwrite=True)`` replaces ``step_N`` when the caller asks for it.

Folders that must make way (a rollback to an older step, ``overwrite=true`` in a run) are moved
aside with :meth:`~CheckpointDirectory.set_aside` into a plainly named folder (e.g.
``root/rolled-back-20260101-120000/``) that :meth:`~CheckpointDirectory.list`,
:meth:`~CheckpointDirectory.latest`, pruning and cleaning all ignore.

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
one process (rank 0) should own a checkpoint root at a time (a training run holds
:class:`tunesmith.training.checkpoint.run_lock.RunLock` on its output dir); other ranks can write
into the temp directory it hands out (see :meth:`~CheckpointDirectory.begin`).

Example::

    >>> ckpts = CheckpointDirectory("runs/exp1/checkpoints", keep_last=2)
    >>> def save(tmp: Path) -> None:
    ...     _ = (tmp / "model.safetensors").write_bytes(b"weights")
    >>> ckpts.write(100, save)
    PosixPath('runs/exp1/checkpoints/step_000100')
    >>> ckpts.latest()
    PosixPath('runs/exp1/checkpoints/step_000100')
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tunesmith.models.atomic import (
    fsync_path,
    fsync_tree,
    open_no_follow,
    real_folder,
    refuse_unsafe,
    replace_directory,
)
from tunesmith.models.manifest import (
    HASH,
    MARKER,
    file_entries,
    has_manifest,
    manifest_problem,
    read_manifest,
)

__all__ = ["MARKER", "CheckpointDirectory", "CheckpointWriteError", "aside_folder", "pid_alive"]

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


def pid_alive(pid: Any) -> bool:
    """Whether process ``pid`` runs on this host (``False`` for anything but a positive int).

    >>> pid_alive(os.getpid())
    True
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
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


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def aside_folder(parent: Path, label: str) -> Path:
    """A new, not yet existing ``parent/<label>-<UTC time>`` (``-2``, ``-3``... if taken).

    Example::

        >>> aside_folder(Path("out/checkpoints"), "rolled-back")
        PosixPath('out/checkpoints/rolled-back-...')
    """
    base = parent / f"{label}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    return folder


class CheckpointDirectory:
    """A folder of ``step_NNNNNN`` checkpoints written atomically, verified, optionally pruned.

    Args:
        root: the folder holding the checkpoints (created if missing).
        keep_last: keep at most this many of this run's complete checkpoints after each write
            (the one just written always survives); ``None`` keeps all. See the module docs
            for what is ever deleted.
        checksum: also record each file's sha256 (a CRC-32 is always recorded).
        clean_stale: remove housekeeping dirs left by dead processes on construction.
        run_id: the id written into each manifest (default: a new one); :meth:`adopt`
            continues the run of a checkpoint instead.

    Example::

        >>> ckpts = CheckpointDirectory("out/checkpoints", keep_last=1)
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
        run_id: str | None = None,
    ) -> None:
        if keep_last is not None and (
            isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1
        ):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.checksum = checksum
        self.run_id = run_id or uuid.uuid4().hex
        self._runs: set[str | None] = {self.run_id}  # whose checkpoints prune may remove
        real_folder(self.root)  # a planted link as the checkpoint root: refused
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
            if m is not None and (entry.is_dir() or entry.is_symlink()):
                found.append((int(m.group(1)), entry))
        return sorted(found)

    def step_dirs(self) -> builtins.list[Path]:
        """Every ``step_<number>`` folder of ``root``, complete or not, oldest step first (a
        symbolic link named so too: it is never a checkpoint, see :meth:`link_problem`)."""
        return [p for _, p in self._step_dirs()]

    @staticmethod
    def link_problem(path: str | os.PathLike[str]) -> str | None:
        """One line when ``path`` (a folder of the checkpoint root) is a symbolic link, or not
        a folder: such a ``step_*`` is never resumed from, pruned or counted; else None.

        Example::

            >>> Path("elsewhere").mkdir(); Path("out/checkpoints").mkdir(parents=True)
            >>> Path("out/checkpoints/step_000002").symlink_to(Path("elsewhere").resolve())
            >>> CheckpointDirectory.link_problem("out/checkpoints/step_000002")
            'out/checkpoints/step_000002: is a symbolic link (to /.../elsewhere); tunesmith ...'
        """
        path = Path(path)
        try:
            refuse_unsafe(path, os.lstat(path), folder=True)
        except OSError as err:
            return str(err)
        return None

    @staticmethod
    def problem(path: str | os.PathLike[str]) -> str | None:
        """Why ``path`` is not a good checkpoint (one line naming the file), or None.

        Checks the manifest is there and every listed file's size and content hash (sha256
        too where recorded; old manifests with sizes only are checked by size).

        Example::

            >>> ckpts = CheckpointDirectory("out/checkpoints")
            >>> step = ckpts.write(4, lambda d: (d / "model.safetensors").write_bytes(b"weights"))
            >>> CheckpointDirectory.problem(step) is None
            True
            >>> _ = (step / "model.safetensors").write_bytes(b"WEIGHTS")
            >>> CheckpointDirectory.problem(step)
            '.../step_000004/model.safetensors: content differs from the COMPLETE manifest ...'
        """
        path = Path(path)
        if not has_manifest(path):
            return f"{path}: no {MARKER} manifest (an unfinished write, or not a checkpoint)"
        return manifest_problem(path)

    @staticmethod
    def is_complete(path: str | os.PathLike[str], verify: bool = False) -> bool:
        """Whether ``path`` holds a readable manifest (and, with ``verify``, matching files:
        sizes and content hashes, see :meth:`problem`)."""
        if verify:
            return CheckpointDirectory.problem(path) is None
        return read_manifest(Path(path)) is not None

    @staticmethod
    def run_of(path: str | os.PathLike[str]) -> str | None:
        """The id of the run that wrote checkpoint ``path`` (None for old manifests)."""
        manifest = read_manifest(Path(path)) or {}
        run = manifest.get("run")
        return run if isinstance(run, str) else None

    def adopt(self, path: str | os.PathLike[str]) -> None:
        """Continue the run that wrote checkpoint ``path`` (the one being resumed): write its
        id into new manifests, and let :meth:`prune` remove that run's older checkpoints. For
        an old manifest without an id, checkpoints without one become prunable."""
        run = self.run_of(path)
        self._runs.add(run)
        if run is not None:
            self.run_id = run

    def list(self) -> builtins.list[Path]:
        """Complete checkpoints, oldest step first (temp dirs, unmarked dirs and links skipped)."""
        return [p for _, p in self._step_dirs() if not p.is_symlink() and self.is_complete(p)]

    def newest_good(self) -> tuple[Path | None, builtins.list[tuple[Path, str]]]:
        """The newest complete checkpoint whose files match its manifest, and the complete
        ones newer than it that do not, each with its :meth:`problem` (newest first)."""
        skipped = []
        found = [p for _, p in self._step_dirs() if p.is_symlink() or self.is_complete(p)]
        for path in reversed(found):
            problem = self.link_problem(path) or self.problem(path)
            if problem is None:
                return path, skipped
            skipped.append((path, problem))
        return None, skipped

    def latest(self, verify: bool = True) -> Path | None:
        """The newest complete checkpoint, or ``None``.

        With ``verify`` (the default: every file is read and hashed, 0.12-0.35 s per GB) a
        checkpoint whose files no longer match its manifest is skipped with a warning naming
        the file, and the next older one is tried.
        """
        if not verify:
            found = self.list()
            return found[-1] if found else None
        path, skipped = self.newest_good()
        for bad, problem in skipped:
            warnings.warn(f"skipping checkpoint {bad}: {problem}", stacklevel=2)
        return path

    # ----------------------------------------------------------------------------- writing
    def begin(self, step: int) -> Path:
        """Create and return an empty temp dir for ``step``; finish with
        :meth:`commit`/:meth:`abort`.

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

    def _manifest(self, tmp: Path, step: int) -> str:
        """Fsync every file and dir of ``tmp``; the manifest text (sizes, hashes, run id)."""
        names = fsync_tree(tmp)
        # read back from the page cache, 4 files at a time
        files = file_entries(tmp, names, sha256=self.checksum)
        manifest = {"step": step, "run": self.run_id, "hash": HASH, "files": files}
        return json.dumps(manifest, indent=1, sort_keys=True)

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

        manifest = self._manifest(tmp, step)
        with open_no_follow(tmp / MARKER, "x") as f:
            f.write(manifest)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp, directory=True)

        old = self._housekeeping("old", step)  # where a replaced step_N waits until deleted
        with _ACTIVE_LOCK:
            _ACTIVE.add(old)
        try:  # two plain renames (no exchange): clean_stale restores an interrupted overwrite
            replace_directory(tmp, final, aside=old, exchange=False)
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.discard(old)
        with _ACTIVE_LOCK:
            _ACTIVE.discard(tmp)
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

    # ----------------------------------------------------------------------------- moving aside
    def set_aside(self, paths: Iterable[Path], into: Path) -> Path:
        """Move each of ``paths`` (folders of ``root``) into the folder ``into`` (created; it
        must not exist), keeping their names; nothing is deleted. Returns ``into``.

        Example::

            >>> ckpts = CheckpointDirectory("out/checkpoints")
            >>> for step in (1, 2, 3):
            ...     _ = ckpts.write(step, lambda d: (d / "a.txt").write_text("hi"))
            >>> ckpts.set_aside(ckpts.step_dirs()[2:], aside_folder(ckpts.root, "rolled-back"))
            PosixPath('out/checkpoints/rolled-back-...')
            >>> [p.name for p in ckpts.step_dirs()]
            ['step_000001', 'step_000002']
        """
        into.mkdir(parents=True)
        for path in paths:
            os.rename(path, into / path.name)
        for folder in {into, into.parent, self.root}:
            fsync_path(folder, directory=True)
        return into

    # ----------------------------------------------------------------------------- cleanup
    def prune(self, keep: Path | None = None) -> builtins.list[Path]:
        """Apply ``keep_last`` to this run's checkpoints; return those removed.

        Candidates are the complete ``step_*`` checkpoints whose manifest carries this run's id
        (or a run :meth:`adopt` continued); ``keep`` and the newest ``keep_last - 1`` other
        candidates stay, the other candidates go. Anything else (no manifest, another run's,
        any other name) is never touched. Each victim is first renamed to a hidden ``.del-*``
        name, so a crash mid-delete never leaves a partial ``step_*`` behind. Errors while
        deleting are reported as warnings: the new checkpoint is already safe.
        """
        if self.keep_last is None:
            return []
        ours = [
            (s, p)
            for s, p in self._step_dirs()
            if p != keep
            and not p.is_symlink()
            and self.is_complete(p)
            and self.run_of(p) in self._runs
        ]
        budget = self.keep_last - (1 if keep is not None else 0)
        victims = ours[: max(len(ours) - budget, 0)]
        removed = []
        for step, path in victims:
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
            if m is None or entry.is_symlink() or not entry.is_dir() or entry in active:
                continue  # a link with a housekeeping name is not ours: left alone
            kind, step, pid = m.group(1), int(m.group(2)), int(m.group(3))
            if pid != os.getpid() and pid_alive(pid):
                continue
            final = self.path_for(step)
            if kind == "old" and not final.exists() and self.is_complete(entry):
                os.rename(entry, final)
                continue
            _remove_tree(entry)
            removed.append(entry)
        if removed:
            fsync_path(self.root, directory=True)
        return removed
