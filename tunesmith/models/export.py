"""Export: merge LoRA/DoRA adapters into their base and write a plain Hugging Face folder.

``tunesmith export`` calls :func:`export_merged`. The result loads in transformers and vLLM
with no ``peft`` involved; NF4 (QLoRA) training does not matter here, since the merge starts
from the base folder's dense weights.

Example::

    export_merged("out/adapter", "out/merged", base_dir="Qwen3-0.6B", dtype="bf16")
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from tunesmith.models.base_record import find_base
from tunesmith.models.hf import (
    CONFIG_NAME,
    TOKENIZER_FILES,
    copy_model_files,
    from_hf,
    read_hf_config,
    resolve_dtype,
    save_hf_checkpoint,
    write_hf_checkpoint,
)
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, load_peft_adapter, read_adapter_config
from tunesmith.models.safetensors_io import CheckpointFileNotFoundError, atomic_directory
from tunesmith.modules.fake_quant import torchao_config
from tunesmith.modules.peft import merge_adapters

__all__ = ["export_merged", "export_quantized"]


def _overlay_tokenizer_files(source: Path, folder: Path) -> None:
    copy_model_files(source, folder, TOKENIZER_FILES)  # links leaving ``source``: refused


def _merge_dtype(base: str | os.PathLike, out_dtype: torch.dtype | None) -> torch.dtype:
    """Load the base in the wider of its stored dtype and the output dtype: the merge then
    rounds once, to the output dtype."""
    config = read_hf_config(base)
    stored = resolve_dtype(config.get("dtype") or config.get("torch_dtype"))
    if out_dtype is None or stored.itemsize >= out_dtype.itemsize:
        return stored
    return out_dtype


def export_merged(
    adapter_or_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
) -> Path:
    """Write a plain Hugging Face folder with the adapters merged into the base weights.

    ``adapter_or_model_dir`` is a PEFT adapter folder (its base model is ``base_dir``, else
    the local HF folder it records, found and checked from any working directory by
    :func:`~tunesmith.models.base_record.find_base`) or a HF model
    folder (re-saved, e.g. to change dtype). ``dtype`` (``"bf16"``, ``"fp32"``...) defaults to
    the base config's. The base is loaded in the wider of its stored dtype and ``dtype``; each
    merged weight is computed in float32, then cast to ``dtype``. Generation config and
    tokenizer files come from the base folder; tokenizer files found in the adapter folder
    replace them. Atomic; returns ``out_dir``.

    Example::

        >>> import json
        >>> from tunesmith.models import build_model, qwen3
        >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")
        >>> export_merged("Qwen3-tiny", "out/merged", dtype="bf16")  # a model folder: re-saved
        PosixPath('out/merged')
        >>> json.loads(Path("out/merged/config.json").read_text())["torch_dtype"]
        'bfloat16'

    With a LoRA run's checkpoint::

        export_merged("ckpt/step_1000", "out/merged", base_dir="Qwen3-0.6B", dtype="bf16")
    """
    src = Path(adapter_or_model_dir)
    if not src.is_dir():
        raise CheckpointFileNotFoundError(f"{src} does not exist")
    out_dtype = None if dtype is None else resolve_dtype(dtype)
    if not (src / ADAPTER_CONFIG_NAME).is_file():
        if not (src / CONFIG_NAME).is_file():
            raise CheckpointFileNotFoundError(
                f"{src} holds neither {ADAPTER_CONFIG_NAME} (an adapter) nor {CONFIG_NAME} (a model)"
            )
        if base_dir is not None:
            raise ValueError(f"{src} is a full model folder: it takes no base_dir")
        model = from_hf(src, dtype=out_dtype)
        return save_hf_checkpoint(
            model, out_dir, dtype=out_dtype, max_shard_size=max_shard_size, source_dir=src
        )
    read_adapter_config(src)  # an unsupported adapter: refused before the base is searched
    base = find_base(src, base_dir)
    model = from_hf(base, dtype=_merge_dtype(base, out_dtype))
    load_peft_adapter(model, src)
    merge_adapters(model)
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        write_hf_checkpoint(
            model, tmp, dtype=out_dtype, max_shard_size=max_shard_size, source_dir=base
        )
        _overlay_tokenizer_files(src, tmp)
    return out_dir


def export_quantized(
    adapter_or_model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    scheme: str,
    group_size: int = 32,
    base_dir: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write a torchao-quantized Hugging Face folder of ``adapter_or_model_dir`` (merged as
    :func:`export_merged` does): every linear layer but ``lm_head`` quantized as ``scheme``
    (:data:`~tunesmith.modules.fake_quant.QAT_SCHEMES`, the rounding a QAT run trained with),
    written by transformers itself (``TorchAoConfig``; its ``from_pretrained`` loads the folder
    as it is), tokenizer files beside it. Atomic; returns ``out_dir``.

    Example::

        export_quantized("runs/qat", "out/int8da-int4w", scheme="int8da-int4w", group_size=32)
    """
    import transformers

    out_dir = Path(out_dir)
    config = transformers.TorchAoConfig(torchao_config(scheme, group_size))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{out_dir.name}.merged-") as tmp:
        merged = export_merged(adapter_or_model_dir, Path(tmp) / "merged", base_dir=base_dir,
                               dtype=dtype)  # fmt: skip
        stored = resolve_dtype(read_hf_config(merged).get("dtype") or "float32")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            merged, quantization_config=config, dtype=stored
        )
        with atomic_directory(out_dir) as staging:
            model.save_pretrained(staging)
            _overlay_tokenizer_files(merged, staging)
    return out_dir
