"""The paper's table on one GPU: the SFT switch ladder at real model shapes, tunesmith beside
torchtune, in one short window (issue #39).

For each model shape (random weights of the real sizes: Qwen3-0.6B, Qwen3-1.7B, Llama-3.2-1B,
Llama-3.1-8B cut to 4 layers and the full 8B) and each stack (tunesmith; torchtune 0.6.x when
it imports) the ladder adds one switch per rung: baseline bf16 -> +compile -> +packing ->
+activation checkpointing -> +optimizer in backward -> +8-bit AdamW -> +linear CE. Both stacks
train on the same synthetic alpaca-length batches (log-normal lengths, median ~205 tokens,
clipped to 16..1024; packed rows of 2048) with pure bf16 weights and AdamW (bf16 states), each
switch through the stack's own function for it (tunesmith's ``compile_model``,
``apply_activation_checkpointing``, ``OptimizerInBackward``, ``LinearCrossEntropyLoss``;
torchtune's ``training.compile_model``, ``set_activation_checkpointing``,
``register_optim_in_bwd_hooks``, ``CEWithChunkedOutputLoss``; torchao's ``AdamW8bit`` for
both). Per row: real (non-padding) tokens/s over the timed steps after the warm-up (the
warm-up's seconds, compile included, apart), peak allocated and reserved memory of the timed
steps, MFU of the FLOPs of real tokens (``6 N T`` + causal attention per document, no
padding, no recomputation) against the bf16 matmul peak measured on the device, the mean loss.

Every (shape, stack) group runs in one fresh process; a row that runs out of memory is
retried at half the batch (the 8B rows say which batch fits). The plan (rows, their step
budgets and estimated seconds) and its total are printed before anything runs; rows beyond
``--budget-s`` are dropped up front and rows whose estimate no longer fits the time left are
skipped, each with the reason in the table. The results file is rewritten after every row.

Usage::

    python benchmarks/gpu/paper_table.py                       # on a GPU (benchmarks/gpu/run.sh)
    python benchmarks/gpu/paper_table.py --dry-run --out /tmp/t.md   # tiny shapes on the CPU
    python benchmarks/gpu/paper_table.py --not-run             # the file before any GPU run
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.abc
import importlib.machinery
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402
from fp8 import _allow_a_graph_per_layer  # noqa: E402
from machine_info import machine  # noqa: E402
from sft_ladder import _doc_lengths, _reset_peak_rss, _status_bytes, synthetic_samples  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "gpu_paper_table.md"
RUNGS = ("baseline bf16", "+compile", "+packing", "+activation checkpointing",
         "+optimizer in backward", "+8-bit AdamW", "+linear CE")  # fmt: skip
SWITCH = {"+compile": "compile", "+packing": "packed", "+activation checkpointing": "checkpointing",
          "+optimizer in backward": "in_backward", "+8-bit AdamW": "eight_bit",
          "+linear CE": "linear_ce"}  # fmt: skip
STACKS = ("tunesmith", "torchtune")
# The paper's numbers each row is read against: (shape, rung) -> text.
PAPER = {
    ("Qwen3-0.6B", "baseline bf16"): "5.2k tokens/s",
    ("Qwen3-0.6B", "+compile"): "7.9k tokens/s",
    ("Qwen3-0.6B", "+packing"): "57k tokens/s",
    ("Qwen3-1.7B", "baseline bf16"): "11.7 GB (AdamW)",
    ("Qwen3-1.7B", "+8-bit AdamW"): "4.9 GB (AdamW8bit)",
    ("Llama-3.1-8B", "+optimizer in backward"): "fits one GPU (AC + optimizer in backward)",
}
TARGETS = (
    "tunesmith's best row >= 1.3x torchtune's best row on Qwen3-0.6B tokens/s at equal loss",
    "peak memory of the memory rows (+activation checkpointing onwards) <= torchtune's",
)
PACK_LEN, ALPACA_MAX, SAMPLES = 2048, 1024, 512  # packed row length, longest sample, pool
BUDGET_S = 450.0  # seconds for every row of a GPU run (run.sh adds wheels, start, a backstop)


@dataclass(frozen=True)
class Shape:
    """One model shape of the table: a zoo size (``family.SIZES`` key) and how it runs."""

    name: str
    family: str  # "qwen3" or "llama3" (tunesmith.models.zoo module)
    size: str
    layers: int | None = None  # None: the size's own depth
    batch: int = 4
    compile: bool = False  # whether the ladder keeps its +compile rung on this shape
    stacks: tuple[str, ...] = STACKS


# In the order they run (the plan keeps the first rows that fit the budget): the headline
# ladder, the paper's memory shape, what fits at 8B, the per-layer slope, the 1B.
GPU_SHAPES = (
    Shape("Qwen3-0.6B", "qwen3", "qwen3_0_6b", compile=True),
    Shape("Qwen3-1.7B", "qwen3", "qwen3_1_7b"),
    Shape("Llama-3.1-8B", "llama3", "llama3_1_8b", batch=2, stacks=("tunesmith",)),
    Shape("Llama-3.1-8B, 4 layers", "llama3", "llama3_1_8b", layers=4),
    Shape("Llama-3.2-1B", "llama3", "llama3_2_1b"),
)
TINY = {"qwen3": "qwen3_tiny", "llama3": "llama3_tiny"}
DRY_RUN_SHAPES = ("Qwen3-0.6B", "Llama-3.2-1B", "Llama-3.1-8B, 4 layers")  # one per code path


@dataclass(frozen=True)
class Budget:
    """Steps and seconds of one row, and the clock the plan is made against."""

    warmup: int = 1  # untimed steps
    compile_warmup: int = 2  # more of them when compiled (padded batches change shape once)
    steps: int = 6  # timed steps at most
    timed_s: float = 5.0  # the timed steps stop after this many seconds (2 steps at least)
    start_s: float = 15.0  # a group's process start, imports and CUDA set-up (estimate)
    compile_s: float = 25.0  # a compiled row's extra warm-up seconds (estimate)
    eight_bit_s: float = 15.0  # torchao's AdamW8bit compiling its step per shape (estimate)
    assumed_flops: float = 3e14  # FLOP/s the estimates assume (~30% of an H200's bf16 peak)


@dataclass
class Row:
    shape: str
    stack: str
    rung: str
    estimate_s: float = 0.0
    status: str = "planned"  # planned | reserve | ran | oom | not run | failed
    why: str = ""
    batch: int = 0
    tokens_per_s: float = 0.0
    flops_per_s: float = 0.0
    step_s: float = 0.0
    warmup_s: float = 0.0
    steps: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    loss: float = 0.0


@dataclass
class Settings:
    """What one run measures, read once from the command line."""

    device: str
    shapes: tuple[Shape, ...]
    budget: Budget
    budget_s: float
    seq: int = PACK_LEN
    longest: int = ALPACA_MAX
    compile_backend: str = "inductor"
    torchtune_site: str | None = None
    dry_run: bool = False
    out: Path = RESULTS
    stacks: tuple[str, ...] = STACKS


# -- the rows of a shape ------------------------------------------------------------------------


def rungs_of(shape: Shape) -> list[str]:
    """The ladder of ``shape``: every rung, less ``+compile`` where the shape skips it.

    >>> rungs_of(GPU_SHAPES[1])[:2]
    ['baseline bf16', '+packing']
    """
    return [r for r in RUNGS if shape.compile or r != "+compile"]


def switches(shape: Shape, rung: str) -> dict[str, bool]:
    """The switches on at ``rung``: its own and those of every rung above it.

    >>> sorted(switches(GPU_SHAPES[0], "+packing"))
    ['compile', 'packed']
    """
    names = rungs_of(shape)
    return {SWITCH[r]: True for r in names[: names.index(rung) + 1] if r in SWITCH}


def model_spec(shape: Shape, dry_run: bool) -> Any:
    """The :class:`ModelSpec` of ``shape`` (its family's tiny size in a dry run)."""
    from tunesmith.models.zoo import llama3, qwen3

    family = {"qwen3": qwen3, "llama3": llama3}[shape.family]
    if dry_run:  # the family's tiny size, tied where the real one is
        tied = family.SIZES[shape.size].get("tie_word_embeddings", False)
        return family.spec(TINY[shape.family], tie_word_embeddings=tied)
    overrides = {} if shape.layers is None else {"num_hidden_layers": shape.layers}
    return family.spec(shape.size, **overrides)


def matmul_params(spec: Any) -> int:
    """Parameters in matmuls: every layer's projections and the head (not the embedding).

    >>> from sft_ladder import _matmul_params  # the same count, read off a built model
    >>> from tunesmith.models import build_model
    >>> from tunesmith.models.zoo import qwen3
    >>> spec = qwen3.spec("qwen3_0_6b")
    >>> matmul_params(spec) == _matmul_params(build_model(spec, device="meta"))
    True
    >>> matmul_params(spec)  # 28 x (1024 x 128 x 48 + 3 x 1024 x 3072) + 151936 x 1024
    595984384
    """
    h, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    attn = h * hd * (2 * spec.num_attention_heads + 2 * spec.num_key_value_heads)
    return spec.num_hidden_layers * (attn + 3 * h * inter) + spec.vocab_size * h


def row_flops(spec: Any, lengths: list[int]) -> float:
    """Useful FLOPs of one training step over documents of ``lengths`` real tokens:
    ``6 N T`` plus causal attention ``6 L nh hd l^2`` per document (``l^2 / 2`` pairs, two
    matmuls, x3 for forward and backward)."""
    attn = 6 * spec.num_hidden_layers * spec.num_attention_heads * spec.head_dim
    return 6 * matmul_params(spec) * sum(lengths) + attn * sum(n * n for n in lengths)


def estimate_s(settings: Settings, shape: Shape, rung: str) -> float:
    """Seconds a row is planned to take: warm-up (compile) and timed steps at the assumed
    FLOP/s, the timed part capped by the row's budget."""
    budget, on = settings.budget, switches(shape, rung)
    spec = model_spec(shape, settings.dry_run)
    tokens = shape.batch * (settings.seq if on.get("packed") else settings.longest // 4)
    step = (
        row_flops(spec, [tokens]) / budget.assumed_flops * (1.3 if on.get("checkpointing") else 1)
    )
    warm = warmup_steps(budget, on) * step + (budget.compile_s if on.get("compile") else 0)
    warm += budget.eight_bit_s if on.get("eight_bit") else 0
    return 2.0 + warm + min(budget.steps * step, budget.timed_s)


def warmup_steps(budget: Budget, on: dict[str, bool]) -> int:
    return budget.warmup + (budget.compile_warmup if on.get("compile") else 0)


def plan(settings: Settings) -> list[Row]:
    """Every row in run order (shape by shape, tunesmith first) with its estimate; rows past
    ``budget_s`` (group start-ups counted) are the ``reserve``: they run only if the rows
    before them leave the time (a row starts only if its estimate fits what is left)."""
    rows, spent = [], 0.0
    for shape in settings.shapes:
        for stack in shape.stacks:
            if stack not in settings.stacks:
                continue
            spent += settings.budget.start_s
            for rung in rungs_of(shape):
                row = Row(shape.name, stack, rung, estimate_s=estimate_s(settings, shape, rung))
                if settings.dry_run and not dry_run_row(shape, rung):
                    row.status, row.why = "not run", "dry run: the rows that run cover its code"
                elif spent + row.estimate_s > settings.budget_s:
                    row.status, row.why = "reserve", "after the plan: runs if time is left"
                else:
                    spent += row.estimate_s
                rows.append(row)
    return rows


def dry_run_row(shape: Shape, rung: str) -> bool:
    """Whether the dry run runs this row: every rung of the first shape (tied Qwen3, the
    compiled ladder), the first and last rung (no switch, every eager switch) of the tied and
    the untied Llama; the other shapes repeat those shapes' code.

    >>> [dry_run_row(GPU_SHAPES[4], r) for r in ("baseline bf16", "+packing", "+linear CE")]
    [True, False, True]
    >>> dry_run_row(GPU_SHAPES[1], "baseline bf16")
    False
    """
    if shape.name == GPU_SHAPES[0].name:
        return True
    return shape.name in DRY_RUN_SHAPES and rung in (RUNGS[0], RUNGS[-1])


def planned_s(settings: Settings, rows: list[Row]) -> float:
    """The plan's total: group start-ups plus the rows that will run."""
    groups = {(r.shape, r.stack) for r in rows if r.status == "planned"}
    runs = sum(r.estimate_s for r in rows if r.status == "planned")
    return len(groups) * settings.budget.start_s + runs


# -- the stacks: one training step each ---------------------------------------------------------


def eight_bit_factory(device: torch.device) -> Callable[..., torch.optim.Optimizer]:
    """torchao's AdamW8bit on CUDA (what both stacks configure); on a CPU, bitsandbytes'
    (torchao's compiles its step with inductor, about a minute per shape on a small CPU)."""
    if device.type == "cuda":
        from torchao.optim import AdamW8bit
    else:
        from bitsandbytes.optim import AdamW8bit
    return partial(AdamW8bit, lr=1e-5)


def optimizer_factory(on: dict[str, bool], device: torch.device) -> Callable[..., Any]:
    if on.get("eight_bit"):
        return eight_bit_factory(device)
    return partial(torch.optim.AdamW, lr=1e-5, fused=device.type == "cuda")


class TunesmithStack:
    """tunesmith's model and switches, as its sft recipe applies them (checkpointing, then
    compile of each layer and the loss; optimizer in backward around any optimizer)."""

    def __init__(self, spec: Any, on: dict[str, bool], device: torch.device, backend: str):
        from tunesmith.models import build_model
        from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
        from tunesmith.training.memory.activations import apply_activation_checkpointing
        from tunesmith.training.memory.compile import compile_loss, compile_model
        from tunesmith.training.memory.optim_in_backward import OptimizerInBackward

        self.on = on
        self.model = build_model(spec, device=device, dtype=torch.bfloat16)
        if on.get("checkpointing"):
            apply_activation_checkpointing(self.model, mode="full")
        self.loss_fn = LinearCrossEntropyLoss() if on.get("linear_ce") else CrossEntropyLoss()
        if on.get("compile"):
            _allow_a_graph_per_layer(spec.num_hidden_layers)
            compile_model(self.model, backend=backend)
            self.loss_fn = compile_loss(self.loss_fn, backend=backend)
        params = [p for p in self.model.parameters() if p.requires_grad]
        factory = optimizer_factory(on, device)
        in_backward = on.get("in_backward")
        self.optimizer = OptimizerInBackward(params, factory) if in_backward else factory(params)

    @staticmethod
    def prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return batch  # the collated batch is all the model takes

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {"position_ids": batch["position_ids"]}
        if "document_ids" in batch:
            inputs["document_ids"] = batch["document_ids"]
        if self.on.get("linear_ce"):
            hidden = self.model(batch["input_ids"], **inputs, return_hidden_states=True)
            loss = self.loss_fn(hidden, self.model.lm_head.weight, batch["labels"])
        else:
            loss = self.loss_fn(self.model(batch["input_ids"], **inputs), batch["labels"])
        loss = loss / (batch["labels"] != -100).sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


class _AbsentType(type):
    """A stand-in class: any attribute or subscript is another stand-in; calling one says the
    package is missing."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentType(f"{cls.__name__}.{name}", (), {})

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{cls.__name__}: the package is not installed (a stand-in)")


class _Absent(types.ModuleType):
    """A stand-in for a package torchtune imports at start-up but this benchmark never calls."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentType(f"{self.__name__}.{name}", (), {})


class _AbsentFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves :class:`_Absent` for ``names`` and their submodules (only those that do not
    import: they are tried first)."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Absent(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


# torchtune's import-time dependencies that its models, losses and training helpers never use
TORCHTUNE_OPTIONAL = (
    "datasets",
    "sentencepiece",
    "tiktoken",
    "blobfile",
    "kagglehub",
    "PIL",
    "psutil",
)


def import_torchtune() -> Any:
    """``import torchtune``, with stand-ins for the optional packages that are missing."""
    import importlib.util

    missing = {name for name in TORCHTUNE_OPTIONAL if importlib.util.find_spec(name) is None}
    if missing:
        sys.meta_path.append(_AbsentFinder(missing))
    import torchtune

    return torchtune


def torchtune_qwen3(spec: Any) -> torch.nn.Module:
    """A Qwen3-shaped decoder from torchtune's own modules (0.6.1 predates its Qwen3 builder;
    this is that builder's composition: Qwen2 RoPE and MLP, per-head q/k RMSNorm, head_dim
    independent of the width, tied head when the size ties it)."""
    from torchtune.models.qwen2._component_builders import qwen2_mlp
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import (
        MultiHeadAttention,
        RMSNorm,
        TiedLinear,
        TransformerDecoder,
        TransformerSelfAttentionLayer,
    )

    h, hd, eps = spec.hidden_size, spec.head_dim, spec.rms_norm_eps
    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    rope = Qwen2RotaryPositionalEmbeddings(dim=hd, max_seq_len=PACK_LEN, base=spec.rope_theta)

    def layer() -> torch.nn.Module:
        attn = MultiHeadAttention(
            embed_dim=h, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
            q_proj=torch.nn.Linear(h, nh * hd, bias=False),
            k_proj=torch.nn.Linear(h, nkv * hd, bias=False),
            v_proj=torch.nn.Linear(h, nkv * hd, bias=False),
            output_proj=torch.nn.Linear(nh * hd, h, bias=False), pos_embeddings=rope,
            q_norm=RMSNorm(hd, eps=eps), k_norm=RMSNorm(hd, eps=eps), max_seq_len=PACK_LEN,
        )  # fmt: skip
        return TransformerSelfAttentionLayer(
            attn=attn, mlp=qwen2_mlp(h, spec.intermediate_size),
            sa_norm=RMSNorm(h, eps=eps), mlp_norm=RMSNorm(h, eps=eps),
        )  # fmt: skip

    embed = torch.nn.Embedding(spec.vocab_size, h)
    head = TiedLinear(embed) if spec.tie_word_embeddings else torch.nn.Linear(h, spec.vocab_size)
    return TransformerDecoder(
        tok_embeddings=embed, layers=torch.nn.ModuleList(layer() for _ in range(spec.num_hidden_layers)),
        max_seq_len=PACK_LEN, num_heads=nh, head_dim=hd, norm=RMSNorm(h, eps=eps), output=head,
    )  # fmt: skip


def torchtune_llama3(spec: Any) -> torch.nn.Module:
    """torchtune's own Llama 3.2 (tied head) or 3.1 component builder at ``spec``'s sizes."""
    from torchtune.models.llama3_1 import llama3_1
    from torchtune.models.llama3_2 import llama3_2

    common = dict(
        vocab_size=spec.vocab_size, num_layers=spec.num_hidden_layers,
        num_heads=spec.num_attention_heads, num_kv_heads=spec.num_key_value_heads,
        embed_dim=spec.hidden_size, max_seq_len=PACK_LEN, rope_base=spec.rope_theta,
        intermediate_dim=spec.intermediate_size, norm_eps=spec.rms_norm_eps,
    )  # fmt: skip
    if spec.tie_word_embeddings:
        return llama3_2(**common, scale_factor=32, tie_word_embeddings=True)
    return llama3_1(**common)


class TorchtuneStack:
    """torchtune's model and switches, as its ``full_finetune_single_device`` recipe applies
    them. 0.6.1 has no linear CE: its ``+linear CE`` rung is ``CEWithChunkedOutputLoss`` (the
    head in 8 chunks of rows, each upcast to float32), its closest switch."""

    def __init__(self, spec: Any, on: dict[str, bool], device: torch.device, backend: str):
        import_torchtune()
        from torchtune import modules, training
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        os.environ["TORCH_COMPILE_BACKEND"] = backend  # what torchtune's compile helpers read
        self.on = on
        build = torchtune_qwen3 if spec.qk_norm else torchtune_llama3
        with training.set_default_dtype(torch.bfloat16), device:
            self.model = build(spec)
        self.model.load_state_dict(tunesmith_weights(spec, device))
        if on.get("checkpointing"):
            policy = {modules.TransformerSelfAttentionLayer}
            training.set_activation_checkpointing(self.model, auto_wrap_policy=policy)
        self.chunked = bool(on.get("linear_ce"))
        self.loss_fn = CEWithChunkedOutputLoss() if self.chunked else torch.nn.CrossEntropyLoss()
        if self.chunked:
            self.model.set_num_output_chunks(self.loss_fn.num_output_chunks)
        if on.get("compile"):
            _allow_a_graph_per_layer(spec.num_hidden_layers)
            training.compile_model(self.model, verbose=False)
            self.loss_fn = training.compile_loss(self.loss_fn, verbose=False)
        factory = optimizer_factory(on, device)
        self.optimizer = None
        if on.get("in_backward"):
            optim_dict = {p: factory([p]) for p in self.model.parameters()}
            training.register_optim_in_bwd_hooks(model=self.model, optim_dict=optim_dict)
        else:
            self.optimizer = factory(self.model.parameters())

    @staticmethod
    def prepare(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """What torchtune's packed collate adds (in its data loader, so before the clock): the
        block-causal mask from the documents' lengths, and positions."""
        from torchtune.modules.attention_utils import packed_block_causal_mask

        if "document_ids" not in batch:
            return batch
        mask = packed_block_causal_mask(seq_lens=_seq_lens(batch["document_ids"]))
        return {**batch, "mask": mask}

    def step(self, batch: dict[str, Any]) -> torch.Tensor:
        inputs = {}
        if "mask" in batch:
            inputs = {"mask": batch["mask"], "input_pos": batch["position_ids"]}
        logits = self.model(batch["input_ids"], **inputs)
        if self.chunked:
            loss = self.loss_fn(logits, batch["labels"])
        else:
            loss = self.loss_fn(logits.float().flatten(0, 1), batch["labels"].flatten())
        loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def tunesmith_weights(spec: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The weights a tunesmith row starts from (same seed), in torchtune's names and layout
    (its converters: q/k permuted to its interleaved RoPE for Llama), so both stacks train
    the same function from the same loss."""
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune

    from tunesmith.models import build_model

    torch.manual_seed(0)
    weights = build_model(spec, device=device, dtype=torch.bfloat16).state_dict()
    if spec.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    sizes = dict(num_heads=spec.num_attention_heads, num_kv_heads=spec.num_key_value_heads,
                 dim=spec.hidden_size, head_dim=spec.head_dim)  # fmt: skip
    if not spec.qk_norm:
        return hf_to_tune(weights, **sizes)
    norms = {
        k: weights.pop(k) for k in list(weights) if k.endswith(("q_norm.weight", "k_norm.weight"))
    }
    out = qwen2_hf_to_tune(weights, **sizes, tie_word_embeddings=spec.tie_word_embeddings)
    for key, value in norms.items():  # model.layers.{i}.self_attn.q_norm.weight
        parts = key.split(".")
        out[f"layers.{parts[2]}.attn.{parts[4]}.scale"] = value
    return out


def _seq_lens(document_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the lengths of its documents then its padding (torchtune's ``seq_lens``).

    >>> _seq_lens(torch.tensor([[0, 0, 1, -1]]))
    [tensor([2, 1, 1])]
    """
    out = []
    for row in document_ids:
        _, counts = torch.unique_consecutive(row, return_counts=True)
        out.append(counts)
    return out


STACK_CLASSES = {"tunesmith": TunesmithStack, "torchtune": TorchtuneStack}


# -- one group of rows, in a fresh process ------------------------------------------------------


def make_batches(
    settings: Settings, spec: Any, batch: int, packed: bool, count: int
) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of the synthetic alpaca-length samples (the same in every row of
    every stack): padded to each batch's longest sample, or packed into rows of ``seq``."""
    from tunesmith.data import PackedDataset, collate_packed, collate_padded

    samples = synthetic_samples(SAMPLES, settings.longest, spec.vocab_size)
    if packed:
        dataset, collate = PackedDataset(samples, settings.seq, pad_id=0), collate_packed
    else:
        dataset, collate = samples, partial(collate_padded, pad_id=0)
    out = []
    for k in range(count):
        start = (k * batch) % max(len(dataset) - batch, 1)
        out.append(collate([dataset[i] for i in range(start, start + batch)]))
    return out


class Meter:
    """Peak memory of the timed steps: the CUDA allocator's peak allocated and reserved
    bytes; on a CPU, the process's peak resident set above its set at the start (both)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":  # cached blocks of the warm-up (and of torchtune's
            torch.cuda.synchronize()  # weight copy) leave, so reserved is the steps' own
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.base = _status_bytes("VmRSS")
            _reset_peak_rss()

    def peaks(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        peak = _status_bytes("VmHWM") - self.base
        return peak, peak

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def run_row(settings: Settings, shape: Shape, stack: str, rung: str, batch: int) -> Row:
    """Build ``stack``'s model with the switches of ``rung``, warm up, time the steps."""
    device, on = torch.device(settings.device), switches(shape, rung)
    spec, warm = model_spec(shape, settings.dry_run), warmup_steps(settings.budget, on)
    count = warm + settings.budget.steps
    batches = make_batches(settings, spec, batch, bool(on.get("packed")), count)
    batches = [{k: v.to(device) for k, v in b.items()} for b in batches]
    torch.manual_seed(0)
    meter = Meter(device)
    runner = STACK_CLASSES[stack](spec, on, device, settings.compile_backend)
    inputs = [runner.prepare(b) for b in batches]
    start = time.perf_counter()
    for b in inputs[:warm]:
        runner.step(b)
    meter.sync()
    warmup_s = time.perf_counter() - start
    meter.reset()
    timed = time_steps(runner, meter, inputs[warm:], settings.budget.timed_s)
    lengths = [_doc_lengths(b) for b in batches[warm : warm + len(timed)]]
    seconds = sum(t for _, t in timed)
    allocated, reserved = meter.peaks()
    return Row(
        shape.name, stack, rung, status="ran", batch=batch, warmup_s=warmup_s,
        tokens_per_s=sum(map(sum, lengths)) / seconds, step_s=seconds / len(timed),
        flops_per_s=sum(row_flops(spec, n) for n in lengths) / seconds, steps=len(timed),
        peak_allocated=allocated, peak_reserved=reserved,
        loss=float(torch.stack([loss for loss, _ in timed]).float().mean()),
    )  # fmt: skip


def time_steps(
    runner: Any, meter: Meter, inputs: list[dict], limit_s: float
) -> list[tuple[torch.Tensor, float]]:
    """``(loss, seconds)`` of each step over ``inputs``, stopping once ``limit_s`` is spent
    (two steps at least); each step waits for the device before its clock stops."""
    timed: list[tuple[torch.Tensor, float]] = []
    for b in inputs:
        start = time.perf_counter()
        loss = runner.step(b)
        meter.sync()
        timed.append((loss, time.perf_counter() - start))
        if sum(t for _, t in timed) > limit_s and len(timed) >= 2:
            break
    return timed


def run_row_fitting(settings: Settings, shape: Shape, stack: str, rung: str) -> Row:
    """:func:`run_row` at the shape's batch, halved after each out-of-memory error (the row
    says the batch that fit, or that none did)."""
    batch, tried = shape.batch, []
    while batch >= 1:
        try:
            row = run_row(settings, shape, stack, rung, batch)
            row.why = f"out of memory at batch {', '.join(tried)}" if tried else ""
            return row
        except torch.OutOfMemoryError:
            tried.append(str(batch))
            batch //= 2
        finally:
            release()
    return Row(
        shape.name, stack, rung, status="oom", why=f"out of memory at batch {', '.join(tried)}"
    )


def release() -> None:
    """Free what the last row left: its graphs, its tensors, the allocator's cache."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_group(settings: Settings, shape: Shape, stack: str, rungs: list[str], deadline: float):
    """The child: each rung's row as one JSON line, or why it did not run (a torchtune group
    first says torchtune's version, or why it does not import and no row runs)."""
    if stack == "torchtune":
        try:
            print(json.dumps({"torchtune": torchtune_versions()}), flush=True)
        except Exception as error:  # noqa: BLE001 (any import failure: the table says which)
            print(json.dumps({"torchtune": f"not run (it does not import: {_why(error)})"}))
            return
    for rung in rungs:
        left = deadline - time.time()
        estimate = estimate_s(settings, shape, rung)
        if left < estimate:
            row = Row(shape.name, stack, rung, status="not run",
                      why=f"budget spent: {left:.0f} s left, ~{estimate:.0f} s needed")  # fmt: skip
        else:
            try:
                row = run_row_fitting(settings, shape, stack, rung)
            except Exception as error:  # noqa: BLE001 (the table says which row failed and why)
                row = Row(shape.name, stack, rung, status="failed", why=_why(error))
        print(json.dumps(asdict(row)), flush=True)


def torchtune_versions() -> str:
    """``"<torchtune> with torchao <torchao>"`` as this process imports them."""
    version = import_torchtune().__version__
    import torchao

    return f"{version} with torchao {torchao.__version__}"


def _why(error: BaseException) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:200]}"


# -- the parent: plan, groups, the report -------------------------------------------------------


def child_env(settings: Settings, stack: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    paths = [str(REPO)]
    if stack == "torchtune" and settings.torchtune_site:  # its own torchao comes first
        paths.insert(0, settings.torchtune_site)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [*paths, env.get("PYTHONPATH")]))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/paper_table_inductor")
    if settings.dry_run:  # tiny steps: threads would only wait for each other
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_groups(settings: Settings, rows: list[Row], started: float, meta: dict) -> None:
    """Run the planned rows, each (shape, stack) group in a fresh process (in a dry run, one
    process per stack: the groups' code is the same, the start-ups are not free), updating
    ``rows`` and the results file as each row's line arrives."""
    deadline = started + settings.budget_s
    processes: dict[str, list[dict]] = {}
    for shape in settings.shapes:
        for stack in shape.stacks:
            todo = [r for r in rows if (r.shape, r.stack) == (shape.name, stack)]
            rungs = [r.rung for r in todo if r.status in ("planned", "reserve")]
            if rungs:
                key = stack if settings.dry_run else f"{shape.name} | {stack}"
                group = {"shape": asdict(shape), "stack": stack, "rungs": rungs}
                processes.setdefault(key, []).append(group)
    for name, groups in processes.items():
        todo = [r for r in rows if r.status in ("planned", "reserve")
                and any((r.shape, r.stack) == (g["shape"]["name"], g["stack"]) for g in groups)]  # fmt: skip
        if groups[0]["stack"] == "torchtune" and meta["torchtune"].startswith("not run"):
            for row in todo:  # an earlier process found torchtune missing
                row.status, row.why = "not run", torchtune_why(meta)
            continue
        run_child(settings, name, {"groups": groups, "deadline": deadline}, todo, rows, meta)


def run_child(
    settings: Settings, name: str, job: dict, todo: list[Row], rows: list[Row], meta: dict
) -> None:
    """One process: its rows as they arrive; rows it did not report say why."""
    command = [sys.executable, __file__, *settings_argv(settings), "--child", json.dumps(job)]
    log, marker = stderr_log(settings), f"== {name}\n"
    with open(log, "a") as stderr:  # a file: a pipe nobody reads would fill and stall it
        stderr.write(marker)
        stderr.flush()
        child = subprocess.Popen(
            command, env=child_env(settings, job["groups"][0]["stack"]),
            stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    by_key = {(r.shape, r.rung): r for r in todo}
    for line in _lines(child, job["deadline"]):
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "torchtune" in record:  # a torchtune group's first line: its version, or why not
            meta["torchtune"] = record["torchtune"]
            continue
        done = Row(**record)
        by_key[(done.shape, done.rung)].__dict__.update(asdict(done))
        print(f"{done.shape} | {done.stack} | {done.rung}: {summary(done)}", flush=True)
        write_report(settings, rows, meta)
    code = child.poll()
    tail = [s for s in log.read_text().split(marker)[-1].splitlines() if s.strip()][-1:] or [""]
    for row in todo:
        if row.status not in ("planned", "reserve"):
            continue
        if meta["torchtune"].startswith("not run") and row.stack == "torchtune":
            row.status, row.why = "not run", torchtune_why(meta)
        elif code is None or code == -9:
            row.status, row.why = "not run", "its process was stopped at the budget"
        else:
            row.status, row.why = "failed", f"process exit {code}: {tail[0][:200]}"
    write_report(settings, rows, meta)


def torchtune_why(meta: dict) -> str:
    """The reason a torchtune row did not run, from the group's first line.

    >>> torchtune_why({"torchtune": "not run (it does not import: X)"})
    'torchtune does not import: X'
    """
    return "torchtune " + meta["torchtune"].removeprefix("not run (it ").removesuffix(")")


def stderr_log(settings: Settings) -> Path:
    """Where the children's stderr goes: beside the results file."""
    return settings.out.with_name(settings.out.stem + "_stderr.txt")


def _lines(child: subprocess.Popen, deadline: float) -> Iterator[str]:
    """The child's stdout lines until it ends or the deadline passes (then it is killed)."""
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ)
    while time.time() < deadline:
        if selector.select(timeout=max(0.1, min(5.0, deadline - time.time()))):
            line = child.stdout.readline()
            if not line:
                break
            yield line
    else:
        child.kill()
    child.wait()


def _budget(settings: Settings) -> str:
    if math.isinf(settings.budget_s):
        return "no time budget"
    return f"budget {settings.budget_s:.0f} s"


def summary(row: Row) -> str:
    if row.status != "ran":
        return f"{row.status}: {row.why}"
    return (f"{row.tokens_per_s:,.0f} tokens/s, peak {_mib(row.peak_allocated)} MiB allocated, "
            f"warm-up {row.warmup_s:.1f} s, loss {row.loss:.3f}")  # fmt: skip


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def settings_argv(settings: Settings) -> list[str]:
    """The flags that rebuild ``settings`` in a child."""
    argv = ["--device", settings.device, "--compile-backend", settings.compile_backend,
            "--budget-s", str(settings.budget_s)]  # fmt: skip
    return [*argv, "--dry-run"] if settings.dry_run else argv


# -- the report ---------------------------------------------------------------------------------


def cell(row: Row, settings: Settings, peak: float) -> list[str]:
    """One row's cells: tokens/s, MFU, step s, warm-up s, peak allocated / reserved MiB,
    loss, batch; a row that did not run says why in place of its numbers."""
    if row.status != "ran":
        label = {"oom": "did not fit", "planned": f"planned, ~{row.estimate_s:.0f} s"}.get(
            row.status, row.status
        )
        return [f"{label}: {row.why}" if row.why else label, "", "", "", "", "", "", ""]
    note = f" ({row.why})" if row.why else ""
    return [f"{row.tokens_per_s:,.0f}", f"{row.flops_per_s / peak:.1%}" if peak else "",
            f"{row.step_s:.3f}", f"{row.warmup_s:.1f}", _mib(row.peak_allocated),
            _mib(row.peak_reserved), f"{row.loss:.3f}", f"{row.batch}{note}"]  # fmt: skip


def ratio(rows: list[Row], row: Row) -> str:
    """tunesmith / torchtune tokens/s and peak allocated on the same shape and rung."""
    other = {(r.shape, r.rung): r for r in rows if r.stack == "torchtune" and r.status == "ran"}
    mate = other.get((row.shape, row.rung))
    if row.stack != "tunesmith" or row.status != "ran" or mate is None:
        return ""
    return (f"{row.tokens_per_s / mate.tokens_per_s:.2f}x / "
            f"{row.peak_allocated / max(mate.peak_allocated, 1):.2f}x")  # fmt: skip


def table(rows: list[Row], settings: Settings, peak: float) -> str:
    lines = ["| shape | stack | rung | tokens/s | MFU | step s | warm-up s | peak alloc MiB "
             "| peak reserved MiB | loss | batch | tunesmith / torchtune (tokens/s / peak) "
             "| paper |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]  # fmt: skip
    for row in rows:
        paper = PAPER.get((row.shape, row.rung), "") if row.stack == "tunesmith" else ""
        cells = [
            row.shape,
            row.stack,
            row.rung,
            *cell(row, settings, peak),
            ratio(rows, row),
            paper,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdicts(rows: list[Row]) -> list[str]:
    """The issue's targets read off the rows (or why they cannot be yet)."""
    ran = [r for r in rows if r.status == "ran"]
    headline = GPU_SHAPES[0].name
    best = {s: max((r for r in ran if r.shape == headline and r.stack == s),
                   key=lambda r: r.tokens_per_s, default=None) for s in STACKS}  # fmt: skip
    if best["tunesmith"] and best["torchtune"]:
        t, tt = best["tunesmith"], best["torchtune"]
        speed = (f"{t.tokens_per_s / tt.tokens_per_s:.2f}x ({t.rung}: {t.tokens_per_s:,.0f} vs "
                 f"{tt.rung}: {tt.tokens_per_s:,.0f} tokens/s; loss {t.loss:.3f} vs {tt.loss:.3f})")  # fmt: skip
    else:
        speed = "not measured (a stack's Qwen3-0.6B rows did not run)"
    memory_rungs = RUNGS[RUNGS.index("+activation checkpointing") :]
    pairs = [(r, m) for r in ran for m in ran if r.stack == "tunesmith" and m.stack == "torchtune"
             and (r.shape, r.rung) == (m.shape, m.rung) and r.rung in memory_rungs]  # fmt: skip
    worse = [f"{r.shape} {r.rung}" for r, m in pairs if r.peak_allocated > m.peak_allocated]
    memory = (f"{len(pairs) - len(worse)} of {len(pairs)} pairs at or below torchtune"
              + (f" (above: {', '.join(worse)})" if worse else "")) if pairs else "not measured"  # fmt: skip
    return [f"- {TARGETS[0]}: **{speed}**", f"- {TARGETS[1]}: **{memory}**"]


def header(settings: Settings, meta: dict, rows: list[Row]) -> str:
    ran = any(r.status == "ran" for r in rows)
    if settings.dry_run:
        status = ("**Dry run** (`--dry-run`): the tiny stand-ins of each family on the CPU, "
                  "two timed steps per row; it checks the code paths, not the speed.")  # fmt: skip
    elif not ran and meta.get("not_run"):
        status = ("**Not run yet on a GPU**: no GPU machine has been lent to a session since "
                  "the script was written. Every row below is the plan, with its estimate; "
                  "the CPU dry run (below) is what has run.")  # fmt: skip
    else:
        status = f"Run {meta['date']} on {meta['device']}."
    return "\n".join([
        "# The paper's table on one GPU: tunesmith beside torchtune",
        "",
        status,
        "",
        f"- Command: `{meta['command']}`; planned total {meta['planned_s']:.0f} s "
        f"({_budget(settings)}){meta.get('elapsed', '')}.",
        _machine_line(meta),
        f"- Matmul peak (bf16, measured on the device, the MFU denominator): {meta['peak_text']}.",
        f"- torchtune: {meta['torchtune']}.",
    ])  # fmt: skip


def _machine_line(meta: dict) -> str:
    if meta.get("not_run"):
        return ("- Machine, driver, torch/CUDA versions and load: the GPU run records them "
                "(not run yet).")  # fmt: skip
    return (f"- Machine: {meta['machine']}; device {meta['device']}; {meta['versions']}; "
            f"load average at the start {meta['load']}.")  # fmt: skip


METHOD = """\
## How it is measured

- **Models**: random weights of the real shapes (`tunesmith.models.zoo`: `qwen3_0_6b`,
  `qwen3_1_7b`, `llama3_2_1b`, `llama3_1_8b` cut to 4 layers, full `llama3_1_8b`), pure bf16
  weights in both stacks, AdamW (lr 1e-5, bf16 states; torch's fused kernel on CUDA). torchtune's
  Llama rows use its own `llama3_2` / `llama3_1` builders; its Qwen3 rows the Qwen3 composition
  of its modules (0.6.1 has no Qwen3 builder).
- **Data**: 512 synthetic alpaca-length samples (log-normal lengths, median ~205 tokens,
  clipped to 16..1024, every token trained), the same batches for both stacks: padded to the
  batch's longest sample, or (`+packing`) packed into rows of 2048 (tunesmith: per-document
  attention; torchtune: its block-causal mask and positions).
- **Ladder**: each rung adds its switch to the rung above. The `+compile` rung runs on
  Qwen3-0.6B only (the 9-minute window); the other shapes climb the ladder eagerly. The
  default plan (450 s) holds the Qwen3-0.6B ladder of both stacks; the other shapes are the
  reserve, run while time is left (a second window: `bash benchmarks/gpu/run.sh --shapes
  Qwen3-1.7B Llama-3.1-8B`, into another `$OUT`). 8-bit
  AdamW is torchao's `AdamW8bit` in both stacks. torchtune 0.6.1 has no linear CE: its
  `+linear CE` rung is `CEWithChunkedOutputLoss`, its closest switch.
- **tokens/s**: real (non-padding) tokens per second of the timed steps (at most {steps}, or
  until {timed_s:.0f} s), after {warmup} warm-up step(s) ({warmup_compiled} when compiled: the
  first compiles, padded batches then change shape once more); **warm-up s** holds the
  compile time. **MFU**: `6 N T + 6 L nh hd Σl²` per step (N matmul parameters, T real
  tokens, l each document's length; no padding, no recomputation) per second over the
  measured bf16 matmul peak. **peak**: CUDA's peak allocated / reserved bytes over the timed
  steps (weights, optimizer states and activations). A row out of memory is retried at half
  the batch; **batch** is the one that fit.
- Memory rows of the paper (Qwen3-1.7B AdamW 11.7 GB -> AdamW8bit 4.9 GB) compare the
  `baseline bf16` and `+8-bit AdamW` rows of that shape; the 8B rows say which switches fit
  and at which batch.
- RL: `benchmarks/rl_step.py --device cuda --bf16` (the GRPO step split, `rl_step_cuda.md`)
  and the rollout engines' `benchmarks/gpu/rollout.sh` (`rollout_cuda.md`, a Qwen3-0.6B-shaped
  section included) are separate GPU runs; this table does not repeat them.
"""


COVERAGE = """\
## What the CPU dry run checks

`tests/benchmarks/test_gpu_paper_table.py` runs `--dry-run` in the default test tier, one
process per stack: the whole ladder at the Qwen3-0.6B rows and the first and last rungs (no
switch; every eager switch) of the tied (Llama-3.2-1B) and the untied (Llama-3.1-8B, 4 layers)
Llama rows, each on its family's tiny stand-in, two timed steps per row, `torch.compile` with
the eager backend, bitsandbytes' 8-bit AdamW in place of torchao's (torchao's compiles its
step: a minute per shape on a small CPU); the other rows say why they did not run. The same
file checks the plan against its budget, the retry at half the batch after an out-of-memory
error, the targets read off both stacks' rows and this not-run file. torchtune is not a
project dependency: in CI its rows say it does not import; with `PAPER_TABLE_TORCHTUNE_SITE`
(a folder holding torchtune 0.6.1 and torchao 0.10.0) the same test runs them and checks that
each starts from tunesmith's loss (the same weights, converted by torchtune's own converters)
— it passed so in the session that wrote the script. What only the GPU run checks:
inductor's CUDA kernels, torchao's 8-bit AdamW, CUDA memory peaks, the time estimates, and
everything at the real shapes.
"""


def write_report(settings: Settings, rows: list[Row], meta: dict) -> None:
    method = METHOD.format(steps=settings.budget.steps, timed_s=settings.budget.timed_s,
                           warmup=settings.budget.warmup,
                           warmup_compiled=warmup_steps(settings.budget, {"compile": True}))  # fmt: skip
    paper = "\n".join(f"- {shape}, {rung}: {text}" for (shape, rung), text in PAPER.items())
    text = "\n\n".join([
        header(settings, meta, rows),
        "## Against the issue's targets\n\n" + "\n".join(verdicts(rows)),
        "## The paper's numbers these rows are read against\n\n" + paper
        + "\n- Targets (read against, not tuned to): " + "; ".join(TARGETS) + ".",
        "## The table\n\n" + table(rows, settings, meta["peak"]),
        method.strip(),
        COVERAGE.strip(),
    ])  # fmt: skip
    settings.out.parent.mkdir(parents=True, exist_ok=True)
    settings.out.write_text(text.rstrip() + "\n")


def matmul_peak(device: torch.device) -> float:
    """Best bf16 FLOP/s of a square matmul on ``device`` (8192 on CUDA, 512 on a CPU)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = math.inf
    for _ in range(8):
        Meter(device).sync()
        start = time.perf_counter()
        a @ b
        Meter(device).sync()
        best = min(best, time.perf_counter() - start)
    del a, b
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the rows' processes get the memory back
    return 2 * n**3 / best


def meta_for(settings: Settings, args: argparse.Namespace, rows: list[Row]) -> dict:
    device = torch.device(settings.device)
    if args.not_run:
        peak, peak_text = 0.0, "not measured yet"
        name, versions = "not run yet", "torch/CUDA versions of the GPU run: not run yet"
        torchtune = "0.6.1 with torchao 0.10.0 planned (carried wheels, `benchmarks/gpu/README.md`)"
    else:
        peak = matmul_peak(device)
        peak_text = f"{peak / 1e9:,.0f} GFLOP/s"
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        cuda = f", CUDA {torch.version.cuda}, driver {_driver()}" if device.type == "cuda" else ""
        versions = f"Python {platform.python_version()}, torch {torch.__version__}{cuda}"
        torchtune = "not reached yet" if "torchtune" in settings.stacks else "not run (`--stacks`)"
    return {
        "date": datetime.date.today().isoformat(), "device": name, "versions": versions,
        "machine": machine(), "load": f"{os.getloadavg()[0]:.1f}", "peak": peak,
        "peak_text": peak_text, "torchtune": torchtune, "not_run": args.not_run,
        "planned_s": planned_s(settings, rows),
        "command": "bash benchmarks/gpu/run.sh" if not settings.dry_run
        else "python benchmarks/gpu/paper_table.py --dry-run",
    }  # fmt: skip


def _driver() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True)  # fmt: skip
    return done.stdout.strip() or "unknown"


def settings_from(args: argparse.Namespace) -> Settings:
    shapes = tuple(s for s in GPU_SHAPES if not args.shapes or s.name in args.shapes)
    if args.dry_run:
        budget = Budget(
            warmup=1,
            compile_warmup=0,
            steps=2,
            timed_s=0.0,
            start_s=0.0,
            compile_s=0.0,
            eight_bit_s=0.0,
        )
        budget_s = math.inf if args.budget_s is None else args.budget_s
        return Settings("cpu", tuple(replace(s, batch=2) for s in shapes), budget, budget_s,
                        seq=64, longest=16, compile_backend="eager", dry_run=True,
                        torchtune_site=args.torchtune_site, out=Path(args.out),
                        stacks=tuple(args.stacks))  # fmt: skip
    budget_s = BUDGET_S if args.budget_s is None else args.budget_s
    return Settings(args.device, shapes, Budget(), budget_s, torchtune_site=args.torchtune_site,
                    compile_backend=args.compile_backend, out=Path(args.out),
                    stacks=tuple(args.stacks))  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget-s", type=float,
                        help=f"seconds for all rows, start-ups included (default {BUDGET_S:.0f}; "
                        "a dry run has none)")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in GPU_SHAPES])
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--torchtune-site", help="a folder holding torchtune and its torchao")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, 2 steps, CPU")
    parser.add_argument("--not-run", action="store_true", help="write the plan only")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    settings = settings_from(args)
    if args.child:
        job = json.loads(args.child)
        for group in job["groups"]:
            shape = Shape(**{**group["shape"], "stacks": tuple(group["shape"]["stacks"])})
            run_group(settings, shape, group["stack"], group["rungs"], job["deadline"])
        return 0
    if not args.not_run and settings.device == "cuda" and not torch.cuda.is_available():
        print("paper_table: no CUDA device here (--dry-run runs on the CPU)", file=sys.stderr)
        return 2
    started = time.time()
    rows = plan(settings)
    meta = meta_for(settings, args, rows)
    print(f"plan: {sum(r.status == 'planned' for r in rows)} of {len(rows)} rows, "
          f"~{meta['planned_s']:.0f} s planned ({_budget(settings)})", flush=True)  # fmt: skip
    for row in rows:
        print(f"  {row.shape} | {row.stack} | {row.rung}: ~{row.estimate_s:.0f} s"
              + (f" ({row.why})" if row.why else ""))  # fmt: skip
    write_report(settings, rows, meta)
    if args.not_run:
        print(f"wrote {settings.out}")
        return 0
    stderr_log(settings).write_text("")
    run_groups(settings, rows, started, meta)
    meta["elapsed"] = f"; took {time.time() - started:.0f} s"
    write_report(settings, rows, meta)
    print(f"wrote {settings.out}")
    return 1 if any(r.status == "failed" and r.stack == "tunesmith" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
