"""Packed vs padded SFT steps on variable-length data: real (non-pad) tokens per second.

The documents are a seeded sample of an alpaca-like length distribution (log-normal token
counts, median 140, sigma 0.75, clipped to 16..1024: :func:`packed_attention.alpaca_like_lengths`,
the distribution ``benchmarks/packed_attention.py`` uses), random token ids, the first 30-60%
of each document an untrained prompt. Every document is trained once per round, two ways:

* ``padded, batch B``: micro-batches of B documents (each of ``--batch``) in a shuffled order
  (what the recipe draws with ``packed: false``), each right-padded to its longest document
  (``collate_padded``; attention: SDPA with the padding mask);
* ``packed``: the same documents packed whole into rows of ``--row`` tokens (``pack_greedy``,
  ``collate_packed``: what ``packed: true`` does), ``--rows`` rows per step; attention: the
  ``varlen`` backend the model picks for packed rows on CPU (one causal SDPA per length bucket
  of documents, so its work follows the documents, not the row length).

One step is what the SFT recipe runs per micro-batch with the shipped settings: forward to the
final hidden states, ``LinearCrossEntropyLoss`` summed over the trained tokens divided by their
count, backward, and torch's fused AdamW step, on a random Llama-shaped model (float32).
AdamW's learning rate is 0, so the weights never change and both ways' summed loss over all
documents can be compared in every round: the script stops unless the loss per trained token
of the packed way equals the padded way's (relative 1e-5).

The ways take turns for ``--rounds`` rounds after a warm-up step each; the table reports real
tokens per second by the wall clock and by process CPU time (per thread: a busy machine
barely moves it), per round and over all rounds.

Usage::

    python benchmarks/packing.py                      # writes benchmarks/results/packing.md
    python benchmarks/packing.py --docs 32 --rounds 1 --layers 2 --no-write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

from machine_info import machine  # noqa: E402
from packed_attention import alpaca_like_lengths  # noqa: E402

from tunesmith.data.collate import collate_packed, collate_padded  # noqa: E402
from tunesmith.data.labels import IGNORE_INDEX, make_labels  # noqa: E402
from tunesmith.data.packing import pack_greedy  # noqa: E402
from tunesmith.models import build_model  # noqa: E402
from tunesmith.models.spec import spec_from_hf_config  # noqa: E402
from tunesmith.modules.attention_backends import resolve_attention_backend  # noqa: E402
from tunesmith.modules.losses import LinearCrossEntropyLoss  # noqa: E402
from tunesmith.training.forward import forward_batch, head_weight  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "packing.md"
PAD = 0


def model_config(args: argparse.Namespace) -> dict:
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
        "hidden_size": args.hidden, "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers, "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 128), "head_dim": 64,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    }  # fmt: skip


def documents(n: int, vocab: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` samples with alpaca-like lengths; the first 30-60% of each is an untrained prompt."""
    rng = random.Random(seed)
    samples = []
    for length in alpaca_like_lengths(n, seed=seed):
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        prompt = max(1, int(length * rng.uniform(0.3, 0.6)))
        samples.append(
            {
                "input_ids": ids,
                "labels": make_labels(ids, [False] * prompt + [True] * (length - prompt)),
            }
        )
    return samples


def batches(samples, args: argparse.Namespace) -> dict[str, list[dict[str, torch.Tensor]]]:
    """The two ways' micro-batches over the same documents."""
    order = list(range(len(samples)))
    random.Random(1).shuffle(order)  # the recipe's shuffled sample order
    shuffled = [samples[i] for i in order]
    ways = {}
    for size in args.batch:
        ways[f"padded, batch {size}"] = [
            collate_padded(shuffled[i : i + size], pad_id=PAD)
            for i in range(0, len(shuffled), size)
        ]
    packs = pack_greedy(shuffled, args.row, pad_id=PAD)
    ways["packed"] = [
        collate_packed(packs[i : i + args.rows]) for i in range(0, len(packs), args.rows)
    ]
    return ways


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    if "document_ids" in batch:
        return int((batch["document_ids"] >= 0).sum())
    return int(batch["attention_mask"].sum())


def step(model, optimizer, loss_fn, batch) -> tuple[float, int]:
    """One training step; returns the summed loss and the trained-token count."""
    hidden, _ = forward_batch(model, batch, return_hidden_states=True)
    trained = int((batch["labels"] != IGNORE_INDEX).sum())
    total = loss_fn(hidden, head_weight(model), batch["labels"])
    (total / trained).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(total.detach()), trained


def run_way(model, optimizer, loss_fn, micro) -> dict[str, float]:
    threads = torch.get_num_threads()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    loss, trained = 0.0, 0
    for batch in micro:
        summed, count = step(model, optimizer, loss_fn, batch)
        loss += summed
        trained += count
    return {"wall": time.perf_counter() - wall0,
            "cpu": (time.process_time() - cpu0) / threads, "loss": loss / trained}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=96)
    parser.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[8, 16],
        help="documents per padded micro-batch (one padded way each)",
    )
    parser.add_argument("--row", type=int, default=1024, help="tokens per packed row")
    parser.add_argument("--rows", type=int, default=2, help="packed rows per step")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1376)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    load = os.getloadavg()[0]

    config = model_config(args)
    torch.manual_seed(0)
    model = build_model(spec_from_hf_config(dict(config)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0, fused=True)
    loss_fn = LinearCrossEntropyLoss()
    samples = documents(args.docs, config["vocab_size"])
    ways = batches(samples, args)
    backend = resolve_attention_backend(
        model.model.attention_backend, device="cpu", packed=True, cached=False
    )
    real = {name: sum(map(real_tokens, micro)) for name, micro in ways.items()}
    assert set(real.values()) == {sum(len(s["input_ids"]) for s in samples)}
    positions = {name: sum(b["input_ids"].numel() for b in micro) for name, micro in ways.items()}

    for micro in ways.values():  # warm-up
        step(model, optimizer, loss_fn, micro[0])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    for round_ in range(args.rounds):
        for name, micro in ways.items():
            results[name].append(run_way(model, optimizer, loss_fn, micro))
            r = results[name][-1]
            print(
                f"round {round_ + 1} {name}: {real[name] / r['wall']:.0f} real tokens/s, "
                f"loss per trained token {r['loss']:.6f}",
                flush=True,
            )
        packed_loss = results["packed"][-1]["loss"]
        for name in ways:
            loss = results[name][-1]["loss"]
            if abs(packed_loss - loss) > 1e-5 * abs(loss):
                raise SystemExit(
                    f"packed loss per trained token {packed_loss!r} != {name}'s {loss!r}"
                )
    text = report(
        args,
        config,
        samples,
        ways,
        real,
        positions,
        results,
        backend,
        load,
        (time.perf_counter() - started) / 60,
    )
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")


def report(args, config, samples, ways, real, positions, results, backend, load, minutes) -> str:
    lengths = [len(s["input_ids"]) for s in samples]
    trained = sum(sum(label != IGNORE_INDEX for label in s["labels"]) for s in samples)
    params = sum(p.numel() for p in build_model(spec_from_hf_config(dict(config))).parameters())
    h, v, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    kv = config["num_key_value_heads"] * 64
    decoder = layers * (2 * h * h + 2 * h * kv + 3 * h * config["intermediate_size"])
    head_work = v * h * trained  # per round: the head projects the trained tokens only
    head_share = head_work / (head_work + decoder * positions["packed"])

    def rate(name: str, key: str) -> float:
        return real[name] * len(results[name]) / sum(r[key] for r in results[name])

    rows = []
    for name in ways:
        per_round = ", ".join(f"{real[name] / r['wall']:.0f}" for r in results[name])
        rows.append(
            f"| {name} | {len(ways[name])} | {positions[name]:,} | "
            f"{real[name] / positions[name]:.0%} | {rate(name, 'wall'):.0f} | "
            f"{per_round} | {rate(name, 'cpu'):.0f} | "
            f"{results[name][-1]['loss']:.6f} |"
        )
    verdicts = []
    for name in ways:
        if name == "packed":
            continue
        wall = rate("packed", "wall") / rate(name, "wall")
        cpu = rate("packed", "cpu") / rate(name, "cpu")
        rounds = ", ".join(
            f"{q['wall'] / p['wall']:.2f}"
            for q, p in zip(results[name], results["packed"], strict=True)
        )
        verdict = "meets" if min(wall, cpu) >= 2 else "does NOT meet"
        ceiling = positions[name] / positions["packed"]
        verdicts.append(
            f"- **packed vs {name}: {wall:.2f}x real tokens/s by the wall clock, "
            f"{cpu:.2f}x by CPU time** (per round, wall: {rounds}); {verdict} the "
            f"2x target; {ceiling:.2f}x fewer positions computed."
        )
    batch_text = " ".join(map(str, args.batch))
    command = (
        f"python benchmarks/packing.py --docs {args.docs} --batch {batch_text} "
        f"--row {args.row} --rows {args.rows} --hidden {args.hidden} "
        f"--intermediate {args.intermediate} --layers {args.layers} "
        f"--rounds {args.rounds} --threads {args.threads}"
    )
    return f"""# Packing on variable-length data: real tokens/s, packed vs padded (CPU)

`{command}` ({minutes:.1f} min)

- Documents: {len(lengths)} alpaca-like lengths: log-normal token counts, median 140 and
  sigma 0.75 before clipping to 16..1024 (`alpaca_like_lengths` of
  `benchmarks/packed_attention.py`; a stated shape with a long tail, not fitted here to a
  downloaded dataset): median {statistics.median(lengths):.0f}, mean \
{statistics.mean(lengths):.0f}, max {max(lengths)}; {sum(lengths):,} real tokens, \
{trained / sum(lengths):.0%} of them trained (the
  first 30-60% of each document is an untrained prompt). Random token ids.
- Model: random Llama-shaped, vocab {config["vocab_size"]}, hidden {config["hidden_size"]}, \
intermediate {config["intermediate_size"]}, {config["num_hidden_layers"]} layers,
  {config["num_attention_heads"]} heads / {config["num_key_value_heads"]} KV heads of 64, \
untied head; {params / 1e6:.1f}M parameters; float32.
- Step (what the SFT recipe runs with the shipped settings): forward to the hidden states,
  `LinearCrossEntropyLoss` on the trained tokens (divided by their count), backward, torch's
  fused AdamW (lr 0: the weights stay fixed, so both ways' loss can be compared each round).
- **padded, batch B**: shuffled micro-batches of B documents, each right-padded to its
  longest (SDPA with the padding mask). **packed**: the same documents packed whole into rows
  of {args.row} tokens, {args.rows} row(s) per step; attention backend `{backend}` (one causal
  SDPA per length bucket of documents: its work follows the documents, not the row length;
  tested in `tests/data/test_packing_varlen.py`).
- Same loss per trained token, asserted in every round (relative 1e-5; the script stops
  otherwise); unit test on small data: `tests/data/test_packing_varlen.py`.
- Machine: {machine()}; {args.threads} intra-op thread(s); Python \
{platform.python_version()}, torch {torch.__version__};
  run {datetime.date.today().isoformat()}; 1-minute load average {load:.1f} at the start \
(shared with other jobs: the CPU-time column is the steadier one). {args.rounds} round(s),
  the ways taking turns, after one warm-up step each.

| way | steps | positions | real share | real tokens/s | per round | real tokens/s by CPU time | loss per trained token |
|---|---:|---:|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

{chr(10).join(verdicts)}

The padded ways run the decoder (projections, MLP, norms) over every padding position and
attend over each micro-batch's longest document squared (the larger the batch, the more
padding); the packed rows are {real["packed"] / positions["packed"]:.0%} real tokens and their
attention covers each document's own length bucket. The head's matmuls (linear CE: trained
tokens only) and the optimizer step cost the same both ways, so per real token the gain stays
below the ratio of positions computed, the more so the larger the head's share of the FLOPs
(here {head_share:.0%} of the decoder's and head's matmul work per real token, packed).
"""


if __name__ == "__main__":
    main()
