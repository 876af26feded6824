"""SFT ablation ladder: throughput, MFU and peak memory as each switch is added.

Rungs (each adds one switch to the rung above, so the last one has them all):
baseline (padded batches, eager, full logits + cross-entropy, AdamW) -> +packing ->
+compile -> +linear CE -> +activation checkpointing -> +optimizer in backward -> +8-bit AdamW.

Every rung runs in a fresh subprocess on the same variable-length synthetic data and a random
Llama-style model: one warm-up step (its time includes compilation), ``--steps`` timed steps,
then one untimed step on the longest batch under the live-tensor counter. Reported per rung:

* tokens/s: real (non-padding) tokens per second of the timed steps;
* MFU: model FLOPs per second / the fp32 matmul peak this script measures on this machine
  (best of several ``n x n`` matmuls at the same thread count). Model FLOPs of a batch are
  ``6 * N * T`` for ``T`` real tokens and ``N`` matmul parameters (every weight matrix but
  the embedding lookup; a tied head counts once, as the output projection) plus causal
  attention ``6 * L * nh * hd * l^2`` per document of length ``l``, i.e. useful work only
  (no padding, no recomputation);
* peak memory: weights + optimizer states + the CPU allocator's peak during the step
  (``tunesmith.training.memory.usage.AllocatedBytes``) and where that peak sits, the memory
  planner's estimate for that batch, and the process's peak resident set over the training
  steps after the warm-up (``VmHWM``, reset once compilation is done) above its resident set
  after imports.

Usage::

    python benchmarks/sft_ladder.py                     # CPU preset, writes results/sft_ladder.md
    python benchmarks/sft_ladder.py --preset 100m       # ~100M parameters at seq 1024 (slow on CPU)
    python benchmarks/sft_ladder.py --rungs baseline +packing --steps 2 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from machine_info import machine

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"  # sft_ladder.md (cpu preset), sft_ladder_100m.md

LLAMA_100M = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": False,
}  # fmt: skip
PRESETS = {
    # the 100M shape with 4 of its 12 layers, at seq 512: the whole ladder in < 10 min on 2 cores
    "cpu": {"config": {**LLAMA_100M, "num_hidden_layers": 4}, "seq_len": 512, "batch_size": 2},
    "100m": {"config": LLAMA_100M, "seq_len": 1024, "batch_size": 2},
}
RUNGS = {
    "baseline": {},
    "+packing": {"packed": True},
    "+compile": {"compile": True},
    "+linear CE": {"linear_ce": True},
    "+activation checkpointing": {"checkpointing": True},
    "+optimizer in backward": {"in_backward": True},
    "+8-bit AdamW": {"eight_bit": True},
}


@dataclass
class RungResult:
    rung: str
    tokens_per_s: float
    flops_per_s: float
    step_s: float
    slowest_tokens_per_s: float
    fastest_tokens_per_s: float
    first_step_s: float
    live_peak: int
    peak_at: str
    estimate: int
    rss_peak: int
    rss_base: int
    params: int
    gradients: int
    matmul_peak: float


# -- data ------------------------------------------------------------------------------------


def synthetic_samples(n: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` samples whose lengths follow a long-tailed (log-normal) law, as chat data does:
    median about seq_len / 5, clipped to [16, seq_len]; every token is trained."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = int(min(seq_len, max(16, rng.lognormvariate(0, 0.8) * seq_len / 5)))
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        samples.append({"input_ids": ids, "labels": ids[1:] + [-100]})
    return samples


def _doc_lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    if "document_ids" in batch:
        lengths = []
        for row in batch["document_ids"].tolist():
            for doc in sorted(set(row) - {-1}):
                lengths.append(row.count(doc))
        return lengths
    return batch["attention_mask"].sum(dim=1).tolist()


# -- one rung, in a fresh process ---------------------------------------------------------------


def _status_bytes(field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    """Start ``VmHWM`` again from the current resident set (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def run_rung(preset: str, rung_index: int, steps: int, threads: int) -> RungResult:
    """Train ``steps`` + 2 steps with the switches of rungs 0..rung_index; measure."""
    from tunesmith.data import PackedDataset, collate_packed, collate_padded
    from tunesmith.models import build_model
    from tunesmith.models.spec import spec_from_hf_config
    from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
    from tunesmith.training.memory.activations import apply_activation_checkpointing
    from tunesmith.training.memory.compile import compile_loss, compile_model
    from tunesmith.training.memory.optim_in_backward import OptimizerInBackward
    from tunesmith.training.memory.planner import estimate_memory
    from tunesmith.training.memory.preflight import longest_batch
    from tunesmith.training.memory.usage import AllocatedBytes, storage_bytes

    torch.set_num_threads(threads)
    rss_base = _status_bytes("VmRSS")
    names = list(RUNGS)[: rung_index + 1]
    on = {key: True for name in names for key in RUNGS[name]}
    setup = PRESETS[preset]
    seq_len, batch_size = setup["seq_len"], setup["batch_size"]

    torch.manual_seed(0)
    spec = spec_from_hf_config(setup["config"])
    model = build_model(spec)
    samples = synthetic_samples(200, seq_len, spec.vocab_size)
    if on.get("packed"):
        dataset = PackedDataset(samples, seq_len, pad_id=0)
        collate = collate_packed
    else:
        dataset = samples
        collate = partial(collate_padded, pad_id=0)
    order = list(range(len(dataset)))
    random.Random(1).shuffle(order)
    batches = [
        collate([dataset[i] for i in order[k : k + batch_size]])
        for k in range(0, (steps + 1) * batch_size, batch_size)
    ]
    peak_batch = longest_batch(dataset, batch_size, collate)

    if on.get("checkpointing"):
        apply_activation_checkpointing(model, mode="full")
    loss_fn = LinearCrossEntropyLoss() if on.get("linear_ce") else CrossEntropyLoss()
    if on.get("compile"):
        compile_model(model)
        loss_fn = compile_loss(loss_fn)
    params = [p for p in model.parameters() if p.requires_grad]
    if on.get("eight_bit"):
        from bitsandbytes.optim import AdamW8bit

        factory = partial(AdamW8bit, lr=1e-5)
    else:
        factory = partial(torch.optim.AdamW, lr=1e-5)
    optimizer = OptimizerInBackward(params, factory) if on.get("in_backward") else factory(params)

    def train_step(batch: dict[str, torch.Tensor]) -> None:
        inputs = {"position_ids": batch["position_ids"]}
        if "document_ids" in batch:
            inputs["document_ids"] = batch["document_ids"]
        if on.get("linear_ce"):
            hidden = model(batch["input_ids"], **inputs, return_hidden_states=True)
            loss = loss_fn(hidden, model.lm_head.weight, batch["labels"])
        else:
            loss = loss_fn(model(batch["input_ids"], **inputs), batch["labels"])
        (loss / (batch["labels"] != -100).sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = time.perf_counter()
    train_step(batches[0])
    first_step_s = time.perf_counter() - start
    _reset_peak_rss()  # the peak of the training steps, not of compiling them
    matmul_peak = matmul_peak_flops(threads)  # this process's measurement, just before
    tokens, flops, seconds, rates = 0, 0.0, 0.0, []
    matmul_params = _matmul_params(model)
    attn = 6 * spec.num_hidden_layers * spec.num_attention_heads * spec.head_dim
    for batch in batches[1:]:
        start = time.perf_counter()
        train_step(batch)
        elapsed = time.perf_counter() - start
        lengths = _doc_lengths(batch)
        seconds += elapsed
        tokens += sum(lengths)
        rates.append(sum(lengths) / elapsed)
        flops += 6 * matmul_params * sum(lengths) + attn * sum(n * n for n in lengths)

    resident = storage_bytes([*model.parameters(), *model.buffers(), *_state_tensors(optimizer)])
    with AllocatedBytes() as mem:
        train_step(peak_batch)
    b, s = peak_batch["input_ids"].shape
    plan = estimate_memory(
        model,
        batch_size=b,
        seq_len=s,
        optimizer="adamw8bit" if on.get("eight_bit") else "adamw",
        activation_checkpointing="full" if on.get("checkpointing") else None,
        loss=loss_fn if on.get("linear_ce") else "full",
        optimizer_in_backward=bool(on.get("in_backward")),
        packed=bool(on.get("packed")),
    )
    rss_peak = _status_bytes("VmHWM")
    return RungResult(
        rung=names[-1],
        tokens_per_s=tokens / seconds,
        flops_per_s=flops / seconds,
        step_s=seconds / steps,
        slowest_tokens_per_s=min(rates),
        fastest_tokens_per_s=max(rates),
        first_step_s=first_step_s,
        matmul_peak=matmul_peak,
        live_peak=resident + mem.peak,
        peak_at=peak_label(mem.peak_op),
        estimate=plan.total,
        rss_peak=rss_peak,
        rss_base=rss_base,
        params=sum(p.numel() for p in model.parameters()),
        gradients=sum(p.numel() * p.element_size() for p in params),
    )


def peak_label(ops: str) -> str:
    """A short name for where a peak sits, from :attr:`AllocatedBytes.peak_op`'s op chain:
    the phase, the autograd node or top-level op, the optimizer, and the allocating op."""
    parts = ["compiled graph" if "CompiledFxGraph" in p else p for p in ops.split(" > ")]
    engine = "autograd::engine::evaluate_function: "
    phase = "backward" if parts[0].startswith(engine) else "forward"
    words = [parts[0].removeprefix(engine).removeprefix("torch::autograd::")]
    words += [p.split("#")[-1] for p in parts if p.startswith("Optimizer.step#")]
    if phase == "forward" and words[0].startswith("Optimizer.step#"):
        phase, words = "step", words[1:]
    allocating = [p for p in parts[1:] if not p.startswith(("aten::empty", "aten::zeros"))]
    return f"{phase}: {' / '.join(words + allocating[-1:])}"


def _matmul_params(model: torch.nn.Module) -> int:
    """Parameters used in matmuls: every 2-D weight but the embedding (a tied head is the
    embedding matrix, counted once as the output projection)."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not embed)
    return total + model.lm_head.weight.numel() * (model.lm_head.weight is embed)


def _state_tensors(optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]


# -- the parent: matmul peak, rungs in subprocesses, the table ----------------------------------


def matmul_peak_flops(threads: int, n: int = 2048, repeats: int = 7) -> float:
    """Best fp32 FLOP/s of an ``n x n`` matmul on ``threads`` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return 2 * n**3 / best


def run_child(preset: str, index: int, steps: int, threads: int, cache_dir: str) -> RungResult:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # a fixed mmap threshold: freed tensors go back to the OS (glibc otherwise raises the
    # threshold and keeps freed activations resident), so the resident set follows the tensors
    env.update(
        OMP_NUM_THREADS=str(threads),
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TORCHINDUCTOR_COMPILE_THREADS="1",
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    command = [sys.executable, __file__, "--child", str(index), "--preset", preset,
               "--steps", str(steps), "--threads", str(threads)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"rung {list(RUNGS)[index]} failed:\n{done.stderr[-4000:]}")
    return RungResult(**json.loads(done.stdout.strip().splitlines()[-1]))


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def table(results: list[RungResult], peak: float) -> str:
    lines = [
        "| rung | tokens/s | slowest-fastest step | MFU | step s | first step s "
        "| peak MiB | planner MiB | peak RSS added MiB | peak RSS MiB | peak at |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.rung} | {r.tokens_per_s:.0f} | {r.slowest_tokens_per_s:.0f}-"
            f"{r.fastest_tokens_per_s:.0f} | {r.flops_per_s / peak:.1%} | {r.step_s:.2f} | "
            f"{r.first_step_s:.1f} | {_mib(r.live_peak)} | {_mib(r.estimate)} | "
            f"{_mib(r.rss_peak - r.rss_base)} | {_mib(r.rss_peak)} | {r.peak_at} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per rung")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--rungs", nargs="+", choices=list(RUNGS), help="only these rungs")
    parser.add_argument("--no-write", action="store_true", help="do not write the results file")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child is not None:
        result = run_rung(args.preset, args.child, args.steps, args.threads)
        print(json.dumps(asdict(result)))
        return

    peak = matmul_peak_flops(args.threads)
    print(f"fp32 matmul peak ({args.threads} thread(s)): {peak / 1e9:.1f} GFLOP/s", flush=True)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="sft_ladder_inductor_") as cache_dir:
        for index, name in enumerate(RUNGS):
            if args.rungs and name not in args.rungs:
                continue
            result = run_child(args.preset, index, args.steps, args.threads, cache_dir)
            results.append(result)
            peak = max(peak, result.matmul_peak)
            print(
                f"{name}: {result.tokens_per_s:.0f} tokens/s, "
                f"MFU {result.flops_per_s / peak:.1%}, peak {_mib(result.live_peak)} MiB "
                f"({result.peak_at}), "
                f"first step {result.first_step_s:.1f} s",
                flush=True,
            )
    minutes = (time.perf_counter() - started) / 60
    # a shared machine: the machine's peak is the best of every measurement (before and after
    # the ladder here, and in each rung's process right before its timed steps)
    peak = max([peak, matmul_peak_flops(args.threads), *(r.matmul_peak for r in results)])
    print(table(results, peak))
    if not args.no_write:
        path = RESULTS / (
            "sft_ladder.md" if args.preset == "cpu" else f"sft_ladder_{args.preset}.md"
        )
        path.write_text(report(args, results, peak, minutes))
        print(f"wrote {path}")


def targets(results: list[RungResult], peak: float) -> str:
    """The issue's ladder targets, read off this run's rows."""
    by = {r.rung: r for r in results}
    lines = []
    if "baseline" in by and len(results) > 1:
        first, last = by["baseline"], results[-1]
        lines.append(
            f"all switches together ({last.rung} row) take the peak from "
            f"{_mib(first.live_peak)} to {_mib(last.live_peak)} MiB "
            f"(**{last.live_peak / first.live_peak - 1:+.1%}**; target -60% or more)"
        )
    if "baseline" in by and "+packing" in by:
        ratio = by["+packing"].tokens_per_s / by["baseline"].tokens_per_s
        lines.append(f"packing raises real tokens/s **{ratio:.2f}x** (target 2x or more)")
    names = list(RUNGS)
    hooked = names.index("+optimizer in backward")
    if names[hooked] in by and names[hooked - 1] in by:
        before, after = by[names[hooked - 1]], by[names[hooked]]
        cut = before.live_peak - after.live_peak
        lines.append(
            f"the optimizer in backward cuts {_mib(cut)} MiB against "
            f"{_mib(after.gradients)} MiB of gradients "
            f"(**{cut / after.gradients:.0%}**; target 100% or more, reachable only "
            "where the plain step's scratch outweighs the working set of backward, "
            "as with torch's foreach AdamW: `optim_in_backward.md`)"
        )
    best = max(results, key=lambda r: r.flops_per_s)
    lines.append(f"best MFU **{best.flops_per_s / peak:.1%}** ({best.rung})")
    return "".join(f"- {line}\n" for line in lines)


def report(args, results: list[RungResult], peak: float, minutes: float) -> str:
    setup = PRESETS[args.preset]
    cfg = setup["config"]
    params = results[0].params / 1e6 if results else 0.0
    if args.preset == "cpu":
        size = (
            "the 100M shape's width and vocabulary with 4 of its 12 layers at seq 512, so "
            "the whole ladder runs in minutes; the issue's shape is `--preset 100m` "
            "(`sft_ladder_100m.md`)"
        )
    else:
        size = "the issue's ladder shape, ~100M parameters at seq 1024"
    return f"""# SFT ablation ladder: throughput, MFU, peak memory

`python benchmarks/sft_ladder.py --preset {args.preset} --threads {args.threads}` —
{args.steps} timed steps per rung, whole ladder {minutes:.1f} min. Each rung adds one switch to
the rung above and runs in a fresh subprocess.

- Model: random Llama-style, {params:.1f}M parameters: hidden {cfg["hidden_size"]}, \
{cfg["num_hidden_layers"]} layers, {cfg["num_attention_heads"]} heads / \
{cfg["num_key_value_heads"]} KV heads, MLP {cfg["intermediate_size"]}, \
vocab {cfg["vocab_size"]} (tied head); fp32; batch {setup["batch_size"]} x seq {setup["seq_len"]}:
  {size}. AdamW is torch's default implementation (the for-loop one on CPU).
- Data: 200 synthetic samples with log-normal lengths (median ~{setup["seq_len"] // 5} tokens,
  clipped to 16..{setup["seq_len"]}), every token trained. Padded rungs pad each batch to its
  longest sample; packed rungs fill rows of {setup["seq_len"]} tokens. Eager rungs attend
  document by document (`document_ids`: causal SDPA per document); compiled ones use the
  block-causal mask (data-dependent document spans would recompile every batch), which is
  why `+compile` can be slower than `+packing` here.
- Machine: {machine()}, shared with other work (timings are noisy; the step range shows it);
  Python {platform.python_version()}, torch {torch.__version__}; run \
{datetime.date.today().isoformat()}. **GPU: not run** (no device was lent to this task).
- Matmul peak: {peak / 1e9:.1f} GFLOP/s, fp32 2048 x 2048 on {args.threads} thread(s), the best
  of this script's measurements (before and after the ladder, and in each rung's process).

Against the issue's targets:

{targets(results, peak)}
{table(results, peak)}

- **tokens/s**: real (non-padding) tokens per second over the timed steps. **MFU**: useful
  model FLOPs (6 x matmul parameters x tokens + causal attention 6·L·nh·hd·l² per document of
  length l; no padding, no recomputation) per second / the measured matmul peak.
- **first step s**: the warm-up step, including `torch.compile`'s tracing and code generation
  (inductor's cache is fresh for each ladder run and shared by its rungs, so a rung whose
  graphs an earlier rung compiled finds them cached); the compile time is roughly first step
  minus step.
- **peak**: weights + optimizer states + the CPU allocator's peak during one step on the
  longest batch (`AllocatedBytes`, read from torch's profiler; **peak at**: the phase, the
  autograd node or op, and the allocating op at that moment). **planner**: the memory
  planner's estimate for that batch and configuration (`estimate_memory`). **peak RSS
  added**: the subprocess's peak resident set over the steps after the warm-up (`VmHWM`,
  reset after it) minus its resident set after imports: it also holds what compilation left
  resident (generated code, graphs), the synthetic data and the allocator's free pages, so it
  sits above the peak. Children run with a fixed glibc mmap threshold
  (`MALLOC_MMAP_THRESHOLD_=131072`) so freed tensors leave the resident set.
- bitsandbytes' CPU step (8-bit AdamW) allocates about five float32 copies of the parameter
  it updates, as torch tensors made outside torch's dispatcher: the allocator peak and the
  planner (step temporaries) count them, a dispatch-mode counter would not.
"""


if __name__ == "__main__":
    main()
