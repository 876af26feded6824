"""Which base model an adapter was trained on: recorded when it is written, found and checked
when it is loaded, from any working directory and after the adapter or the base moved.

A LoRA/DoRA adapter is half a model. When :func:`~tunesmith.models.peft_io.write_peft_adapter`
is given a local HF folder as the base (a run's ``model_dir``, however it was spelled), the
adapter folder records it twice:

* ``adapter_config.json``: ``base_model_name_or_path`` is the base's absolute path with links
  resolved, so ``peft.PeftModel.from_pretrained`` (and anything reading that field) finds it
  from any working directory of this machine;
* ``base_model.json`` (:data:`BASE_RECORD`): ``{"path": "/abs/models/Qwen3-0.6B", "given":
  "models/Qwen3-0.6B", "fingerprint": "v1:..."}``: the same path, the spelling given at
  training, and a fingerprint of the base's weights (:func:`weights_fingerprint`).

:func:`find_base` looks for the base of an adapter folder in this order and returns the first
model folder (one with ``config.json``) whose weights have the recorded fingerprint:

1. ``base_model_name_or_path`` of ``adapter_config.json`` (the user's edit wins), then the
   recorded absolute path;
2. each spelling (those two, the spelling given at training, and the caller's ``spellings``,
   e.g. the run's ``config.yaml`` ``model_dir``) relative to the working directory, the adapter
   folder, the folder holding it, and the caller's ``roots`` (e.g. the run folder);
3. a folder of the base's name in each folder of ``$TUNESMITH_MODEL_PATH`` (``os.pathsep``
   separated): where a moved or copied base is found.

A model folder there with other weights is passed over; when none fits, one line names what
was tried (and which had other weights). An explicit ``base_dir`` is used as given, with a
warning when its weights are not the recorded ones (a re-saved or converted copy of the base
is a legitimate choice). Adapters without a record (written by peft, or before records
existed) are found the same way, unchecked.

The fingerprint covers the weight files only (names, sizes, sampled bytes), not
``config.json``: cosmetic config edits (a ``torch_dtype``, a transformers version stamp) leave
the adapter valid, and an architecture change shows in the weights' sizes. A file of at most
2 MiB is hashed whole; a larger one in 32 blocks of 64 KiB spread evenly over it, the first of
which holds the safetensors header (every tensor's name, dtype, shape and offset). That reads
2 MiB per weight file whatever the model's size, so it costs milliseconds at every save and
load; it tells apart any two bases that differ in layout, in a randomly initialised or fully
fine-tuned tensor, or in a tensor the blocks touch. Two bases that differ only between the
sampled blocks (a merge that changed a few small tensors) are not told apart.

Example::

    >>> import json
    >>> from tunesmith.models import build_model, qwen3
    >>> from tunesmith.models.hf import save_hf_checkpoint
    >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")
    >>> record = BaseRecord.of("Qwen3-tiny")
    >>> record.given, Path(record.path).is_absolute(), record.fingerprint[:3]
    ('Qwen3-tiny', True, 'v1:')
    >>> Path("adapter").mkdir(); _ = record.write("adapter")
    >>> _ = Path("adapter/adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    >>> find_base("adapter") == Path(record.path)
    True
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tunesmith.models.hf import CONFIG_NAME
from tunesmith.models.safetensors_io import (
    CheckpointError,
    CheckpointFileNotFoundError,
    find_weight_files,
    read_json_object,
)

__all__ = [
    "BASE_RECORD",
    "MODEL_PATH_ENV",
    "BaseNotFoundError",
    "BaseRecord",
    "find_base",
    "weights_fingerprint",
]

logger = logging.getLogger(__name__)

BASE_RECORD = "base_model.json"
"""The file of an adapter folder that records its base model (:class:`BaseRecord`)."""
MODEL_PATH_ENV = "TUNESMITH_MODEL_PATH"
"""Folders (``os.pathsep`` separated) searched for a base model of the recorded name."""
_ADAPTER_CONFIG = "adapter_config.json"  # peft_io.ADAPTER_CONFIG_NAME (peft_io imports us)
_VERSION = "v1"
_BLOCKS, _BLOCK = 32, 64 << 10


class BaseNotFoundError(CheckpointFileNotFoundError):
    """No model folder with the recorded weights was found for an adapter."""


def _sample_offsets(size: int) -> list[int]:
    """Where the blocks hashed of a file of ``size`` bytes start: all of it when small."""
    if size <= _BLOCKS * _BLOCK:
        return list(range(0, size, _BLOCK))
    step = (size - _BLOCK) / (_BLOCKS - 1)
    return [round(i * step) for i in range(_BLOCKS)]


def weights_fingerprint(folder: str | os.PathLike[str]) -> str:
    """``"v1:<sha256>"`` of the names, sizes and sampled bytes of ``folder``'s safetensors
    weight files (see the module docs); equal for a copy of the folder, anywhere.

    Example::

        >>> from tunesmith.models import build_model, qwen3
        >>> from tunesmith.models.hf import save_hf_checkpoint
        >>> import shutil
        >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "a")
        >>> _ = shutil.copytree("a", "copy")
        >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "b")  # other init
        >>> weights_fingerprint("copy") == weights_fingerprint("a") != weights_fingerprint("b")
        True
    """
    files, _ = find_weight_files(folder)
    digest = hashlib.sha256()
    for path in files:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO put there never blocks
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            digest.update(f"{path.name}\0{st.st_size}\0".encode())
            for offset in _sample_offsets(st.st_size):
                digest.update(os.pread(fd, _BLOCK, offset))
        finally:
            os.close(fd)
    return f"{_VERSION}:{digest.hexdigest()}"


@dataclass(frozen=True)
class BaseRecord:
    """An adapter's base model: its absolute ``path`` (links resolved), the spelling ``given``
    at training, and its :func:`weights_fingerprint`."""

    path: str
    given: str
    fingerprint: str

    @classmethod
    def of(cls, base: str | os.PathLike[str]) -> BaseRecord:
        """The record of the model folder ``base`` as spelled (relative to the working
        directory, as a run's ``model_dir``)."""
        return cls(str(Path(base).resolve()), str(base), weights_fingerprint(base))

    def write(self, adapter_dir: str | os.PathLike[str]) -> Path:
        """Write :data:`BASE_RECORD` into ``adapter_dir``; returns its path."""
        path = Path(adapter_dir) / BASE_RECORD
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def read(cls, adapter_dir: str | os.PathLike[str]) -> BaseRecord | None:
        """The record of ``adapter_dir``; None when it has none (a peft adapter, an old one).
        A record that is not one is an error naming the file."""
        path = Path(adapter_dir) / BASE_RECORD
        if not path.is_file():
            return None
        data = read_json_object(path, "an adapter folder")
        bad = [k for k in ("path", "given", "fingerprint") if not isinstance(data.get(k), str)]
        if bad:
            raise CheckpointError(f"{path}: {', '.join(bad)} missing or not a string")
        return cls(data["path"], data["given"], data["fingerprint"])


def _named(adapter_dir: Path) -> str | None:
    """``base_model_name_or_path`` of the adapter's config (None when absent or not text)."""
    config = adapter_dir / _ADAPTER_CONFIG
    named = read_json_object(config, "a PEFT adapter").get("base_model_name_or_path")
    return named if isinstance(named, str) and named else None


def _search_folders() -> list[Path]:
    """The folders of ``$TUNESMITH_MODEL_PATH``, in order."""
    return [Path(p) for p in os.environ.get(MODEL_PATH_ENV, "").split(os.pathsep) if p]


def _candidates(adapter_dir: Path, spellings: Sequence[str], roots: Sequence[Path]) -> list[Path]:
    """Every folder :func:`find_base` tries, in order (see the module docs), each once."""
    found: list[Path] = []
    for spelling in spellings:
        path = Path(spelling)
        if path.is_absolute():
            found.append(path)
        else:
            found += [path, adapter_dir / path, adapter_dir.parent / path]
            found += [root / path for root in roots]
    names = dict.fromkeys(Path(s).name for s in spellings if Path(s).name)
    found += [folder / name for folder in _search_folders() for name in names]
    once: dict[Path, Path] = {}
    for path in found:  # one folder reached by two spellings: tried under the first
        once.setdefault(path.resolve(), path)
    return list(once.values())


def _fits(candidate: Path, record: BaseRecord | None) -> str | None:
    """Why the model folder ``candidate`` is not the recorded base, or None when it is."""
    if record is None:
        return None
    try:
        fingerprint = weights_fingerprint(candidate)
    except (CheckpointError, OSError) as err:
        return f"unreadable weights: {err}"
    return None if fingerprint == record.fingerprint else "other weights"


def find_base(
    adapter_dir: str | os.PathLike[str],
    base_dir: str | os.PathLike[str] | None = None,
    *,
    spellings: Sequence[str] = (),
    roots: Sequence[str | os.PathLike[str]] = (),
) -> Path:
    """The base model folder of the adapter folder ``adapter_dir`` (see the module docs for
    the order): ``base_dir`` when given; else the first candidate that is a model folder with
    the recorded weights. ``spellings`` are more names of the base to try (after the
    recorded ones), ``roots`` more folders a relative one is tried against.
    :class:`BaseNotFoundError` names every folder tried.

    Example::

        base = find_base("outputs/sft-tiny_lora/checkpoints/step_000008")
    """
    adapter_dir = Path(adapter_dir)
    record = BaseRecord.read(adapter_dir)
    if base_dir is not None:
        return _explicit(adapter_dir, Path(base_dir), record)
    named = _named(adapter_dir)
    recorded = [record.path, record.given] if record else []
    ordered = list(dict.fromkeys(s for s in (named, *recorded, *spellings) if s))
    tried: list[str] = []
    for candidate in _candidates(adapter_dir, ordered, [Path(r) for r in roots]):
        if not (candidate / CONFIG_NAME).is_file():
            tried.append(str(candidate))
        elif (why := _fits(candidate, record)) is None:
            return candidate
        else:
            tried.append(f"{candidate} ({why})")
    raise BaseNotFoundError(_not_found(adapter_dir, named, record, tried))


def _explicit(adapter_dir: Path, base_dir: Path, record: BaseRecord | None) -> Path:
    """``base_dir`` given by the user: a model folder, used even with other weights (warned)."""
    if not (base_dir / CONFIG_NAME).is_file():
        raise CheckpointFileNotFoundError(f"--base-dir {base_dir}: no {CONFIG_NAME} there")
    if (why := _fits(base_dir, record)) is not None:
        logger.warning(
            "--base-dir %s: %s, not those of the base recorded in %s (%s); using it as asked",
            base_dir,
            why,
            adapter_dir / BASE_RECORD,
            record.path if record else None,
        )
    return base_dir


def _not_found(
    adapter_dir: Path, named: str | None, record: BaseRecord | None, tried: list[str]
) -> str:
    """The one line of a base that is nowhere to be found."""
    what = repr(named if named else record.given if record else None)
    if record is not None and record.path != named:
        what += f" (trained on {record.path})"
    places = ", ".join(tried) if tried else "nothing (no base named)"
    return (
        f"{adapter_dir / _ADAPTER_CONFIG}: base model {what} not found (tried {places}); "
        f"give the base model's folder (`tunesmith ... --base-dir DIR`, or base_dir=DIR), or "
        f"put it in a folder listed in ${MODEL_PATH_ENV}"
    )
