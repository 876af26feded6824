"""Load time and peak memory of :func:`tunesmith.models.hf.from_hf` versus model size.

Writes a random Llama-style checkpoint (about 254M parameters, 1 GB in float32 by default)
into a temporary folder with :func:`save_hf_checkpoint`, sharded, then loads it in a fresh
interpreter per measurement and prints a markdown table: wall time of the load call and the
peak resident memory it added (``VmHWM`` - ``VmRSS`` before the call; the peak is reset right
before loading through ``/proc/self/clear_refs``), once right after loading and once after
every weight has been read (memory-mapped weights are only paged in when first used; the
"peak / model" ratio uses the latter). ``ru_maxrss`` is not used: Linux carries it
over ``exec`` from the parent, which here holds the whole model while writing it.

Rows: ours in the file's dtype (tensors stay memory-mapped), ours cast to bfloat16, a naive
loader (random-init the model, read every shard into one dict, ``load_state_dict``) and, if
installed, ``transformers.AutoModelForCausalLM.from_pretrained``. Files are read from the
page cache (they were just written): this measures the loader, not the disk.

Usage::

    python benchmarks/load_checkpoint.py                    # ~1 GB fp32, 500MB shards
    python benchmarks/load_checkpoint.py --layers 4 --shard-size 200MB --no-transformers
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tunesmith.models.builder import build_model
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.spec import ModelSpec

# Runs in a fresh interpreter: argv = folder, loader, dtype; prints one JSON line.
_CHILD = r"""
import gc, json, sys, time, torch

def status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024

folder, loader, dtype_name = sys.argv[1], sys.argv[2], sys.argv[3]
dtype = getattr(torch, dtype_name)
start = time.perf_counter()
torch.empty(1, device="meta") + 1  # torch's one-time meta-kernel setup, paid by every loader
warmup_s = time.perf_counter() - start
if loader == "tunesmith":
    from tunesmith.models.hf import from_hf
    load = lambda: from_hf(folder, dtype=dtype)
elif loader == "naive":
    import glob
    from safetensors.torch import load_file
    from tunesmith.models.builder import build_model
    from tunesmith.models.hf import spec_from_hf_folder

    def load():
        model = build_model(spec_from_hf_folder(folder), dtype=dtype)
        state = {}
        for path in sorted(glob.glob(folder + "/*.safetensors")):
            state.update(load_file(path))
        model.load_state_dict(state)
        return model
else:
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    load = lambda: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS
before = status_mb("VmRSS")
start = time.perf_counter()
model = load()
seconds = time.perf_counter() - start
peak = status_mb("VmHWM")
params = {id(p): p for p in model.parameters()}
model_mb = sum(p.numel() * p.element_size() for p in params.values()) / 2**20
with torch.no_grad():  # first use: memory-mapped weights are paged in only now
    for p in params.values():
        p.float().sum()
peak_used = status_mb("VmHWM")
print(json.dumps({"seconds": seconds, "peak_added_mb": peak - before, "model_mb": model_mb,
                  "peak_used_mb": peak_used - before, "baseline_mb": before,
                  "warmup_s": warmup_s}))
"""


def llama_spec(layers: int) -> ModelSpec:
    """Llama-style: 32k vocab, hidden 1024, GQA 16/8 heads, untied head (~11.8M per layer)."""
    return ModelSpec(
        model_type="llama",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        bos_token_id=1,
        eos_token_id=2,
    )


def measure(folder: Path, loader: str, dtype: str) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), loader, dtype],
        capture_output=True,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    if result.returncode != 0:
        raise RuntimeError(f"{loader} ({dtype}) failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="decoder layers (16: ~254M params)")
    parser.add_argument("--shard-size", default="500MB", help="max_shard_size when saving")
    parser.add_argument("--no-transformers", action="store_true", help="skip the HF row")
    parser.add_argument("--no-naive", action="store_true", help="skip the naive-loader row")
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("needs Linux (/proc/self/status and /proc/self/clear_refs)")

    spec = llama_spec(args.layers)
    with tempfile.TemporaryDirectory(prefix="tunesmith-load-bench-") as tmp:
        folder = Path(tmp) / "ckpt"
        start = time.perf_counter()
        torch.manual_seed(0)
        model = build_model(spec, dtype=torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        save_hf_checkpoint(model, folder, max_shard_size=args.shard_size)
        del model
        write_s = time.perf_counter() - start
        files = sorted(folder.glob("*.safetensors"))
        disk_mb = sum(p.stat().st_size for p in files) / 2**20
        print(
            f"checkpoint: {n_params / 1e6:.0f}M params, {disk_mb:.0f} MB float32 in "
            f"{len(files)} shard(s) of <= {args.shard_size} (built + written in {write_s:.1f} s)\n"
        )
        runs = [("tunesmith from_hf", "tunesmith", "float32")]
        runs.append(("tunesmith from_hf", "tunesmith", "bfloat16"))
        if not args.no_naive:
            runs.append(("naive: init + load_file + load_state_dict", "naive", "bfloat16"))
        if not args.no_transformers:
            try:
                import transformers  # noqa: F401
            except ImportError:
                print("(transformers not installed: no transformers row)")
            else:
                runs.append(("transformers from_pretrained", "transformers", "float32"))
                runs.append(("transformers from_pretrained", "transformers", "bfloat16"))
        print(
            "| loader | dtype | load s | peak RSS added MB: load | ... + read all weights "
            "| model MB | peak / model |"
        )
        print("|---|---|---:|---:|---:|---:|---:|")
        warmups = []
        for label, loader, dtype in runs:
            r = measure(folder, loader, dtype)
            warmups.append(r["warmup_s"])
            print(
                f"| {label} | {dtype} | {r['seconds']:.2f} | {r['peak_added_mb']:.0f} | "
                f"{r['peak_used_mb']:.0f} | {r['model_mb']:.0f} | "
                f"{r['peak_used_mb'] / r['model_mb']:.2f} |",
                flush=True,
            )
        print(
            f"\nNot in the times: interpreter + imports, and torch's one-time meta-kernel setup "
            f"({min(warmups):.1f}-{max(warmups):.1f} s) done before each load. "
            f"torch {torch.__version__}, {os.cpu_count()} CPU(s), files in the page cache."
        )


if __name__ == "__main__":
    main()
