"""MoE layer forward + backward on CPU: the old per-expert Python loop vs the grouped path
and the other exact ways to run the experts.

All run the same routing (``MoE.route``, sort by expert, weighted ``index_add``) on the
same weights; they differ only in the experts:

- **loop** (the layer before issue #16, kept here only as the baseline): one
  ``FeedForward`` (three ``nn.Linear``) per expert in a ``ModuleList``, a Python loop over the
  experts on ``split(counts.tolist())`` slices (a host sync per layer), outputs concatenated.
- **grouped**: :class:`~tunesmith.modules.moe.GroupedExperts`, stacked ``[E, ...]`` weights,
  three ``torch._grouped_mm`` calls over the sorted tokens (``counts`` stays a tensor). The
  default wherever the kernel takes the operands (float32/bfloat16 rows of 16-byte multiples).
- **stacked loop**: ``GroupedExperts``' fallback, a loop over ``unbind``-ed stacked weights on
  ``split(counts.tolist())`` slices (on CPU reading ``counts`` costs no device sync).
- **manual loop**: the same loop in one ``autograd.Function`` whose backward writes each
  expert's gradients straight into ``[E, ...]`` buffers (no per-expert autograd nodes, no
  ``cat``/``stack`` copies); gate and up activations are kept from the forward.
- **padded bmm**: tokens scattered into a zero-padded ``[E, max_count, hidden]`` buffer,
  three ``bmm`` calls, rows gathered back (the padding is wasted FLOPs).

``FLOP bound`` is the experts' FLOPs (3 matmuls forward, 6 backward) at the rate of one dense
float32 matmul of the same total size, measured on the spot: no exact way beats it, so
``old loop / FLOP bound`` is the most any expert path could gain.

The step is ``out, _ = moe(x); (out * g).sum().backward()`` with ``x`` and all weights
requiring grad (full fine-tuning). The two ways take turns in every round (after a warm-up
step each) so load changes on a shared machine hit both alike; the table gives the median
wall time and the median CPU time of this process per thread, and the outputs and gradients
of the two are compared (max abs difference).

**Per family** (``--families``): tokens/s of a training step (forward + backward, every
weight and the input requiring grad) of one MoE layer *as the family builds it* (its router,
experts, shared experts: ``tunesmith.models.builder``'s layer for its first MoE layer) at its
largest shipped size's routing (experts, top-k) with hidden and expert widths divided by
``--scale``, grouped experts (``torch._grouped_mm``) vs the per-expert loop (the same layer
with the grouped kernel switched off: ``GroupedExperts``' loop over experts). A new family is
a row by naming it: ``--families mixtral,qwen3_moe,deepseek_v3``.

Usage::

    python benchmarks/moe.py                      # writes results/moe.md
    python benchmarks/moe.py --sizes 512x256x128 --rounds 3 --no-write
    python benchmarks/moe.py --families mixtral,qwen3_moe,deepseek_v3 --sizes ""  # rows only

``--sizes ''`` measures the family rows alone and keeps the file's other table (and
``--families ''`` the reverse).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from sft_ladder import machine
from torch import nn

from tunesmith.models import builder, zoo
from tunesmith.models.spec import ModelSpec
from tunesmith.modules import moe as moe_module
from tunesmith.modules.feed_forward import FeedForward
from tunesmith.modules.moe import MoE

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ((8, 2), (8, 8), (64, 2), (64, 8))  # (experts, top-k)
WAYS = ("old loop", "grouped", "stacked loop", "manual loop", "padded bmm")
FAMILIES = "mixtral,qwen3_moe"
FAMILY_HEADING = (
    "## Per family: a training step of one MoE layer, grouped experts vs a per-expert loop"
)


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


def stacked_loop(x, counts, gate, up, down):
    """``GroupedExperts``' fallback: a loop over ``unbind``-ed stacked weights."""
    outputs = []
    chunks = x.split(counts.tolist())
    for chunk, g, u, d in zip(chunks, gate.unbind(), up.unbind(), down.unbind(), strict=True):
        if chunk.shape[0]:
            outputs.append((F.silu(chunk @ g.T) * (chunk @ u.T)) @ d.T)
    return torch.cat(outputs) if outputs else x.new_zeros(x.shape)


class _ManualLoop(torch.autograd.Function):
    """The per-expert loop with a hand-written backward into ``[E, ...]`` gradient buffers."""

    @staticmethod
    def forward(ctx, x, sizes, gate, up, down):
        out = x.new_empty(x.shape)
        kept = []
        for chunk, o, g, u, d in zip(x.split(sizes), out.split(sizes), gate, up, down):
            if chunk.shape[0]:
                a, b = chunk @ g.T, chunk @ u.T
                torch.mm(F.silu(a) * b, d.T, out=o)
                kept.append((a, b))
            else:
                kept.append(None)
        ctx.save_for_backward(x, gate, up, down)
        ctx.kept, ctx.sizes = kept, sizes
        return out

    @staticmethod
    def backward(ctx, dy):
        x, gate, up, down = ctx.saved_tensors
        sizes = ctx.sizes
        dx = torch.empty_like(x)
        dgate, dup, ddown = torch.zeros_like(gate), torch.zeros_like(up), torch.zeros_like(down)
        parts = zip(x.split(sizes), dy.split(sizes), dx.split(sizes), ctx.kept, strict=True)
        for e, (chunk, dyc, dxc, kept) in enumerate(parts):
            if kept is None:
                continue
            a, b = kept
            sig = torch.sigmoid(a)
            act = a * sig
            torch.mm(dyc.T, act * b, out=ddown[e])
            dh = dyc @ down[e]
            db = dh * act
            da = dh * b * (sig * (1 + a * (1 - sig)))
            torch.mm(da.T, chunk, out=dgate[e])
            torch.mm(db.T, chunk, out=dup[e])
            torch.mm(da, gate[e], out=dxc)
            dxc.addmm_(db, up[e])
        return dx, None, dgate, dup, ddown


def manual_loop(x, counts, gate, up, down):
    return _ManualLoop.apply(x, counts.tolist(), gate, up, down)


def padded_bmm(x, counts, gate, up, down):
    """Tokens into a zero-padded ``[E, max_count, hidden]`` buffer, three ``bmm`` calls."""
    experts, longest = counts.shape[0], int(counts.max())
    steps = torch.arange(longest)
    real = steps[None] < counts[:, None]
    rows = (torch.arange(experts)[:, None] * longest + steps[None]).masked_select(real)
    padded = x.new_zeros(experts * longest, x.shape[1]).index_copy(0, rows, x)
    padded = padded.view(experts, longest, -1)
    h = F.silu(padded @ gate.transpose(1, 2)) * (padded @ up.transpose(1, 2))
    return (h @ down.transpose(1, 2)).reshape(experts * longest, -1).index_select(0, rows)


class Variant(nn.Module):
    """``base`` (a :class:`MoE`) with its experts run by ``way(x, counts, gate, up, down)``."""

    def __init__(self, base: MoE, way) -> None:
        super().__init__()
        self.base, self.way = base, way

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ex = self.base.experts
        ex.forward = lambda t, c: self.way(t, c, ex.gate_proj, ex.up_proj, ex.down_proj)
        try:
            return self.base(x)
        finally:
            del ex.forward


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


def grads(layer: nn.Module) -> torch.Tensor:
    if isinstance(layer, LoopMoE):
        parts = [
            torch.stack([_grad(getattr(e, n).weight) for e in layer.experts])
            for n in ("gate_proj", "up_proj", "down_proj")
        ]
    else:
        ex = layer.base.experts if isinstance(layer, Variant) else layer.experts
        parts = [_grad(ex.gate_proj), _grad(ex.up_proj), _grad(ex.down_proj)]
    return torch.cat([p.flatten() for p in parts])


def flop_bound(tokens: int, hidden: int, intermediate: int, top_k: int) -> float:
    """Seconds for the experts' 9 matmuls at the rate of one dense matmul of the same size."""
    a, b = torch.randn(tokens * top_k, hidden), torch.randn(hidden, 3 * intermediate)
    best = math.inf
    for _ in range(3):
        start = time.process_time()
        a @ b
        best = min(best, time.process_time() - start)
    return 3 * best  # forward: a @ b; backward: twice the forward's FLOPs


def run_case(
    experts: int, top_k: int, size: tuple[int, int, int], rounds: int
) -> dict[str, object]:
    tokens, hidden, intermediate = size
    torch.manual_seed(0)
    grouped = MoE(hidden, intermediate, num_experts=experts, top_k=top_k)
    layers = {
        "old loop": LoopMoE(grouped),
        "grouped": grouped,
        "stacked loop": Variant(grouped, stacked_loop),
        "manual loop": Variant(grouped, manual_loop),
        "padded bmm": Variant(grouped, padded_bmm),
    }
    x = torch.randn(1, tokens, hidden, requires_grad=True)
    g = torch.randn(1, tokens, hidden)
    # Check: same outputs and gradients as the old loop (whose router is the grouped layer's).
    reference: list[torch.Tensor] = []
    diffs: dict[str, float] = {}
    for name, layer in layers.items():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        out, _ = layer(x)
        (out * g).sum().backward()
        mine = [out.detach(), x.grad.clone(), grads(layer)]
        reference = reference or mine
        diffs[name] = max((a - b).abs().max().item() for a, b in zip(mine, reference))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in layers}
    for _ in range(rounds):
        for name, layer in layers.items():
            times[name].append(step(layer, x, g))
    threads = torch.get_num_threads()
    row: dict[str, object] = {"size": size, "experts": experts, "top_k": top_k}
    row["bound"] = flop_bound(tokens, hidden, intermediate, top_k) / threads
    for name, ts in times.items():
        row[f"{name}_wall"] = statistics.median(t[0] for t in ts)
        row[f"{name}_cpu"] = statistics.median(t[1] for t in ts) / threads
        row[f"{name}_diff"] = diffs[name]
    return row


def family_layer(family: str, scale: int) -> tuple[str, ModelSpec, nn.Module]:
    """The family's largest shipped MoE size, its spec with hidden and expert widths divided
    by ``scale``, and the MoE layer the builder makes for its first MoE layer (float32, CPU)."""
    sizes = zoo.FAMILY_FILES[family]
    moe_sizes = [(name, sizes.spec(name)) for name in sizes.SIZES if sizes.spec(name).is_moe]
    if not moe_sizes:
        raise SystemExit(f"--families: {family} ships no mixture-of-experts size")
    name, full = max(moe_sizes, key=lambda item: item[1].approx_parameters())
    small = full.replace(  # attention is not built: its sizes stay
        hidden_size=full.hidden_size // scale,
        moe_intermediate_size=full.moe_intermediate_size // scale,
        intermediate_size=max(1, full.intermediate_size // scale),
        torch_dtype=None,
    )
    layer_idx = next(i for i in range(small.num_hidden_layers) if small.is_moe_layer(i))
    torch.manual_seed(0)
    layer = builder._mlp(small, layer_idx)
    for p in layer.parameters():  # some families' routers start at zero (a bias)
        torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else torch.nn.init.normal_(p, std=0.1)
    return name, small, layer


@contextlib.contextmanager
def per_expert_loop() -> Iterator[None]:
    """``GroupedExperts`` without the grouped kernel: its loop over experts."""
    saved = moe_module.grouped_mm_supported
    moe_module.grouped_mm_supported = lambda *tensors: False
    try:
        yield
    finally:
        moe_module.grouped_mm_supported = saved


def _family_step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, loop: bool):
    with per_expert_loop() if loop else contextlib.nullcontext():
        elapsed = step(layer, x, g)
    mine = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    return elapsed, torch.cat([x.grad.flatten(), *(t.flatten() for t in mine)])


def run_family(family: str, tokens: int, scale: int, rounds: int) -> dict[str, object]:
    """Tokens per CPU-second (per thread) of a training step, grouped vs per-expert loop."""
    name, spec, layer = family_layer(family, scale)
    x = torch.randn(1, tokens, spec.hidden_size, requires_grad=True)
    g = torch.randn(1, tokens, spec.hidden_size)
    results = {mode: _family_step(layer, x, g, mode == "loop") for mode in ("grouped", "loop")}
    diff = (results["grouped"][1] - results["loop"][1]).abs().max().item()
    times: dict[str, list[float]] = {"grouped": [], "loop": []}
    for _ in range(rounds):
        for mode in times:
            times[mode].append(_family_step(layer, x, g, mode == "loop")[0][1])
    threads = torch.get_num_threads()
    rate = {mode: tokens / (statistics.median(ts) / threads) for mode, ts in times.items()}
    return {"family": family, "size": name, "spec": spec, "tokens": tokens, "scale": scale,
            "grouped": rate["grouped"], "loop": rate["loop"], "diff": diff}  # fmt: skip


def family_lines(rows: list[dict[str, object]], command: str, minutes: float) -> list[str]:
    lines = [
        FAMILY_HEADING,
        "",
        f"`{command}` ({minutes:.1f} min)",
        "",
        "- The layer each family builds (router, experts, shared experts) for its first MoE "
        "layer, at its largest shipped size's experts and top-k with hidden and expert widths "
        "divided by the scale; float32; step = forward + backward of `(out * g).sum()` with the "
        "input and every weight requiring grad. **grouped**: `torch._grouped_mm`; **loop**: "
        "the same layer and weights with the grouped kernel off (`GroupedExperts`' loop over "
        "experts). Tokens per CPU-second of this process per thread (median).",
        "- **max diff**: largest absolute difference of the input and weight gradients of the "
        "two (float32 rounding only).",
        "",
        "| family | shipped size | scale | tokens x hidden x expert inter | experts | top-k | "
        "grouped tok/s | loop tok/s | grouped vs loop | max diff |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s = r["spec"]
        lines.append(
            f"| {r['family']} | {r['size']} | 1/{r['scale']} | {r['tokens']}x{s.hidden_size}x"
            f"{s.moe_intermediate_size} | {s.num_experts} | {s.num_experts_per_tok} | "
            f"{r['grouped']:.0f} | {r['loop']:.0f} | {r['grouped'] / r['loop']:.2f}x | "
            f"{r['diff']:.1e} |"
        )
    return lines


def _size(text: str) -> tuple[tuple[int, int, int], tuple[tuple[int, int], ...]]:
    """``TxHxI`` (the four default cases) or ``TxHxI:E/k`` (that case only)."""
    shape, _, case = text.partition(":")
    tokens, hidden, intermediate = (int(v) for v in shape.split("x"))
    cases = CASES if not case else ((int(case.split("/")[0]), int(case.split("/")[1])),)
    return (tokens, hidden, intermediate), cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        default="2048x1024x384,1024x512x192:128/8,256x128x64",
        help="comma-separated TOKENSxHIDDENxINTERMEDIATE[:EXPERTS/TOPK] (intermediate per "
        "expert); without :E/k the cases are " + ", ".join(f"{e}/{k}" for e, k in CASES),
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--families",
        default=FAMILIES,
        help="comma-separated family names (tunesmith.models.zoo) for the per-family rows; "
        "'' for none",
    )
    parser.add_argument("--tokens", type=int, default=512, help="tokens per family step")
    parser.add_argument("--scale", type=int, default=8, help="family widths divided by this")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    family_start = time.perf_counter()
    family_rows = []
    for family in filter(None, args.families.split(",")):
        row = run_family(family, args.tokens, args.scale, args.rounds)
        family_rows.append(row)
        print(f"{family}: grouped {row['grouped']:.0f} tok/s, loop {row['loop']:.0f} tok/s")
    family_command = (
        f"python benchmarks/moe.py --sizes '' --families {args.families} --tokens {args.tokens} "
        f"--scale {args.scale} --rounds {args.rounds} --threads {args.threads}"
    )
    family_minutes = (time.perf_counter() - family_start) / 60
    start = time.perf_counter()
    rows = []
    for text in filter(None, args.sizes.split(",")):
        size, cases = _size(text)
        for experts, top_k in cases:
            row = run_case(experts, top_k, size, args.rounds)
            rows.append(row)
            print(
                f"{size} E={experts} k={top_k} CPU s/thread: bound {row['bound']:.3f} "
                + " ".join(f"{w} {row[f'{w}_cpu']:.3f}" for w in WAYS),
                flush=True,
            )
    minutes = (time.perf_counter() - start) / 60
    command = (
        f"python benchmarks/moe.py --sizes {args.sizes} --rounds {args.rounds} "
        f"--threads {args.threads}"
    )
    lines = [
        "# MoE layer forward + backward on CPU: the old per-expert loop vs the exact ways to "
        "run stacked experts",
        "",
        f"`{command}` ({minutes:.1f} min)",
        "",
        "- One MoE layer, float32; sizes are tokens x hidden x expert intermediate; step = "
        "forward + backward of `(out * g).sum()` with the input and every weight requiring "
        "grad. Same router, routing and combine every way. 1024x512x192 with 128 experts "
        "top-8 is Qwen3-30B-A3B's routing with its per-expert shape (2048x768) scaled by 1/4.",
        "- **old loop**: the layer before issue #16 (a `ModuleList` of `FeedForward` experts "
        "run in a Python loop on `split(counts.tolist())`). **grouped**: `GroupedExperts`' "
        "default (`torch._grouped_mm`, no host sync). **stacked loop**: its fallback (loop "
        "over `unbind`-ed stacked weights). **manual loop**: the loop in one "
        "`autograd.Function` writing gradients into `[E, ...]` buffers. **padded bmm**: "
        "zero-padded `[E, max_count, hidden]` and `bmm`. See the module docstring.",
        "- **FLOP bound**: the experts' FLOPs at the rate of one dense matmul of the same total "
        "size (no exact way can beat it); **max gain** = old loop / FLOP bound.",
        f"- Machine: {machine()}; {args.threads} intra-op thread(s); torch {torch.__version__}; "
        f"run {datetime.date.today()}. The machine was shared with other jobs, so the table "
        "gives the median CPU time of this process per thread (steadier than wall time).",
        "- **max diff**: the largest absolute difference to the old loop over the output, the "
        "input gradient and the expert weight gradients (float32 rounding only).",
        "",
        "| tokens x hidden x inter | experts | top-k | FLOP bound s | "
        + " | ".join(f"{w} s" for w in WAYS)
        + " | grouped vs old loop | max gain | max diff |",
        "|---|---:|---:|---:|" + "---:|" * len(WAYS) + "---:|---:|---:|",
    ]
    for r in rows:
        size = "x".join(str(v) for v in r["size"])
        diff = max(r[f"{w}_diff"] for w in WAYS)
        lines.append(
            f"| {size} | {r['experts']} | {r['top_k']} | {r['bound']:.3f} | "
            + " | ".join(f"{r[f'{w}_cpu']:.3f}" for w in WAYS)
            + f" | {r['old loop_cpu'] / r['grouped_cpu']:.2f}x "
            f"| {r['old loop_cpu'] / r['bound']:.2f}x | {diff:.1e} |"
        )
    ways = "\n".join(lines) + "\n" if rows else None
    families = "\n".join(family_lines(family_rows, family_command, family_minutes)) + "\n"
    text = merged_results(ways, families if family_rows else None)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "moe.md").write_text(text)


def merged_results(ways: str | None, families: str | None) -> str:
    """results/moe.md with the parts this run measured, the other part kept from the file
    (``--sizes ''`` re-measures the family rows alone, ``--families ''`` the ways alone)."""
    old = (RESULTS / "moe.md").read_text() if (RESULTS / "moe.md").is_file() else ""
    old_ways, marker, old_families = old.partition(FAMILY_HEADING)
    ways = ways if ways is not None else old_ways.rstrip("\n") + "\n"
    families = families if families is not None else (marker + old_families if marker else "")
    return ways + ("\n" + families if families else "")


if __name__ == "__main__":
    main()
