"""Per-rank peak memory and tokens/s under FSDP2, TP, TP+SP and HSDP, against the memory model.

Part 1, measured: the ~100M benchmark model (the shape of ``sft_ladder.py --preset 100m``:
hidden 768, 12 layers, 12 heads / 4 KV heads, MLP 2048, vocab 32000, tied head; float32) at
batch 1 x seq 1024 per data-parallel rank, on 1, 2 and 4 CPU ranks (gloo), each layout in
fresh processes started the way torchrun starts them (``RANK``/``WORLD_SIZE``/``MASTER_*``),
each rank building its model with the library path a recipe takes:
``init_distributed(device="cpu", parallelism=...)`` then ``parallelize(model, ctx, cfg)``.
A training step is forward, summed cross-entropy over the full logits (divided by the
tokens), backward and torch's AdamW step (its default for-loop implementation on CPU; no
gradient clipping). After a warm-up step (so AdamW's states exist), each rank measures

* its peak: the bytes of its parameters, buffers and optimizer states (local shards) plus
  the CPU allocator's peak over one step (``tunesmith.training.memory.usage.AllocatedBytes``,
  the CPU stand-in for ``torch.cuda.max_memory_allocated``), and where that peak sits;
* its tokens/s over ``--steps`` more steps: the tokens the whole world trained per second,
  divided by the ranks (tensor-parallel ranks share their sequence).

Each row shows the heaviest rank against the memory model's prediction for that layout
(``tunesmith.training.memory.planner.estimate_memory(..., parallel=ParallelDims(...))``)
and their ratio; the issue asks every row to be within 15%.

Part 2, modelled: the same memory model applied to Llama-3.1-8B and Llama-3.3-70B (bf16
weights) on 8 x 80 GB GPUs at batch 1 x seq 8192, linear cross-entropy (vocabulary-parallel
under TP), for FSDP2 over 8, TP 8, TP 2 x FSDP2 4, TP 4 x FSDP2 2 and HSDP 2 x 4, with and
without activation checkpointing, and AdamW with float32 or bf16 moments, 8-bit AdamW, each
with and without the optimizer in backward: which fit.

Part 3, ``--part cp_ep`` (its own file, ``results/parallel_memory_cp_ep.md``; parts 1-2 are
not rerun): the same measurement and comparison for context parallel and expert parallel.
Context parallel (``cp`` 2) on the dense model: each rank's batch is its zigzag share
(``shard_batch``) and the model is called with ``cp_index`` (ring attention), as the Trainer
does. Expert parallel (``ep`` 2, with FSDP2 over the same 2 ranks) on a Qwen3-MoE of the same
width (:data:`QWEN3_MOE`: 8 experts of 768 x 512, top 2, every layer MoE), next to the MoE
model on one process and under FSDP2 alone; the loss is the cross-entropy only (no
load-balancing term, which adds no memory worth naming).

Usage::

    python benchmarks/parallel_memory.py          # writes benchmarks/results/parallel_memory.md
    python benchmarks/parallel_memory.py --part cp_ep  # writes results/parallel_memory_cp_ep.md
    python benchmarks/parallel_memory.py --layers 2 --seq 256 --output /tmp/quick.md
    python benchmarks/parallel_memory.py --layouts tp2_sp fsdp2 --output /tmp/two.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import machine_info  # benchmarks/machine_info.py, next to this script
import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "parallel_memory.md"
RESULTS_CP_EP = REPO / "benchmarks" / "results" / "parallel_memory_cp_ep.md"

LLAMA_100M = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
    "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True, "attention_bias": False,
}  # fmt: skip

# Part 3's MoE model: LLAMA_100M's attention, embedding and depth; every layer 8 experts, top 2
QWEN3_MOE = {
    **LLAMA_100M, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "use_sliding_window": False,
}  # fmt: skip

# name: (ranks, the `parallelism` config section, what the row is called)
LAYOUTS: dict[str, tuple[int, dict[str, Any], str]] = {
    "single": (1, {}, "one process"),
    "fsdp2": (2, {"dp_shard": 2}, "FSDP2: dp_shard 2"),
    "tp2": (2, {"tp": 2, "sequence_parallel": False}, "TP 2, no SP"),
    "tp2_sp": (2, {"tp": 2}, "TP 2 + SP"),
    "hsdp2": (2, {"dp_replicate": 2}, "HSDP: dp_replicate 2 x dp_shard 1"),
    "fsdp4": (4, {"dp_shard": 4}, "FSDP2: dp_shard 4"),
    "tp4": (4, {"tp": 4, "sequence_parallel": False}, "TP 4, no SP"),
    "tp4_sp": (4, {"tp": 4}, "TP 4 + SP"),
    "hsdp4": (4, {"dp_replicate": 2, "dp_shard": 2}, "HSDP: dp_replicate 2 x dp_shard 2"),
    "tp2_fsdp2": (4, {"tp": 2, "dp_shard": 2}, "TP 2 + SP x FSDP2 dp_shard 2"),
    # part 3 (--part cp_ep); "moe_*": the QWEN3_MOE model
    "cp2": (2, {"cp": 2, "dp_shard": 1}, "CP 2 (ring attention), FSDP2 over the 2 cp ranks"),
    "moe_single": (1, {}, "MoE: one process"),
    "moe_fsdp2": (2, {"dp_shard": 2}, "MoE: FSDP2 dp_shard 2 (experts sharded by FSDP2)"),
    "moe_ep2": (2, {"dp_shard": 2, "ep": 2}, "MoE: EP 2 x FSDP2 dp_shard 2 (4 experts per rank)"),
}
PARTS = {
    "tp": ["single", "fsdp2", "tp2", "tp2_sp", "hsdp2", "fsdp4", "tp4", "tp4_sp", "hsdp4",
           "tp2_fsdp2"],
    "cp_ep": ["single", "cp2", "moe_single", "moe_fsdp2", "moe_ep2"],
}  # fmt: skip

# Part 2: the GPU machine the model is applied to
GPU_COUNT = 8
GPU_TOTAL = 79.6 * 2**30  # an "80 GB" H100/A100 reports 81,559 MiB
GPU_USABLE = 76 * 2**30  # less ~3.6 GiB: CUDA context, NCCL buffers, allocator fragmentation
GPU_SEQ = 8192
GPU_LAYOUTS = {
    "FSDP2 8": {"dp_shard": 8},
    "TP 8 + SP": {"tp": 8},
    "TP 2 x FSDP2 4": {"tp": 2, "dp_shard": 4},
    "TP 4 x FSDP2 2": {"tp": 4, "dp_shard": 2},
    "HSDP 2 x 4": {"dp_replicate": 2, "dp_shard": 4},
}
# column: (optimizer kind of the memory planner, optimizer in backward)
GPU_OPTIMIZERS = {
    "AdamW fp32 moments": ("adamw32bit", False),
    "AdamW bf16 moments": ("adamw", False),
    "8-bit AdamW": ("adamw8bit", False),
    "in-bwd, fp32 moments": ("adamw32bit", True),
    "in-bwd, bf16 moments": ("adamw", True),
    "in-bwd, 8-bit": ("adamw8bit", True),
}


# -- one rank ------------------------------------------------------------------------------------


def _peak_label(ops: str) -> str:
    """A short name for where a peak sits: the phase and the autograd node or op running."""
    parts = ops.split(" > ")
    engine = "autograd::engine::evaluate_function: "
    if parts[0].startswith(engine):
        return "backward: " + parts[0].removeprefix(engine)
    if any(p.startswith("Optimizer.step#") for p in parts):
        return "optimizer step"
    return "forward: " + parts[-1]


def run_rank(args: argparse.Namespace) -> dict[str, Any]:
    """Train ``args.layout`` on this rank (started with torchrun's environment); measure."""
    from tunesmith.models import build_model
    from tunesmith.models.spec import spec_from_hf_config
    from tunesmith.modules.losses import CrossEntropyLoss
    from tunesmith.training.memory.usage import AllocatedBytes, storage_bytes
    from tunesmith.training.parallel.context_parallel import shard_batch
    from tunesmith.training.parallel.distributed import close_distributed, init_distributed
    from tunesmith.training.parallelize import parallelize

    torch.set_num_threads(args.threads)
    _, parallelism, _ = LAYOUTS[args.layout]
    ctx = init_distributed(device="cpu", parallelism=parallelism)
    try:
        spec = spec_from_hf_config(_shape(args, args.layout))
        torch.manual_seed(0)
        model = parallelize(build_model(spec), ctx, {})
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        loss_fn = CrossEntropyLoss()
        # each data-parallel rank its own rows; the tp ranks of one dp rank the same ones
        gen = torch.Generator().manual_seed(1000 + ctx.dp_rank)
        ids = torch.randint(0, spec.vocab_size, (args.batch, args.seq + 1), generator=gen)
        inputs, labels = ids[:, :-1], ids[:, 1:]
        kwargs: dict[str, torch.Tensor] = {}
        if ctx.cp_size > 1:  # this rank's zigzag share of the row, attended by ring attention
            positions = torch.arange(args.seq)[None].expand(args.batch, -1)
            local = shard_batch(
                {"input_ids": inputs, "labels": labels, "position_ids": positions},
                cp_rank=ctx.cp_rank,
                cp_size=ctx.cp_size,
            )
            inputs, labels = local["input_ids"], local["labels"]
            kwargs = {"position_ids": local["position_ids"], "cp_index": local["cp_index"]}
        trained = args.batch * args.seq

        def step() -> None:
            logits = model(inputs, **kwargs)
            loss = loss_fn(logits, labels) / trained
            del logits  # as a training loop's objective returns the loss alone
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # warm-up: AdamW's states are created
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        resident = storage_bytes([*model.parameters(), *model.buffers(), *states])
        with AllocatedBytes() as mem:
            step()
        torch.distributed.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        torch.distributed.barrier()
        seconds = (time.perf_counter() - start) / args.steps
    finally:
        close_distributed()
    world_tokens = ctx.dp_size * args.batch * args.seq
    return {
        "rank": ctx.rank, "resident": resident, "allocated_peak": mem.peak,
        "peak": resident + mem.peak, "peak_at": _peak_label(mem.peak_op), "step_s": seconds,
        "tokens_per_s_per_rank": world_tokens / seconds / ctx.world_size,
    }  # fmt: skip


def _shape(args: argparse.Namespace, layout: str = "single") -> dict[str, Any]:
    base = QWEN3_MOE if layout.startswith("moe_") else LLAMA_100M
    return {**base, "num_hidden_layers": args.layers}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every rank's result for layout ``name``, its ranks started as torchrun starts them."""
    world = LAYOUTS[name][0]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(args.threads),
        PYTHONWARNINGS="ignore",
    )
    flags = [f"--{k}={getattr(args, k)}" for k in ("layers", "seq", "batch", "steps", "threads")]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-of", name, *flags],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    results, failed = [], []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate(timeout=args.timeout)
        if proc.returncode != 0:
            failed.append(f"rank {rank} exited with {proc.returncode}:\n{err[-3000:]}")
        else:
            results.append(json.loads(out.strip().splitlines()[-1]))
    if failed:
        raise RuntimeError(f"layout {name} failed:\n" + "\n".join(failed))
    return sorted(results, key=lambda r: r["rank"])


# -- the memory model ------------------------------------------------------------------------------


def predict(name: str, args: argparse.Namespace) -> Any:
    """The memory model's plan for layout ``name`` (the heaviest rank)."""
    from tunesmith.models import build_model
    from tunesmith.models.spec import spec_from_hf_config
    from tunesmith.training.memory.planner import estimate_memory
    from tunesmith.training.parallel.distributed import ParallelDims

    world, parallelism, _ = LAYOUTS[name]
    model = build_model(spec_from_hf_config(_shape(args, name)), device="meta")
    return estimate_memory(
        model,
        batch_size=args.batch,
        seq_len=args.seq,
        optimizer="adamw",
        loss="full",
        parallel=ParallelDims.resolve(parallelism, world),
    )


def gpu_plans() -> dict[tuple[str, str, bool, str], Any]:
    """Plans of Llama-3.1-8B and Llama-3.3-70B on 8 GPUs: key (model, layout, checkpointing,
    optimizer column)."""
    from tunesmith.models.zoo import llama3
    from tunesmith.training.memory.planner import estimate_memory
    from tunesmith.training.parallel.distributed import ParallelDims

    models = {
        "Llama-3.1-8B": llama3.llama3_1_8b(device="meta", dtype=torch.bfloat16),
        "Llama-3.3-70B": llama3.llama3_3_70b(device="meta", dtype=torch.bfloat16),
    }
    plans = {}
    for model_name, model in models.items():
        for layout, parallelism in GPU_LAYOUTS.items():
            dims = ParallelDims.resolve(parallelism, GPU_COUNT)
            for checkpointing in (False, True):
                for column, (optimizer, in_backward) in GPU_OPTIMIZERS.items():
                    plans[model_name, layout, checkpointing, column] = estimate_memory(
                        model,
                        batch_size=1,
                        seq_len=GPU_SEQ,
                        optimizer=optimizer,
                        activation_checkpointing="full" if checkpointing else None,
                        loss="linear",
                        optimizer_in_backward=in_backward,
                        parallel=dims,
                        device="cuda",
                    )
    return plans


# -- the report ------------------------------------------------------------------------------------


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def machine() -> str:
    return machine_info.machine() + ", no GPU"


def measured_table(rows: dict[str, list[dict[str, Any]]], plans: dict[str, Any]) -> str:
    lines = [
        "| ranks | layout | measured peak MiB (heaviest rank) | ranks' range MiB | model MiB "
        "| model / measured | weights + states MiB | step allocator peak MiB | peak at "
        "| tokens/s per rank | step s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for name, ranks in rows.items():
        world, _, label = LAYOUTS[name]
        heaviest = max(ranks, key=lambda r: r["peak"])
        low = min(r["peak"] for r in ranks)
        plan = plans[name]
        tokens = sum(r["tokens_per_s_per_rank"] for r in ranks) / len(ranks)
        step = max(r["step_s"] for r in ranks)
        lines.append(
            f"| {world} | {label} | {_mib(heaviest['peak'])} | {_mib(low)}-"
            f"{_mib(heaviest['peak'])} | {_mib(plan.total)} | {plan.total / heaviest['peak']:.3f} "
            f"| {_mib(heaviest['resident'])} | {_mib(heaviest['allocated_peak'])} | "
            f"{heaviest['peak_at']} | {tokens:.0f} | {step:.1f} |"
        )
    return "\n".join(lines)


def terms_table(plans: dict[str, Any]) -> str:
    names = {
        "weights": "W", "optimizer_states": "O", "gradients": "G", "activations": "A",
        "logits": "Lg", "head_gradient": "Hg", "gathered_root": "Ur", "gathered_layers": "Ul",
        "step_temporaries": "S",
    }  # fmt: skip
    lines = [
        "| layout | " + " | ".join(names.values()) + " | peak phase | model MiB |",
        "|---|" + "---:|" * len(names) + "---|---:|",
    ]
    for name, plan in plans.items():
        phase = "backward" if plan.backward_peak >= plan.step_peak else "optimizer step"
        cells = " | ".join(_mib(getattr(plan, field)) for field in names)
        lines.append(f"| {LAYOUTS[name][2]} | {cells} | {phase} | {_mib(plan.total)} |")
    return "\n".join(lines)


def gpu_table(plans: dict[tuple[str, str, bool, str], Any]) -> str:
    lines = [
        "| model | layout | activation checkpointing | "
        + " | ".join(f"{c} GiB" for c in GPU_OPTIMIZERS)
        + " |",
        "|---|---|---|" + "---:|" * len(GPU_OPTIMIZERS),
    ]
    rows = dict.fromkeys(key[:3] for key in plans)  # (model, layout, checkpointing), in order
    for model, layout, checkpointing in rows:
        cells = []
        for column in GPU_OPTIMIZERS:
            total = plans[model, layout, checkpointing, column].total
            mark = "fits" if total <= GPU_USABLE else "tight" if total <= GPU_TOTAL else "no"
            cells.append(f"{_gib(total)} {mark}")
        ac = "full" if checkpointing else "off"
        lines.append(f"| {model} | {layout} | {ac} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def claim(plans: dict[tuple[str, str, bool, str], Any]) -> str:
    """The reference claim "70B full fine-tuning fits on 8 H100 with optimizer-in-backward",
    as the model sees it."""
    model = "Llama-3.3-70B"
    bf16 = plans[model, "FSDP2 8", True, "in-bwd, bf16 moments"]
    fp32 = plans[model, "FSDP2 8", True, "in-bwd, fp32 moments"]
    plain = plans[model, "FSDP2 8", True, "AdamW bf16 moments"]
    fitting = sorted(
        {
            (k[1], k[2])
            for k, p in plans.items()
            if k[0] == model and k[3] == "in-bwd, bf16 moments" and p.total <= GPU_USABLE
        },
    )
    where = ", ".join(
        f"{layout} (checkpointing {'full' if ac else 'off'})" for layout, ac in fitting
    )
    verdict = "holds" if bf16.total <= GPU_USABLE else "does not hold"
    return (
        f'**The reference claim** "70B full fine-tuning fits on 8 H100 with '
        f'optimizer-in-backward" {verdict} in this model under its assumption: bf16 weights '
        f"and gradients with AdamW's moments kept in bf16 (what torch's AdamW does for bf16 "
        f"parameters), activation checkpointing and a chunked (linear) cross-entropy. FSDP2 "
        f"over 8 GPUs then needs {_gib(bf16.total)} GiB per GPU (weights "
        f"{_gib(bf16.weights)}, moments {_gib(bf16.optimizer_states)}, the backward's "
        f"activations and gathered weights {_gib(bf16.backward_peak)}) against "
        f"{_gib(GPU_USABLE)} usable; the same without the optimizer in backward needs "
        f"{_gib(plain.total)} GiB (all {_gib(plain.gradients)} GiB of gradient shards plus "
        f"the CUDA foreach step's copy of them at the step), and with float32 moments "
        f"{_gib(fp32.total)} GiB (the moments alone take {_gib(fp32.optimizer_states)} GiB "
        f"per GPU): it holds only with 16-bit (or 8-bit) moments. With the optimizer in "
        f"backward and bf16 moments, these 70B layouts fit: {where or 'none'}."
    )


def reading(rows: dict[str, list[dict[str, Any]]], plans: dict[str, Any]) -> str:
    """A few sentences read off this run's numbers (only for the layouts that ran)."""
    peak = {name: max(r["peak"] for r in ranks) for name, ranks in rows.items()}
    lines = []
    pairs = [(a, b) for a, b in (("tp2", "tp2_sp"), ("tp4", "tp4_sp")) if a in peak and b in peak]
    if pairs:
        said = "; ".join(
            f"{LAYOUTS[b][2]} peaks {_mib(peak[a] - peak[b])} MiB below {LAYOUTS[a][2]} (model: "
            f"{_mib(plans[a].total - plans[b].total)})"
            for a, b in pairs
        )
        lines.append(
            f"- Sequence parallel: {said}. Each rank keeps its layers' norms and the residual "
            "stream for 1/tp of the sequence; attention and the MLP still save the gathered "
            "(whole) layer input."
        )
    excess = {name: plans[name].total - peak[name] for name in peak}
    heads = {name: plans[name].head_gradient for name in peak}
    if min(excess.values()) >= 0:
        lines.append(
            "- The model is above the measurement by "
            f"{_mib(min(excess.values()))}-{_mib(max(excess.values()))} MiB, about the head's "
            f"gradient term Hg ({_mib(min(heads.values()))}-{_mib(max(heads.values()))} MiB): "
            "the model keeps Hg alive at the start of backward, but with full cross-entropy "
            "the peak (`LogSoftmaxBackward0`) comes before the head's gradient exists."
        )
    logits = max(plan.logits for plan in plans.values())
    lines.append(
        f"- Full logits are 12 x tokens x vocab bytes ({_mib(logits)} MiB here) on every rank "
        "whatever the layout: under TP the head's output is gathered for a full-logits loss. "
        "The linear cross-entropy with loss parallel (vocabulary-sharded chunks) is what "
        "removes them; its per-rank terms are in the model but not measured here."
    )
    lines.append(
        "- Not modelled: the very end of backward, where the (tied) embedding's gradient is "
        "built while every other gradient exists; it sets the peak only when activations are "
        "small next to the embedding (e.g. `--layers 1 --seq 64`), where the model falls below "
        "the measurement."
    )
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    plans: dict[str, Any],
    gpu: dict[tuple[str, str, bool, str], Any],
    command: str,
    minutes: float,
) -> str:
    shape = _shape(args)
    params = sum(p.numel() for p in _meta_model(args).parameters()) / 1e6
    ratios = [plans[n].total / max(r["peak"] for r in rows[n]) for n in rows]
    worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else 1.0
    within = all(abs(x - 1) <= 0.15 for x in ratios)
    return f"""# Parallel memory: per-rank peaks under FSDP2, TP, TP+SP and HSDP vs the memory model

`python benchmarks/parallel_memory.py{command}` ({minutes:.1f} min). Machine: {machine()},
shared with other work (timings are noisy); Python {platform.python_version()}, torch \
{torch.__version__}; run {datetime.date.today().isoformat()}. **GPU: not run** — no GPU machine
was available in this session, so neither the per-rank peaks on CUDA nor the 2-rank NCCL
equivalence of the issue were run; part 2 is the model's arithmetic only.

## 1. Measured on CPU ranks vs the memory model

- Model: random Llama-style, {params:.1f}M parameters (hidden {shape["hidden_size"]}, \
{shape["num_hidden_layers"]} layers, {shape["num_attention_heads"]} heads / \
{shape["num_key_value_heads"]} KV heads, MLP {shape["intermediate_size"]}, vocab \
{shape["vocab_size"]}, tied head), float32, batch {args.batch} x seq {args.seq} per \
data-parallel rank; full logits + cross-entropy; torch's AdamW (for-loop, CPU); no
  activation checkpointing. Gloo ranks on this machine, {args.threads} intra-op thread(s) each,
  started as torchrun starts them; each rank runs `init_distributed(device="cpu",
  parallelism=...)` and `parallelize(model, ctx, cfg)` (TP/SP, then FSDP2/HSDP).
- **measured peak**: the rank's parameters, buffers and AdamW states (local shards) + the
  CPU allocator's peak over one training step after a warm-up step (`AllocatedBytes`:
  like `torch.cuda.max_memory_allocated`, not the resident set); the heaviest rank, and the
  range over the ranks. **model**: `estimate_memory(model, batch_size={args.batch}, \
seq_len={args.seq}, parallel=ParallelDims(...))`, the heaviest rank. **peak at**: the phase
  and autograd node at the measured peak.
- **tokens/s per rank**: the tokens the whole world trained per second over {args.steps} timed
  step(s) after the measured one, divided by the ranks (tensor-parallel ranks share a
  sequence; data-parallel ranks each train their own), the mean over ranks; **step s**: the
  slowest rank's step time. With more ranks than the 2 cores, ranks wait for cores: compare
  memory, not speed, across world sizes.

{measured_table(rows, plans)}

Every row within 15%: **{"yes" if within else "NO"}** (largest deviation: model / measured =
{worst:.3f}).

{reading(rows, plans)}

The model's terms per layout (MiB; heaviest rank; W weights, O optimizer states, G
gradients, A activations, Lg logits and loss, Hg the head's gradient, Ur / Ul FSDP2's gathered
root / two layers, S optimizer step temporaries; the peak is
`W + O + max(A + Hg + Ur + max(Lg, R + Ul), G + S)` with R the recomputed layer under
checkpointing, none here; see `tunesmith/training/memory/planner.py`):

{terms_table(plans)}

## 2. The model applied: Llama-3.1-8B and Llama-3.3-70B on {GPU_COUNT} x 80 GB GPUs

Per-GPU peak (GiB) from `estimate_memory(..., device="cuda")`: bf16 weights and gradients,
batch 1 x seq {GPU_SEQ}, linear cross-entropy (chunked; vocabulary-parallel under TP),
sequence parallel with TP, activation checkpointing off or full (every layer).
Optimizers: AdamW keeping float32 moments (8 bytes per parameter, e.g. bitsandbytes'
`AdamW32bit`), AdamW keeping bf16 moments (torch's AdamW on bf16 parameters; its CUDA
`foreach` step adds a copy of the gradient shards), 8-bit AdamW; "in-bwd": the same with the
optimizer in backward (one gradient shard alive at a time). **fits**: at most
{_gib(GPU_USABLE)} GiB (an 80 GB card reports {_gib(GPU_TOTAL)} GiB; about 3.6 GiB is left
for the CUDA context, NCCL buffers and allocator fragmentation — an assumption); **tight**:
above that but under {_gib(GPU_TOTAL)} GiB; **no**: more.

{gpu_table(gpu)}

{claim(gpu)}

The model prices what the CPU measurements validate (per-rank shards, activations with and
without SP, FSDP2's gathered weights, full-logits loss); on GPUs it adds assumptions it could
not check here: flash attention's saved tensors as SDPA's on CPU, the CUDA `foreach` step
scratch, no NCCL or caching-allocator overheads beyond the margin above, and a linear
cross-entropy whose logits chunk is as `LinearCrossEntropyLoss` chunks by default.
"""


def _meta_model(args: argparse.Namespace, layout: str = "single") -> torch.nn.Module:
    from tunesmith.models import build_model
    from tunesmith.models.spec import spec_from_hf_config

    return build_model(spec_from_hf_config(_shape(args, layout)), device="meta")


def reading_cp_ep(rows: dict[str, list[dict[str, Any]]], plans: dict[str, Any]) -> str:
    """Part 3's sentences, read off this run's numbers (only for the layouts that ran)."""
    peak = {name: max(r["peak"] for r in ranks) for name, ranks in rows.items()}
    lines = []
    if "single" in peak and "cp2" in peak:
        one, two = plans["single"], plans["cp2"]
        lines.append(
            f"- Context parallel 2: the heaviest rank peaks at {peak['cp2'] / peak['single']:.2f}"
            f" x one process's (model: {two.total / one.total:.2f} x). Per rank the model "
            f"halves the per-token terms (activations {_mib(one.activations)} -> "
            f"{_mib(two.activations)} MiB, logits {_mib(one.logits)} -> {_mib(two.logits)} MiB: "
            "each rank keeps its zigzag half of the row) and shards weights, gradients and "
            "AdamW states over the 2 cp ranks (FSDP2 over dp_shard x cp)."
        )
    if "moe_fsdp2" in peak and "moe_ep2" in peak:
        fsdp, ep = plans["moe_fsdp2"], plans["moe_ep2"]
        lines.append(
            f"- Expert parallel 2 next to FSDP2 over the same 2 ranks: measured "
            f"{_mib(peak['moe_ep2'] - peak['moe_fsdp2'])} MiB apart (model: "
            f"{_mib(ep.total - fsdp.total)}). Both keep half of every expert's weights, "
            "gradients and states per rank; EP keeps whole experts and never gathers them "
            f"(FSDP2's gathered layers Ul: {_mib(fsdp.gathered_layers)} MiB without EP, "
            f"{_mib(ep.gathered_layers)} MiB with it) and adds the all-to-all buffers to the "
            f"activations ({_mib(fsdp.activations)} -> {_mib(ep.activations)} MiB)."
        )
    ratios = {name: plans[name].total / peak[name] for name in peak}
    low, high = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    lines.append(
        f"- model / measured ranges from {ratios[low]:.3f} ({LAYOUTS[low][2]}) to "
        f"{ratios[high]:.3f} ({LAYOUTS[high][2]})."
    )
    return "\n".join(lines)


def report_cp_ep(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    plans: dict[str, Any],
    command: str,
    minutes: float,
) -> str:
    dense, moe = _shape(args), _shape(args, "moe_single")
    params = {
        name: sum(p.numel() for p in _meta_model(args, name).parameters()) / 1e6
        for name in ("single", "moe_single")
    }
    ratios = [plans[n].total / max(r["peak"] for r in rows[n]) for n in rows]
    worst = max(ratios, key=lambda x: abs(x - 1)) if ratios else 1.0
    within = all(abs(x - 1) <= 0.15 for x in ratios)
    return f"""# Parallel memory, part 3: per-rank peaks under context and expert parallel vs the memory model

`python benchmarks/parallel_memory.py{command}` ({minutes:.1f} min). Machine: {machine()},
shared with other work (timings are noisy); Python {platform.python_version()}, torch \
{torch.__version__}; run {datetime.date.today().isoformat()}. CPU ranks (gloo) only: no GPU
was measured. Parts 1 and 2 (FSDP2, TP, HSDP; the 8B/70B model): `parallel_memory.md`.

- Models: the dense one of part 1, random Llama-style, {params["single"]:.1f}M parameters \
(hidden {dense["hidden_size"]}, {dense["num_hidden_layers"]} layers, \
{dense["num_attention_heads"]} heads / {dense["num_key_value_heads"]} KV heads, MLP \
{dense["intermediate_size"]}, vocab {dense["vocab_size"]}, tied head); and "MoE", a random \
Qwen3-MoE of the same attention, embedding and depth, {params["moe_single"]:.1f}M parameters \
({moe["num_experts"]} experts of MLP {moe["moe_intermediate_size"]} per layer, top \
{moe["num_experts_per_tok"]}, qk-norm). float32, batch {args.batch} x seq {args.seq} per \
data-parallel rank (under CP: the row split over the cp ranks); full logits + cross-entropy
  (no load-balancing term); torch's AdamW (for-loop, CPU); no activation checkpointing.
  {args.threads} intra-op thread(s) per rank; ranks started as torchrun starts them, each
  running `init_distributed(device="cpu", parallelism=...)` and `parallelize(model, ctx, cfg)`
  (expert parallel, context parallel's ring group, then FSDP2). Under CP each rank trains its
  zigzag share (`shard_batch`) with `cp_index` (ring attention), as the Trainer does.
- **measured peak**, **model**, **peak at**, **tokens/s per rank**, **step s**: as in part 1
  (`parallel_memory.md`): parameters, buffers and AdamW states of the rank plus the CPU
  allocator's peak over one step after a warm-up step, against `estimate_memory(model,
  batch_size={args.batch}, seq_len={args.seq}, parallel=ParallelDims(...))`; the heaviest rank.
  Both ranks share the 2 cores: compare memory, not speed.

| ranks | layout | measured peak MiB (heaviest rank) | ranks' range MiB | model MiB | model / measured | weights + states MiB | step allocator peak MiB | peak at | tokens/s per rank | step s |
{measured_table(rows, plans).split(chr(10), 1)[1]}

Every row within 15%: **{"yes" if within else "no"}** (largest deviation: model / measured =
{worst:.3f}).

{reading_cp_ep(rows, plans)}

The model's terms per layout (MiB; heaviest rank; the letters and the peak formula as in
part 1; under EP the all-to-all buffers are in A):

{terms_table(plans)}
"""


def _argv_note(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command-line flags that differ from the defaults (``--output`` aside)."""
    notes = []
    for name, value in vars(args).items():
        if name in ("output", "rank_of", "timeout") or value == parser.get_default(name):
            continue
        shown = " ".join(value) if isinstance(value, list) else value
        notes.append(f" --{name} {shown}")
    return "".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-of", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument(
        "--part",
        choices=list(PARTS),
        default="tp",
        help="tp: parts 1-2 (FSDP2/TP/HSDP); cp_ep: part 3",
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=list(LAYOUTS), help="default: the part's layouts"
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1, help="rows per data-parallel rank")
    parser.add_argument("--steps", type=int, default=1, help="timed steps after the measured one")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per layout")
    parser.add_argument("--output", type=Path, help="markdown file to write (default: the part's)")
    args = parser.parse_args()
    if args.rank_of:
        args.layout = args.rank_of
        print(json.dumps(run_rank(args)))
        return
    command = _argv_note(args, parser)
    args.layouts = args.layouts or PARTS[args.part]
    args.output = args.output or (RESULTS if args.part == "tp" else RESULTS_CP_EP)
    start = time.perf_counter()
    rows, plans = {}, {}
    for name in args.layouts:
        rows[name] = run_layout(name, args)
        plans[name] = predict(name, args)
        heaviest = max(r["peak"] for r in rows[name])
        print(
            f"{name}: measured {_mib(heaviest)} MiB, model {_mib(plans[name].total)} MiB "
            f"({plans[name].total / heaviest:.3f}), "
            f"{rows[name][0]['tokens_per_s_per_rank']:.0f} tokens/s per rank, "
            f"{time.perf_counter() - start:.0f} s so far",
            flush=True,
        )
    if args.part == "cp_ep":
        minutes = (time.perf_counter() - start) / 60
        text = report_cp_ep(args, rows, plans, command, minutes)
    else:
        gpu = gpu_plans()
        minutes = (time.perf_counter() - start) / 60
        text = report(args, rows, plans, gpu, command, minutes)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print("\n" + text)


if __name__ == "__main__":
    main()
