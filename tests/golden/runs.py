"""Golden runs: each built-in recipe on its shipped ``tiny`` config, on a small generated world
(tiny model folders, a trained tiny tokenizer, synthetic chat and preference data), for a few
steps on fixed seeds, on the CPU and one intra-op thread; and the summary of a run that the
goldens record (:func:`summarize`): every per-step loss-like metric as logged, and digests of the
final checkpoint's weights.

:mod:`tests.golden.record` writes the summaries to ``tests/golden/<run>.json``;
:mod:`tests.golden.test_golden` re-runs the same runs and compares. Changing anything here
(data, sizes, overrides) changes what the goldens mean: record them again, from the commit the
goldens should stand for.

Example::

    world = build_world(tmp_path / "world")
    summary = summarize(execute(RUNS["sft"], world, tmp_path / "sft"))
"""

from __future__ import annotations

import hashlib
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    checkpoint_weights,
    final_weights,
    make_chat_data,
    make_counting_data,
    make_model_dir,
    read_eval_metrics,
    read_metrics,
    run_recipe,
)

GOLDEN_DIR = Path(__file__).resolve().parent
STEPS = 6
FIRST_VALUES = 8
"""How many leading values of every final tensor a golden keeps (for an approximate look)."""

TEACHER_SIZE = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8}
VOLATILE = re.compile(r"(^time$|_s$|per_s|memory|_gb$|_time)")
"""Metrics that depend on the machine's speed or memory, not on the training: not recorded."""


@dataclass(frozen=True)
class GoldenRun:
    """One recipe run: ``recipe`` on its shipped ``config`` with the world's ``data`` (and
    ``val``, if any, as ``val_dataset``), plus ``overrides`` (``{name}`` placeholders are
    world paths)."""

    recipe: str
    data: str
    val: str | None = None
    overrides: tuple[str, ...] = ()
    config: str = "tiny"
    inputs: tuple[str, ...] = field(default=("model",))
    """World model folders the run reads (their initial weights are part of the golden)."""

    def all_overrides(self) -> list[str]:
        """The overrides every golden run has, then the run's own."""
        return [f"max_steps={STEPS}", "device=cpu", "save_every_n_steps=null", *self.overrides]


RUNS: dict[str, GoldenRun] = {
    "sft": GoldenRun("sft", "chat", "chat_val", ("eval_every_n_steps=3",)),
    "sft_packed_accum": GoldenRun(
        "sft", "counting", overrides=("packed=true", "gradient_accumulation_steps=2")
    ),
    "dpo": GoldenRun("dpo", "pairs", "pairs_val", ("eval_every_n_steps=3", "optimizer.lr=1e-4")),
    "dpo_precompute": GoldenRun(
        "dpo", "pairs", overrides=("precompute_reference=true", "optimizer.lr=1e-4")
    ),
    "kd": GoldenRun(
        "kd",
        "chat",
        "chat_val",
        ("eval_every_n_steps=3", "teacher_dir={teacher}"),
        inputs=("model", "teacher"),
    ),
    "reward_model": GoldenRun("reward_model", "pairs", "pairs_val", ("eval_every_n_steps=3",)),
}
"""Golden run name -> the run (the name is also the golden file's: ``<name>.json``)."""


def build_world(root: Path) -> dict[str, Path]:
    """The world every golden run draws from, generated under ``root`` (deterministic: the
    same files on every machine, the same initial weights for a given CPU and torch)."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        "model": make_model_dir(root / "model", seed=0),
        "teacher": make_model_dir(root / "teacher", seed=1, **TEACHER_SIZE),
        "chat": make_chat_data(root / "chat.jsonl", rows=24, seed=0),
        "chat_val": make_chat_data(root / "chat_val.jsonl", rows=8, seed=1),
        "counting": make_counting_data(root / "counting.jsonl", rows=24, seed=0),
        "pairs": make_preference_data(root / "pairs.jsonl", rows=24, seed=0, task="add"),
        "pairs_val": make_preference_data(root / "pairs_val.jsonl", rows=8, seed=1, task="add"),
    }


def execute(run: GoldenRun, world: dict[str, Path], output_dir: Path) -> Path:
    """Run ``run`` in this process (on one intra-op thread, as :func:`run_recipe` does) into
    ``output_dir``; returns it."""
    paths = {k: str(v) for k, v in world.items()}
    overrides = [o.format(**paths) for o in run.all_overrides()]
    val = world[run.val] if run.val else None
    return run_recipe(
        run.recipe, run.config, world["model"], world[run.data], output_dir, *overrides, val=val
    )


_ISA_FLAG = re.compile(r"^(avx|amx|fma|f16c|sse|ssse|bmi|vnni|vaes|vpclmul)")


def cpu_model() -> tuple[str, str]:
    """The CPU's model name and a digest of its instruction-set flags (from ``/proc/cpuinfo``;
    ``platform.processor()`` and ``unknown`` elsewhere): two CPUs with one torch
    ``cpu_capability`` can still pick different kernels (blocking, AMX, VNNI), so sums land in
    other orders.

    Example::

        cpu_model()  # ('Intel(R) Xeon(R) Processor', 'e027004417e3')
    """
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown", "unknown"
    first_cpu = info.split("\n\n", 1)[0].splitlines()
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first_cpu)}
    isa = sorted(f for f in fields.get("flags", "").split() if _ISA_FLAG.match(f))
    digest = hashlib.sha256(" ".join(isa).encode()).hexdigest()[:12]
    return fields.get("model name", platform.processor() or "unknown"), digest


def fingerprint() -> dict[str, str]:
    """Where a golden was recorded: a run elsewhere (another torch, another CPU kernel set,
    another CPU model) need not reproduce it bit for bit."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        **dict(zip(("cpu", "cpu_isa"), cpu_model())),
    }


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def weights_digest(weights: dict[str, torch.Tensor]) -> dict:
    """``sha256`` of ``weights`` (tensor names sorted; each name, dtype, shape and bytes
    hashed) and, per tensor, what an approximate comparison needs: dtype, shape, and in
    float64 (as ``float.hex``) the sum, the sum of absolute values, the sum of squares, the
    largest absolute value and the first :data:`FIRST_VALUES` values."""
    sha = hashlib.sha256()
    tensors = {}
    for name in sorted(weights):
        t = weights[name].detach().cpu()
        sha.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        sha.update(_tensor_bytes(t))
        x = t.double().reshape(-1)
        tensors[name] = {
            "dtype": str(t.dtype),
            "shape": list(t.shape),
            "sum": x.sum().item().hex(),
            "abs_sum": x.abs().sum().item().hex(),
            "sq_sum": x.square().sum().item().hex(),
            "max_abs": x.abs().max().item().hex() if x.numel() else (0.0).hex(),
            "first": [v.hex() for v in x[:FIRST_VALUES].tolist()],
        }
    return {"sha256": sha.hexdigest(), "tensors": tensors}


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def input_files(run: GoldenRun, world: dict[str, Path]) -> dict[str, str]:
    """sha256 of every generated file the run reads other than weights: its data files and
    the tokenizer/config files of its model folders (machine-independent)."""
    out = {}
    for key in (run.data, run.val):
        if key:
            out[world[key].name] = file_sha256(world[key])
    for key in run.inputs:
        for f in sorted(world[key].iterdir()):
            if f.is_file() and not f.name.endswith(".safetensors"):
                out[f"{key}/{f.name}"] = file_sha256(f)
    return out


def _kept(record: dict) -> dict:
    return {k: v for k, v in sorted(record.items()) if not VOLATILE.search(k)}


def summarize(run: GoldenRun, world: dict[str, Path], output_dir: Path) -> dict:
    """What a golden holds of a finished run: its inputs' digests, every training and
    validation record (step -> metric -> value, volatile metrics left out; floats exact as
    JSON writes them) and the final checkpoint's :func:`weights_digest`."""
    return {
        "recipe": run.recipe,
        "config": run.config,
        "overrides": run.all_overrides(),
        "inputs": {
            "files": input_files(run, world),
            "initial_weights": {
                k: weights_digest(checkpoint_weights(world[k])) for k in run.inputs
            },
        },
        "train": {str(s): _kept(r) for s, r in sorted(read_metrics(output_dir).items())},
        "eval": {str(s): _kept(r) for s, r in sorted(read_eval_metrics(output_dir).items())},
        "final_weights": weights_digest(final_weights(output_dir)),
    }
