"""The rollout engine: paged KV cache, shared prompts, continuous batching.

:func:`generate_paged` answers the same call as :func:`~tunesmith.generation.generate` and
returns the same tokens (greedy, and keyed sampling: a row's draws depend only on its key and
its own step; up to float rounding: log-probs agree to about 1e-6, and a keyed draw within
rounding of a token boundary can flip, as between two batchings of the plain engine), but does
less work for them:

* **Shared prompts.** Rows with the same prompt (a GRPO group) are prefilled once; their block
  tables point at the same cache blocks for the prompt's full blocks, and each row gets its own
  copy of the last, partly filled one (copy on write), so the prompt's keys exist once.
* **Continuous batching.** At most ``max_slots`` rows decode at a time within a cache of
  ``kv_cache_mib`` MiB. A row that stops (stop token or string, its own ``max_new_tokens``)
  leaves the batch at once and gives its slot and blocks to the next waiting row, whose prompt
  is prefilled between two decode steps. A finished row costs no more decode work.
* **A static cache.** One pool of blocks, allocated once per call (and released after it, so
  a training step that follows has its memory back); nothing is concatenated or reallocated
  while decoding. Each row reserves the blocks it can need at admission (prompt plus its
  ``max_new_tokens``), so a row never waits for memory mid-way and nothing is truncated.
* **Kept prefixes** (``prefixes``, :mod:`~tunesmith.generation.prefix_cache`): the pool and
  its full blocks outlive the call, and a prompt that starts with kept blocks prefills only
  the rest, so a multi-turn rollout's next turn continues its conversation's cache.
* **A compiled decode step** (``compile=True``): ``torch.compile`` of the decode forward, with
  batch and cache widths rounded up to powers of two so a few graphs serve a whole run (CUDA
  graphs on CUDA: ``mode="reduce-overhead"``).

Under data parallelism with a sharded model (FSDP2, ``sync_ranks``) every rank makes the same
forward calls: each round, one all-reduce says whether any rank prefills or decodes, and a rank
with nothing to do runs a one-token forward on the scratch block. Tensor-parallel ranks take
the first rank's tokens each step, as in the plain engine.

Example::

    >>> from tunesmith.models import llama3
    >>> from tunesmith.generation.generate import generate
    >>> model = llama3.llama3_tiny().eval()
    >>> rows = [[1, 5, 7]] * 4 + [[1, 9]]
    >>> out = generate_paged(model, rows, max_new_tokens=[3, 3, 3, 3, 5], row_keys=[1, 2, 3, 4, 5],
    ...                      temperature=1.0, settings=EngineSettings(max_slots=2))
    >>> out.sequences == generate(model, rows, max_new_tokens=[3, 3, 3, 3, 5],
    ...                           row_keys=[1, 2, 3, 4, 5], temperature=1.0).sequences
    True
    >>> out.stats["prefill_tokens"]  # the shared prompt once, the other once
    5
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from tunesmith.generation.config import EngineSettings
from tunesmith.generation.generate import GenerationOutput, _reshard, check_call
from tunesmith.generation.prefix_cache import PrefixCache
from tunesmith.generation.sampling import LogitsProcessor, sample
from tunesmith.modules.paged_cache import PagedKVCache

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["generate_paged", "supports_paged"]


def supports_paged(model: nn.Module) -> bool:
    """Whether ``model`` can decode with a paged cache (our own ``TransformerLM``s can; the
    transformers backend keeps transformers' own cache and decodes on the plain engine).

    >>> from tunesmith.models import llama3
    >>> supports_paged(llama3.llama3_tiny())
    True
    """
    return callable(getattr(model, "init_paged_kv_cache", None))


def _blocks(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


@dataclass
class _Prompt:
    """One distinct prompt (the shared prefix of the rows that repeat it)."""

    ids: list[int]
    full_blocks: int  # its full cache blocks, shared as they are (the partial one is copied)
    rows_left: int = 0  # rows of this prompt not finished yet
    blocks: list[int] = field(default_factory=list)  # its cache blocks, once prefilled
    logits: Tensor | None = None  # the next-token logits after it, once prefilled
    start: int = 0  # its first position to prefill (those before are kept from earlier calls)
    nodes: list[Any] = field(default_factory=list)  # the kept blocks it pins (PrefixCache)
    private: list[int] = field(default_factory=list)  # its blocks freed when it is done


@dataclass
class _Row:
    index: int
    prompt: _Prompt
    limit: int
    key: int | None
    table: list[int] = field(default_factory=list)  # its block table (shared blocks first)
    own: list[int] = field(default_factory=list)  # the blocks it owns (freed when it ends)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stopped: bool = False


class _BlockPool:
    """Free-list of the cache's blocks (block 0 is scratch, never handed out)."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, 0, -1))
        self.peak_used = 0
        self.num_blocks = num_blocks

    def grow(self, num_blocks: int) -> None:
        """Add the blocks up to ``num_blocks`` (a kept pool made larger)."""
        self.free[:0] = range(num_blocks - 1, self.num_blocks - 1, -1)
        self.num_blocks = num_blocks

    def take(self, n: int) -> list[int]:
        taken = [self.free.pop() for _ in range(n)]
        self.peak_used = max(self.peak_used, self.num_blocks - 1 - len(self.free))
        return taken

    def give(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


class _Scheduler:
    """Which rows decode, which wait, which cache blocks each holds (host side, no tensors)."""

    def __init__(
        self,
        rows: list[list[int]],
        limits: list[int],
        keys: list[int] | None,
        settings: EngineSettings,
        block_size: int,
        prefixes: PrefixCache | None = None,
    ) -> None:
        self.block_size = block_size
        self.prefixes = prefixes
        prompts: dict[tuple[int, ...], _Prompt] = {}
        self.waiting: list[_Row] = []
        self.rows: list[_Row] = []
        for i, (ids, limit) in enumerate(zip(rows, limits)):
            tag: tuple[int, ...] = tuple(ids) if settings.share_prefixes else (i, *ids)
            prompt = prompts.get(tag)
            if prompt is None:
                prompt = prompts[tag] = _Prompt(list(ids), len(ids) // block_size)
            row = _Row(i, prompt, limit, None if keys is None else keys[i])
            self.rows.append(row)
            if limit > 0:  # a row with nothing to generate is answered empty, never prefilled
                prompt.rows_left += 1
                self.waiting.append(row)
        self.max_slots = settings.max_slots or len(rows)
        self.running: list[_Row] = []

    def worst_case_blocks(self) -> int:
        """Blocks for every row at once (each distinct prompt once, less what is kept of it
        from earlier calls), the scratch one too."""
        prompts = {id(r.prompt): r.prompt for r in self.waiting}.values()
        shared = sum(_blocks(len(p.ids), self.block_size) - len(self._kept(p)) for p in prompts)
        return 1 + shared + sum(self._own_blocks(r) for r in self.waiting)

    def _kept(self, prompt: _Prompt) -> list[Any]:
        """The kept blocks of ``prompt``'s start (one token at least is left to prefill, for
        its next-token logits)."""
        if self.prefixes is None:
            return []
        return self.prefixes.match(prompt.ids, most=(len(prompt.ids) - 1) // self.block_size)

    def use_pool(self, pool: _BlockPool) -> None:
        """Hand out the blocks of ``pool``, whose cache must hold every row alone (or the
        call could never end)."""
        self.pool = pool
        num_blocks = pool.num_blocks
        for row in self.waiting:
            if self._need(row, fresh=True) > num_blocks - 1:
                raise ValueError(
                    f"generation.engine.kv_cache_mib: prompt {row.index} ({len(row.prompt.ids)} "
                    f"tokens) with max_new_tokens {row.limit} needs "
                    f"{self._need(row, fresh=True)} cache blocks of {self.block_size} positions, "
                    f"the cache holds {num_blocks - 1}: raise kv_cache_mib or lower max_new_tokens"
                )

    def _own_blocks(self, row: _Row) -> int:
        """Blocks a row writes to: its copy of the prompt's last partial block, and its tokens
        (every sampled token but the last is fed back)."""
        positions = len(row.prompt.ids) + row.limit - 1
        return _blocks(positions, self.block_size) - row.prompt.full_blocks

    def _need(self, row: _Row, fresh: bool, kept: int = 0) -> int:
        shared = _blocks(len(row.prompt.ids), self.block_size) - kept if fresh else 0
        return shared + self._own_blocks(row)

    def _available(self) -> int:
        """Free blocks, and kept ones no running prompt uses (evicted when taken)."""
        return len(self.pool.free) + (self.prefixes.evictable if self.prefixes else 0)

    def _take(self, n: int) -> list[int]:
        short = n - len(self.pool.free)
        if short > 0 and self.prefixes is not None:
            self.pool.give(self.prefixes.evict(short))
        return self.pool.take(n)

    def admit(self) -> tuple[list[_Row], list[_Prompt]]:
        """Start waiting rows (in order) while a slot and their blocks are free; return them
        and the prompts among theirs that need a prefill."""
        started: list[_Row] = []
        prefill: list[_Prompt] = []
        while self.waiting and len(self.running) < self.max_slots:
            # A row whose prompt is in the cache first (its shared blocks are paid for).
            row = next((r for r in self.waiting if r.prompt.blocks), self.waiting[0])
            prompt, fresh = row.prompt, not row.prompt.blocks
            kept = self._kept(prompt) if fresh else []
            self._pin(kept)
            if self._need(row, fresh, len(kept)) > self._available():
                self._unpin(kept)
                if self.running:
                    break  # a running row will give blocks back
                # Nothing runs, yet prompts kept for their waiting rows fill the cache: drop
                # them (prefilled again when their rows start), so the row fits the empty cache.
                self._drop_cached_prompts()
                continue
            self.waiting.remove(row)
            if fresh:
                prompt.private = self._take(_blocks(len(prompt.ids), self.block_size) - len(kept))
                prompt.nodes, prompt.start = kept, len(kept) * self.block_size
                prompt.blocks = [n.block for n in kept] + prompt.private
                prefill.append(prompt)
            row.own = self._take(self._own_blocks(row))
            row.table = prompt.blocks[: prompt.full_blocks] + row.own
            self.running.append(row)
            started.append(row)
        return started, prefill

    def _pin(self, nodes: list[Any]) -> None:
        if self.prefixes is not None:
            self.prefixes.pin(nodes)

    def _unpin(self, nodes: list[Any]) -> None:
        if self.prefixes is not None:
            self.prefixes.unpin(nodes)

    def prefilled(self, prompts: list[_Prompt]) -> None:
        """Keep the full blocks of the prompts just prefilled (when prefixes are kept)."""
        if self.prefixes is None:
            return
        for prompt in prompts:
            nodes, adopted = self.prefixes.register(prompt.ids, prompt.blocks, len(prompt.nodes))
            prompt.nodes += nodes
            taken = set(adopted)
            prompt.private = [b for b in prompt.private if b not in taken]

    def _release(self, prompt: _Prompt) -> None:
        self._unpin(prompt.nodes)
        self.pool.give(prompt.private)
        prompt.blocks, prompt.logits, prompt.nodes, prompt.private = [], None, [], []

    def _drop_cached_prompts(self) -> None:
        for prompt in {id(r.prompt): r.prompt for r in self.waiting}.values():
            if prompt.blocks:
                self._release(prompt)

    def finish(self, row: _Row) -> None:
        """A row ended: its slot and blocks go back (its prompt's too, after its last row);
        when prefixes are kept, its full blocks (every token fed) are kept instead."""
        self.running.remove(row)
        if self.prefixes is not None:
            fed = row.prompt.ids + row.tokens[:-1]
            kept = set(self.prefixes.adopt(fed, row.table, first=row.prompt.full_blocks))
            row.own = [b for b in row.own if b not in kept]
        self.pool.give(row.own)
        row.own = []
        row.prompt.rows_left -= 1
        if row.prompt.rows_left == 0 and row.prompt.blocks:
            self._release(row.prompt)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class _Forward:
    """The model's forward on the paged cache: prefills, and the decode step (compiled when
    asked, on shapes rounded up to powers of two)."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, compile_step: Any) -> None:
        self.model, self.cache, self.compiled = model, cache, compile_step

    def __call__(
        self, ids: Tensor, positions: Tensor, tables: Tensor, rope: Tensor | None = None
    ) -> Tensor:
        """Last-position logits ``[b, V]`` of ``ids`` ``[b, s]`` written at ``positions``
        ``[b, s]``; ``rope``: the positions the model sees, where they differ (padding)."""
        self.cache.bind(tables, positions)
        step = self.compiled if self.compiled is not None and ids.shape[1] == 1 else self.model
        position_ids = positions if rope is None else rope
        logits = step(ids, position_ids=position_ids, kv_cache=self.cache, logits_to_keep=1)
        return logits[:, -1]

    def decode(self, ids: Tensor, positions: Tensor, tables: Tensor) -> Tensor:
        """One token per row; padded to a power-of-two batch and width when compiled."""
        if self.compiled is None:
            return self(ids, positions, tables)
        b, n = tables.shape
        pb, pn = _pow2(b), _pow2(n)
        ids = torch.nn.functional.pad(ids, (0, 0, 0, pb - b))
        positions = torch.nn.functional.pad(positions, (0, 0, 0, pb - b))
        tables = torch.nn.functional.pad(tables, (0, pn - n, 0, pb - b))
        return self(ids, positions, tables)[:b]


def _cache_blocks(model: nn.Module, plan: _Scheduler, settings: EngineSettings) -> tuple[int, int]:
    """``(num_blocks, bytes per block)`` of the pool: ``kv_cache_mib``'s worth, or what every
    row (and each distinct prompt once) needs at worst, plus the scratch block."""
    per_block = model.init_paged_kv_cache(2, settings.block_size, device="meta").block_bytes
    if settings.kv_cache_mib is not None:
        return max(int(settings.kv_cache_mib * 2**20 // per_block), 2), per_block
    return max(plan.worst_case_blocks(), 2), per_block


def _kept_pool(
    model: nn.Module, prefixes: PrefixCache, num_blocks: int, fixed: bool
) -> tuple[Any, _BlockPool]:
    """The pool ``prefixes`` keeps between calls: made on the first call, then grown to
    ``num_blocks`` plus the kept blocks when that is more (its kept blocks copied over), unless
    its size is ``fixed`` (``kv_cache_mib``: kept blocks are evicted instead)."""
    wanted = num_blocks if fixed else num_blocks + prefixes.kept
    old = prefixes.cache
    if old is None:
        prefixes.cache = model.init_paged_kv_cache(wanted, prefixes.block_size)
        prefixes.pool = _BlockPool(wanted)
    elif not fixed and old.num_blocks < wanted:
        cache = model.init_paged_kv_cache(wanted, prefixes.block_size)
        for new, kept in zip((*cache.k, *cache.v), (*old.k, *old.v)):
            new[: old.num_blocks].copy_(kept)
        prefixes.cache = cache
        prefixes.pool.grow(wanted)
    pool = prefixes.pool
    pool.peak_used = pool.num_blocks - 1 - len(pool.free)
    return prefixes.cache, pool


def _table_tensor(rows: list[_Row], used: list[int], device: torch.device) -> Tensor:
    """The rows' block tables up to the blocks they use now (``used[i]`` each), so a decode step
    reads only the keys written so far; zero (scratch) beyond."""
    width = max(used)
    return torch.tensor(
        [r.table[:n] + [0] * (width - n) for r, n in zip(rows, used)], device=device
    )


@torch.no_grad()
def generate_paged(
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
    processors: Sequence[LogitsProcessor] = (),
    sync_ranks: bool = False,
    sync_group: ProcessGroup | None = None,
    tp_group: ProcessGroup | None = None,
    settings: EngineSettings | None = None,
    compiled_step: Any = None,
    prefixes: PrefixCache | None = None,
) -> GenerationOutput:
    """Decode like :func:`~tunesmith.generation.generate` (same arguments, same result) with
    the rollout engine of this module; ``settings`` size and shape it (see
    :class:`~tunesmith.generation.config.EngineSettings`). ``compiled_step``: a compiled
    ``model`` forward to decode with (the engine that owns it keeps it across calls).
    ``prefixes``: blocks kept from earlier calls (and kept for later ones) in their pool
    (:class:`~tunesmith.generation.prefix_cache.PrefixCache`): a prompt that starts with
    kept blocks prefills only the rest.

    Rows without ``row_keys`` draw from ``generator`` in the order the engine samples them,
    which differs from the plain engine's; with keys (and greedy) the tokens are the plain
    engine's. ``out.stats``: ``prefill_tokens``, ``decode_steps``, ``decode_rows`` (rows fed
    over all steps), ``peak_slots``, ``cache_blocks``, ``peak_blocks``, ``cache_mib``,
    ``cached_tokens`` (prompt positions found in ``prefixes``, not prefilled).
    """
    started = time.perf_counter()
    if not supports_paged(model):
        raise ValueError(
            f"generate_paged: {type(model).__name__} keeps its own KV cache (no "
            "init_paged_kv_cache); decode it with tunesmith.generation.generate"
        )
    settings = settings or EngineSettings()
    call = check_call(
        model, prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, stop_token_ids=stop_token_ids, stop_strings=stop_strings,
        decode=decode, pad_id=pad_id, row_keys=row_keys, sync_ranks=sync_ranks,
        sync_group=sync_group, tp_group=tp_group, engine=settings,
    )  # fmt: skip
    rows, limits, keys, stops, device = call.rows, call.limits, call.keys, call.stops, call.device
    shared, sync, stop_ids = call.shared, call.sync, call.stop_ids

    bs = settings.block_size
    plan = _Scheduler(rows, limits, keys, settings, bs, prefixes)
    num_blocks, per_block = _cache_blocks(model, plan, settings)
    if prefixes is None:
        cache, pool = model.init_paged_kv_cache(num_blocks, bs), _BlockPool(num_blocks)
    else:
        cache, pool = _kept_pool(model, prefixes, num_blocks, fixed=bool(settings.kv_cache_mib))
        num_blocks = pool.num_blocks
    plan.use_pool(pool)
    if compiled_step is not None and device.type == "cuda":
        for pool in (*cache.k, *cache.v):  # CUDA graphs write the pools in place, not copies
            torch._dynamo.mark_static_address(pool)
    forward = _Forward(model, cache, compiled_step)
    stop_set = set(stop_ids)
    stats = dict.fromkeys(
        ("prefill_tokens", "cached_tokens", "decode_steps", "decode_rows", "peak_slots"), 0
    )

    def take(batch: list[_Row], logits: Tensor) -> None:
        """Sample each row's next token from its logits; finish the rows that end."""
        out = sample(
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            processors=processors,
            generator=generator,
            keys=None if keys is None else torch.tensor([r.key for r in batch], device=device),
            step=torch.tensor([len(r.tokens) for r in batch], device=device),
        )
        tokens, logprobs = shared(out.tokens, out.logprobs)
        for row, token, logprob in zip(batch, tokens.tolist(), logprobs.tolist()):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.stopped = token in stop_set or bool(stops and stops(row.tokens))
            if row.stopped or len(row.tokens) >= row.limit:
                plan.finish(row)

    while True:
        admitted, prefill = plan.admit()
        stats["peak_slots"] = max(stats["peak_slots"], len(plan.running))
        # One all-reduce a round under sync_ranks: does any rank prefill, does any decode?
        any_prefill, any_decode = sync.max(int(bool(prefill)), int(bool(plan.running)))
        if not (any_prefill or any_decode):
            break  # nothing runs, so nothing waits either: every row fits an empty cache
        if any_prefill:
            _prefill(forward, prefill, pad_id, device, stats)
            plan.prefilled(prefill)
        if admitted:
            for row in admitted:
                _copy_partial(cache, row, bs)
            take(admitted, torch.stack([r.prompt.logits for r in admitted]))
        if not any_decode:
            continue
        decoding = list(plan.running)
        if not decoding:  # another rank decodes: join its collectives on the scratch block
            _idle_forward(forward, pad_id, device)
            continue
        ids = torch.tensor([[r.tokens[-1]] for r in decoding], device=device)
        at = [len(r.prompt.ids) + len(r.tokens) - 1 for r in decoding]
        tables = _table_tensor(decoding, [p // bs + 1 for p in at], device)
        logits = forward.decode(ids, torch.tensor(at, device=device)[:, None], tables)
        stats["decode_steps"] += 1
        stats["decode_rows"] += len(decoding)
        take(decoding, logits)
    _reshard(model)
    del cache, forward
    return GenerationOutput(
        sequences=[r.tokens for r in plan.rows],
        logprobs=[r.logprobs for r in plan.rows],
        prompt_lengths=[len(r) for r in rows],
        finish_reasons=["stop" if r.stopped else "length" for r in plan.rows],
        seconds=time.perf_counter() - started,
        stats={
            **stats,
            "cache_blocks": num_blocks - 1,
            "peak_blocks": plan.pool.peak_used,
            "cache_mib": num_blocks * per_block / 2**20,
        },
    )


def _prefill(
    forward: _Forward,
    prompts: list[_Prompt],
    pad_id: int,
    device: torch.device,
    stats: dict[str, int],
) -> None:
    """Run the new prompts from their first position not kept (``p.start``; left-padded into
    one batch, padding writes to the scratch block) and keep each one's next-token logits. No
    prompt (another rank prefills): a scratch forward."""
    if not prompts:
        _idle_forward(forward, pad_id, device)
        return
    length = max(len(p.ids) - p.start for p in prompts)
    width = max(len(p.blocks) for p in prompts)
    capacity = width * forward.cache.block_size  # a position here writes to scratch
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    positions = torch.full((len(prompts), length), capacity, dtype=torch.long)
    for i, p in enumerate(prompts):
        new = len(p.ids) - p.start
        ids[i, length - new :] = torch.tensor(p.ids[p.start :])
        positions[i, length - new :] = torch.arange(p.start, len(p.ids))
    tables = torch.tensor([p.blocks + [0] * (width - len(p.blocks)) for p in prompts])
    # Padding is written past the table (to scratch) but rotated as position 0: a family
    # whose rotary table depends on the largest position (LongRoPE) sees only real ones.
    rope = positions.masked_fill(positions == capacity, 0)
    logits = forward(ids.to(device), positions.to(device), tables.to(device), rope.to(device))
    for p, row_logits in zip(prompts, logits):
        p.logits = row_logits
    stats["prefill_tokens"] += sum(len(p.ids) - p.start for p in prompts)
    stats["cached_tokens"] += sum(p.start for p in prompts)


def _copy_partial(cache: PagedKVCache, row: _Row, block_size: int) -> None:
    """Give ``row`` its own copy of its prompt's last, partly filled block (its first own
    block), which its first tokens will extend."""
    prompt = row.prompt
    if len(prompt.ids) % block_size == 0:
        return
    source, target = prompt.blocks[prompt.full_blocks], row.own[0]
    for pool in (*cache.k, *cache.v):
        pool[target].copy_(pool[source])


def _idle_forward(forward: _Forward, pad_id: int, device: torch.device) -> None:
    """A one-token forward on the scratch block: joins the collectives of sharded ranks."""
    zero = torch.zeros((1, 1), dtype=torch.long, device=device)
    forward(zero + pad_id, zero, zero)
