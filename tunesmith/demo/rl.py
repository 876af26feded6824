"""``tunesmith demo rl``: what SFT on a few demonstrations leaves undone, GRPO learns from a
verifier.

The task is the SFT demo's (sort a string of 3-8 distinct capital letters,
:mod:`tunesmith.demo.task`) with the same kind of tiny, randomly initialised Qwen2.5-style
model, but only a few demonstrations (96 by default) are available. Steps:

1. the local world (:func:`~tunesmith.demo.assets.make_assets`), then three files under
   ``data/``: ``demonstrations.jsonl`` (the SFT rows), ``prompts.jsonl`` (every other training
   string as an RL prompt; its answer is read by the verifier only) and
   ``held_out_prompts.jsonl`` (prompts never trained on);
2. an SFT warm-up, ``tunesmith run sft --config demo_rl``: the model fits its demonstrations
   and learns the answer format, yet gets only a part of new prompts right;
3. GRPO, ``tunesmith run grpo --config demo`` from the warm-up's checkpoint: sampled answers
   scored by :class:`~tunesmith.rl.rewards.strings.StringMatch` (exact) plus partial credit;
   with ``asynchronous=True`` (``tunesmith demo rl --async``) the same GRPO run goes through
   ``tunesmith run grpo_async --config demo`` (``overlap`` mode: a Ray rollout worker samples
   batch k+1 while the trainer trains on batch k);
4. held-out accuracy (greedy answers scored by the config's ``correct`` reward) of the warm-up
   and of the GRPO checkpoint, and the reward curve as a PNG.

Example::

    result = run_rl_demo("outputs/demo_rl", threads=1)
    result.accuracy_before, result.accuracy_after
    # -> (0.36, 0.8)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tunesmith.config import instantiate
from tunesmith.data import Tokenizer
from tunesmith.demo.assets import DEFAULT_MODEL, AssetSettings, DemoAssets, is_built, make_assets
from tunesmith.demo.run import run_to_checkpoint
from tunesmith.demo.task import Example, read_jsonl, write_jsonl
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.models import from_hf
from tunesmith.recipes import prepare_run
from tunesmith.rl.prompts import Prompt, encode_prompt
from tunesmith.rl.rewards import RewardSet, Sample
from tunesmith.rl.settings import RLSettings
from tunesmith.training.logging.plot import read_metrics

__all__ = [
    "ACCURACY_REWARD",
    "CONFIG",
    "WARMUP_CONFIG",
    "RLDemoData",
    "RLDemoResult",
    "RLDemoSettings",
    "grpo_recipe",
    "greedy_accuracy",
    "plot_rewards",
    "run_rl_demo",
    "split_overrides",
    "summary",
    "write_prompts",
    "write_rl_data",
]

CONFIG = "demo"
"""The GRPO config (``tunesmith/recipes/configs/grpo/demo.yaml``; ``grpo_async/demo.yaml``, the
same settings plus the asynchronous ones, with ``asynchronous=True``)."""
WARMUP_CONFIG = "demo_rl"
"""The SFT warm-up's config (``tunesmith/recipes/configs/sft/demo_rl.yaml``)."""
ACCURACY_REWARD = "correct"
"""The reward of the GRPO config that is held-out accuracy (1 for an exact answer, else 0)."""
SFT_DIR, GRPO_DIR, GRPO_ASYNC_DIR = "sft", "grpo", "grpo_async"
DEMONSTRATIONS, PROMPTS, HELD_OUT_PROMPTS = (
    "demonstrations.jsonl", "prompts.jsonl", "held_out_prompts.jsonl")  # fmt: skip
_SFT_KEYS = ("model_dir", "dataset.source", "output_dir")
_GRPO_KEYS = ("model_dir", "prompts.source", "val_prompts.source", "output_dir")


@dataclass(frozen=True)
class RLDemoSettings:
    """The task's size, the seed (data, model, both runs) and the model's size.

    ``num_demonstrations`` training strings become SFT rows, the other ``num_prompts`` RL
    prompts; ``num_held_out`` strings are never trained on.
    """

    seed: int = 0
    num_demonstrations: int = 96
    num_prompts: int = 3904
    num_held_out: int = 200
    vocab_size: int = 320
    model: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_MODEL))

    def assets(self) -> AssetSettings:
        """The settings of the shared demo world (:func:`~tunesmith.demo.assets.make_assets`)."""
        return AssetSettings(
            num_train=self.num_demonstrations + self.num_prompts,
            num_held_out=self.num_held_out,
            seed=self.seed,
            vocab_size=self.vocab_size,
            model=dict(self.model),
        )


@dataclass(frozen=True)
class RLDemoData:
    """The files of the RL demo (see :func:`write_rl_data`) and what they hold."""

    assets: DemoAssets
    demonstrations_file: Path
    prompts_file: Path
    held_out_file: Path
    demonstrations: list[Example]
    held_out: list[Example]


@dataclass(frozen=True)
class RLDemoResult:
    """What :func:`run_rl_demo` measured and wrote.

    ``accuracy_before`` / ``accuracy_after``: held-out accuracy of the SFT warm-up / of GRPO;
    ``accuracy_demonstrations``: the warm-up's accuracy on its own demonstrations;
    ``curve``: ``(step, held-out accuracy)`` as the GRPO run logged it, step 0 the warm-up;
    ``recipe``: the GRPO recipe that ran (``grpo``, or ``grpo_async`` for the asynchronous
    demo); ``grpo_seconds``: the wall time of that run alone (``seconds``: the whole demo).
    """

    accuracy_before: float
    accuracy_after: float
    accuracy_demonstrations: float
    held_out: list[Example]
    replies_before: list[str]
    replies_after: list[str]
    warmup_checkpoint: Path
    checkpoint: Path
    curve: list[tuple[int, float]]
    plot: Path | None
    seconds: float
    recipe: str = "grpo"
    grpo_seconds: float = 0.0


# ----------------------------------------------------------------------------- data


def write_prompts(examples: Iterable[Example], path: str | os.PathLike[str]) -> Path:
    """Write RL prompt rows ``{"prompt": [system, user], "answer": "SORTED"}`` to ``path``
    (what :class:`~tunesmith.rl.prompts.PromptDataset` reads).

    Example::

        >>> write_prompts([Example("CBA")], "p.jsonl")
        PosixPath('p.jsonl')
        >>> json.loads(Path("p.jsonl").read_text())["answer"]
        'ABC'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": ex.prompt_messages(), "answer": ex.answer}) + "\n")
    return path


def write_rl_data(root: str | os.PathLike[str], settings: RLDemoSettings) -> RLDemoData:
    """Build (or reuse) the demo world under ``root`` and write the RL demo's three files:
    the first ``num_demonstrations`` training strings as SFT rows, the rest as RL prompts,
    the held-out strings as prompts.

    Example::

        >>> settings = RLDemoSettings(num_demonstrations=4, num_prompts=8, num_held_out=2)
        >>> data = write_rl_data("outputs/demo_rl", settings)
        >>> len(data.demonstrations), data.prompts_file
        (4, PosixPath('outputs/demo_rl/data/prompts.jsonl'))
    """
    assets = make_assets(root, settings.assets())
    train = read_jsonl(assets.train_file)
    held_out = read_jsonl(assets.held_out_file)
    demonstrations, prompts = (
        train[: settings.num_demonstrations],
        train[settings.num_demonstrations :],
    )
    data_dir = assets.train_file.parent
    return RLDemoData(
        assets=assets,
        demonstrations_file=write_jsonl(demonstrations, data_dir / DEMONSTRATIONS),
        prompts_file=write_prompts(prompts, data_dir / PROMPTS),
        held_out_file=write_prompts(held_out, data_dir / HELD_OUT_PROMPTS),
        demonstrations=demonstrations,
        held_out=held_out,
    )


# ----------------------------------------------------------------------------- scoring


@torch.no_grad()
def greedy_accuracy(
    model: nn.Module,
    tokenizer: Tokenizer,
    prompts: Sequence[Prompt],
    rewards: RewardSet,
    *,
    max_new_tokens: int,
    batch_size: int = 200,
    reward: str = ACCURACY_REWARD,
) -> tuple[float, list[str]]:
    """Greedy replies of ``model`` to ``prompts`` and the mean of ``rewards``' ``reward`` over
    them, decoded as the GRPO recipe's held-out evaluation decodes (chat template, stop at
    end of turn, ``max_new_tokens``, batches of ``batch_size``).

    Example::

        acc, replies = greedy_accuracy(
            model, tok, prompts, rewards, max_new_tokens=10)
    """
    if reward not in rewards.rewards:
        raise ValueError(
            f"no reward {reward!r} to measure accuracy with (rewards: {sorted(rewards.rewards)})"
        )
    if not prompts:
        raise ValueError("accuracy of no prompts is undefined")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    stop = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    engine = LocalEngine(model, tokenizer, pad_id=pad_id)
    greedy = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    replies: list[str] = []
    scores: list[float] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        encoded = [encode_prompt(tokenizer, p) for p in chunk]
        out = generate_with(engine, [ids for ids, _ in encoded], None, greedy, stop)
        texts = [tokenizer.decode(seq, skip_special_tokens=True) for seq in out.sequences]
        samples = [
            Sample(
                prompt=text,
                completion=reply,
                answer=p.answer,
                metadata=p.metadata,
                completion_tokens=len(seq),
                finish_reason=reason,
            )
            for p, (_, text), reply, seq, reason in zip(
                chunk, encoded, texts, out.sequences, out.finish_reasons
            )
        ]
        scores += rewards(samples).per_reward[reward].tolist()
        replies += texts
    return sum(scores) / len(scores), replies


# ----------------------------------------------------------------------------- runs


def grpo_recipe(asynchronous: bool) -> tuple[str, str]:
    """``(recipe, run folder)`` of the demo's GRPO stage: the synchronous ``grpo`` recipe into
    ``grpo/``, or asynchronous GRPO (``grpo_async``, its ``demo`` config) into ``grpo_async/``.

    >>> grpo_recipe(False), grpo_recipe(True)
    (('grpo', 'grpo'), ('grpo_async', 'grpo_async'))
    """
    return ("grpo_async", GRPO_ASYNC_DIR) if asynchronous else ("grpo", GRPO_DIR)


def split_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(sft, grpo)`` overrides: ``sft.KEY=V`` goes to the warm-up as ``KEY=V``, ``grpo.KEY=V``
    and a plain ``KEY=V`` to GRPO (``~`` deletions alike). Keys the demo sets itself (the model
    folders, data files and output folders) are refused.

    Example::

        >>> split_overrides(["sft.epochs=5", "max_steps=100", "grpo.optimizer.lr=1e-3"])
        (['epochs=5'], ['max_steps=100', 'optimizer.lr=1e-3'])
    """
    runs: dict[str, list[str]] = {"SFT": [], "GRPO": []}
    for item in overrides:
        tilde = "~" if item.startswith("~") else ""
        body = item[len(tilde) :]
        run_name, own = ("SFT", _SFT_KEYS) if body.startswith("sft.") else ("GRPO", _GRPO_KEYS)
        body = body.removeprefix("sft.") if run_name == "SFT" else body.removeprefix("grpo.")
        if body.split("=", 1)[0] in own:
            raise ValueError(
                f"override {item!r}: the demo sets {', '.join(own)} of its {run_name} run "
                "itself (choose the folder with --output-dir)"
            )
        runs[run_name].append(tilde + body)
    sft, grpo = runs["SFT"], runs["GRPO"]
    return sft, grpo


def run_rl_demo(
    output_dir: str | os.PathLike[str] = "outputs/demo_rl",
    *,
    settings: RLDemoSettings | None = None,
    overrides: Sequence[str] = (),
    threads: int | None = None,
    verbose: bool = True,
    asynchronous: bool = False,
) -> RLDemoResult:
    """Build the files, warm up with SFT, score, train with GRPO, score again, plot.

    Args:
        output_dir: where the files (reused when present) and both runs (replaced) go.
        settings: seed and task size (default :class:`RLDemoSettings`); the seed is also each
            run's ``seed``.
        overrides: ``sft.KEY=V`` for the warm-up's config, ``KEY=V`` (or ``grpo.KEY=V``) for
            GRPO's (see :func:`split_overrides`), e.g. ``["max_steps=100"]``.
        threads: torch CPU threads during the demo (default: torch's current setting); the
            previous setting is restored at the end.
        verbose: print the progress and the summary.
        asynchronous: train GRPO with ``grpo_async`` (``overlap`` mode, Ray rollout and
            reward workers, config ``grpo_async/demo.yaml``) into ``output_dir/grpo_async``
            instead of ``grpo`` into ``output_dir/grpo``; the rest of the demo is the same.
    """
    settings = settings or RLDemoSettings()
    sft_overrides, grpo_overrides = split_overrides(overrides)  # before anything is built
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(
            Path(output_dir), settings, sft_overrides, grpo_overrides, verbose, asynchronous
        )
    finally:
        torch.set_num_threads(previous)


def _run(
    root: Path,
    settings: RLDemoSettings,
    sft_overrides: list[str],
    grpo_overrides: list[str],
    verbose: bool,
    asynchronous: bool,
) -> RLDemoResult:
    say = print if verbose else (lambda *a, **k: None)
    start = time.perf_counter()
    recipe, grpo_name = grpo_recipe(asynchronous)
    sft_dir, grpo_dir = root / SFT_DIR, root / grpo_name
    assets = DemoAssets.under(root)
    data_dir = assets.train_file.parent
    sft = [
        f"seed={settings.seed}",
        f"model_dir={assets.model_dir}",
        f"dataset.source={data_dir / DEMONSTRATIONS}",
        f"output_dir={sft_dir}",
        *sft_overrides,
    ]
    grpo = [f"seed={settings.seed}", f"prompts.source={data_dir / PROMPTS}",
            f"val_prompts.source={data_dir / HELD_OUT_PROMPTS}", f"output_dir={grpo_dir}",
            *grpo_overrides]  # fmt: skip
    # Both configs are checked before anything is built (the warm-up's checkpoint is a
    # stand-in until it exists).
    prepare_run("sft", WARMUP_CONFIG, sft, files=False)
    prepare_run(recipe, CONFIG, [f"model_dir={sft_dir / 'checkpoints'}", *grpo], files=False)
    built = is_built(root, settings.assets())
    say(f"[1/5] task (sort the letters), tokenizer and base model in {root}/")
    data = write_rl_data(root, settings)
    say(
        f"      {'reused' if built else 'built'}: {len(data.demonstrations)} demonstrations "
        f"(SFT), {settings.num_prompts} prompts with a verifier (RL), {len(data.held_out)} "
        "held-out prompts; base model: randomly initialised tiny Qwen2.5-style model"
    )

    say(f"[2/5] SFT warm-up on the demonstrations: tunesmith run sft --config {WARMUP_CONFIG}")
    warmup = run_to_checkpoint("sft", WARMUP_CONFIG, sft, sft_dir)

    # The GRPO config names the rewards and the held-out decoding settings.
    grpo = [f"model_dir={warmup}", *grpo]
    _, _, cfg = prepare_run(recipe, CONFIG, grpo)
    rewards = instantiate(cfg.rewards)
    held_out_prompts = instantiate(cfg.val_prompts)
    scoring = {"max_new_tokens": int(cfg.generation.max_new_tokens),
               "batch_size": RLSettings.from_config(cfg).eval_batch_size}  # fmt: skip
    tokenizer = Tokenizer.from_pretrained(warmup)
    demo_prompts = [
        Prompt(i, ex.prompt_messages(), ex.answer) for i, ex in enumerate(data.demonstrations)
    ]

    say("[3/5] accuracy of the SFT model (greedy answers, exact-match verifier)")
    model = from_hf(warmup)
    fit_acc, _ = greedy_accuracy(model, tokenizer, demo_prompts, rewards, **scoring)
    before, replies_before = greedy_accuracy(model, tokenizer, held_out_prompts, rewards, **scoring)
    del model
    say(
        f"      on its {len(demo_prompts)} demonstrations: {fit_acc:.1%}; "
        f"on {len(held_out_prompts)} held-out prompts: {before:.1%}"
    )

    say(f"[4/5] GRPO from the SFT checkpoint: tunesmith run {recipe} --config {CONFIG}")
    grpo_start = time.perf_counter()
    checkpoint = run_to_checkpoint(recipe, CONFIG, grpo, grpo_dir)
    grpo_seconds = time.perf_counter() - grpo_start

    say("[5/5] held-out accuracy of the GRPO checkpoint, reward curve")
    after, replies_after = greedy_accuracy(
        from_hf(checkpoint), tokenizer, held_out_prompts, rewards, **scoring
    )
    series = read_metrics(grpo_dir / "metrics.jsonl")
    curve = [(0, before), *series.get(f"val_reward/{ACCURACY_REWARD}", [])]
    plot = _plot_or_none(grpo_dir, before, say)

    result = RLDemoResult(
        accuracy_before=before,
        accuracy_after=after,
        accuracy_demonstrations=fit_acc,
        held_out=data.held_out,
        replies_before=replies_before,
        replies_after=replies_after,
        warmup_checkpoint=warmup,
        checkpoint=checkpoint,
        curve=curve,
        plot=plot,
        seconds=time.perf_counter() - start,
        recipe=recipe,
        grpo_seconds=grpo_seconds,
    )
    say(summary(result))
    return result


# ----------------------------------------------------------------------------- report


def plot_rewards(
    run_dir: str | os.PathLike[str],
    out_png: str | os.PathLike[str] | None = None,
    *,
    start: float | None = None,
    reward: str = ACCURACY_REWARD,
    window: int = 5,
) -> Path:
    """Draw a GRPO run's reward curves from ``run_dir/metrics.jsonl``; return the PNG path
    (default ``run_dir/rewards.png``).

    Top: held-out accuracy (``val_reward/<reward>``, greedy answers; ``start`` is drawn at
    step 0) and the exact-answer rate of the sampled answers (``reward/<reward>``); bottom:
    the mean total reward of the samples; both sample curves averaged over the last ``window``
    logged steps. Needs ``matplotlib`` (``pip install tunesmith[plot]``).

    Example::

        >>> from tunesmith.training import JSONLLogger
        >>> with JSONLLogger("outputs/demo_rl/grpo", timestamps=False) as logger:
        ...     for step in (1, 2):
        ...         logger.log(step, {"reward": 0.5 * step, "reward/correct": 0.4 * step,
        ...                           "val_reward/correct": 0.5})
        >>> plot_rewards("outputs/demo_rl/grpo", start=0.36)
        PosixPath('outputs/demo_rl/grpo/rewards.png')
    """
    run_dir = Path(run_dir)
    series = read_metrics(run_dir / "metrics.jsonl")
    held_out = list(series.get(f"val_reward/{reward}", []))
    if start is not None:
        held_out.insert(0, (0, start))
    sampled, total = series.get(f"reward/{reward}", []), series.get("reward", [])
    if not (held_out or sampled or total):
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no reward values (a GRPO run's)")
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plot_rewards needs matplotlib: pip install tunesmith[plot]  (or: pip install "
            "matplotlib)"
        ) from err

    fig = Figure(figsize=(8, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    if held_out:
        top.plot(*zip(*held_out), marker="o", markersize=4, label="held-out accuracy (greedy)")
    if sampled:
        top.plot(
            *zip(*_moving_mean(sampled, window)),
            alpha=0.6,
            label=f"exact answers among the samples (mean of {window} logs)",
        )
    top.set_ylabel("accuracy")
    top.set_ylim(0, 1)
    top.set_title(f"rewards of {run_dir}")
    top.grid(True, alpha=0.3)
    top.legend(loc="lower right")
    if total:
        bottom.plot(*zip(*_moving_mean(total, window)), color="tab:green")
    bottom.set_ylabel(f"reward (mean of {window} logs)")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)

    out = Path(out_png) if out_png is not None else run_dir / "rewards.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def _moving_mean(points: list[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """Each point's value replaced by the mean of it and the ``window - 1`` points before."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    values = [v for _, v in points]
    return [
        (step, sum(values[max(0, i - window + 1) : i + 1]) / min(i + 1, window))
        for i, (step, _) in enumerate(points)
    ]


def _plot_or_none(run_dir: Path, start: float, say: Any) -> Path | None:
    try:
        return plot_rewards(run_dir, start=start)
    except ImportError as e:  # the plot is optional; the numbers are printed anyway
        say(f"      no reward plot: {e}")
        return None


def summary(result: RLDemoResult, examples: int = 3) -> str:
    """The closing report: a few held-out replies, the accuracy curve, before/after, paths."""
    lines = ["", "held-out prompts -> reply after SFT | after GRPO:"]
    rows = zip(result.held_out, result.replies_before, result.replies_after)
    for ex, before, after in list(rows)[:examples]:
        lines.append(f"  sort {ex.letters:<8} -> {_shown(before):<16} | {_shown(after)}")
    curve = "  ".join(f"{step}: {acc:.0%}" for step, acc in result.curve)
    lines += [
        "",
        f"held-out accuracy during GRPO (step: accuracy): {curve}",
        f"held-out accuracy ({len(result.held_out)} prompts never trained on): "
        f"{result.accuracy_before:.1%} after SFT -> {result.accuracy_after:.1%} after GRPO "
        f"({100 * (result.accuracy_after - result.accuracy_before):+.1f} points)",
        f"checkpoint (Hugging Face folder): {result.checkpoint}",
        f"reward plot:                      {result.plot or 'not drawn (no matplotlib)'}",
        f"total time: {result.seconds:.0f} s ({result.recipe}: {result.grpo_seconds:.0f} s)",
    ]
    return "\n".join(lines)


def _shown(reply: str, width: int = 14) -> str:
    text = repr(reply)
    return text if len(text) <= width else text[: width - 3] + "..."
