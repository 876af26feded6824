"""Hugging Face style safetensors folders: streamed reading, sharded writing, atomic directories.

This module knows about ``nn.Module`` state dicts and files, nothing about model families.

A folder holds either one ``model.safetensors`` or shards ``model-00001-of-0000N.safetensors``
listed by ``model.safetensors.index.json``. Loading goes one shard at a time through
``safe_open``: tensors are memory-mapped and assigned into the module (no second copy of the
model is ever built; when no cast or device move is needed, parameters stay backed by the
file's private mapping, so the model costs no anonymous memory until it is written to).

Example::

    >>> from tunesmith.models import build_model, qwen3
    >>> spec = qwen3.spec("qwen3_tiny")  # 115k parameters
    >>> with atomic_directory("ckpt/") as tmp:
    ...     _ = write_safetensors_shards(build_model(spec).state_dict(), tmp, max_shard_size="200KB")
    >>> sorted(p.name for p in Path("ckpt").iterdir())  # doctest: +NORMALIZE_WHITESPACE
    ['model-00001-of-00003.safetensors', 'model-00002-of-00003.safetensors',
     'model-00003-of-00003.safetensors', 'model.safetensors.index.json']
    >>> model = build_model(spec, device="meta")
    >>> load_into_module(model, "ckpt/", device="cpu", dtype=torch.bfloat16)
    >>> next(model.parameters()).dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from tunesmith.models.atomic import fsync_path, fsync_tree, replace_directory

__all__ = [
    "SAFE_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "CheckpointError",
    "DerivedTensor",
    "TensorInfo",
    "assert_no_meta",
    "atomic_directory",
    "find_weight_files",
    "load_into_module",
    "parse_size",
    "plan_shards",
    "read_tensor_index",
    "shard_file_names",
    "write_safetensors_shards",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointError(ValueError):
    """A checkpoint folder or file cannot be read or written; the message names file and tensor."""


class CheckpointFileNotFoundError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs (config, shard, weights) does not exist."""


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor lives on disk and what its header says (read without loading data)."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype code, e.g. "BF16"
    stored_name: str | None = None  # its name in the file, when the index renamed it


@dataclass(frozen=True)
class DerivedTensor:
    """A checkpoint tensor the loader computes from others of the folder instead of reading it
    (a quantized weight from its data and scales): ``compute(*inputs, dtype=)`` gets the
    ``inputs`` (names as stored) as read and returns the tensor of ``shape`` in ``dtype``.

    Example::

        >>> half = DerivedTensor(("w", "w_scale"), (2, 3), lambda w, s, dtype: (w * s).to(dtype))
        >>> half.compute(torch.ones(2, 3), torch.tensor(0.5), dtype=torch.bfloat16)[0]
        tensor([0.5000, 0.5000, 0.5000], dtype=torch.bfloat16)
    """

    inputs: tuple[str, ...]  # read only to compute it; never loaded themselves
    shape: tuple[int, ...]
    compute: Callable[..., torch.Tensor]


def _names(names: list[str] | set[str], limit: int = 20) -> str:
    ordered = sorted(names)
    shown = ", ".join(ordered[:limit])
    return shown + (f", ... ({len(ordered) - limit} more)" if len(ordered) > limit else "")


# ----------------------------------------------------------------------------- sizes


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like ``"5GB"`` (decimal) or ``"512MiB"`` (binary).

    >>> parse_size("5GB"), parse_size("1KiB"), parse_size(300)
    (5000000000, 1024, 300)
    """
    if isinstance(size, bool):
        raise ValueError(f"invalid size {size!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"invalid size {size!r}: use an int (bytes) or e.g. '500MB', '5GB', '1GiB'"
        )
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return value


# ----------------------------------------------------------------------------- reading


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; errors name the file (``what`` says what the folder
    should have been, e.g. "a HF model folder")."""
    if not path.is_file():
        raise CheckpointFileNotFoundError(f"{path} not found: {path.parent} is not {what}")
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot parse ({e})") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def find_weight_files(folder: str | os.PathLike) -> tuple[list[Path], Path | None]:
    """The safetensors files of ``folder`` and the index that lists them (``None`` if single).

    Like transformers, a single ``model.safetensors`` wins over an index. Raises
    :class:`CheckpointError` naming the folder when there are no safetensors weights, and naming
    the index and shard when a listed shard is missing.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointFileNotFoundError(f"checkpoint folder {folder} does not exist")
    single = folder / SAFE_WEIGHTS_NAME
    if single.is_file():
        return [single], None
    index = folder / SAFE_INDEX_NAME
    if index.is_file():
        weight_map = _read_index(index)
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            details = "; ".join(f"'{f}' (holds {_names(files[f], 5)})" for f in sorted(missing))
            raise CheckpointFileNotFoundError(
                f"{index} lists shard(s) missing from {folder}: {details}"
            )
        return [folder / f for f in sorted(files)], index
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    legacy = sorted(p.name for pattern in ("*.bin", "*.pt") for p in folder.glob(pattern))
    hint = ""
    if others:
        hint = f" (found {', '.join(others)} but neither {SAFE_WEIGHTS_NAME} nor {SAFE_INDEX_NAME})"
    elif legacy:
        hint = f" (found {', '.join(legacy)}: only safetensors weights are loaded; convert them)"
    raise CheckpointFileNotFoundError(
        f"no weights found in {folder}: expected {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME}{hint}"
    )


def _read_index(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: cannot read index ({e})") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' (tensor name -> shard file) in index")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise CheckpointError(f"{index}: tensor '{name}' maps to invalid shard name {file!r}")
    return weight_map


@contextlib.contextmanager
def _open_shard(path: Path) -> Iterator:
    """``safe_open`` (CPU, memory-mapped) whose format errors name the file."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(
            f"{path}: not a valid safetensors file (truncated or corrupt?): {e}"
        ) from e
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e})") from e
    with handle as f:
        yield f


def read_tensor_index(folder: str | os.PathLike) -> dict[str, TensorInfo]:
    """Name -> :class:`TensorInfo` for every tensor of the checkpoint, from file headers only.

    Cross-checks the index: a tensor it maps to a shard that lacks it, or a tensor stored in two
    shards, is an error naming both.
    """
    files, index = find_weight_files(folder)
    mapped = _read_index(index) if index is not None else {}
    infos: dict[str, TensorInfo] = {}
    for path in files:
        with _open_shard(path) as f:
            names = list(f.keys())
            for name in names:
                if name in infos:
                    raise CheckpointError(
                        f"tensor '{name}' is stored twice: in {infos[name].file} and in {path}"
                    )
                piece = f.get_slice(name)
                infos[name] = TensorInfo(path, tuple(piece.get_shape()), piece.get_dtype())
        listed = {n for n, file in mapped.items() if file == path.name}
        absent = listed - set(names)
        if absent:
            raise CheckpointError(
                f"{index} maps tensor(s) {_names(absent)} to {path}, which does not contain them"
            )
    return infos


def _tied_names(module: nn.Module, keys: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Canonical state-dict name -> the other names of the same tensor object.

    E.g. ``{"model.embed_tokens.weight": ["lm_head.weight"]}`` for tied embeddings. The
    canonical name is the first of a group in state-dict order; the other names may or may
    not be in the state dict (a module may drop its tied copies there). Untied names map to [].
    """
    by_id: dict[int, list[str]] = {}
    named = list(module.named_parameters(remove_duplicate=False))
    named += list(module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        by_id.setdefault(id(tensor), []).append(name)
    tied: dict[str, list[str]] = {}
    claimed: set[str] = set()
    for key, tensor in keys.items():
        if key in claimed:
            continue
        others = [n for n in by_id.get(id(tensor), []) if n != key]
        claimed.update(others)
        tied[key] = others
    return tied


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    if attr in owner._parameters:
        owner._parameters[attr] = tensor  # an existing Parameter object (re-tying)
    else:
        owner._buffers[attr] = tensor


def load_into_module(
    module: nn.Module,
    folder: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    parts: Mapping[str, tuple[str, int, int]] | None = None,
    rename: Callable[[str], str | None] | None = None,
    derive: Callable[[Mapping[str, TensorInfo]], Mapping[str, DerivedTensor]] | None = None,
) -> None:
    """Load a safetensors folder into ``module`` shard by shard, replacing its tensors.

    ``module`` may live on the meta device. Floating tensors are cast to ``dtype`` (default: the
    dtype of the tensor they replace) and moved to ``device`` (default: that tensor's device, or
    CPU for meta); when neither changes, the module keeps the memory-mapped tensor itself. Each
    shard goes through ``module.load_state_dict(..., strict=False, assign=True)``, so the
    module's own load hooks run. Names tied to one tensor in ``module`` (e.g. ``lm_head.weight``
    and ``model.embed_tokens.weight``) need only one of them in the checkpoint and are re-tied
    after loading; if the checkpoint holds several with different values, that is an error.

    ``rename`` maps each checkpoint name to the state-dict name it holds, or to None for a
    tensor that is not the model's (a multimodal checkpoint's vision tower), which is skipped.
    ``parts`` names tensors the checkpoint stores fused with others (see
    :func:`~tunesmith.models.fused_keys.fused_parts`): state-dict name -> (checkpoint name,
    first row, end row); such a tensor is read as those rows of the fused one.
    ``derive`` (optional) gets the folder's tensors (names as stored -> header) and returns the
    tensors to compute instead of reading (:class:`DerivedTensor`, e.g. a quantized weight
    from its data and scales: block-scaled FP8, MXFP4); each stands for its inputs under its
    own name (then renamed like any other) and is computed in its load dtype as its shard is
    loaded, reading only its inputs, so memory holds one such tensor's inputs at a time and
    nothing is written to disk.

    Every name and shape is checked from the file headers before any data is read.

    Example::

        >>> from tunesmith.models import build_model, qwen3
        >>> spec = qwen3.spec("qwen3_tiny")
        >>> write_safetensors_shards(build_model(spec).state_dict(), "ckpt")
        [PosixPath('ckpt/model.safetensors')]
        >>> model = build_model(spec, device="meta")
        >>> load_into_module(model, "ckpt/")
        >>> {p.device.type for p in model.parameters()}
        {'cpu'}
    """
    folder = Path(folder)
    stored = read_tensor_index(folder)
    reader = _Reader(stored, dict(derive(stored)) if derive is not None else {})
    infos = reader.infos(folder)
    if rename is not None:
        infos = _renamed(infos, rename)
    state = module.state_dict(keep_vars=True)
    tied = _tied_names(module, state)
    expected = {key: state[key] for key in tied}  # one name per tensor object
    float32 = _float32_names(module)

    # ---- validate names and shapes from headers only
    source: dict[str, str] = {}  # state-dict name -> checkpoint name its data is read from
    duplicates: dict[str, list[str]] = {}  # state-dict name -> tied copies also in the checkpoint
    rows: dict[str, tuple[int, int]] = {}  # state-dict name -> its rows of a fused tensor
    parts = parts or {}
    missing = []
    for key in expected:
        present = [n for n in [key, *tied[key]] if n in infos]
        if not present and key in parts and parts[key][0] in infos:
            name, start, stop = parts[key]
            source[key], duplicates[key], rows[key] = name, [], (start, stop)
            continue
        if not present:
            missing.append(key)
            continue
        source[key] = present[0]
        duplicates[key] = present[1:]
    if missing:
        files = sorted({info.file.name for info in infos.values()})
        raise CheckpointError(
            f"checkpoint {folder} is missing {len(missing)} tensor(s) the model needs: "
            f"{_names(missing)} (searched {', '.join(files)})"
        )
    known = {n for key in expected for n in [key, *tied[key]]} | set(source.values())
    _check_fused_rows(infos, source, rows)
    unexpected = {n: info for n, info in infos.items() if n not in known}
    if unexpected:
        listed = sorted(unexpected.items())
        details = "; ".join(f"'{n}' in {info.file.name}" for n, info in listed[:20])
        more = f"; ... ({len(listed) - 20} more)" if len(listed) > 20 else ""
        raise CheckpointError(
            f"checkpoint {folder} holds {len(listed)} tensor(s) the model does not have: "
            f"{details}{more}"
        )
    for key, tensor in expected.items():
        for name in [source[key], *duplicates[key]]:
            info = infos[name]
            shape = (
                info.shape if key not in rows else (rows[key][1] - rows[key][0], *info.shape[1:])
            )
            if shape != tuple(tensor.shape):
                raise CheckpointError(
                    f"{info.file}: tensor '{name}' has shape {list(info.shape)}, "
                    f"the model expects {list(tensor.shape)}"
                    + (
                        f" (as rows {rows[key][0]}:{rows[key][1]} for '{key}')"
                        if key in rows
                        else ""
                    )
                )
            if info.dtype not in _DTYPES:
                raise CheckpointError(
                    f"{info.file}: tensor '{name}' has unsupported dtype {info.dtype}"
                )
            if _DTYPES[info.dtype].is_floating_point != tensor.is_floating_point():
                raise CheckpointError(
                    f"{info.file}: tensor '{name}' has dtype {_DTYPES[info.dtype]}, "
                    f"the model expects {tensor.dtype}"
                )

    # ---- stream shard by shard
    by_file: dict[Path, list[str]] = {}
    for key, name in source.items():
        by_file.setdefault(infos[name].file, []).append(key)
    for path in sorted(by_file):
        with _open_shard(path) as f:
            shard, fused = {}, {}
            for key in by_file[path]:
                target = expected[key]
                dt = (dtype or target.dtype) if target.is_floating_point() else target.dtype
                if key in float32:  # kept in float32 whatever the load dtype
                    dt = torch.float32
                if key in rows:  # read once, cut into its parts
                    if source[key] not in fused:
                        fused[source[key]] = reader.read(f, path, _stored(infos, source[key]), dt)
                    tensor = fused[source[key]][rows[key][0] : rows[key][1]]
                else:
                    tensor = reader.read(f, path, _stored(infos, source[key]), dt)
                shard[key] = tensor.to(device=_target_device(target, device), dtype=dt)
            result = module.load_state_dict(shard, strict=False, assign=True)
            if result.unexpected_keys:
                raise CheckpointError(
                    f"{path}: the module rejected tensor(s) {_names(result.unexpected_keys)}"
                )
            del shard, fused

    # ---- re-tie, then check that tied copies stored in the checkpoint agree
    loaded = module.state_dict(keep_vars=True)
    for key, others in tied.items():
        for name in others:
            _set_tensor(module, name, loaded[key])
        for name in duplicates[key]:
            info = infos[name]
            with _open_shard(info.file) as f:
                copy = reader.read(f, info.file, _stored(infos, name), loaded[key].dtype).to(
                    loaded[key].device, loaded[key].dtype
                )
            if not torch.equal(copy, loaded[key]):
                raise CheckpointError(
                    f"{info.file}: '{name}' differs from '{source[key]}' "
                    f"({infos[source[key]].file.name}) but the model ties them; set "
                    f"tie_word_embeddings=false in config.json if the checkpoint is really untied"
                )


def _float32_names(module: nn.Module) -> set[str]:
    """State-dict names of the tensors ``module``'s submodules keep in float32 whatever the
    model's dtype (their ``float32_buffers``, e.g. DeepSeek's ``e_score_correction_bias``)."""
    return {
        f"{name}.{buffer}" if name else buffer
        for name, sub in module.named_modules()
        for buffer in getattr(sub, "float32_buffers", ())
    }


def _renamed(
    infos: Mapping[str, TensorInfo], rename: Callable[[str], str | None]
) -> dict[str, TensorInfo]:
    """``infos`` under the names ``rename`` gives (None: left out), each remembering its own."""
    out: dict[str, TensorInfo] = {}
    for name, info in infos.items():
        new = rename(name)
        if new is None:
            continue
        if new in out:
            raise CheckpointError(
                f"{info.file}: tensors '{out[new].stored_name}' and '{name}' both hold '{new}'"
            )
        out[new] = dataclasses.replace(info, stored_name=name)
    return out


@dataclass(frozen=True)
class _Reader:
    """Reads a checkpoint tensor by its stored name: from its file, or computed from its
    inputs when ``derived`` (see :class:`DerivedTensor`) holds it."""

    stored: Mapping[str, TensorInfo]
    derived: Mapping[str, DerivedTensor]

    def infos(self, folder: Path) -> dict[str, TensorInfo]:
        """The tensors to load: the stored ones with each derived tensor in place of its inputs
        (listed in its first input's file; "F32": computed as floats)."""
        infos = dict(self.stored)
        used: dict[str, str] = {}  # input -> the derived tensor it is read for
        for name, tensor in self.derived.items():
            for source in tensor.inputs:
                if source not in self.stored:
                    raise CheckpointError(
                        f"checkpoint {folder}: '{name}' is computed from '{source}', "
                        "which no file holds"
                    )
                if source in used:
                    raise CheckpointError(
                        f"{self.stored[source].file}: tensor '{source}' is read for both "
                        f"'{used[source]}' and '{name}'"
                    )
                used[source] = name
                infos.pop(source)
        for name, tensor in self.derived.items():
            if name in infos:
                raise CheckpointError(
                    f"{infos[name].file}: tensor '{name}' is stored and also computed from "
                    f"{list(tensor.inputs)}"
                )
            infos[name] = TensorInfo(self.stored[tensor.inputs[0]].file, tensor.shape, "F32")
        return infos

    def read(self, handle, path: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` (read from ``handle``, the open ``path``, or computed in ``dtype``)."""
        if name not in self.derived:
            return _read(handle, path, name)
        tensor = self.derived[name]
        inputs = [self._input(handle, path, source) for source in tensor.inputs]
        return tensor.compute(*inputs, dtype=dtype)

    def _input(self, handle, path: Path, name: str) -> torch.Tensor:
        file = self.stored[name].file
        if file == path:
            return _read(handle, path, name)
        with _open_shard(file) as f:  # e.g. scales in another shard than their blocks
            return _read(f, file, name)


def _stored(infos: Mapping[str, TensorInfo], name: str) -> str:
    return infos[name].stored_name or name


def _check_fused_rows(
    infos: Mapping[str, Any], source: Mapping[str, str], rows: Mapping[str, tuple[int, int]]
) -> None:
    """A fused checkpoint tensor must have exactly the rows of the parts read from it."""
    needed: dict[str, int] = {}
    for key, (_, stop) in rows.items():
        needed[source[key]] = max(needed.get(source[key], 0), stop)
    for name, count in needed.items():
        info = infos[name]
        if info.shape[0] != count:
            parts = [key for key in rows if source[key] == name]
            raise CheckpointError(
                f"{info.file}: fused tensor '{name}' has {info.shape[0]} rows, the model's "
                f"{_names(parts)} take {count}"
            )


def _target_device(tensor: torch.Tensor, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cpu") if tensor.device.type == "meta" else tensor.device


def _read(handle, path: Path, name: str) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read tensor '{name}': {e}") from e


def assert_no_meta(module: nn.Module, where: str = "") -> None:
    """Raise if any parameter or buffer of ``module`` is still on the meta device."""
    left = [n for n, t in module.named_parameters(remove_duplicate=False) if t.is_meta]
    left += [n for n, t in module.named_buffers(remove_duplicate=False) if t.is_meta]
    if left:
        suffix = f" after loading {where}" if where else ""
        raise CheckpointError(f"tensor(s) still on the meta device{suffix}: {_names(left)}")


# ----------------------------------------------------------------------------- writing


def shard_file_names(num_shards: int) -> list[str]:
    """HF shard names: ``["model.safetensors"]`` or ``model-00001-of-0000N.safetensors`` ...

    >>> shard_file_names(2)
    ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    if num_shards == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{i:05d}-of-{num_shards:05d}.safetensors" for i in range(1, num_shards + 1)]


def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group names (in order) into shards of at most ``max_shard_bytes``; bigger tensors alone.

    >>> plan_shards({"a": 6, "b": 6, "c": 20, "d": 1}, 10)
    [['a'], ['b'], ['c'], ['d']]
    >>> plan_shards({"a": 4, "b": 4, "c": 4}, 10)
    [['a', 'b'], ['c']]
    """
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes.items():
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current or not shards:
        shards.append(current)
    return shards


def _check_plain(name: str, tensor: torch.Tensor) -> None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        DTensor = ()  # noqa: N806
    if isinstance(tensor, DTensor):
        raise CheckpointError(
            f"tensor '{name}' is a DTensor: gather a full state dict first (e.g. "
            f"torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            f"options=StateDictOptions(full_state_dict=True, cpu_offload=True)))"
        )
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"'{name}' is a {type(tensor).__name__}, not a tensor")
    if tensor.is_meta:
        raise CheckpointError(f"tensor '{name}' is on the meta device and has no data to save")


def _write_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    save_file(tensors, str(path), metadata=metadata)


def write_safetensors_shards(
    state_dict: Mapping[str, torch.Tensor],
    folder: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``state_dict`` into ``folder`` as HF safetensors; an index when it needs >1 shard.

    Floating tensors are cast to ``dtype`` when given. Only one shard at a time is prepared in
    memory (cast, moved to CPU, made contiguous). Takes a plain, full state dict: gather
    FSDP/DTensor parameters before calling. Not atomic on its own: write into the directory
    yielded by :func:`atomic_directory`. Returns the paths written (shards, then index).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, tensor in state_dict.items():
        _check_plain(name, tensor)
    if not state_dict:
        raise CheckpointError(f"nothing to save into {folder}: the state dict is empty")

    def out_dtype(t: torch.Tensor) -> torch.dtype:
        return dtype if (dtype is not None and t.is_floating_point()) else t.dtype

    sizes = {n: t.numel() * out_dtype(t).itemsize for n, t in state_dict.items()}
    plan = plan_shards(sizes, parse_size(max_shard_size))
    file_names = shard_file_names(len(plan))
    meta = {"format": "pt", **(dict(metadata) if metadata else {})}
    written = []
    weight_map = {}
    for names, file_name in zip(plan, file_names):
        seen_storages: set[int] = set()
        shard = {}
        for name in names:
            tensor = state_dict[name].detach().to(device="cpu", dtype=out_dtype(state_dict[name]))
            storage = tensor.untyped_storage()
            whole = tensor.data_ptr() == storage.data_ptr() and tensor.nbytes == storage.nbytes()
            if not whole or not tensor.is_contiguous() or storage.data_ptr() in seen_storages:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            seen_storages.add(tensor.untyped_storage().data_ptr())
            shard[name] = tensor
            weight_map[name] = file_name
        path = folder / file_name
        _write_shard(shard, path, meta)
        written.append(path)
        del shard
    if len(plan) > 1:
        index = {
            "metadata": {
                "total_size": sum(sizes.values()),
                "total_parameters": sum(t.numel() for t in state_dict.values()),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        index_path = folder / SAFE_INDEX_NAME
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        written.append(index_path)
    return written


# ----------------------------------------------------------------------------- atomic folders


def _sibling(path: Path, kind: str) -> Path:
    """An unused hidden name next to ``path``: ``.{name}.{kind}-{random}``."""
    while True:
        candidate = path.parent / f".{path.name}.{kind}-{secrets.token_hex(4)}"
        if not candidate.exists():
            return candidate


@contextlib.contextmanager
def atomic_directory(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``out_dir`` only if the block succeeds.

    On success every file is fsynced, then the directory is swapped in (Linux: one atomic
    ``renameat2`` exchange; elsewhere: rename the old one away, rename the new one in, delete
    the old one; see :func:`tunesmith.models.atomic.replace_directory`). On error the temporary
    directory is deleted and ``out_dir`` is untouched.

    Example::

        >>> with atomic_directory("ckpt/step_100") as tmp:
        ...     _ = (tmp / "notes.txt").write_text("hello")
        >>> Path("ckpt/step_100/notes.txt").read_text()
        'hello'
        >>> with atomic_directory("ckpt/step_100") as tmp:
        ...     _ = (tmp / "notes.txt").write_text("half")
        ...     raise OSError("disk full")
        Traceback (most recent call last):
        OSError: disk full
        >>> Path("ckpt/step_100/notes.txt").read_text(), list(Path("ckpt").iterdir())
        ('hello', [PosixPath('ckpt/step_100')])
    """
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out_dir, "tmp")
    tmp.mkdir()  # unlike mkdtemp, honours the umask (the folder is meant to be shared)
    try:
        yield tmp
        if out_dir.exists() and (not out_dir.is_dir() or out_dir.is_symlink()):
            raise CheckpointError(
                f"{out_dir} exists and is not a directory; refusing to replace it"
            )
        fsync_tree(tmp)
        fsync_path(tmp, directory=True)
        replace_directory(tmp, out_dir, aside=_sibling(out_dir, "old"))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
