"""MoE layer forward + backward on CPU: the old per-expert Python loop vs the grouped path.

Both run the same routing (``MoE.route``, sort by expert, weighted ``index_add``) on the
same weights; they differ only in the experts:

- **loop** (the layer before issue #16, kept here only as the baseline): one
  ``FeedForward`` (three ``nn.Linear``) per expert in a ``ModuleList``, a Python loop over the
  experts on ``split(counts.tolist())`` slices (a host sync per layer), outputs concatenated.
- **grouped**: :class:`~tunesmith.modules.moe.GroupedExperts`, stacked ``[E, ...]`` weights,
  three ``torch._grouped_mm`` calls over the sorted tokens (``counts`` stays a tensor).

The step is ``out, _ = moe(x); (out * g).sum().backward()`` with ``x`` and all weights
requiring grad (full fine-tuning). The two ways take turns in every round (after a warm-up
step each) so load changes on a shared machine hit both alike; the table gives the median
wall time and the median CPU time of this process per thread, and the outputs and gradients
of the two are compared (max abs difference).

Usage::

    python benchmarks/moe.py                      # writes results/moe.md
    python benchmarks/moe.py --sizes 512x256x128 --rounds 3 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import torch
from sft_ladder import machine
from torch import nn

from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.moe import MoE

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ((8, 2), (8, 8), (64, 2), (64, 8))  # (experts, top-k)


class LoopMoE(nn.Module):
    """The pre-#16 layer: a router and a ``ModuleList`` of experts run one by one."""

    def __init__(self, grouped: MoE) -> None:
        super().__init__()
        self.top_k, self.num_experts = grouped.top_k, grouped.num_experts
        self.route = grouped.route  # the same router (and its weight)
        ex = grouped.experts
        self.experts = nn.ModuleList(
            FeedForward(ex.hidden_size, ex.intermediate_size) for _ in range(self.num_experts)
        )
        with torch.no_grad():
            for i, expert in enumerate(self.experts):
                expert.gate_proj.weight.copy_(ex.gate_proj[i])
                expert.up_proj.weight.copy_(ex.up_proj[i])
                expert.down_proj.weight.copy_(ex.down_proj[i])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(tokens)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        token_idx = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        outputs = []
        for expert, chunk in zip(self.experts, tokens[token_idx].split(counts), strict=True):
            if chunk.shape[0]:
                outputs.append(expert(chunk))
        expert_out = torch.cat(outputs) * weights.flatten()[order, None]
        out = torch.zeros_like(tokens).index_add_(0, token_idx, expert_out)
        return out.reshape(shape), logits


def step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[float, float]:
    x.grad = None
    for p in layer.parameters():
        p.grad = None
    wall, cpu = time.perf_counter(), time.process_time()
    out, _ = layer(x)
    (out * g).sum().backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def _grad(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad  # an expert with no token


def grads(layer: nn.Module, grouped: bool) -> torch.Tensor:
    if grouped:
        ex = layer.experts
        parts = [ex.gate_proj.grad, ex.up_proj.grad, ex.down_proj.grad]
    else:
        parts = [
            torch.stack([_grad(getattr(e, n).weight) for e in layer.experts])
            for n in ("gate_proj", "up_proj", "down_proj")
        ]
    return torch.cat([p.flatten() for p in parts])


def run_case(
    experts: int, top_k: int, size: tuple[int, int, int], rounds: int
) -> dict[str, object]:
    tokens, hidden, intermediate = size
    torch.manual_seed(0)
    grouped = MoE(hidden, intermediate, num_experts=experts, top_k=top_k)
    loop = LoopMoE(grouped)
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    g = torch.randn(1, tokens, hidden)
    # Check: same outputs and gradients (the loop's router is the grouped layer's own).
    out_l, _ = loop(x)
    out_g, _ = grouped(x)
    (out_l * g).sum().backward()
    gl, xl = grads(loop, False), x.grad.clone()
    x.grad = None
    grouped.gate.weight.grad = None
    (out_g * g).sum().backward()
    gg, xg = grads(grouped, True), x.grad.clone()
    diff = max(
        (out_l - out_g).abs().max().item(),
        (gl - gg).abs().max().item(),
        (xl - xg).abs().max().item(),
    )
    times: dict[str, list[tuple[float, float]]] = {"loop": [], "grouped": []}
    for _ in range(rounds):
        for name, layer in (("loop", loop), ("grouped", grouped)):
            times[name].append(step(layer, x, g))
    threads = torch.get_num_threads()
    row: dict[str, object] = {"size": size, "experts": experts, "top_k": top_k, "diff": diff}
    for name, ts in times.items():
        row[f"{name}_wall"] = statistics.median(t[0] for t in ts)
        row[f"{name}_cpu"] = statistics.median(t[1] for t in ts) / threads
        row[f"{name}_rounds"] = ", ".join(f"{t[0]:.3f}" for t in ts)
    return row


def _size(text: str) -> tuple[int, int, int]:
    tokens, hidden, intermediate = (int(v) for v in text.split("x"))
    return tokens, hidden, intermediate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="2048x1024x384,256x128x64",
        help="comma-separated TOKENSxHIDDENxINTERMEDIATE (intermediate per expert)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [_size(s) for s in args.sizes.split(",")]
    start = time.perf_counter()
    rows = []
    for size in sizes:
        for experts, top_k in CASES:
            row = run_case(experts, top_k, size, args.rounds)
            rows.append(row)
            print(
                f"{size} E={experts} k={top_k}: loop {row['loop_wall']:.3f}s grouped "
                f"{row['grouped_wall']:.3f}s ({row['loop_wall'] / row['grouped_wall']:.2f}x) "
                f"cpu/thread {row['loop_cpu']:.3f} vs {row['grouped_cpu']:.3f} "
                f"diff {row['diff']:.1e}",
                flush=True,
            )
    minutes = (time.perf_counter() - start) / 60
    command = (
        f"python benchmarks/moe.py --sizes {args.sizes} --rounds {args.rounds} "
        f"--threads {args.threads}"
    )
    lines = [
        "# MoE layer forward + backward: per-expert loop vs grouped experts (CPU)",
        "",
        f"`{command}` ({minutes:.1f} min)",
        "",
        "- One MoE layer, float32; sizes are tokens x hidden x expert intermediate; step = "
        "forward + backward of `(out * g).sum()` with the input and every weight requiring "
        "grad. Same router, routing and combine both ways.",
        "- **loop**: the layer before issue #16 (a `ModuleList` of `FeedForward` experts run in "
        "a Python loop on `split(counts.tolist())`). **grouped**: `GroupedExperts` "
        "(stacked `[E, ...]` weights, `torch._grouped_mm`, no host sync).",
        f"- Machine: {machine()}; {args.threads} intra-op thread(s); torch {torch.__version__}; "
        f"run {datetime.date.today()}. The machine was shared with other jobs: the per-round "
        "times show the noise; CPU time per thread is the steadier number.",
        "- **max diff**: the largest absolute difference between the two ways over the output, "
        "the input gradient and the expert weight gradients (float32 rounding only).",
        "",
        "| tokens x hidden x inter | experts | top-k | loop step s | grouped step s | speed-up "
        "| loop CPU s/thread | grouped CPU s/thread | CPU speed-up | max diff | loop s per round "
        "| grouped s per round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        size = "x".join(str(v) for v in r["size"])
        lines.append(
            f"| {size} | {r['experts']} | {r['top_k']} | {r['loop_wall']:.3f} "
            f"| {r['grouped_wall']:.3f} | {r['loop_wall'] / r['grouped_wall']:.2f}x "
            f"| {r['loop_cpu']:.3f} | {r['grouped_cpu']:.3f} "
            f"| {r['loop_cpu'] / r['grouped_cpu']:.2f}x | {r['diff']:.1e} "
            f"| {r['loop_rounds']} | {r['grouped_rounds']} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "moe.md").write_text(text)


if __name__ == "__main__":
    main()
