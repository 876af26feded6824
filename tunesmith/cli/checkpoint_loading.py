"""One loader for every command that runs a trained model (``generate``, ``chat``, ``eval``).

:func:`load_checkpoint` takes any of the folders a user has after training:

* a HF model folder (a downloaded model, a full fine-tuning checkpoint ``step_N``, or a merged
  ``tunesmith export``);
* a PEFT LoRA/DoRA adapter folder (a LoRA run's ``step_N``, or a copy of it anywhere): its
  base model is loaded and the adapter put on top, no export needed. The base is
  ``base_dir`` when given, else the folder the adapter records, found and checked from any
  working directory (:func:`adapter_base`, :mod:`tunesmith.models.base_record`);
* a run folder (``output_dir`` of a run, holding ``checkpoints/``) or its ``checkpoints``
  folder: its newest complete checkpoint (:func:`resolve_checkpoint`; an unfinished write,
  a ``step_N`` without its ``COMPLETE`` manifest, is never chosen). :func:`chosen` says which
  one was.

The tokenizer is the checkpoint's own when it holds ``tokenizer.json``, else the base's.

Example::

    loaded = load_checkpoint("outputs/sft-tiny_lora")
    loaded.kind, loaded.path.name
    # -> ('adapter', 'step_000008')
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from omegaconf import OmegaConf
from torch import nn

from tunesmith.data import Tokenizer
from tunesmith.models.base_record import find_base
from tunesmith.models.hf import CONFIG_NAME, from_hf
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, load_peft_adapter, read_adapter_config
from tunesmith.models.safetensors_io import CheckpointFileNotFoundError
from tunesmith.training.checkpoint.directory import CheckpointDirectory

__all__ = [
    "CheckpointNotFoundError",
    "LoadedCheckpoint",
    "adapter_base",
    "chosen",
    "load_checkpoint",
    "resolve_checkpoint",
]

CHECKPOINTS_DIR = "checkpoints"
RUN_CONFIG = "config.yaml"


class CheckpointNotFoundError(FileNotFoundError):
    """A path that is no model, adapter or run folder, or an adapter whose base is not found."""


@dataclass
class LoadedCheckpoint:
    """A model ready for inference (eval mode, no grads) and its tokenizer.

    ``path`` is the folder that was loaded (a run folder's newest ``step_N``), ``kind`` is
    ``"model"`` or ``"adapter"``, ``base`` the base model folder of an adapter (else None).
    """

    model: nn.Module
    tokenizer: Tokenizer
    path: Path
    kind: Literal["model", "adapter"]
    base: Path | None = None


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The checkpoint folder ``path`` stands for: ``path`` itself when it holds a model
    (``config.json``) or an adapter (``adapter_config.json``); the newest complete checkpoint
    of a run folder (``path/checkpoints``) or of a ``checkpoints`` folder.

    Example::

        >>> from tunesmith.training.checkpoint.directory import CheckpointDirectory
        >>> def save(tmp): (tmp / "config.json").write_text("{}")
        >>> _ = CheckpointDirectory("outputs/sft-tiny/checkpoints").write(8, save)
        >>> resolve_checkpoint("outputs/sft-tiny")
        PosixPath('outputs/sft-tiny/checkpoints/step_000008')
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such folder")
    if (path / CONFIG_NAME).is_file() or (path / ADAPTER_CONFIG_NAME).is_file():
        return path
    root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    steps = CheckpointDirectory(root, clean_stale=False).latest(verify=False)
    if steps is not None:
        return steps
    if root is not path or CheckpointDirectory(root, clean_stale=False).step_dirs():
        raise CheckpointNotFoundError(
            f"{root}: holds no complete checkpoint (step_N with a COMPLETE manifest)"
        )
    raise CheckpointNotFoundError(
        f"{path}: neither a model folder ({CONFIG_NAME}), an adapter folder "
        f"({ADAPTER_CONFIG_NAME}) nor a run folder ({CHECKPOINTS_DIR}/step_N)"
    )


def chosen(given: str | os.PathLike[str], path: Path, base: Path | None = None) -> str:
    """One line saying which checkpoint ``given`` stood for (and the base of an adapter).

    Example::

        >>> chosen("out", Path("out/checkpoints/step_000008"), Path("/models/Qwen3-0.6B"))
        'checkpoint: out/checkpoints/step_000008 (the newest complete one of out); base model: /models/Qwen3-0.6B'
    """
    line = f"checkpoint: {path}"
    if Path(given) != path:
        line += f" (the newest complete one of {given})"
    return line + (f"; base model: {base}" if base is not None else "")


def _run_folder(checkpoint: Path) -> Path | None:
    """The run folder of ``run/checkpoints/step_N``, or None for a folder elsewhere."""
    if checkpoint.parent.name == CHECKPOINTS_DIR:
        return checkpoint.parent.parent
    return None


def adapter_base(
    adapter_dir: str | os.PathLike[str], base_dir: str | os.PathLike[str] | None = None
) -> Path:
    """The base model folder of an adapter: ``base_dir`` when given; else found by
    :func:`~tunesmith.models.base_record.find_base` (the adapter config's absolute path, the
    recorded path and spelling, tried from the working directory, the adapter folder and its
    run folder, then ``$TUNESMITH_MODEL_PATH``), with the run's ``config.yaml`` ``model_dir``
    as one more spelling; a folder whose weights are not the recorded base's is passed over.
    An error lists what was tried.

    Example::

        >>> import json
        >>> Path("Qwen3-0.6B").mkdir(); _ = Path("Qwen3-0.6B/config.json").write_text("{}")
        >>> adapter = {"peft_type": "LORA", "r": 8, "lora_alpha": 16,
        ...            "base_model_name_or_path": "Qwen3-0.6B"}
        >>> Path("adapter").mkdir()
        >>> _ = Path("adapter/adapter_config.json").write_text(json.dumps(adapter))
        >>> adapter_base("adapter")
        PosixPath('Qwen3-0.6B')
    """
    adapter_dir = Path(adapter_dir)
    read_adapter_config(adapter_dir)  # an unsupported adapter: refused before any search
    run = _run_folder(adapter_dir)
    try:
        return find_base(
            adapter_dir,
            base_dir,
            spellings=_run_model_dir(run),
            roots=[run] if run is not None else [],
        )
    except CheckpointFileNotFoundError as err:
        raise CheckpointNotFoundError(str(err)) from None


def _run_model_dir(run: Path | None) -> list[str]:
    """The ``model_dir`` of the run's ``config.yaml`` (none when there is no such file)."""
    if run is None or not (run / RUN_CONFIG).is_file():
        return []
    model_dir = OmegaConf.load(run / RUN_CONFIG).get("model_dir")
    return [model_dir] if isinstance(model_dir, str) and model_dir else []


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    base_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    chat_template: str | None = None,
) -> LoadedCheckpoint:
    """Load a model folder, an adapter folder (on its base) or a run folder's newest
    checkpoint (see the module docs) for inference: eval mode, no parameter requires grad.

    ``dtype`` defaults to the checkpoint's (the base's for an adapter); ``chat_template``
    replaces the tokenizer's (a shipped name such as ``qwen2_5``, or a ``.jinja`` file).

    Example::

        loaded = load_checkpoint("out/checkpoints/step_000100", dtype="bf16")
        loaded.model, loaded.tokenizer
    """
    folder = resolve_checkpoint(path)
    if (folder / ADAPTER_CONFIG_NAME).is_file():
        base = adapter_base(folder, base_dir)
        model = from_hf(base, dtype=dtype, device=device)
        load_peft_adapter(model, folder)
        model = model.to(device)
        kind: Literal["model", "adapter"] = "adapter"
    else:
        if base_dir is not None:
            raise ValueError(f"{folder} is a full model folder: it takes no --base-dir")
        base, kind = None, "model"
        model = from_hf(folder, dtype=dtype, device=device)
    tokenizer_dir = folder if (folder / "tokenizer.json").is_file() or base is None else base
    tokenizer = Tokenizer.from_pretrained(tokenizer_dir, chat_template=chat_template)
    model.eval().requires_grad_(False)
    return LoadedCheckpoint(model, tokenizer, folder, kind, base)
