"""Multi-turn rollouts with and without the KV cache carried from turn to turn.

A multi-turn GRPO rollout calls the engine once per turn; each turn's prompt is the last one
plus the reply and the environment's answer. Inside ``LocalEngine.keep_prefixes()`` (what the
recipes do around a rollout) the kept full blocks of the conversation are found again and
only the rest is prefilled (:mod:`tunesmith.generation.prefix_cache`); without it every turn
prefills the whole conversation. Both runs sample the same trajectories (keyed sampling), the
real trajectory sampler (``sample_trajectory_groups``) with an environment that answers each
reply with a fixed observation, on the benchmark model of ``sft_mfu.py`` (Llama-shaped, 4
layers, hidden 256) with the demo's tokenizer. Alternated ``--repeats`` times in one process,
medians reported; the trajectories of both runs compared token by token.

    python benchmarks/multiturn_rollout.py   # benchmarks/results/multiturn_rollout.md
    python benchmarks/multiturn_rollout.py --dry-run --out /tmp/x   # tiny, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import command_line, machine  # noqa: E402
from sft_mfu import MODEL  # noqa: E402

from tunesmith.data import Tokenizer  # noqa: E402
from tunesmith.demo.assets import build_tokenizer  # noqa: E402
from tunesmith.demo.task import make_splits  # noqa: E402
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with  # noqa: E402
from tunesmith.models import build_model  # noqa: E402
from tunesmith.models.spec import spec_from_hf_config  # noqa: E402
from tunesmith.rl.envs import EpisodeSettings, StepResult  # noqa: E402
from tunesmith.rl.groups import sample_trajectory_groups  # noqa: E402
from tunesmith.rl.prompts import Prompt  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "multiturn_rollout.md"
DEFAULTS = {"prompts": 8, "group": 4, "turns": 4, "system_words": 100, "observation_words": 20,
            "max_new_tokens": 32, "repeats": 3, "threads": 1, "dry_run": False}  # fmt: skip
DRY = {"prompts": 2, "group": 2, "turns": 3, "system_words": 8, "observation_words": 6,
       "max_new_tokens": 6, "repeats": 1}  # fmt: skip
DRY_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
WORDS = ["the", "result", "of", "the", "search", "lists", "these", "passages", "about",
         "numbers", "and", "their", "sums"]  # fmt: skip


class Observe:
    """Answers each reply with the same ``words``-word observation; ends after ``turns``."""

    def __init__(self, turns: int, words: int) -> None:
        self.turns, self.text = turns, " ".join(WORDS[i % len(WORDS)] for i in range(words))

    def tool_schemas(self) -> None:
        return None

    def reset(self, row: Prompt) -> list[dict[str, Any]]:
        self.turn = 0
        return [dict(m) for m in row.messages]

    def step(self, message: dict[str, Any]) -> StepResult:
        self.turn += 1
        done = self.turn >= self.turns
        return StepResult([] if done else [{"role": "user", "content": self.text}], {}, done)


@dataclass
class Run:
    """One rollout: its wall and CPU seconds, what each turn's engine call prefilled (and found
    kept), and the trajectories' tokens."""

    kept: bool
    wall: float
    cpu: float
    prefill: list[int]
    cached: list[int]
    rows: list[list[int]]


def rollout(model: Any, tok: Tokenizer, prompts: list[Prompt], args: Any, kept: bool) -> Run:
    engine = LocalEngine(model, tok, pad_id=tok.pad_id or 0)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=1.0)
    prefill, cached = [], []

    def generate(rows: list[list[int]], keys: list[int], limits: Any = None) -> Any:
        out = generate_with(engine, rows, keys, config, tok.stop_token_ids, max_new_tokens=limits)
        prefill.append(out.stats["prefill_tokens"])
        cached.append(out.stats["cached_tokens"])
        return out

    wall, cpu = time.perf_counter(), time.process_time()
    with engine.keep_prefixes() if kept else contextlib.nullcontext():
        groups = sample_trajectory_groups(
            generate, tok, Observe(args.turns, args.observation_words), prompts, round=0,
            group_size=args.group, seed=0, episode=EpisodeSettings(max_turns=args.turns),
            max_new_tokens=args.max_new_tokens, stop_token_ids=tok.stop_token_ids,
        )  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Run(kept, wall, cpu, prefill, cached, [c for g in groups for c in g.completions])


def report(runs: list[Run], args: Any, model_config: dict[str, Any], opening: int) -> str:
    kept = [r for r in runs if r.kept]
    plain = [r for r in runs if not r.kept]
    same = all(k.rows == p.rows for k, p in zip(kept, plain))
    walls = {
        n: statistics.median(r.wall for r in rs) for n, rs in (("kept", kept), ("plain", plain))
    }
    cpus = {n: statistics.median(r.cpu for r in rs) for n, rs in (("kept", kept), ("plain", plain))}
    speedup = statistics.median(p.wall / k.wall for k, p in zip(kept, plain))
    prefilled = {n: sum(rs[0].prefill) for n, rs in (("kept", kept), ("plain", plain))}
    lines = [
        "# Multi-turn rollouts: the KV cache carried from turn to turn",
        "",
        f"Machine: {machine()}; Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{args.threads} torch threads; run {datetime.date.today().isoformat()}, a shared "
        "machine (times are upper bounds; the ratio is of runs alternated in one process).",
        f"Command: `{command_line('benchmarks/multiturn_rollout.py', args, DEFAULTS)}`",
        "",
        f"Workload: {args.prompts} prompts x {args.group} trajectories, {args.turns} turns each "
        f"(an environment answering every reply with a {args.observation_words}-word "
        f"observation), replies of at most {args.max_new_tokens} tokens sampled at temperature "
        f"1 (keyed), an opening of {opening} tokens (a {args.system_words}-word system prompt); "
        f"model: Llama-shaped, {model_config['num_hidden_layers']} layers, hidden "
        f"{model_config['hidden_size']}, vocabulary {model_config['vocab_size']} (the demo's "
        "tokenizer), float32, CPU; engine defaults (block size 16).",
        "",
        "| engine | wall s (median) | CPU s (median) | prefilled tokens | found kept | "
        "plain / this (wall) |",
        "|---|---:|---:|---:|---:|---:|",
        f"| every turn prefilled whole | {walls['plain']:.2f} | {cpus['plain']:.2f} | "
        f"{prefilled['plain']} | 0 | 1.00 |",
        f"| `keep_prefixes()` (the recipes) | {walls['kept']:.2f} | {cpus['kept']:.2f} | "
        f"{prefilled['kept']} | {sum(kept[0].cached)} | {speedup:.2f} |",
        "",
        "Wall seconds of each alternated pair, plain / kept: "
        + ", ".join(f"{p.wall:.2f} / {k.wall:.2f}" for k, p in zip(kept, plain))
        + " (after one warm-up rollout, not counted).",
        "",
        "Per turn (engine call), prefilled tokens without / with kept prefixes: "
        + ", ".join(f"{p} / {k}" for p, k in zip(plain[0].prefill, kept[0].prefill))
        + ".",
        "",
        f"Same trajectories (every token of every row, in each of {len(kept)} pairs): "
        f"{'yes' if same else 'NO'}. Prefilled tokens: {prefilled['kept'] / prefilled['plain']:.2f}"
        f" of the plain engine's. Wall-time ratio: the median over the alternated pairs.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=int, default=default)
    p.add_argument("--out", type=Path, default=None, help="folder of the results file")
    args = p.parse_args(argv)
    if args.dry_run:
        for name, value in DRY.items():
            setattr(args, name, value)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.from_pretrained(build_tokenizer(Path(tmp) / "tok", make_splits(200, 0)[0]))
    config = {**MODEL, **(DRY_MODEL if args.dry_run else {}), "vocab_size": tok.vocab_size}
    torch.manual_seed(0)
    model = build_model(spec_from_hf_config(config)).eval()
    system = " ".join(WORDS[i % len(WORDS)] for i in range(args.system_words))
    prompts = [
        Prompt(i, [{"role": "system", "content": system},
                   {"role": "user", "content": f"Question {i}: add {i} and {2 * i}."}])
        for i in range(args.prompts)
    ]  # fmt: skip
    opening = len(tok.apply_chat_template(prompts[0].messages, add_generation_prompt=True))
    rollout(model, tok, prompts, args, kept=True)  # warm-up (first-call costs), not counted
    runs = []
    for i in range(args.repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs += [rollout(model, tok, prompts, args, kept) for kept in order]
    text = report(runs, args, config, opening)
    print(text)
    path = (args.out / RESULTS.name) if args.out else RESULTS
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return text


if __name__ == "__main__":
    main()
