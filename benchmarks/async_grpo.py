"""Asynchronous GRPO on this machine: samples/s and reward against updates and wall-clock time
of ``sync``, ``overlap`` and ``off_policy`` (``max_staleness`` 2), a timing model that predicts
each mode's step time from the measured time of each role, that model applied to 8-GPU and
multi-node splits, and (``--demo``) the RL demo run synchronously and asynchronously.

The workload is the RL tests' world (``tests/rl/rl_world.py``): the tiny random Qwen2.5-style
policy of ``tests.recipes.sft_world.make_model_dir``, "add A and B" prompts and a dense reward
(the fraction of digits in a completion, so every group has a gradient and the reward rises as
the policy learns), ``--prompts-per-step`` prompts x 8 samples of ``--new-tokens`` tokens per
update (the random policy seldom stops early). ``--new-tokens`` sets the balance: generation
is sequential (one forward per new token), training is one forward and backward over prompt
and completion, so longer completions weigh more on the rollout side; the default makes the
two sides take comparable time on this machine (the results say how comparable).

Every run is ``tunesmith.recipes.grpo_async.main`` on the shipped ``grpo_async/tiny`` config
(one rollout worker and one reward worker with one CPU each, the trainer in this process with
one torch thread) with only ``async_mode`` (and ``max_staleness``) changed; the synchronous
``grpo`` recipe on ``grpo/tiny`` (generation in the trainer's process, no Ray) runs next to them
as a reference. All runs join one local Ray instance started here. The modes run one after
another, in a rotated order for each seed (``--seeds``), so that a change of the machine's
load falls on every mode.

Measured, from each run's own ``metrics.jsonl`` (one line per update): samples/s (rollouts
trained on per second of wall time between update ``--warmup`` and the last update), the
trainer's step time, ``wait_s`` (the trainer waiting for its batch), ``generate_s``,
``reward_s``, ``logprobs_s``, ``train_s``, ``weight_sync_s`` (medians over the updates after
the warm-up), staleness and the mean reward per update.

Usage::

    python benchmarks/async_grpo.py            # writes benchmarks/results/async_grpo.md
    python benchmarks/async_grpo.py --demo     # ... and the demo, synchronous and --async
    python benchmarks/async_grpo.py --steps 12 --seeds 0 --no-write    # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "async_grpo.md"
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402
from machine_info import machine  # noqa: E402

from tests.recipes.sft_world import _any_component_allowed, make_model_dir  # noqa: E402
from tests.rl.rl_world import grpo_overrides, make_prompts  # noqa: E402
from tunesmith.demo.rl import RLDemoSettings, run_rl_demo  # noqa: E402
from tunesmith.models import from_hf  # noqa: E402
from tunesmith.recipes import run as run_recipe  # noqa: E402

MODES = ("grpo", "sync", "overlap", "off_policy")
"""``grpo``: the synchronous recipe (reference); the others: ``grpo_async``'s modes."""
LABEL = {"grpo": "grpo (in-process, no Ray)", "sync": "grpo_async sync",
         "overlap": "grpo_async overlap", "off_policy": "grpo_async off_policy (k=2)"}  # fmt: skip
ROLES = ("generate_s", "reward_s", "logprobs_s", "train_s", "weight_sync_s", "wait_s")


# ----------------------------------------------------------------------------- timing model


@dataclass(frozen=True)
class RoleTimes:
    """Seconds per update of each role, as a synchronous run measures them.

    ``gen``: sampling a batch (rollout worker); ``reward``: scoring it (and reference
    log-probs; reward worker); ``pipe``: what a remote batch costs besides those two (Ray task
    dispatch, moving the groups between processes: the trainer's wait minus ``gen + reward``
    in ``sync`` mode); ``logprobs``: the trainer's log-probs of the sampled tokens; ``train``:
    the update; ``sync``: sending the new weights to the rollout worker; ``other``: the rest
    of the trainer's step (building the batch, metrics, logging).
    """

    gen: float
    reward: float
    pipe: float
    logprobs: float
    train: float
    sync: float
    other: float

    @property
    def rollout_side(self) -> float:
        """One batch's time on the rollout and reward workers (and in between)."""
        return self.gen + self.reward + self.pipe

    @property
    def trainer_side(self) -> float:
        """One update's time in the trainer once its batch is there."""
        return self.logprobs + self.train + self.sync + self.other


def predict_step_s(
    times: RoleTimes, mode: str, *, rollout_slowdown: float = 1.0, trainer_slowdown: float = 1.0
) -> float:
    """The step time (seconds per update) ``mode`` should reach with the measured ``times``.

    * ``sync`` (and the in-process ``grpo`` recipe, whose ``pipe`` and ``sync`` are 0): the
      roles take turns, ``gen + reward + pipe + logprobs + train + sync + other``;
    * ``overlap``: batch k+1 is sampled while batch k trains, so in steady state a step takes
      the longer of the two sides, ``max(gen + reward + pipe, logprobs + train + sync +
      other)``;
    * ``off_policy``: the same ``max``; the deeper queue (batches sampled up to
      ``max_staleness`` updates ahead) only absorbs jitter, it cannot beat the slower side.

    When both sides run at once they share the machine: ``rollout_slowdown`` and
    ``trainer_slowdown`` (>= 1; 1 = a core each, nothing shared) stretch each side in the
    overlapped modes. With 1, 1 this is a prediction from the ``sync`` run alone.

    >>> t = RoleTimes(gen=3, reward=0, pipe=1, logprobs=1, train=4, sync=0.5, other=0.5)
    >>> predict_step_s(t, "sync"), predict_step_s(t, "overlap")
    (10.0, 6.0)
    >>> predict_step_s(t, "overlap", rollout_slowdown=2.0)
    8.0
    """
    if mode in ("grpo", "sync"):
        return times.rollout_side + times.trainer_side
    if mode in ("overlap", "off_policy"):
        return max(times.rollout_side * rollout_slowdown, times.trainer_side * trainer_slowdown)
    raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")


@dataclass(frozen=True)
class ClusterAssumptions:
    """What :func:`cluster_step_s` assumes of a GPU cluster (model predictions, not
    measurements).

    ``gen_gpu_s`` / ``train_gpu_s``: one batch's generation / training work in GPU-seconds
    (on one GPU, for a dedicated inference engine); generation splits perfectly over
    independent inference engines (data parallel); training over ``n`` GPUs takes
    ``train_gpu_s / (n * efficiency)`` (FSDP's communication); when colocated (every GPU
    generates, then trains), generation runs at ``colocated_gen_efficiency`` of a dedicated
    engine's speed (its KV cache shares the GPU's memory with the trainer's state: smaller
    batches) and each step pays ``switch_s`` to switch the GPUs between engine and trainer
    (weights into the engine, KV cache freed and rebuilt); ``sync_bytes`` over ``link_gb_s``
    (GB/s): a split's weight transfer from the trainer GPUs to the generation GPUs (NVLink
    inside a node, InfiniBand between nodes).
    """

    gen_gpu_s: float
    train_gpu_s: float
    efficiency: float = 0.9
    colocated_gen_efficiency: float = 1.0
    switch_s: float = 1.0
    sync_bytes: float = 16e9  # an 8B-parameter model in bfloat16
    link_gb_s: float = 100.0

    def weight_sync_s(self) -> float:
        return self.sync_bytes / (self.link_gb_s * 1e9)


def cluster_step_s(a: ClusterAssumptions, gen_gpus: int, train_gpus: int, mode: str) -> float:
    """Step time of a split of ``gen_gpus`` generation + ``train_gpus`` training GPUs under
    ``a``; ``gen_gpus == 0`` means colocated: all ``train_gpus`` GPUs generate, then train
    (time-sharing, the synchronous recipe), paying ``a.switch_s``. A split in ``sync`` mode
    adds its sides; in ``overlap`` it takes the longer side, the weight sync on the trainer's
    (the trainer sends the weights after each update, as :mod:`tunesmith.rl.asynchronous.source`).

    >>> a = ClusterAssumptions(gen_gpu_s=64.0, train_gpu_s=28.8, switch_s=1.0, link_gb_s=160)
    >>> round(cluster_step_s(a, 0, 8, "sync"), 2)  # 64/8 + 28.8/(8*0.9) + 1
    13.0
    >>> round(cluster_step_s(a, 4, 4, "overlap"), 2)  # max(64/4, 28.8/(4*0.9) + 0.1)
    16.0
    """
    train = a.train_gpu_s / (train_gpus * (a.efficiency if train_gpus > 1 else 1.0))
    if gen_gpus == 0:
        return a.gen_gpu_s / (train_gpus * a.colocated_gen_efficiency) + train + a.switch_s
    gen = a.gen_gpu_s / gen_gpus
    if mode == "sync":
        return gen + train + a.weight_sync_s()
    if mode in ("overlap", "off_policy"):
        return max(gen, train + a.weight_sync_s())
    raise ValueError(f"mode must be sync, overlap or off_policy, got {mode!r}")


def best_split(a: ClusterAssumptions, gpus: int) -> tuple[int, float]:
    """The number of generation GPUs (of ``gpus``) that makes an ``overlap`` step shortest,
    and that step time.

    >>> best_split(ClusterAssumptions(gen_gpu_s=64.0, train_gpu_s=28.8, link_gb_s=160), 8)
    (5, 12.8)
    """
    steps = {g: cluster_step_s(a, g, gpus - g, "overlap") for g in range(1, gpus)}
    g = min(steps, key=lambda k: (steps[k], k))
    return g, round(steps[g], 6)


# ----------------------------------------------------------------------------- runs


@dataclass
class Run:
    """One measured run: per-update metrics and what they sum up to."""

    mode: str
    seed: int
    out: Path
    records: dict[int, dict[str, float]]
    wall_s: float
    warmup: int
    idle: float = 0.0  # the machine's idle share of CPU time during the run (/proc/stat)

    @property
    def steps(self) -> list[int]:
        return sorted(s for s, r in self.records.items() if "reward" in r)

    def measured(self) -> list[int]:
        return [s for s in self.steps if s > self.warmup]

    def median(self, key: str) -> float:
        values = [self.records[s][key] for s in self.measured() if key in self.records[s]]
        return statistics.median(values) if values else 0.0

    def samples_per_s(self) -> float:
        steps = self.steps
        first, last = self.warmup, steps[-1]
        seconds = self.records[last]["elapsed_s"] - self.records[first]["elapsed_s"]
        samples = sum(self.records[s]["rollout_samples"] for s in steps if first < s <= last)
        return samples / seconds

    def step_s(self) -> float:
        steps = self.steps
        first, last = self.warmup, steps[-1]
        return (self.records[last]["elapsed_s"] - self.records[first]["elapsed_s"]) / (last - first)

    def rewards(self) -> list[tuple[int, float, float]]:
        """``(update, seconds since the run's first update, sampled reward)``."""
        t0 = self.records[1]["elapsed_s"]
        return [
            (s, self.records[s]["elapsed_s"] - t0, self.records[s]["reward"]) for s in self.steps
        ]

    def policy_rewards(self) -> dict[int, float]:
        """Mean sampled reward by the policy version that sampled it (``rollouts.jsonl``; the
        in-process ``grpo`` run samples each update's batch with the policy being trained).
        Version ``v`` is the policy after ``v`` updates, so a policy one update behind is
        charged for its own samples, not for the ones trained on at update ``v + 1``."""
        log = self.out / "rollouts.jsonl"
        if not log.is_file():
            return {s - 1: self.records[s]["reward"] for s in self.steps}
        by_version: dict[int, list[float]] = {}
        for line in log.read_text().splitlines():
            for _, _, version, reward, *_ in json.loads(line)["groups"]:  # then the spread
                by_version.setdefault(int(version), []).append(float(reward))
        return {v: _mean(rewards) for v, rewards in sorted(by_version.items())}

    def final_reward(self, last: int) -> float:
        """Mean reward of the ``last`` updates."""
        return _mean([x for _, _, x in self.rewards()[-last:]])

    def staleness(self) -> tuple[float, float]:
        lags = [r["staleness_mean"] for r in self.records.values() if "staleness_mean" in r]
        most = [r["staleness_max"] for r in self.records.values() if "staleness_max" in r]
        return (statistics.mean(lags) if lags else 0.0, max(most) if most else 0.0)


def read_records(out: Path) -> dict[int, dict[str, float]]:
    records: dict[int, dict[str, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        records.setdefault(int(row["step"]), {}).update(row)
    return records


def run_mode(
    mode: str, seed: int, root: Path, model_dir: Path, prompts: Path, args: argparse.Namespace
) -> Run:
    out = root / f"{mode}-seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    overrides = grpo_overrides(
        model_dir,
        prompts,
        out,
        f"seed={seed}",
        f"max_steps={args.steps}",
        f"prompts_per_step={args.prompts_per_step}",
        "group_size=8",
        "batch_size=64",
        f"generation.max_new_tokens={args.new_tokens}",
        f"optimizer.lr={args.lr}",
        "log_every_n_steps=1",
        "log_samples_every=0",
        "save_every_minutes=null",
        "~metric_loggers.0",  # the console logger: one line per update is noise here
    )
    if mode != "grpo":
        overrides += [f"async_mode={mode}", "max_staleness=2"]
    start, busy = time.perf_counter(), _cpu_times()
    with _any_component_allowed():  # the test reward lives in tests/
        run_recipe("grpo" if mode == "grpo" else "grpo_async", "tiny", overrides)
    wall = time.perf_counter() - start
    (idle1, total1), (idle0, total0) = _cpu_times(), busy
    return Run(
        mode,
        seed,
        out,
        read_records(out),
        wall,
        args.warmup,
        idle=(idle1 - idle0) / max(total1 - total0, 1),
    )


def _cpu_times() -> tuple[int, int]:
    """The machine's idle and total CPU time so far (clock ticks, all cores; /proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0, 0
    return fields[3] + fields[4], sum(fields[:8])  # idle + iowait; user .. steal


def role_times(run: Run) -> RoleTimes:
    """:class:`RoleTimes` of a ``sync`` (or ``grpo``) run: medians over its updates."""
    m = run.median
    gen, reward = m("generate_s"), m("reward_s")
    pipe = max(0.0, m("wait_s") - gen - reward) if run.mode != "grpo" else 0.0
    trainer = m("logprobs_s") + m("train_s") + m("weight_sync_s")
    waited = m("wait_s") if run.mode != "grpo" else gen + reward
    other = max(0.0, run.step_s() - waited - trainer)
    return RoleTimes(gen, reward, pipe, m("logprobs_s"), m("train_s"), m("weight_sync_s"), other)


# ----------------------------------------------------------------------------- report


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _spread(values: Sequence[float]) -> str:
    return f"{_mean(values):.1f}" + (
        f" ({min(values):.1f}-{max(values):.1f})" if len(values) > 1 else ""
    )


def window_means(run: Run, window: int) -> list[float]:
    """Mean sampled reward of each block of ``window`` updates."""
    rewards = [r for _, _, r in run.rewards()]
    return [_mean(rewards[i : i + window]) for i in range(0, len(rewards), window)]


def report(runs: list[Run], args: argparse.Namespace, setup: Mapping[str, Any]) -> str:
    by_mode = {m: [r for r in runs if r.mode == m] for m in MODES}
    seeds = sorted({r.seed for r in runs})
    lines = [
        "# Asynchronous GRPO: sync vs overlap vs off_policy on 2 CPU cores",
        "",
        f"`{setup['command']}` ({setup['minutes']:.1f} min)",
        "",
        "- Workload: the RL tests' world (`tests/rl/rl_world.py`): the tiny random "
        f"Qwen2.5-style policy of `make_model_dir` ({setup['params'] / 1e6:.2f} M parameters), "
        f'"add A and B" prompts, {args.prompts_per_step} prompts x 8 samples per update of '
        f"at most {args.new_tokens} new tokens (mean completion {setup['completion']:.1f} "
        "tokens: the random policy seldom stops), rewarded by the fraction of digits in the "
        f"completion (dense: the reward rises as the policy learns); AdamW, lr {args.lr}, "
        "one micro-batch per update.",
        f"- Each run: `tunesmith.recipes.grpo_async.main` on the shipped `grpo_async/tiny` "
        f"config, {args.steps} updates, only `async_mode` changed (`off_policy` with "
        "`max_staleness=2`); 1 rollout worker (1 CPU, 1 torch thread), 1 reward worker (1 CPU), "
        "the trainer in the benchmark's process (1 torch thread); all runs join one local Ray "
        "instance (`num_cpus=2`). Reference: the synchronous `grpo` recipe on `grpo/tiny` "
        "(generation in the trainer's process, no Ray). Same initial policy, same prompts, "
        f"seeds {', '.join(map(str, seeds))}; modes in a rotated order for each seed.",
        f"- Times: medians over updates {args.warmup + 1}-{args.steps} of each run's "
        "`metrics.jsonl` (one line per update); samples/s and step s: rollouts trained on "
        f"(and updates) per second of wall time between update {args.warmup} and the last.",
        f"- Machine: {machine()}; Python {platform.python_version()}, torch {torch.__version__}, "
        f"ray {setup['ray']}; run {datetime.date.today()}. 1-minute load average "
        f"{setup['load_start']:.1f} at the start, {setup['load_end']:.1f} at the end: "
        + (
            "the machine was shared with other jobs, so every time below is inflated and noisy "
            "(hence the repeats and the rotated order)."
            if max(setup["load_start"], setup["load_end"]) > 2.5
            else "no other job is known to have shared the machine."
        ),
        "",
        "## Throughput and where a step's time goes",
        "",
        "| mode | samples/s | vs sync | step s | trainer waits s | generate s | reward s "
        "| log-probs s | train s | weight sync s | staleness mean / max | machine idle "
        f"| reward, last {args.window} updates |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    sync_sps = _mean([r.samples_per_s() for r in by_mode["sync"]])
    for mode in MODES:
        rs = by_mode[mode]
        if not rs:
            continue
        sps = [r.samples_per_s() for r in rs]
        cells = [f"{_mean([r.median(k) for r in rs]):.3f}" for k in ROLES]
        if mode == "grpo":
            cells[-1] = "-"
            cells[4] = "-"
        stale = [r.staleness() for r in rs]
        acc_text = ", ".join(f"{r.final_reward(args.window):.3f}" for r in rs)
        lines.append(
            f"| {LABEL[mode]} | {_spread(sps)} | {_mean(sps) / sync_sps:.2f}x | "
            f"{_mean([r.step_s() for r in rs]):.3f} | {cells[5]} | {cells[0]} | {cells[1]} | "
            f"{cells[2]} | {cells[3]} | {cells[4]} | "
            f"{_mean([s[0] for s in stale]):.2f} / {max(s[1] for s in stale):.0f} | "
            f"{_mean([r.idle for r in rs]):.0%} | {acc_text} |"
        )
    lines += [
        "",
        'samples/s: mean over the seeds (range). "trainer waits": `wait_s`, the trainer idle '
        "until its batch is there (in `sync` the whole rollout; in the in-process `grpo` run "
        "no such wait: it generates itself). Machine idle: the share of the 2 cores' time "
        "nobody used during the run (`/proc/stat`); with none idle, a second busy process "
        "cannot add CPU, only split it. Reward: mean over the last updates, "
        "one value "
        f"per seed (first update: {setup['reward_start']:.3f}).",
        "",
        "Samples/s of each run (in the order they ran):",
        "",
    ]
    for r in runs:
        lines.append(
            f"- seed {r.seed}, {LABEL[r.mode]}: {r.samples_per_s():.1f} samples/s, "
            f"{r.step_s():.3f} s/update, {r.wall_s:.0f} s in all"
        )
    at = lines.index("## Throughput and where a step's time goes")
    lines[at:at] = [*verdict_section(by_mode, args)[1:], ""]
    lines += timing_section(by_mode)
    lines += reward_section(by_mode, args)
    if setup.get("demo"):
        lines += demo_section(setup["demo"])
    lines += cluster_section(by_mode)
    return "\n".join(lines) + "\n"


def measured_model(by_mode: Mapping[str, list[Run]]) -> tuple[RoleTimes, float, float]:
    """The ``sync`` runs' :class:`RoleTimes` (mean over seeds of the medians) and how much
    slower each side ran in the overlapped modes (generation; log-probs + train)."""
    sync = [role_times(r) for r in by_mode["sync"]]
    fields = RoleTimes.__dataclass_fields__
    t = RoleTimes(*(statistics.mean(getattr(x, f) for x in sync) for f in fields))
    over = by_mode["overlap"] + by_mode["off_policy"]
    if not over:
        return t, 1.0, 1.0
    slow_r = _mean([r.median("generate_s") for r in over]) / max(t.gen, 1e-9)
    slow_t = _mean([r.median("logprobs_s") + r.median("train_s") for r in over]) / max(
        t.logprobs + t.train, 1e-9
    )
    return t, slow_r, slow_t


def verdict_section(by_mode: Mapping[str, list[Run]], args: argparse.Namespace) -> list[str]:
    """The answer to the issue's target, from the numbers of this run."""
    t, slow_r, slow_t = measured_model(by_mode)
    sync_sps = _mean([r.samples_per_s() for r in by_mode["sync"]])
    lines = ["", "## Verdict", ""]
    ceiling = (t.rollout_side + t.trainer_side) / max(t.rollout_side, t.trainer_side)
    plain = predict_step_s(t, "overlap")
    fitted = predict_step_s(t, "overlap", rollout_slowdown=slow_r, trainer_slowdown=slow_t)
    measured = _mean([r.step_s() for r in by_mode["overlap"]]) if by_mode["overlap"] else 0.0
    idle = _mean([r.idle for rs in by_mode.values() for r in rs])
    for mode in ("overlap", "off_policy"):
        if not by_mode[mode]:
            continue
        ratio = _mean([r.samples_per_s() for r in by_mode[mode]]) / sync_sps
        met = "met" if ratio >= 1.5 else "not met"
        lines.append(f"- `{mode}`: {ratio:.2f}x the samples/s of `sync` (target 1.5x: {met}).")
    lines += [
        f"- Balance: the rollout side takes {t.rollout_side / t.trainer_side:.2f}x the trainer "
        f"side in `sync` ({args.new_tokens} new tokens), so overlapping them perfectly, each "
        f"on a core of its own, would give {ceiling:.2f}x.",
        f"- What holds it down: with both sides busy at once, generation took {slow_r:.2f}x "
        f"and log-probs + train {slow_t:.2f}x their `sync` times, and the machine's 2 cores "
        f"were {idle:.0%} idle over the runs (load average above). Overlap turns idle cores "
        "into throughput; on a machine with none idle, the rollout worker and the trainer "
        "(plus Ray's processes) only split the same CPU time. With these slowdowns the timing "
        f"model gives {fitted:.3f} s/update for `overlap` against {measured:.3f} measured "
        f"({plain:.3f} without them; table below)."
        if max(slow_r, slow_t) > 1.2
        else f"- Both sides kept their `sync` speed when overlapped (generation {slow_r:.2f}x, "
        f"log-probs + train {slow_t:.2f}x): the cores were free for them.",
    ]
    per = {
        (r.mode, r.seed): _mean([x for _, _, x in r.rewards()])
        for rs in by_mode.values()
        for r in rs
    }
    seeds = sorted({s for _, s in per})
    if len(seeds) > 1:
        noise = max(
            abs(per[(m, seeds[0])] - per[(m, seeds[1])])
            for m in MODES
            if (m, seeds[0]) in per and (m, seeds[1]) in per
        )
        gaps = [
            abs(per[(m, s)] - per[("sync", s)])
            for m in ("overlap", "off_policy")
            for s in seeds
            if (m, s) in per and ("sync", s) in per
        ]
        within = "within" if max(gaps) <= noise else "outside"
        lines.append(
            f"- Reward per update trained on: the overlapped modes' mean reward differs from "
            f"`sync`'s (same seed) by at most {max(gaps):.3f}, against up to {noise:.3f} between "
            f"two seeds of one mode: {within} the noise (per-block curves below). Their batches "
            "are sampled by a policy up to `lead` updates older, so this curve lags by that much."
        )
        versions, policy, gaps, noise = policy_comparison(by_mode, seeds)
        within = "within" if max(gaps) <= noise else "outside"
        lines.append(
            f"- Reward per policy version (the samples each policy drew, versions 0-"
            f"{versions - 1}, common to every run): the overlapped modes differ from `sync`'s "
            f"(same seed) by at most {max(gaps):.3f}, against up to {noise:.3f} between two "
            f"seeds of one mode: {within} the noise (table below)."
        )
    return lines


def policy_comparison(
    by_mode: Mapping[str, list[Run]], seeds: Sequence[int]
) -> tuple[int, dict[tuple[str, int], float], list[float], float]:
    """Mean reward per policy version over the versions every run sampled with: the number
    of versions, each run's mean, the overlapped modes' gaps to ``sync`` (same seed) and the
    largest gap between two seeds of one mode."""
    runs = [r for rs in by_mode.values() for r in rs]
    versions = min(max(r.policy_rewards()) + 1 for r in runs)
    policy = {
        (r.mode, r.seed): _mean([r.policy_rewards()[v] for v in range(versions)]) for r in runs
    }
    noise = max(
        abs(policy[(m, seeds[0])] - policy[(m, seeds[1])])
        for m in MODES
        if (m, seeds[0]) in policy and (m, seeds[1]) in policy
    )
    gaps = [
        abs(policy[(m, s)] - policy[("sync", s)])
        for m in ("overlap", "off_policy")
        for s in seeds
        if (m, s) in policy and ("sync", s) in policy
    ]
    return versions, policy, gaps, noise


def timing_section(by_mode: Mapping[str, list[Run]]) -> list[str]:
    t, slow_r, slow_t = measured_model(by_mode)
    lines = [
        "",
        "## Timing model: predicted vs measured step time",
        "",
        "The model (`predict_step_s` in `benchmarks/async_grpo.py`), from the per-role times of "
        "the `sync` runs (mean over seeds of the medians):",
        "",
        f"- rollout side = generate {t.gen:.3f} + reward {t.reward:.3f} + pipeline {t.pipe:.3f}"
        f" = {t.rollout_side:.3f} s (pipeline: the trainer's wait minus generate and reward: "
        "Ray task dispatch, moving the groups between processes);",
        f"- trainer side = log-probs {t.logprobs:.3f} + train {t.train:.3f} + weight sync "
        f"{t.sync:.3f} + other {t.other:.3f} = {t.trainer_side:.3f} s (other: the rest of the "
        "step: building the batch, metrics);",
        "- `sync`: rollout side + trainer side; `overlap` and `off_policy`: max(rollout side, "
        "trainer side), the deeper queue of `off_policy` only absorbing jitter;",
        f"- measured while both sides run at once (overlap and off_policy runs): generation "
        f"{slow_r:.2f}x and log-probs + train {slow_t:.2f}x their `sync` times: on 2 cores "
        "shared by the trainer, the rollout worker, Ray's own processes (and here other jobs) "
        "the sides slow each other down. The second prediction stretches each side by that "
        "factor (fitted on these runs, so a consistency check rather than a prediction).",
        "",
        "| mode | predicted s/update (no contention) | predicted s/update (measured contention) "
        "| measured s/update | predicted speed-up vs sync | measured speed-up |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    measured_sync = _mean([r.step_s() for r in by_mode["sync"]])
    base = predict_step_s(t, "sync")
    for mode in ("sync", "overlap", "off_policy"):
        rs = by_mode[mode]
        if not rs:
            continue
        plain = predict_step_s(t, mode)
        fitted = predict_step_s(t, mode, rollout_slowdown=slow_r, trainer_slowdown=slow_t)
        measured = _mean([r.step_s() for r in rs])
        lines.append(
            f"| {mode} | {plain:.3f} | {fitted:.3f} | {measured:.3f} | "
            f"{base / plain:.2f}x | {measured_sync / measured:.2f}x |"
        )
    ideal = (t.rollout_side + t.trainer_side) / max(t.rollout_side, t.trainer_side)
    balance = t.rollout_side / t.trainer_side
    lines += [
        "",
        f"Generation vs training: the rollout side is {balance:.2f}x the trainer side "
        f"(generate {t.gen:.3f} s vs log-probs + train {t.logprobs + t.train:.3f} s per "
        f"update), so perfect overlap could at most give {ideal:.2f}x; the 1.5x target needs "
        "the two sides within a factor of 2 of each other *and* a core for each.",
    ]
    return lines


def reward_section(by_mode: Mapping[str, list[Run]], args: argparse.Namespace) -> list[str]:
    window = args.window
    lines = [
        "",
        "## Reward per update and per wall-clock second",
        "",
        f"Mean reward (fraction of digits, over the {8 * args.prompts_per_step} samples of an "
        f"update) in blocks of {window} updates, one row per run:",
        "",
    ]
    runs = [r for rs in by_mode.values() for r in rs]
    blocks = len(window_means(runs[0], window))
    header = " | ".join(
        f"{i * window + 1}-{min((i + 1) * window, args.steps)}" for i in range(blocks)
    )
    lines += [f"| run | {header} | all |", "|---|" + "---:|" * (blocks + 1)]
    for mode in MODES:
        for r in by_mode[mode]:
            means = window_means(r, window)
            all_mean = _mean([x for _, _, x in r.rewards()])
            lines.append(
                f"| {LABEL[mode]}, seed {r.seed} | "
                + " | ".join(f"{m:.3f}" for m in means)
                + f" | {all_mean:.3f} |"
            )
    # noise: how far apart two seeds of the same mode are, against a mode vs sync, same seed
    seeds = sorted({r.seed for r in runs})
    per = {(r.mode, r.seed): _mean([x for _, _, x in r.rewards()]) for r in runs}
    lines += [
        "",
        "How to read it (noise): the reward of one run depends on its seed "
        "(which prompts, which samples). The mean reward over all updates:",
    ]
    if len(seeds) > 1:
        seed_gaps = [
            abs(per[(m, seeds[0])] - per[(m, seeds[1])])
            for m in MODES
            if (m, seeds[0]) in per and (m, seeds[1]) in per
        ]
        lines.append(
            f"- between seeds {seeds[0]} and {seeds[1]} of the same mode differs by "
            f"{_mean(seed_gaps):.3f} on average (max {max(seed_gaps):.3f}): the noise;"
        )
    for mode in ("overlap", "off_policy", "grpo"):
        gaps = [per[(mode, s)] - per[("sync", s)] for s in seeds if (mode, s) in per]
        if gaps:
            lines.append(
                f"- {LABEL[mode]} minus sync, same seed: "
                + ", ".join(f"{g:+.3f}" for g in gaps)
                + ";"
            )
    lines += [
        "- `grpo` and `grpo_async sync` are the same computation (bitwise equal weights, "
        "tested in `tests/rl/test_grpo_async.py`), so their rewards agree exactly and that "
        "row measures only the cost of the remote pipeline.",
    ]
    if len(seeds) > 1:
        lines += policy_section(by_mode, seeds, window)
    lines += [
        "",
        "Reward against wall-clock time (seconds since the run's first update; mean sampled "
        f"reward of the {window} updates up to the one shown):",
        "",
        "| run | " + " | ".join(f"update {u}" for u in _marks(args)) + " |",
        "|---|" + "---:|" * len(_marks(args)),
    ]
    for mode in MODES:
        for r in by_mode[mode]:
            points = r.rewards()
            cells = []
            for u in _marks(args):
                upto = [x for s, _, x in points if u - window < s <= u]
                seconds = next(t for s, t, _ in points if s == u)
                cells.append(f"{seconds:.0f} s: {_mean(upto):.3f}")
            lines.append(f"| {LABEL[mode]}, seed {r.seed} | " + " | ".join(cells) + " |")
    return lines


def policy_section(
    by_mode: Mapping[str, list[Run]], seeds: Sequence[int], window: int
) -> list[str]:
    """The reward of each policy version (from the groups it sampled), in blocks."""
    versions, policy, _, _ = policy_comparison(by_mode, seeds)
    starts = list(range(0, versions, window))
    lines = [
        "",
        "Mean reward by the policy that sampled it (version `v`: the policy after `v` updates; "
        "each group's mean reward in `rollouts.jsonl` with its version), in blocks of "
        f"{window} versions, over the versions 0-{versions - 1} every run sampled with:",
        "",
        "| run | "
        + " | ".join(f"v {a}-{min(a + window, versions) - 1}" for a in starts)
        + " | all |",
        "|---|" + "---:|" * (len(starts) + 1),
    ]
    for mode in MODES:
        for r in by_mode[mode]:
            rewards = r.policy_rewards()
            cells = [
                _mean([rewards[v] for v in range(a, min(a + window, versions))]) for a in starts
            ]
            lines.append(
                f"| {LABEL[mode]}, seed {r.seed} | "
                + " | ".join(f"{c:.3f}" for c in cells)
                + f" | {policy[(mode, r.seed)]:.3f} |"
            )
    for mode in ("overlap", "off_policy"):
        gaps = [policy[(mode, s)] - policy[("sync", s)] for s in seeds if (mode, s) in policy]
        if gaps:
            lines.append(
                f"- {LABEL[mode]} minus sync, same seed, by policy version: "
                + ", ".join(f"{g:+.3f}" for g in gaps)
                + ";"
            )
    return lines


def _marks(args: argparse.Namespace) -> list[int]:
    return [u for u in range(args.window, args.steps + 1, args.window)]


def demo_section(demo: Mapping[str, Any]) -> list[str]:
    lines = [
        "",
        "## The RL demo, synchronous and `--async`",
        "",
        "`tunesmith demo rl` and `tunesmith demo rl --async` (default settings: 700 updates "
        "of 8 prompts x 8 samples, held-out accuracy every 50), one after the other in this "
        "run, `--threads 1`; the same world and the same SFT warm-up (seed 0). The async "
        "demo's config (`grpo_async/demo`) is `grpo/demo` in `overlap` mode with "
        "`importance_cap: 2.0` (truncated importance weights for its one-update-old batches).",
        "",
        "| demo | GRPO recipe | held-out accuracy after SFT | after GRPO | gain | GRPO run s "
        "| whole demo s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in demo.items():
        lines.append(
            f"| {name} | {r['recipe']} | {r['before']:.1%} | {r['after']:.1%} | "
            f"{100 * (r['after'] - r['before']):+.1f} points | {r['grpo_s']:.0f} | "
            f"{r['total_s']:.0f} |"
        )
    sync, fast = demo.get("demo rl"), demo.get("demo rl --async")
    if sync and fast:
        lines += [
            "",
            f"The asynchronous GRPO run took {fast['grpo_s'] / sync['grpo_s']:.2f}x the "
            f"synchronous one's time ({sync['grpo_s'] / fast['grpo_s']:.2f}x as fast) for a "
            f"gain of {100 * (fast['after'] - fast['before']):+.1f} points against "
            f"{100 * (sync['after'] - sync['before']):+.1f}. Held-out accuracy during GRPO "
            "(update: accuracy):",
            "",
            f"- sync:  {sync['curve']}",
            f"- async: {fast['curve']}",
        ]
    return lines


CLUSTER_CASES = {
    "ideal time-sharing": {"colocated_gen_efficiency": 1.0, "switch_s": 1.0},
    "memory-bound time-sharing": {"colocated_gen_efficiency": 0.8, "switch_s": 10.0},
}
"""The two assumption sets of the cluster table: time-sharing that costs nothing but a 1 s
switch, and one whose engine gets 80% of a dedicated engine's speed (a smaller KV cache next
to the trainer's state) and pays 10 s a step to switch (an 8B model's weights into the engine,
the KV cache rebuilt)."""


def cluster_section(by_mode: Mapping[str, list[Run]]) -> list[str]:
    lines = [
        "",
        "## The model applied to 8 GPUs and to several nodes (model predictions, not measurements)",
        "",
        "`cluster_step_s` in `benchmarks/async_grpo.py`, the `max(rollout side, trainer side)` "
        "of the timing model with each side's time divided among its GPUs. Assumptions (none "
        "measured here): one batch needs `G` GPU-seconds of generation on dedicated inference "
        "engines and `T` GPU-seconds of training, G + T = 800 with generation 50%, 70% or 85% "
        "of it (at scale generation dominates a GRPO step: long reasoning answers); "
        "generation splits perfectly over independent engines, training over n GPUs takes "
        "T / (0.9 n) (FSDP); a split sends the new weights (16 GB: 8B parameters in bfloat16) "
        "from the trainer's GPUs to the engines after every update, at 100 GB/s inside a node "
        "(NVLink) or 25 GB/s between nodes (InfiniBand), on the trainer's side of the max. "
        "Colocated (every GPU generates, then trains: the synchronous recipe), two cases: "
        "*ideal* time-sharing (generation at full speed, 1 s per step to switch) and "
        "*memory-bound* time-sharing (generation at 80% speed, its KV cache sharing memory "
        "with the trainer's state, and 10 s per step to switch).",
        "",
        "| cluster | G share | colocated s/update: ideal / memory-bound | split | split, sync "
        "s | split, overlap s | best split (overlap) | best split vs colocated: ideal / "
        "memory-bound |",
        "|---|---:|---:|---|---:|---:|---|---:|",
    ]
    gains: dict[str, list[float]] = {"ideal": [], "memory": [], "split_sync": []}
    for gpus, nodes in ((8, 1), (16, 2), (32, 4)):
        for share in (0.5, 0.7, 0.85):
            cases = [
                ClusterAssumptions(
                    gen_gpu_s=800 * share,
                    train_gpu_s=800 * (1 - share),
                    link_gb_s=100.0 if nodes == 1 else 25.0,
                    **case,
                )
                for case in CLUSTER_CASES.values()
            ]
            colocated = [cluster_step_s(a, 0, gpus, "sync") for a in cases]
            a = cases[0]  # a split has no colocation: both cases are the same
            half = gpus // 2
            g, best = best_split(a, gpus)
            gains["ideal"].append(colocated[0] / best)
            gains["memory"].append(colocated[1] / best)
            gains["split_sync"].append(cluster_step_s(a, half, gpus - half, "sync") / colocated[0])
            where = (
                f"{half} + {gpus - half} GPUs"
                if nodes == 1
                else f"{nodes // 2} + {nodes // 2} nodes"
            )
            lines.append(
                f"| {gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''}) | {share:.0%} | "
                f"{colocated[0]:.1f} / {colocated[1]:.1f} | {where} | "
                f"{cluster_step_s(a, half, gpus - half, 'sync'):.1f} | "
                f"{cluster_step_s(a, half, gpus - half, 'overlap'):.1f} | "
                f"{g} gen + {gpus - g} train: {best:.1f} s | "
                f"{colocated[0] / best:.2f}x / {colocated[1] / best:.2f}x |"
            )
    lines += [
        "",
        "Reading: a split that does not overlap (split, sync) is "
        f"{min(gains['split_sync']):.1f}-{max(gains['split_sync']):.1f}x as slow as ideal "
        "time-sharing, each half idling while the other works; overlapped, a split is as "
        "fast as its slower side, so it must be sized to the generation share (the best split "
        "puts more GPUs on generation as generation dominates; an even 4 + 4 split wastes "
        "the training half when generation is 85%). When both sides scale linearly, overlap on "
        "a best split only matches ideal time-sharing "
        f"({min(gains['ideal']):.2f}-{max(gains['ideal']):.2f}x): the same GPU-seconds, spread "
        "differently. What the split wins is what time-sharing loses: the switch and the "
        f"engine's memory (memory-bound: {min(gains['memory']):.2f}-"
        f"{max(gains['memory']):.2f}x), and, not modelled here, generation that does not scale "
        "down to a step's share of the GPUs (long-tail answers). Staleness stays at most one "
        "update in `overlap` whatever the split.",
    ]
    return lines


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="updates per run")
    p.add_argument("--warmup", type=int, default=5, help="first updates not timed")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64, help="generation.max_new_tokens")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--window", type=int, default=10, help="updates per reward block")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--demo", action="store_true", help="also run the demo, sync and --async")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--output", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if "sync" not in args.modes:
        p.error("--modes needs sync (the baseline)")

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(1)
    start = time.perf_counter()
    load_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="async_grpo_"))
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    try:
        model_dir = make_model_dir(root / "world")
        prompts = make_prompts(root / "prompts.jsonl", rows=64)
        with _any_component_allowed():  # the workers start with the test reward allowed
            ray.init(num_cpus=2, _temp_dir=ray_dir, include_dashboard=False, log_to_driver=False)
        runs: list[Run] = []
        order = [m for m in MODES if m in args.modes]
        for i, seed in enumerate(args.seeds):
            rotated = order[i % len(order) :] + order[: i % len(order)]
            for mode in rotated:
                print(f"seed {seed}: {mode}", flush=True)
                runs.append(run_mode(mode, seed, root, model_dir, prompts, args))
                print(f"  {runs[-1].samples_per_s():.1f} samples/s", flush=True)
        ray.shutdown()
        demo: dict[str, Any] = {}
        if args.demo:
            for asynchronous in (False, True):
                name = "demo rl --async" if asynchronous else "demo rl"
                print(name, flush=True)
                r = run_rl_demo(
                    root / "demo",
                    settings=RLDemoSettings(seed=0),
                    threads=1,
                    verbose=False,
                    asynchronous=asynchronous,
                    overrides=[f"ray.temp_dir={ray_dir}"] if asynchronous else [],
                )
                demo[name] = {"recipe": r.recipe, "before": r.accuracy_before,
                              "after": r.accuracy_after, "grpo_s": r.grpo_seconds,
                              "total_s": r.seconds,
                              "curve": "  ".join(f"{s}: {a:.0%}" for s, a in r.curve)}  # fmt: skip
        first = runs[0].records
        setup = {
            "command": "python benchmarks/async_grpo.py" + (" " + " ".join(argv or sys.argv[1:])
                                                            if (argv or sys.argv[1:]) else ""),
            "minutes": (time.perf_counter() - start) / 60, "ray": ray.__version__,
            "load_start": load_start, "load_end": os.getloadavg()[0], "demo": demo,
            "params": sum(p.numel() for p in from_hf(model_dir).parameters()),
            "completion": _mean([r["completion_length"] for r in first.values()
                                 if "completion_length" in r]),
            "reward_start": _mean([r.rewards()[0][2] for r in runs]),
        }  # fmt: skip
        text = report(runs, args, setup)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(ray_dir, ignore_errors=True)
    print(text)
    if not args.no_write:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
