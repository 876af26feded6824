"""Load a ``torch.distributed.checkpoint`` folder, and the other pickle-based files of a
checkpoint, without unpickling arbitrary objects.

``dcp.load`` reads two things with plain ``pickle``: the ``.metadata`` file (``pickle.load``)
and every non-tensor entry (``torch.load(weights_only=False)`` in the default planner), so a
checkpoint folder from someone else could run code when resumed. :func:`load` reads the
metadata with an unpickler that builds exactly the objects of :func:`allowed_globals` (dcp's
metadata records, ``torch.Size``, dtype/layout/memory-format constants, paths): a pickle's
``(module, name)`` is looked up in that table and never imported or walked, so a dotted name
(``os.system`` reached through a module's imports, as protocol 4 allows) is refused too. The
non-tensor entries, and the per-rank training state (``rank*.pt``: scheduler, sampler and
data-loader position, RNG), go through :func:`load_plain`: ``torch.load(weights_only=True)``
with torch's built-in allow-list only (every global registered with
``torch.serialization.add_safe_globals``, by torch's modules or by any other code, is set aside
while it reads: these files hold plain data and tensors). Anything else is
refused: the metadata with :class:`UnsafeCheckpointError` naming the file and the object it
wanted to build, the others with torch's error, which the caller names the file in
(:func:`refusal_reason` picks out what was refused).

Example::

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    load(state, "out/checkpoints/step_000100/training_state/optimizer")
    load_plain("out/checkpoints/step_000100/training_state/rank0.pt")
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import os
import pathlib
import pickle
import pickletools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystemReader,
    SerializationFormat,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "allowed_globals",
    "load",
    "load_plain",
    "refusal_reason",
]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file wanted to build an object outside the allow-list (it was not built)."""


@functools.cache
def allowed_globals() -> dict[tuple[str, str], Any]:
    """Every ``(module, name)`` a dcp ``.metadata`` pickle may name, with the object it gets.

    >>> allowed_globals()[("torch", "Size")] is torch.Size
    True
    """
    classes = [
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata._MEM_FORMAT_ENCODING,
        _StorageInfo,
        SerializationFormat,
        torch.Size,
        collections.OrderedDict,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
    ]
    table: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes}
    table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name, value in vars(torch).items():  # torch.float32, torch.strided, ...
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", name)] = value
    return table


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        """The listed object for exactly ``(module, name)``; nothing is imported or walked."""
        obj = allowed_globals().get((module, name))
        if obj is None:
            raise UnsafeCheckpointError(
                f"{self.path}: refused to unpickle {module}.{name}: a checkpoint's metadata "
                "holds only dcp records, paths and torch constants (this file could run code)"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"{self.path}: refused a persistent id in dcp metadata")


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with the allow-list unpickler, and
    whose storage entries must name plain files of the checkpoint folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream, path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as err:  # truncated or not a pickle at all
                raise UnsafeCheckpointError(
                    f"{path}: not a readable checkpoint metadata file: {type(err).__name__}: {err}"
                ) from err
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(
                f"{path}: holds a {type(metadata).__name__}, not checkpoint Metadata"
            )
        _check_storage(path, metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_storage(path: Path, metadata: Metadata) -> None:
    """Every storage entry points into a plain file of the folder (no ``..``, no ``/``)."""
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not _plain_file_name(name):
            raise UnsafeCheckpointError(
                f"{path}: a storage entry names {name!r}, not a file of the checkpoint folder"
            )


def _plain_file_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not set("/\\") & set(name)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = load_plain(value)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"entry '{fqn}' holds objects other than tensors and plain data: "
                f"{refusal_reason(err)}"
            ) from err
        if self.flatten_state_dict:  # what the parent does, after its torch.load
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def refusal_reason(err: BaseException) -> str:
    """The line of a ``torch.load(weights_only=True)`` error that names what was refused
    (``Trying to load unsupported GLOBAL posix.system ...``), else its first line; an opcode
    the reader does not take is named (``Unsupported operand 149 (FRAME: a protocol-4
    pickle)``)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    line = (named or lines or [type(err).__name__])[0]
    match = re.search(r"Unsupported operand (\d+)", line)
    if match and int(match.group(1)) < 256:
        opcode = pickletools.code2op.get(chr(int(match.group(1))))
        if opcode is not None:
            line += f" ({opcode.name}: a protocol-{opcode.proto} pickle opcode)"
    return line


def load_plain(file: str | os.PathLike[str] | IO[bytes], map_location: Any = None) -> Any:
    """``file`` read with ``torch.load(weights_only=True)`` and torch's built-in allow-list
    (``map_location`` as in ``torch.load``). A refusal is torch's ``pickle.UnpicklingError``:
    the caller names the file, and :func:`refusal_reason` says what was refused.

    >>> torch.save({"progress": {"step": 100}}, "rank0.pt")  # e.g. training_state/rank0.pt
    >>> load_plain("rank0.pt")
    {'progress': {'step': 100}}
    >>> torch.save({"hook": print}, "hostile.pt")  # a pickled function is not plain data
    >>> try:
    ...     load_plain("hostile.pt")
    ... except Exception as error:
    ...     print(refusal_reason(error))
    WeightsUnpickler error: Unsupported global: GLOBAL print was not an allowed global by default...
    """
    with _only_builtin_safe_globals():
        return torch.load(file, map_location=map_location, weights_only=True)


@contextlib.contextmanager
def _only_builtin_safe_globals() -> Iterator[None]:
    """Set aside the globals registered with ``torch.serialization.add_safe_globals`` (a
    library may have allowed a ``subprocess.call``-like callable for its own files)."""
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(added)


def load(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``dcp.load(state_dict, checkpoint_id=path)`` with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner` (a collective: every rank calls it)."""
    reader = SafeFileSystemReader(path)
    if Path(reader._get_metadata_path()).is_file():  # refuse it here: dcp would log tracebacks
        reader.read_metadata()  # and fall back to per-rank metadata files
    dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner())
