"""Quantization-aware training against post-training quantization on a task where int4 hurts.

The task (``--task``, :mod:`qat_task`): ``sort8-outliers`` (default): the demo's letter sorting
with every string 8 letters long, 4000 training and 500 held-out strings, on the demo's
tokenizer and random 2-layer base model of hidden 128 given outlier weights (one in 64 of each
decoder linear layer set to +-0.3, as pretrained LLMs have outliers: this is what int4 groups
round badly), trained for 100 steps; ``sort8``: the same without the outliers (int4 costs under
0.01 of accuracy, ``results/qat_sort8.md``); ``demo``: the demo's own world
(:mod:`tunesmith.demo`, strings of 3 to 8 letters, 200 held-out), where int4 loses nothing.
The model is trained twice with the demo's SFT config and the same steps: plain
(float32), and with ``quantization.qat`` (the scheme below, from step 1). Measured on the
held-out examples:

- greedy accuracy (the demo's own scoring) of the float model, of the float model quantized
  after training (PTQ, torchao, :func:`tunesmith.modules.fake_quant.quantize`) with each int4
  scheme, and of the QAT run's model quantized with its scheme (what it trained for);
- perplexity of the held-out answers (the assistant tokens of each conversation, teacher
  forced), for the same models;
- training tokens/s of both runs (tokens seen / elapsed at the last step, first step included),
  and the QAT step's overhead: plain and QAT steps alternated on one batch
  (:func:`step_seconds`), which a shared machine's load slows alike;
- the exported folder sizes: the float Hugging Face folder, and ``tunesmith export
  --quantize``'s torchao folder.

Writes ``results/qat.md``.

Usage::

    PYTHONPATH=. python benchmarks/qat.py             # sort8-outliers, int8da-int4w, groups of 32
    PYTHONPATH=. python benchmarks/qat.py --task sort8 --out benchmarks/results/qat_sort8.md
    PYTHONPATH=. python benchmarks/qat.py --task demo --steps 250 --out /tmp/qat_demo.md
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import command_line, machine  # noqa: E402
from qat_task import TaskSettings, make_task  # noqa: E402

from tunesmith.data import Tokenizer  # noqa: E402
from tunesmith.demo.assets import AssetSettings, make_assets  # noqa: E402
from tunesmith.demo.run import evaluate, train  # noqa: E402
from tunesmith.demo.task import read_jsonl  # noqa: E402
from tunesmith.models import from_hf  # noqa: E402
from tunesmith.models.export import export_merged, export_quantized  # noqa: E402
from tunesmith.modules.fake_quant import QAT_SCHEMES, prepare_fake_quant, quantize  # noqa: E402

TASKS = {
    "sort8-outliers": "the demo's letter sorting with every string 8 letters long, the base model "
    "with outlier weights (one in 64 weights of each decoder linear layer set to +-0.3, where "
    "trained weights have a standard deviation near 0.035; `benchmarks/qat_task.py`)",
    "sort8": "the demo's letter sorting with every string 8 letters long (`benchmarks/qat_task.py`)",
    "demo": "the demo's (`tunesmith demo`), strings of 3 to 8 letters",
}
INT4_SCHEMES = ("int8da-int4w", "int4w")
TIMED_STEPS = 20  # steps of each kind in the interleaved timing
DEFAULTS = {"task": "sort8-outliers", "scheme": "int8da-int4w", "group_size": 32, "steps": 100,
            "out": str(REPO / "benchmarks" / "results" / "qat.md")}  # fmt: skip


def perplexity(model: torch.nn.Module, tokenizer: Tokenizer, examples) -> float:
    """exp(mean NLL) of the held-out answers' tokens (assistant mask), teacher forced."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for ex in examples:
            ids, mask = tokenizer.tokenize_conversation(ex.messages())
            x = torch.tensor([ids])
            out = model(x)
            logits = out.logits if hasattr(out, "logits") else out
            logp = logits[0, :-1].float().log_softmax(-1)
            target = torch.tensor(ids[1:])
            trained = torch.tensor(mask[1:], dtype=torch.bool)
            nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[trained]
            total, count = total + nll.sum().item(), count + int(trained.sum())
    return float(torch.tensor(total / count).exp())


def tokens_per_s(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "tokens_seen" in r and "elapsed_s" in r][-1]
    return last["tokens_seen"] / last["elapsed_s"]


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def step_seconds(model_dir: Path, tokenizer: Tokenizer, examples, scheme: str, group: int):
    """Median seconds of a plain and of a QAT training step (forward, cross-entropy, backward,
    AdamW) on the same batch of 32 rows, the two kinds alternated step by step so that the
    load of a shared machine falls on both alike.

    Example::

        plain, qat = step_seconds(assets.model_dir, tokenizer, held_out, "int4w", 32)
    """
    rows = [tokenizer.tokenize_conversation(ex.messages())[0] for ex in examples[:32]]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_id or 0] * (width - len(r)) for r in rows])
    plain = from_hf(model_dir, dtype=torch.float32)
    models = {"plain": plain, "qat": prepare_fake_quant(copy.deepcopy(plain), scheme, group)}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(TIMED_STEPS + 1):  # the first of each kind is a warm-up, dropped below
        for kind, model in models.items():
            begin = time.perf_counter()
            logits = model(ids[:, :-1])
            logits = logits.logits if hasattr(logits, "logits") else logits
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            optimizers[kind].step()
            optimizers[kind].zero_grad()
            times[kind].append(time.perf_counter() - begin)
    return tuple(float(torch.tensor(times[k][1:]).median()) for k in models)


def build_task(name: str, root: Path):
    """The task's files under ``root`` and its held-out examples."""
    if name == "demo":
        assets = make_assets(root, AssetSettings())
        return assets, read_jsonl(assets.held_out_file)
    return make_task(root, TaskSettings(outlier=0.3 if name == "sort8-outliers" else 0.0))


def scheme_models(trained, qat_ckpt: Path, scheme: str, group_size: int) -> dict:
    """The models scored: float, PTQ with each int4 scheme (``scheme`` first), and the QAT
    run's model quantized with ``scheme``."""
    ptq = [scheme, *(s for s in INT4_SCHEMES if s != scheme)]
    return {
        "float32": trained,
        **{f"PTQ {s}": quantize(copy.deepcopy(trained), s, group_size) for s in ptq},
        f"QAT {scheme}": quantize(from_hf(qat_ckpt, dtype=torch.float32), scheme, group_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=list(TASKS), default=DEFAULTS["task"])
    parser.add_argument("--scheme", choices=QAT_SCHEMES, default=DEFAULTS["scheme"])
    parser.add_argument("--group-size", type=int, default=DEFAULTS["group_size"])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--out", default=DEFAULTS["out"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets, held_out = build_task(args.task, root / "world")
        tokenizer = Tokenizer.from_pretrained(assets.tokenizer_dir)
        steps = [f"max_steps={args.steps}", "save_every_minutes=null"]
        qat = (f"quantization={{qat: {{scheme: {args.scheme}, group_size: {args.group_size}, "
               "fake_quant_after_n_steps: 0}}")  # fmt: skip
        float_ckpt = train(assets, root / "float", steps)
        qat_ckpt = train(assets, root / "qat", [*steps, qat])
        speeds = {"float": tokens_per_s(root / "float"), "qat": tokens_per_s(root / "qat")}
        steps_s = step_seconds(assets.model_dir, tokenizer, held_out, args.scheme, args.group_size)

        trained = from_hf(float_ckpt, dtype=torch.float32)
        rows = {}
        for name, model in scheme_models(trained, qat_ckpt, args.scheme, args.group_size).items():
            acc, _ = evaluate(model, tokenizer, held_out)
            rows[name] = (acc, perplexity(model, tokenizer, held_out))
            print(name, rows[name], flush=True)
        float_mb = folder_mb(export_merged(float_ckpt, root / "exp_float"))
        quant_mb = folder_mb(
            export_quantized(
                qat_ckpt, root / "exp_q", scheme=args.scheme, group_size=args.group_size
            )  # fmt: skip
        )
    minutes = (time.time() - start) / 60
    write_report(args, rows, (speeds, steps_s), (float_mb, quant_mb), len(held_out), minutes)


def recovery(rows: dict, scheme: str, examples: int) -> str:
    """The sentence on what PTQ lost and how much of it QAT won back, with the standard error
    of the float model's accuracy on ``examples`` held-out examples.

    >>> print(recovery({"float32": (0.9, 1), "PTQ x": (0.5, 2), "QAT x": (0.8, 1)}, "x", 100))
    Accuracy lost to quantization: PTQ +0.400, QAT +0.100 (standard error of an accuracy on 100 examples: 0.030); QAT recovers 75% of PTQ's loss.
    >>> recovery({"float32": (0.9, 1), "PTQ x": (0.89, 1), "QAT x": (0.9, 1)}, "x", 100)[-57:]
    'within one standard error: nothing measurable to recover.'
    """
    accuracy = rows["float32"][0]
    ptq_loss = accuracy - rows[f"PTQ {scheme}"][0]
    qat_loss = accuracy - rows[f"QAT {scheme}"][0]
    error = (accuracy * (1 - accuracy) / examples) ** 0.5
    lost = (
        f"Accuracy lost to quantization: PTQ {ptq_loss:+.3f}, QAT {qat_loss:+.3f} (standard "
        f"error of an accuracy on {examples} examples: {error:.3f}); "
    )
    if ptq_loss > error:
        return lost + f"QAT recovers {100 * (1 - qat_loss / ptq_loss):.0f}% of PTQ's loss."
    return lost + "PTQ's loss is within one standard error: nothing measurable to recover."


def write_report(args, rows: dict, timings: tuple, sizes: tuple, held_out: int, minutes: float):
    (speeds, (plain_s, qat_s)), (float_mb, quant_mb) = timings, sizes
    lines = [
        f"# Quantization-aware training against post-training quantization ({args.task} task)",
        "",
        f"`{command_line('benchmarks/qat.py', args, DEFAULTS, skip=['out'])}` ({minutes:.1f} min)",
        "",
        f"- Machine: {machine()}; torch {torch.__version__}, torchao "
        f"{__import__('torchao').__version__}; 2 threads; run {time.strftime('%Y-%m-%d')}.",
        f"- Task: {TASKS[args.task]}, {held_out} held-out examples, greedy replies scored by "
        "the demo (exact match); the demo's random 2-layer base model of hidden 128; both runs: "
        f"the demo's SFT config (`sft/demo`), {args.steps} steps of 32 rows, the same seed; the "
        f"QAT run with `quantization.qat.scheme: {args.scheme}`, `group_size: "
        f"{args.group_size}` from its first step. PTQ: the float run's model quantized after "
        f"training, groups of {args.group_size}. Every linear layer but `lm_head` quantized "
        "(torchao), embeddings and the output head float.",
        "",
        "| model | held-out accuracy | held-out perplexity |",
        "|---|---:|---:|",
        *[f"| {name} | {acc:.3f} | {ppl:.3f} |" for name, (acc, ppl) in rows.items()],
        "",
        recovery(rows, args.scheme, held_out),
        "",
        f"| training speed | float32 | QAT {args.scheme} | QAT / float32 |",
        "|---|---:|---:|---:|",
        f"| the two runs above, tokens/s | {speeds['float']:.0f} | {speeds['qat']:.0f} | "
        f"{speeds['qat'] / speeds['float']:.2f}x |",
        f"| alternated steps, batch of 32, median s/step of {TIMED_STEPS} | {plain_s:.3f} | "
        f"{qat_s:.3f} | {plain_s / qat_s:.2f}x speed |",
        "",
        "The two runs ran one after the other on a machine shared with other jobs, so their "
        "tokens/s carry the load of the moment; the alternated steps (a plain and a QAT step "
        "in turn on one batch, plain cross-entropy) share it and give the QAT step's overhead.",
        "",
        f"Exported folders: float32 Hugging Face {float_mb:.2f} MiB; torchao {args.scheme} "
        f"(`tunesmith export --quantize`) {quant_mb:.2f} MiB ({quant_mb / float_mb:.2f}x; the "
        "embeddings and `lm_head` stay float32, and torchao's `UNPACKED_TO_INT8` layout keeps "
        "one int4 value per byte).",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
