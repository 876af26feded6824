"""Native vs transformers backend: one training step and KV-cache decoding, side by side.

The same random small model (a Llama-style and a Qwen3-style config, about 30M parameters
each) is written once as a HF folder and loaded twice with
:func:`tunesmith.models.from_hf`: ``backend="native"`` (``TransformerLM``, tunesmith's
modules) and ``backend="transformers"`` (``TransformersLM``, transformers' own
``*ForCausalLM`` behind the same forward). Then, for each family:

* **Training step**: forward to the final hidden states (``return_hidden_states=True``),
  ``LinearCrossEntropyLoss`` on ``lm_head.weight`` (the chunked head the recipes use),
  backward, fused ``AdamW`` step, ``zero_grad``: the SFT recipe's step on random tokens
  (``--batch`` rows of ``--seq``, every position trained but the last). After ``--warmup``
  steps each, the backends take turns for ``--repeats`` rounds (the order alternates by round),
  so a load change on a shared machine hits both alike; median wall seconds per step and
  median CPU seconds per thread (which other jobs barely move). The first step's losses of
  the two backends are compared (the same weights and batch: they must agree).
* **Peak memory of a step**: on CUDA ``torch.cuda.max_memory_allocated`` over one step (reset
  before it; weights and optimizer states included). On a CPU, the bytes alive before the
  step (weights and AdamW states, ``storage_bytes``) plus the most bytes torch's CPU allocator
  handed out during the step and had not yet taken back (``AllocatedBytes``: torch's profiler
  with memory recording, replayed), measured on an extra, untimed step. Not the process RSS:
  both models live in one process and the allocator keeps freed pages.
* **Decoding**: :func:`tunesmith.generation.generate`, greedy, KV cache (native: its static
  cache; transformers: the cache transformers' model makes), ``--new-tokens`` tokens for
  each of ``--gen-batch`` prompts of ~``--prompt-len`` tokens (unequal lengths, left-padded);
  turns as above, median; the two backends' tokens are compared.

The ratio columns are native / transformers (tokens/s: > 1 means native is faster; memory:
< 1 means native needs less), computed here from the medians.

Usage::

    python benchmarks/backends.py --threads 1 --out benchmarks/results/backends.md   # CPU fp32
    python benchmarks/backends.py --device cuda --dtype bfloat16 --batch 8 --seq 1024 \\
        --gen-batch 1 32 --out benchmarks/results/backends_cuda.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from decode import SMALL_LLAMA  # noqa: E402
from machine_info import machine  # noqa: E402

from tunesmith.generation import generate  # noqa: E402
from tunesmith.models import build_model, from_hf  # noqa: E402
from tunesmith.models.hf import save_hf_checkpoint  # noqa: E402
from tunesmith.models.spec import spec_from_hf_config  # noqa: E402
from tunesmith.modules.losses import LinearCrossEntropyLoss  # noqa: E402
from tunesmith.training.forward import head_transform, head_weight  # noqa: E402
from tunesmith.training.memory.usage import AllocatedBytes, storage_bytes  # noqa: E402

BACKENDS = ("native", "transformers")

# benchmarks/decode.py's model (RMSNorm, GQA, SwiGLU, tied embeddings, llama3 rope theta)
_COMMON = {**SMALL_LLAMA, "bos_token_id": 1, "eos_token_id": 2}
CONFIGS = {
    "llama": _COMMON,
    # the same sizes with Qwen3's per-head q/k RMSNorm and rope theta
    "qwen3": {**_COMMON, "model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Trainer:
    """One backend's model, optimizer and batch: :meth:`step` is one training step."""

    model: nn.Module
    ids: torch.Tensor
    labels: torch.Tensor
    device: torch.device

    def __post_init__(self) -> None:
        self.loss_fn = LinearCrossEntropyLoss()
        self.trained = int((self.labels != -100).sum())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)

    def step(self) -> float:
        hidden = self.model(self.ids, return_hidden_states=True)
        loss = self.loss_fn(
            hidden, head_weight(self.model), self.labels, transform=head_transform(self.model)
        )
        loss = loss / self.trained  # the token mean, as the recipes take it
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()

    def peak_memory(self) -> int:
        """Peak bytes of one step (weights and optimizer states included); see the docstring."""
        if self.device.type == "cuda":
            _sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.step()
            _sync(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        states = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t)]
        before = storage_bytes([*self.model.parameters(), *self.model.buffers(), *states])
        with AllocatedBytes() as mem:
            self.step()
        return before + mem.peak


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds per intra-op thread, result) of one call."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return time.perf_counter() - wall, (time.process_time() - cpu) / torch.get_num_threads(), out


def take_turns(
    calls: dict[str, Callable[[], object]], repeats: int, device: torch.device
) -> dict[str, tuple[list[float], list[float]]]:
    """Each call once per round, the order alternating by round; wall and CPU times per call."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in calls}
    for r in range(repeats):
        for name in calls if r % 2 == 0 else reversed(list(calls)):
            wall, cpu, _ = timed(calls[name], device)
            times[name][0].append(wall)
            times[name][1].append(cpu)
    return times


def bench_family(family: str, args: argparse.Namespace, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    config = dict(CONFIGS[family])
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        save_hf_checkpoint(build_model(spec_from_hf_config(config)), Path(tmp) / "model")
        models = {
            b: from_hf(Path(tmp) / "model", dtype=dtype, device=device, backend=b) for b in BACKENDS
        }
    n_params = sum(p.numel() for p in models["native"].parameters())
    assert n_params == sum(p.numel() for p in models["transformers"].parameters())

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config["vocab_size"], (args.batch, args.seq), generator=gen)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    trainers = {
        b: Trainer(m.train(), ids.to(device), labels.to(device), device) for b, m in models.items()
    }
    first_loss = {b: t.step() for b, t in trainers.items()}  # the same weights and batch
    for _ in range(args.warmup - 1):
        for t in trainers.values():
            t.step()
    step_times = take_turns({b: t.step for b, t in trainers.items()}, args.repeats, device)
    peak = {b: t.peak_memory() for b, t in trainers.items()}
    del trainers

    decode = {}
    for batch in args.gen_batch:
        prompts = [
            torch.randint(
                3, config["vocab_size"], (args.prompt_len - i % 4,), generator=gen
            ).tolist()
            for i in range(batch)
        ]
        calls = {}
        for b, m in models.items():
            m.eval()
            generate(m, prompts, max_new_tokens=4)  # warm-up
            calls[b] = lambda m=m, p=prompts: (
                generate(m, p, max_new_tokens=args.new_tokens).sequences
            )
        tokens = {b: call() for b, call in calls.items()}
        decode[batch] = {
            "times": take_turns(calls, args.gen_repeats, device),
            "same_tokens": tokens["native"] == tokens["transformers"],
        }
    return {
        "params": n_params,
        "first_loss": first_loss,
        "step_times": step_times,
        "peak": peak,
        "decode": decode,
    }


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def report(results: dict[str, dict], args: argparse.Namespace, minutes: float) -> str:
    step_tokens = args.batch * args.seq
    memory = (
        "`torch.cuda.max_memory_allocated` over one step"
        if args.device.startswith("cuda")
        else "weights + AdamW states + torch's CPU allocator peak during one step "
        "(`AllocatedBytes`, the profiler's memory records)"
    )
    train_rows, decode_rows, ratio_lines = [], [], []
    for family, r in results.items():
        med = {b: statistics.median(r["step_times"][b][0]) for b in BACKENDS}
        cpu = {b: statistics.median(r["step_times"][b][1]) for b in BACKENDS}
        tps = {b: step_tokens / med[b] for b in BACKENDS}
        for b in BACKENDS:
            rounds = ", ".join(f"{t:.2f}" for t in r["step_times"][b][0])
            train_rows.append(
                f"| {family} | {b} | {r['first_loss'][b]:.6f} | {med[b]:.3f} | {tps[b]:,.0f} | "
                f"{cpu[b]:.3f} | {step_tokens / cpu[b]:,.0f} | {_mib(r['peak'][b])} | {rounds} |"
            )
        speed = tps["native"] / tps["transformers"]
        cpu_ratio = cpu["transformers"] / cpu["native"]  # tokens per CPU second, native / tr.
        mem_ratio = r["peak"]["native"] / r["peak"]["transformers"]
        train_rows.append(
            f"| {family} | **native / transformers** | | | **{speed:.2f}x** | | "
            f"{cpu_ratio:.2f}x | **{mem_ratio:.2f}x** | |"
        )
        loss_gap = abs(r["first_loss"]["native"] - r["first_loss"]["transformers"])
        ratio_lines.append(
            f"- {family} ({r['params'] / 1e6:.1f}M params): training step tokens/s native / "
            f"transformers = **{speed:.2f}x** (by CPU time {cpu_ratio:.2f}x), peak memory "
            f"**{mem_ratio:.2f}x**; first-step losses differ by {loss_gap:.2e}"
        )
        for batch, d in r["decode"].items():
            new = batch * args.new_tokens
            dmed = {b: statistics.median(d["times"][b][0]) for b in BACKENDS}
            dcpu = {b: statistics.median(d["times"][b][1]) for b in BACKENDS}
            dtps = {b: new / dmed[b] for b in BACKENDS}
            for b in BACKENDS:
                rounds = ", ".join(f"{t:.2f}" for t in d["times"][b][0])
                decode_rows.append(
                    f"| {family} | {batch} | {b} | {dmed[b]:.2f} | {dtps[b]:,.1f} | "
                    f"{dcpu[b]:.2f} | {new / dcpu[b]:,.1f} | {rounds} |"
                )
            dratio = dtps["native"] / dtps["transformers"]
            dcpu_ratio = dcpu["transformers"] / dcpu["native"]
            same = "same tokens" if d["same_tokens"] else "**tokens differ**"
            decode_rows.append(
                f"| {family} | {batch} | **native / transformers** | | **{dratio:.2f}x** | | "
                f"{dcpu_ratio:.2f}x | {same} |"
            )
            ratio_lines.append(
                f"- {family}, decoding batch {batch}: new tokens/s native / transformers = "
                f"**{dratio:.2f}x** (by CPU time {dcpu_ratio:.2f}x; {same})"
            )
    command = "python benchmarks/backends.py " + shlex.join(sys.argv[1:])
    sizes = CONFIGS["llama"]
    model = (
        f"vocab {sizes['vocab_size']}, hidden {sizes['hidden_size']}, intermediate "
        f"{sizes['intermediate_size']}, {sizes['num_hidden_layers']} layers, "
        f"{sizes['num_attention_heads']} heads / {sizes['num_key_value_heads']} kv heads of "
        f"{sizes['head_dim']}, tied embeddings"
    )
    versions = (
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {_transformers_version()}"
    )
    return f"""# Native vs transformers backend: training step and decoding

`{command}` ({minutes:.1f} min)

- Models: a Llama-style and a Qwen3-style config ({model}; Qwen3 adds its per-head q/k
  RMSNorm), random weights written once as a HF folder and loaded by
  `from_hf(backend="native")` and `from_hf(backend="transformers")`; {args.dtype} on
  {args.device}.
- Training step: forward to the hidden states, `LinearCrossEntropyLoss` on the head (token
  mean), backward, fused AdamW step; batch {args.batch} x seq {args.seq} ({step_tokens:,}
  tokens) of random ids; {args.warmup} warm-up step(s) each, then {args.repeats} rounds with
  the backends taking turns (alternating order); median wall time per step, and median CPU
  time per intra-op thread (less moved by other jobs on a shared machine).
- Peak memory: {memory}.
- Decoding: `generate`, greedy, KV cache, {args.new_tokens} new tokens per prompt of
  ~{args.prompt_len} tokens; one warm-up call each, then {args.gen_repeats} rounds in turns;
  median.
- Machine: {machine()}; {torch.get_num_threads()} intra-op thread(s); {versions}; run
  {datetime.date.today().isoformat()}.

## Training step

| model | backend | step-1 loss | median step s | tokens/s | median CPU s per thread | tokens per CPU s | peak MiB | step s per round |
|---|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(train_rows)}

## Decoding (KV cache)

| model | batch | backend | median s | new tokens/s | median CPU s per thread | new tokens per CPU s | s per round |
|---|---:|---|---:|---:|---:|---:|---:|
{chr(10).join(decode_rows)}

## Ratios (native / transformers, computed by the script)

Throughput ratios above 1 mean native is faster; memory ratios below 1 mean native needs
less. Wall-clock medians move with other jobs on a shared machine (see the per-round times);
the CPU-time ratios (tokens per CPU second of this process) are the steadier comparison.

{chr(10).join(ratio_lines)}
"""


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gen-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args()
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first step compares the backends' losses)")

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    start = time.perf_counter()
    results = {}
    for family in args.families:
        results[family] = bench_family(family, args, device)
        print(f"{family}: done ({(time.perf_counter() - start) / 60:.1f} min)", file=sys.stderr)
    text = report(results, args, (time.perf_counter() - start) / 60)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
