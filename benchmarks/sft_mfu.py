"""MFU of plain full SFT through the real ``sft`` recipe, on a small Llama-shaped model.

The workload: a random Llama-shaped model (vocab 32000, hidden 256, intermediate 688, 4 layers,
8 heads, 4 KV heads, untied ``lm_head``), float32, batch 4, seq 256, AdamW, loss on the
assistant replies only (synthetic one-turn chats, about half of each sample's tokens are the
prompt). Every configuration runs ``tunesmith.recipes.sft.main`` on a config built here, in a
fresh process, on a tiny tokenizer (``tests/data/tokenizer_factory.py``) and a model folder
written to a temporary directory; the throughput is read back from the recipe's own
``metrics.jsonl`` (``tokens_per_s``: non-pad input tokens per second of whole loop
iterations, data loading and logging included).

MFU (the headline) counts the matmul FLOPs the step actually computes for real tokens, per
second, against the fp32 matmul peak of this machine measured by this script at the same
thread count (best ``2048 x 2048`` matmul; the best of every measurement of the run, before
and after each configuration, so a busy moment cannot lower the peak and raise the MFU):
``6 x decoder matmul parameters x non-pad tokens + 6 x lm_head parameters x rows the head
projects (every non-pad token for plain CE, the trained tokens only for linear CE) +
6 x layers x heads x head_dim x sum of l^2 over the samples (causal attention's two matmuls,
forward and backward)``. Padding positions are computed by the padded batch but not counted.
The 6N convention (``6 x matmul parameters, lm_head included, x non-pad tokens``) is a second
column. A profiled run of the shipped settings splits the step's CPU time into matmuls,
attention, optimizer and the rest; the "what held MFU down" notes are computed from it and
from the measured ratios between configurations.

Configurations run in turns (round 1: every configuration once, round 2: again ...), so a
load change on a shared machine hits them alike; each run times ``--steps`` steps after a
warm-up step.

Usage::

    python benchmarks/sft_mfu.py                         # writes benchmarks/results/sft_mfu.md
    python benchmarks/sft_mfu.py --configs "plain CE" "linear CE" --threads 1 --rounds 1 \\
        --steps 4 --no-write
    python benchmarks/sft_mfu.py --no-breakdown         # without the profiled run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "sft_mfu.md"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from sft_ladder import machine  # noqa: E402

MODEL = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
    "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}  # fmt: skip
SEQ_LEN, BATCH = 256, 4
LINEAR_CE = {"_component_": "tunesmith.modules.losses.LinearCrossEntropyLoss"}
FUSED_ADAMW = {"fused": True}  # torch's one-kernel AdamW (CPU too); the default loops per tensor
SHIPPED = "linear CE + fused AdamW (shipped)"  # what the shipped SFT configs set
# name -> config changes over the plain recipe config (see base_config)
CONFIGS: dict[str, dict[str, Any]] = {
    "plain CE": {},
    "plain CE + fused AdamW": {"optimizer": FUSED_ADAMW},
    "linear CE": {"loss": LINEAR_CE},
    SHIPPED: {"loss": LINEAR_CE, "optimizer": FUSED_ADAMW},
    "linear CE + fused AdamW + compile": {
        "loss": LINEAR_CE, "optimizer": FUSED_ADAMW,
        "compile": {"loss": False, "dynamic": True},  # one shape-generic graph per layer
    },
    "linear CE + fused AdamW + THP": {"loss": LINEAR_CE, "optimizer": FUSED_ADAMW},
}  # fmt: skip
# name -> environment of its process. THP_MEM_ALLOC_ENABLE=1: torch's CPU allocator asks for
# transparent huge pages for large tensors, so a fresh [rows, vocab] block or gradient costs a
# few hundred page faults instead of tens of thousands.
ENVIRONMENTS = {"linear CE + fused AdamW + THP": {"THP_MEM_ALLOC_ENABLE": "1"}}
DEFAULT_CONFIGS = [name for name in CONFIGS if name not in ENVIRONMENTS]
# Profiled ops by category (self CPU time): matmul kernels, attention kernels, the optimizer.
MATMUL_OPS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm"}
ATTENTION_PREFIX = "aten::_scaled_dot_product"
OPTIMIZER_OPS = {"aten::_fused_adamw_", "aten::_foreach_add_", "aten::_foreach_mul_",
                 "aten::_foreach_addcmul_", "aten::_foreach_addcdiv_", "aten::_foreach_sqrt",
                 "aten::_foreach_div_", "aten::_foreach_lerp_", "aten::lerp_", "aten::addcmul_",
                 "aten::addcdiv_", "aten::sqrt", "aten::_fused_sgd_"}  # fmt: skip
WORDS = (  # noqa: SIM905
    "the a of to and in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound "
    "no most people my over know water than call first who may down side been now find"
).split()


# -- clocks ----------------------------------------------------------------------------------


def matmul_peak(threads: int, n: int = 2048, repeats: int = 7) -> tuple[float, float]:
    """Best fp32 FLOP/s of an ``n x n`` matmul on ``threads`` threads, by the wall clock and by
    this process's CPU time (per thread): the second one a busy machine barely lowers."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        a @ b
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, (time.process_time() - start_cpu) / threads)
    torch.set_num_threads(previous)
    return 2 * n**3 / wall, 2 * n**3 / cpu


class StepClock:
    """A metric-logger component: records this process's CPU time at every logged step and
    writes the records to ``path`` on close (CPU seconds per step, next to the recipe's wall
    clock)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.records: list[tuple[int, float]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.records.append((step, time.process_time()))

    def log_config(self, cfg: Any) -> None:
        pass

    def close(self) -> None:
        self.path.write_text(json.dumps(self.records))


class StepProfiler:
    """A metric-logger component: runs ``torch.profiler`` from the end of the first (warm-up)
    step to the end of step ``last_step`` and writes the self time of each op to ``path`` on
    close."""

    def __init__(self, path: str, last_step: int) -> None:
        self.path = Path(path)
        self.last_step = last_step
        self.profiler: Any = None
        self.ops: dict[str, float] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step == 1 and self.profiler is None:
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.start()
        elif step == self.last_step and self.profiler is not None and not self.ops:
            self.profiler.stop()
            self.ops = {e.key: e.self_cpu_time_total / 1e6 for e in self.profiler.key_averages()}

    def log_config(self, cfg: Any) -> None:
        pass

    def close(self) -> None:
        self.path.write_text(json.dumps(self.ops))


def breakdown(ops: dict[str, float]) -> dict[str, Any]:
    """Self CPU seconds of a profiled run by category, and the largest other ops."""
    parts = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    others = {}
    for name, seconds in ops.items():
        if not name.startswith("aten::"):
            continue  # record_function ranges: their ops are counted under their own names
        if name in MATMUL_OPS:
            parts["matmul"] += seconds
        elif name.startswith(ATTENTION_PREFIX):
            parts["attention"] += seconds
        elif name in OPTIMIZER_OPS:
            parts["optimizer"] += seconds
        else:
            parts["other"] += seconds
            others[name] = seconds
    top = sorted(others.items(), key=lambda kv: -kv[1])[:5]
    return {"parts": parts, "top_other": top}


# -- the world: tokenizer, model folder, chat data ----------------------------------------------


def make_world(root: Path, rows: int, seed: int = 0) -> tuple[Path, Path]:
    """A tiny tokenizer + random model folder, and ``rows`` synthetic chats; returns
    ``(model_dir, data_path)``."""
    from tests.data.tokenizer_factory import make_tokenizer_folder
    from tunesmith.models import build_model
    from tunesmith.models.hf import save_hf_checkpoint
    from tunesmith.models.spec import spec_from_hf_config

    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", "llama3")
    torch.manual_seed(seed)
    model = build_model(spec_from_hf_config(dict(MODEL)))
    model_dir = save_hf_checkpoint(model, root / "model", source_dir=tokenizer_dir)
    rng = random.Random(seed)
    data = root / "chat.jsonl"
    with open(data, "w") as f:
        for _ in range(rows):  # the template adds ~65 prompt tokens: about half trained
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 70)))
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 120)))
            messages = [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": reply}]  # fmt: skip
            f.write(json.dumps({"messages": messages}) + "\n")
    return model_dir, data


def data_stats(model_dir: Path, data: Path) -> dict[str, float]:
    """Sample lengths, the share of prompt (untrained) tokens, and the padding a batch of
    ``BATCH`` consecutive samples carries."""
    from tunesmith.data import SFTDataset, Tokenizer

    dataset = SFTDataset(
        Tokenizer.from_pretrained(model_dir), source=str(data), max_seq_len=SEQ_LEN
    )
    lengths = [len(s["input_ids"]) for s in dataset.samples]
    trained = sum(sum(label != -100 for label in s["labels"]) for s in dataset.samples)
    batches = [lengths[i : i + BATCH] for i in range(0, len(lengths) - BATCH + 1, BATCH)]
    padded = sum(max(b) * len(b) for b in batches)
    return {
        "samples": len(lengths), "min_len": min(lengths), "max_len": max(lengths),
        "mean_len": statistics.mean(lengths), "trained_share": trained / sum(lengths),
        "pad_share": 1 - sum(map(sum, batches)) / padded,
        "mean_sq_len": statistics.mean(n * n for n in lengths),
    }  # fmt: skip


def matmul_params() -> int:
    """Parameters in matmuls: every layer's projections and the lm_head (not the embedding)."""
    return decoder_matmul_params() + MODEL["vocab_size"] * MODEL["hidden_size"]


def head_params() -> int:
    return MODEL["vocab_size"] * MODEL["hidden_size"]


def attention_flops_per_sq_token() -> int:
    """Causal attention FLOPs per unit of ``l^2`` of one sample, forward and backward: the
    ``q k^T`` and ``p v`` matmuls are ``l^2/2 x head_dim`` multiply-adds (2 FLOPs each) per
    head and layer forward (the causal half), times 3 for forward + backward."""
    return 6 * MODEL["num_hidden_layers"] * MODEL["num_attention_heads"] * MODEL["head_dim"]


def decoder_matmul_params() -> int:
    """Parameters of the decoder layers' projections (q, k, v, o, gate, up, down)."""
    h, i, layers = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["num_hidden_layers"]
    hd, nh, nkv = MODEL["head_dim"], MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    attention = h * nh * hd * 2 + h * nkv * hd * 2  # q, o; k, v
    return layers * (attention + 3 * h * i)


# -- one configuration, in a fresh process -----------------------------------------------------


def base_config(model_dir: Path, data: Path, output_dir: Path, steps: int) -> dict[str, Any]:
    """The plain full-SFT recipe config of this workload."""
    return {
        "output_dir": str(output_dir), "model_dir": str(model_dir), "seed": 0, "device": "cpu",
        "mixed_precision": None,
        "tokenizer": {"_component_": "tunesmith.data.Tokenizer.from_pretrained",
                      "folder": str(model_dir)},
        "model": {"_component_": "tunesmith.models.from_hf", "path": str(model_dir),
                  "dtype": "float32"},
        "dataset": {"_component_": "tunesmith.data.SFTDataset", "source": str(data),
                    "format": "messages", "train_on": "assistant", "max_seq_len": SEQ_LEN},
        "packed": False, "shuffle": True, "batch_size": BATCH, "gradient_accumulation_steps": 1,
        "epochs": 1, "max_steps": steps + 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-4, "weight_decay": 0.0},
        "lr_scheduler": {"_component_": "tunesmith.training.cosine_with_warmup",
                         "num_warmup_steps": 1},
        "max_grad_norm": 1.0,
        "loss": {"_component_": "tunesmith.modules.losses.CrossEntropyLoss"},
        "compile": False, "preflight": False,
        "metric_loggers": [{"_component_": "tunesmith.training.JSONLLogger",
                            "log_dir": str(output_dir)}],
        "log_every_n_steps": 1, "save_every_n_steps": None, "keep_last": 1,
        "progress_bar": False,
    }  # fmt: skip


def merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if (
            isinstance(value, dict)
            and isinstance(out.get(key), dict)
            and "_component_" not in value
        ):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def run_config(name: str, world: Path, steps: int, threads: int, profile: bool) -> dict:
    """Train ``steps`` + 1 steps with configuration ``name``; the recipe's per-step metrics,
    the CPU seconds of each step, and this process's matmul peaks (before and after)."""
    from omegaconf import OmegaConf

    from tunesmith.config import ALLOW_ANY_COMPONENT_ENV
    from tunesmith.recipes import sft

    torch.set_num_threads(threads)
    peaks = [matmul_peak(threads)]
    output_dir = Path(tempfile.mkdtemp(prefix="run_", dir=world))
    cfg = merged(
        base_config(world / "model", world / "chat.jsonl", output_dir, steps), CONFIGS[name]
    )
    clock_file = output_dir / "cpu_clock.json"
    profile_file = output_dir / "profile.json"
    cfg["metric_loggers"].append({"_component_": "sft_mfu.StepClock", "path": str(clock_file)})
    if profile:
        cfg["metric_loggers"].append(
            {
                "_component_": "sft_mfu.StepProfiler",
                "path": str(profile_file),
                "last_step": steps + 1,
            }
        )
    os.environ[ALLOW_ANY_COMPONENT_ENV] = "1"  # these loggers are not library components
    sft.main(OmegaConf.create(cfg))
    peaks.append(matmul_peak(threads))
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "tokens_per_s" in r]
    clock = dict(json.loads(clock_file.read_text()))
    return {
        "name": name, "threads": threads, "peak": max(p[0] for p in peaks),
        "cpu_peak": max(p[1] for p in peaks),
        "first_step_s": next(r["first_step_s"] for r in records if "first_step_s" in r),
        "tokens": [r["tokens_per_s"] * r["step_time_s"] for r in timed],
        "trained": [r["trained_tokens_in_window"] for r in timed],
        "linear_ce": "Linear" in cfg["loss"]["_component_"],
        "seconds": [r["step_time_s"] for r in timed],
        "cpu_seconds": [(clock[r["step"]] - clock[r["step"] - 1]) / threads for r in timed],
        "profile": json.loads(profile_file.read_text()) if profile else None,
    }  # fmt: skip


def run_child(
    name: str, world: Path, steps: int, threads: int, cache_dir: str, profile: bool = False
) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(
        OMP_NUM_THREADS=str(threads),
        TORCHINDUCTOR_CACHE_DIR=cache_dir,
        TORCHINDUCTOR_COMPILE_THREADS="1",
        **ENVIRONMENTS.get(name, {}),
    )
    command = [sys.executable, __file__, "--child", name, "--world", str(world),
               "--steps", str(steps), "--threads", str(threads)]  # fmt: skip
    if profile:
        command.append("--child-profile")
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} ({threads} threads) failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the parent: rounds, table ----------------------------------------------------------------


def step_flops(run: dict, stats: dict[str, float]) -> tuple[float, float, float]:
    """FLOPs of a run's timed steps: (counted as computed, of which attention, 6N)."""
    tokens = sum(run["tokens"])
    head_rows = sum(run["trained"]) if run["linear_ce"] else tokens
    samples = BATCH * len(run["tokens"])
    attention = attention_flops_per_sq_token() * stats["mean_sq_len"] * samples
    done = 6 * decoder_matmul_params() * tokens + 6 * head_params() * head_rows + attention
    return done, attention, 6 * matmul_params() * tokens


def summarize(
    runs: list[dict], peaks: dict[int, tuple[float, float]], stats: dict[str, float]
) -> dict:
    """Per (configuration, threads): tokens/s over all timed steps of all rounds, the MFU of
    the FLOPs computed (by the wall clock and by CPU time), the 6N MFU, seconds per step."""
    out: dict[tuple[str, int], dict] = {}
    for run in runs:
        entry = out.setdefault(
            (run["name"], run["threads"]),
            {
                "tokens": 0.0,
                "seconds": 0.0,
                "cpu_seconds": 0.0,
                "done": 0.0,
                "six_n": 0.0,
                "steps": 0,
                "rates": [],
                "round_done": [],
                "first": [],
            },
        )
        done, _, six_n = step_flops(run, stats)
        entry["tokens"] += sum(run["tokens"])
        entry["seconds"] += sum(run["seconds"])
        entry["cpu_seconds"] += sum(run["cpu_seconds"])
        entry["done"] += done
        entry["six_n"] += six_n
        entry["steps"] += len(run["seconds"])
        entry["rates"].append(sum(run["tokens"]) / sum(run["seconds"]))
        entry["round_done"].append(done / sum(run["seconds"]))
        entry["first"].append(run["first_step_s"])
    for (_, threads), entry in out.items():
        wall_peak, cpu_peak = peaks[threads]
        entry["tokens_per_s"] = entry["tokens"] / entry["seconds"]
        entry["step_s"] = entry["seconds"] / entry["steps"]
        entry["cpu_step_s"] = entry["cpu_seconds"] / entry["steps"]
        entry["mfu"] = entry["done"] / entry["seconds"] / wall_peak
        entry["round_mfu"] = [r / wall_peak for r in entry["round_done"]]
        entry["cpu_mfu"] = entry["done"] / entry["cpu_seconds"] / cpu_peak
        entry["six_n_mfu"] = entry["six_n"] / entry["seconds"] / wall_peak
    return out


def table(summary: dict[tuple[str, int], dict]) -> str:
    lines = ["| configuration | threads | tokens/s | **MFU (FLOPs computed)** | per round "
             "| by CPU time | MFU (6N) | step s | CPU s per step | first step s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (name, threads), e in sorted(summary.items(), key=lambda kv: kv[0][1]):
        rounds = ", ".join(f"{m:.0%}" for m in e["round_mfu"])
        lines.append(
            f"| {name} | {threads} | {e['tokens_per_s']:.0f} | **{e['mfu']:.1%}** | "
            f"{rounds} | {e['cpu_mfu']:.1%} | {e['six_n_mfu']:.1%} | "
            f"{e['step_s']:.3f} | {e['cpu_step_s']:.3f} | "
            f"{statistics.median(e['first']):.1f} |"
        )
    return "\n".join(lines)


def best(summary: dict[tuple[str, int], dict]) -> str:
    """One line per thread count: the configuration with the highest MFU."""
    lines = []
    for threads in sorted({t for _, t in summary}):
        rows = {name: e for (name, t), e in summary.items() if t == threads}
        name = max(rows, key=lambda n: rows[n]["mfu"])
        plain = rows.get("plain CE")
        versus = f" (plain CE: {plain['mfu']:.1%})" if plain else ""
        lines.append(
            f"- {threads} thread(s): **{name}**, MFU **{rows[name]['mfu']:.1%}**"
            f" of the FLOPs computed, {rows[name]['six_n_mfu']:.1%} by 6N{versus}."
        )
    return "\n".join(lines)


def _ratio_notes(summary: dict[tuple[str, int], dict]) -> list[str]:
    """What each switch changed, per thread count, from the measured step times."""
    notes = []
    for threads in sorted({t for _, t in summary}):
        rows = {name: e for (name, t), e in summary.items() if t == threads}

        def step(name: str, rows: dict = rows) -> float | None:
            return rows[name]["cpu_step_s"] if name in rows else None

        parts = []
        plain, linear = step("plain CE"), step("linear CE")
        if plain and linear:
            parts.append(
                f"linear CE takes {linear / plain:.2f}x plain CE's CPU time per step "
                f"({plain:.3f} -> {linear:.3f} s)"
            )
        for base, fused in (("plain CE", "plain CE + fused AdamW"), ("linear CE", SHIPPED)):
            if step(base) and step(fused):
                parts.append(
                    f"fused AdamW saves {1000 * (step(base) - step(fused)):.0f} ms of "
                    f"{1000 * step(base):.0f} ms per step over the for-loop AdamW "
                    f"({base})"
                )
        compiled = "linear CE + fused AdamW + compile"
        if step(SHIPPED) and step(compiled):
            parts.append(
                f"compile: {step(compiled) / step(SHIPPED):.2f}x the shipped CPU time "
                f"per step after a first step of "
                f"{statistics.median(rows[compiled]['first']):.1f} s (shipped: "
                f"{statistics.median(rows[SHIPPED]['first']):.1f} s)"
            )
        if parts:
            notes.append(f"- **{threads} thread(s)**: " + "; ".join(parts) + ".")
    return notes


def _breakdown_notes(
    profiled: dict | None, stats: dict[str, float], peaks: dict[int, tuple[float, float]]
) -> list[str]:
    if not profiled:
        return ["- (no profiled run: `--no-breakdown`)"]
    split = breakdown(profiled["profile"])
    parts, total = split["parts"], sum(split["parts"].values())
    done, attention, _ = step_flops(profiled, stats)
    threads = profiled["threads"]
    peak = peaks[threads][0]
    matmul_rate = (done - attention) / parts["matmul"] if parts["matmul"] else 0.0
    attention_rate = attention / parts["attention"] if parts["attention"] else 0.0
    top = ", ".join(f"`{name}` {seconds / total:.1%}" for name, seconds in split["top_other"])
    return [
        f"- **Where the shipped step's CPU time went** (`{profiled['name']}`, "
        f"{threads} thread(s), torch.profiler's self time of each op over the "
        f"{len(profiled['tokens'])} timed steps; the profiler adds a little to the small ops): "
        f"matmuls "
        f"{parts['matmul'] / total:.0%}, attention kernels {parts['attention'] / total:.0%}, "
        f"the optimizer {parts['optimizer'] / total:.0%}, everything else "
        f"{parts['other'] / total:.0%} (largest: {top}).",
        f"- **Inside the matmuls**: the linear-layer and head FLOPs counted above ran at "
        f"{matmul_rate / 1e9:.1f} GFLOP/s of their own time, {matmul_rate / peak:.0%} of the "
        f"measured peak ({peak / 1e9:.1f} GFLOP/s; smaller and thinner matmuls than the "
        f"2048 x 2048 peak: hidden {MODEL['hidden_size']}); attention at "
        f"{attention_rate / 1e9:.1f} GFLOP/s counting its causal half only.",
        f"- **Not counted**: {stats['pad_share']:.1%} of a padded batch's positions are "
        f"padding (computed, not counted); the attention matmuls are "
        f"{attention / done:.1%} of the counted FLOPs; the lm_head is "
        f"{head_params() / matmul_params():.0%} of the 6N FLOPs, and linear CE projects only "
        f"the {stats['trained_share']:.0%} of tokens that are trained, which is why the 6N "
        f"column reads higher than the headline for linear CE.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2, help="turns over the configurations")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per run")
    parser.add_argument(
        "--no-breakdown", action="store_true", help="skip the profiled run of the shipped settings"
    )
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS.name}")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows = BATCH * (args.steps + 1)

    if args.child is not None:
        result = run_config(
            args.child, Path(args.world), args.steps, args.threads[0], args.child_profile
        )
        print(json.dumps(result))
        return
    started, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="sft_mfu_") as tmp:
        world = Path(tmp)
        make_world(world, rows)
        stats = data_stats(world / "model", world / "chat.jsonl")
        peaks = {t: matmul_peak(t) for t in args.threads}
        runs = []
        cache_dir = str(world / "inductor")
        for round_ in range(args.rounds):
            for threads in args.threads:
                for name in args.configs:
                    run = run_child(name, world, args.steps, threads, cache_dir)
                    runs.append(run)
                    peaks[threads] = _best(peaks[threads], (run["peak"], run["cpu_peak"]))
                    rate = sum(run["tokens"]) / sum(run["seconds"])
                    print(
                        f"round {round_ + 1}, {threads} thread(s), {name}: {rate:.0f} tokens/s "
                        f"(first step {run['first_step_s']:.1f} s)",
                        flush=True,
                    )
        profiled = None
        if not args.no_breakdown:
            threads = min(args.threads)
            profiled = run_child(SHIPPED, world, args.steps, threads, cache_dir, profile=True)
            peaks[threads] = _best(peaks[threads], (profiled["peak"], profiled["cpu_peak"]))
        peaks = {t: _best(p, matmul_peak(t)) for t, p in peaks.items()}
    summary = summarize(runs, peaks, stats)
    minutes = (time.perf_counter() - started) / 60
    text = report(args, stats, summary, peaks, minutes, load, profiled)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")


def _best(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return max(a[0], b[0]), max(a[1], b[1])


def report(
    args,
    stats: dict[str, float],
    summary: dict,
    peaks: dict[int, tuple[float, float]],
    minutes: float,
    load: float,
    profiled: dict | None,
) -> str:
    n, d, h = matmul_params(), decoder_matmul_params(), head_params()
    peak_text = "; ".join(
        f"{t} thread(s): {peaks[t][0] / 1e9:.1f} GFLOP/s by the wall clock, "
        f"{peaks[t][1] / 1e9:.1f} by CPU time"
        for t in sorted(peaks)
    )
    configs = "\n".join(
        f"  - **{name}**: {json.dumps(CONFIGS[name]) if CONFIGS[name] else 'the plain config'}"
        + (f", environment {json.dumps(ENVIRONMENTS[name])}" if name in ENVIRONMENTS else "")
        for name in args.configs
    )
    attn = attention_flops_per_sq_token()
    notes = "\n".join(_breakdown_notes(profiled, stats, peaks) + _ratio_notes(summary))
    return f"""# SFT MFU: a small Llama-shaped model through the real recipe

`python benchmarks/sft_mfu.py --rounds {args.rounds} --steps {args.steps} --threads \
{" ".join(map(str, args.threads))}` ({minutes:.1f} min, profiled run included)

- Model: random Llama-shaped, vocab {MODEL["vocab_size"]}, hidden {MODEL["hidden_size"]}, \
intermediate {MODEL["intermediate_size"]}, {MODEL["num_hidden_layers"]} layers, \
{MODEL["num_attention_heads"]} heads / {MODEL["num_key_value_heads"]} KV heads, untied
  `lm_head`; float32; {n / 1e6:.2f}M matmul parameters: decoder D = {d / 1e6:.2f}M, \
lm_head H = {h / 1e6:.2f}M (embedding not counted).
- Recipe: `tunesmith.recipes.sft.main`, full fine-tuning, batch {BATCH}, max_seq_len {SEQ_LEN},
  right padding to the longest sample of the batch, AdamW (lr 1e-4), clipping at 1.0, cosine
  schedule, JSONL metrics every step; one warm-up step then {args.steps} timed steps per run,
  {args.rounds} round(s) taking turns over the configurations; every run a fresh process.
- Data: {stats["samples"]:.0f} synthetic one-turn chats (llama3-style template, tiny BPE
  tokenizer), {stats["min_len"]:.0f}-{stats["max_len"]:.0f} tokens (mean \
{stats["mean_len"]:.0f}), {stats["trained_share"]:.0%} of the tokens trained (the replies; the
  rest is the prompt), {stats["pad_share"]:.1%} padding in a batch.
- **MFU (FLOPs computed)**, the headline: per timed step,
  `6·D·T + 6·H·R + {attn}·Σl²` FLOPs, where T = non-pad tokens, R = rows the head projects
  (T for plain CE; the trained tokens for linear CE, which skips prompt positions),
  {attn} = 6 x layers x heads x head_dim (causal attention's `q k^T` and `p v`, forward and
  backward, the causal half), and Σl² = {BATCH} samples x the data's mean l² \
({stats["mean_sq_len"]:.0f}); divided by the
  step time and the fp32 matmul peak measured in this run ({peak_text}; best 2048 x 2048
  matmul of all this run's measurements, before, during and after the configurations).
  Padding positions are computed but not counted. **by CPU time**: the same with the step's
  CPU seconds per thread (read by a metric-logger component at each step) against the
  CPU-time peak; other jobs barely move it. **MFU (6N)**: the usual convention,
  `6 x {n / 1e6:.2f}M x T` per step, no attention, the head counted on every token.
- Machine: {machine()}; Python {platform.python_version()}, torch {torch.__version__}; run \
{datetime.date.today().isoformat()}; 1-minute load average {load:.1f} at the start (shared with
  other jobs: compare configurations within a round, and by CPU time).
- Configurations:
{configs}

{table(summary)}

## Best configuration (this run)

{best(summary)}

## What held MFU down (computed from this run)

{notes}
"""


if __name__ == "__main__":
    main()
