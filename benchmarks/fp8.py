"""FP8 training against bf16: the loss over the same steps and the tokens/s of each.

A random model of the ``--shape`` (``qwen3_0_6b``: hidden 1024, 28 layers, 16 heads / 8 KV
heads, head_dim 128, intermediate 3072, vocabulary 151936, tied embeddings) trains ``--steps``
steps of AdamW on generated rows (a random span of ids below 4096 or the vocabulary, repeated:
the model learns to copy it, so the loss falls within 50 steps) with bf16 weights and fp32
master copies (``precision: {weights: bf16, master_weights: fp32}``), once per ``--modes``
entry: ``bf16``
(plain), ``fp8_rowwise``, ``fp8_tensorwise`` (``precision.matmuls``: the same conversion a run
makes, :func:`tunesmith.training.fp8.apply_fp8`). Every mode starts from the same weights and
sees the same batches. Each decoder layer is compiled (torchao's advice for float8) unless
``--no-compile``.

Reported per mode: tokens/s after ``--warmup`` steps (the first steps compile), the first
step's seconds, the loss at a few steps, and against bf16: the largest |loss difference| at
any step and the mean relative difference over the last 10 steps, which must stay within
``--tolerance`` (default 2%). The report is rewritten after each mode, so a run stopped at a
time limit keeps what it measured.

Usage::

    PYTHONPATH=. python benchmarks/fp8.py --device cuda          # benchmarks/gpu/fp8.sh
    PYTHONPATH=. python benchmarks/fp8.py --device cpu --shape qwen3_tiny --steps 4 \\
        --batch 2 --seq 64 --no-compile --out /tmp/fp8.md        # the script itself, on a CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import command_line, machine  # noqa: E402

from tunesmith.models import build_model  # noqa: E402
from tunesmith.models.zoo import qwen3  # noqa: E402
from tunesmith.training.fp8 import FP8Settings, apply_fp8, device_problem  # noqa: E402
from tunesmith.training.memory.compile import compile_model  # noqa: E402
from tunesmith.training.precision import Precision, build_optimizer  # noqa: E402

MODES = ("bf16", "fp8_rowwise", "fp8_tensorwise")
DEFAULTS = {
    "device": "cuda", "shape": "qwen3_0_6b", "steps": 50, "batch": 8, "seq": 1024, "lr": 3e-4,
    "modes": list(MODES), "no_compile": False, "warmup": 10, "tolerance": 0.02,
    "out": str(REPO / "benchmarks" / "results" / "fp8_cuda.md"),
}  # fmt: skip
COPY_VOCAB = 4096  # the ids the generated rows use
LAST = 10  # the steps the tolerance is checked over


def batches(args: argparse.Namespace) -> list[torch.Tensor]:
    """``args.steps`` batches of ``[batch, seq + 1]`` ids: a random span repeated."""
    generator = torch.Generator().manual_seed(0)
    vocab = min(COPY_VOCAB, qwen3.spec(args.shape).vocab_size)
    span = max(args.seq // 8, 4)
    out = []
    for _ in range(args.steps):
        spans = torch.randint(0, vocab, (args.batch, span), generator=generator)
        rows = spans.repeat(1, (args.seq + 1) // span + 1)[:, : args.seq + 1]
        out.append(rows)
    return out


def train(mode: str, args: argparse.Namespace, data: list[torch.Tensor]) -> dict:
    """One mode's run: its losses, the first step's seconds and tokens/s after the warm-up."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(qwen3.spec(args.shape), device=device, dtype=torch.bfloat16)
    if mode != "bf16":
        apply_fp8(model, FP8Settings(mode.removeprefix("fp8_")))
    if not args.no_compile:
        _allow_a_graph_per_layer(len(model.model.layers))
        compile_model(model)
    precision = Precision(torch.bfloat16, torch.float32, torch.float32)
    optimizer = build_optimizer(
        precision, model.parameters(), lambda p: torch.optim.AdamW(p, lr=args.lr)
    )
    losses, times = [], []
    for ids in data:
        ids = ids.to(device)
        start = time.perf_counter()
        logits = model(ids[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step
        times.append(time.perf_counter() - start)
    timed = times[args.warmup :] or times
    tokens = args.batch * args.seq * len(timed)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"losses": losses, "first_s": times[0], "tokens_s": tokens / sum(timed)}


def _allow_a_graph_per_layer(layers: int) -> None:
    """Let dynamo keep one graph per decoder layer (its default limit of 8 recompiles of the same
    code would leave the later layers of a 28-layer model eager, should they specialise)."""
    import torch._dynamo.config as dynamo

    name = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
    setattr(dynamo, name, max(getattr(dynamo, name), 2 * layers))


def compare(run: dict, base: dict) -> dict[str, float]:
    """The largest |loss difference| at any step and the mean relative one of the last steps."""
    pairs = list(zip(run["losses"], base["losses"], strict=True))
    last = pairs[-LAST:]
    return {
        "max_abs": max(abs(a - b) for a, b in pairs),
        "last_rel": sum(abs(a - b) / b for a, b in last) / len(last),
    }


def report(args: argparse.Namespace, runs: dict[str, dict], started: float) -> str:
    steps = sorted({1, *range(10, args.steps + 1, 10), args.steps})
    name = torch.cuda.get_device_name() if args.device == "cuda" else machine()
    lines = [
        f"# FP8 training against bf16 ({args.device})",
        "",
        f"`{command_line('benchmarks/fp8.py', args, DEFAULTS, skip=['out'])}`",
        "",
        f"- Device: {name}; torch {torch.__version__}, torchao {_torchao()}; run "
        f"{time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s.",
        f"- Model: random {args.shape} (bf16 weights, fp32 master copies, AdamW lr {args.lr}, "
        f"clip 1.0), {'not compiled' if args.no_compile else 'each decoder layer compiled'}; "
        f"{args.steps} steps of {args.batch} x {args.seq} generated tokens (a random span "
        "repeated), the same weights and batches in every mode.",
        f"- tokens/s: steps {args.warmup + 1} to {args.steps}; the first step compiles. "
        f"Tolerance: the mean relative |loss difference| to bf16 over the last {LAST} steps "
        f"<= {args.tolerance:.0%}.",
        "",
        "| mode | tokens/s | vs bf16 | first step s | "
        + " | ".join(f"loss @{s}" for s in steps)
        + " | max \\|Δ loss\\| | last-10 rel Δ | within tolerance |",
        "|---|---:|---:|---:|" + "---:|" * len(steps) + "---:|---:|---|",
    ]
    base = runs.get("bf16")
    for mode, run in runs.items():
        if "error" in run:
            lines.append(f"| {mode} | failed: {run['error']} |")
            continue
        speed = f"{run['tokens_s'] / base['tokens_s']:.2f}x" if base and "error" not in base else ""
        diff = compare(run, base) if base and mode != "bf16" and "error" not in base else None
        cells = [f"{run['losses'][s - 1]:.4f}" for s in steps]
        tail = (
            ["", "", ""]
            if diff is None
            else [f"{diff['max_abs']:.4f}", f"{diff['last_rel']:.2%}",
                  "yes" if diff["last_rel"] <= args.tolerance else "**no**"]
        )  # fmt: skip
        lines.append(
            f"| {mode} | {run['tokens_s']:,.0f} | {speed} | {run['first_s']:.1f} | "
            + " | ".join([*cells, *tail])
            + " |"
        )
    missing = [m for m in args.modes if m not in runs]
    if missing:
        lines += ["", f"Not reached (time limit): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def _torchao() -> str:
    import torchao

    return torchao.__version__


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=DEFAULTS["device"], choices=["cuda", "cpu"])
    parser.add_argument("--shape", default=DEFAULTS["shape"], choices=sorted(qwen3.SIZES))
    for flag in ("steps", "batch", "seq", "warmup"):
        parser.add_argument(f"--{flag}", type=int, default=DEFAULTS[flag])
    parser.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    parser.add_argument("--tolerance", type=float, default=DEFAULTS["tolerance"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=DEFAULTS["modes"])
    parser.add_argument("--no-compile", action="store_true", help="eager layers")
    parser.add_argument("--out", default=DEFAULTS["out"])
    args = parser.parse_args()
    if args.device == "cuda" and (problem := device_problem(torch.device("cuda"))) is not None:
        print(f"fp8 benchmark: {problem}", file=sys.stderr)
        return 2
    started, runs, data = time.perf_counter(), {}, batches(args)
    for mode in args.modes:
        try:
            runs[mode] = train(mode, args, data)
        except Exception as error:  # noqa: BLE001 (the report says which mode failed and why)
            runs[mode] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        print(mode, {k: v for k, v in runs[mode].items() if k != "losses"}, flush=True)
        Path(args.out).write_text(report(args, runs, started))
    print(f"wrote {args.out}")
    failed = any("error" in r for r in runs.values())
    base = runs.get("bf16")
    off = (
        base is not None
        and "error" not in base
        and any(
            compare(r, base)["last_rel"] > args.tolerance
            for m, r in runs.items()
            if m != "bf16" and "error" not in r
        )
    )
    return 1 if failed or off else 0


if __name__ == "__main__":
    sys.exit(main())
