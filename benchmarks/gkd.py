"""On-policy distillation (``gkd``, lmbda = 1, and mixed, lmbda = 0.5) against offline KD
(``gkd`` with lmbda = 0, which is the ``kd`` recipe on the dataset's completions:
tests/recipes/test_gkd.py) on the demo task (sort the letters), at the same budget of teacher
forward passes.

A teacher (the demo's base size) is trained with ``tunesmith run sft --config demo``; a
smaller student (hidden 64) is distilled from it each way with the same loss (the generalised
JSD, beta 0.5), optimiser, schedule, batch and steps, so each makes one teacher forward pass
over ``batch_size`` rows per step. Every ``--eval-every`` steps the checkpoint's held-out
accuracy (greedy answers to the 200 held-out prompts, the demo's scorer) is measured.

    python benchmarks/gkd.py                  # writes benchmarks/results/gkd.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine_info import command_line, machine  # noqa: E402

from tunesmith.data import Tokenizer  # noqa: E402
from tunesmith.demo.assets import AssetSettings, build_base_model, make_assets  # noqa: E402
from tunesmith.demo.run import MAX_NEW_TOKENS, evaluate, run_to_checkpoint  # noqa: E402
from tunesmith.demo.task import read_jsonl  # noqa: E402
from tunesmith.models import from_hf  # noqa: E402
from tunesmith.training import CheckpointDirectory  # noqa: E402

STUDENT = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 32}  # fmt: skip
DEFAULTS = {"out": "outputs/bench-gkd", "teacher_steps": 250, "student_sft_steps": 100,
            "steps": 300, "eval_every": 50, "batch_size": 32, "lr": 3e-3, "threads": 2,
            "results": "benchmarks/results/gkd.md"}  # fmt: skip
WAYS = {
    "offline KD (lmbda=0)": "0.0",
    "mixed GKD (lmbda=0.5)": "0.5",
    "on-policy GKD (lmbda=1)": "1.0",
}


def distill(args, assets, student: Path, teacher: Path, lmbda: str, run_dir: Path) -> list[Path]:
    """The ``gkd`` recipe's checkpoints (every ``eval_every`` steps) of one way."""
    run_to_checkpoint(
        "gkd",
        "tiny",
        [
            f"model_dir={student}", f"teacher_dir={teacher}", f"output_dir={run_dir}",
            f"dataset.source={assets.train_file}", "dataset.max_seq_len=64", "device=cpu",
            f"lmbda={lmbda}", f"max_steps={args.steps}", f"batch_size={args.batch_size}",
            f"save_every_n_steps={args.eval_every}", "keep_last=100", "save_every_minutes=null",
            f"optimizer.lr={args.lr}", "lr_scheduler.num_warmup_steps=25", "log_every_n_steps=25",
            f"generation.max_new_tokens={MAX_NEW_TOKENS}", "progress_bar=false",
            "metric_loggers=[]",
        ],
        run_dir,
    )  # fmt: skip
    return CheckpointDirectory(run_dir / "checkpoints").list()


def accuracy_of(folder: Path, tokenizer: Tokenizer, held_out) -> float:
    return evaluate(from_hf(folder), tokenizer, held_out)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, default in DEFAULTS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(default), default=default)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.out)
    start = time.perf_counter()

    assets = make_assets(root, AssetSettings())
    tokenizer = Tokenizer.from_pretrained(assets.tokenizer_dir)
    held_out = read_jsonl(assets.held_out_file)
    teacher = run_to_checkpoint(
        "sft", "demo",
        [f"model_dir={assets.model_dir}", f"dataset.source={assets.train_file}",
         f"output_dir={root / 'teacher'}", f"max_steps={args.teacher_steps}",
         "progress_bar=false", "metric_loggers=[]"],
        root / "teacher",
    )  # fmt: skip
    teacher_acc = accuracy_of(teacher, tokenizer, held_out)
    base = build_base_model(root / "student_base", assets.tokenizer_dir, seed=1, **STUDENT)
    student = run_to_checkpoint(  # a warm start, as in the GKD paper: a short SFT first
        "sft", "demo",
        [f"model_dir={base}", f"dataset.source={assets.train_file}",
         f"output_dir={root / 'student_sft'}", f"max_steps={args.student_sft_steps}",
         "lr_scheduler.num_warmup_steps=10", "progress_bar=false", "metric_loggers=[]"],
        root / "student_sft",
    )  # fmt: skip
    student_acc = accuracy_of(student, tokenizer, held_out)
    sizes = {
        name: sum(p.numel() for p in from_hf(path).parameters())
        for name, path in (("teacher", teacher), ("student", student))
    }
    curves: dict[str, dict[int, float]] = {}
    seconds: dict[str, float] = {}
    for way, lmbda in WAYS.items():
        began = time.perf_counter()
        ckpts = distill(args, assets, student, teacher, lmbda, root / f"lmbda{lmbda}")
        seconds[way] = time.perf_counter() - began
        curves[way] = {0: student_acc} | {
            int(c.name.removeprefix("step_")): accuracy_of(c, tokenizer, held_out) for c in ckpts
        }
        print(way, curves[way], flush=True)
    write_results(args, teacher_acc, sizes, curves, seconds, time.perf_counter() - start)


def first_within(curve: dict[int, float], target: float) -> str:
    """The first evaluated step whose accuracy is within 5 points of ``target``."""
    steps = [s for s in sorted(curve) if curve[s] >= target - 0.05]
    return str(steps[0]) if steps else "not reached"


def write_results(args, teacher_acc, sizes, curves, seconds, total) -> None:
    import platform

    import tunesmith

    versions = f"Python {platform.python_version()}, torch {torch.__version__}"
    steps = sorted(next(iter(curves.values())))
    lines = [
        "# On-policy distillation (GKD) vs offline KD on the demo task",
        "",
        f"Machine: {machine()}; {versions}; tunesmith {getattr(tunesmith, '__version__', '?')}.",
        f"Command: `{command_line('benchmarks/gkd.py', args, DEFAULTS)}` ({total / 60:.1f} min).",
        "",
        f"Teacher: the demo's base size ({sizes['teacher']:,} parameters) after "
        f"{args.teacher_steps} steps of `sft --config demo`: held-out accuracy "
        f"**{teacher_acc:.1%}**. Student: hidden 64 ({sizes['student']:,} parameters), "
        f"{args.student_sft_steps} steps of the same SFT first (step 0 below). Every way: "
        "`gkd --config tiny` with the generalised JSD (beta 0.5), kd_ratio 1, "
        f"AdamW lr {args.lr}, batch {args.batch_size}; lmbda=0 trains on the dataset's answers "
        "(offline KD), lmbda=1 on the student's own samples (temperature 1). Teacher forward "
        f"passes: {args.batch_size} rows per step in each, so the same budget at the same step.",
        "",
        "| step | teacher forward rows | " + " | ".join(curves) + " |",
        "|---|---|" + "---|" * len(curves),
    ]
    for step in steps:
        row = [f"{curves[w][step]:.1%}" for w in curves]
        lines.append(f"| {step} | {step * args.batch_size:,} | " + " | ".join(row) + " |")
    lines += [
        "",
        "| way | first step within 5 points of the teacher | training time |",
        "|---|---|---|",
        *(f"| {w} | {first_within(curves[w], teacher_acc)} | {seconds[w]:.0f} s |" for w in curves),
        "",
        "Raw: " + json.dumps({w: curves[w] for w in curves}),
        "",
    ]
    Path(args.results).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
