"""Hugging Face folders in and out: ``from_hf`` builds and loads, ``save_hf_checkpoint`` writes.

A HF folder is ``config.json`` + safetensors weights (+ tokenizer files, ``generation_config``).
Our parameter names are the HF names, so no key map is involved; the work here is reading
``config.json`` into a :class:`~tunesmith.models.spec.ModelSpec`, streaming weights shard by
shard into a meta-built model, and writing a folder transformers/vLLM load as is.

Example::

    >>> from tunesmith.models import qwen3
    >>> save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")  # a HF folder
    PosixPath('Qwen3-tiny')
    >>> model = from_hf("Qwen3-tiny", dtype=torch.bfloat16)  # e.g. "Qwen3-0.6B"
    >>> save_hf_checkpoint(model, "out/qwen3-sft", source_dir="Qwen3-tiny")
    PosixPath('out/qwen3-sft')
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any

import torch
from torch import nn

from tunesmith.config.registry import component
from tunesmith.config.typecheck import Check
from tunesmith.models.atomic import UnsafePathError, open_no_follow, real_folder, refuse_unsafe
from tunesmith.models.builder import build_model
from tunesmith.models.family import language_model_config
from tunesmith.models.fused_keys import fuse_state, fused_parts
from tunesmith.models.load_filters import LoadFilters, load_filters
from tunesmith.models.manifest import has_manifest, manifest_problem
from tunesmith.models.safetensors_io import (
    CheckpointError,
    CheckpointFileNotFoundError,
    assert_no_meta,
    atomic_directory,
    find_weight_files,
    load_into_module,
    read_json_object,
    write_safetensors_shards,
)
from tunesmith.models.spec import ModelSpec, UnsupportedModelError, spec_from_hf_config
from tunesmith.models.transformers_backend import (
    Backend,
    TransformersLM,
    TransformersSpec,
    choose_backend,
    transformers_from_hf,
)
from tunesmith.modules.decoder import TransformerLM
from tunesmith.modules.dtypes import dtype_from_name

logger = logging.getLogger(__name__)

__all__ = [
    "CONFIG_NAME",
    "GENERATION_CONFIG_NAME",
    "SCORE_WEIGHT",
    "TOKENIZER_FILES",
    "check_model_files",
    "copy_model_files",
    "CheckpointError",
    "DTypeSetting",
    "HFFolder",
    "from_hf",
    "hf_folder_problem",
    "hf_folder_spec",
    "load_hf_weights",
    "read_hf_config",
    "resolve_dtype",
    "save_hf_checkpoint",
    "score_num_labels",
    "spec_from_hf_folder",
    "verify_own_checkpoint",
    "write_hf_checkpoint",
]

CONFIG_NAME = "config.json"
# The head of a *ForSequenceClassification checkpoint (reward models), in place of lm_head.
SCORE_WEIGHT = "score.weight"
GENERATION_CONFIG_NAME = "generation_config.json"
# Files (and one folder) a tokenizer may consist of; copied as they are when present.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)


def hf_folder_problem(folder: str | os.PathLike) -> str | None:
    """Why ``folder`` is not a Hugging Face model folder (None: it has a ``config.json``).

    >>> hf_folder_problem("nowhere")
    'nowhere: no such model folder (a Hugging Face folder with a config.json)'
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder}: no such model folder (a Hugging Face folder with a config.json)"
    if not (folder / CONFIG_NAME).is_file():
        return f"{folder / CONFIG_NAME} not found: {folder} is not a HF model folder"
    return None


HFFolder = Annotated[str | os.PathLike, Check(hf_folder_problem, on_disk=True)]
"""A HF model folder argument: checked by :func:`hf_folder_problem` in ``tunesmith validate``
and every run before anything is built, and by :func:`read_hf_config` when it is read."""


def resolve_dtype(
    dtype: torch.dtype | str | None, default: torch.dtype = torch.float32
) -> torch.dtype:
    """A floating dtype from a ``torch.dtype`` or a name (``"bf16"``, ``"torch.bfloat16"`` ...).

    >>> resolve_dtype("bf16"), resolve_dtype(None)
    (torch.bfloat16, torch.float32)
    """
    if dtype is None or dtype == "auto":
        return default
    resolved = dtype_from_name(dtype)
    if not resolved.is_floating_point:
        raise ValueError(f"dtype must be floating point, got {resolved}")
    return resolved


DTypeSetting = Annotated[str, Check.raises(resolve_dtype)]
"""A dtype given by name (``bf16``, ``float32``, ``auto``...): checked by :func:`resolve_dtype`
in ``tunesmith validate`` and every run before anything is built."""


def read_hf_config(folder: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of ``folder``; errors name the file."""
    if (problem := hf_folder_problem(folder)) is not None:
        raise CheckpointFileNotFoundError(problem)
    return read_json_object(Path(folder) / CONFIG_NAME, "a HF model folder")


def spec_from_hf_folder(folder: str | os.PathLike) -> ModelSpec:
    """:func:`spec_from_hf_config` on ``folder/config.json``, errors naming the folder."""
    return _spec_from_config(read_hf_config(folder), folder)


def _spec_from_config(config: dict[str, Any], folder: str | os.PathLike) -> ModelSpec:
    try:
        return spec_from_hf_config(language_model_config(config)[0])
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{Path(folder) / CONFIG_NAME}: {e}") from e
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{Path(folder) / CONFIG_NAME}: {e}") from e


def _config_dtype(config: Mapping[str, Any], folder: str | os.PathLike) -> torch.dtype:
    value = config.get("dtype") or config.get("torch_dtype")
    try:
        return resolve_dtype(value)
    except ValueError as e:
        raise CheckpointError(f"{Path(folder) / CONFIG_NAME}: dtype {value!r}: {e}") from e


def hf_folder_spec(
    path: str | os.PathLike, dtype: torch.dtype | str | None = None
) -> tuple[ModelSpec, torch.dtype]:
    """The spec of HF folder ``path`` and the dtype to load it in: ``dtype``, else the
    config's ``dtype``/``torch_dtype``, else float32. Errors name ``config.json``.

    Example::

        >>> from tunesmith.models import qwen3
        >>> model = build_model(qwen3.spec("qwen3_tiny"))
        >>> _ = save_hf_checkpoint(model, "Qwen3-tiny", dtype="bf16")
        >>> spec, dtype = hf_folder_spec("Qwen3-tiny")
        >>> spec.num_hidden_layers, dtype
        (2, torch.bfloat16)
    """
    folder = Path(path)
    config = read_hf_config(folder)
    spec = _spec_from_config(config, folder)
    return spec, resolve_dtype(dtype, default=_config_dtype(config, folder))


def load_hf_weights(
    model: nn.Module,
    folder: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    verify: bool = True,
) -> nn.Module:
    """Stream the safetensors weights of ``folder`` into ``model`` (meta-built or real).

    Tensors are cast to ``dtype`` (default: each parameter's current dtype) and placed on
    ``device`` (default: each parameter's device, CPU for meta). Afterwards tied weights are
    re-tied, RoPE buffers are recomputed on the weights' device (``init_buffers``), and nothing
    may be left on the meta device. Returns ``model``. With ``verify``, a folder holding our
    ``COMPLETE`` manifest (one of our checkpoints) has its config and weight files checked
    against it first (0.12-0.35 s per GB): a :class:`CheckpointError` names a file that
    changed since it was written.

    Example::

        >>> from tunesmith.models import qwen3
        >>> spec = qwen3.spec("qwen3_tiny")
        >>> _ = save_hf_checkpoint(build_model(spec), "Qwen3-tiny")
        >>> model = build_model(spec, device="meta")
        >>> _ = load_hf_weights(model, "Qwen3-tiny", dtype=torch.bfloat16, device="cpu")
        >>> next(model.parameters()).dtype, next(model.parameters()).device
        (torch.bfloat16, device(type='cpu'))
    """
    resolved = None if dtype is None else resolve_dtype(dtype)
    if verify:
        verify_own_checkpoint(folder)
    rename = _language_model_names(folder)
    filters = _load_filters(folder)
    load_into_module(
        model,
        folder,
        device=device,
        dtype=resolved,
        parts=_fused_parts(model),
        rename=_with_family_renames(model, _then(filters, rename)),
        derive=None if filters is None else filters.derive,  # FP8, MXFP4: dequantized
    )
    if rename is not None:
        rename.report(folder)
    if filters is not None:
        filters.report(folder)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    assert_no_meta(model, str(folder))
    return model


# Where transformers keeps a multimodal model's language model: 5.x, then 4.x.
_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


class _LanguageModelNames:
    """Checkpoint name -> our name for a multimodal folder's language model (see
    :func:`~tunesmith.models.family.language_model_config`), None for the other towers'
    tensors, which it counts by their first name part for :meth:`report`."""

    def __init__(self, note: str) -> None:
        self.note = note
        self.left_out: dict[str, int] = {}

    def __call__(self, name: str) -> str | None:
        for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        tower = name.split(".")[0]
        self.left_out[tower] = self.left_out.get(tower, 0) + 1
        return None

    def report(self, folder: str | os.PathLike) -> None:
        towers = ", ".join(f"{t} ({n} tensors)" for t, n in sorted(self.left_out.items()))
        logger.warning("%s: %s: %s not loaded", folder, self.note, towers or "nothing")


def _language_model_names(folder: str | os.PathLike) -> _LanguageModelNames | None:
    """The renaming of a multimodal folder's tensors, None for any other folder."""
    if not (Path(folder) / CONFIG_NAME).is_file():
        return None
    note = language_model_config(read_hf_config(folder))[1]
    return None if note is None else _LanguageModelNames(note)


def _with_family_renames(
    model: nn.Module, rename: Callable[[str], str | None] | None
) -> Callable[[str], str | None] | None:
    """``rename`` followed by the names ``model``'s family spells differently on disk
    (``spec.checkpoint_renames``, e.g. Mixtral's ``block_sparse_moe``)."""
    renames = getattr(getattr(model, "spec", None), "checkpoint_renames", None)
    if not renames:
        return rename
    if rename is None:
        return renames.from_disk
    first = rename

    def both(name: str) -> str | None:
        ours = first(name)
        return None if ours is None else renames.from_disk(ours)

    return both


def _load_filters(folder: str | os.PathLike) -> LoadFilters | None:
    """What the folder's config asks a loader to skip or convert (MTP layers, FP8, MXFP4), or
    None."""
    if not (Path(folder) / CONFIG_NAME).is_file():
        return None
    return load_filters(language_model_config(read_hf_config(folder))[0])


def _then(
    filters: LoadFilters | None, rename: Callable[[str], str | None] | None
) -> Callable[[str], str | None] | None:
    """``filters.rename`` (on the names as stored), then ``rename``."""
    if filters is None:
        return rename
    if rename is None:
        return filters.rename

    def both(name: str) -> str | None:
        kept = filters.rename(name)
        return None if kept is None else rename(kept)

    return both


def _fused_parts(model: nn.Module) -> dict[str, tuple[str, int, int]]:
    """Where each of ``model``'s parts of a fused projection is read from (its spec's family
    stores them fused); empty for other models."""
    fused = getattr(getattr(model, "spec", None), "fused_projections", None)
    return fused_parts(model.state_dict(keep_vars=True), fused) if fused else {}


def verify_own_checkpoint(folder: str | os.PathLike) -> None:
    """If ``folder`` is one of our checkpoints (it holds a ``COMPLETE`` manifest), check that
    its ``config.json`` and weight files still match the manifest; a :class:`CheckpointError`
    names the first file that does not. Other HF folders pass unchecked.

    Example::

        >>> from tunesmith.models import qwen3
        >>> from tunesmith.training.checkpoint.directory import CheckpointDirectory
        >>> model = build_model(qwen3.spec("qwen3_tiny"))
        >>> step = CheckpointDirectory("out/checkpoints").write(
        ...     100, lambda tmp: save_hf_checkpoint(model, tmp))
        >>> verify_own_checkpoint(step)  # as written: passes
        >>> _ = (step / "config.json").write_text("{}")
        >>> verify_own_checkpoint(step)
        Traceback (most recent call last):
        tunesmith.models.safetensors_io.CheckpointError: out/.../config.json: 2 bytes, the ...
    """
    folder = Path(folder)
    if not has_manifest(folder):
        return
    files, index = find_weight_files(folder)
    names = [CONFIG_NAME, *(f.name for f in files), *([index.name] if index else [])]
    problem = manifest_problem(folder, only=names)
    if problem is not None:
        raise CheckpointError(problem)


@component
def from_hf(
    path: HFFolder,
    *,
    dtype: torch.dtype | DTypeSetting | None = None,
    device: torch.device | str = "cpu",
    load_weights: bool = True,
    verify: bool = True,
    backend: Backend = "auto",
) -> TransformerLM | TransformersLM:
    """Build the model of a HF folder from its ``config.json`` and load its weights.

    ``backend`` (:func:`~tunesmith.models.transformers_backend.choose_backend`): ``auto``
    builds a native family's model where one exists and otherwise transformers' own
    (:class:`~tunesmith.models.transformers_backend.TransformersLM`, never remote code);
    ``native`` or ``transformers`` insist on one. The transformers backend logs once that
    it runs and what it cannot do.

    ``dtype`` defaults to the config's ``dtype``/``torch_dtype``, else float32. The model is
    built on the meta device and each tensor is assigned once (memory-mapped, cast, moved),
    so loading never holds a second copy of the model. With ``load_weights=False`` the model
    is randomly initialised instead (same architecture, no weights read). One of our own
    checkpoints (a folder with a ``COMPLETE`` manifest) is verified against its manifest
    first unless ``verify=False`` (see :func:`verify_own_checkpoint`).

    Example::

        >>> from tunesmith.models import qwen3
        >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")
        >>> model = from_hf("Qwen3-tiny", dtype="bf16", device="cpu")  # or device="cuda"
        >>> type(model).__name__, next(model.parameters()).dtype
        ('TransformerLM', torch.bfloat16)
    """
    folder = Path(path)
    config = read_hf_config(folder)
    choice = choose_backend(
        language_model_config(config)[0], backend, where=f"{folder / CONFIG_NAME}: "
    )
    resolved = resolve_dtype(dtype, default=_config_dtype(config, folder))
    if choice.backend == "transformers":
        logger.warning("%s: %s", folder, choice)
        if load_weights and verify:
            verify_own_checkpoint(folder)
        return transformers_from_hf(
            folder, dtype=resolved, device=device, load_weights=load_weights
        )
    spec = _spec_from_config(config, folder)
    if not load_weights:
        _check_fits(spec, resolved, device, folder)
        return build_model(spec, device=device, dtype=resolved)
    find_weight_files(folder)  # fail on a folder without weights before building anything
    model = build_model(spec, device="meta", dtype=resolved)
    load_hf_weights(model, folder, dtype=resolved, device=device, verify=verify)
    return model


def _device_memory(device: torch.device | str) -> int | None:
    """Bytes of memory of ``device`` (the machine's RAM for the CPU), None when unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def _check_fits(
    spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, folder: Path
) -> None:
    """Refuse to build a model whose weights alone are larger than ``device``'s memory."""
    memory = _device_memory(device)
    size = spec.approx_parameters() * dtype.itemsize
    if memory is not None and size > memory:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: the model has about {spec.approx_parameters():.3g} "
            f"parameters ({size / 2**30:.1f} GiB in {dtype}), more than the "
            f"{memory / 2**30:.1f} GiB of memory of {device}"
        )


# ----------------------------------------------------------------------------- saving


def score_num_labels(state: Mapping[str, Any]) -> int | None:
    """Outputs of the ``score`` head when ``state`` (tensors or file headers with a
    ``.shape``) is a sequence-classification (reward) model's, else None (a causal LM)."""
    score = state.get(SCORE_WEIGHT)
    return None if score is None else int(score.shape[0])


def _reference_state(
    spec: ModelSpec | TransformersSpec, num_labels: int | None
) -> dict[str, torch.Tensor]:
    """Meta tensors named and shaped as the HF checkpoint of ``spec`` holds them: the causal
    LM's, or with ``num_labels`` the ``*ForSequenceClassification``'s (``score``, no head)."""
    if isinstance(spec, TransformersSpec):
        spec.to_hf_config(num_labels)  # refuses a classifier
        return spec.reference_state()
    reference = build_model(spec, device="meta").state_dict()
    if num_labels is not None:
        reference.pop("lm_head.weight", None)
        reference[SCORE_WEIGHT] = torch.empty(num_labels, spec.hidden_size, device="meta")
    return reference


def _model_and_state(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], spec: ModelSpec | None
) -> tuple[dict[str, torch.Tensor], ModelSpec, int | None]:
    if isinstance(model_or_state_dict, nn.Module):
        state = model_or_state_dict.state_dict()
        spec = spec if spec is not None else getattr(model_or_state_dict, "spec", None)
    else:
        state = dict(model_or_state_dict)
    if not isinstance(spec, (ModelSpec, TransformersSpec)):
        raise TypeError("save_hf_checkpoint needs spec=ModelSpec(...) to write config.json")
    if isinstance(spec, TransformersSpec):
        state = spec.checkpoint_layout(state)
    num_labels = score_num_labels(state)
    if spec.tie_word_embeddings and num_labels is None:
        state.pop("lm_head.weight", None)  # transformers stores tied heads once
    reference = _reference_state(spec, num_labels)
    missing = sorted(set(reference) - set(state))
    unexpected = sorted(set(state) - set(reference))
    if missing or unexpected:
        raise CheckpointError(
            f"state dict does not match the {spec.model_type} spec: "
            f"missing {missing[:20]}, unexpected {unexpected[:20]} "
            f"(merge adapters and gather a full, plain state dict before saving)"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(reference[name].shape):
            raise CheckpointError(
                f"tensor '{name}' has shape {list(tensor.shape)}, the spec expects "
                f"{list(reference[name].shape)}"
            )
    return {name: state[name] for name in reference}, spec, num_labels


def _dominant_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for tensor in state.values():
        if tensor.is_floating_point():
            counts[tensor.dtype] = counts.get(tensor.dtype, 0) + tensor.numel()
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def _generation_config(spec: ModelSpec) -> dict[str, Any]:
    config: dict[str, Any] = {"_from_model_config": True}
    eos = spec.eos_token_id
    tokens = {
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "pad_token_id": spec.pad_token_id,
    }
    config.update({k: v for k, v in tokens.items() if v is not None})
    return config


def _copy_tokenizer_files(source_dir: Path, folder: Path) -> list[Path]:
    return copy_model_files(source_dir, folder, TOKENIZER_FILES)


def _hub_blob(source: Path, target: Path) -> bool:
    """Whether ``target`` is a blob of the Hugging Face cache repo whose snapshot ``source`` is
    (``models--org--name/snapshots/<rev>/vocab.json -> ../../blobs/<hash>``: the hub's layout)."""
    snapshots = source.parent
    repo = snapshots.parent
    return (
        snapshots.name == "snapshots"
        and repo.name.startswith(("models--", "datasets--"))
        and target.parent == repo / "blobs"
    )


def model_file_source(root: Path, path: Path) -> Path:
    """The real file or folder to copy for ``path`` of the model folder ``root`` (both
    resolved by the caller for ``root``): ``path`` itself, or where a symbolic link at
    ``path`` points when that stays inside ``root`` (or is a blob of the Hugging Face cache
    repo ``root`` is a snapshot of). A link that leaves the folder, and anything that is not a
    regular file or a folder (a FIFO, a device), is refused with one line naming it.

    Example::

        >>> root = Path("Qwen3").resolve()
        >>> root.mkdir(); _ = Path("elsewhere.txt").write_text("not the model's")
        >>> (root / "vocab.txt").symlink_to(Path("elsewhere.txt").resolve())
        >>> model_file_source(root, root / "vocab.txt")
        Traceback (most recent call last):
        tunesmith.models.atomic.UnsafePathError: ... symbolic link to ..., outside the model folder ...
    """
    target = path
    if path.is_symlink():
        target = path.resolve()
        if not (target.is_relative_to(root) or _hub_blob(root, target)):
            raise UnsafePathError(
                f"{path}: is a symbolic link to {os.readlink(path)}, outside the model folder "
                f"{root}: refused (copy the file into the folder instead)"
            )
    st = os.stat(target)
    if not stat.S_ISDIR(st.st_mode):
        refuse_unsafe(path, st)
    return target


def _copy_model_file(src: Path, dst: Path) -> None:
    """Copy the regular file ``src`` to ``dst`` (never through a link at either end)."""
    with open_no_follow(src, "rb") as f, open_no_follow(dst, "wb") as out:
        shutil.copyfileobj(f, out, 1 << 20)


def _copy_model_tree(root: Path, src: Path, dst: Path) -> None:
    """Copy the folder ``src`` (inside ``root``) to ``dst``: its regular files, each link
    checked as :func:`model_file_source` does (a link to a folder is refused)."""
    real_folder(dst)
    for entry in sorted(src.iterdir()):
        target = model_file_source(root, entry)
        if target.is_dir():
            if entry.is_symlink():
                raise UnsafePathError(f"{entry}: is a symbolic link to a folder: refused")
            _copy_model_tree(root, target, dst / entry.name)
        else:
            _copy_model_file(target, dst / entry.name)


def _model_sources(
    source_dir: str | os.PathLike, names: Iterable[str]
) -> Iterator[tuple[str, Path]]:
    """(name, what to read) for each of ``names`` the model folder has; a top-level link to a
    folder, or a link leaving the folder (:func:`model_file_source`), is refused."""
    root = Path(source_dir).resolve()
    for name in names:
        path = root / name
        if not os.path.lexists(path):
            continue
        target = model_file_source(root, path)
        if target.is_dir() and path.is_symlink():
            raise UnsafePathError(
                f"{Path(source_dir) / name}: is a symbolic link to a "
                "folder: refused (copy the folder in instead)"
            )
        yield name, target


def check_model_files(
    source_dir: str | os.PathLike, names: Iterable[str] = (*TOKENIZER_FILES, GENERATION_CONFIG_NAME)
) -> None:
    """Refuse now (one line naming the link and its target) what :func:`copy_model_files`
    would refuse when the first checkpoint is written: a training run checks its model folder
    before it trains.

    Example::

        >>> Path("Qwen3").mkdir(); _ = Path("Qwen3/tokenizer.json").write_text("{}")
        >>> check_model_files("Qwen3")  # passes
        >>> Path("Qwen3/tokenizer").symlink_to(Path("Qwen3").resolve())
        >>> check_model_files("Qwen3", ["tokenizer"])
        Traceback (most recent call last):
        tunesmith.models.atomic.UnsafePathError: Qwen3/tokenizer: is a symbolic link to a folder...
    """
    root = Path(source_dir).resolve()
    for _, target in _model_sources(source_dir, names):
        if target.is_dir():
            for entry in target.rglob("*"):
                if model_file_source(root, entry).is_dir() and entry.is_symlink():
                    raise UnsafePathError(f"{entry}: is a symbolic link to a folder: refused")


def copy_model_files(source_dir: Path, folder: Path, names: Iterable[str]) -> list[Path]:
    """Copy the files (and folders) of ``names`` that the model folder ``source_dir`` has into
    ``folder``, and nothing else of it: a checkpoint holds only the known files of a model
    folder. A symbolic link is copied as the file it points to when that stays inside the
    folder (or is the Hugging Face cache's blob); one that leaves it is refused, naming the
    link and its target. Returns the paths written.

    Example::

        >>> Path("Qwen3").mkdir(); Path("ckpt").mkdir()
        >>> for name in ("tokenizer.json", "tokenizer_config.json", "notes.txt"):
        ...     _ = (Path("Qwen3") / name).write_text("{}")
        >>> copy_model_files(Path("Qwen3"), Path("ckpt"), TOKENIZER_FILES)
        [PosixPath('ckpt/tokenizer.json'), PosixPath('ckpt/tokenizer_config.json')]
    """
    root = Path(source_dir).resolve()  # the user's folder: a link to it is followed once
    copied = []
    for name, target in _model_sources(source_dir, names):
        if target.is_dir():
            shutil.rmtree(folder / name, ignore_errors=True)
            _copy_model_tree(root, target, folder / name)
        else:
            _copy_model_file(target, folder / name)
        copied.append(folder / name)
    return copied


def write_hf_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    folder: str | os.PathLike,
    *,
    spec: ModelSpec | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    source_dir: str | os.PathLike | None = None,
    generation_config: Mapping[str, Any] | None = None,
    pad_token_id: int | None = None,
) -> list[Path]:
    """Write a HF folder's files into ``folder`` (not atomic; see :func:`save_hf_checkpoint`).

    For callers that add more files (training state) inside one :func:`atomic_directory`.
    Returns the paths written.
    """
    folder = Path(folder)
    state, spec, num_labels = _model_and_state(model_or_state_dict, spec)
    if pad_token_id is not None:
        spec = spec.replace(pad_token_id=pad_token_id)
    if num_labels is not None and spec.pad_token_id is None:
        raise ValueError(
            f"saving a sequence-classification (reward) model to {folder} needs a pad token id: "
            "pass pad_token_id= or set spec.pad_token_id (transformers scores the last token "
            "that is not padding)"
        )
    out_dtype = resolve_dtype(dtype) if dtype is not None else _dominant_dtype(state)
    written = write_safetensors_shards(
        spec.checkpoint_renames.state_to_disk(fuse_state(state, spec.fused_projections)),
        folder,
        max_shard_size=max_shard_size,
        dtype=out_dtype,
    )

    config = spec.to_hf_config(num_labels=num_labels)
    dtype_name = str(out_dtype).removeprefix("torch.")
    config["dtype"] = dtype_name  # transformers >= 4.56
    config["torch_dtype"] = dtype_name  # older transformers, vLLM
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    written.append(folder / CONFIG_NAME)

    source = Path(source_dir) if source_dir is not None else None
    if source is not None and not source.is_dir():
        raise CheckpointFileNotFoundError(f"source_dir {source} does not exist")
    gen_path = folder / GENERATION_CONFIG_NAME
    if generation_config is not None:
        gen_path.write_text(json.dumps(dict(generation_config), indent=2) + "\n")
        written.append(gen_path)
    elif num_labels is None:  # a classifier does not generate; transformers writes none either
        if source is not None and os.path.lexists(source / GENERATION_CONFIG_NAME):
            copy_model_files(source, folder, [GENERATION_CONFIG_NAME])
        else:
            gen_path.write_text(json.dumps(_generation_config(spec), indent=2) + "\n")
        written.append(gen_path)
    if source is not None:
        written += _copy_tokenizer_files(source, folder)
    return written


def save_hf_checkpoint(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    spec: ModelSpec | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    source_dir: str | os.PathLike | None = None,
    generation_config: Mapping[str, Any] | None = None,
    pad_token_id: int | None = None,
) -> Path:
    """Atomically write a HF folder that transformers/vLLM load as is; returns ``out_dir``.

    Writes safetensors (sharded at ``max_shard_size`` with ``model.safetensors.index.json``
    when more than one shard), ``config.json`` (``spec.to_hf_config()`` plus the dtype),
    ``generation_config.json`` (``generation_config`` if given, else copied from
    ``source_dir``, else bos/eos from the spec) and the tokenizer files of ``source_dir``.
    A tied ``lm_head.weight`` is not stored, as transformers does. ``spec`` defaults to
    ``model.spec``; ``dtype`` to the weights' own; ``pad_token_id`` (written to config.json)
    to ``spec.pad_token_id``.

    A reward model (:class:`~tunesmith.models.reward.RewardModel`, or any state dict with a
    ``score.weight`` and no ``lm_head``) is written as the family's
    ``*ForSequenceClassification`` (``num_labels``/``id2label``/``label2id`` in config.json,
    no generation config unless ``generation_config`` is given). It needs a pad token id, from
    ``pad_token_id`` or the spec: transformers scores the last token that is not padding.

    Everything goes into a sibling temporary folder, is fsynced, then replaces ``out_dir``:
    a crash never leaves a half-written ``out_dir``, and ``source_dir == out_dir`` is allowed.

    Takes a module or a plain, full state dict: FSDP/DTensor shards must be gathered first.

    Example::

        >>> from tunesmith.models import qwen3
        >>> save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "out/final", dtype="bf16")
        PosixPath('out/final')
        >>> sorted(p.name for p in Path("out/final").iterdir())
        ['config.json', 'generation_config.json', 'model.safetensors']
    """
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_hf_checkpoint(
            model_or_state_dict,
            tmp,
            spec=spec,
            dtype=dtype,
            max_shard_size=max_shard_size,
            source_dir=source_dir,
            generation_config=generation_config,
            pad_token_id=pad_token_id,
        )
    return out_dir
