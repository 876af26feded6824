"""GGUF export: logits of the file (read back by transformers' GGUF loader) against ours, file
sizes and export time, for every exported family and out type.

Each family is a random model of ``--hidden`` (4 layers, 8 heads, 4 KV heads) with a
byte-level BPE tokenizer of the family's kind (the test suite's tokenizer factory), written
with :func:`tunesmith.models.gguf_export.export_gguf` and loaded by
``transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` in float32.
Logits: 4 rows of 64 random ids; the max and the mean |difference| against our float32 model,
and their ratio to the logits' own standard deviation. Writes ``results/gguf_export.md``.

Usage::

    PYTHONPATH=. python benchmarks/gguf_export.py
    PYTHONPATH=. python benchmarks/gguf_export.py --hidden 256 --out /tmp/gguf_export.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import transformers  # noqa: E402
from machine_info import command_line, machine  # noqa: E402

from tests.data.tokenizer_factory import make_tokenizer_folder  # noqa: E402
from tunesmith.data import Tokenizer  # noqa: E402
from tunesmith.models import build_model  # noqa: E402
from tunesmith.models.gguf_export import OUTTYPES, export_gguf  # noqa: E402
from tunesmith.models.hf import from_hf, save_hf_checkpoint  # noqa: E402
from tunesmith.models.zoo import llama3, qwen2_5, qwen3, qwen3_moe  # noqa: E402

# family -> (zoo module, tokenizer family, spec overrides): transformers' GGUF reader takes
# Qwen3's head_dim from its config class (128) and reads no RoPE scaling
FAMILIES = {
    "llama": (llama3, "llama3", {"rope_scaling": None}),
    "qwen2": (qwen2_5, "qwen2_5", {}),
    "qwen3": (qwen3, "qwen3", {"head_dim": 128}),
    "qwen3_moe": (qwen3_moe, "qwen3", {"head_dim": 128, "moe_intermediate_size": 768,
                                       "mlp_only_layers": (), "norm_topk_prob": True}),
}  # fmt: skip
DEFAULTS = {"hidden": 512, "out": str(REPO / "benchmarks" / "results" / "gguf_export.md")}


def model_folder(root: Path, family: str, hidden: int) -> Path:
    zoo, tokenizer_family, overrides = FAMILIES[family]
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", tokenizer_family)
    sizes = {
        "vocab_size": Tokenizer.from_pretrained(tokenizer_dir).vocab_size,
        "hidden_size": hidden, "intermediate_size": hidden * 3, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": hidden // 8,
    }  # fmt: skip
    torch.manual_seed(0)
    name = f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny"
    model = build_model(zoo.spec(name, **{**sizes, **overrides}))
    return save_hf_checkpoint(model, root / "model", source_dir=tokenizer_dir)


def measure(folder: Path, outtype: str, ids: torch.Tensor) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = export_gguf(folder, Path(tmp) / "model.gguf", outtype=outtype)
        seconds = time.perf_counter() - start
        size = path.stat().st_size
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, gguf_file=path.name, dtype=torch.float32
        )
        ours = from_hf(folder, dtype=torch.float32)
        with torch.no_grad():
            a, b = theirs(ids).logits, ours(ids)
    gap = (a - b).abs()
    scale = b.std().item()
    return {"size_mb": size / 2**20, "export_s": seconds, "max": gap.max().item(),
            "mean": gap.mean().item(), "max_rel": gap.max().item() / scale}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    parser.add_argument("--out", default=DEFAULTS["out"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            folder = model_folder(Path(tmp) / family, family, args.hidden)
            vocab = from_hf(folder).spec.vocab_size
            ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
            params = sum(p.numel() for p in from_hf(folder).parameters())
            for outtype in OUTTYPES:
                result = measure(folder, outtype, ids)
                rows.append((family, params, outtype, result))
                print(family, outtype, result, flush=True)
    lines = [
        "# GGUF export: read back by transformers against ours",
        "",
        f"`{command_line('benchmarks/gguf_export.py', args, DEFAULTS, skip=['out'])}`",
        "",
        f"- Machine: {machine()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, gguf {importlib.metadata.version('gguf')}; "
        f"run {time.strftime('%Y-%m-%d')}.",
        f"- Models: random, hidden {args.hidden}, 4 layers, 8 heads / 4 KV heads, the family's "
        "byte-level BPE tokenizer of the test suite (vocabulary ~640); Qwen3 at head_dim 128 "
        "(transformers' GGUF reader takes it from its config class), Llama without RoPE "
        "scaling (the reader ignores `rope_freqs`); Qwen3-MoE: 8 experts of 768 (the reader's "
        "default width), top 2 renormalised, every layer sparse.",
        "- Logits: 4 rows of 64 random ids, our float32 model against transformers' model of "
        "the file (dequantised to float32); `max / std`: the max difference over the "
        "standard deviation of our logits. In the mixture of experts a rounding that moves a "
        "token's router scores across a top-k tie sends it to another expert: its logits then "
        "differ by a whole expert's contribution (the max), while the mean stays near the dense "
        "families'.",
        "",
        "| family | parameters | outtype | file MiB | export s | max \\|Δ logit\\| "
        "| mean \\|Δ logit\\| | max / std |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for family, params, outtype, r in rows:
        lines.append(
            f"| {family} | {params:,} | {outtype} | {r['size_mb']:.2f} | {r['export_s']:.2f} "
            f"| {r['max']:.2e} | {r['mean']:.2e} | {r['max_rel']:.2e} |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
