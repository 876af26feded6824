"""Load a ``torch.distributed.checkpoint`` folder without unpickling arbitrary objects.

``dcp.load`` reads two things with plain ``pickle``: the ``.metadata`` file (``pickle.load``)
and every non-tensor entry (``torch.load(weights_only=False)`` in the default planner), so a
checkpoint folder from someone else could run code when resumed. :func:`load` reads the
metadata with an unpickler that only builds dcp's own metadata records, paths, ``torch.Size``
and dtype/layout/memory-format constants, and the non-tensor entries with
``torch.load(weights_only=True)``; anything else is refused with :class:`UnsafeCheckpointError`
naming the file and the object it wanted to build.

Example::

    >>> state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # doctest: +SKIP
    >>> load(state, "out/checkpoints/step_000100/training_state/optimizer")  # doctest: +SKIP
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "UnsafeCheckpointError",
    "load",
    "refusal_reason",
]

_ALLOWED_CLASSES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
}
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file wanted to build an object outside the allow-list (it was not built)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if module == dcp_metadata.__name__ or (module, name) in _ALLOWED_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self.path}: refused to unpickle {module}.{name}: a checkpoint's metadata holds "
            "only dcp records, paths and torch constants (this file could run code)"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with an allow-list unpickler."""

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
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
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
    (``Trying to load unsupported GLOBAL posix.system ...``), else its first line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (named or lines or [type(err).__name__])[0]


def load(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``dcp.load(state_dict, checkpoint_id=path)`` with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner` (a collective: every rank calls it)."""
    reader = SafeFileSystemReader(path)
    if Path(reader._get_metadata_path()).is_file():  # refuse it here: dcp would log tracebacks
        reader.read_metadata()  # and fall back to per-rank metadata files
    dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner())
