"""Linear cross-entropy's chunk step, eager (in place on one reused block of logits) against
inductor-compiled (``LinearCrossEntropyLoss(compile=True)``): time and peak memory, side by
side in one run, at the ladder's shape (2048 trained rows, hidden 768, vocab 32000, fp32).

Usage::

    python benchmarks/linear_ce_compile.py            # writes results/linear_ce_compile.md
"""

from __future__ import annotations

import datetime
import platform
import time
from pathlib import Path

import torch
from sft_ladder import machine

from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.training.memory.usage import AllocatedBytes

ROWS, HIDDEN, VOCAB, THREADS, REPEATS = 2048, 768, 32000, 2, 5


def measure(compile: bool, hidden, weight, labels) -> tuple[float, int]:
    """Best forward+backward seconds over ``REPEATS`` (after two warm-ups) and the peak."""
    loss_fn = LinearCrossEntropyLoss(compile=compile)

    def step() -> None:
        loss_fn(hidden, weight, labels).backward()
        hidden.grad = weight.grad = None

    for _ in range(2):
        step()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    with AllocatedBytes() as mem:
        step()
    return best, mem.peak


def main() -> None:
    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (ROWS,))
    rows = []
    for _ in range(2):  # interleaved twice: a busy machine shows as a spread
        for compile in (False, True):
            rows.append((compile, *measure(compile, hidden, weight, labels)))
    eager = min(s for c, s, _ in rows if not c)
    lines = ["| chunk step | best s | vs eager | peak MiB |", "|---|---:|---:|---:|"]
    for compile, seconds, peak in rows:
        name = "inductor-compiled" if compile else "eager, in place"
        lines.append(f"| {name} | {seconds:.3f} | {seconds / eager:.2f}x | {peak / 2**20:,.0f} |")
    chunk = LinearCrossEntropyLoss().rows_per_chunk(ROWS, VOCAB * HIDDEN * 4)
    text = f"""# Linear cross-entropy: eager chunk step vs inductor-compiled

`python benchmarks/linear_ce_compile.py` — forward + backward of `LinearCrossEntropyLoss`
(default chunking: {chunk} rows per chunk) on {ROWS} trained rows, hidden {HIDDEN}, vocab {VOCAB},
fp32, {THREADS} threads; best of {REPEATS} after two warm-ups, each kind measured twice,
interleaved. Peak: the CPU allocator's peak above the inputs (`AllocatedBytes`).

- Machine: {machine()}; Python {platform.python_version()}, torch {torch.__version__};
  run {datetime.date.today().isoformat()}. GPU: not run (no device was lent to this task).

{chr(10).join(lines)}

The eager step turns each chunk's logits into their gradient in place in one reused block;
inductor's kernels write new buffers (two more chunks of logits) and run no faster, since the
matmuls dominate the step. So `compile_loss` leaves a linear cross-entropy eager;
`LinearCrossEntropyLoss(compile=True)` still compiles its chunk step.
"""
    print(text)
    (Path(__file__).resolve().parent / "results" / "linear_ce_compile.md").write_text(text)


if __name__ == "__main__":
    main()
