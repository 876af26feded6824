"""The set-up every recipe shares, one step per function, so a recipe file keeps only its
objective and what is its own.

* :func:`rank_zero_log`: ``print`` on rank 0, nothing elsewhere;
* :func:`load_tokenizer`, :func:`pad_id`, :func:`datasets_for` (training and validation
  sets), :func:`token_batches` (SFT samples packed or padded; the pack length is the
  dataset's own ``max_seq_len``), :func:`sft_batches` (the training and validation sets
  alike, one collate for both);
* :func:`build_policy`: the trained model, checked against the tokenizer (:func:`check_vocab`);
* :func:`apply_attention_backend`: the ``attention_backend`` key set on every decoder of a
  model (``build_policy`` and ``frozen_model`` call it);
* :func:`frozen_model`: a model that is never trained (DPO reference, KD teacher), frozen,
  placed and sharded like the policy, optionally offloaded;
* :func:`reference_policy`: the frozen policy a KL or a preference loss compares against
  (``reference_model``, the policy with its adapters off, or a frozen copy);
* :func:`compiled_loss` and :func:`memory_plan`: ``compile`` and the memory estimate, for
  every recipe (the layers are compiled by
  :func:`~tunesmith.training.parallelize.parallelize`).

Example (the prologue of a recipe)::

    log = rank_zero_log(ctx)
    tokenizer = load_tokenizer(cfg)
    dataset, val_dataset = datasets_for(cfg, tokenizer, log)
    dataset, val_dataset, collate = sft_batches(cfg, dataset, val_dataset, tokenizer)
    model = build_policy(cfg, ctx, tokenizer)
    teacher = frozen_model(cfg, ctx, "teacher_model")
    model = parallelize(model, ctx, cfg)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn
from torch.utils.data import Subset

from tunesmith.config import instantiate
from tunesmith.data import packed_or_padded
from tunesmith.models.peft_io import peft_adapter_config
from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.modules.decoder import DecoderModel
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.modules.peft import adapter_modules, disable_adapters
from tunesmith.training import fp8, qat
from tunesmith.training.datasets import build_datasets
from tunesmith.training.memory.compile import compile_loss, compile_options
from tunesmith.training.memory.planner import MemoryPlan, estimate_memory, optimizer_kind
from tunesmith.training.memory.preflight import longest_batch
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.precision import cast_weights, check_precision
from tunesmith.training.settings import MODEL_KEYS, value_of  # the model steps' keys

__all__ = [
    "MODEL_KEYS",
    "apply_attention_backend",
    "build_policy",
    "check_vocab",
    "compiled_loss",
    "datasets_for",
    "frozen_model",
    "load_tokenizer",
    "memory_plan",
    "packing_length",
    "pad_id",
    "rank_zero_log",
    "FrozenPolicy",
    "reference_policy",
    "sft_batches",
    "token_batches",
]


Log = Callable[..., None]


def rank_zero_log(ctx: DistributedContext) -> Log:
    """``print`` on rank 0, a no-op on the other ranks.

    Example::

        log = rank_zero_log(ctx); log("dataset: 100 samples")
    """
    return print if ctx.is_rank_zero else (lambda *a, **k: None)


def load_tokenizer(cfg: DictConfig) -> Any:
    """The tokenizer of ``cfg.tokenizer``.

    Example::

        tokenizer = load_tokenizer(cfg)
    """
    return instantiate(cfg.tokenizer)


def pad_id(tokenizer: Any) -> int:
    """The tokenizer's pad id, 0 when it has none (padding is masked out of every loss).

    >>> class NoPad:  # a tokenizer without a pad token
    ...     pad_id = None
    >>> pad_id(NoPad())
    0
    """
    return tokenizer.pad_id if tokenizer.pad_id is not None else 0


def datasets_for(
    cfg: DictConfig, tokenizer: Any, log: Log = print
) -> tuple[Sequence[Any], Sequence[Any] | None]:
    """The training set and the validation set (or None) of ``cfg``: see
    :func:`~tunesmith.training.datasets.build_datasets`.

    Example::

        dataset, val_dataset = datasets_for(cfg, tokenizer, log)
    """
    return build_datasets(cfg, tokenizer, log)


def packing_length(dataset: Sequence[Any]) -> int | None:
    """The length of a pack of ``dataset``: its ``max_seq_len`` (that of the dataset a
    training/validation split was taken from), None when it sets none.

    >>> class Samples(list):  # e.g. SFTDataset(tok, source="chat.jsonl", max_seq_len=512)
    ...     max_seq_len = 512
    >>> packing_length(Subset(Samples([{}] * 4), [0, 1]))  # a split: its dataset's length
    512
    >>> packing_length([{"input_ids": [1]}]) is None
    True
    """
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return getattr(dataset, "max_seq_len", None)


def token_batches(
    cfg: DictConfig, dataset: Sequence[Any], tokenizer: Any
) -> tuple[Sequence[Any], Callable[[list[Any]], dict[str, torch.Tensor]]]:
    """SFT samples as a loader should draw them, and their collate: with ``packed: true``
    packs of :func:`packing_length` tokens, else the samples padded per batch.

    Example::

        dataset, collate = token_batches(cfg, dataset, tokenizer)
    """
    packed = bool(value_of(cfg, "packed"))
    length = packing_length(dataset)
    if packed and length is None:
        raise ValueError(
            f"packed: true needs the dataset's max_seq_len (the length of each pack), and "
            f"{type(dataset).__name__} sets none: give the dataset a max_seq_len"
        )
    return packed_or_padded(dataset, packed=packed, max_seq_len=length, pad_id=pad_id(tokenizer))


def sft_batches(
    cfg: DictConfig, dataset: Sequence[Any], val_dataset: Sequence[Any] | None, tokenizer: Any
) -> tuple[Sequence[Any], Sequence[Any] | None, Callable[[list[Any]], dict[str, torch.Tensor]]]:
    """:func:`token_batches` of the training set and, the same way, of the validation set (None
    stays None), and the one collate of both: the loop evaluates ``val_dataset`` with the
    training collate (:meth:`~tunesmith.training.trainer.Trainer.evaluate`), so with
    ``packed: true`` the held-out samples are packed too (to their dataset's ``max_seq_len``;
    a ``val_fraction`` split: the training set's).

    Packed, the validation loss is the unpacked one: it is summed over the trained tokens and
    divided by their count, and a pack gives every token the loss it has alone (attention
    within its document, positions restarting at each document, no target across documents).
    The validation batches then have the training batches' ``[batch_size, max_seq_len]``
    shape: the memory plan, the compiled layers and the attention backend are the training's.

    Example::

        dataset, val_dataset, collate = sft_batches(cfg, dataset, val_dataset, tokenizer)
    """
    dataset, collate = token_batches(cfg, dataset, tokenizer)
    if val_dataset is not None:
        val_dataset, _ = token_batches(cfg, val_dataset, tokenizer)
    return dataset, val_dataset, collate


def check_vocab(tokenizer: Any, model: nn.Module, cfg: DictConfig, key: str = "model") -> None:
    """Refuse a tokenizer whose ids run past the embedding of ``model`` (built from
    ``cfg[key]``): a model of another vocabulary would index out of range, or on a GPU read
    garbage rows, in the middle of the first step."""
    rows = getattr(getattr(model, "spec", None), "vocab_size", None)
    if rows is not None and tokenizer.vocab_size > rows:
        node = cfg[key]
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name', cfg.tokenizer)} has {tokenizer.vocab_size} "
            f"token ids but {key} ({node.get('path', node._component_)}) embeds only {rows} "
            f"(model.embed_tokens.weight): {key} belongs to another vocabulary"
        )


def build_policy(
    cfg: DictConfig, ctx: DistributedContext, tokenizer: Any, *, on_device: bool = True
) -> nn.Module:
    """The trained model of ``cfg.model`` (on ``ctx.device`` unless ``on_device=False``, e.g.
    to copy a frozen reference on the host first); a tokenizer whose ids it cannot embed is
    refused. Parallelize it after the recipe's own changes.

    Example::

        model = _parallelize(build_policy(cfg, ctx, tokenizer), ctx, cfg)
    """
    model = instantiate(cfg.model)
    check_trainable(model, cfg)
    if adapter_modules(model):  # adapters the PEFT format cannot hold: refused now, not at a save
        peft_adapter_config(model)
    cast_weights(model, check_precision(cfg))  # precision.weights: bf16 casts the trained model
    if (qat_settings := qat.QATSettings.from_config(cfg)) is not None:
        if ctx.dims is not None and ctx.dims.tp > 1:
            raise ValueError("quantization.qat with tensor parallel (tp > 1) is not supported")
        qat.prepare(model, qat_settings)  # fake quantization: the deployed model's rounding
    # precision.matmuls: float8 linears before parallelize, whose FSDP2 shards them (on CUDA,
    # tensorwise weights all-gathered in float8; gloo cannot all-gather float8)
    fp8.prepare(model, cfg, ctx.device, fsdp=ctx.dp_cp_size > 1 and ctx.device.type == "cuda")
    apply_attention_backend(model, cfg.get("attention_backend"))
    check_packing(model, cfg)
    if on_device:
        model = model.to(ctx.device)
    check_vocab(tokenizer, model, cfg)
    return model


def check_trainable(model: nn.Module, cfg: DictConfig, key: str = "model") -> None:
    """Refuse a quantized model (``tunesmith export --quantize``'s folder, loaded by
    transformers) as the trained one: its int weights take no gradient. Quantization-aware
    training trains the float model (``quantization.qat``)."""
    hf_model = getattr(model, "hf_model", None)
    quantization = getattr(getattr(hf_model, "config", None), "quantization_config", None)
    if quantization is not None:
        node = cfg[key]
        raise ValueError(
            f"{key} ({node.get('path', node._component_)}) is a quantized checkpoint, which "
            "cannot be trained: train its float model (with quantization.qat for the "
            "quantized rounding), then export it with tunesmith export --quantize"
        )


def check_packing(model: nn.Module, cfg: DictConfig, key: str = "model") -> None:
    """Refuse ``packed: true`` for a model whose layers would run across the documents of a
    packed row (the transformers backend's convolution or recurrent layers), before any
    data is read or step is run."""
    if value_of(cfg, "packed") and not getattr(model, "accepts_packing", True):
        node = cfg[key]
        raise ValueError(
            f"packed: true, but {key} ({node.get('path', node._component_)}, "
            f"{model.spec.model_type} on the transformers backend) has layers that are not "
            "attention, which would run across the documents of a packed row: set packed: false"
        )


def apply_attention_backend(model: nn.Module, name: str | None) -> nn.Module:
    """Set ``name`` (``auto``, ``sdpa``, ``varlen``, ``flex``, ``loop``; the config's
    ``attention_backend``) on every :class:`~tunesmith.modules.decoder.DecoderModel` inside
    ``model``; None leaves the models as they are (``auto`` unless built otherwise). A name
    that is no backend, or a model without a decoder to set it on, is refused. A model of the
    transformers backend takes ``auto``, ``sdpa``, ``eager`` (or ``loop``) and ``flex``
    (transformers' own ``attn_implementation``).

    >>> from tunesmith.models import llama3
    >>> model = apply_attention_backend(llama3.llama3_tiny(), "sdpa")
    >>> model.model.attention_backend
    'sdpa'
    >>> apply_attention_backend(llama3.llama3_tiny(), "fast")
    Traceback (most recent call last):
    ValueError: attention_backend must be 'auto' or one of ['flex', 'loop', 'ring', 'sdpa', ...
    """
    if name is None:
        return model
    decoders = [m for m in model.modules() if isinstance(m, (DecoderModel, TransformersLM))]
    if not decoders:
        raise ValueError(
            f"attention_backend: {name!r} is set, but {type(model).__name__} has no "
            "DecoderModel to apply it to; remove the key for this model"
        )
    for decoder in decoders:
        decoder.attention_backend = name  # validates the name
    return model


def frozen_model(
    cfg: DictConfig,
    ctx: DistributedContext,
    key: str,
    *,
    offload: bool = False,
    tokenizer: Any = None,
    copy_of: nn.Module | None = None,
) -> nn.Module:
    """A model that is never trained: ``cfg[key]`` (checked against ``tokenizer`` when
    given), else a deep copy of ``copy_of`` as it is now; without gradients, in eval mode,
    sharded like the policy, and with ``offload`` on a GPU kept in CPU memory between its
    layers' forwards.

    Example::

        teacher = frozen_model(cfg, ctx, "teacher_model", offload=True)
        reference = frozen_model(cfg, ctx, "reference_model", copy_of=policy)
    """
    if cfg.get(key):
        model = instantiate(cfg[key])
        check_packing(model, cfg, key)
        if tokenizer is not None:
            check_vocab(tokenizer, model, cfg, key=key)
    elif copy_of is not None:
        model = copy.deepcopy(copy_of)
    else:
        raise ValueError(f"{key} is not set: give a model component")
    apply_attention_backend(model, cfg.get("attention_backend"))
    model.requires_grad_(False).eval()
    if not (offload and ctx.device.type == "cuda"):  # offloaded: FSDP2 places the shards
        model = model.to(ctx.device)
    return _parallelize(model, ctx, frozen=True, cpu_offload=offload)


@dataclass
class FrozenPolicy:
    """A model used without gradient, under ``context`` (e.g. its adapters disabled).

    Example::

        with reference() as model:
            logits = model(input_ids)
    """

    model: nn.Module
    context: Callable[[nn.Module], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    description: str = ""

    @contextlib.contextmanager
    def __call__(self) -> Iterator[nn.Module]:
        with torch.no_grad(), self.context(self.model):
            yield self.model


def reference_policy(
    cfg: DictConfig,
    ctx: DistributedContext,
    model: nn.Module,
    log: Log = print,
    *,
    tokenizer: Any = None,
) -> FrozenPolicy:
    """The reference policy: ``cfg.reference_model`` (sharded like the policy; offloaded with
    ``reference_offload: true``), else ``model`` with its adapters disabled (LoRA: no second
    copy in memory), else a frozen copy of ``model`` as it is now (before any update: call
    this before sharding). With ``tokenizer``, a ``reference_model`` that cannot embed its
    token ids is refused.

    Example::

        reference = reference_policy(cfg, ctx, model, log, tokenizer=tokenizer)
    """
    if not cfg.get("reference_model") and adapter_modules(model):
        reference = FrozenPolicy(model, disable_adapters, "the policy with its adapters disabled")
    else:
        description = (
            str(cfg.reference_model.get("path", cfg.reference_model._component_))
            if cfg.get("reference_model")
            else "a frozen copy of the initial policy"
        )
        frozen = frozen_model(
            cfg,
            ctx,
            "reference_model",
            offload=bool(value_of(cfg, "reference_offload")),
            tokenizer=tokenizer,
            copy_of=model,
        )
        reference = FrozenPolicy(frozen, description=description)
    log(f"reference: {reference.description}")
    return reference


def compiled_loss(cfg: Mapping[str, Any], loss_fn: nn.Module) -> nn.Module:
    """``loss_fn``, compiled in place when ``cfg.compile`` asks for the loss (see
    :func:`~tunesmith.training.memory.compile.compile_options`).

    >>> from tunesmith.modules.losses import CrossEntropyLoss
    >>> loss_fn = CrossEntropyLoss()
    >>> compiled_loss({"compile": None}, loss_fn) is loss_fn  # compile off: as it is
    True
    >>> loss_fn = compiled_loss({"compile": {"backend": "eager"}}, loss_fn)  # compiled in place
    """
    compiling = compile_options(cfg.get("compile"))
    if compiling is None or not compiling.loss:
        return loss_fn
    return compile_loss(
        loss_fn, backend=compiling.backend, mode=compiling.mode, dynamic=compiling.dynamic
    )


def memory_plan(
    cfg: DictConfig,
    ctx: DistributedContext,
    model: nn.Module,
    dataset: Sequence[Any],
    collate: Callable[[list[Any]], dict[str, torch.Tensor]],
    log: Log,
    *,
    loss_fn: nn.Module | None = None,
    objective: str = "this objective",
) -> MemoryPlan | None:
    """The estimated peak memory of a step on the longest batch of ``dataset``, logged as a
    table. The planner prices a decoder trained on token cross-entropy (``loss_fn``: full or
    linear); for any other ``objective`` (``loss_fn=None``) it logs that it gives no estimate
    and returns None (``preflight: true`` measures a step instead).

    Example::

        plan = memory_plan(cfg, ctx, model, dataset, collate, log, loss_fn=loss_fn)
        memory_plan(cfg, ctx, model, dataset, collate, log, objective="dpo")
        # logs: memory plan: not estimated for dpo (the planner prices token cross-entropy ...)
    """
    if loss_fn is None:
        log(
            f"memory plan: not estimated for {objective} (the planner prices token "
            "cross-entropy only; preflight=true measures a step)"
        )
        return None
    if not hasattr(model, "spec") or not len(dataset):
        return None
    batch = longest_batch(dataset, min(cfg.batch_size, len(dataset)), collate)
    plan = estimate_memory(
        model,
        batch_size=batch["input_ids"].shape[0],
        seq_len=batch["input_ids"].shape[1],
        optimizer=optimizer_kind(cfg.optimizer._component_, cfg.optimizer),
        mixed_precision=cfg.get("mixed_precision"),
        activation_checkpointing=cfg.get("activation_checkpointing"),
        loss=loss_fn if isinstance(loss_fn, LinearCrossEntropyLoss) else "full",
        optimizer_in_backward=bool(value_of(cfg, "optimizer_in_backward")),
        packed="document_ids" in batch,
        world_size=ctx.shard_size,
        parallel=ctx.dims,
        device=ctx.device,
    )
    log(plan.table())
    return plan


def _parallelize(model: nn.Module, ctx: DistributedContext, *args: Any, **kwargs: Any) -> nn.Module:
    """:func:`~tunesmith.training.parallelize.parallelize`, imported when first needed: a Ray
    rollout or reward worker imports this module to build its policy and never shards it, so
    it does not pay for DTensor's import (about a second per actor)."""
    from tunesmith.training.parallelize import parallelize

    return parallelize(model, ctx, *args, **kwargs)
