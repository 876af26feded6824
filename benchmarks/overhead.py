"""Library overhead: tunesmith's ``Trainer.step`` against a hand-written PyTorch loop.

For each shape, method and dtype, one process holds two copies of the same model (built by
``build_model``, same initial weights) and trains each on the same batch: the **baseline** is
the plain PyTorch step in :func:`baseline_step` (forward, the same loss math, backward,
clipping when the config clips, the config's AdamW, an LR lambda: no tunesmith training
code); **tunesmith** is the real :class:`~tunesmith.training.trainer.Trainer` with the
recipe's own objective, built from the method's shipped config (its loss, optimizer,
``max_grad_norm``, LR schedule), ``mixed_precision`` set to the row's dtype. Rounds take
turns (baseline then tunesmith, then the other order), after one warm-up step each; the
ratio is of the median step times (CPU time of this process, since the machine is shared;
wall time next to it). The two copies' first-step losses are printed side by side: equal up
to float rounding, they show that both do the same math.

The breakdown: a few more tunesmith steps under ``torch.profiler`` with the Trainer's own
``record_function`` ranges (``trainer/units``, ``trainer/objective``, ``trainer/backward``,
``trainer/grad_norm``, ``trainer/optimizer``, ``trainer/metrics``) and the model's forward
(hooks), and the baseline's matching phases; plus, measured with the real classes outside
the step: data (``DatasetSource.next_step``: sampling and collate), logging
(``MetricWindow`` + the config's loggers, at its ``log_every_n_steps``) and the checkpoint
(``Trainer.save``, amortised over the steps of the config's save interval).

Usage::

    python benchmarks/overhead.py                            # writes results/overhead.md
    python benchmarks/overhead.py --shapes 100M              # writes results/overhead_100m.md
    python benchmarks/overhead.py --shapes 4-layer --methods sft --dtypes fp32 --rounds 2 \\
        --no-write                                           # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import io
import math
import os
import platform
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"  # overhead.md (4-layer), overhead_100m.md
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import machine  # noqa: E402
from shapes import SHAPES  # noqa: E402  (sft_mfu.py's 4-layer shape; sft_ladder.py's ~100M)

BATCH, SEQ_LEN = 4, 256  # rows (DPO: pairs) x tokens; the first half of each row is prompt
METHODS = {"sft": ("sft", "tiny"), "lora": ("sft", "tiny_lora"), "dpo": ("dpo", "tiny"),
           "kd": ("kd", "tiny")}  # fmt: skip
DTYPES = {"fp32": None, "bf16": "bf16"}
TRAINER_PHASES = ("units", "objective", "backward", "grad_norm", "optimizer", "metrics")
_RANGE = (
    torch.profiler.record_function
)  # the baseline's phase ranges (a PhaseClock in the breakdown)


# -- the hand-written baseline: plain PyTorch, no tunesmith training code ------------------------


def _trained(model, batch, head):  # log-softmax of the trained positions, float32; their labels
    hidden = model(batch["input_ids"], return_hidden_states=True)
    mask = batch["labels"] != -100
    return (hidden[mask] @ head.weight.T).float().log_softmax(-1), batch["labels"][mask], mask


def baseline_loss(method: str, linear_ce: bool, model, frozen, batch, cfg) -> torch.Tensor:
    """The method's summed loss, written out: cross-entropy (over full logits, or over the
    trained positions' logits only when the config's loss is linear CE), DPO, forward KD."""
    if method in ("sft", "lora") and not linear_ce:
        logits = model(batch["input_ids"])
        return F.cross_entropy(
            logits.flatten(0, 1).float(),
            batch["labels"].flatten(),
            ignore_index=-100,
            reduction="sum",
        )
    if method in ("sft", "lora"):
        logp, labels, _ = _trained(model, batch, model.lm_head)
        return F.nll_loss(logp, labels, reduction="sum")
    if method == "kd":
        logp, labels, _ = _trained(model, batch, model.lm_head)
        with torch.no_grad():
            teacher, _, _ = _trained(frozen, batch, frozen.lm_head)
        kd = (teacher.exp() * (teacher - logp)).sum()
        ratio = float(cfg.kd_ratio)
        return ratio * kd + (1 - ratio) * F.nll_loss(logp, labels, reduction="sum")

    def row_logps(m):  # each row's summed log-prob of its trained labels
        logp, labels, mask = _trained(m, batch, m.lm_head)
        rows = mask.nonzero()[:, 0]
        picked = logp.gather(-1, labels[:, None])[:, 0]
        return torch.zeros(mask.shape[0], device=logp.device).index_add(0, rows, picked)

    policy = row_logps(model)
    with torch.no_grad():
        ref = row_logps(frozen)
    (pc, pr), (rc, rr) = policy.chunk(2), ref.chunk(2)
    return -F.logsigmoid(float(cfg.loss.beta) * ((pc - rc) - (pr - rr))).sum()


def baseline_step(state: dict, batch: dict) -> float:
    """One optimizer step of the hand-written loop; returns the loss (one host sync)."""
    model, optimizer, schedule, cfg = state["model"], state["opt"], state["sched"], state["cfg"]
    dtype = state["autocast"]
    with (
        _RANGE("baseline/objective"),
        torch.autocast("cpu", dtype or torch.bfloat16, enabled=dtype is not None),
    ):
        loss = baseline_loss(
            state["method"], state["linear_ce"], model, state["frozen"], batch, cfg
        )
        loss = loss / state["units"]
    with _RANGE("baseline/backward"):
        loss.backward()
    if cfg.get("max_grad_norm"):
        with _RANGE("baseline/grad_norm"):
            torch.nn.utils.clip_grad_norm_(state["params"], float(cfg.max_grad_norm))
    with _RANGE("baseline/optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    with _RANGE("baseline/metrics"):
        return loss.item()


def make_baseline(method: str, model, frozen, cfg: DictConfig, batch: dict) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(
        params, lr=float(opt.lr), weight_decay=float(opt.weight_decay), fused=opt.get("fused")
    )
    warmup, total = int(cfg.lr_scheduler.num_warmup_steps), int(cfg.max_steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / total))
        ),
    )
    units = (
        batch["input_ids"].shape[0] // 2
        if method == "dpo"
        else int((batch["labels"] != -100).sum())
    )
    return {"model": model, "frozen": frozen, "opt": optimizer, "sched": schedule, "cfg": cfg,
            "params": params, "method": method, "units": units,
            "linear_ce": "Linear" in str(cfg.get("loss", {}).get("_component_", "")),
            "autocast": {"bf16": torch.bfloat16}.get(cfg.get("mixed_precision"))}  # fmt: skip


# -- tunesmith: the shipped config, the recipe's objective, the real Trainer ---------------------


def method_config(method: str, dtype: str, out: Path) -> DictConfig:
    from tunesmith.cli import catalog
    from tunesmith.config import load_config

    recipe, name = METHODS[method]
    overrides = [f"output_dir={out}", "model_dir=null", "dataset.source=unused",
                 "teacher_dir=unused", "max_steps=1000", f"mixed_precision={DTYPES[dtype]}",
                 "metric_loggers.1.log_dir=" + str(out)]  # fmt: skip
    cfg = load_config(catalog.config_path(name, recipe), overrides)
    if recipe != "kd":
        cfg.pop("teacher_dir", None)
    return cfg


def build_models(method: str, shape: str, cfg: DictConfig):
    """(policy, frozen reference/teacher or None), the policy with the config's adapters."""
    from tunesmith.models import build_model
    from tunesmith.models.spec import spec_from_hf_config
    from tunesmith.modules.peft import apply_lora

    spec = spec_from_hf_config(SHAPES[shape])
    torch.manual_seed(0)
    model = build_model(spec)
    frozen = None
    if method == "dpo":
        frozen = copy.deepcopy(model).requires_grad_(False).eval()
    if method == "kd":
        torch.manual_seed(1)
        frozen = build_model(spec).requires_grad_(False).eval()
    if method == "lora":
        options = {
            k: v
            for k, v in OmegaConf.to_container(cfg.model).items()
            if k not in ("_component_", "model")
        }
        model = apply_lora(model, **options)
    return model, frozen


def objective_for(method: str, cfg: DictConfig, frozen):
    from tunesmith.config import instantiate
    from tunesmith.training.objectives import (
        Distillation,
        PreferenceObjective,
        TokenCrossEntropy,
        pair_logps,
    )
    from tunesmith.training.setup import FrozenPolicy

    loss_fn = instantiate(cfg.loss)
    if method == "dpo":
        chunk = int(cfg.get("logprob_chunk_size", 1024))
        reference = partial(pair_logps, FrozenPolicy(frozen), chunk_size=chunk)
        return PreferenceObjective(loss_fn, reference, chunk)
    if method == "kd":
        return Distillation(frozen, loss_fn, float(cfg.get("kd_ratio", 0.5)))
    return TokenCrossEntropy(loss_fn)


# -- data --------------------------------------------------------------------------------------


def samples(method: str, n: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` samples of ``SEQ_LEN`` tokens whose first half is prompt (DPO: pairs sharing it)."""
    rng = random.Random(seed)
    half = SEQ_LEN // 2

    def row(prompt):
        ids = prompt + [rng.randrange(1, vocab) for _ in range(SEQ_LEN - half)]
        return ids, [-100] * (half - 1) + ids[half:] + [-100]

    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(half)]
        ids, labels = row(prompt)
        if method != "dpo":
            out.append({"input_ids": ids, "labels": labels})
            continue
        rejected, rejected_labels = row(prompt)
        out.append(
            {
                "chosen_input_ids": ids,
                "chosen_labels": labels,
                "prompt_len": half,
                "rejected_input_ids": rejected,
                "rejected_labels": rejected_labels,
            }
        )
    return out


def collate_for(method: str) -> Callable:
    from tunesmith.data import collate_padded
    from tunesmith.training.objectives.preference import collate_with_reference

    return partial(collate_with_reference if method == "dpo" else collate_padded, pad_id=0)


# -- one row -----------------------------------------------------------------------------------


@dataclass
class Row:
    shape: str
    method: str
    dtype: str
    cpu: dict[str, list[float]] = field(default_factory=dict)  # b: baseline, t: tunesmith,
    wall: dict[str, list[float]] = field(default_factory=dict)
    user: dict[str, list[float]] = field(default_factory=dict)  # user CPU only
    faults: dict[str, list[int]] = field(default_factory=dict)  # minor page faults
    first_losses: tuple[float, float] = (0.0, 0.0)
    loss: str = ""  # the config's loss component (the baseline writes out the same math)
    phases: dict[str, float] = field(default_factory=dict)  # tunesmith, ms per step
    baseline_phases: dict[str, float] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)  # outside the step, ms per step

    def ms(self, who: str = "t") -> float:
        return statistics.median(self.cpu[who]) * 1e3

    @property
    def ratio(self) -> float:
        return self.ms("t") / self.ms("b")

    @property
    def user_ratio(self) -> float:
        return statistics.median(self.user["t"]) / statistics.median(self.user["b"])

    def faults_per_step(self, who: str) -> int:
        return int(statistics.median(self.faults[who]))

    @property
    def wall_ratio(self) -> float:
        return statistics.median(self.wall["t"]) / statistics.median(self.wall["b"])


def _usage() -> tuple[float, float, int]:
    """This process's (user CPU s, system CPU s, minor page faults) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime, usage.ru_minflt


def _timed(step: Callable[[], object]) -> tuple[float, float, float, int]:
    """CPU seconds, wall seconds, user CPU seconds and minor page faults of ``step()``."""
    wall, (user, system, faults) = time.perf_counter(), _usage()
    step()
    user_end, system_end, faults_end = _usage()
    cpu = user_end - user + system_end - system
    return cpu, time.perf_counter() - wall, user_end - user, faults_end - faults


class PhaseClock:
    """CPU seconds of named phases: stands in for ``torch.profiler.record_function`` (the
    Trainer's and the baseline's ranges) during the breakdown steps, and times each forward
    of the given models through hooks (a shared, loaded machine makes the profiler's
    wall-clock ranges too noisy)."""

    def __init__(self, models: dict[str, torch.nn.Module]) -> None:
        self.totals: dict[str, float] = {}
        self.handles, self.started = [], []
        for name, model in models.items():
            self.handles.append(model.register_forward_pre_hook(partial(self._enter, name)))
            self.handles.append(model.register_forward_hook(self._exit))

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.process_time()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.process_time() - start

    def _enter(self, name, module, args):
        self.started.append((name, time.process_time()))

    def _exit(self, module, args, output):
        name, start = self.started.pop()
        self.totals[name] = self.totals.get(name, 0.0) + time.process_time() - start

    def per_step_ms(self, steps: int) -> dict[str, float]:
        for handle in self.handles:
            handle.remove()
        return {name: total / steps * 1e3 for name, total in self.totals.items()}


@contextlib.contextmanager
def phase_clock(models: dict[str, torch.nn.Module]):
    """A :class:`PhaseClock` in place of the Trainer's and the baseline's ranges."""
    global _RANGE
    import tunesmith.training.trainer as trainer_module

    clock = PhaseClock(models)
    saved = trainer_module.record_function, _RANGE
    trainer_module.record_function = _RANGE = clock
    try:
        yield clock
    finally:
        trainer_module.record_function, _RANGE = saved


def run_row(shape: str, method: str, dtype: str, rounds: int, profile_steps: int) -> Row:
    from tunesmith.training.logging.loggers import MetricWindow
    from tunesmith.training.parallel.distributed import init_distributed
    from tunesmith.training.settings import LoopSettings
    from tunesmith.training.sources import DatasetSource
    from tunesmith.training.trainer import Trainer

    row = Row(shape, method, dtype)
    with tempfile.TemporaryDirectory(prefix="overhead_") as tmp:
        out = Path(tmp)
        cfg = method_config(method, dtype, out)
        cfg.progress_bar = False
        model, frozen = build_models(method, shape, cfg)
        base_model, base_frozen = copy.deepcopy(model), frozen  # same weights; frozen shared
        collate = collate_for(method)
        data = samples(method, 64, SHAPES[shape]["vocab_size"])
        batch = collate(data[:BATCH])
        ctx = init_distributed("cpu")
        trainer = Trainer.from_config(
            cfg, ctx, model=model, objective=objective_for(method, cfg, frozen)
        )
        base = make_baseline(method, base_model, base_frozen, cfg, batch)
        row.loss = str(cfg.loss._component_).rsplit(".", 1)[-1]
        first_base = baseline_step(base, batch)  # warm-up steps (not timed)
        first_tune = trainer.step([batch])["loss"]
        row.first_losses = (first_base, first_tune)
        contestants = {
            "b": lambda: baseline_step(base, batch), "t": lambda: trainer.step([batch]),
        }  # fmt: skip
        for r in range(rounds):
            order = list(contestants)
            order = order[r % len(order) :] + order[: r % len(order)]  # taking turns
            for who in order:
                cpu, wall, user, faults = _timed(contestants[who])
                row.cpu.setdefault(who, []).append(cpu)
                row.wall.setdefault(who, []).append(wall)
                row.user.setdefault(who, []).append(user)
                row.faults.setdefault(who, []).append(faults)

        # -- the breakdown: CPU time per phase
        forwards = {"model/forward": model, **({"frozen/forward": frozen} if frozen else {})}
        with phase_clock(forwards) as clock:
            for _ in range(profile_steps):
                trainer.step([batch])
        row.phases = clock.per_step_ms(profile_steps)
        forwards = {"model/forward": base_model, **({"frozen/forward": frozen} if frozen else {})}
        with phase_clock(forwards) as clock:
            for _ in range(profile_steps):
                baseline_step(base, batch)
        row.baseline_phases = clock.per_step_ms(profile_steps)

        # -- outside the step: data, logging, checkpoint
        source = DatasetSource.build(data, collate, LoopSettings.from_config(cfg), ctx)
        source.next_step()  # the loader's start
        n = 8
        start = time.process_time()
        for _ in range(n):
            source.next_step()
        row.extras["data"] = (time.process_time() - start) / n * 1e3
        metrics = trainer.step([batch])
        loggers = _loggers(cfg)
        window = MetricWindow(trainer.objective.unit)
        log_every = int(cfg.get("log_every_n_steps", 1))
        start = time.process_time()
        for step in range(1, n + 1):
            window.add(metrics)
            if step % log_every == 0:
                for logger in loggers:
                    logger.log(step, window.means())
                window.clear()
        row.extras["logging"] = (time.process_time() - start) / n * 1e3
        for logger in loggers:
            logger.close()
        start = time.perf_counter()
        trainer.save()
        save_s = time.perf_counter() - start
        step_s = statistics.median(row.wall["t"])
        every = cfg.get("save_every_n_steps")
        minutes = cfg.get("save_every_minutes")
        interval = int(every) if every else max(1, int(float(minutes or 0) * 60 / step_s))
        row.extras["checkpoint"] = save_s / interval * 1e3 if (every or minutes) else 0.0
        row.extras["checkpoint_interval"] = interval
        row.extras["checkpoint_s"] = save_s
    return row


def _loggers(cfg: DictConfig) -> list:
    from tunesmith.config import instantiate
    from tunesmith.training.logging.loggers import StdoutLogger

    loggers = []
    for node in cfg.get("metric_loggers") or []:
        logger = instantiate(node)
        if isinstance(logger, StdoutLogger):
            logger = StdoutLogger(stream=io.StringIO())  # measured, not shown
        loggers.append(logger)
    return loggers


# -- the report ---------------------------------------------------------------------------------


PAIRS = {  # a tunesmith phase -> the baseline's matching phase(s)
    "objective (forward + loss)": (("trainer/objective",), ("baseline/objective",)),
    "backward": (("trainer/backward",), ("baseline/backward",)),
    "grad norm / clip": (("trainer/grad_norm",), ("baseline/grad_norm",)),
    "optimizer + schedule": (("trainer/optimizer",), ("baseline/optimizer",)),
    "units + metrics": (("trainer/units", "trainer/metrics"), ("baseline/metrics",)),
}


def differences(row: Row) -> list[tuple[float, str]]:
    """(tunesmith - baseline CPU ms per step, phase), largest first."""
    t, b = row.phases, row.baseline_phases
    diffs = [
        (sum(t.get(k, 0.0) for k in mine) - sum(b.get(k, 0.0) for k in theirs), name)
        for name, (mine, theirs) in PAIRS.items()
    ]
    return sorted(diffs, reverse=True)


def explain(row: Row) -> str:
    """Why a row is where it is, from its breakdown."""
    diffs = differences(row)
    excess = row.ms("t") - row.ms("b")
    text = ", ".join(f"{name} {d:+.0f} ms" for d, name in diffs[:2])
    fb, ft = row.faults_per_step("b"), row.faults_per_step("t")
    faults = ""
    if abs(fb - ft) > 0.1 * max(fb, ft):  # the allocator, not work: see the notes
        faults = (
            f"; page faults a step {fb:,} (baseline) vs {ft:,} ({abs(fb - ft) * 4 / 1024:,.0f} "
            f"MiB of fresh pages {'more' if ft > fb else 'fewer'} for tunesmith), user CPU "
            f"ratio {row.user_ratio:.3f}"
        )
    if row.ratio <= 1.10:
        return f"within 10% (largest phase differences: {text}{faults})"
    why = f"**above 10%** ({excess:+.0f} ms a step): largest phase differences {text}"
    return why + faults


def table(rows: list[Row]) -> str:
    lines = [
        "| shape | method | dtype | loss | baseline ms | tunesmith ms | ratio (CPU) "
        "| ratio (user CPU) "
        "| ratio (wall) | page faults / step baseline / tunesmith "
        "| first-step loss baseline / tunesmith |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape} | {r.method} | {r.dtype} | {r.loss} | {r.ms('b'):.0f} | {r.ms('t'):.0f} | "
            f"**{r.ratio:.3f}** | {r.user_ratio:.3f} | {r.wall_ratio:.3f} | "
            f"{r.faults_per_step('b'):,} / {r.faults_per_step('t'):,} | "
            f"{r.first_losses[0]:.6f} / {r.first_losses[1]:.6f} |"
        )
    return "\n".join(lines)


def breakdown(rows: list[Row]) -> str:
    lines = [
        "| shape | method | dtype | units | objective (model fwd / frozen fwd) | backward "
        "| grad norm | optimizer | metrics | data | logging | checkpoint (save s / every) "
        "| baseline: objective / backward / clip / optimizer / metrics |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        p, b, x = r.phases, r.baseline_phases, r.extras
        lines.append(
            f"| {r.shape} | {r.method} | {r.dtype} | {p.get('trainer/units', 0):.2f} | "
            f"{p.get('trainer/objective', 0):.0f} ({p.get('model/forward', 0):.0f} / "
            f"{p.get('frozen/forward', 0):.0f}) | {p.get('trainer/backward', 0):.0f} | "
            f"{p.get('trainer/grad_norm', 0):.1f} | {p.get('trainer/optimizer', 0):.1f} | "
            f"{p.get('trainer/metrics', 0):.2f} | {x['data']:.2f} | {x['logging']:.2f} | "
            f"{x['checkpoint']:.2f} ({x['checkpoint_s']:.2f} s / {x['checkpoint_interval']:.0f}) "
            f"| {b.get('baseline/objective', 0):.0f} / {b.get('baseline/backward', 0):.0f} / "
            f"{b.get('baseline/grad_norm', 0):.1f} / {b.get('baseline/optimizer', 0):.1f} / "
            f"{b.get('baseline/metrics', 0):.2f} |"
        )
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> str:
    lines = []
    for r in rows:
        extra = r.extras["data"] + r.extras["logging"] + r.extras["checkpoint"]
        loop = (r.ms("t") + extra) / r.ms("b")
        lines.append(
            f"- {r.shape} {r.method} {r.dtype}: ratio {r.ratio:.3f}, {explain(r)}; with the "
            f"loop's data, logging and amortised checkpoint {loop:.3f}"
        )
    return "\n".join(lines)


def report(args, rows: list[Row], minutes: float, load: tuple[float, float]) -> str:
    worst = max(rows, key=lambda r: r.ratio)
    return f"""# Library overhead: tunesmith's Trainer.step against a hand-written loop

`python benchmarks/overhead.py --shapes {" ".join(args.shapes)} --rounds {args.rounds} --rounds-100m {args.rounds_100m} --threads {args.threads}` — whole run
{minutes:.1f} min.

- Machine: {machine()}, shared with other work; 1-minute load average {load[0]:.1f} at the
  start, {load[1]:.1f} at the end (timings are CPU time of this process for that reason).
  Python {platform.python_version()}, torch {torch.__version__}; {args.threads} intra-op
  thread(s); run {datetime.date.today().isoformat()}. **GPU: not run** (no device for this
  task).
- Shapes: `4-layer` (random Llama, vocab 32000, hidden 256, 4 layers, untied head) and
  `100M` (vocab 32000, hidden 768, 12 layers, tied head); batch {BATCH} rows (DPO: {BATCH}
  pairs, {2 * BATCH} rows) x seq {SEQ_LEN}, the first half of each row prompt (no loss).
- Methods: each shipped config as it is at run time (`sft/tiny`, `sft/tiny_lora`,
  `dpo/tiny`, `kd/tiny`: its loss, optimizer, `max_grad_norm`, schedule; **loss** column),
  `mixed_precision` null (fp32) or `bf16` (autocast). The baseline writes the same loss
  math out by hand (for `LinearCrossEntropyLoss`: the logits of the trained positions only,
  in one matmul, then cross-entropy; DPO: log-softmax of the trained positions, summed per
  row; KD: forward KL of the trained positions' distributions plus cross-entropy), clips
  when the config clips, and steps `torch.optim.AdamW` with the config's settings.
- {args.rounds} timed steps of each side per row ({args.rounds_100m} for `100M`), taking
  turns, after one warm-up step each; step times are medians of this process's CPU time.
  Breakdown: {args.profile_steps}
  more steps of each side (one for `100M`) with CPU clocks in place of the phase ranges.

**Worst ratio: {worst.ratio:.3f}** ({worst.shape} {worst.method} {worst.dtype}); target
<= 1.10 for every row.

{table(rows)}

Per row:

{verdicts(rows)}

## Breakdown (CPU ms per step)

{breakdown(rows)}

- **units**: counting the step's units (tokens or pairs; no collective and no host copy in
  a world of one). **objective**: the recipe's objective (the policy's forward, the frozen
  reference's or teacher's forward, the loss); **model fwd / frozen fwd**: the forwards
  alone (hooks). **grad norm**: the norm and clipping (the gradients are multiplied only
  when the norm is above `max_grad_norm`). **metrics**: the non-finite check, token counts,
  the objective's means (one host sync).
- **data**: `DatasetSource.next_step()` (sampler + collate of one step's rows); **logging**:
  `MetricWindow.add` and the config's loggers (stdout to a buffer, JSONL to a file) at its
  `log_every_n_steps`; **checkpoint**: one `Trainer.save()` (weights or adapter, optimizer,
  training state; wall seconds) divided by the steps between saves (`save_every_n_steps`, or
  `save_every_minutes` at this row's step time). These three run outside `Trainer.step` and
  are not in its ratio; the per-row line adds them.
- **head logits of DPO and KD**: `token_logprobs` (DPO) and `KDLoss` keep a single chunk of
  trained positions' logits from forward to backward and recompute them in backward only
  when there are several chunks (here one chunk: {BATCH * SEQ_LEN // 2} trained positions,
  DPO {BATCH * SEQ_LEN} in its {2 * BATCH} rows); recomputing a single chunk would cost
  two more head matmuls for no lower peak (`test_one_chunk_is_kept_at_no_extra_peak` in
  tests/losses).
- **page faults**: minor page faults of the process during the step (4 KiB each: fresh pages
  the allocator got from the kernel and the step touched). glibc returns large freed blocks
  to the kernel, so a step pays for the fresh pages of its large tensors; how many it pays
  for depends on the process's allocation history as well as on the step (the same loss
  and model code fault differently in different places of one process), and those faults
  are system CPU time. **ratio (user CPU)** leaves them out: the work both sides do.
- Phase clocks are CPU time; a loaded machine still slows both sides alike through shared
  caches and memory bandwidth, so single rows move by several percent between runs.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["4-layer"])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=6, help="timed steps of each side")
    parser.add_argument("--rounds-100m", type=int, default=2, help="--rounds of the 100M shape")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    parser.add_argument("--no-write", action="store_true", help="do not write the results")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    rows = []
    for shape in args.shapes:
        for method in args.methods:
            for dtype in args.dtypes:
                rounds = args.rounds_100m if shape == "100M" else args.rounds
                profile = 1 if shape == "100M" else args.profile_steps
                row = run_row(shape, method, dtype, rounds, profile)
                gc.collect()  # the row's models and optimizer states
                rows.append(row)
                print(
                    f"{shape} {method} {dtype}: baseline "
                    f"{row.ms('b'):.0f} ms, tunesmith "
                    f"{row.ms('t'):.0f} ms, ratio "
                    f"{row.ratio:.3f} (wall {row.wall_ratio:.3f}); first losses "
                    f"{row.first_losses[0]:.6f} / {row.first_losses[1]:.6f}",
                    flush=True,
                )
    minutes = (time.perf_counter() - started) / 60
    print(table(rows))
    print(breakdown(rows))
    print(verdicts(rows))
    if not args.no_write:
        name = "overhead.md" if args.shapes == ["4-layer"] else "overhead_100m.md"
        if set(args.shapes) == set(SHAPES):
            name = "overhead_all.md"
        path = RESULTS / name
        path.write_text(report(args, rows, minutes, (load_start, os.getloadavg()[0])))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
