"""``tunesmith demo``: fine-tune a tiny model on a generated task and show that it learned it.

Steps: build the local world (:func:`tunesmith.demo.assets.make_assets`), score the random base
model on held-out prompts with greedy batched generation, train with the SFT recipe through
the same code path as ``tunesmith run sft --config demo``, load the saved checkpoint with
``from_hf``, score it again, and plot the loss curve.

Example::

    result = run_demo("outputs/demo")
    result.accuracy_before, result.accuracy_after
    # -> (0.0, 0.99)
"""

from __future__ import annotations

import os
import shlex
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tunesmith.data import Tokenizer
from tunesmith.demo.assets import AssetSettings, DemoAssets, is_built, make_assets
from tunesmith.demo.task import COMMAND, MAX_LEN, Example, accuracy, read_jsonl
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.models import from_hf
from tunesmith.recipes import run
from tunesmith.training import CheckpointDirectory, plot_run
from tunesmith.training.logging.quiet import quiet_third_party

__all__ = [
    "CONFIG",
    "MAX_NEW_TOKENS",
    "RUN_DIR",
    "DemoResult",
    "evaluate",
    "generate_command",
    "run_demo",
    "summary",
    "train",
]

CONFIG = "demo"
"""The SFT config the demo trains with (``tunesmith/recipes/configs/sft/demo.yaml``)."""
RUN_DIR = "sft"
"""Sub-folder of the output folder for the training run (metrics, checkpoints, plot)."""
_OWN_KEYS = ("model_dir", "dataset.source", "output_dir")
MAX_NEW_TOKENS = MAX_LEN + 2
"""New tokens of a held-out answer: the longest answer and its end-of-turn token, one spare."""


@dataclass(frozen=True)
class DemoResult:
    """What :func:`run_demo` measured and wrote."""

    accuracy_before: float
    accuracy_after: float
    held_out: list[Example]
    replies_before: list[str]  # the base model's reply to each held-out prompt
    replies_after: list[str]  # the fine-tuned model's
    checkpoint: Path
    plot: Path
    seconds: float


def evaluate(
    model: nn.Module, tokenizer: Tokenizer, examples: Sequence[Example], batch_size: int = 200
) -> tuple[float, list[str]]:
    """Greedy replies of ``model`` to the held-out prompts, and their accuracy.

    Each prompt is the example's system and user turns rendered with the tokenizer's chat
    template plus the assistant header; decoding stops at an end-of-turn token.

    Example::

        >>> from tunesmith.demo.task import make_splits
        >>> assets = make_assets("demo", AssetSettings(num_train=100, num_held_out=4))
        >>> model, tok = from_hf(assets.model_dir), Tokenizer.from_pretrained(assets.tokenizer_dir)
        >>> acc, replies = evaluate(model, tok, make_splits(0, 4)[1])
        >>> acc, len(replies)  # an untrained model
        (0.0, 4)
    """
    model.eval()  # left in eval mode after (the engine restores the mode it finds)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    engine = LocalEngine(model, tokenizer, pad_id=pad_id)
    greedy = GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    replies: list[str] = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        prompts = [
            tokenizer.tokenize_conversation(ex.prompt_messages(), add_generation_prompt=True)[0]
            for ex in chunk
        ]
        out = generate_with(engine, prompts, None, greedy, tokenizer.stop_token_ids)
        replies += [tokenizer.decode(seq, skip_special_tokens=True) for seq in out.sequences]
    return accuracy(replies, examples), replies


def train(assets: DemoAssets, run_dir: Path, overrides: Sequence[str] = ()) -> Path:
    """Train with ``tunesmith.run("sft", "demo", ...)`` (what ``tunesmith run sft --config demo``
    does) pointed at ``assets``; return the checkpoint.

    ``run_dir`` is emptied first, so the metrics and checkpoints are this run's only. The
    demo sets ``model_dir``, ``dataset.source`` and ``output_dir`` itself; ``overrides`` may
    change anything else.
    """
    _check_overrides(overrides)
    own = [
        f"model_dir={assets.model_dir}",
        f"dataset.source={assets.train_file}",
        f"output_dir={run_dir}",
    ]
    return run_to_checkpoint("sft", CONFIG, [*own, *overrides], run_dir)


def run_to_checkpoint(recipe: str, config: str, overrides: Sequence[str], run_dir: Path) -> Path:
    """``tunesmith.run(recipe, config, overrides)`` in this process into ``run_dir`` (emptied
    first, so its metrics and checkpoints are this run's only); returns the last checkpoint.

    Example::

        run_to_checkpoint("sft", "demo", [f"output_dir={out}"], out)
    """
    shutil.rmtree(run_dir, ignore_errors=True)
    with quiet_third_party():  # as every recipe's run: library notices kept off the output
        run(recipe, config, list(overrides))  # load the config, validate it, run in-process
    checkpoint = CheckpointDirectory(run_dir / "checkpoints").latest()
    if checkpoint is None:
        raise RuntimeError(f"training finished without a checkpoint in {run_dir / 'checkpoints'}")
    return checkpoint


def run_demo(
    output_dir: str | os.PathLike[str] = "outputs/demo",
    *,
    settings: AssetSettings | None = None,
    overrides: Sequence[str] = (),
    threads: int | None = None,
    verbose: bool = True,
) -> DemoResult:
    """Build the assets, score the base model, fine-tune, score the checkpoint, plot.

    Args:
        output_dir: where the assets (reused when present) and the run (replaced) go.
        settings: task size, seed and model size (default :class:`AssetSettings`).
        overrides: extra ``key=value`` overrides of the ``demo`` SFT config
            (e.g. ``["max_steps=50"]``).
        threads: torch CPU threads during the demo (default: torch's current setting); the
            previous setting is restored at the end.
        verbose: print the progress and the summary.
    """
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(Path(output_dir), settings or AssetSettings(), overrides, verbose)
    finally:
        torch.set_num_threads(previous)


def _run(
    root: Path, settings: AssetSettings, overrides: Sequence[str], verbose: bool
) -> DemoResult:
    _check_overrides(overrides)  # before anything is built
    say = print if verbose else (lambda *a, **k: None)
    start = time.perf_counter()
    built = is_built(root, settings)
    say(f"[1/4] task (sort the letters), tokenizer and base model in {root}/")
    assets = make_assets(root, settings)
    held_out = read_jsonl(assets.held_out_file)
    tokenizer = Tokenizer.from_pretrained(assets.model_dir)
    say(
        f"      {'reused' if built else 'built'}: {settings.num_train} training / "
        f"{len(held_out)} held-out prompts; "
        f"tokenizer: {tokenizer.vocab_size} tokens; base model: randomly initialised tiny "
        "Qwen2.5-style model built by tunesmith"
    )

    say("[2/4] held-out accuracy of the base model")
    base = from_hf(assets.model_dir)
    say(f"      {sum(p.numel() for p in base.parameters()):,} parameters")
    before, replies_before = evaluate(base, tokenizer, held_out)
    del base
    say(f"      accuracy before: {before:.1%}")

    say(f"[3/4] fine-tuning: tunesmith run sft --config {CONFIG}")
    run_dir = root / RUN_DIR
    checkpoint = train(assets, run_dir, overrides)

    say("[4/4] held-out accuracy of the fine-tuned checkpoint")
    tuned = from_hf(checkpoint)
    after, replies_after = evaluate(tuned, tokenizer, held_out)
    plot = plot_run(run_dir)

    result = DemoResult(
        accuracy_before=before,
        accuracy_after=after,
        held_out=held_out,
        replies_before=replies_before,
        replies_after=replies_after,
        checkpoint=checkpoint,
        plot=plot,
        seconds=time.perf_counter() - start,
    )
    say(summary(result))
    return result


def _check_overrides(overrides: Sequence[str]) -> None:
    for item in overrides:
        if item.split("=", 1)[0].lstrip("~") in _OWN_KEYS:
            raise ValueError(
                f"override {item!r}: the demo sets {', '.join(_OWN_KEYS)} itself "
                "(choose the folder with --output-dir)"
            )


def summary(result: DemoResult, examples: int = 3) -> str:
    """The closing report of the demo: a few held-out replies, the accuracies, the paths."""
    lines = ["", "held-out prompts -> reply of the base model | of the fine-tuned model:"]
    for ex, before, after in list(
        zip(result.held_out, result.replies_before, result.replies_after)
    )[:examples]:
        lines.append(f"  {COMMAND} {ex.letters:<8} -> {_shown(before):<16} | {_shown(after)}")
    lines += [
        "",
        f"held-out accuracy ({len(result.held_out)} prompts never seen in training): "
        f"{result.accuracy_before:.1%} before -> {result.accuracy_after:.1%} after fine-tuning",
        f"checkpoint (Hugging Face folder): {result.checkpoint}",
        f"loss plot:                        {result.plot}",
        "the fine-tuned model's first answer above, again (the run folder means its newest "
        "checkpoint):",
        f"  {generate_command(result.checkpoint.parent.parent, result.held_out[0])}",
        f"total time: {result.seconds:.0f} s",
    ]
    return "\n".join(lines)


def generate_command(run_dir: str | os.PathLike[str], example: Example) -> str:
    """The ``tunesmith generate`` command that answers ``example`` as the demo scored it
    (greedy, the task's system prompt, :data:`MAX_NEW_TOKENS`), on the newest checkpoint of
    ``run_dir``.

    Example::

        >>> print(generate_command("outputs/demo/sft", Example("QZXAB")))
        tunesmith generate outputs/demo/sft --system 'sort the letters' --prompt 'sort QZXAB' --max-new-tokens 10
    """
    system, user = (m["content"] for m in example.prompt_messages())
    words = ["tunesmith", "generate", str(run_dir), "--system", system, "--prompt", user]
    return shlex.join([*words, "--max-new-tokens", str(MAX_NEW_TOKENS)])


def _shown(reply: str, width: int = 14) -> str:
    text = repr(reply)
    return text if len(text) <= width else text[: width - 3] + "..."
