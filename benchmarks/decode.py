"""Decode throughput of :func:`tunesmith.generation.generate`, with and without KV cache.

Builds a small random Llama-style model (about 28M parameters by default) and times greedy
decoding of ``--new-tokens`` tokens (no stop tokens, so every row decodes all of them) for
each batch size, printing a markdown table.

Usage::

    python benchmarks/decode.py                          # CPU, batch 1 and 8, 128 new tokens
    python benchmarks/decode.py --device cuda --dtype bfloat16 --batch-sizes 1 8 64
"""

from __future__ import annotations

import argparse
import time

import torch

from tunesmith.generation import generate
from tunesmith.models import build_model
from tunesmith.models.spec import spec_from_hf_config

SMALL_LLAMA = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(
    model: torch.nn.Module,
    batch_size: int,
    prompt_len: int,
    new_tokens: int,
    use_cache: bool,
    device: torch.device,
) -> float:
    """Seconds to decode ``new_tokens`` tokens for ``batch_size`` random prompts."""
    gen = torch.Generator().manual_seed(batch_size)
    vocab = model.spec.vocab_size
    # Unequal prompt lengths (left padding) as in real batched use.
    prompts = [
        torch.randint(2, vocab, (prompt_len - (i % 4),), generator=gen).tolist()
        for i in range(batch_size)
    ]
    generate(model, prompts, max_new_tokens=4, use_cache=use_cache)  # warm-up
    _sync(device)
    start = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=new_tokens, use_cache=use_cache)
    _sync(device)
    elapsed = time.perf_counter() - start
    assert all(len(s) == new_tokens for s in out.sequences)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-baseline", action="store_true", help="skip the no-cache runs")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = build_model(spec_from_hf_config(SMALL_LLAMA), device=device, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())

    print(
        f"model: llama-style, {n_params / 1e6:.1f}M params, {args.dtype} on {device} "
        f"({torch.get_num_threads()} CPU threads); prompt ~{args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens, greedy\n"
    )
    print("| batch | KV cache | time (s) | tokens/s | speed-up |")
    print("|------:|:--------:|---------:|---------:|---------:|")
    for batch in args.batch_sizes:
        cached = time_decode(model, batch, args.prompt_len, args.new_tokens, True, device)
        tokens = batch * args.new_tokens
        if args.no_baseline:
            print(f"| {batch} | yes | {cached:.2f} | {tokens / cached:.1f} | |")
            continue
        plain = time_decode(model, batch, args.prompt_len, args.new_tokens, False, device)
        print(f"| {batch} | yes | {cached:.2f} | {tokens / cached:.1f} | {plain / cached:.1f}x |")
        print(f"| {batch} | no | {plain:.2f} | {tokens / plain:.1f} | 1.0x |")


if __name__ == "__main__":
    main()
