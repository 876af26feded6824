"""The two weight-sync paths of asynchronous GRPO side by side (``rollout.weight_sync``:
``object_store`` and ``collective``, :mod:`tunesmith.rl.asynchronous.weight_sync`) on this machine.

The workload is the RL tests' world (``tests/rl/rl_world.py``): the tiny random policy of
``tests.recipes.sft_world.make_model_dir``, "add A and B" prompts and a dense digit reward, run
by ``tunesmith.recipes.grpo_async.main`` on the shipped ``grpo_async/tiny`` config in
``overlap`` mode with two rollout workers; only ``rollout.weight_sync`` differs between the two
runs of a seed. All runs join one local Ray instance started here; the two paths alternate
(rotated order for each seed) so that a change of the machine's load falls on both.

Measured from each run's ``metrics.jsonl`` (medians over the updates that send weights, after
the first): ``weight_sync_s`` (what the trainer waits for at each sync: gathering the tensors,
then ``ray.put`` for ``object_store``, packing them into per-dtype buffers and queueing the
broadcast for ``collective``), ``weight_sync_mb``, ``wait_s`` (the trainer waiting for its
batch) and the run's wall time; and whether both paths end with bitwise-equal weights.

Usage::

    python benchmarks/weight_sync.py              # writes benchmarks/results/weight_sync.md
    python benchmarks/weight_sync.py --steps 6 --seeds 0 --no-write    # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "weight_sync.md"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import ray  # noqa: E402
import torch  # noqa: E402
from machine_info import machine  # noqa: E402

from tests.recipes.sft_world import (  # noqa: E402
    _any_component_allowed,
    final_weights,
    make_model_dir,
)
from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl  # noqa: E402

PATHS = ("object_store", "collective")


def run_path(
    path: str, seed: int, root: Path, model_dir: Path, prompts: Path, steps: int
) -> tuple[Path, float]:
    """One ``grpo_async`` run with ``rollout.weight_sync=path``; its output dir and wall time."""
    out = root / f"{path}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = grpo_overrides(
        model_dir,
        prompts,
        out,
        f"seed={seed}",
        f"max_steps={steps}",
        "optimizer.lr=1e-2",
        "generation.max_new_tokens=16",
        "async_mode=overlap",
        "rollout.workers=2",
        f"rollout.weight_sync={path}",
        "log_samples_every=0",
        "save_every_minutes=null",
        "~metric_loggers.0",
    )
    start = time.perf_counter()
    run_rl("grpo_async", "tiny", overrides)
    return out, time.perf_counter() - start


def metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def median(rows: Sequence[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rows[1:] if key in r]  # the first sync forms the group
    return statistics.median(values)


def report(rows: list[tuple[str, int, Path, float]], steps: int) -> str:
    lines = [
        "# Weight sync: object store vs collective broadcast",
        "",
        f"Machine: {machine()}; torch {torch.__version__}, ray {ray.__version__}; "
        f"{datetime.date.today().isoformat()}.",
        "",
        f"`python benchmarks/weight_sync.py`: `grpo_async/tiny` on the tests' tiny policy, "
        f"`overlap`, 2 rollout workers + 1 reward worker, {steps} updates per run; medians "
        "over the updates that send weights, after the first (see the script's docs).",
        "",
        "| path | seed | weight_sync_s | weight_sync_mb | wait_s | run wall s |",
        "|---|---|---|---|---|---|",
    ]
    for path, seed, out, wall in rows:
        m = metrics(out)
        lines.append(
            f"| {path} | {seed} | {median(m, 'weight_sync_s'):.4f} | "
            f"{median(m, 'weight_sync_mb'):.3f} | {median(m, 'wait_s'):.3f} | {wall:.1f} |"
        )
    lines.append("")
    for seed in sorted({s for _, s, _, _ in rows}):
        outs = {p: o for p, s, o, _ in rows if s == seed}
        a, b = (final_weights(outs[p]) for p in PATHS)
        same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        lines.append(f"Seed {seed}: final weights of both paths bitwise equal: {same}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--no-write", action="store_true", help="print the report only")
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    root = Path(tempfile.mkdtemp(prefix="weight_sync"))
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    try:
        model_dir = make_model_dir(root)
        prompts = make_prompts(root / "prompts.jsonl", rows=64)
        with _any_component_allowed():
            ray.init(num_cpus=4, _temp_dir=temp, include_dashboard=False, log_to_driver=False)
        rows = []
        for i, seed in enumerate(args.seeds):
            order = PATHS if i % 2 == 0 else PATHS[::-1]
            for path in order:
                out, wall = run_path(path, seed, root, model_dir, prompts, args.steps)
                rows.append((path, seed, out, wall))
        rows.sort(key=lambda r: (r[1], PATHS.index(r[0])))
        text = report(rows, args.steps)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS.relative_to(REPO)}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
