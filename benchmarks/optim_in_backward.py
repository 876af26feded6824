"""Optimizer in backward: how much of a step's peak memory it removes, and what is left.

The ladder's ``+activation checkpointing`` rung (packed rows, linear cross-entropy, every layer
checkpointed) is measured with and without the optimizer in backward, for a tied and an untied
head and for torch's three AdamW implementations: the for-loop (torch's default on CPU),
``foreach`` (its default on CUDA) and ``fused``. Each measurement is one training step on the
longest batch under ``tunesmith.training.memory.usage.AllocatedBytes`` (the CPU allocator's peak,
with where it sits), after the optimizer states exist. Memory only: no timing, so a busy
machine does not change the numbers.

Usage::

    python benchmarks/optim_in_backward.py                  # preset 100m, writes the results
    python benchmarks/optim_in_backward.py --preset cpu --no-write
"""

from __future__ import annotations

import argparse
import datetime
import platform
from functools import partial
from pathlib import Path

import torch
from sft_ladder import PRESETS, machine, peak_label, synthetic_samples

from tunesmith.data import PackedDataset, collate_packed
from tunesmith.models import build_model
from tunesmith.models.spec import spec_from_hf_config
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.memory.optim_in_backward import OptimizerInBackward
from tunesmith.training.memory.preflight import longest_batch
from tunesmith.training.memory.usage import AllocatedBytes

RESULTS = Path(__file__).resolve().parent / "results"
IMPLEMENTATIONS = {
    "for-loop (CPU default)": {"foreach": False},
    "foreach (CUDA default)": {"foreach": True},
    "fused": {"fused": True},
}
MiB = 2**20


def measure(preset: str, tied: bool, options: dict, in_backward: bool) -> dict:
    """One step's allocator peak above weights and states, for one configuration."""
    setup = PRESETS[preset]
    torch.manual_seed(0)
    spec = spec_from_hf_config({**setup["config"], "tie_word_embeddings": tied})
    model = build_model(spec)
    packs = PackedDataset(
        synthetic_samples(200, setup["seq_len"], spec.vocab_size), setup["seq_len"], pad_id=0
    )
    batch = longest_batch(packs, setup["batch_size"], collate_packed)
    apply_activation_checkpointing(model, mode="full")
    loss_fn = LinearCrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    factory = partial(torch.optim.AdamW, lr=1e-5, **options)
    optimizer = OptimizerInBackward(params, factory) if in_backward else factory(params)
    for p in params:  # create every state without a training step
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    with AllocatedBytes() as mem:
        hidden = model(
            batch["input_ids"],
            position_ids=batch["position_ids"],
            document_ids=batch["document_ids"],
            return_hidden_states=True,
        )
        loss = loss_fn(hidden, model.lm_head.weight, batch["labels"])
        (loss / (batch["labels"] != -100).sum()).backward()
        del hidden, loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {
        "peak": mem.peak,
        "at": peak_label(mem.peak_op),
        "gradients": sum(p.numel() * p.element_size() for p in params),
        "largest": max(p.numel() * p.element_size() for p in params),
        "params": sum(p.numel() for p in params),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="100m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    for tied in (True, False):
        for name, options in IMPLEMENTATIONS.items():
            plain = measure(args.preset, tied, options, in_backward=False)
            hooked = measure(args.preset, tied, options, in_backward=True)
            rows.append((tied, name, plain, hooked))
            cut = plain["peak"] - hooked["peak"]
            print(
                f"{'tied' if tied else 'untied'} {name}: {plain['peak'] / MiB:,.0f} -> "
                f"{hooked['peak'] / MiB:,.0f} MiB, cut {cut / MiB:,.0f} MiB = "
                f"{cut / plain['gradients']:.0%} of the gradients",
                flush=True,
            )
    text = report(args, rows)
    print(text)
    if not args.no_write:
        path = RESULTS / f"optim_in_backward{'' if args.preset == '100m' else '_' + args.preset}.md"
        path.write_text(text)
        print(f"wrote {path}")


def report(args, rows) -> str:
    setup = PRESETS[args.preset]
    cfg = setup["config"]
    lines = [
        "| head | AdamW | gradients MiB | largest gradient MiB | peak without MiB | where "
        "| peak with MiB | where | cut MiB | cut / gradients |",
        "|---|---|---:|---:|---:|---|---:|---|---:|---:|",
    ]
    for tied, name, plain, hooked in rows:
        cut = plain["peak"] - hooked["peak"]
        lines.append(
            f"| {'tied' if tied else 'untied'} | {name} | {plain['gradients'] / MiB:,.0f} | "
            f"{plain['largest'] / MiB:,.0f} | {plain['peak'] / MiB:,.0f} | {plain['at']} | "
            f"{hooked['peak'] / MiB:,.0f} | {hooked['at']} | {cut / MiB:,.0f} | "
            f"{cut / plain['gradients']:.0%} |"
        )
    table = "\n".join(lines)
    return f"""# Optimizer in backward: the peak it removes

`python benchmarks/optim_in_backward.py --preset {args.preset}` — memory only (no timing).

- Model: random Llama-style, hidden {cfg["hidden_size"]}, {cfg["num_hidden_layers"]} layers, \
{cfg["num_attention_heads"]} heads / {cfg["num_key_value_heads"]} KV heads, MLP \
{cfg["intermediate_size"]},
  vocab {cfg["vocab_size"]}; fp32; the longest packed batch of \
{setup["batch_size"]} x {setup["seq_len"]} tokens; linear cross-entropy, every
  layer checkpointed (the ladder's `+activation checkpointing` rung, to which the ladder adds the
  optimizer in backward).
- Peaks: the CPU allocator's peak during one step (forward, backward, optimizer step), above
  the weights and optimizer states, which both runs hold alike (`AllocatedBytes`); "where" is
  the phase, autograd node or op, and the op allocating when the peak was reached.
- Machine: {machine()}; Python {platform.python_version()}, torch {torch.__version__};
  {args.threads} threads; run {datetime.date.today().isoformat()}.

{table}

**What the cut is made of.** Without the optimizer in backward the peak holds every gradient
(G) plus the scratch of the optimizer step (S): the for-loop AdamW allocates `sqrt(v)` and its
quotient, two copies of the parameter it steps (the 94 MiB embedding here); `foreach` holds a
temporary copy of every gradient at once; the fused kernel none, and its peak sits in backward
instead, where the gradients made so far meet the last layers' working set. With the optimizer
in backward every gradient is freed as soon as its parameter is stepped, and the peak is the
working set of backward that a plain run also holds at that moment (the checkpointed layer
inputs, one recomputed layer and its gradients, the loss's chunk of logits) plus the gradients
not yet stepped (with a tied head, the embedding's, which the head starts at the first op of
backward and the embedding lookup completes at the last) and the scratch of a step running at
that moment. So the cut is `G + S` minus all that, and it reaches G only where the plain
step's scratch S is at least as large: with `foreach` (torch's default on CUDA) it is; with
the for-loop or fused AdamW it cannot be, whatever the optimizer in backward does, since the
working set belongs to the forward and backward passes. What it removes there is every gradient
but the pending one, down to the working set.
"""


if __name__ == "__main__":
    main()
