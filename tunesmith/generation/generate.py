"""Batched autoregressive decoding for :class:`~tunesmith.modules.decoder.TransformerLM`.

Prompts of different lengths are left padded; a 2-D attention mask hides the padding and
per-row position ids count only real tokens (``cumsum(mask) - 1``, as transformers does), so
each row decodes exactly as it would alone. With ``use_cache=True`` the prompt is prefilled
into a KV cache once and each step feeds one token per row; ``use_cache=False`` recomputes
the whole sequence every step (slow; a reference for tests and benchmarks).

A row ends at its own ``max_new_tokens`` (``"length"``), at a stop token or at a stop string
(``"stop"``). Under data parallelism with a sharded model (FSDP2: every forward is a
collective) pass ``sync_ranks=True``: every rank then runs the same number of decode steps.

A tensor-parallel model (its parameters DTensors on a mesh with a ``tp`` dimension, as
:func:`~tunesmith.training.parallelize.parallelize` makes; or pass ``tp_group``) decodes one
batch on all the ranks of its ``tp`` group: they must pass the same prompts and settings
(checked once, one all-reduce), and each step every rank takes the tokens and log-probs
sampled on the group's first rank (one broadcast of ``[2, b]`` numbers), so the group's ranks
hold the same tokens whatever their random generators, and stop at the same step.

Generation runs under ``torch.no_grad()``, not ``inference_mode()``: FSDP2 all-gathers into
parameter buffers it keeps for later forwards, and inference tensors there would break the
training step that follows. A sharded model is resharded before :func:`generate` returns.

Example::

    >>> from tunesmith.models import llama3
    >>> model = llama3.llama3_tiny()
    >>> out = generate(model, [[1, 5, 7], [1, 9]], max_new_tokens=[4, 2], stop_token_ids=[2])
    >>> [len(s) <= n for s, n in zip(out.sequences, [4, 2])], out.prompt_lengths
    ([True, True], [3, 2])
    >>> out.new_tokens == sum(map(len, out.sequences)), out.seconds > 0
    (True, True)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tunesmith.generation.sampling import LogitsProcessor, build_processors, sample
from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.modules.decoder import TransformerLM
from tunesmith.modules.masks import padding_position_ids

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "CheckedCall",
    "FinishReason",
    "GenerationOutput",
    "check_call",
    "generate",
    "left_pad",
    "model_positions",
]

FinishReason = Literal["stop", "length"]


@dataclass
class GenerationOutput:
    """Result of :func:`generate`, one entry per prompt, in prompt order.

    ``sequences[i]`` holds only the new tokens (the stop token, or the token that completed a
    stop string, included when the row stopped; nothing after it). ``logprobs[i][j]`` is the
    raw policy log-prob of ``sequences[i][j]`` (see
    :func:`tunesmith.generation.sampling.sample`). ``finish_reasons[i]`` is ``"stop"`` when a
    stop token or stop string ended the row, else ``"length"`` (its ``max_new_tokens``).
    ``seconds`` is the wall time of the :func:`generate` call, so
    ``out.new_tokens / out.seconds`` is the generated tokens per second. ``stats``: what the
    engine did (the paged engine's prefilled tokens, decode steps, slots and cache blocks).

    Example::

        >>> out = GenerationOutput([[4, 2], [7]], [[-0.1, -0.2], [-0.3]], [3, 2],
        ...                        ["stop", "length"], seconds=0.5)
        >>> out.new_tokens, out.new_tokens / out.seconds
        (3, 6.0)
    """

    sequences: list[list[int]]
    logprobs: list[list[float]]
    prompt_lengths: list[int]
    finish_reasons: list[FinishReason]
    seconds: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        """Generated tokens over all rows (the sum of the sequences' lengths)."""
        return sum(len(s) for s in self.sequences)


def _as_token_lists(
    prompts: Sequence[Sequence[int]] | Tensor, allow_empty: bool = False
) -> list[list[int]]:
    if isinstance(prompts, Tensor):
        if prompts.dim() == 1:
            prompts = prompts[None]
        if prompts.dim() != 2:
            raise ValueError(
                f"prompts tensor must be 1-D or 2-D token ids, got shape {tuple(prompts.shape)}"
            )
        if prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(f"prompts tensor must hold integer token ids, got {prompts.dtype}")
        return prompts.tolist()
    rows = [list(map(int, row)) for row in prompts]
    if not rows and not allow_empty:
        raise ValueError("prompts is empty: give at least one prompt")
    return rows


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int = 0, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask, position_ids)``, each ``[b, L]``.

    ``attention_mask`` is 1 on real tokens, 0 on padding (``torch.long``); ``position_ids``
    count real tokens only (``cumsum(mask) - 1``; 0 on padding).

    Example::

        >>> ids, mask, pos = left_pad([[5, 6, 7], [8]], pad_id=0)
        >>> ids.tolist(), mask.tolist(), pos.tolist()
        ([[5, 6, 7], [0, 0, 8]], [[1, 1, 1], [0, 0, 1]], [[0, 1, 2], [0, 0, 0]])
    """
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    for i, row in enumerate(prompts):
        if len(row) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    length = max(len(row) for row in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), length), dtype=torch.long)
    for i, row in enumerate(prompts):
        ids[i, length - len(row) :] = torch.as_tensor(list(row), dtype=torch.long)
        mask[i, length - len(row) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, padding_position_ids(mask)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _check_vocab(rows: list[list[int]], model: nn.Module) -> None:
    spec = getattr(model, "spec", None)
    vocab = getattr(spec, "vocab_size", None)
    for i, row in enumerate(rows):
        low, high = min(row), max(row)
        if low < 0 or (vocab is not None and high >= vocab):
            bad = low if low < 0 else high
            raise ValueError(
                f"prompt {i} holds token id {bad}, outside the model's vocabulary [0, {vocab})"
            )


def model_positions(model: nn.Module) -> int | None:
    """The most positions ``model`` was built for (its ``max_position_embeddings``), if known.

    Example::

        >>> from tunesmith.models import llama3
        >>> model_positions(llama3.llama3_tiny()) > 0
        True
    """
    for holder in (getattr(model, "spec", None), getattr(model, "config", None)):
        positions = getattr(holder, "max_position_embeddings", None)
        if isinstance(positions, int) and not isinstance(positions, bool):
            return positions
    return None


def _check_positions(rows: list[list[int]], model: nn.Module) -> None:
    """Refuse a prompt with more tokens than the model has positions (it would be decoded at
    positions the model never saw, silently)."""
    positions = model_positions(model)
    for i, row in enumerate(rows):
        if positions is not None and len(row) >= positions:
            raise ValueError(
                f"prompt {i} has {len(row)} tokens; the model has {positions} positions "
                "(max_position_embeddings), which leaves no room to generate: shorten it"
            )


def _last_logits(model: nn.Module, input_ids: Tensor, **kwargs: object) -> Tensor:
    """Logits ``[b, V]`` of the last position only.

    A ``TransformerLM`` (or the transformers backend's ``TransformersLM``) projects only the
    last hidden state (``logits_to_keep=1``), so a long prefill never materialises
    ``[b, s, V]`` logits; other models run their full forward.
    """
    if isinstance(model, (TransformerLM, TransformersLM)):
        return model(input_ids, logits_to_keep=1, **kwargs)[:, -1]
    return model(input_ids, **kwargs)[:, -1]


def row_limits(max_new_tokens: int | Sequence[int], batch: int) -> list[int]:
    """One ``max_new_tokens`` per prompt, each checked to be an int >= 0.

    >>> row_limits(3, 2), row_limits([0, 5], 2)
    ([3, 3], [0, 5])
    """

    def bad(value: object) -> bool:
        return not isinstance(value, int) or isinstance(value, bool) or value < 0

    if isinstance(max_new_tokens, int):
        if bad(max_new_tokens):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        return [max_new_tokens] * batch
    if isinstance(max_new_tokens, Tensor):
        max_new_tokens = max_new_tokens.tolist()
    if isinstance(max_new_tokens, str | bytes) or not isinstance(max_new_tokens, Sequence):
        raise ValueError(
            f"max_new_tokens must be an int or one int per prompt, got {max_new_tokens!r}"
        )
    limits = list(max_new_tokens)
    if len(limits) != batch:
        raise ValueError(
            f"max_new_tokens has {len(limits)} entries but there are {batch} prompts: "
            "give one per prompt (or a single int)"
        )
    for i, value in enumerate(limits):
        if bad(value):
            raise ValueError(f"max_new_tokens[{i}] must be an int >= 0, got {value!r}")
    return limits


class _StopStrings:
    """Tells whether a completion's decoded text contains any of ``stops``.

    Only the last ``window`` tokens are decoded each step (enough to hold the longest stop
    string: every token adds at least one byte), and a hit there is confirmed on the whole
    completion, so decoding stays cheap on long rollouts and a text artefact at the window's
    start (a multi-byte character cut in half) cannot cause a false stop.
    """

    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str] | None) -> None:
        self.stops = tuple(stops)
        for i, stop in enumerate(self.stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop_strings[{i}] must be a non-empty string, got {stop!r}")
        if self.stops and decode is None:
            raise ValueError(
                "stop_strings need decode= (token ids -> text), e.g. "
                "decode=tokenizer.decode, to find them in the generated text"
            )
        self.decode = decode
        self.window = max((len(s.encode("utf-8")) for s in self.stops), default=0) + 8

    def __bool__(self) -> bool:
        return bool(self.stops)

    def _found(self, ids: list[int]) -> bool:
        assert self.decode is not None
        text = self.decode(ids)
        return any(stop in text for stop in self.stops)

    def __call__(self, completion: list[int]) -> bool:
        if len(completion) <= self.window:
            return self._found(completion)
        return self._found(completion[-self.window :]) and self._found(completion)


def _find_tp_group(model: nn.Module) -> ProcessGroup | None:
    """The ``tp`` group of a model whose parameters are DTensors on a mesh with a ``tp``
    dimension (tensor parallel, with or without FSDP2 on top); None for any other model."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        if isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ()):
            return param.device_mesh.get_group("tp")
    return None


class _SharedTokens:
    """Keeps the ranks of a tensor-parallel group on one batch: they decode the same rows, so
    each step they take the tokens (and log-probs) sampled on the group's first rank. Inactive
    (every call local) without a group of more than one rank."""

    def __init__(self, group: ProcessGroup | None, device: torch.device) -> None:
        self.active = group is not None and dist.get_world_size(group) > 1
        self.group, self.device = group, device

    def check_same(self, what: object) -> None:
        """Raise on every rank unless ``what`` (prompts, limits, settings) is equal on every
        rank of the group (one all-reduce of a hash and its negation)."""
        if not self.active:
            return
        h = int.from_bytes(hashlib.blake2b(repr(what).encode(), digest_size=7).digest(), "big")
        both = torch.tensor([h, -h], dtype=torch.long, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if int(both[0]) != -int(both[1]):
            raise ValueError(
                "generate on a tensor-parallel model: the ranks of a tp group decode one batch "
                "together and must pass the same prompts, max_new_tokens, row_keys, stop "
                f"tokens/strings and sampling settings, but rank {dist.get_rank()}'s differ "
                "from another tp rank's (split prompts over ctx.dp_rank, not the global rank)"
            )

    def __call__(self, tokens: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
        """The group's first rank's ``tokens`` and ``logprobs`` (``[b]`` each)."""
        if not self.active:
            return tokens, logprobs
        both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)])
        dist.broadcast(both, group=self.group, group_src=0)
        return both[0].to(tokens.dtype), both[1].to(logprobs.dtype)


class _RankSync:
    """Makes the ranks of ``group`` agree on the number of decode steps (FSDP2: every forward
    is a collective, so a rank that stops early would leave the others waiting forever).
    Inactive (every call local) outside a process group of more than one rank."""

    def __init__(self, enabled: bool, group: ProcessGroup | None, device: torch.device) -> None:
        self.active = (
            enabled
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(group) > 1
        )
        self.group = group
        self.device = device

    def max(self, *values: int) -> list[int]:
        """The element-wise max of ``values`` over the ranks (one all-reduce)."""
        if not self.active:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.long, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return tensor.tolist()

    def all_finished(self, finished: Tensor) -> bool:
        """Whether every row on every rank is finished (one all-reduce of a flag)."""
        if not self.active:
            return bool(finished.all())
        busy = (~finished).any().to(torch.long).reshape(1)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.group)
        return not bool(busy.item())


def _reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 left gathered (a forward without backward keeps the root's
    unsharded) and register the sharded ones again, as after a training step."""
    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@dataclass
class CheckedCall:
    """A decode call's arguments, checked once, as both engines start from them (see
    :func:`check_call`)."""

    rows: list[list[int]]
    limits: list[int]
    keys: list[int] | None
    stop_ids: list[int]
    stops: _StopStrings
    device: torch.device
    shared: _SharedTokens
    sync: _RankSync


def check_call(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | Tensor,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    stop_token_ids: Sequence[int],
    stop_strings: Sequence[str],
    decode: Callable[[list[int]], str] | None,
    pad_id: int,
    row_keys: Sequence[int] | Tensor | None,
    sync_ranks: bool,
    sync_group: ProcessGroup | None,
    tp_group: ProcessGroup | None,
    engine: object,
) -> CheckedCall:
    """Check a :func:`generate` call's arguments (the same for every engine) before any work:
    sampling settings, stop strings, prompts (token ids in the vocabulary, room to generate),
    one limit and key per prompt; tp ranks must agree on all of it and on ``engine`` (the
    engine's own settings).

    >>> from tunesmith.models import llama3
    >>> check_call(llama3.llama3_tiny(), [[1, 2], []], max_new_tokens=2, temperature=0.0,
    ...            top_k=None, top_p=None, min_p=None, stop_token_ids=(), stop_strings=(),
    ...            decode=None, pad_id=0, row_keys=None, sync_ranks=False, sync_group=None,
    ...            tp_group=None, engine=None)
    Traceback (most recent call last):
    ValueError: prompt 1 is empty: every prompt needs at least one token
    """
    sync_wanted = sync_ranks or sync_group is not None
    build_processors(temperature, top_k, top_p, min_p)  # validate the settings before any work
    stops = _StopStrings(stop_strings, decode)
    rows = _as_token_lists(prompts, allow_empty=sync_wanted)
    limits = row_limits(max_new_tokens, len(rows))
    keys = None if row_keys is None else [int(k) for k in torch.as_tensor(row_keys).flatten()]
    if keys is not None and len(keys) != len(rows):
        raise ValueError(f"row_keys has {len(keys)} keys for {len(rows)} prompts")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    _check_vocab(rows, model)
    _check_positions(rows, model)
    device = _model_device(model)
    stop_ids = sorted(set(map(int, stop_token_ids)))
    shared = _SharedTokens(tp_group if tp_group is not None else _find_tp_group(model), device)
    shared.check_same(
        (rows, limits, keys, stop_ids, tuple(stop_strings), temperature, top_k, top_p, min_p,
         pad_id, engine)
    )  # fmt: skip
    sync = _RankSync(sync_wanted, sync_group, device)
    return CheckedCall(rows, limits, keys, stop_ids, stops, device, shared, sync)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]] | Tensor,
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    stop_token_ids: Sequence[int] = (),
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
    row_keys: Sequence[int] | Tensor | None = None,
    use_cache: bool = True,
    processors: Sequence[LogitsProcessor] = (),
    sync_ranks: bool = False,
    sync_group: ProcessGroup | None = None,
    tp_group: ProcessGroup | None = None,
) -> GenerationOutput:
    """Decode up to ``max_new_tokens`` tokens for every prompt, batched.

    Args:
        model: a ``TransformerLM`` (``forward(input_ids, position_ids=, attention_mask=,
            kv_cache=)`` and ``init_kv_cache``); it runs on whatever device/dtype it is on,
            FSDP2-sharded or not.
        prompts: token lists of any lengths, or an integer tensor ``[b, s]`` / ``[s]`` whose
            entries are all real tokens (no padding).
        max_new_tokens: one limit for all rows, or one per prompt; a row that reaches its
            limit finishes with reason ``"length"``.
        temperature: 0 is greedy; > 0 samples (with ``top_k``/``top_p``/``min_p`` filtering).
        stop_token_ids: a row ends after it emits any of these (kept in its sequence).
        stop_strings: a row ends at the first token after which its decoded completion (the
            new tokens only, through ``decode``) contains any of these; that token is the
            last of its sequence. Needs ``decode``, e.g. ``tokenizer.decode``.
        pad_id: token fed for finished rows and used as left padding (always masked out).
        generator: ``torch.Generator`` on the model's device, for repeatable sampling.
        row_keys: one integer key per prompt (in ``[0, 2**32)``) for keyed sampling instead
            of ``generator``: row ``i``'s completion then depends only on its key, its prompt
            and the model, not on the rest of the batch (see :mod:`tunesmith.generation.keyed`).
        use_cache: KV cache (prefill, then one token per step) or full recompute per step.
        processors: extra logits processors applied after temperature/top-k/top-p/min-p.
        sync_ranks: run as many decode steps as the rank that needs the most, so that every
            rank of ``sync_group`` makes the same forward calls: needed whenever the forward
            is a collective (FSDP2). Every rank of the group must call :func:`generate`
            (``prompts`` may differ in number and length, and may be empty on some ranks).
            Costs one all-reduce at the start (the largest ``max_new_tokens`` over ranks,
            which sizes every rank's loop) and one per step when rows can stop early.
        sync_group: the process group to agree over; ``None`` is the default group (every
            rank). Giving a group turns ``sync_ranks`` on.
        tp_group: the tensor-parallel group of a TP-sharded model, whose ranks decode one
            batch (same prompts and settings on each; every step they take the first rank's
            tokens). ``None`` finds it from the model: the ``tp`` dimension of its DTensor
            parameters' mesh (what ``parallelize`` builds); give it for a mesh of other names.
            Under data parallelism too (FSDP2 on top), ``sync_ranks`` is still needed.

    The model's train/eval mode is left as it is (call ``model.eval()`` if it has dropout).
    Runs under ``torch.no_grad()`` (see the module docs), so the model can be trained right
    after.
    """
    started = time.perf_counter()
    call = check_call(
        model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, stop_token_ids=stop_token_ids, stop_strings=stop_strings,
        decode=decode, pad_id=pad_id, row_keys=row_keys, sync_ranks=sync_ranks,
        sync_group=sync_group, tp_group=tp_group, engine=use_cache,
    )  # fmt: skip
    rows, limits, stop_ids, device, shared = (
        call.rows,
        call.limits,
        call.stop_ids,
        call.device,
        call.shared,
    )
    stop_strings_check = call.stops
    prompt_lengths = [len(r) for r in rows]
    n_rows = len(rows)
    keys = None if call.keys is None else torch.tensor(call.keys, dtype=torch.int64)
    if not rows:  # a rank with nothing to do still joins every step: one masked dummy row
        rows, limits = [[pad_id]], [0]
        keys = None if keys is None else torch.zeros(1, dtype=torch.int64)
    sync = call.sync
    # The loop runs ``steps`` times at most on every rank; it can end earlier only if a row
    # can stop before its limit (a stop token or string on some rank).
    steps, can_stop = sync.max(max(limits), int(bool(stop_ids) or bool(stop_strings_check)))
    if steps == 0:
        return GenerationOutput(
            [[] for _ in range(n_rows)],
            [[] for _ in range(n_rows)],
            prompt_lengths,
            ["length"] * n_rows,
            seconds=time.perf_counter() - started,
        )

    input_ids, prompt_mask, prompt_pos = left_pad(rows, pad_id, device)
    batch, prompt_len = input_ids.shape
    padded = not bool(prompt_mask.all())
    total_len = prompt_len + steps
    # The full mask for every step: generated positions are always "real" (finished rows keep
    # decoding pad tokens whose outputs are discarded). ``None`` when there is no padding.
    full_mask = torch.ones((batch, total_len), dtype=torch.long, device=device)
    full_mask[:, :prompt_len] = prompt_mask
    next_pos = prompt_pos[:, -1] + 1
    full_pos = torch.cat(
        [prompt_pos, next_pos[:, None] + torch.arange(steps, device=device)], dim=1
    )
    tokens = torch.full((batch, total_len), pad_id, dtype=torch.long, device=device)
    tokens[:, :prompt_len] = input_ids

    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    limit = torch.tensor(limits, dtype=torch.long, device=device)
    finished = limit == 0
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    completions: list[list[int]] = [[] for _ in range(batch)]  # host copies, for stop strings

    def mask_upto(end: int) -> Tensor | None:
        return full_mask[:, :end] if padded else None

    cache = model.init_kv_cache(batch, total_len, device=device) if use_cache else None
    logits = _last_logits(
        model,
        input_ids,
        position_ids=prompt_pos,
        attention_mask=mask_upto(prompt_len),
        kv_cache=cache,
    )
    for step in range(steps):
        out = sample(
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            processors=processors,
            generator=generator,
            keys=keys,
            step=step,
        )
        sampled, sampled_logprobs = shared(out.tokens, out.logprobs)  # tp: the first rank's
        running = ~finished
        new = torch.where(running, sampled, torch.full_like(sampled, pad_id))
        cur = prompt_len + step
        tokens[:, cur] = new
        logprobs[:, step] = sampled_logprobs
        lengths += running.long()
        if stop.numel():
            stopped |= running & torch.isin(new, stop)
        if stop_strings_check:
            hits = []
            for i, (token, live) in enumerate(zip(new.tolist(), running.tolist())):
                if live:
                    completions[i].append(token)
                    if stop_strings_check(completions[i]):
                        hits.append(i)
            if hits:
                stopped[hits] = True
        finished |= stopped | (lengths >= limit)
        # The only per-step host sync (an all-reduce under sync_ranks), and only when rows
        # can stop early.
        if step == steps - 1 or (can_stop and sync.all_finished(finished)):
            break
        if use_cache:
            logits = _last_logits(
                model,
                new[:, None],
                position_ids=full_pos[:, cur : cur + 1],
                attention_mask=mask_upto(cur + 1),
                kv_cache=cache,
            )
        else:
            logits = _last_logits(
                model,
                tokens[:, : cur + 1],
                position_ids=full_pos[:, : cur + 1],
                attention_mask=mask_upto(cur + 1),
            )
    _reshard(model)

    generated = tokens[:n_rows, prompt_len:].tolist()
    lps = logprobs[:n_rows].tolist()
    n_new = lengths.tolist()
    done = stopped.tolist()
    return GenerationOutput(
        sequences=[generated[i][: n_new[i]] for i in range(n_rows)],
        logprobs=[lps[i][: n_new[i]] for i in range(n_rows)],
        prompt_lengths=prompt_lengths,
        finish_reasons=["stop" if done[i] else "length" for i in range(n_rows)],
        seconds=time.perf_counter() - started,
    )
