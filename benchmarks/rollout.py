"""Rollout engines side by side: the plain engine, the paged rollout engine, transformers.

Everything runs in one process on one random model, so the rows of a table share the machine's
state. The model is the random Llama-shaped model of ``sft_mfu.py`` (vocab 32000, hidden 256,
4 layers, 8 heads / 4 KV heads, untied ``lm_head``), the one ``rl_step.py`` times a GRPO step
on; the rows are ``--prompts`` distinct prompts of random token ids, about ``--prompt-len``
tokens long (``prompt_len - 1 + i % 4``), each repeated ``--group-size`` times (a GRPO group).

* **A. RL rollout** (``rl_step.py``'s workload): every row samples ``--new-tokens`` tokens
  (keyed sampling, temperature 1, no stop tokens). The plain engine
  (:func:`tunesmith.generation.generate`: one left-padded batch, a contiguous KV cache), the
  paged engine (:func:`tunesmith.generation.paged.generate_paged`, the default of
  ``LocalEngine``), the paged engine with ``share_prefixes=False`` and the paged engine with
  its compiled decode step (``torch.compile(model, dynamic=False)``, as ``LocalEngine`` makes
  it; ``mode="reduce-overhead"``, CUDA graphs, on CUDA). Against the forward-only throughput
  measured exactly as ``rl_step.py`` does (its own function).
* **B. Long tail**: the same rows, half of them (every other row) stopping after
  ``--tail-short`` tokens, the others after ``--tail-long`` (per-row ``max_new_tokens``).
  Plain vs paged vs paged with ``max_slots=--tail-slots`` (continuous batching with refills).
* **C. transformers**: ``transformers``' ``generate`` on the same weights (the HF model class
  of the same config, our ``state_dict`` loaded strictly), greedy, every row left-padded in
  one batch, its static cache (``cache_implementation="static"``; the dynamic cache if the
  static one fails, and the report says so), against our engines greedy on the same rows.
* **D. Measured bound**: one paged decode step of workload A (mid-way: ``--new-tokens // 2``
  tokens generated) under ``torch.profiler``, its ops' self time grouped into matmuls,
  attention, cache gather/write, sampling and other; and the ``lm_head`` GEMM at the decode
  batch against a 1024-row batch.
* **E. GRPO end to end**: ``tunesmith.recipes.grpo`` on the shipped ``grpo/tiny`` config as
  ``rl_step.py`` runs it (its ``make_world`` and ``recipe_config``: full fine-tuning, k3 KL),
  with ``generation.engine.paged=false`` and with the default (paged).
* **F. Qwen3-0.6B shape** (with ``--qwen-batches``; made for CUDA): the random
  ``qwen3_0_6b``-shaped model (hidden 1024, 28 layers, 16 heads / 8 KV heads, head_dim 128,
  intermediate 3072, vocab 151936) sampling at each batch, plain vs paged vs paged compiled.
* **G. Colocation**: a GRPO-shaped training step's peak memory (``colocation.py``: on CUDA
  ``max_memory_allocated``, on CPU the CPU allocator's reports to the profiler replayed from
  before the rollout) with no rollout before it and after a rollout of workload A's rows by
  ``LocalEngine`` (eager, compiled), and by an engine that keeps its pool alive (the
  counter-example that shows the measurement sees a kept cache).

The missed targets' bounds are computed from measurements of the same run: A's from D's
profile; B's from the plain and paged prefills (each engine's call with one new token) and
D-style decode steps at B's two batch sizes; C's from a profile of one whole ``generate`` call
of transformers and of the paged engine (the time each spends in the same matmul kernels).

Each configuration is called once to warm up (the compiled one compiles then), then
``--repeats`` times, the configurations of a table taking turns (round-robin, so a burst of
load from elsewhere falls on all of them); tables show the medians, wall and process CPU time.
The results file is rewritten after each section, so an interrupted run leaves what it measured.

Usage::

    python benchmarks/rollout.py                      # CPU, writes benchmarks/results/rollout.md
    python benchmarks/rollout.py --dry-run --out /tmp/r  # tiny shapes, seconds
    bash benchmarks/gpu/rollout.sh                    # CUDA (a lent GPU), see benchmarks/gpu/
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# A fresh compile cache for this run, so the compile times measured are those of a first run
# (inductor's and Triton's on-disk caches would otherwise make a second run's look cheap).
if "--warm-compile-cache" not in sys.argv:
    _CACHE = tempfile.mkdtemp(prefix="rollout_compile_cache_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _CACHE
    os.environ["TRITON_CACHE_DIR"] = os.path.join(_CACHE, "triton")
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import rl_step  # noqa: E402
from colocation import TOLERANCE, GrpoStep, step_peak  # noqa: E402
from machine_info import command_line, machine  # noqa: E402
from sft_mfu import MODEL  # noqa: E402

from tunesmith.generation import generate  # noqa: E402
from tunesmith.generation.config import EngineSettings  # noqa: E402
from tunesmith.generation.generate import GenerationOutput  # noqa: E402
from tunesmith.generation.keyed import row_key  # noqa: E402
from tunesmith.generation.paged import generate_paged  # noqa: E402
from tunesmith.generation.sampling import sample  # noqa: E402
from tunesmith.models import build_model, qwen3  # noqa: E402
from tunesmith.models.spec import spec_from_hf_config  # noqa: E402
from tunesmith.recipes import grpo  # noqa: E402

SECTIONS = ("a", "tail", "hf", "profile", "grpo", "qwen", "coloc")
TITLES = {
    "a": "A. RL rollout: plain vs paged engine",
    "tail": "B. Long tail: continuous batching",
    "hf": "C. Against transformers' generate (greedy)",
    "profile": "D. Measured bound: one paged decode step",
    "grpo": "E. GRPO end to end",
    "qwen": "F. Qwen3-0.6B-shaped model",
    "coloc": "G. Colocation: a training step's peak memory after a rollout",
}
# The dry run's Qwen3 stand-in: the 0.6B config with small widths (same vocab, qk-norm, tied).
DRY_QWEN = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
# Metrics of a GRPO step that depend on the sampled tokens (compared between the engines).
GRPO_CHECKED = ("reward", "reward_std", "completion_length", "completion_length_max",
                "stopped_fraction", "tokens_seen", "completion_tokens_in_window", "loss", "grad_norm",
                "entropy", "kl", "approx_kl", "advantage_mean", "advantage_std")  # fmt: skip
# The sampler's log-probs against the trainer's: each engine rounds its own way, so these are
# shown side by side rather than expected equal.
GRPO_NUMERICS = ("logprob_mismatch_max", "logprob_mismatch_mean")
NL = "\n"
TARGETS = {"gen_forward": 0.8, "tail": 2.5, "hf": 2.0}
TOTALS = {"wall": 0.0, "cpu": 0.0}  # over every timed call of every table


# -- timing -----------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, float, Any]:
    """``(wall s, process CPU s, result)`` of one call."""
    _sync(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def measure(
    cases: dict[str, Callable[[], Any]], repeats: int, device: torch.device, label: str
) -> dict[str, dict[str, Any]]:
    """Each case once to warm up, then ``repeats`` rounds taking turns; per case the first
    call's wall time, the medians and every timing, and the last result."""
    out: dict[str, dict[str, Any]] = {}
    for name, fn in cases.items():
        wall, cpu, result = timed(fn, device)
        out[name] = {"first_s": wall, "walls": [], "cpus": [], "out": result}
        print(f"  {label} / {name}: first call {wall:.2f} s", flush=True)
    for _ in range(repeats):
        for name, fn in cases.items():
            wall, cpu, result = timed(fn, device)
            out[name]["walls"].append(wall)
            out[name]["cpus"].append(cpu)
            TOTALS["wall"] += wall
            TOTALS["cpu"] += cpu
            out[name]["out"] = result
    for name, case in out.items():
        case["wall"] = statistics.median(case["walls"])
        case["cpu"] = statistics.median(case["cpus"])
        print(f"  {label} / {name}: median {case['wall']:.2f} s wall, {case['cpu']:.2f} s CPU")
    return out


def compare(out: GenerationOutput, ref: GenerationOutput) -> tuple[int, float]:
    """Rows whose tokens differ from ``ref``'s, and the largest |log-prob gap| over the tokens
    the two agree on (each row up to its first differing token)."""
    differ, gap = 0, 0.0
    for a, b, la, lb in zip(out.sequences, ref.sequences, out.logprobs, ref.logprobs):
        same = 0
        while same < min(len(a), len(b)) and a[same] == b[same]:
            same += 1
        differ += a != b
        gap = max(gap, max((abs(x - y) for x, y in zip(la[:same], lb[:same])), default=0.0))
    return differ, gap


# -- the world --------------------------------------------------------------------------------


def make_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    torch.manual_seed(0)
    return build_model(spec_from_hf_config(dict(config)), device=device, dtype=dtype).eval()


def make_rows(
    prompts: int, group: int, length: int, vocab: int, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """``prompts`` random prompts (lengths ``length - 1 + i % 4``) x ``group`` rows each, and
    the rows' sampling keys (``row_key(seed, 0, prompt, sample)``, as the recipes key them)."""
    gen = torch.Generator().manual_seed(seed)
    distinct = [
        torch.randint(3, vocab, (max(length - 1 + i % 4, 1),), generator=gen).tolist()
        for i in range(prompts)
    ]
    rows = [p for p in distinct for _ in range(group)]
    keys = [row_key(seed, 0, i, j) for i in range(prompts) for j in range(group)]
    return rows, keys


def compiled_step(model: Any, device: torch.device, backend: str) -> Any:
    """The decode step ``LocalEngine`` compiles (``engine.compile: true``)."""
    if backend != "inductor":  # the dry run: dynamo's capture without code generation
        return torch.compile(model, dynamic=False, backend=backend)
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(model, dynamic=False, mode=mode)


class Bench:
    """The run's settings, model and rows, and what each section measured."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.model = make_model(MODEL, self.device, self.dtype)
        self.rows, self.keys = make_rows(
            args.prompts, args.group_size, args.prompt_len, MODEL["vocab_size"]
        )
        self.results: dict[str, Any] = {}
        self.errors: dict[str, str] = {}
        self.on_progress: Callable[[], Any] = lambda: None  # rewrites the report mid-section
        self.previous: dict[str, str] = {}  # sections kept from an earlier report (--keep-unrun)

    def common(self, **extra: Any) -> dict[str, Any]:
        return {"temperature": 1.0, "row_keys": self.keys, "pad_id": 0, **extra}

    # -- A ------------------------------------------------------------------------------------

    def section_a(self) -> None:
        args, model, rows = self.args, self.model, self.rows
        limit = args.new_tokens
        step = compiled_step(model, self.device, args.compile_backend)
        cases = {
            "plain": lambda: generate(model, rows, max_new_tokens=limit, **self.common()),
            "paged": lambda: generate_paged(model, rows, max_new_tokens=limit, **self.common()),
            "paged, share_prefixes=False": lambda: generate_paged(
                model,
                rows,
                max_new_tokens=limit,
                settings=EngineSettings(share_prefixes=False),
                **self.common(),
            ),  # fmt: skip
            "paged + compiled step": lambda: generate_paged(
                model, rows, max_new_tokens=limit, compiled_step=step, **self.common()
            ),
        }
        with torch.no_grad():
            runs = measure(cases, args.repeats, self.device, "A")
        ns = argparse.Namespace(
            prompts=args.prompts, group_size=args.group_size, new_tokens=args.new_tokens,
            micro_batch=args.micro_batch, forward_repeats=args.repeats, bf16=False,
        )  # fmt: skip
        _, forward_cpu_s, forward = timed(
            lambda: rl_step.forward_tokens_per_s(model, ns, self.device), self.device
        )
        # its CPU time over its warm-up and timed calls, each one forward over every token
        forward_cpu = (args.repeats + 1) * len(rows) * args.new_tokens / forward_cpu_s
        plain = runs["plain"]["out"]
        for run in runs.values():
            out = run["out"]
            run["tokens"] = out.new_tokens
            run["tokens_per_s"] = out.new_tokens / run["wall"]
            run["vs_forward"] = run["tokens_per_s"] / forward
            run["cpu_vs_forward"] = out.new_tokens / run["cpu"] / forward_cpu
            run["prefill"] = out.stats.get("prefill_tokens", sum(len(r) for r in rows))
            run["differ"], run["gap"] = compare(out, plain)
            run["decode_steps"] = out.stats.get("decode_steps", limit - 1)  # plain: longest - 1
        compiled = runs["paged + compiled step"]
        compiled["compile_s"] = compiled["first_s"] - compiled["wall"]
        self.results["a"] = {"runs": runs, "forward": forward, "forward_cpu": forward_cpu}

    # -- B ------------------------------------------------------------------------------------

    def section_tail(self) -> None:
        args, model, rows = self.args, self.model, self.rows
        limits = [args.tail_short if i % 2 == 0 else args.tail_long for i in range(len(rows))]
        slots = EngineSettings(max_slots=args.tail_slots)
        cases = {
            "plain": lambda: generate(model, rows, max_new_tokens=limits, **self.common()),
            "paged": lambda: generate_paged(model, rows, max_new_tokens=limits, **self.common()),
            f"paged, max_slots={args.tail_slots}": lambda: generate_paged(
                model, rows, max_new_tokens=limits, settings=slots, **self.common()
            ),
        }
        with torch.no_grad():
            runs = measure(cases, args.repeats, self.device, "B")
        plain = runs["plain"]
        for name, run in runs.items():
            out = run["out"]
            run["tokens"] = out.new_tokens
            run["tokens_per_s"] = out.new_tokens / run["wall"]
            run["speedup"] = plain["wall"] / run["wall"]
            run["cpu_speedup"] = plain["cpu"] / run["cpu"]
            run["differ"], run["gap"] = compare(out, plain["out"])
            if name == "plain":  # one padded batch decoded to its longest row
                run["decode_steps"] = max(limits) - 1
                run["decode_rows"] = len(rows) * (max(limits) - 1)
                run["peak_slots"] = len(rows)
            else:
                for key in ("decode_steps", "decode_rows", "peak_slots"):
                    run[key] = out.stats[key]
        self.results["tail"] = {
            "runs": runs,
            "limits": limits,
            "bound": self.tail_bound(limits, runs),
        }

    def tail_bound(self, limits: list[int], runs: dict[str, Any]) -> dict[str, float]:
        """What B's plain / paged wall ratio can reach: the plain engine's measured wall over
        the paged engine's floor, its prefill (a call with one new token) plus its decode
        steps at the cost of D-style steps of all rows and of the long rows only (or, ideally,
        each step costing its rows' share of the all-rows step)."""
        args, model, rows = self.args, self.model, self.rows
        prefill = {"paged": lambda: generate_paged(model, rows, max_new_tokens=1, **self.common())}
        with torch.no_grad():
            pre = measure(prefill, args.repeats, self.device, "B prefill")["paged"]
        generated = max(args.new_tokens // 2, 1)
        long_rows = [i for i, n in enumerate(limits) if n == max(limits)]
        full = self.step_times(self.decode_step(generated)[0])
        part = self.step_times(self.decode_step(generated, long_rows)[0])
        plain, paged = runs["plain"], runs["paged"]
        steps, fed = paged["decode_steps"], paged["decode_rows"]
        n, k = len(rows), len(long_rows)
        at_full = (fed - k * steps) / (n - k) if n > k else steps  # steps with every row
        out: dict[str, float] = {
            "row_steps": plain["decode_rows"] / fed, "generated": generated, "rows": n,
            "long_rows": k, "at_full": at_full, "at_part": steps - at_full,
        }  # fmt: skip
        for clock in ("wall", "cpu"):  # the same floor in wall time and in process CPU time
            full_s, part_s = full[clock] / 1e3, part[clock] / 1e3
            floor = pre[clock] + at_full * full_s + (steps - at_full) * part_s
            ideal = pre[clock] + fed / n * full_s
            out.update({
                f"prefill_{clock}": pre[clock], f"full_ms_{clock}": full[clock],
                f"part_ms_{clock}": part[clock], f"floor_{clock}": floor, f"ideal_{clock}": ideal,
                f"measured_{clock}": plain[clock] / floor,
                f"proportional_{clock}": plain[clock] / ideal,
            })  # fmt: skip
        return out

    # -- C ------------------------------------------------------------------------------------

    def section_hf(self) -> None:
        import transformers

        args, model, rows = self.args, self.model, self.rows
        limit = args.new_tokens
        config = transformers.AutoConfig.for_model(
            **{k: v for k, v in MODEL.items() if k != "architectures"}
        )
        hf = transformers.AutoModelForCausalLM.from_config(config)
        hf.load_state_dict(model.state_dict(), strict=True)
        hf = hf.to(device=self.device, dtype=self.dtype).eval()
        length = max(map(len, rows))
        ids = torch.tensor([[0] * (length - len(r)) + r for r in rows], device=self.device)
        mask = (ids != 0).long()  # prompts hold no 0 (ids are drawn from 3 up)
        for r, m in zip(rows, mask.tolist()):
            assert sum(m) == len(r)

        def run_hf(cache: str | None) -> list[list[int]]:
            gen_config = transformers.GenerationConfig(
                do_sample=False, max_new_tokens=limit, min_new_tokens=limit,
                eos_token_id=None, pad_token_id=0, bos_token_id=None,
                cache_implementation=cache,
            )  # fmt: skip
            out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
            return out[:, length:].tolist()

        cache: str | None = "static"
        with torch.no_grad():
            try:
                run_hf(cache)
            except Exception as error:  # noqa: BLE001 - reported, then the dynamic cache
                self.results["hf_static_error"] = f"{type(error).__name__}: {error}"[:300]
                cache = None
            greedy = {"pad_id": 0}
            cases = {
                "transformers": lambda: run_hf(cache),
                "plain": lambda: generate(model, rows, max_new_tokens=limit, **greedy),
                "paged": lambda: generate_paged(model, rows, max_new_tokens=limit, **greedy),
            }
            runs = measure(cases, args.repeats, self.device, "C")
            profiled = {  # one whole call each: where its time goes, op group by op group
                name: group_ms(profile_ops(cases[name], 1, self.device))
                for name in ("transformers", "paged")
            }
        hf_tokens = runs["transformers"]["out"]
        for name, run in runs.items():
            sequences = run["out"] if name == "transformers" else run["out"].sequences
            run["tokens"] = sum(map(len, sequences))
            run["tokens_per_s"] = run["tokens"] / run["wall"]
            run["cpu_tokens_per_s"] = run["tokens"] / run["cpu"]
            run["equal_hf"] = sum(a == b for a, b in zip(sequences, hf_tokens))
        hf_tps = runs["transformers"]["tokens_per_s"]
        for run in runs.values():
            run["vs_hf"] = run["tokens_per_s"] / hf_tps
            run["cpu_vs_hf"] = run["cpu_tokens_per_s"] / runs["transformers"]["cpu_tokens_per_s"]
        self.results["hf"] = {
            "runs": runs,
            "cache": cache or "dynamic",
            "version": transformers.__version__,
            "attn": getattr(hf.config, "_attn_implementation", None),
            "compiled": getattr(hf, "_compiled_call", None) is not None,
            "profiled": profiled,
        }

    # -- D ------------------------------------------------------------------------------------

    def decode_step(
        self, generated: int, keep: list[int] | None = None
    ) -> tuple[Callable[[], None], Any]:
        """One decode step of workload A's rows (those in ``keep``, or all) as the paged engine
        runs it, ``generated`` tokens into every row: the shared prompt blocks and each row's
        own blocks laid out as the engine lays them out, the block tables built from Python
        lists, ``bind``, the model's forward (``logits_to_keep=1``), keyed sampling and the
        host copy of the tokens. Returns the step and its cache."""
        args, model = self.args, self.model
        bs, device = EngineSettings().block_size, self.device
        keep = list(range(len(self.rows))) if keep is None else keep
        tables, positions, next_block = [], [], 1
        for p in range(args.prompts):
            prompt = self.rows[p * args.group_size]
            full, total = len(prompt) // bs, -(-len(prompt) // bs)
            shared = list(range(next_block, next_block + total))
            next_block += total
            own = -(-(len(prompt) + args.new_tokens - 1) // bs) - full
            for j in range(args.group_size):
                if p * args.group_size + j not in keep:
                    continue
                at = len(prompt) + generated - 1
                table = shared[:full] + list(range(next_block, next_block + own))
                next_block += own
                tables.append(table[: at // bs + 1])
                positions.append(at)
        cache = model.init_paged_kv_cache(next_block, bs)
        keys = torch.tensor([self.keys[i] for i in keep], device=device)
        width = max(map(len, tables))
        token_ids = [[5] for _ in tables]

        def step() -> None:
            with torch.profiler.record_function("rollout::host"):
                table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
                ids = torch.tensor(token_ids, device=device)
                at = torch.tensor(positions, device=device)[:, None]
            with torch.profiler.record_function("rollout::cache"):
                cache.bind(table, at)
            logits = model(ids, position_ids=at, kv_cache=cache, logits_to_keep=1)[:, -1]
            with torch.profiler.record_function("rollout::sample"):
                steps = torch.full((len(tables),), generated, device=device)
                out = sample(logits, temperature=1.0, keys=keys, step=steps)
                out.tokens.tolist(), out.logprobs.tolist()

        return step, cache

    def section_profile(self) -> None:
        args, device = self.args, self.device
        step, cache = self.decode_step(max(args.new_tokens // 2, 1))
        for name, label in (("update", "rollout::cache"), ("attention_mask", "rollout::mask")):
            method = getattr(cache, name)

            def wrapped(*a: Any, _method: Any = method, _label: str = label, **k: Any) -> Any:
                with torch.profiler.record_function(_label):
                    return _method(*a, **k)

            setattr(cache, name, wrapped)  # this cache object only: labels its calls
        times = self.step_times(step)
        ops = profile_ops(step, args.profile_steps, device)
        groups = group_ms(ops)
        self.results["profile"] = {
            "ops": sorted(ops.items(), key=lambda kv: -kv[1]),
            "groups": groups,
            "step_ms": times["wall"],
            "step_cpu_ms": times["cpu"],
            "clock": "self CUDA time" if device.type == "cuda" else "self CPU time",
            "rows": len(self.rows),
            "generated": max(args.new_tokens // 2, 1),
            "gemm": self.lm_head_gemm(),
        }

    def step_times(self, step: Callable[[], None]) -> dict[str, float]:
        """Median ms of ``step``, wall and process CPU time (two warm-up calls, then at least
        5)."""
        with torch.no_grad():
            for _ in range(2):
                step()
            calls = [timed(step, self.device) for _ in range(max(self.args.repeats, 5))]
        return {
            "wall": statistics.median(c[0] for c in calls) * 1e3,
            "cpu": statistics.median(c[1] for c in calls) * 1e3,
        }

    def lm_head_gemm(self) -> dict[int, dict[str, float]]:
        """``lm_head`` alone on ``m`` random hidden rows: ms per call (median), µs per row."""
        weight = self.model.lm_head.weight.detach()
        out: dict[int, dict[str, float]] = {}
        for m in (len(self.rows), self.args.gemm_rows):
            x = torch.randn(m, weight.shape[1], device=self.device, dtype=weight.dtype)
            with torch.no_grad():
                for _ in range(2):
                    F.linear(x, weight)
                calls = max(self.args.repeats, 5)
                ms = statistics.median(
                    timed(lambda x=x: F.linear(x, weight), self.device)[0] for _ in range(calls)
                ) * 1e3  # fmt: skip
            flops = 2 * m * weight.shape[0] * weight.shape[1]
            out[m] = {"ms": ms, "us_per_row": ms * 1e3 / m, "gflops": flops / ms / 1e6}
        return out

    # -- E ------------------------------------------------------------------------------------

    def section_grpo(self) -> None:
        args = self.args
        ns = argparse.Namespace(
            device=args.device, bf16=args.dtype == "bfloat16", prompts=args.prompts,
            group_size=args.group_size, micro_batch=args.micro_batch, new_tokens=args.new_tokens,
            kl_coef=args.kl_coef, warmup=args.grpo_warmup, steps=args.grpo_steps,
        )  # fmt: skip
        runs: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory(prefix="rollout_grpo_") as tmp:
            world = Path(tmp)
            rows = args.prompts * (args.grpo_warmup + args.grpo_steps)
            model_dir, prompts = rl_step.make_world(world, rows)
            for name, paged in (("plain (paged=false)", False), ("paged (default)", True)):
                output_dir = world / ("paged" if paged else "plain")
                cfg = rl_step.recipe_config(ns, "full", model_dir, prompts, output_dir)
                cfg.generation.engine = {"paged": paged}
                started = time.perf_counter()
                grpo.main(cfg)
                wall = time.perf_counter() - started
                lines = (output_dir / "metrics.jsonl").read_text().splitlines()
                steps = {r["step"]: r for r in map(json.loads, lines) if "step" in r}
                measured = [steps[s] for s in sorted(steps) if s > args.grpo_warmup]
                if len(measured) != args.grpo_steps:
                    raise RuntimeError(f"{name}: {len(measured)} measured GRPO steps")
                time_key = "step_time_s" if args.grpo_warmup else "first_step_s"
                runs[name] = {
                    "first": steps[1],
                    "wall": wall,
                    "step_s": statistics.median(r[time_key] for r in measured),
                    "generate_s": statistics.median(r["generate_s"] for r in measured),
                    "generate_all": [r["generate_s"] for r in measured],
                    "samples_per_s": statistics.median(
                        r["rollout_samples"] / r[time_key] for r in measured
                    ),
                    "tokens_per_s": statistics.median(
                        r["generated_tokens_per_s"] for r in measured
                    ),
                }
                print(f"  E / {name}: generate {runs[name]['generate_s']:.2f} s", flush=True)
        plain, paged = runs.values()
        same, differ = [], []
        for key in GRPO_CHECKED:
            a, b = plain["first"].get(key), paged["first"].get(key)
            (same if a == b else differ).append((key, a, b))
        numerics = [(k, plain["first"].get(k), paged["first"].get(k)) for k in GRPO_NUMERICS]
        self.results["grpo"] = {
            "runs": runs, "same": same, "differ": differ, "numerics": numerics, "bf16": ns.bf16,
        }  # fmt: skip

    # -- F ------------------------------------------------------------------------------------

    def section_qwen(self) -> None:
        args, device = self.args, self.device
        config = qwen3.spec("qwen3_0_6b").to_hf_config()
        if args.dry_run:
            config = {**config, **DRY_QWEN}
        model = make_model(config, device, self.dtype)
        step = compiled_step(model, device, args.compile_backend)
        tables = []
        for batch in args.qwen_batches:
            group = min(args.group_size, batch)
            rows, keys = make_rows(
                -(-batch // group), group, args.qwen_prompt_len, config["vocab_size"], seed=1
            )
            rows, keys = rows[:batch], keys[:batch]
            common = {"temperature": 1.0, "row_keys": keys, "pad_id": 0,
                      "max_new_tokens": args.qwen_new_tokens}  # fmt: skip
            cases = {
                "plain": lambda rows=rows, common=common: generate(model, rows, **common),
                "paged": lambda rows=rows, common=common: generate_paged(model, rows, **common),
                "paged + compiled step": lambda rows=rows, common=common: generate_paged(
                    model, rows, compiled_step=step, **common
                ),
            }
            with torch.no_grad():
                runs = measure(cases, args.qwen_repeats, device, f"F batch {batch}")
            for run in runs.values():
                run["tokens"] = run["out"].new_tokens
                run["tokens_per_s"] = run["tokens"] / run["wall"]
                run["vs_plain"] = runs["plain"]["wall"] / run["wall"]
                run["differ"], run["gap"] = compare(run["out"], runs["plain"]["out"])
            for run in runs.values():
                run["out"] = None  # the batch's tokens are not kept
            runs["paged + compiled step"]["compile_s"] = (
                runs["paged + compiled step"]["first_s"] - runs["paged + compiled step"]["wall"]
            )
            tables.append({"batch": batch, "group": group, "runs": runs})
            self.results["qwen"] = {"tables": tables, "config": config}
            self.on_progress()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # -- G ------------------------------------------------------------------------------------

    def section_coloc(self) -> None:
        """A GRPO-shaped step's peak with no rollout before it, then after a rollout by each
        engine: eager, with its compiled step, and one keeping its pools (the counter-example).
        """
        args, device, rows = self.args, self.device, self.rows
        model = make_model(MODEL, device, self.dtype)  # its own: the step trains it
        kept: list[Any] = []
        steps = {"paged (default)": None,
                 "paged + compiled step": compiled_step(model, device, args.compile_backend),
                 "paged, pool kept alive (counter-example)": None}  # fmt: skip
        outputs: dict[str, GenerationOutput] = {}

        def rollout(name: str) -> GenerationOutput:
            if name.endswith("(counter-example)"):
                model.init_paged_kv_cache = _keeping_caches(model, kept)
            try:
                outputs[name] = generate_paged(
                    model, rows, max_new_tokens=args.new_tokens, compiled_step=steps[name],
                    **self.common(),
                )  # fmt: skip
            finally:
                vars(model).pop("init_paged_kv_cache", None)
            return outputs[name]

        for name in steps:  # warm-up: the compiled step compiles
            wall, _, out = timed(lambda name=name: rollout(name), device)
            print(f"  G / {name}: warm-up rollout {wall:.2f} s", flush=True)
        kept.clear()
        step = GrpoStep(model, rows, out, micro_batch=args.micro_batch)
        step_s = timed(step, device)[0]  # warm-up: AdamW's state
        without, _ = step_peak(step)
        runs = {"none": {"peak": without, "held": 0, "cache_mib": None}}
        for name in steps:
            peak, held = step_peak(step, lambda name=name: rollout(name))
            runs[name] = {"peak": peak, "held": held,
                          "cache_mib": outputs[name].stats["cache_mib"]}  # fmt: skip
            print(f"  G / {name}: step peak {peak / 2**20:.1f} MiB (none: "
                  f"{without / 2**20:.1f}), held {held / 2**20:.1f} MiB", flush=True)  # fmt: skip
        kept.clear()
        self.results["coloc"] = {"runs": runs, "step_s": step_s}


def profile_ops(
    fn: Callable[[], Any], calls: int, device: torch.device
) -> dict[tuple[str, str], float]:
    """Self time (CUDA time on CUDA, else CPU time) of each ``(op, group)`` in ms per call of
    ``fn``, over ``calls`` profiled calls (no gradient)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.no_grad(), torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    ops: dict[tuple[str, str], float] = {}
    for event in prof.events():
        label = _category(event)
        if label is None:
            continue
        self_us = (
            event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        )
        ops[(event.name, label)] = ops.get((event.name, label), 0.0) + self_us / 1e3 / calls
    return ops


def group_ms(ops: dict[tuple[str, str], float]) -> dict[str, float]:
    """``profile_ops``'s times summed per group."""
    groups: dict[str, float] = {}
    for (_, label), ms in ops.items():
        groups[label] = groups.get(label, 0.0) + ms
    return groups


def _keeping_caches(model: Any, kept: list[Any]) -> Callable[..., Any]:
    """``model.init_paged_kv_cache`` that also keeps every cache it makes in ``kept``."""
    make = model.init_paged_kv_cache

    def keeping(*args: Any, **kwargs: Any) -> Any:
        kept.append(make(*args, **kwargs))
        return kept[-1]

    return keeping


def _category(event: Any) -> str | None:
    """Which group an op's self time belongs to (None: not an op to count)."""
    names = []
    parent = event
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    if event.name.startswith("rollout::") or event.name.startswith("ProfilerStep"):
        return "other" if event.name == "rollout::host" else _LABEL_OF.get(event.name)
    for label, group in _LABEL_OF.items():
        if label in names:
            return group
    name = event.name
    if any(k in name for k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
                               "aten::linear", "aten::baddbmm")):  # fmt: skip
        return "matmuls"
    if "scaled_dot_product" in name or "flash" in name or "softmax" in name:
        return "attention"
    return "other"


_LABEL_OF = {
    "rollout::sample": "sampling (log_softmax, exp, cumsum, keyed hash, host copy)",
    "rollout::cache": "cache gather/write (bind, index_put, gather)",
    "rollout::mask": "attention",
    "rollout::host": "other",
}


# -- report -----------------------------------------------------------------------------------


def _cache_text(bench: Bench) -> str:
    if bench.args.warm_compile_cache:
        return "inductor's on-disk cache kept from earlier runs"
    return "a cold compile: a fresh inductor cache for this run"


def _relative(a: Any, b: Any) -> str:
    if isinstance(a, int | float) and isinstance(b, int | float) and a:
        return f", relative difference {abs(a - b) / abs(a):.1e}"
    return ""


def _num(value: Any) -> str:
    return f"{value:.1e}" if isinstance(value, float) else repr(value)


def _fmt_gap(gap: float) -> str:
    return "0" if gap == 0 else f"{gap:.1e}"


def previous_sections(path: Path | None) -> dict[str, str]:
    """The sections of an earlier report at ``path`` by title, each opened by a line that says
    it was kept and from which run (empty when there is no report there)."""
    if path is None or not path.exists():
        return {}
    text = path.read_text()
    head = text.split("\n## ", 1)[0]
    command = next((line for line in head.splitlines() if line.startswith("`")), "")
    date = re.search(r"run (\d{4}-\d\d-\d\d)", head)
    kept = (
        f"*Not re-run: kept from the previous report (run {date.group(1) if date else '?'}, "
        f"{command}).*"
    )
    out = {}
    for chunk in text.split("\n## ")[1:]:
        title, _, body = chunk.partition("\n")
        body = body.strip()  # a section kept before already says from which run
        out[title.strip()] = body if body.startswith("*Not re-run") else f"{kept}\n\n{body}"
    return out


def _missing(bench: Bench, key: str) -> str:
    if key in bench.errors:
        return f"Not measured: the section failed ({bench.errors[key]})."
    if key == "qwen" and not bench.args.qwen_batches:
        return ("Not run: made for CUDA (`--qwen-batches 64 256`, as `benchmarks/gpu/rollout.sh` "
                "runs it).")  # fmt: skip
    if key not in bench.args.sections:
        return bench.previous.get(TITLES[key], "Not run (left out with `--sections`).")
    return "Not measured yet (the run was interrupted before this section)."


def table_a(bench: Bench) -> str:
    res = bench.results["a"]
    runs, forward = res["runs"], res["forward"]
    lines = ["| engine | wall s | CPU s | generated tokens/s | / forward-only | / forward-only "
             "(CPU) | prefill tokens | decode steps | rows differing from plain "
             "| max \\|log-prob gap\\| |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        steps = "-" if r["decode_steps"] is None else r["decode_steps"]
        lines.append(
            f"| {name} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['vs_forward']:.3f} | {r['cpu_vs_forward']:.3f} | {r['prefill']} | {steps} | "
            f"{r['differ']} / "
            f"{len(bench.rows)} | {_fmt_gap(r['gap'])} |"
        )
    c = runs["paged + compiled step"]
    times = "\n".join(
        f"- {name}: {', '.join(f'{t:.2f}' for t in r['walls'])} (first call {r['first_s']:.2f})"
        for name, r in runs.items()
    )
    backend = bench.args.compile_backend
    return f"""{NL.join(lines)}

Forward-only: {forward:.0f} tokens/s (`rl_step.forward_tokens_per_s`: a no-gradient, eval-mode
forward with logits at every position over {len(bench.rows)} x {bench.args.new_tokens} random \
ids in micro-batches of {bench.args.micro_batch} rows,
median of {bench.args.repeats}); {res["forward_cpu"]:.0f} tokens per second of process CPU \
time over its warm-up and timed calls
(the "(CPU)" column: generated tokens per CPU second over that). Compiled step (`torch.compile(model, dynamic=False)`, backend \
`{backend}`{", mode reduce-overhead (CUDA graphs)" if bench.device.type == "cuda" and backend == "inductor" else ""}):
first call {c["first_s"]:.1f} s, so compiling took about {c["compile_s"]:.1f} s (first call \
minus the median call; {_cache_text(bench)}).

- Generated tokens/s: tokens generated / wall time of the whole call (prefill included).
  Prefill tokens: the prompt tokens each engine ran through the model (the plain engine every
  row's prompt; the paged one each distinct prompt once, unless `share_prefixes=False`); both
  pad a prefill batch to its longest prompt.
- Equality: rows whose {bench.args.new_tokens} sampled tokens are not the plain engine's \
(keyed sampling: the same key
  and step draw the same uniform number, so the engines agree unless their logits round
  differently enough to move a draw across a token boundary), and the largest |log-prob
  difference| over the tokens both engines sampled alike (each row up to its first difference).

Measured wall times (s):

{times}"""


def table_tail(bench: Bench) -> str:
    res = bench.results["tail"]
    runs, args = res["runs"], bench.args
    lines = ["| engine | wall s | CPU s | generated tokens | tokens/s | plain / this (wall) "
             "| plain / this (CPU) | decode steps | row-steps decoded | peak rows "
             "| rows differing from plain | max \\|log-prob gap\\| |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['tokens']} | "
            f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['cpu_speedup']:.2f}x | "
            f"{r['decode_steps']} | {r['decode_rows']} | {r['peak_slots']} | {r['differ']} / "
            f"{len(bench.rows)} | {_fmt_gap(r['gap'])} |"
        )
    times = "\n".join(
        f"- {name}: {', '.join(f'{t:.2f}' for t in r['walls'])}" for name, r in runs.items()
    )
    return f"""{NL.join(lines)}

{tail_bound_text(bench)}

The rows of workload A, every other row limited to {args.tail_short} new tokens and the others \
to {args.tail_long}
(per-row `max_new_tokens`, keyed sampling at temperature 1, no stop tokens). The plain engine
decodes its one batch until its longest row is done (finished rows keep being fed, their
outputs dropped: its row-steps are rows x (longest - 1)); the paged engine drops a row from
the batch when it finishes, and with `max_slots` runs at most that many rows at once,
admitting (and prefilling) the next waiting row as one leaves. Row-steps decoded: the rows fed
to the model over all decode steps (the engine's `stats`).

Measured wall times (s):

{times}"""


def tail_bound_text(bench: Bench) -> str:
    """B's measured bound: the row-steps ratio, and the paged engine's floor from its prefill
    and D-style steps at B's two batch sizes."""
    b = bench.results["tail"]["bound"]
    plain = bench.results["tail"]["runs"]["plain"]
    reach = (
        f": below the target of {TARGETS['tail']}x on this workload, whatever the engine's own "
        "overhead"
        if max(b["proportional_wall"], b["proportional_cpu"]) < TARGETS["tail"]
        else ""
    )
    return f"""**Measured bound.** The paged engine feeds {b["row_steps"]:.2f}x fewer row-steps \
to the model than the plain one
(and prefills each prompt once). Its floor, from measurements of this run: its prefill (a \
call with one new
token: {b["prefill_wall"]:.2f} s wall, {b["prefill_cpu"]:.2f} s CPU), then {b["at_full"]:.0f} \
decode steps of all {b["rows"]} rows and {b["at_part"]:.0f} of the {b["long_rows"]} long rows,
each at the median cost of a D-style step of that many rows {b["generated"]} tokens in \
({b["full_ms_wall"]:.1f} ms and {b["part_ms_wall"]:.1f} ms wall,
{b["full_ms_cpu"]:.1f} ms and {b["part_ms_cpu"]:.1f} ms CPU: {b["long_rows"] / b["rows"]:.0%} \
of the rows cost {b["part_ms_cpu"] / b["full_ms_cpu"]:.0%} of the step's CPU time, every step
reading all the weights): {b["floor_wall"]:.2f} s wall ({b["floor_cpu"]:.2f} s CPU), so plain \
/ paged can reach **{b["measured_wall"]:.2f}x**
(CPU time {b["measured_cpu"]:.2f}x) against the plain engine's {plain["wall"]:.2f} s \
({plain["cpu"]:.2f} s CPU). Even if a step cost only its
rows' share of the all-rows step (proportional to its rows), the floor would be \
{b["ideal_wall"]:.2f} s ({b["ideal_cpu"]:.2f} s CPU) and the
ratio **{b["proportional_wall"]:.2f}x** (CPU time {b["proportional_cpu"]:.2f}x){reach} (the \
later steps read more keys than D's, so the
true floor is a little higher)."""


def hf_bound(bench: Bench) -> dict[str, float] | None:
    """C's bound: transformers' measured time over the paged engine's measured time cut to the
    share of its profiled call spent in matmuls (``matmuls``), or in matmuls and attention
    (``model``); ``*_cpu``: the same with process CPU times."""
    hf = bench.results.get("hf")
    if not (hf and "profiled" in hf):
        return None
    ours, runs = hf["profiled"]["paged"], hf["runs"]
    total = sum(ours.values())
    shares = {"matmuls": ours.get("matmuls", 0.0) / total,
              "model": (ours.get("matmuls", 0.0) + ours.get("attention", 0.0)) / total}  # fmt: skip
    out = {}
    for name, share in shares.items():
        for clock, suffix in (("wall", ""), ("cpu", "_cpu")):
            floor = runs["paged"][clock] * share
            out[name + suffix] = runs["transformers"][clock] / floor if floor else float("inf")
    return out


def hf_profile_text(bench: Bench) -> str:
    res = bench.results["hf"]
    profiled, bound = res["profiled"], hf_bound(bench)
    labels = sorted(
        {k for p in profiled.values() for k in p}, key=lambda k: -profiled["paged"].get(k, 0)
    )
    lines = ["| group | transformers ms | share | paged ms | share |", "|---|---:|---:|---:|---:|"]
    totals = {name: sum(p.values()) for name, p in profiled.items()}
    for label in [*labels, None]:
        cells = []
        for name in ("transformers", "paged"):
            ms = totals[name] if label is None else profiled[name].get(label, 0.0)
            cells.append(f"{ms:.0f} | {ms / totals[name]:.0%}")
        lines.append(f"| {label.split(' (')[0] if label else 'all ops'} | {' | '.join(cells)} |")
    return f"""**Measured bound.** One whole call of each under `torch.profiler` (self CPU time of \
each op, grouped as in D;
CUDA time on CUDA): both run the same matmul kernels (`aten::mm` of the same weights; \
transformers prefills every
row, the paged engine each distinct prompt once).

{NL.join(lines)}

If the paged engine's call cost only its matmuls and attention (the model's maths: its \
measured time cut to their share
above; sampling, cache gathers and the rest free), it would be **{bound["model"]:.2f}x** \
transformers' (CPU time {bound["model_cpu"]:.2f}x);
only its matmuls, {bound["matmuls"]:.2f}x (CPU time {bound["matmuls_cpu"]:.2f}x). Faster \
matmuls or attention would speed transformers up
too (the same kernels)."""


def table_hf(bench: Bench) -> str:
    res = bench.results["hf"]
    runs, args = res["runs"], bench.args
    lines = ["| engine | wall s | CPU s | generated tokens/s | this / transformers (wall) "
             "| this / transformers (CPU) | rows equal to transformers' |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        label = f"transformers {res['version']} `generate`" if name == "transformers" else name
        lines.append(
            f"| {label} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['tokens_per_s']:.0f} | "
            f"{r['vs_hf']:.2f}x | {r['cpu_vs_hf']:.2f}x | {r['equal_hf']} / {len(bench.rows)} |"
        )
    error = bench.results.get("hf_static_error")
    cache = (
        'its static cache (`cache_implementation="static"`)'
        if res["cache"] == "static"
        else f"its dynamic cache: the static cache failed here ({error})"
    )
    compiled = (
        "transformers compiled its decode forward itself (its rule: a static cache on CUDA); "
        "the compile fell in the warm-up call"
        if res["compiled"]
        else "not compiled (transformers compiles only on an accelerator)"
    )
    return f"""{NL.join(lines)}

transformers: the HF class of the same config (`AutoModelForCausalLM.from_config`) with our
`state_dict` loaded strictly (our Llama uses HF's names), attention `{res["attn"]}`, {cache};
{compiled}. Every row left-padded into one batch of {len(bench.rows)}, greedy, exactly \
{args.new_tokens} new tokens (no
end-of-sequence token). Ours: the same rows, greedy (temperature 0), no stop tokens. A random
model's greedy rows fall into short loops, so equal rows say the three decode the same
argmaxes, not much more.

{hf_profile_text(bench)}"""


def table_profile(bench: Bench) -> str:
    res = bench.results["profile"]
    total = sum(res["groups"].values())
    groups = ["| group | ms per step | share |", "|---|---:|---:|"]
    for label, ms in sorted(res["groups"].items(), key=lambda kv: -kv[1]):
        groups.append(f"| {label} | {ms:.2f} | {ms / total:.0%} |")
    groups.append(f"| all ops | {total:.2f} | 100% |")
    ops = ["| op | group | ms per step | share |", "|---|---|---:|---:|"]
    for (name, label), ms in res["ops"][:14]:
        shown = (
            f"Python inside `{name}` (between its ops)"
            if name.startswith("rollout::")
            else f"`{name}`"
        )
        ops.append(f"| {shown} | {label.split(' (')[0]} | {ms:.3f} | {ms / total:.1%} |")
    gemm = res["gemm"]
    big_rows = bench.args.gemm_rows
    small, big = gemm[res["rows"]], gemm[big_rows]
    gemm_lines = ["| rows (M) | ms per call | µs per row | GFLOP/s |", "|---:|---:|---:|---:|"]
    for m, g in gemm.items():
        gemm_lines.append(f"| {m} | {g['ms']:.3f} | {g['us_per_row']:.2f} | {g['gflops']:.1f} |")
    a = bench.results.get("a")
    engine = ""
    if a:
        paged = a["runs"]["paged"]
        per_step = paged["wall"] / max(paged["decode_steps"] or 1, 1) * 1e3
        engine = (
            f" The paged engine's whole call in A took {per_step:.1f} ms per decode step "
            "(its wall time / decode steps, so the prefill and host bookkeeping are in it)."
        )
        bound = bound_ratios(bench)
        if bound:
            engine += (
                f"\n\nThe bound this sets on generated / forward-only tokens/s (A's forward-only "
                f"{a['forward']:.0f} tokens/s): {bound['all']:.2f} if a call cost only its decode "
                f"steps at this step's median (the prefill and host bookkeeping free), "
                f"{bound['model']:.2f} if a step cost only its share of the model's maths "
                f"(matmuls and attention: sampling, the cache's gather and the rest free), "
                f"{bound['matmuls']:.2f} if it cost only its matmuls' share. In process CPU time "
                f"(this step's and the forward-only's): {bound.get('all_cpu', 0):.2f}, "
                f"{bound.get('model_cpu', 0):.2f} and {bound.get('matmuls_cpu', 0):.2f}."
            )
    return f"""One decode step of workload A's {res["rows"]} rows, {res["generated"]} tokens into \
each row, as the paged engine
runs it: block tables from Python lists, `bind`, the model's forward (`logits_to_keep=1`),
keyed sampling at temperature 1 and the host copy of the sampled tokens. The cache's `update`
(write the new keys/values, gather every row's blocks) and `attention_mask` are labelled on
this cache object, `sample` around its call; the rest is grouped by op name. {res["clock"]}
of each op (its children excluded), per step, mean of {bench.args.profile_steps} profiled \
steps. The same step unprofiled: {res["step_ms"]:.2f} ms
(median; {res["step_cpu_ms"]:.2f} ms of process CPU time).{engine}

{NL.join(groups)}

Top ops:

{NL.join(ops)}

`lm_head` alone ({MODEL["vocab_size"]} x {MODEL["hidden_size"]}, `F.linear` on random rows; \
median of {max(bench.args.repeats, 5)} calls):

{NL.join(gemm_lines)}

At the decode batch a row's logits cost {small["us_per_row"] / big["us_per_row"]:.1f}x what \
they cost in a {big_rows}-row batch (the
forward-only baseline's micro-batches are 16 rows x {bench.args.new_tokens} positions = \
{16 * bench.args.new_tokens} rows per GEMM): a decode step
reads the whole weight for {res["rows"]} rows."""


def bound_ratios(bench: Bench) -> dict[str, float] | None:
    """Generated / forward-only tokens/s if a decode step cost its measured median (``all``),
    or only the share of its profile spent in matmuls and attention (``model``), or in matmuls
    (from D's step and profile and A's forward-only throughput)."""
    a, prof = bench.results.get("a"), bench.results.get("profile")
    if not (a and prof):
        return None
    rows, forward, step_s = prof["rows"], a["forward"], prof["step_ms"] / 1e3
    groups = prof["groups"]
    total = sum(groups.values())
    shares = {"all": total, "model": (groups.get("matmuls", 0.0) + groups.get("attention", 0.0)),
              "matmuls": groups.get("matmuls", 0.0)}  # fmt: skip
    step_cpu_s, forward_cpu = prof["step_cpu_ms"] / 1e3, a.get("forward_cpu")
    out = {}
    for name, part in shares.items():
        out[name] = rows / (step_s * part / total) / forward if part else float("inf")
        if forward_cpu and part:  # the same in process CPU time
            out[f"{name}_cpu"] = rows / (step_cpu_s * part / total) / forward_cpu
    return out


def table_grpo(bench: Bench) -> str:
    res = bench.results["grpo"]
    runs, args = res["runs"], bench.args
    lines = ["| engine | step s | generate s | samples/s | generated tokens/s "
             "| run wall s (incl. start, warm-up) | generate s per step |",
             "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        lines.append(
            f"| {name} | {r['step_s']:.2f} | {r['generate_s']:.2f} | {r['samples_per_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['wall']:.1f} | "
            f"{', '.join(f'{t:.2f}' for t in r['generate_all'])} |"
        )
    plain, paged = runs.values()
    if res["differ"]:
        check = "the first step's metrics differ: " + "; ".join(
            f"`{k}` {a!r} (plain) vs {b!r} (paged){_relative(a, b)}" for k, a, b in res["differ"]
        )
    else:
        check = "the first step's metrics are identical under both engines: " + ", ".join(
            f"`{k}`" for k, _, _ in res["same"]
        )
    numerics = "; ".join(
        f"`{k}` {_num(a)} (plain) vs {_num(b)} (paged)" for k, a, b in res["numerics"]
    )
    precision = "bf16 autocast (`mixed_precision=bf16`), " if res["bf16"] else ""
    return f"""{NL.join(lines)}

`tunesmith.recipes.grpo.main` on the shipped `grpo/tiny` config through `rl_step.py`'s
`make_world` and `recipe_config` (full fine-tuning, {precision}k3 KL coef {args.kl_coef}, \
{args.prompts} prompts x {args.group_size} samples, at most
{args.new_tokens} new tokens, micro-batches of {args.micro_batch}), once with \
`generation.engine.paged=false`, once with the default; {args.grpo_warmup} warm-up
step(s) excluded, medians of {args.grpo_steps} step(s), from the recipe's `metrics.jsonl`. The two runs \
follow one another
(a recipe run cannot take turns with another as the tables above do), so a change in the
machine's load between them shows here.
Paged / plain: generate {plain["generate_s"] / paged["generate_s"]:.2f}x faster, step \
{plain["step_s"] / paged["step_s"]:.2f}x, samples/s {paged["samples_per_s"] / plain["samples_per_s"]:.2f}x.
Check: {check}. The sampler's log-probs against the trainer's (each engine rounds its own way):
{numerics}."""


def table_qwen(bench: Bench) -> str:
    res = bench.results["qwen"]
    c = res["config"]
    args = bench.args
    lines = ["| batch | engine | wall s | generated tokens/s | plain / this | compile s "
             "| rows differing from plain | max \\|log-prob gap\\| |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for t in res["tables"]:
        for name, r in t["runs"].items():
            compile_s = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
            lines.append(
                f"| {t['batch']} | {name} | {r['wall']:.2f} | {r['tokens_per_s']:.0f} | "
                f"{r['vs_plain']:.2f}x | {compile_s} | {r['differ']} / {t['batch']} | "
                f"{_fmt_gap(r['gap'])} |"
            )
    shape = (
        f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, "
        f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} KV heads, head_dim "
        f"{c['head_dim']}, intermediate {c['intermediate_size']}, vocab {c['vocab_size']}, "
        "qk-norm, tied embeddings"
    )
    note = " (the dry run's stand-in: the 0.6B config with small widths)" if args.dry_run else ""
    return f"""{NL.join(lines)}

A random model of the `qwen3_0_6b` spec{note}: {shape}; {bench.args.dtype} weights (the paged
cache in the weights' dtype). Each batch: groups of up to {args.group_size} rows sharing a random prompt of about {args.qwen_prompt_len} tokens,
{args.qwen_new_tokens} new tokens each (keyed sampling, temperature 1, no stops); one warm-up \
call (the compile), medians
of {args.qwen_repeats}. Compile s: first call minus the median call ({_cache_text(bench)})."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def coloc_differences(bench: Bench) -> dict[str, int]:
    """Each engine's step peak less the step's peak with no rollout before it (bytes)."""
    runs = bench.results["coloc"]["runs"]
    return {name: r["peak"] - runs["none"]["peak"] for name, r in runs.items() if name != "none"}


def table_coloc(bench: Bench) -> str:
    res = bench.results["coloc"]
    runs = res["runs"]
    lines = ["| rollout before the step | step peak MiB | after a rollout - without, bytes "
             "| held when the step began, MiB | the rollout's KV cache, MiB |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    differences = coloc_differences(bench)
    for name, r in runs.items():
        diff = "-" if name == "none" else f"{differences[name]:+,d}"
        cache = "-" if r["cache_mib"] is None else f"{r['cache_mib']:.2f}"
        lines.append(f"| {name} | {_mib(r['peak'])} | {diff} | {_mib(r['held'])} | {cache} |")
    how = (
        "`torch.cuda.max_memory_allocated` over the step (its peak statistic reset just before), "
        "less what was allocated before the rollout"
        if bench.device.type == "cuda"
        else "torch's CPU allocator's reports to the profiler (`profile_memory=True`), replayed "
        "from before the rollout: the most bytes allocated since then and alive at once inside "
        "the step (the rollout's own peak lies outside it; weights and AdamW's state, allocated "
        "before, count in neither)"
    )
    return f"""{NL.join(lines)}

`benchmarks/colocation.py`: a GRPO-shaped step (workload A's {len(bench.rows)} rows, prompt + \
{bench.args.new_tokens} sampled tokens,
through the policy in micro-batches of {bench.args.micro_batch}; `PolicyGradient`'s clipped \
loss against the sampler's log-probs,
per-row advantages; `backward`, AdamW, `zero_grad`; {res["step_s"]:.1f} s) on its own copy of \
the model, measured with no
rollout before it and right after a rollout of the same rows (the step's batch is the same \
every time). Peak: {how}.
A difference within {TOLERANCE:.0%} of the step's peak counts as the same \
(`tests/generation/test_colocation_memory.py` holds
the engine to it); the counter-example keeps a reference to every pool the engine makes, so \
its pool is still alive
when the step begins, and shows there: the measurement can see a kept cache."""


BUSY = 0.9  # below this CPU / wall share over the timed calls, verdicts read CPU time


def verdict_clock(bench: Bench) -> str:
    """``"wall"`` when this process had a core to itself over its timed calls (or on CUDA),
    else ``"cpu"``: other jobs' load is then in every wall time, less in process CPU time."""
    if bench.device.type == "cuda" or not TOTALS["wall"]:
        return "wall"
    return "wall" if TOTALS["cpu"] / TOTALS["wall"] >= BUSY else "cpu"


def target_values(bench: Bench) -> dict[str, tuple[float, float | None]]:
    """Per ratio target, ``(measured, bound)`` in the verdicts' clock (the best configuration;
    the bound None where not measured)."""
    cpu = verdict_clock(bench) == "cpu"
    out: dict[str, tuple[float, float | None]] = {}
    a, bound = bench.results.get("a"), bound_ratios(bench)
    if a:
        key = "cpu_vs_forward" if cpu else "vs_forward"
        best = max(a["runs"]["paged"][key], a["runs"]["paged + compiled step"][key])
        out["A"] = (best, bound and bound.get("model_cpu" if cpu else "model"))
    tail = bench.results.get("tail")
    if tail:
        key = "cpu_speedup" if cpu else "speedup"
        best = max(r[key] for name, r in tail["runs"].items() if name != "plain")
        out["B"] = (best, tail["bound"]["proportional_cpu" if cpu else "proportional_wall"])
    hf, hf_max = bench.results.get("hf"), hf_bound(bench)
    if hf:
        value = hf["runs"]["paged"]["cpu_vs_hf" if cpu else "vs_hf"]
        out["C"] = (value, hf_max and hf_max["model_cpu" if cpu else "model"])
    return out


def targets(bench: Bench) -> str:
    lines = ["| target (the issue's) | measured | verdict |", "|---|---|---|"]
    values, clock = target_values(bench), verdict_clock(bench)

    def verdict(key: str, goal: float) -> str:
        value, bound = values[key]
        if value >= goal:
            return "meets"
        if bound is None:
            return "misses"
        return f"misses; bound {bound:.2f} (measured{', CPU time' if clock == 'cpu' else ''})"

    a = bench.results.get("a")
    if a:
        paged, comp = a["runs"]["paged"], a["runs"]["paged + compiled step"]
        where = "" if bench.device.type == "cpu" else " (the target is for CPU; this is CUDA)"
        lines.append(
            f"| generated / forward-only tokens/s >= {TARGETS['gen_forward']} on CPU, "
            f"workload A{where} | paged {paged['vs_forward']:.3f} (CPU time "
            f"{paged['cpu_vs_forward']:.3f}); paged + compiled step {comp['vs_forward']:.3f} "
            f"(CPU time {comp['cpu_vs_forward']:.3f}) | {verdict('A', TARGETS['gen_forward'])} |"
        )
    else:
        lines.append(f"| generated / forward-only >= {TARGETS['gen_forward']} | not measured | - |")
    tail = bench.results.get("tail")
    if tail:
        paged = tail["runs"]["paged"]
        slots = tail["runs"][f"paged, max_slots={bench.args.tail_slots}"]
        lines.append(
            f"| long tail: plain / paged wall time >= {TARGETS['tail']}x (B) | paged "
            f"{paged['speedup']:.2f}x (CPU time {paged['cpu_speedup']:.2f}x); max_slots="
            f"{bench.args.tail_slots} {slots['speedup']:.2f}x (CPU time "
            f"{slots['cpu_speedup']:.2f}x) | {verdict('B', TARGETS['tail'])} |"
        )
    else:
        lines.append(f"| long tail >= {TARGETS['tail']}x | not measured | - |")
    hf = bench.results.get("hf")
    if hf:
        paged = hf["runs"]["paged"]
        lines.append(
            f"| paged tokens/s >= {TARGETS['hf']}x transformers' `generate` (C, greedy) | "
            f"{paged['vs_hf']:.2f}x (CPU time {paged['cpu_vs_hf']:.2f}x) | "
            f"{verdict('C', TARGETS['hf'])} |"
        )
    else:
        lines.append(f"| >= {TARGETS['hf']}x transformers | not measured | - |")
    coloc = bench.results.get("coloc")
    if coloc:
        peak = coloc["runs"]["none"]["peak"]
        diffs = {k: v for k, v in coloc_differences(bench).items() if "counter" not in k}
        same = all(abs(d) <= TOLERANCE * peak for d in diffs.values())
        shown = "; ".join(f"{k} {d:+,d} B" for k, d in diffs.items())
        lines.append(
            f"| colocation: a training step's peak memory after a rollout = without one (G) | "
            f"{shown} (step peak {_mib(peak)} MiB) | {'meets' if same else 'misses'} |"
        )
    else:
        lines.append("| colocation: step peak after a rollout = without | not measured | - |")
    share = TOTALS["cpu"] / TOTALS["wall"] if TOTALS["wall"] else 1.0
    reads = (
        "Verdicts and bounds read the wall-time medians"
        if clock == "wall"
        else f"Verdicts and bounds read process CPU time: over the timed calls this process got "
        f"{share:.0%} of the wall time as CPU time (below {BUSY:.0%}), so other jobs' load is "
        "in every wall time"
    )
    return "\n".join(lines) + (
        f"\n\n{reads}; both are shown. A bound is the most the target's ratio can reach on "
        "this machine, computed from this run's measurements: A's if a decode step cost only "
        "the model's maths (matmuls and attention, D's profile; sampling, cache gathers, the "
        "prefill free); B's if a step cost only its rows' share of D's all-rows step (B's "
        "bound); C's if the paged engine's call cost only its matmuls and attention (C's "
        "bound). Each section also gives the bound with matmuls alone, in wall and in CPU "
        f"time.{_bounds_verdict(values)}"
    )


def _bounds_verdict(values: dict[str, tuple[float, float | None]]) -> str:
    """Which missed targets lie above their measured bound (no engine work reaches those)."""
    goals = {"A": TARGETS["gen_forward"], "B": TARGETS["tail"], "C": TARGETS["hf"]}
    out_of_reach = [
        k for k, (value, bound) in values.items() if bound is not None and bound < goals[k]
    ]
    if not out_of_reach:
        return ""
    return (
        f" {', '.join(out_of_reach)}: the bound lies below the target, so no work on the "
        "engine's own overhead reaches it on this machine."
    )


def gpu_section(bench: Bench, out_dir: Path) -> str:
    if bench.device.type == "cuda":
        return "This file is the GPU run (`benchmarks/gpu/rollout.sh`)."
    cuda = out_dir / "rollout_cuda.md"
    if cuda.exists():
        first = cuda.read_text().splitlines()[2:3]
        return f"See [rollout_cuda.md](rollout_cuda.md) ({' '.join(first)})."
    return (
        "The GPU run has not happened: no GPU was lent to the session that wrote this file. "
        "`bash benchmarks/gpu/rollout.sh` runs it on a lent GPU (see `benchmarks/gpu/README.md`) "
        "and writes `rollout_cuda.md`."
    )


def command(args: argparse.Namespace) -> str:
    skip = ["out", "sections"]
    if args.compile_backend == ("eager" if args.dry_run else "inductor"):
        skip.append("compile_backend")  # the backend the run picks by itself
    line = command_line("benchmarks/rollout.py", args, DEFAULTS, skip)
    if set(args.sections) != set(DEFAULTS["sections"]):
        line += f" --sections {' '.join(args.sections)}"
    return line


def device_text(bench: Bench) -> str:
    if bench.device.type == "cuda":
        name = torch.cuda.get_device_name(bench.device)
        return f"{name}, CUDA {torch.version.cuda}"
    return f"CPU, {torch.get_num_threads()} thread(s)"


def report(bench: Bench, load: tuple[float, float], minutes: float, out_dir: Path) -> str:
    import transformers

    args = bench.args
    sharing = (
        "shared with other jobs while this ran, so absolute times are noisy; the ratios "
        "compare configurations timed in turns in the same process"
        if args.shared
        else "no other job is known to have shared the machine"
    )
    dry = "\n**Dry run**: tiny workload, numbers meaningless.\n" if args.dry_run else ""
    busy = (
        f" Over every timed call this process used {TOTALS['cpu'] / TOTALS['wall']:.0%} of the "
        "wall time as CPU time (one thread: 100% is a core to itself throughout)."
        if TOTALS["wall"] and bench.device.type == "cpu"
        else ""
    )
    body = []
    renderers = {"a": table_a, "tail": table_tail, "hf": table_hf, "profile": table_profile,
                 "grpo": table_grpo, "qwen": table_qwen, "coloc": table_coloc}  # fmt: skip
    for key in SECTIONS:
        text = renderers[key](bench) if key in bench.results else _missing(bench, key)
        body.append(f"## {TITLES[key]}\n\n{text}\n")
    sections = "\n".join(body)
    rows = len(bench.rows)
    return f"""# Rollout: the paged engine against the plain one and transformers

`{command(args)}` ({minutes:.1f} min)
{dry}
- Model: the random Llama-shaped model of `sft_mfu.py` (the one `rl_step.py` times): vocab \
{MODEL["vocab_size"]}, hidden
  {MODEL["hidden_size"]}, intermediate {MODEL["intermediate_size"]}, \
{MODEL["num_hidden_layers"]} layers, {MODEL["num_attention_heads"]} heads / \
{MODEL["num_key_value_heads"]} KV heads, untied `lm_head`; {args.dtype} weights.
- Rows: {args.prompts} distinct prompts of random token ids ({min(map(len, bench.rows))}-\
{max(map(len, bench.rows))} tokens) x {args.group_size} samples = {rows} rows
  (a GRPO step's rollout), keyed sampling (`row_key(seed, 0, prompt, sample)`), no stop tokens.
- Timing: one warm-up call per configuration, then {args.repeats} round(s) in which the \
configurations of a table take turns;
  medians of wall time and of process CPU time. Everything in one process, one model.
- Machine: {machine()}; {device_text(bench)}; Python {platform.python_version()}, torch
  {torch.__version__}, transformers {transformers.__version__}; run \
{datetime.date.today().isoformat()}. 1-minute load average {load[0]:.1f} at the
  start, {load[1]:.1f} at the end ({os.cpu_count()} cores): {sharing}.{busy}

## Targets

{targets(bench)}

{sections}
## GPU run

{gpu_section(bench, out_dir)}
"""


# -- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the weights' dtype (and so the caches')")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny workload (a smoke test); writes only with --out")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for rollout.md / rollout_cuda.md (default benchmarks/results)")  # fmt: skip
    parser.add_argument("--sections", nargs="+", choices=SECTIONS,
                        default=[s for s in SECTIONS if s != "qwen"])  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=72)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=16, help="forward-only micro-batch")
    parser.add_argument("--tail-short", type=int, default=8)
    parser.add_argument("--tail-long", type=int, default=128)
    parser.add_argument("--tail-slots", type=int, default=16)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--gemm-rows", type=int, default=1024, help="the lm_head GEMM's big M")
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--grpo-warmup", type=int, default=1)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--qwen-batches", type=int, nargs="*", default=[],
                        help="batches for the Qwen3-0.6B-shaped model (adds section F)")  # fmt: skip
    parser.add_argument("--qwen-prompt-len", type=int, default=136)
    parser.add_argument("--qwen-new-tokens", type=int, default=112)
    parser.add_argument("--qwen-repeats", type=int, default=3)
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend (default inductor; the dry run: eager)")  # fmt: skip
    parser.add_argument("--keep-going", action="store_true",
                        help="a section that fails is reported, the others still run")  # fmt: skip
    parser.add_argument("--warm-compile-cache", action="store_true",
                        help="keep inductor's on-disk cache (default: a fresh one, cold compiles)")  # fmt: skip
    parser.add_argument("--keep-unrun", action="store_true",
                        help="sections left out with --sections keep their text from the report "
                        "already at the output path (marked as kept)")  # fmt: skip
    parser.add_argument("--shared", action="store_true",
                        help="say in the report that other jobs shared the machine")  # fmt: skip
    return parser


DEFAULTS = {a.dest: a.default for a in build_parser()._actions if a.dest != "help"}
DRY = {"repeats": 1, "prompts": 2, "group_size": 2, "prompt_len": 6, "new_tokens": 3,
       "micro_batch": 4, "tail_short": 2, "tail_long": 4, "tail_slots": 2, "profile_steps": 1, "gemm_rows": 16,
       "grpo_warmup": 0, "grpo_steps": 1, "qwen_prompt_len": 6, "qwen_new_tokens": 2,
       "qwen_repeats": 1}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        for key, value in DRY.items():
            if getattr(args, key) == DEFAULTS[key]:
                setattr(args, key, value)
    if args.compile_backend is None:
        args.compile_backend = "eager" if args.dry_run else "inductor"
    if args.qwen_batches and "qwen" not in args.sections:
        args.sections.append("qwen")
    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    out_dir = args.out or (None if args.dry_run else RESULTS_DIR)
    path = None if out_dir is None else out_dir / ("rollout_cuda.md" if cuda else "rollout.md")
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    bench = Bench(args)
    if args.keep_unrun:
        bench.previous = previous_sections(path)

    def write() -> str:
        minutes = (time.perf_counter() - started) / 60
        text = report(bench, (load_start, os.getloadavg()[0]), minutes, out_dir or RESULTS_DIR)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return text

    bench.on_progress = write
    for key in SECTIONS:
        if key not in args.sections:
            continue
        print(f"{TITLES[key]} ...", flush=True)
        section_started = time.perf_counter()
        try:
            getattr(bench, f"section_{key}")()
        except Exception as error:
            if not args.keep_going:
                write()
                raise
            bench.errors[key] = f"{type(error).__name__}: {error}"[:300]
        print(f"  ({time.perf_counter() - section_started:.0f} s)", flush=True)
        write()
    text = write()
    print(text)
    if path is not None:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
