"""Atomic directories: write into a temp sibling, fsync every file and folder, rename into place.

The one implementation behind :func:`tunesmith.models.safetensors_io.atomic_directory` (HF
folders, adapters, exports) and :class:`tunesmith.training.CheckpointDirectory` (training
checkpoints with their ``COMPLETE`` manifest). Callers choose the temp and aside names (and so
their own housekeeping and crash clean-up); this module does the fsyncs and the renames. It
lives in ``models`` (the lowest layer that writes folders) so ``models`` and ``training`` both
import it.

It also holds the no-follow helpers every writer of a run's folders uses
(:func:`open_no_follow`, :func:`real_folder`): a symbolic link planted as the run's lock,
``config.yaml``, ``metrics.jsonl``, a log, ``checkpoints/`` or ``logs/`` is refused with one
line naming it instead of being written through.

Hard links: a file opened to write in place (every mode but ``r``: the lock, ``config.yaml``,
``metrics.jsonl``, ``samples.jsonl``/``rollouts.jsonl``, the torchrun log, a trainer group's
``rank<N>.log``/``console.log``/``driver.log``) is refused when it has more than one name
(``st_nlink > 1``): a hard link planted there is another file of the user's, which appending
or truncating would change. Reading is not refused: a model folder or a checkpoint whose
files are hard links (tools that deduplicate identical files, HF caches on some setups) is
read as its files, since reading changes nothing. Files written atomically (a temp file
renamed into place: checkpoints, exports) replace the name and never write into what it named,
so they need no check.

Example::

    >>> tmp = Path("out/.ckpt.tmp")
    >>> tmp.mkdir(parents=True)
    >>> (tmp / "a.txt").write_text("hi")
    2
    >>> fsync_tree(tmp)
    ['a.txt']
    >>> fsync_path(tmp, directory=True)
    >>> replace_directory(tmp, Path("out/ckpt"), aside=Path("out/.ckpt.old"))
    >>> sorted(p.as_posix() for p in Path("out").rglob("*"))
    ['out/ckpt', 'out/ckpt/a.txt']
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import IO, Any

__all__ = [
    "UnsafePathError",
    "fsync_path",
    "fsync_tree",
    "open_fd_no_follow",
    "open_no_follow",
    "real_folder",
    "refuse_hard_link",
    "refuse_unsafe",
    "replace_directory",
]


def fsync_path(path: Path, *, directory: bool = False) -> None:
    """Fsync a file or a directory (directories are skipped where they cannot be opened: Windows).

    >>> fsync_path(Path("."), directory=True)
    """
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


def fsync_tree(root: Path) -> list[str]:
    """Fsync every file and sub-directory below ``root`` (not ``root`` itself, which the caller
    syncs once it has written its last file); return the files' paths relative to ``root``.

    Example::

        >>> tmp = Path("out/.tmp-step_000001-123")
        >>> (tmp / "training_state").mkdir(parents=True)
        >>> (tmp / "model.safetensors").write_bytes(b"weights")
        7
        >>> (tmp / "training_state" / "rank0.pt").write_bytes(b"state")
        5
        >>> fsync_tree(tmp)
        ['model.safetensors', 'training_state/rank0.pt']
    """
    names = []
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        for name in sorted(filenames):
            fsync_path(d / name)
            names.append((d / name).relative_to(root).as_posix())
        for name in dirnames:
            fsync_path(d / name, directory=True)
    return names


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux ``renameat2(RENAME_EXCHANGE)``; False if unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    rc = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


def replace_directory(new: Path, final: Path, *, aside: Path, exchange: bool = True) -> None:
    """Rename the (already fsynced) directory ``new`` to ``final``, fsync the parent, and delete
    what ``final`` held before.

    An existing ``final`` is swapped out with one atomic ``renameat2`` exchange when
    ``exchange`` and the platform allow it; otherwise it is renamed to ``aside``, ``new`` is
    renamed in (on failure ``aside`` is renamed back) and ``aside`` is deleted once the parent
    is synced (a failure to delete it is ignored: the new contents are already in place). A crash between the two renames leaves ``final`` absent and the previous
    contents intact at ``aside``, never a half-written ``final``.

    Example::

        >>> Path("ckpt/step_1").mkdir(parents=True)
        >>> Path("ckpt/step_1/old.txt").write_text("old")
        3
        >>> tmp = Path("ckpt/.tmp-step_1")
        >>> tmp.mkdir()
        >>> (tmp / "new.txt").write_text("new")
        3
        >>> replace_directory(tmp, Path("ckpt/step_1"), aside=Path("ckpt/.old"))
        >>> sorted(p.as_posix() for p in Path("ckpt").rglob("*"))
        ['ckpt/step_1', 'ckpt/step_1/new.txt']
    """
    if not final.exists():
        os.rename(new, final)
        fsync_path(final.parent, directory=True)
        return
    if exchange and _exchange(new, final):
        fsync_path(final.parent, directory=True)
        shutil.rmtree(new, ignore_errors=True)  # now holds the previous contents
        return
    os.rename(final, aside)
    try:
        os.rename(new, final)
    except BaseException:
        os.rename(aside, final)
        raise
    fsync_path(final.parent, directory=True)
    shutil.rmtree(aside, ignore_errors=True)  # the new contents are safe either way


# ----------------------------------------------------------------------------- no-follow files


class UnsafePathError(OSError):
    """A file or folder of the run's own folders (or of a checkpoint) is a symbolic link, not
    a regular file / folder (a FIFO, a device), or a file to write with another hard link:
    refused, because writing or reading it would reach something else. The message is one line
    naming the path."""


_REFUSAL = "tunesmith does not write or read through links inside its own folders"


def _describe(path: Path, st: os.stat_result) -> str:
    """``'a symbolic link (to /etc/passwd)'``, ``'a FIFO'``, ... for the refusal messages."""
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symbolic link (to {os.readlink(path)})"
        except OSError:
            return "a symbolic link"
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISDIR, "a folder")]  # fmt: skip
    return next((name for test, name in kinds if test(st.st_mode)), "not a regular file")


def refuse_unsafe(path: Path, st: os.stat_result, *, folder: bool = False) -> None:
    """Raise :class:`UnsafePathError` unless ``st`` (an ``lstat`` of ``path``) is a regular
    file (a real folder with ``folder``).

    Example::

        >>> Path("out").mkdir()
        >>> Path("out/metrics.jsonl").symlink_to("/etc/passwd")
        >>> refuse_unsafe(Path("out/metrics.jsonl"), os.lstat("out/metrics.jsonl"))
        Traceback (most recent call last):
        ...
        tunesmith.models.atomic.UnsafePathError: out/metrics.jsonl: is a symbolic link (to /etc/passwd); ...
    """
    wanted = stat.S_ISDIR if folder else stat.S_ISREG
    if wanted(st.st_mode):
        return
    what = _describe(path, st)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path}: is {what}; {_REFUSAL}: remove the link")
    raise UnsafePathError(f"{path}: is {what}, not a regular {'folder' if folder else 'file'}")


def refuse_hard_link(path: Path, st: os.stat_result) -> None:
    """Raise :class:`UnsafePathError` when ``st`` (an ``fstat`` of ``path``, opened to write)
    says the file has other names: a hard link, whose other name writing here would change.

    Example::

        >>> Path("out").mkdir()
        >>> Path("out/metrics.jsonl").write_text("")
        0
        >>> os.link("out/metrics.jsonl", "mine.jsonl")
        >>> refuse_hard_link(Path("out/metrics.jsonl"), os.stat("out/metrics.jsonl"))
        Traceback (most recent call last):
        ...
        tunesmith.models.atomic.UnsafePathError: out/metrics.jsonl: is a hard link (the file has 2 names), ...
    """
    if st.st_nlink > 1:
        raise UnsafePathError(
            f"{path}: is a hard link (the file has {st.st_nlink} names), so writing it would "
            f"change another file too; tunesmith does not write to hard-linked files inside "
            f"its own folders: remove {path.name} (its other names keep the content)"
        )


def real_folder(path: str | os.PathLike[str], *, create: bool = True) -> Path:
    """``path`` as a folder the run writes into: created if missing (parents too), refused
    (:class:`UnsafePathError`) when ``path`` itself is a symbolic link or not a folder.

    The folders above ``path`` are the user's (an ``output_dir`` that is a link is followed
    once, as the user chose); a link planted as one of the run's own folders
    (``checkpoints/``, ``logs/``) is not.

    Example::

        >>> real_folder("out/logs")
        PosixPath('out/logs')
    """
    path = Path(path)
    if create:
        with contextlib.suppress(FileExistsError):  # a dangling link, or a file: said below
            path.mkdir(parents=True, exist_ok=True)
    refuse_unsafe(path, os.lstat(path), folder=True)
    return path


_MODES = {"w": os.O_WRONLY | os.O_CREAT, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL, "r": os.O_RDONLY,
          "r+": os.O_RDWR, "w+": os.O_RDWR | os.O_CREAT}  # fmt: skip


def open_fd_no_follow(
    path: str | os.PathLike[str], mode: str = "r", perms: int = 0o644, *, create: bool = False
) -> int:
    """A file descriptor of ``path`` opened without following a symbolic link at ``path`` and
    without blocking on a FIFO; refused (:class:`UnsafePathError`, one line naming the file)
    unless it is a regular file, and, opened to write (every mode but ``r``), unless it has
    one name only (:func:`refuse_hard_link`). ``mode`` is ``r``, ``r+``, ``w``, ``w+``, ``a``
    or ``x`` (``w`` truncates only once the file passed both checks); ``create`` adds
    ``O_CREAT`` (``r+`` with ``create``: read and write, created if missing, never truncated).

    Example::

        >>> Path("out").mkdir()
        >>> fd = open_fd_no_follow("out/.tunesmith.lock", "r+", create=True)
        >>> os.write(fd, b"1234")
        4
        >>> os.close(fd)
    """
    path = Path(path)
    flags = _MODES[mode] | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_CREAT if create else 0
    try:
        fd = os.open(path, flags, perms)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.ENOTDIR, errno.EEXIST):
            refuse_unsafe(path, os.lstat(path))
        raise
    try:
        st = os.fstat(fd)
        refuse_unsafe(path, st)
        if mode != "r":  # appended to or written in place: no other name may share it
            refuse_hard_link(path, st)
        os.set_blocking(fd, True)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_no_follow(
    path: str | os.PathLike[str],
    mode: str = "w",
    *,
    encoding: str | None = "utf-8",
    buffering: int = -1,
    errors: str | None = None,
) -> IO[Any]:
    """``open(path, mode)`` for the files a run writes (its lock, ``config.yaml``,
    ``metrics.jsonl``, logs) and the checkpoint files it reads, with no-follow semantics: a
    symbolic link (or a FIFO, a device) at ``path`` is refused with one line naming it, and so
    is a hard-linked file in a mode that writes. ``mode``: ``r``, ``w``, ``a``, ``x``, ``r+``,
    ``w+``, optionally with ``b``.

    Example::

        >>> Path("out").mkdir()
        >>> with open_no_follow("out/config.yaml", "w") as f:
        ...     f.write("lr: 0.001\\n")
        10
        >>> Path("out/metrics.jsonl").symlink_to("/etc/passwd")
        >>> open_no_follow("out/metrics.jsonl", "a")
        Traceback (most recent call last):
        ...
        tunesmith.models.atomic.UnsafePathError: out/metrics.jsonl: is a symbolic link (to /etc/passwd); ...
    """
    binary = "b" in mode
    fd = open_fd_no_follow(path, mode.replace("b", ""))
    try:
        if binary:
            return os.fdopen(fd, mode, buffering=buffering)
        return os.fdopen(fd, mode, buffering=buffering, encoding=encoding, errors=errors)
    except BaseException:
        os.close(fd)
        raise
