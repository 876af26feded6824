"""Peak memory and tokens/s of full vs LoRA vs QLoRA SFT steps on the same model.

The model is a random Llama-style decoder (about 100M parameters by default, float32). The
variants: full fine-tuning; LoRA, rank 16 on every linear layer but ``lm_head``; QLoRA, the
same adapters over NF4 base weights. Every variant runs the SFT step the recipe runs (forward,
token-mean cross-entropy, backward, clip, AdamW step) on random token batches.

Memory, one fresh interpreter per variant: build the model, add adapters, make AdamW over the
trainable parameters, then train. Reported:

- bytes of the trainable parameters (their gradients take as much again), the frozen ones
  (NF4 tensors by their packed storage) and the AdamW state;
- peak tensors: the most bytes of tensors alive at once during a training step (weights,
  optimizer state, activations, gradients, temporaries; counted per storage, a CPU stand-in
  for ``torch.cuda.max_memory_allocated``), measured on a step after the warm-up;
- peak RSS: the process high-water mark (``VmHWM``) over the warm-up steps and one more (so
  the optimizer state allocated at the first step counts), reset through
  ``/proc/self/clear_refs`` once the model and optimizer exist, and the RSS at that point.

Speed, one more interpreter holding all three variants: after a warm-up step each, timed steps
go round the variants in turn (in a rotating order), so the load of a shared machine hits them
alike; tokens/s is the tokens of a step over the variant's median step time.

Usage::

    python benchmarks/peft_memory.py                      # writes benchmarks/results/peft_memory.md
    python benchmarks/peft_memory.py --layers 2 --seq 64 --steps 2 --output /tmp/quick.md
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

VARIANTS = ("full", "lora", "qlora")
RESULTS = Path(__file__).resolve().parent / "results" / "peft_memory.md"
SHAPE_FLAGS = ("layers", "hidden", "intermediate", "vocab", "seq", "batch", "rank", "threads")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``, or the inner tensors of a tensor subclass such as torchao's ``NF4Tensor``."""
    if type(t) is torch.Tensor or isinstance(t, nn.Parameter) and type(t.data) is torch.Tensor:
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for n in names for inner in _plain_tensors(getattr(t, n))]


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for t in tensors for p in _plain_tensors(t))


class StorageBytes(TorchDispatchMode):
    """Bytes of live tensor storages: the ``existing`` tensors given up front (weights,
    optimizer state) plus every storage an op returns inside the block, each counted once
    until freed. ``peak``: the most at any moment.

    >>> with StorageBytes([]) as mem:
    ...     y = torch.randn(1024) * 2
    >>> mem.peak >= 4096
    True
    """

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}
        self.current = self.peak = 0
        for t in existing:
            for plain in _plain_tensors(t):
                self._track(plain.untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                for plain in _plain_tensors(leaf):
                    self._track(plain.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._sizes:  # in-place results are already counted
            return
        self._sizes[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key)


def _build(variant: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    from tunesmith.models.builder import build_model
    from tunesmith.models.spec import ModelSpec
    from tunesmith.modules.peft import apply_lora

    spec = ModelSpec(
        model_type="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 192,
        head_dim=64,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = build_model(spec, dtype=torch.float32)
    if variant != "full":
        apply_lora(
            model,
            target_modules="all-linear",
            rank=args.rank,
            alpha=2 * args.rank,
            quantize_base="nf4" if variant == "qlora" else False,
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model.train(), torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)


def _step_fn(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    trainable = [p for p in model.parameters() if p.requires_grad]

    def step(ids: torch.Tensor) -> None:
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _batches(args: argparse.Namespace, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(n)
    ]


def _optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


def memory_child(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """Memory of one variant, in this (fresh) process."""
    model, optimizer = _build(variant, args)
    step = _step_fn(model, optimizer)
    batches = _batches(args, args.warmup + 2)
    params = list(model.parameters())
    gc.collect()
    setup_mb = _status_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on is the training's
    for ids in batches[:-1]:
        step(ids)
    peak_rss_mb = _status_mb("VmHWM")
    with StorageBytes([*params, *_optimizer_state(optimizer)]) as tensors:
        step(batches[-1])
    return {
        "total_params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "trainable_mb": _bytes(p for p in params if p.requires_grad) / 2**20,
        "frozen_mb": _bytes(p for p in params if not p.requires_grad) / 2**20,
        "optimizer_mb": _bytes(_optimizer_state(optimizer)) / 2**20,
        "peak_tensor_mb": tensors.peak / 2**20,
        "setup_rss_mb": setup_mb,
        "peak_rss_mb": peak_rss_mb,
    }


def speed_child(args: argparse.Namespace) -> dict[str, Any]:
    """Step times of all variants, interleaved in this process."""
    steps = {v: _step_fn(*_build(v, args)) for v in VARIANTS}
    batches = _batches(args, args.warmup + args.steps)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i, ids in enumerate(batches):
        order = VARIANTS[i % 3 :] + VARIANTS[: i % 3]
        for variant in order:
            start = time.perf_counter()
            steps[variant](ids)
            if i >= args.warmup:
                times[variant].append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    return {
        "threads": torch.get_num_threads(),
        "step_s": times,
        "tokens_per_s": {v: tokens / statistics.median(t) for v, t in times.items()},
    }


def _child(which: str, args: argparse.Namespace) -> dict[str, Any]:
    flags = [f"--{k}={getattr(args, k)}" for k in (*SHAPE_FLAGS, "steps", "warmup")]
    result = subprocess.run(
        [sys.executable, __file__, "--child", which, *flags], capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"--child {which} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torchao

        ao = f", torchao {torchao.__version__}"
    except ImportError:
        ao = ""
    return (
        f"{os.cpu_count()} CPU(s) {platform.machine()} ({cpu}), {ram:.0f} GB RAM, no GPU; "
        f"Python {platform.python_version()}, torch {torch.__version__}{ao}"
    )


def _report(
    memory: dict[str, dict[str, Any]],
    speed: dict[str, Any],
    args: argparse.Namespace,
    command: str,
    minutes: float,
) -> str:
    full, tps = memory["full"], speed["tokens_per_s"]
    lines = [
        "# PEFT memory: full vs LoRA vs QLoRA SFT steps",
        "",
        f"`python benchmarks/peft_memory.py{command}` ({minutes:.1f} min): a random Llama-style "
        f"model, {full['total_params'] / 1e6:.0f}M parameters ({args.layers} layers, hidden "
        f"{args.hidden}, intermediate {args.intermediate}, vocab {args.vocab}, untied "
        f"`lm_head`), float32, batch {args.batch} x {args.seq} tokens, AdamW, "
        f"{speed['threads']} intra-op thread(s). LoRA: rank {args.rank}, alpha {2 * args.rank} "
        "on every linear layer but `lm_head`; QLoRA: the same adapters, those layers' base "
        "weights stored as NF4 (embeddings, norms and `lm_head` stay float32).",
        f"Memory: each variant in a fresh process, {args.warmup} warm-up step(s) + 1 + 1 "
        f"measured. Speed: one process, {args.warmup} warm-up + {args.steps} timed steps per "
        "variant, the variants taking turns; median step time.",
        "",
        f"Machine: {_machine()}. Run: {date.today().isoformat()}.",
        "",
        "| variant | trainable params | trainable MB | frozen MB | AdamW state MB "
        "| peak tensors MB | vs full | RSS before training MB | peak RSS MB | vs full "
        "| tokens/s | vs full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in VARIANTS:
        r = memory[v]
        lines.append(
            f"| {v} | {r['trainable_params'] / 1e6:.2f}M | {r['trainable_mb']:.0f} | "
            f"{r['frozen_mb']:.0f} | {r['optimizer_mb']:.0f} | {r['peak_tensor_mb']:.0f} | "
            f"{r['peak_tensor_mb'] / full['peak_tensor_mb']:.2f} | {r['setup_rss_mb']:.0f} | "
            f"{r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / full['peak_rss_mb']:.2f} | "
            f"{tps[v]:.0f} | {tps[v] / tps['full']:.2f} |"
        )
    step_s = "; ".join(
        f"{v} " + ", ".join(f"{t:.1f}" for t in speed["step_s"][v]) for v in VARIANTS
    )
    lines += [
        "",
        f"Timed step seconds: {step_s}.",
        "",
        "Trainable MB: their gradients take as much again. Peak tensors: weights, optimizer "
        "state, activations, gradients and temporaries alive at once during a step (like "
        "`torch.cuda.max_memory_allocated`). Peak RSS: the whole process (interpreter, torch, "
        "torchao for QLoRA, and what the C allocator keeps), over the warm-up and one more step.",
    ]
    return "\n".join(lines) + "\n"


def _argv_note(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The command-line flags that differ from the defaults (``--output`` aside)."""
    flags = [
        f"--{name} {value}"
        for name, value in vars(args).items()
        if name not in ("output", "child") and value != parser.get_default(name)
    ]
    return "".join(" " + f for f in flags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=[*VARIANTS, "speed"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768, help="a multiple of 192")
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 * rank)")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: steadier on a shared machine)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS, help="markdown file to write")
    args = parser.parse_args()
    if args.child:
        torch.set_num_threads(args.threads)
        result = speed_child(args) if args.child == "speed" else memory_child(args.child, args)
        print(json.dumps(result))
        return
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux (/proc/self/status and /proc/self/clear_refs)")
    start = time.perf_counter()
    memory = {}
    for variant in VARIANTS:
        memory[variant] = _child(variant, args)
        print(f"{variant}: {json.dumps(memory[variant])}", flush=True)
    speed = _child("speed", args)
    print(f"speed: {json.dumps(speed)}", flush=True)
    minutes = (time.perf_counter() - start) / 60
    report = _report(memory, speed, args, _argv_note(args, parser), minutes)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print("\n" + report)


if __name__ == "__main__":
    main()
