"""Checkpoints that both deploy and resume, written atomically by one rank or many.

A checkpoint ``<root>/step_000100/`` is a Hugging Face model folder (safetensors, config,
tokenizer files: ``transformers`` loads it as is) — or, for a LoRA/DoRA model, a PEFT adapter
folder (``peft.PeftModel.from_pretrained`` loads it onto the base) — plus ``training_state/``: the optimizer
(torch.distributed.checkpoint, sharded by rank), and one ``rank<N>.pt`` per rank with the LR
schedule, data-loader position, RNG states and progress counters. The folder appears under
its final name only once every file is written and fsynced (see :class:`CheckpointDirectory`).

Example::

    >>> ckpt = Checkpointer("out/checkpoints", ctx, keep_last=2, source_dir="Qwen3-0.6B")
    >>> path = ckpt.save(100, model, optimizer, {"scheduler": sched, "dataloader": loader},
    ...                  progress={"step": 100})  # doctest: +SKIP
    >>> progress = ckpt.load(path, model, optimizer, {"scheduler": sched, "dataloader": loader})  # doctest: +SKIP
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tunesmith.models.hf import write_hf_checkpoint
from tunesmith.models.peft_io import load_peft_adapter, write_peft_adapter
from tunesmith.models.safetensors_io import find_weight_files
from tunesmith.modules.peft import adapter_modules, adapter_state_dict
from tunesmith.training.checkpoint_dir import CheckpointDirectory
from tunesmith.training.distributed import DistributedContext

__all__ = ["Checkpointer", "rng_state", "set_rng_state"]

STATE_DIR = "training_state"


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_state() -> dict[str, Any]:
    """Every RNG the training loop draws from (python, torch CPU, CUDA when present)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _broadcast_path(path: Path | None) -> Path:
    box = [str(path) if path is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _gather_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights to export, on CPU: the whole model, or only its LoRA/DoRA
    adapters when it has any (the frozen base is never gathered)."""
    if adapter_modules(model):
        return {
            name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu()
            for name, t in adapter_state_dict(model).items()
        }
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


class Checkpointer:
    """Save and restore full training checkpoints under ``root`` (keeping the last ``keep_last``).

    Args:
        root: folder of ``step_*`` checkpoints.
        ctx: the :class:`DistributedContext`; rank 0 owns the folder, every rank writes its part.
        keep_last: complete checkpoints kept after each save (None: all).
        source_dir: HF folder whose tokenizer and generation config files are copied in.
        save_dtype: dtype of the exported weights (default: the parameters' own, which is what
            exact resumption needs).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        ctx: DistributedContext,
        *,
        keep_last: int | None = None,
        source_dir: str | os.PathLike[str] | None = None,
        save_dtype: torch.dtype | None = None,
    ) -> None:
        self.ctx = ctx
        self.source_dir = source_dir
        self.save_dtype = save_dtype
        self.directory = (
            CheckpointDirectory(root, keep_last=keep_last) if ctx.is_rank_zero else None
        )
        self.root = Path(root)
        _barrier()  # rank 0 has cleaned stale temp dirs before anyone looks

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None (same answer on every rank)."""
        found = self.directory.latest() if self.directory is not None else None
        box = [str(found) if found is not None else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        return Path(box[0]) if box[0] is not None else None

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: Mapping[str, Stateful],
        progress: Mapping[str, Any],
    ) -> Path:
        """Write checkpoint ``step`` (a collective: every rank calls it); returns its path."""
        weights = _gather_weights(model)  # collective; only the adapters for LoRA models
        optim_state = get_optimizer_state_dict(model, optimizer)
        tmp = _broadcast_path(self.directory.begin(step) if self.directory else None)
        try:
            if self.ctx.is_rank_zero and adapter_modules(model):
                write_peft_adapter(
                    model, tmp, state_dict=weights, base_model_name_or_path=self.source_dir
                )
            elif self.ctx.is_rank_zero:
                write_hf_checkpoint(
                    weights, tmp, spec=model.spec, dtype=self.save_dtype,
                    source_dir=self.source_dir,
                )  # fmt: skip
            dcp.save({"optimizer": optim_state}, checkpoint_id=tmp / STATE_DIR / "optimizer")
            rank_state = {name: obj.state_dict() for name, obj in stateful.items()}
            rank_state |= {"rng": rng_state(), "progress": dict(progress)}
            torch.save(rank_state, tmp / STATE_DIR / f"rank{self.ctx.rank}.pt")
            _barrier()
            final = self.directory.commit(tmp) if self.directory else None
        except BaseException:
            if self.directory is not None:
                self.directory.abort(tmp)
            raise
        return _broadcast_path(final)

    def load(
        self,
        path: str | os.PathLike[str],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stateful: Mapping[str, Stateful],
    ) -> dict[str, Any]:
        """Restore weights, optimizer, ``stateful`` objects and RNG from ``path``; return progress."""
        path = Path(path)
        rank_file = path / STATE_DIR / f"rank{self.ctx.rank}.pt"
        if not rank_file.is_file():
            raise FileNotFoundError(
                f"{rank_file} is missing: {path} is not a training checkpoint of a "
                f"{self.ctx.world_size}-rank run (resume needs the same number of ranks)"
            )
        if adapter_modules(model):
            load_peft_adapter(model, path)  # each rank takes its shard of each tensor
        else:
            weights: dict[str, torch.Tensor] = {}
            if self.ctx.is_rank_zero:
                files, _ = find_weight_files(path)
                for file in files:
                    weights.update(load_file(file))
            set_model_state_dict(
                model,
                weights,
                options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=self.ctx.world_size > 1
                ),
            )
        optim_state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(optim_state, checkpoint_id=path / STATE_DIR / "optimizer")
        set_optimizer_state_dict(model, optimizer, optim_state["optimizer"])
        rank_state = torch.load(rank_file, weights_only=True)
        for name, obj in stateful.items():
            obj.load_state_dict(rank_state[name])
        set_rng_state(rank_state["rng"])
        return rank_state["progress"]
