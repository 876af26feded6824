"""Atomic directories: write into a temp sibling, fsync every file and folder, rename into place.

The one implementation behind :func:`tunesmith.models.safetensors_io.atomic_directory` (HF
folders, adapters, exports) and :class:`tunesmith.training.CheckpointDirectory` (training
checkpoints with their ``COMPLETE`` manifest). Callers choose the temp and aside names (and so
their own housekeeping and crash clean-up); this module does the fsyncs and the renames. It
lives in ``models`` (the lowest layer that writes folders) so ``models`` and ``training`` both
import it.

Example::

    >>> tmp = Path("out/.ckpt.tmp")  # doctest: +SKIP
    >>> tmp.mkdir()  # doctest: +SKIP
    >>> (tmp / "a.txt").write_text("hi")  # doctest: +SKIP
    >>> fsync_tree(tmp)  # doctest: +SKIP
    ['a.txt']
    >>> fsync_path(tmp, directory=True)  # doctest: +SKIP
    >>> replace_directory(tmp, Path("out/ckpt"), aside=Path("out/.ckpt.old"))  # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
from pathlib import Path

__all__ = ["fsync_path", "fsync_tree", "replace_directory"]


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

        >>> fsync_tree(Path("out/.tmp-step_000001-123"))  # doctest: +SKIP
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

        >>> replace_directory(tmp, Path("ckpt/step_1"), aside=Path("ckpt/.old"))  # doctest: +SKIP
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
