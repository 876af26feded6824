"""Quantization-aware training against post-training quantization on the demo task.

The demo's world (:mod:`tunesmith.demo`: a generated command task, its tokenizer, a random
2-layer base model of hidden 128) trained twice with the demo's SFT config and the same steps:
plain (float32), and with ``quantization.qat`` (the scheme below, from step 1). Measured on the
200 held-out examples:

- greedy accuracy (the demo's own scoring) of the float model, of the float model quantized
  after training (PTQ, torchao, :func:`tunesmith.modules.fake_quant.quantize`), and of the QAT
  run's model quantized the same way (what it trained for);
- perplexity of the held-out answers (the assistant tokens of each conversation, teacher
  forced), for the same three models;
- training tokens/s of both runs (tokens seen / elapsed at the last step, first step included),
  the QAT step's overhead;
- the exported folder sizes: the float Hugging Face folder, and ``tunesmith export
  --quantize``'s torchao folder.

Writes ``results/qat.md``.

Usage::

    PYTHONPATH=. python benchmarks/qat.py                          # int8da-int4w, groups of 32
    PYTHONPATH=. python benchmarks/qat.py --scheme int4w --steps 250
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

from tunesmith.data import Tokenizer  # noqa: E402
from tunesmith.demo.assets import AssetSettings, make_assets  # noqa: E402
from tunesmith.demo.run import evaluate, train  # noqa: E402
from tunesmith.demo.task import read_jsonl  # noqa: E402
from tunesmith.models import from_hf  # noqa: E402
from tunesmith.models.export import export_merged, export_quantized  # noqa: E402
from tunesmith.modules.fake_quant import QAT_SCHEMES, quantize  # noqa: E402

DEFAULTS = {"scheme": "int8da-int4w", "group_size": 32, "steps": 250,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=QAT_SCHEMES, default=DEFAULTS["scheme"])
    parser.add_argument("--group-size", type=int, default=DEFAULTS["group_size"])
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--out", default=DEFAULTS["out"])
    args = parser.parse_args()
    torch.set_num_threads(2)
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        assets = make_assets(root / "world", AssetSettings())
        tokenizer = Tokenizer.from_pretrained(assets.tokenizer_dir)
        held_out = read_jsonl(assets.held_out_file)
        steps = [f"max_steps={args.steps}", "save_every_minutes=null"]
        qat = (f"quantization={{qat: {{scheme: {args.scheme}, group_size: {args.group_size}, "
               "fake_quant_after_n_steps: 0}}")  # fmt: skip
        float_ckpt = train(assets, root / "float", steps)
        qat_ckpt = train(assets, root / "qat", [*steps, qat])
        speeds = {"float": tokens_per_s(root / "float"), "qat": tokens_per_s(root / "qat")}

        trained = from_hf(float_ckpt, dtype=torch.float32)
        models = {
            "float32": trained,
            f"PTQ {args.scheme}": quantize(copy.deepcopy(trained), args.scheme, args.group_size),
            f"QAT {args.scheme}": quantize(
                from_hf(qat_ckpt, dtype=torch.float32), args.scheme, args.group_size
            ),
        }
        rows = {}
        for name, model in models.items():
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
    ptq_loss = rows["float32"][0] - rows[f"PTQ {args.scheme}"][0]
    qat_loss = rows["float32"][0] - rows[f"QAT {args.scheme}"][0]
    lines = [
        "# Quantization-aware training against post-training quantization (demo task)",
        "",
        f"`{command_line('benchmarks/qat.py', args, DEFAULTS, skip=['out'])}` ({minutes:.1f} min)",
        "",
        f"- Machine: {machine()}; torch {torch.__version__}, torchao "
        f"{__import__('torchao').__version__}; 2 threads; run {time.strftime('%Y-%m-%d')}.",
        f"- Task: the demo's (`tunesmith demo`), {len(held_out)} held-out examples, greedy "
        f"replies scored by the demo; both runs: the demo's SFT config (`sft/demo`), "
        f"{args.steps} steps of 32 rows, the same seed; the QAT run with "
        f"`quantization.qat.scheme: {args.scheme}`, `group_size: {args.group_size}` from its "
        "first step. Every linear layer but `lm_head` quantized (torchao), embeddings and the "
        "output head float.",
        "",
        "| model | held-out accuracy | held-out perplexity |",
        "|---|---:|---:|",
        *[f"| {name} | {acc:.3f} | {ppl:.3f} |" for name, (acc, ppl) in rows.items()],
        "",
        f"Accuracy lost to quantization: PTQ {ptq_loss:+.3f}, QAT {qat_loss:+.3f}; "
        + (
            f"QAT recovers {100 * (1 - qat_loss / ptq_loss):.0f}% of PTQ's loss."
            if ptq_loss > 0
            else f"PTQ lost nothing here ({args.scheme}, groups of {args.group_size}, on a model "
            "this size and task), so there is no loss for QAT to recover."
        ),
        "",
        "| run | training tokens/s |",
        "|---|---:|",
        f"| float32 | {speeds['float']:.0f} |",
        f"| QAT {args.scheme} | {speeds['qat']:.0f} ({speeds['qat'] / speeds['float']:.2f}x) |",
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
