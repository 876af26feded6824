"""Checkpoints that both deploy and resume, written atomically by one rank or many.

A checkpoint ``<root>/step_000100/`` is a Hugging Face model folder (safetensors, config,
tokenizer files: ``transformers`` loads it as is) — or, for a LoRA/DoRA model, a PEFT adapter
folder (``peft.PeftModel.from_pretrained`` loads it onto the base) — plus ``training_state/``: the optimizer
(torch.distributed.checkpoint, sharded by rank), and one ``rank<N>.pt`` per rank with the LR
schedule, data-loader position, RNG states, progress counters and the mesh that wrote it
(:func:`saved_layout`): a checkpoint resumes on another mesh too (:meth:`Checkpointer.load`).
The folder appears under its final name only once every file is written and fsynced (see
:class:`CheckpointDirectory`).

Example::

    ckpt = Checkpointer("out/checkpoints", ctx, keep_last=2, source_dir="Qwen3-0.6B")
    path = ckpt.save(100, model, optimizer, {"scheduler": sched, "dataloader": loader},
                     progress={"step": 100})
    progress = ckpt.load(path, model, optimizer, {"scheduler": sched, "dataloader": loader})
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import resource
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tunesmith.models.atomic import fsync_path
from tunesmith.models.hf import check_model_files, write_hf_checkpoint
from tunesmith.models.manifest import MARKER, has_manifest
from tunesmith.models.peft_io import load_peft_adapter, write_peft_adapter
from tunesmith.models.safetensors_io import CheckpointError, find_weight_files
from tunesmith.models.transformers_backend import TransformersSpec
from tunesmith.modules.moe import file_expert_keys, model_expert_keys, stacked_state
from tunesmith.modules.peft import adapter_modules, adapter_state_dict
from tunesmith.training.checkpoint import safe_dcp
from tunesmith.training.checkpoint.directory import (
    CheckpointDirectory,
    CheckpointWriteError,
    aside_folder,
)
from tunesmith.training.logging.loggers import OPEN_LOG_DIRS
from tunesmith.training.parallel.distributed import DistributedContext, full_tensor

__all__ = ["Checkpointer", "layout", "not_continued", "rng_state", "saved_layout", "set_rng_state"]

STATE_DIR = "training_state"
LAYOUT_KEY = "layout"
"""The entry of each ``rank<N>.pt`` that says which mesh wrote the checkpoint (:func:`layout`)."""


class Stateful(Protocol):
    """What is saved in each ``rank<N>.pt``; may also have ``reshard_state_dict(state,
    saved_dp_size)`` to resume on another data-parallel size (:meth:`Checkpointer.load`)."""

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def layout(ctx: DistributedContext) -> dict[str, Any]:
    """The mesh a checkpoint is written by, as plain data (saved in every ``rank<N>.pt``): the
    world size, the data-parallel size, each rank's data-parallel index and the mesh's sizes.

    Example::

        layout(ctx)  # 4 ranks of tp 2 x dp_shard 2
        # -> {'world_size': 4, 'dp_size': 2, 'dp_ranks': [0, 0, 1, 1],
        #     'mesh': {'dp_shard': 2, 'tp': 2}}
    """
    dims, names = ctx.dims, getattr(ctx.mesh, "mesh_dim_names", None) or ()
    return {
        "world_size": ctx.world_size,
        "dp_size": ctx.dp_size,
        "dp_ranks": [r if dims is None else dims.dp_rank(r) for r in range(ctx.world_size)],
        "mesh": {name: ctx.mesh.size(i) for i, name in enumerate(names)},
    }


def saved_layout(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The :func:`layout` of the run that wrote checkpoint ``path`` (None: a checkpoint from
    before layouts were saved).

    Example::

        saved_layout("out/checkpoints/step_000002")["mesh"]
        # -> {'dp_shard': 2, 'tp': 2}
    """
    file = Path(path) / STATE_DIR / "rank0.pt"
    found = _read_rank_file(file).get(LAYOUT_KEY)
    if found is None:
        return None
    try:
        world, dp = int(found["world_size"]), int(found["dp_size"])
        dp_ranks = [int(r) for r in found["dp_ranks"]]
        mesh = {str(k): int(v) for k, v in dict(found.get("mesh", {})).items()}
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file}: '{LAYOUT_KEY}' is not a mesh layout: {found!r}") from err
    if len(dp_ranks) != world or sorted(set(dp_ranks)) != list(range(dp)):
        raise CheckpointError(
            f"{file}: '{LAYOUT_KEY}' gives {world} rank(s) the data-parallel indices {dp_ranks}, "
            f"not each of 0..{dp - 1}"
        )
    return {"world_size": world, "dp_size": dp, "dp_ranks": dp_ranks, "mesh": mesh}


def _read_rank_file(file: Path) -> dict[str, Any]:
    """A ``rank<N>.pt`` (tensors and plain data only); a :class:`CheckpointError` names it."""
    try:  # weights_only, torch's built-in allow-list: tensors and plain data only
        state = safe_dcp.load_plain(file)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{file}: refused to load the training state: it holds objects other than "
            f"tensors and plain data ({safe_dcp.refusal_reason(err)})"
        ) from err
    except Exception as err:
        raise CheckpointError(
            f"{file}: cannot load the training state (truncated or corrupt?): {_cause(err)}"
        ) from err
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: holds a {type(state).__name__}, not a training state")
    return state


def _same_state(a: Any, b: Any) -> bool:
    """Equal nested states: same keys, lengths, types and values; tensors of the same dtype,
    shape and elements (a NaN anywhere counts as a difference)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_state, a, b))
    return type(a) is type(b) and a == b


def _mesh_words(saved: Mapping[str, Any]) -> str:
    """``4 rank(s) (dp_shard 2 x tp 2)``."""
    mesh = " x ".join(f"{name} {size}" for name, size in dict(saved.get("mesh", {})).items())
    return f"{saved['world_size']} rank(s) ({mesh or 'data parallel'})"


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
            name: full_tensor(t).detach().cpu() for name, t in adapter_state_dict(model).items()
        }
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if _transformers_built(model):  # its own names; checkpoint_layout() converts on write
        return get_model_state_dict(model, options=options)
    with stacked_state(model):  # DCP needs parameter names; HF keys for MoE experts after
        return file_expert_keys(model, get_model_state_dict(model, options=options))


def _transformers_built(model: nn.Module) -> bool:
    """Whether ``model`` is the transformers backend's: its experts are transformers' own
    modules, whose checkpoint layout transformers' conversion gives (not our expert split)."""
    return isinstance(getattr(model, "spec", None), TransformersSpec)


def _check_shapes(
    model: nn.Module, weights: Mapping[str, torch.Tensor], files: Mapping[str, Path]
) -> None:
    """One clear error for a checkpoint of another architecture (instead of a list of them)."""
    with stacked_state(model):  # no collective: split on meta tensors (expert-parallel
        # experts are DTensors, whose per-expert views would redistribute on rank 0 alone)
        stacked = {
            name: torch.empty(t.shape, device="meta") for name, t in model.state_dict().items()
        }
    if not _transformers_built(model):
        stacked = file_expert_keys(model, stacked)
    expected = {name: tuple(t.shape) for name, t in stacked.items()}
    for name, tensor in weights.items():
        if name in expected and tuple(tensor.shape) != expected[name]:
            raise CheckpointError(
                f"{files[name]}: tensor '{name}' has shape {list(tensor.shape)}, the model "
                f"expects {list(expected[name])} (a checkpoint of another model size?)"
            )
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        where = ", ".join(sorted({str(f) for f in files.values()}))
        raise CheckpointError(
            f"{where}: the tensors do not match the model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )


def _cause(err: BaseException) -> str:
    """One line saying what went wrong: the first rank's error inside dcp's
    ``CheckpointException`` (whose own text is a traceback per rank), else ``err`` itself."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _nbytes(tree: Any) -> int:
    """Bytes of the tensors in nested dicts/lists (the size of what a checkpoint writes)."""
    if isinstance(tree, torch.Tensor):
        return tree.nbytes
    if isinstance(tree, Mapping):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


def _write_error(
    step: int, root: Path, err: BaseException, free: int | None, needed: int
) -> CheckpointWriteError:
    """A one-line error for a failed checkpoint write, saying when the disk is full or a file
    outgrew the process's file size limit (the underlying errors often do not: torch's writer
    reports ENOSPC and EFBIG alike as 'unexpected pos 704 vs 598', without an errno).

    Example::

        >>> root, err = Path("out/checkpoints"), RuntimeError("unexpected pos 704 vs 598")
        >>> error = _write_error(4, root, err, free=10**6, needed=2**30)
        >>> print(error)  # doctest: +NORMALIZE_WHITESPACE
        failed to write checkpoint step 4 in out/checkpoints (disk full: 976.6 KiB free, the
        checkpoint needs about 1.0 GiB): RuntimeError: unexpected pos 704 vs 598. Older
        checkpoints in out/checkpoints are untouched.

    With ``ulimit -f 100`` and room on the disk it says ``(file too large: the process's file
    size limit (ulimit -f) is 102400 bytes ...)`` instead.
    """
    code = next((e.errno for e in _chain(err) if isinstance(e, OSError) and e.errno), None)
    limit = _file_size_limit()
    if code in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < needed):
        hint = (
            f" (disk full: {_human(free or 0)} free, the checkpoint needs about {_human(needed)})"
        )
    elif limit is not None and (code == errno.EFBIG or (code is None and limit < needed)):
        code = errno.EFBIG  # torch's C++ writer lost it; the limit is below what was written
        hint = (
            f" (file too large: the process's file size limit (ulimit -f) is {limit} bytes "
            f"({_human(limit)}), the checkpoint needs about {_human(needed)}; raise it, e.g. "
            "`ulimit -f unlimited`)"
        )
    elif code == errno.EFBIG:
        hint = " (file too large for the filesystem)"
    else:
        hint = ""
    return CheckpointWriteError(
        f"failed to write checkpoint step {step} in {root}{hint}: {_cause(err)}. "
        f"Older checkpoints in {root} are untouched.",
        path=root / f"step_{step:06d}",
        step=step,
        errno=code,
    )


def _file_size_limit() -> int | None:
    """This process's file size limit (``RLIMIT_FSIZE``, ``ulimit -f``) in bytes; None if none.

    Example::

        _file_size_limit()
        # -> None
    """
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _human(size: float) -> str:
    """``1391720`` -> ``'1.3 MiB'``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    while size >= 1024 and len(units) > 1:
        size /= 1024
        units.pop(0)
    return f"{size:.0f} B" if units[0] == "B" else f"{size:.1f} {units[0]}"


def _chain(err: BaseException) -> list[BaseException]:
    """``err``, its causes and contexts, and the errors inside a dcp CheckpointException."""
    seen: list[BaseException] = []
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [wrapped[0] for wrapped in e.failures.values()]
    return seen


def not_continued(root: Path, existing: list[Path], resume: Any) -> str:
    """Why a run that does not continue the ``existing`` checkpoints of ``root`` is refused
    (said before anything is built, and again by :meth:`Checkpointer.start`).

    >>> print(not_continued(Path("out/checkpoints"), [Path("step_000004")], False))
    ... # doctest: +NORMALIZE_WHITESPACE
    out/checkpoints already holds checkpoints of another run (step_000004) and resume=false does
    not continue them: pass resume=true to continue that run, overwrite=true to move them aside
    and start over, or choose another output_dir
    """
    start = "resume=false" if resume is None or resume is False else f"resume={resume}"
    return (
        f"{root} already holds checkpoints of another run ({_names(existing)}) and "
        f"{start} does not continue them: pass resume=true to continue that run, "
        "overwrite=true to move them aside and start over, or choose another output_dir"
    )


def _names(paths: list[Path], limit: int = 4) -> str:
    """``step_000002, step_000004`` (``... and 7 more`` past ``limit``)."""
    names = [p.name for p in paths]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


RUN_FILES = ("metrics.jsonl", "config.yaml")
"""The files of the output dir a run's loggers write, moved aside with a run that is not
continued (:meth:`Checkpointer.start`)."""


def _run_files(output_dir: Path) -> list[Path]:
    """The :data:`RUN_FILES` present in ``output_dir``."""
    return [output_dir / name for name in RUN_FILES if (output_dir / name).is_file()]


def _earlier_run_files(output_dir: Path) -> list[Path]:
    """The :data:`RUN_FILES` an earlier run left in ``output_dir``: none while a logger of
    this process already writes there (a script that opened it before starting)."""
    if os.path.abspath(output_dir) in OPEN_LOG_DIRS:
        return []
    files = [output_dir / name for name in RUN_FILES if os.path.lexists(output_dir / name)]
    for file in files:  # a planted link stays, for the logger to refuse naming it
        info = os.lstat(file)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            return []
    return files


def _move_run_files(files: list[Path], into: Path) -> Path:
    """Move ``files`` into the folder ``into`` (created if missing; :func:`aside_folder`
    names a new one); nothing is deleted. Returns ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    for file in files:
        os.rename(file, into / file.name)
    if files:
        fsync_path(into, directory=True)
        fsync_path(files[0].parent, directory=True)
    return into


def _is_step_dir(path: Path) -> bool:
    try:
        CheckpointDirectory.step_of(path)
    except ValueError:
        return False
    return True


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
        if source_dir is not None:  # a link leaving the model folder: refused before training
            check_model_files(source_dir)
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

    def start(
        self,
        resume: bool | str | os.PathLike[str] | None,
        *,
        overwrite: bool = False,
        check: Callable[[Path], Any] | None = None,
        log: Callable[[str], None] = print,
    ) -> Path | None:
        """The checkpoint this run resumes from (None: step 0), once ``root`` is safe to write
        into; the same answer (or error) on every rank, rank 0 deciding. Nothing is deleted.

        * ``resume=false``: ``root`` must hold no ``step_*`` folder (complete or not): they
          are another run's. ``overwrite=true`` moves them, with ``metrics.jsonl`` and
          ``config.yaml`` of the output dir, into ``<output_dir>/overwritten-<time>/``.
        * Any run starting at step 0 (no checkpoint to resume) starts its own record: an
          earlier run's ``metrics.jsonl`` and ``config.yaml`` left in the output dir (a run
          stopped before its first checkpoint) move into ``<output_dir>/earlier-run-<time>/``
          (logged). A resumed run keeps appending to them.
        * ``resume=true``: the newest checkpoint whose files match their manifest (newer
          damaged ones are skipped with a warning naming the file); with none, step 0 when
          ``root`` holds no ``step_*`` folder, else an error naming each one's problem.
        * ``resume=<folder>``: that checkpoint, verified (an error names the file that does
          not match). From outside ``root``, a ``root`` with ``step_*`` folders is refused
          as for ``resume=false``.

        Resuming from ``step_N`` of ``root``, every ``step_*`` folder newer than ``N`` is moved
        to ``root/rolled-back-<time>/`` (the run will write those steps again), and the run
        continues the resumed run's id, so ``keep_last`` prunes its older checkpoints.
        ``check(path)`` runs on every rank once the checkpoint is chosen and before anything is
        moved (e.g. to refuse a changed config while the folder is still as the user left it).

        Example::

            path = ckpt.start(cfg.resume, overwrite=cfg.overwrite)
        """
        path = self._decided_by_rank_zero(lambda: self._choose(resume, log))
        if path is not None and check is not None:
            check(path)
        self._decided_by_rank_zero(lambda: self._prepare(path, resume, overwrite, log))
        return path

    def _decided_by_rank_zero(self, decide: Callable[[], Any]) -> Any:
        """``decide()``'s answer (or error) on rank 0, the same on every rank."""
        box: list[Any] = [None]
        if self.directory is not None:
            try:
                box = [decide()]
            except (OSError, ValueError) as err:  # CheckpointError is a ValueError
                box = [err]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _choose(self, resume: Any, log: Callable[[str], None]) -> Path | None:
        """The checkpoint ``resume`` names, verified (rank 0; nothing moves)."""
        directory = self.directory
        existing = directory.step_dirs()
        if resume is True:
            path, skipped = directory.newest_good()
            for bad, problem in skipped:
                log(f"warning: skipping damaged checkpoint {bad.name}: {problem}")
            if path is None and existing:
                problems = [directory.link_problem(p) or directory.problem(p) for p in existing]
                raise FileNotFoundError(
                    f"resume=true: no usable checkpoint in {directory.root}: "
                    f"{'; '.join(p for p in problems if p)}. Restarting from step 0 would "
                    "lose them: move them away, or pass resume=false overwrite=true (they are "
                    "moved aside, not deleted)"
                )
        elif resume is None or resume is False:
            path = None
        else:
            path = Path(resume)
            planted = path.parent.resolve() == directory.root.resolve()  # the user's own: followed
            if planted and path.is_symlink() and (problem := directory.link_problem(path)):
                raise CheckpointError(f"resume={resume}: {problem}")
            if not has_manifest(path):
                log(
                    f"warning: resume={resume} has no {MARKER} manifest; its files are not verified"
                )
            elif problem := directory.problem(path):
                raise CheckpointError(f"resume={resume}: {problem}")
        return path

    def _prepare(
        self, path: Path | None, resume: Any, overwrite: bool, log: Callable[[str], None]
    ) -> None:
        """Make ``root`` safe to write for a run resuming ``path`` (rank 0): move aside newer
        checkpoints of a rollback, refuse (or with ``overwrite`` move) another run's."""
        directory = self.directory
        existing = directory.step_dirs()
        inside = path is not None and path.parent.resolve() == directory.root.resolve()
        if inside and _is_step_dir(path):
            newer = [p for p in existing if directory.step_of(p) > directory.step_of(path)]
            if newer:
                into = directory.set_aside(newer, aside_folder(directory.root, "rolled-back"))
                log(
                    f"resuming from {path.name}: moved the newer {_names(newer)} to {into} "
                    "(not deleted)"
                )
        elif existing:
            self._replace(existing, resume, overwrite, log)
        elif path is None and (files := _earlier_run_files(directory.root.parent)):
            into = _move_run_files(files, aside_folder(directory.root.parent, "earlier-run"))
            log(
                f"starting a fresh run (no checkpoint to resume): moved the earlier run's "
                f"{_names(files)} to {into} (not deleted)"
            )
        if path is not None:
            directory.adopt(path)

    def _replace(
        self, existing: list[Path], resume: Any, overwrite: bool, log: Callable[[str], None]
    ) -> None:
        """A run that does not continue the checkpoints in ``root``: refuse, or with
        ``overwrite`` move them (and the output dir's metrics.jsonl, config.yaml) aside."""
        root = self.directory.root
        if not overwrite:
            raise FileExistsError(not_continued(root, existing, resume))
        into = aside_folder(root.parent, "overwritten")
        self.directory.set_aside(existing, into / root.name)
        _move_run_files(_run_files(root.parent), into)
        log(
            f"overwrite=true: moved the previous run's {_names(existing)} (and its "
            f"metrics.jsonl, config.yaml) to {into} (not deleted)"
        )

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
                    weights,
                    tmp,
                    spec=model.spec,
                    dtype=self.save_dtype,
                    source_dir=self.source_dir,
                )
            dcp.save({"optimizer": optim_state}, checkpoint_id=tmp / STATE_DIR / "optimizer")
            rank_state = {name: obj.state_dict() for name, obj in stateful.items()}
            rank_state |= {
                "rng": rng_state(),
                "progress": dict(progress),
                LAYOUT_KEY: layout(self.ctx),
            }
            torch.save(rank_state, tmp / STATE_DIR / f"rank{self.ctx.rank}.pt")
            _barrier()
            final = self.directory.commit(tmp) if self.directory else None
        except (Exception, CheckpointException) as err:  # dcp's is a BaseException
            free = _free_bytes(tmp)  # before the partial files are removed
            if self.directory is not None:
                self.directory.abort(tmp)
            raise _write_error(step, self.root, err, free, _nbytes((weights, optim_state))) from err
        except BaseException:  # KeyboardInterrupt, SystemExit: clean up, propagate as is
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
        *,
        verify: bool = True,
        log: Callable[[str], None] = print,
    ) -> dict[str, Any]:
        """Restore weights, optimizer, ``stateful`` objects and RNG from ``path``; return progress.

        With ``verify`` rank 0 first checks every file against the checkpoint's manifest (a
        :class:`CheckpointError` names the first that does not match); :meth:`start` has
        already done so for the checkpoint it returns.

        The checkpoint may come from another mesh (other world, tensor- or data-parallel
        sizes; rank 0 logs the two): the weights are a full HF folder, dcp reshards the
        optimizer state, and each rank reads the ``rank<N>.pt`` of the first saved rank with
        its data-parallel index (modulo the saved data-parallel size). A ``stateful`` object
        with ``reshard_state_dict(state, saved_dp_size)`` maps that state to this rank (the
        data position); one without it gets the state as saved, which is refused when the
        data-parallel size changed and the state differs between the saved ranks.
        """
        path = Path(path)
        if verify:
            checked = self.ctx.is_rank_zero and has_manifest(path)
            problem = [CheckpointDirectory.problem(path) if checked else None]
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast_object_list(problem, src=0)
            if problem[0] is not None:
                raise CheckpointError(problem[0])
        plan = self._decided_by_rank_zero(lambda: self._mesh_change(path, stateful))
        rank_state = self._rank_state(path, plan, stateful, log)
        if adapter_modules(model):
            load_peft_adapter(model, path)  # each rank takes its shard of each tensor
        else:
            weights: dict[str, torch.Tensor] = {}
            if self.ctx.is_rank_zero:
                files, _ = find_weight_files(path)
                origin: dict[str, Path] = {}
                for file in files:
                    try:
                        tensors = load_file(file)
                    except SafetensorError as err:
                        raise CheckpointError(
                            f"{file}: not a valid safetensors file (truncated or corrupt?): {err}"
                        ) from err
                    weights.update(tensors)
                    origin.update(dict.fromkeys(tensors, file))
                if _transformers_built(model):  # a MoE's per-expert tensors, fused
                    weights = model.spec.runtime_layout(weights, path)
                    origin = {name: origin.get(name, path) for name in weights}
                renames = getattr(getattr(model, "spec", None), "checkpoint_renames", None)
                if renames:  # names the family's files spell otherwise (Llama 4's feed_forward)
                    weights = {renames.from_disk(k): v for k, v in weights.items()}
                    origin = {renames.from_disk(k): v for k, v in origin.items()}
                _check_shapes(model, weights, origin)
            set_model_state_dict(
                model,
                weights if _transformers_built(model) else model_expert_keys(model, weights),
                options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=self.ctx.world_size > 1
                ),
            )
        optim_state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        optim_dir = path / STATE_DIR / "optimizer"
        try:  # no pickle: allow-listed metadata, weights_only entries; any saved mesh
            safe_dcp.load(optim_state, optim_dir)
        except (Exception, CheckpointException) as err:  # dcp's is a BaseException
            raise CheckpointError(
                f"{optim_dir}: cannot load the optimizer state: {_cause(err)}"
            ) from err
        set_optimizer_state_dict(model, optimizer, optim_state["optimizer"])
        for name, obj in stateful.items():
            obj.load_state_dict(rank_state[name])
        set_rng_state(rank_state["rng"])
        return rank_state["progress"]

    def _mesh_change(self, path: Path, stateful: Mapping[str, Stateful]) -> dict[str, Any] | None:
        """(Rank 0.) None when ``path`` was written by this very layout (each rank reads its own
        ``rank<N>.pt``); else the saved :func:`layout` and, when the data-parallel size changed,
        the ``stateful`` names without ``reshard_state_dict`` whose state differs between the
        saved ranks."""
        state_dir = path / STATE_DIR
        first = state_dir / "rank0.pt"
        if not first.is_file():
            raise FileNotFoundError(
                f"{first} is missing: {path} is not a training checkpoint (of a "
                f"{self.ctx.world_size}-rank run, or of any other)"
            )
        saved, current = saved_layout(path), layout(self.ctx)
        if saved is None:  # written before checkpoints recorded their mesh
            count = len(list(state_dir.glob("rank*.pt")))
            if count == self.ctx.world_size:
                return None
            raise FileNotFoundError(
                f"{path} was written by {count} rank(s) before checkpoints recorded their mesh: "
                f"resume it on {count} rank(s), not {self.ctx.world_size}"
            )
        if saved["world_size"] == current["world_size"] and (
            list(saved["dp_ranks"]) == current["dp_ranks"]
        ):
            return None
        differing: list[str] = []
        if saved["dp_size"] != current["dp_size"]:
            states = [
                _read_rank_file(state_dir / f"rank{r}.pt") for r in range(saved["world_size"])
            ]
            differing = [
                name
                for name, obj in stateful.items()
                if not hasattr(obj, "reshard_state_dict")
                and not all(_same_state(s.get(name), states[0].get(name)) for s in states[1:])
            ]
        return {"layout": saved, "differing": differing}

    def _rank_state(
        self,
        path: Path,
        plan: dict[str, Any] | None,
        stateful: Mapping[str, Stateful],
        log: Callable[[str], None],
    ) -> dict[str, Any]:
        """This rank's saved training state, the ``stateful`` entries mapped to this mesh when
        ``plan`` (:meth:`_mesh_change`) says it is another; read before any weight moves."""
        if plan is None:
            rank_file = path / STATE_DIR / f"rank{self.ctx.rank}.pt"
            if not rank_file.is_file():
                raise FileNotFoundError(
                    f"{rank_file} is missing: {path} is not a training checkpoint of a "
                    f"{self.ctx.world_size}-rank run"
                )
            return _read_rank_file(rank_file)
        saved, here = plan["layout"], layout(self.ctx)
        saved_dp = int(saved["dp_size"])
        for name in plan["differing"]:  # the same list on every rank: all refuse together
            raise CheckpointError(
                f"{path}: the '{name}' state differs between the saved ranks and "
                f"{type(stateful[name]).__name__} cannot map it from {saved_dp} to "
                f"{self.ctx.dp_size} data-parallel ranks (no reshard_state_dict): resume with "
                f"{saved_dp} data-parallel ranks"
            )
        if self.ctx.is_rank_zero:
            log(
                f"resuming {path.name}, written by {_mesh_words(saved)}, on {_mesh_words(here)}: "
                "the optimizer state is resharded, the data position mapped"
            )
        source = list(saved["dp_ranks"]).index(self.ctx.dp_rank % saved_dp)
        rank_file = path / STATE_DIR / f"rank{source}.pt"
        state = _read_rank_file(rank_file)
        for name, obj in stateful.items():
            reshard = getattr(obj, "reshard_state_dict", None)
            if reshard is None or name not in state:
                continue
            try:
                state[name] = reshard(state[name], saved_dp)
            except ValueError as err:
                raise CheckpointError(
                    f"{rank_file}: cannot resume the '{name}' state on {_mesh_words(here)}: {err}"
                ) from err
        return state
