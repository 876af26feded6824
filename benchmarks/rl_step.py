"""Where a GRPO step's time goes, through the real ``grpo`` recipe, full fine-tuning and LoRA.

The workload: the random Llama-shaped model of ``sft_mfu.py`` (vocab 32000, hidden 256, 4
layers, 8 heads / 4 KV heads, untied ``lm_head``) with the tiny llama3-style tokenizer
(``tests/data/tokenizer_factory.py``), float32; ``--prompts`` arithmetic prompts per step
("What is 17 + 25?", chat-templated) x ``--group-size`` samples x ``--new-tokens`` new tokens
(temperature 1, no stop strings or extra stop tokens; the tokenizer's end-of-sequence token
still ends a row, so the tokens actually generated are counted, not assumed), scored by the
shipped config's ``ExactAnswer`` reward, GRPO advantages, the PPO-clip loss and a k3 KL term
(``kl.coef`` > 0, so the reference forward is part of every step: a frozen copy of the initial
policy for full fine-tuning, the policy with its adapters off for LoRA).

Each configuration runs ``tunesmith.recipes.grpo.main`` on the shipped ``tiny`` config (the
LoRA one takes the ``model`` node of ``sft/tiny_lora``: rank 8 on q and v) in this process,
and the per-step split is read back from the recipe's own ``metrics.jsonl``: ``generate_s``,
``reward_s``, ``logprobs_s`` (the trainer's "old" log-probs and the reference's, one
no-gradient forward each over every row), ``train_s`` (``Trainer.step``: forward, backward,
clipping, AdamW) and ``step_time_s`` (the whole step; "other" is the rest: prompt encoding,
building the batch, metrics). The first ``--warmup`` steps are excluded; the table shows the
median of the ``--steps`` measured steps.

Generation throughput (``generated_tokens_per_s``: tokens actually generated / ``generate_s``,
the prompts' prefill included in the time) is set against the same model's forward-only
throughput, measured in the same process right after the run: a no-gradient, eval-mode,
prefill-style forward (logits at every position) over ``rows x new_tokens`` random token ids
in micro-batches of ``--micro-batch`` rows, i.e. over as many tokens as a step generates,
median of ``--forward-repeats`` timings. The log-prob forwards' tokens/s (prompt + completion
tokens, from the recipe's ``tokens_seen``) is shown next to them. Unless
``--no-sampling-check``, ``generate`` alone is then timed on a step's rows of the first
configuration twice: with the recipe's keyed sampling and with a ``torch.Generator`` stream.

Usage::

    python benchmarks/rl_step.py                     # CPU, writes benchmarks/results/rl_step.md
    python benchmarks/rl_step.py --device cuda --bf16   # writes benchmarks/results/rl_step_cuda.md
    python benchmarks/rl_step.py --device cuda --prompts 32 --new-tokens 256 --no-write
    python benchmarks/rl_step.py --prompts 2 --group-size 4 --new-tokens 8 --steps 1 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "rl_step.md"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import command_line  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from sft_ladder import machine  # noqa: E402
from sft_mfu import MODEL  # noqa: E402

from tests.data.tokenizer_factory import make_tokenizer_folder  # noqa: E402
from tunesmith.config import instantiate, load_config  # noqa: E402
from tunesmith.generation import generate  # noqa: E402
from tunesmith.generation.keyed import row_key  # noqa: E402
from tunesmith.models import build_model  # noqa: E402
from tunesmith.models.hf import save_hf_checkpoint  # noqa: E402
from tunesmith.models.spec import spec_from_hf_config  # noqa: E402
from tunesmith.modules.dtypes import AUTOCAST  # noqa: E402
from tunesmith.recipes import config_path, grpo  # noqa: E402
from tunesmith.rl.prompts import encode_prompt  # noqa: E402

CONFIGS = ("full", "lora")
PHASES = ("generate_s", "reward_s", "logprobs_s", "train_s")
ROLLOUT = ("generate_s", "reward_s", "logprobs_s")  # everything of a step before the update
LOGGED = ("step_time_s", "generated_tokens_per_s", "completion_length", "stopped_fraction",
          "reward", "logprob_mismatch_max", "rollout_samples")  # fmt: skip
LABELS = {"full": "full fine-tuning", "lora": "LoRA (rank 8, q + v)"}


# -- the world: tokenizer, model folder, prompts --------------------------------------------------


def make_world(root: Path, rows: int, seed: int = 0) -> tuple[Path, Path]:
    """A tiny llama3-style tokenizer + the random ``MODEL`` folder, and ``rows`` arithmetic
    prompts with their answers; returns ``(model_dir, prompts_path)``."""
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", "llama3")
    torch.manual_seed(seed)
    model = build_model(spec_from_hf_config(dict(MODEL)))
    model_dir = save_hf_checkpoint(model, root / "model", source_dir=tokenizer_dir)
    rng = random.Random(seed)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return model_dir, prompts


# -- one configuration ------------------------------------------------------------------------------


def recipe_config(
    args: argparse.Namespace, name: str, model_dir: Path, prompts: Path, output_dir: Path
) -> Any:
    """The shipped ``grpo/tiny`` config pointed at the world, at this benchmark's sizes."""
    overrides = [
        f"model_dir={model_dir}", f"prompts.source={prompts}", f"output_dir={output_dir}",
        f"device={args.device}", f"mixed_precision={'bf16' if args.bf16 else 'null'}",
        f"prompts_per_step={args.prompts}", f"group_size={args.group_size}",
        f"batch_size={args.micro_batch}", f"generation.max_new_tokens={args.new_tokens}",
        f"kl.coef={args.kl_coef}", f"max_steps={args.warmup + args.steps}",
        "log_samples_every=0", "progress_bar=false", "overwrite=true",
        # bf16: the KV-cache decode and the full forward round differently; the mismatch is
        # reported, not a reason to stop a timing run
        f"max_logprob_mismatch={'null' if args.bf16 else '1.0e-3'}",
    ]  # fmt: skip
    cfg = load_config(config_path("tiny", "grpo"), overrides)
    cfg.metric_loggers = [{"_component_": "tunesmith.training.JSONLLogger",
                           "log_dir": str(output_dir)}]  # fmt: skip
    if name == "lora":
        cfg.model = OmegaConf.load(config_path("tiny_lora", "sft")).model  # ${model_dir}: ours
    return cfg


def forward_tokens_per_s(
    model: torch.nn.Module, args: argparse.Namespace, device: torch.device
) -> float:
    """Tokens/s of a no-gradient, eval-mode forward (logits at every position) of ``model``
    over ``rows x new_tokens`` random ids in micro-batches; median of ``forward_repeats``."""
    rows = args.prompts * args.group_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, MODEL["vocab_size"], (rows, args.new_tokens), generator=gen)
    parts = [p.to(device) for p in ids.split(args.micro_batch)]

    def once() -> float:
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad(), _autocast(args, device):
            for part in parts:
                model(part)
        _sync(device)
        return time.perf_counter() - start

    once()  # warm-up
    return rows * args.new_tokens / statistics.median(once() for _ in range(args.forward_repeats))


def sampling_tokens_per_s(
    model: torch.nn.Module, cfg: Any, args: argparse.Namespace, device: torch.device
) -> dict[str, float]:
    """Generated tokens/s of :func:`~tunesmith.generation.generate` alone on one step's rows
    (the first ``prompts`` prompts, chat-templated, ``group_size`` times each; temperature 1,
    the tokenizer's end-of-sequence token stops a row), with the recipe's keyed sampling and
    with a ``torch.Generator`` stream instead."""

    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.prompts)
    rows, keys = [], []
    for prompt in [dataset[i] for i in range(args.prompts)]:
        ids, _ = encode_prompt(tokenizer, prompt, chat_template=True)
        for j in range(args.group_size):
            rows.append(ids)
            keys.append(row_key(0, 0, prompt.index, j))
    common = {"max_new_tokens": args.new_tokens, "temperature": 1.0,
              "pad_id": 0 if tokenizer.pad_id is None else tokenizer.pad_id,
              "stop_token_ids": [] if tokenizer.eos_id is None else [tokenizer.eos_id]}  # fmt: skip
    ways = {"keyed": {"row_keys": torch.tensor(keys)},
            "generator": {"generator": torch.Generator(device).manual_seed(0)}}  # fmt: skip
    out = {}
    with _autocast(args, device):
        generate(model, rows[:2], **{**common, "max_new_tokens": 2})  # warm-up
        for name, how in ways.items():
            _sync(device)
            start = time.perf_counter()
            result = generate(model, rows, **common, **how)
            _sync(device)
            out[name] = result.new_tokens / (time.perf_counter() - start)
    return out


def run_config(
    args: argparse.Namespace, name: str, world: Path, model_dir: Path, prompts: Path, sampling: bool
) -> dict[str, Any]:
    """Run the recipe with configuration ``name``; its measured steps' metrics, the
    forward-only throughput of the same policy and, with ``sampling``, the sampling check."""

    output_dir = world / name
    cfg = recipe_config(args, name, model_dir, prompts, output_dir)
    started = time.perf_counter()
    grpo.main(cfg)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "step" in r}
    measured = [steps[s] for s in sorted(steps) if s > args.warmup]
    if len(measured) != args.steps or any("step_time_s" not in r for r in measured):
        raise RuntimeError(f"{name}: expected {args.steps} measured steps in {output_dir}")
    for r in measured:  # prompt + completion tokens of the step's rows
        r["row_tokens"] = r["tokens_seen"] - steps[r["step"] - 1]["tokens_seen"]
    device = torch.device(args.device)
    model = instantiate(cfg.model).to(device).eval()  # the policy as the run started it
    out = {"name": name, "steps": measured, "wall_s": wall,
           "forward_tokens_per_s": forward_tokens_per_s(model, args, device)}  # fmt: skip
    if sampling:
        out["sampling"] = sampling_tokens_per_s(model, cfg, args, device)
    return out


def _autocast(args: argparse.Namespace, device: torch.device) -> Any:
    dtype = AUTOCAST["bf16" if args.bf16 else None]
    return torch.autocast(device.type, dtype, enabled=bool(dtype))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- summary and report ---------------------------------------------------------------------------


def summarize(run: dict[str, Any], forwards: int) -> dict[str, Any]:
    """Medians over the measured steps, each of its own per-step quantity: the phases, "other"
    (the step minus the phases), each one's share of its step, samples/s, tokens generated,
    prompt tokens and the tokens/s of the ``forwards`` log-prob forwards; and the generation /
    forward-only throughput ratio."""
    steps = run["steps"]
    per_step: dict[str, list[float]] = {}
    for r in steps:
        other = r["step_time_s"] - sum(r[p] for p in PHASES)
        values = {key: float(r[key]) for key in (*PHASES, *LOGGED)}
        generated = r["completion_length"] * r["rollout_samples"]
        values |= {
            "other_s": other,
            "samples_per_s": r["rollout_samples"] / r["step_time_s"],
            "generated_tokens": generated,
            "prompt_tokens": (r["row_tokens"] - generated) / r["rollout_samples"],
            "logprob_tokens_per_s": forwards * r["row_tokens"] / r["logprobs_s"],
        }
        values |= {f"share/{p}": values[p] / r["step_time_s"] for p in (*PHASES, "other_s")}
        values["share/rollout"] = sum(r[p] for p in ROLLOUT) / r["step_time_s"]
        for key, value in values.items():
            per_step.setdefault(key, []).append(value)
    out: dict[str, Any] = {key: statistics.median(v) for key, v in per_step.items()}
    out["forward_tokens_per_s"] = run["forward_tokens_per_s"]
    out["generation_vs_forward"] = out["generated_tokens_per_s"] / run["forward_tokens_per_s"]
    out["step_times"] = per_step["step_time_s"]
    out["sampling"] = run.get("sampling")
    return out


def split_table(summary: dict[str, dict[str, float]]) -> str:
    lines = ["| policy | step s | generate s | reward s | old + ref log-probs s | train s "
             "| other s | samples/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, s in summary.items():
        step = s["step_time_s"]
        cells = [f"{s[k]:.2f} ({s['share/' + k]:.0%})" for k in (*PHASES, "other_s")]
        lines.append(
            f"| {LABELS[name]} | {step:.2f} | {' | '.join(cells)} | {s['samples_per_s']:.2f} |"
        )
    return "\n".join(lines)


def throughput_table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| policy | tokens generated / step | mean prompt | mean completion | stopped early "
             "| generation tokens/s | forward-only tokens/s | generation / forward "
             "| log-prob forwards tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, s in summary.items():
        lines.append(
            f"| {LABELS[name]} | {s['generated_tokens']:.0f} | {s['prompt_tokens']:.1f} | "
            f"{s['completion_length']:.1f} | {s['stopped_fraction']:.1%} | "
            f"{s['generated_tokens_per_s']:.0f} | {s['forward_tokens_per_s']:.0f} | "
            f"{s['generation_vs_forward']:.3f} | {s['logprob_tokens_per_s']:.0f} |"
        )
    return "\n".join(lines)


def sampling_section(args: argparse.Namespace, summary: dict[str, dict[str, Any]]) -> str:
    """The sampling check's paragraph (empty without one)."""
    name = next((n for n, s in summary.items() if s["sampling"]), None)
    if name is None:
        return ""
    s = summary[name]
    keyed, plain = s["sampling"]["keyed"], s["sampling"]["generator"]
    forward = s["forward_tokens_per_s"]
    return f"""
## What a generated token costs ({LABELS[name]})

`generate` alone, after the run, once each way, on a step's worth of rows: the first \
{args.prompts} prompts,
chat-templated, {args.group_size} times each; temperature 1, at most {args.new_tokens} new \
tokens, KV cache, as in the recipe.

| sampling | generated tokens/s | / forward-only |
|---|---:|---:|
| keyed, as the recipe samples (one counter-based hash per row and step, inverse CDF) \
| {keyed:.0f} | {keyed / forward:.3f} |
| one `torch.Generator` stream | {plain:.0f} | {plain / forward:.3f} |

Keyed sampling keeps a rollout independent of its batch and of the number of ranks; here a
token generated with it takes {plain / keyed:.2f}x the time of one sampled from a
`torch.Generator` stream (below 1: faster).
"""


def comparisons(summary: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, s in summary.items():
        lines.append(
            f"- {LABELS[name]}: generation takes {s['share/generate_s']:.0%} of a step, the "
            f"whole rollout (generate, reward, log-probs) {s['share/rollout']:.0%}, the update "
            f"{s['share/train_s']:.0%};\n  a generated token costs "
            f"{1 / s['generation_vs_forward']:.1f}x the time of a token of the forward-only pass."
        )
    if {"full", "lora"} <= summary.keys():
        full, lora = summary["full"], summary["lora"]
        ratios = ", ".join(
            f"{label} {lora[key] / full[key]:.2f}x"
            for label, key in (
                ("step", "step_time_s"),
                ("generate", "generate_s"),
                ("log-probs", "logprobs_s"),
                ("train", "train_s"),
            )
        )
        lines.append(f"- LoRA / full fine-tuning (medians): {ratios}.")
    return "\n".join(lines)


def command(args: argparse.Namespace) -> str:
    return command_line("benchmarks/rl_step.py", args, DEFAULTS)


def device_text(args: argparse.Namespace) -> str:
    if args.device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(torch.device(args.device))}, CUDA {torch.version.cuda}"
    return f"CPU, {torch.get_num_threads()} thread(s)"


def report(
    args: argparse.Namespace,
    summary: dict[str, dict[str, Any]],
    load: tuple[float, float],
    minutes: float,
) -> str:
    rows = args.prompts * args.group_size
    times = "\n".join(
        f"- {LABELS[n]}: {', '.join(f'{t:.2f}' for t in s['step_times'])}"
        for n, s in summary.items()
    )
    checks = "\n".join(
        f"- {LABELS[n]}: mean reward {s['reward']:.3f}, largest |trainer - sampler| log-prob "
        f"{s['logprob_mismatch_max']:.1e}"
        for n, s in summary.items()
    )
    precision = "bf16 autocast" if args.bf16 else "no autocast"
    sharing = SHARED if args.shared else "no other job is known to have shared the machine"
    return f"""# RL step: where a GRPO step's time goes

`{command(args)}` ({minutes:.1f} min)

- Model: the random Llama-shaped model of `sft_mfu.py`: vocab {MODEL["vocab_size"]}, hidden \
{MODEL["hidden_size"]}, intermediate {MODEL["intermediate_size"]}, {MODEL["num_hidden_layers"]} \
layers,
  {MODEL["num_attention_heads"]} heads / {MODEL["num_key_value_heads"]} KV heads, untied \
`lm_head`; float32 weights, {precision}. Tokenizer: the tests' tiny llama3-style
  one (651 ids; most ids the model samples decode to nothing).
- Recipe: `tunesmith.recipes.grpo.main` on the shipped `grpo/tiny` config (LoRA: the `model`
  node of `sft/tiny_lora`, rank 8 on q and v). Per step {args.prompts} prompts x \
{args.group_size} samples = {rows} completions of at most
  {args.new_tokens} new tokens (temperature 1, KV cache), scored by `ExactAnswer` on
  "What is A + B?" prompts; GRPO advantages, PPO-clip loss, k3 KL with `kl.coef` = \
{args.kl_coef}
  (reference: a frozen copy for full fine-tuning, the policy with its adapters off for LoRA);
  micro-batches of {args.micro_batch} rows, AdamW. {args.warmup} warm-up step(s) excluded; \
medians of {args.steps} measured steps.
- The split is the recipe's own `metrics.jsonl`: `generate_s`, `reward_s`, `logprobs_s` (the
  trainer's old log-probs and the reference's: two no-gradient forwards over every row),
  `train_s` (`Trainer.step`: forward, backward, clipping, AdamW) and `step_time_s`; "other" is
  the step minus those four (prompt encoding, building the batch, metrics). Each cell is the
  median over the measured steps of that quantity (the shares too, so they need not add up).
- Generation tokens/s: tokens actually generated / `generate_s` (the prompts' prefill is in
  that time); log-prob forwards tokens/s: the rows' prompt + completion tokens x the forwards
  ({"old and reference" if args.kl_coef > 0 else "old only"}) / `logprobs_s`. Forward-only tokens/s: a no-gradient, eval-mode, prefill-style forward (logits
  at every position) of the same policy over {rows} x {args.new_tokens} random token ids \
(as many tokens as a step
  generates) in micro-batches of {args.micro_batch} rows; median of {args.forward_repeats} \
timings, in the same process right after the run.
- Machine: {machine()}; {device_text(args)}; Python {platform.python_version()},
  torch {torch.__version__}; run {datetime.date.today().isoformat()}. 1-minute load average \
{load[0]:.1f} at the start, {load[1]:.1f} at the end
  ({os.cpu_count()} cores): {sharing}.

## Per-step time (median, and share of the step)

{split_table(summary)}

Measured step times (s):

{times}

## Generation vs forward-only

{throughput_table(summary)}

{comparisons(summary)}
{sampling_section(args, summary)}
## Checks

{checks}

A random policy scores (almost) nothing, so its advantages are all zero: the policy loss has
no gradient and the KL term alone moves the weights. The backward runs in full either way, so
the timing is that of a learning run.
"""


SHARED = (
    "shared with other jobs while this ran, so absolute times are noisy; the shares and "
    "ratios come from the same run"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64, help="max new tokens per sample")
    parser.add_argument("--micro-batch", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=1, help="steps excluded (at least 1)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps")
    parser.add_argument("--forward-repeats", type=int, default=3)
    parser.add_argument(
        "--no-sampling-check",
        dest="sampling_check",
        action="store_false",
        help="skip timing generate alone, keyed vs generator sampling",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (mixed_precision)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared machine)"
    )
    parser.add_argument(
        "--shared", action="store_true", help="say in the report that other jobs shared the machine"
    )
    parser.add_argument("--no-write", action="store_true", help=f"do not write {RESULTS.name}")
    return parser


DEFAULTS = {a.dest: a.default for a in build_parser()._actions if a.dest != "help"}


def main() -> None:
    args = build_parser().parse_args()
    if args.warmup < 1:
        raise SystemExit("--warmup must be >= 1: the recipe logs the first step as first_step_s")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    summary: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_") as tmp:
        world = Path(tmp)
        rows = args.prompts * (args.warmup + args.steps)
        model_dir, prompts = make_world(world, rows)
        for name in args.configs:
            sampling = args.sampling_check and name == args.configs[0]
            run = run_config(args, name, world, model_dir, prompts, sampling)
            summary[name] = s = summarize(run, 2 if args.kl_coef > 0 else 1)
            print(
                f"{name}: step {s['step_time_s']:.2f} s (generate {s['generate_s']:.2f}, "
                f"reward {s['reward_s']:.3f}, log-probs {s['logprobs_s']:.2f}, train "
                f"{s['train_s']:.2f}); {s['generated_tokens_per_s']:.0f} generated tokens/s vs "
                f"{s['forward_tokens_per_s']:.0f} forward-only; run {run['wall_s']:.0f} s",
                flush=True,
            )
    minutes = (time.perf_counter() - started) / 60
    text = report(args, summary, (load_start, os.getloadavg()[0]), minutes)
    print(text)
    if not args.no_write:
        path = RESULTS if args.device == "cpu" else RESULTS.with_name("rl_step_cuda.md")
        path.write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
