"""Linear cross-entropy vs full logits: the loss step's peak memory and time, side by side.

One loss step is forward + backward of the summed cross-entropy of ``hidden @ weight.T``
(``hidden`` ``[1 x seq, h]``, ``weight`` ``[vocab, h]``, both float32 and requiring grad,
every position trained) divided by the token count, as the recipe does. Three ways:

* ``full logits``: ``CrossEntropyLoss`` on the materialised ``[seq, vocab]`` logits;
* ``linear CE``: ``LinearCrossEntropyLoss`` (gradients computed chunk by chunk in forward,
  backward only scales them);
* ``linear CE, recompute``: ``LinearCrossEntropyLoss(grad_in_forward=False)``, whose
  backward recomputes each chunk's logits (one more matmul).

Memory: the peak bytes of tensors created during the step, counted op by op by
``tunesmith.training.memory.usage.LiveTensorBytes`` (the inputs and the weight exist before and are
not counted); reported with the weight's gradient (which both need and which survives the step
as ``weight.grad``) and without it (every tensor shaped like the weight left out).

Time: one process, the ways taking turns for ``--repeats`` rounds after a warm-up step each;
median seconds per step.

Usage::

    python benchmarks/linear_ce.py                     # 128256 x 2048, seq 2048; writes results
    python benchmarks/linear_ce.py --hidden 256 --vocab 32000 --repeats 2 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from sft_ladder import machine  # noqa: E402

from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss  # noqa: E402
from tunesmith.training.memory.usage import LiveTensorBytes  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "linear_ce.md"
LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LiveBytesExceptShape(LiveTensorBytes):
    """:class:`LiveTensorBytes` that leaves out every new tensor of one ``shape`` (here the
    weight's gradient, and any other ``[vocab, h]`` tensor)."""

    def __init__(self, shape: torch.Size) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs))
        inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) == self.shape:
                continue
            if tensor.untyped_storage().data_ptr() not in inputs:
                self._track(tensor.untyped_storage())
        return out


def ways(chunks: int | None) -> dict[str, LossFn]:
    full = CrossEntropyLoss()
    return {
        "full logits": lambda hidden, weight, labels: full(hidden @ weight.T, labels),
        "linear CE": LinearCrossEntropyLoss(chunks),
        "linear CE, recompute": LinearCrossEntropyLoss(chunks, grad_in_forward=False),
    }


def loss_step(
    loss_fn: LossFn, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> None:
    """Forward + backward of the token-mean loss; the gradients land in ``.grad``."""
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, labels) / labels.numel()
    loss.backward()


def peak_bytes(loss_fn: LossFn, hidden, weight, labels) -> tuple[int, int]:
    """(peak with the weight gradient, peak without any weight-shaped tensor) of one step."""
    hidden.grad = weight.grad = None
    with LiveTensorBytes() as everything, LiveBytesExceptShape(weight.shape) as without:
        loss_step(loss_fn, hidden, weight, labels)
    return everything.peak, without.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256, help="Llama 3's vocabulary")
    parser.add_argument("--hidden", type=int, default=2048, help="Llama 3.2 1B's width")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunks", type=int, help="num_chunks (default: the loss's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS.name}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, args.seq, args.hidden, generator=gen).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
    candidates = ways(args.chunks)
    started = time.perf_counter()

    memory = {name: peak_bytes(fn, hidden, weight, labels) for name, fn in candidates.items()}
    for name, (with_grad, without) in memory.items():
        print(
            f"{name}: peak {with_grad / 2**20:,.0f} MiB ({without / 2**20:,.0f} MiB without "
            "the weight gradient)",
            flush=True,
        )
    times: dict[str, list[float]] = {name: [] for name in candidates}
    cpu_times: dict[str, list[float]] = {name: [] for name in candidates}
    for round_ in range(args.repeats):
        for name, fn in candidates.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            loss_step(fn, hidden, weight, labels)
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append((time.process_time() - start_cpu) / args.threads)
            print(
                f"round {round_ + 1}: {name} {times[name][-1]:.2f} s "
                f"({cpu_times[name][-1]:.2f} CPU s per thread)",
                flush=True,
            )
    minutes = (time.perf_counter() - started) / 60
    text = report(args, memory, times, cpu_times, weight, minutes)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")


def report(
    args: argparse.Namespace,
    memory: dict[str, tuple[int, int]],
    times: dict[str, list[float]],
    cpu_times: dict[str, list[float]],
    weight: torch.Tensor,
    minutes: float,
) -> str:
    full_mem, full_time = memory["full logits"], statistics.median(times["full logits"])
    full_cpu = statistics.median(cpu_times["full logits"])
    rows = []
    for name, (with_grad, without) in memory.items():
        median, cpu = statistics.median(times[name]), statistics.median(cpu_times[name])
        rows.append(
            f"| {name} | {with_grad / 2**20:,.0f} | {full_mem[0] / with_grad:.1f}x | "
            f"{without / 2**20:,.0f} | {full_mem[1] / without:.1f}x | {median:.2f} | "
            f"{median / full_time:.2f} | {cpu:.2f} | {cpu / full_cpu:.2f} | "
            f"{', '.join(f'{t:.2f}' for t in times[name])} |"
        )
    grad_bytes = weight.numel() * weight.element_size()
    grad_mib = grad_bytes / 2**20
    chunk_rows = LinearCrossEntropyLoss(args.chunks).rows_per_chunk(args.seq, grad_bytes)
    chunking = f"--chunks {args.chunks} " if args.chunks else ""
    how = f"num_chunks={args.chunks}" if args.chunks else "the default chunking"
    linear_mem = memory["linear CE"]
    linear_time = statistics.median(times["linear CE"]) / full_time
    linear_cpu = statistics.median(cpu_times["linear CE"]) / full_cpu
    verdict = f"""## Against the targets (issue #6)

- Peak cut >= 5x: **{full_mem[1] / linear_mem[1]:.1f}x** on what the loss step adds besides the
  weight gradient; **{full_mem[0] / linear_mem[0]:.1f}x** counting that gradient too. Counting
  it, no loss can go below the gradient itself ({grad_mib:,.0f} MiB): full logits peak at
  {full_mem[0] / grad_bytes:.1f} gradients' worth, which bounds that ratio whatever linear CE does.
- At most 10% slower than full logits: linear CE takes **{linear_time:.2f}x** the full-logits
  step by the wall clock ({linear_cpu:.2f}x by CPU time): its gradients come out of the forward
  chunks (3 matmuls, as full logits), where the recompute variant needs 4.
"""
    return f"""# Linear cross-entropy vs full logits: loss-step peak memory and time

`python benchmarks/linear_ce.py --vocab {args.vocab} --hidden {args.hidden} --seq {args.seq} \
{chunking}--repeats {args.repeats} --threads {args.threads}` ({minutes:.1f} min)

- Loss step: forward + backward of the token-mean cross-entropy of `hidden @ weight.T`,
  `hidden` [1 x {args.seq}, {args.hidden}], `weight` [{args.vocab}, {args.hidden}], float32,
  both requiring grad, all {args.seq} positions trained (linear CE drops no row here).
- Linear CE: {how}, {-(-args.seq // chunk_rows)} chunks of {chunk_rows} rows (a {chunk_rows} x {args.vocab} float32
  logits block, {chunk_rows * args.vocab * 4 / 2**20:,.0f} MiB). `recompute` is the same loss with
  `grad_in_forward=False` (backward recomputes each chunk's logits: 4 matmuls instead of 3).
- Machine: {machine()}; {args.threads} intra-op thread(s); Python {platform.python_version()},
  torch {torch.__version__}; run {datetime.date.today().isoformat()}. The machine was shared
  with other jobs: the per-round times show the noise.

| loss | peak MiB (with weight grad) | full / this | peak MiB (without) | full / this | median step s | vs full | median CPU s per thread | vs full | step s per round |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

- **Peak**: the most bytes of tensors created during the step alive at once
  (`LiveTensorBytes`, op by op); `hidden`, `weight` and the labels exist before and are not
  counted. **With weight grad**: the weight's gradient ({grad_mib:,.0f} MiB, float32
  `[vocab, h]`), which both ways produce and which outlives the step as `weight.grad`, is
  inside the number. **Without**: every `[vocab, h]`-shaped tensor is left out, i.e. what the
  loss step costs on top of the gradient it must produce.
- **Time**: the ways take turns in each round (after a warm-up step each for the memory
  count), so a load change on the shared machine hits them alike; median over rounds, by the
  wall clock and by this process's CPU time per thread (which other jobs on a shared machine
  barely move).

{verdict}"""


if __name__ == "__main__":
    main()
