"""Content hashes in checkpoint manifests: what they cost on a ~1 GB checkpoint.

Writes a real training checkpoint through ``Checkpointer.save`` (a random Llama-style model in
fp32 with its AdamW state: model.safetensors, the optimizer's .distcp file and rank0.pt, about
1.07 GB) into a temporary folder under ``--dir``, then measures, best of ``--repeat``:

1. ``Checkpointer.save`` as it runs (sizes + CRC-32 in the manifest) and with the hashing
   patched out (sizes only, the manifest before content hashes): the difference is the cost.
2. Hashing the files as ``commit`` does (``file_entries``: 4 threads, and 1 thread), files in
   the page cache (they were just written).
3. Verifying the checkpoint (``CheckpointDirectory.problem``: what resume and ``from_hf`` run),
   page cache warm, and cold (pages dropped with ``posix_fadvise(DONTNEED)``: read from disk).
4. Each candidate hash of the standard library on the same files, one thread, warm cache.

Usage::

    python benchmarks/checkpoint_hash.py                 # writes results/checkpoint_hash.md
    python benchmarks/checkpoint_hash.py --layers 1 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import platform
import ssl
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from sft_ladder import machine

from tunesmith.models.builder import build_model
from tunesmith.models.manifest import MARKER, file_entries
from tunesmith.models.spec import ModelSpec
from tunesmith.training.checkpoint import directory as checkpoint_dir
from tunesmith.training.checkpoint.checkpointer import Checkpointer
from tunesmith.training.checkpoint.directory import CheckpointDirectory
from tunesmith.training.parallel.distributed import close_distributed, init_distributed

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 8 << 20


def llama_spec(layers: int) -> ModelSpec:
    """Llama-style: 32k vocab, hidden 1024, untied head (~89M params with 2 layers)."""
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


def best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def stream(files: list[Path], update: Callable[[memoryview], None]) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                update(view[:n])


def checksum_fn(fn: Callable[[memoryview, int], int]) -> Callable[[list[Path]], None]:
    def run(files: list[Path]) -> None:
        state = [0]
        stream(files, lambda chunk: state.__setitem__(0, fn(chunk, state[0])))

    return run


def hashlib_fn(name: str) -> Callable[[list[Path]], None]:
    def run(files: list[Path]) -> None:
        for path in files:
            h = hashlib.new(name)
            stream([path], h.update)

    return run


CANDIDATES = {
    "zlib.crc32 (chosen)": checksum_fn(zlib.crc32),
    "zlib.adler32": checksum_fn(zlib.adler32),
    "hashlib.sha1": hashlib_fn("sha1"),
    "hashlib.sha256": hashlib_fn("sha256"),
    "hashlib.blake2b": hashlib_fn("blake2b"),
    "hashlib.md5": hashlib_fn("md5"),
}


def sizes_only(folder: Path, names, **_: object) -> dict:
    """The manifest before content hashes: sizes only."""
    return {rel: {"size": (folder / rel).stat().st_size} for rel in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (2: ~1.07 GB)")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a real disk)")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = parser.parse_args()

    ctx = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_model(llama_spec(args.layers), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # AdamW state exists: the checkpoint holds it
    n_params = sum(p.numel() for p in model.parameters())
    rows: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="tunesmith-hash-bench-", dir=args.dir) as tmp:
            root = Path(tmp) / "checkpoints"
            ckpt = Checkpointer(root, ctx, keep_last=1)
            step = iter(range(1, 1000))

            def save() -> Path:
                return ckpt.save(next(step), model, optimizer, {}, progress={"step": 0})

            hashed_s = best(save, args.repeat)
            original = checkpoint_dir.file_entries
            checkpoint_dir.file_entries = sizes_only
            try:
                sizes_s = best(save, args.repeat)
            finally:
                checkpoint_dir.file_entries = original
            path = save()
            files = files_of(path)
            names = [p.relative_to(path).as_posix() for p in files]
            sizes = {n: (path / n).stat().st_size for n in names}
            gb = sum(p.stat().st_size for p in files) / 1e9
            threads4 = best(lambda: file_entries(path, names), args.repeat)
            thread1 = best(lambda: file_entries(path, names, workers=1), args.repeat)
            warm = best(lambda: CheckpointDirectory.problem(path), args.repeat)

            def cold_verify() -> None:
                drop_cache(files)
                assert CheckpointDirectory.problem(path) is None

            cold = best(cold_verify, args.repeat)
            drop_cache(files)
            cold_read = best(
                lambda: (drop_cache(files), stream(files, lambda c: None)), args.repeat
            )
            stream(files, lambda c: None)  # warm again for the comparison
            compare = {
                name: best(lambda fn=fn: fn(files), args.repeat) for name, fn in CANDIDATES.items()
            }
    finally:
        close_distributed()

    rows.append("| what | seconds | GB/s | per GB |")
    rows.append("|---|---:|---:|---:|")

    def row(what: str, seconds: float) -> None:
        rows.append(f"| {what} | {seconds:.3f} | {gb / seconds:.2f} | {seconds / gb:.3f} s |")

    row("`Checkpointer.save`, sizes + CRC-32 manifest (as shipped)", hashed_s)
    row("`Checkpointer.save`, sizes-only manifest (hashing patched out)", sizes_s)
    rows.append(
        f"| **hashing cost in save** (difference) | {hashed_s - sizes_s:.3f} | | "
        f"{(hashed_s - sizes_s) / gb:.3f} s |"
    )
    row("hash the files as `commit` does (4 threads, warm cache)", threads4)
    row("hash the files, 1 thread (warm cache)", thread1)
    row("verify (`CheckpointDirectory.problem`), warm cache", warm)
    row("verify, cold cache (read from disk)", cold)
    row("only reading the files, cold cache (the disk's share)", cold_read)
    compare_rows = ["| hash (one thread, warm cache) | seconds | GB/s |", "|---|---:|---:|"]
    compare_rows += [f"| {name} | {s:.3f} | {gb / s:.2f} |" for name, s in compare.items()]

    big = [f"{n} {size / 1e6:.0f} MB" for n, size in sizes.items() if size >= 1e6]
    layout = ", ".join(big) + f" and {len(sizes) - len(big)} small files"
    today = datetime.date.today().isoformat()
    text = f"""# Checkpoint content hashes: the cost

`python benchmarks/checkpoint_hash.py` — a real training checkpoint written by
`Checkpointer.save`: a random Llama-style model ({n_params / 1e6:.0f}M parameters, fp32) with its
AdamW state, {gb:.2f} GB in {len(files)} files ({layout}). Best of {args.repeat}.

- Machine: {machine()}; Python {platform.python_version()}, torch {torch.__version__},
  {ssl.OPENSSL_VERSION}, zlib {zlib.ZLIB_RUNTIME_VERSION}; run {today}.
- Each checkpoint's `COMPLETE` manifest records every file's size and CRC-32; `commit` reads
  the files back (from the page cache: they were just written and fsynced) to hash them.
  Resume (`Checkpointer.start`, `CheckpointDirectory.latest`) and `from_hf` of our own
  checkpoints re-hash before loading; a cold read is bound by the disk, not the hash.

{chr(10).join(rows)}

Candidates for the content hash, the same {gb:.2f} GB:

{chr(10).join(compare_rows)}

CRC-32 is the fastest check in the standard library here and catches every accidental change
a size check misses (all bursts up to 32 bits, anything else with probability 1 - 2^-32); it is
not a defence against deliberate edits, which loading only safetensors and allow-listed pickles
handles. Times are the best of {args.repeat}; on a shared 2-vCPU VM other load inflates them
severalfold.
"""
    print(text)
    if not args.no_write:
        (RESULTS / "checkpoint_hash.md").write_text(text)


if __name__ == "__main__":
    main()
