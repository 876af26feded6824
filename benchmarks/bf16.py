"""bf16 that pays? Step time, memory and the loss gap to fp32 of each precision mode.

Modes (``tunesmith.training.precision``; autocast is ``mixed_precision``):

- ``fp32``: fp32 weights, AdamW states fp32;
- ``autocast``: fp32 weights, bf16 autocast (``mixed_precision: bf16``);
- ``bf16+master``: bf16 weights, fp32 master copies and fp32 AdamW states;
- ``bf16+master, bf16 states``: the same with the AdamW moments stored in bf16;
- ``pure bf16``: bf16 weights stepped in place, bf16 moments (no masters).

Each (shape, mode) runs in a fresh subprocess: a random-init Llama of the shape (4-layer: vocab
32000, hidden 256, 4 layers; 100M: hidden 768, 12 layers, tied head), batch 4 x seq 256 of
random tokens (the first half of each row prompt, masked), the library's cross-entropy loss,
torch's AdamW (lr 1e-3) through :func:`~tunesmith.training.precision.build_optimizer`,
gradient clipping at 1.0; the same batch every step, so the loss falls (the batch is learnt)
and the modes' losses after N steps compare. Step time: the median over the steps after the
first (warm-up), CPU time of the process divided by its threads (the machine is shared) and
wall time. Memory: the bytes of the weights, gradients and optimizer states counted tensor by
tensor at the end (exact), and the process's peak RSS. Rounds take turns over the modes.

A second table times the loss path alone, forward + backward of the library's
``CrossEntropyLoss`` on [4 x 256 x 32000] logits, and, on the hidden states and the head,
``LinearCrossEntropyLoss`` (SFT), ``token_logprobs`` (DPO, RL; summed) and ``KDLoss`` (forward
KL + CE against a teacher of the same shape), with bf16 inputs against fp32 inputs (all
compute log-softmax in fp32).

Usage::

    python benchmarks/bf16.py                                  # writes results/bf16.md
    python benchmarks/bf16.py --shapes 4-layer --steps 3 --rounds 1 --no-write   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "bf16.md"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import machine  # noqa: E402
from shapes import SHAPES  # noqa: E402

MODES = {  # name -> (precision mapping, mixed_precision)
    "fp32": (None, None),
    "autocast": (None, "bf16"),
    "bf16+master": ({"weights": "bf16", "master_weights": "fp32"}, None),
    "bf16+master, bf16 states": (
        {"weights": "bf16", "master_weights": "fp32", "optimizer_states": "bf16"}, None,
    ),
    "pure bf16": ({"weights": "bf16"}, None),
}  # fmt: skip
BATCH, SEQ_LEN, LR = 4, 256, 1e-3


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if torch.is_tensor(t) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def run_mode(shape: str, mode: str, steps: int, threads: int) -> dict:
    """One mode in this process: per-step losses and times, memory."""
    from tunesmith.models import build_model
    from tunesmith.models.spec import spec_from_hf_config
    from tunesmith.modules.losses import CrossEntropyLoss
    from tunesmith.training.precision import Precision, build_optimizer, cast_weights

    torch.set_num_threads(threads)
    precision_map, autocast = MODES[mode]
    precision = Precision.from_mapping(precision_map)
    torch.manual_seed(0)
    model = cast_weights(build_model(spec_from_hf_config(SHAPES[shape])), precision)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (BATCH, SEQ_LEN + 1), generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[:, : SEQ_LEN // 2] = -100
    loss_fn = CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(precision, params, lambda p: torch.optim.AdamW(p, lr=LR))
    units = int((labels != -100).sum())
    losses, cpu, wall = [], [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast is not None):
            loss = loss_fn(model(inputs), labels) / units
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        grads = _tensor_bytes(p.grad for p in params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cpu.append((time.process_time() - start_cpu) / threads)
        wall.append(time.perf_counter() - start)
        losses.append(loss.item())
    states = [t for s in opt.state.values() for t in s.values()]
    inner = getattr(opt, "inner", None)
    if inner is not None:
        states += [t for s in inner.state.values() for t in s.values()]
    return {
        "shape": shape, "mode": mode, "losses": losses, "cpu": cpu[1:], "wall": wall[1:],
        "weights": _tensor_bytes(params), "grads": grads,
        "states": _tensor_bytes(states),  # masters + moments (shared tensors counted once)
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": sum(p.numel() for p in params),
    }  # fmt: skip


def loss_path(threads: int, repeats: int = 5) -> list[dict]:
    """Forward + backward time of the loss alone, bf16 inputs vs fp32 inputs."""
    from tunesmith.modules.losses import (
        CrossEntropyLoss,
        KDLoss,
        LinearCrossEntropyLoss,
        token_logprobs,
    )

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    hidden32 = torch.randn(BATCH, SEQ_LEN, 256, generator=gen)
    weight32 = torch.randn(32000, 256, generator=gen) * 0.02
    labels = torch.randint(0, 32000, (BATCH, SEQ_LEN), generator=gen)
    labels[:, : SEQ_LEN // 2] = -100
    teacher32 = torch.randn(BATCH, SEQ_LEN, 256, generator=gen)
    losses = {
        "CrossEntropyLoss (logits)": lambda h, w, t: CrossEntropyLoss()(h @ w.T, labels),
        "LinearCrossEntropyLoss (hidden, head)": lambda h, w, t: LinearCrossEntropyLoss()(
            h, w, labels
        ),
        "token_logprobs (hidden, head; DPO, RL)": lambda h, w, t: token_logprobs(
            h, w, labels
        ).sum(),
        "KDLoss (hidden, heads; forward KL + CE)": lambda h, w, t: sum(
            KDLoss()(h, w, t, w.detach(), labels)
        ),
    }
    rows = []
    for name, loss_fn in losses.items():
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            samples = []
            for _ in range(repeats + 1):
                hidden = hidden32.to(dtype).requires_grad_()
                weight = weight32.to(dtype).requires_grad_()
                teacher = teacher32.to(dtype)
                start = time.process_time()
                loss = loss_fn(hidden, weight, teacher)
                loss.backward()
                samples.append((time.process_time() - start) / threads)
            times[dtype] = statistics.median(samples[1:])
        rows.append({"loss": name, "fp32": times[torch.float32], "bf16": times[torch.bfloat16]})
    return rows


def _child(args: argparse.Namespace) -> None:
    if args.child == "loss":
        print(json.dumps(loss_path(args.threads)))
    else:
        shape, mode = args.child.split("|")
        print(json.dumps(run_mode(shape, mode, args.steps, args.threads)))


def _spawn(child: str, args: argparse.Namespace) -> dict | list:
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            child,
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def report(args, runs: list[dict], loss_rows: list[dict], load: str, minutes: float) -> str:
    lines = [
        "# bf16 precision modes: step time, memory, loss gap to fp32", "",
        f"`python benchmarks/bf16.py --shapes {' '.join(args.shapes)} --steps {args.steps} "
        f"--rounds {args.rounds} --threads {args.threads}` ({minutes:.1f} min).", "",
        f"- Machine: {machine()}; Python {platform.python_version()}, torch {torch.__version__}; "
        f"run {datetime.date.today()}; load average at the start {load}. Shared with other "
        "work: times are CPU time of the process per thread (median over the timed steps of "
        "all rounds); wall time next to it. **GPU: not run.**",
        f"- Workload: random-init Llama, batch {BATCH} x seq {SEQ_LEN}, the second half of each "
        f"row trained, the same batch every step (the loss falls as it is learnt), AdamW lr {LR}, "
        "clip 1.0, the library's CrossEntropyLoss. Each mode a fresh process per round.",
        "- Memory: weights / grads / states are exact tensor bytes (states: masters + AdamW "
        "moments); peak RSS is the process's (includes activations and the allocator).", "",
    ]  # fmt: skip
    for shape in args.shapes:
        rows = [r for r in runs if r["shape"] == shape]
        if not rows:
            continue
        n = rows[0]["params"]
        lines += [
            f"## {shape} ({n / 1e6:.1f}M parameters)",
            "",
            f"| mode | step CPU s | vs fp32 | step wall s | loss after {args.steps} steps "
            "| gap to fp32 | max gap (any step) | weights MiB | grads MiB | states MiB | "
            "peak RSS MiB |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        by_mode: dict[str, list[dict]] = {}
        for r in rows:
            by_mode.setdefault(r["mode"], []).append(r)
        base = statistics.median(t for r in by_mode["fp32"] for t in r["cpu"])
        fp32_losses = by_mode["fp32"][0]["losses"]
        for mode, mine in by_mode.items():
            cpu = statistics.median(t for r in mine for t in r["cpu"])
            wall = statistics.median(t for r in mine for t in r["wall"])
            losses = mine[0]["losses"]
            gaps = [abs(a - b) for a, b in zip(losses, fp32_losses)]
            last = mine[-1]
            lines.append(
                f"| {mode} | {cpu:.3f} | {cpu / base:.2f}x | {wall:.3f} | {losses[-1]:.4f} | "
                f"{gaps[-1]:.4f} | {max(gaps):.4f} | {_mib(last['weights'])} | "
                f"{_mib(last['grads'])} | {_mib(last['states'])} | "
                f"{_mib(max(r['peak_rss'] for r in mine))} |"
            )
        lines.append("")
    lines += [
        "## The loss path alone (forward + backward, CPU s per thread, median of 5)",
        "",
        "| loss | fp32 inputs | bf16 inputs | bf16 / fp32 |",
        "|---|---:|---:|---:|",
    ]
    for row in loss_rows:
        lines.append(
            f"| {row['loss']} | {row['fp32']:.4f} | {row['bf16']:.4f} | "
            f"{row['bf16'] / row['fp32']:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first untimed)")
    parser.add_argument("--rounds", type=int, default=2, help="turns over the modes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        _child(args)
        return
    load = f"{os.getloadavg()[0]:.1f}"
    start = time.perf_counter()
    runs = []
    for shape in args.shapes:
        for round_ in range(args.rounds):
            order = args.modes if round_ % 2 == 0 else list(reversed(args.modes))
            for mode in order:
                runs.append(_spawn(f"{shape}|{mode}", args))
                print(f"{shape} round {round_} {mode}: {runs[-1]['cpu']}", flush=True)
    loss_rows = _spawn("loss", args)
    text = report(args, runs, loss_rows, load, (time.perf_counter() - start) / 60)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
