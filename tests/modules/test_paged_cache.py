"""PagedKVCache: keys/values in blocks of one pool, read back through block tables.

A model forward on a paged cache (rows scattered over random, non-contiguous blocks of the
pool; rows of different lengths decoded in one batch) gives the logits of the same forward on
a plain :class:`KVCache` (one row at a time), sliding windows included; the mask hides later
positions, stale entries and keys outside the window; positions past a row's table and table
entries 0 write to the scratch block only; ``bytes_per_block`` is what the pools hold.
"""

from __future__ import annotations

import pytest
import torch

from tunesmith.models.zoo import gemma2, llama3, mistral
from tunesmith.modules.kv_cache import KVCache
from tunesmith.modules.paged_cache import PagedKVCache

BLOCK = 4
MODELS = {
    "llama3": lambda: llama3.llama3_tiny(initializer_range=0.1),
    "mistral": lambda: mistral.mistral_tiny(initializer_range=0.1),  # window 8 < the rows
    "gemma2": lambda: gemma2.gemma2_tiny(initializer_range=0.1),  # window 4, softcapping
}
ROWS = [  # lengths 13 and 6: row 0 spans 4 blocks (the last one partial), row 1 two
    [5, 17, 99, 3, 42, 8, 61, 7, 9, 10, 11, 12, 13],
    [150, 4, 4, 90, 33, 21],
]
NEXT = [[7, 101, 33, 2, 250, 64], [19, 19, 5, 77, 8, 1]]  # tokens fed one a step


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]().eval()


def _plain_logits(model: torch.nn.Module, row: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Last-position logits of the prompt (prefilled in two chunks), then of each fed token,
    on a plain KVCache of one row."""
    cache = model.init_kv_cache(1, len(row) + len(steps))
    out = []
    with torch.no_grad():
        half = len(row) // 2
        model(torch.tensor([row[:half]]), kv_cache=cache)
        out.append(model(torch.tensor([row[half:]]), kv_cache=cache)[0, -1])
        for token in steps:
            out.append(model(torch.tensor([[token]]), kv_cache=cache)[0, -1])
    return out


def _random_tables(num_blocks: int, widths: list[int], seed: int) -> list[list[int]]:
    """Disjoint tables of random pool blocks (never block 0), in no particular order."""
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    blocks, tables = perm.tolist(), []
    for width in widths:
        tables.append(blocks[:width])
        blocks = blocks[width:]
    return tables


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_forward_equals_the_plain_cache_forward(name, seed):
    model = _model(name)
    steps = len(NEXT[0])
    widths = [-(-(len(r) + steps) // BLOCK) for r in ROWS]
    num_blocks = 24
    tables = _random_tables(num_blocks, widths, seed)
    cache = model.init_paged_kv_cache(num_blocks, BLOCK)
    # Garbage in every block first: a stale entry that leaked into attention would show.
    for pool in (*cache.k, *cache.v):
        pool.normal_(generator=torch.Generator().manual_seed(seed + 10))
    expected = [_plain_logits(model, row, nxt) for row, nxt in zip(ROWS, NEXT)]
    got: list[list[torch.Tensor]] = [[], []]
    with torch.no_grad():
        # Prefill each row alone, in two chunks (the second chunk reads the first's keys).
        for i, row in enumerate(ROWS):
            half = len(row) // 2
            for start, end in ((0, half), (half, len(row))):
                positions = torch.arange(start, end)[None]
                cache.bind(torch.tensor([tables[i]]), positions)
                logits = model(torch.tensor([row[start:end]]), position_ids=positions,
                               kv_cache=cache)  # fmt: skip
            got[i].append(logits[0, -1])
        # Decode both rows in one batch, at different positions, on tables cut to the blocks
        # used so far (zero, i.e. scratch, beyond).
        for step in range(steps):
            at = [len(r) + step for r in ROWS]
            width = max(p // BLOCK + 1 for p in at)
            table = torch.tensor(
                [t[: p // BLOCK + 1] + [0] * (width - p // BLOCK - 1) for t, p in zip(tables, at)]
            )
            positions = torch.tensor(at)[:, None]
            cache.bind(table, positions)
            ids = torch.tensor([[nxt[step]] for nxt in NEXT])
            logits = model(ids, position_ids=positions, kv_cache=cache)
            for i in range(2):
                got[i].append(logits[i, -1])
    for i in range(2):
        for step, (g, e) in enumerate(zip(got[i], expected[i], strict=True)):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-5, msg=f"{name} row {i} step {step}")


def test_positions_default_to_the_bound_ones():
    model = _model("llama3")
    cache = model.init_paged_kv_cache(8, BLOCK)
    ids = torch.tensor([ROWS[1]])
    positions = torch.arange(len(ROWS[1]))[None]
    with torch.no_grad():
        cache.bind(torch.tensor([[3, 5]]), positions)
        implicit = model(ids, kv_cache=cache)
        cache.bind(torch.tensor([[6, 2]]), positions)
        explicit = model(ids, position_ids=positions, kv_cache=cache)
        plain = model(ids)
    torch.testing.assert_close(implicit, explicit, rtol=0, atol=1e-6)
    torch.testing.assert_close(implicit, plain, rtol=0, atol=1e-5)


def test_update_writes_where_the_table_says_and_gathers_every_row_in_position_order():
    cache = PagedKVCache(num_layers=2, num_blocks=6, block_size=2, num_kv_heads=2, head_dim=3)
    tables = torch.tensor([[4, 1, 3], [2, 5, 0]])
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 9]])  # row 1's last: past its table
    k = torch.arange(2 * 2 * 5 * 3, dtype=torch.float32).view(2, 2, 5, 3)
    cache.bind(tables, positions)
    gk, gv = cache.update(1, k, -k)
    assert gk.shape == gv.shape == (2, 2, 6, 3)
    torch.testing.assert_close(gk[0, :, :5], k[0])  # row 0's positions 0..4, in order
    torch.testing.assert_close(gv[0, :, :5], -k[0])
    torch.testing.assert_close(gk[1, :, :4], k[1, :, :4])
    # where each position landed in the pool: block table[p // 2], offset p % 2
    pool = cache.k[1]
    for row, table in enumerate(tables.tolist()):
        for j, p in enumerate(positions[row].tolist()[:4]):
            torch.testing.assert_close(pool[table[p // 2], p % 2], k[row, :, j])
    torch.testing.assert_close(pool[0, 9 % 2], k[1, :, 4])  # past the table: scratch
    assert not cache.k[0].any() and not cache.v[0].any()  # the other layer: untouched
    # a row reads its own blocks only: row 1's table never names row 0's blocks
    assert not set(tables[0].tolist()) & set(tables[1].tolist()[:2])


def test_out_of_table_positions_and_zero_entries_write_only_to_scratch():
    cache = PagedKVCache(num_layers=1, num_blocks=5, block_size=4, num_kv_heads=1, head_dim=2)
    for pool in (*cache.k, *cache.v):
        pool.fill_(7.0)
    before = cache.k[0].clone()
    # row 0: positions 8..10 past its 2-entry table; row 1: a table of zeros (padding row)
    cache.bind(torch.tensor([[3, 1], [0, 0]]), torch.tensor([[8, 9, 10], [0, 1, 2]]))
    cache.update(0, torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))
    torch.testing.assert_close(cache.k[0][1:], before[1:])  # blocks 1..4 unchanged
    torch.testing.assert_close(cache.v[0][1:], before[1:])
    assert not cache.k[0][0].eq(7.0).all()  # the writes went to block 0


def test_attention_mask_is_causal_on_positions_and_respects_the_window():
    cache = PagedKVCache(num_layers=1, num_blocks=6, block_size=4, num_kv_heads=1, head_dim=2)
    # two rows, one new token each, at positions 5 and 1 of two-block tables
    cache.bind(torch.tensor([[2, 3], [4, 0]]), torch.tensor([[5], [1]]))
    mask = cache.attention_mask(None, batch_size=2, q_len=1)
    assert mask.shape == (2, 1, 1, 8) and mask.dtype == torch.bool
    assert mask[0, 0, 0].int().tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert mask[1, 0, 0].int().tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    window = cache.attention_mask(None, batch_size=2, q_len=1, sliding_window=3)
    assert window[0, 0, 0].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 0]  # keys 3, 4, 5
    assert window[1, 0, 0].int().tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    # a prefill of three tokens at positions 2..4: each query its own causal window of 2
    cache.bind(torch.tensor([[2, 3]]), torch.tensor([[2, 3, 4]]))
    window = cache.attention_mask(None, batch_size=1, q_len=3, sliding_window=2)
    assert window[0, 0].int().tolist() == [
        [0, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 0, 0, 0],
    ]


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        PagedKVCache(num_layers=1, num_blocks=1, block_size=4, num_kv_heads=1, head_dim=2)
    cache = PagedKVCache(num_layers=1, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=2)
    with pytest.raises(RuntimeError, match="bind"):
        cache.update(0, torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    with pytest.raises(RuntimeError, match="bind"):
        cache.next_positions(1)
    cache.bind(torch.tensor([[1]]), torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="bind"):
        cache.next_positions(3)  # not the bound width
    with pytest.raises(ValueError, match="no attention_mask"):
        cache.attention_mask(torch.ones(1, 2), batch_size=1, q_len=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_per_block_is_what_the_pools_hold_per_block(dtype):
    layers, blocks, size, heads, dim = 3, 5, 8, 2, 16
    cache = PagedKVCache(layers, blocks, size, heads, dim, dtype=dtype)
    held = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    per_block = PagedKVCache.bytes_per_block(layers, size, heads, dim, dtype)
    assert held == blocks * per_block
    assert per_block == 2 * layers * size * heads * dim * (4 if dtype == torch.float32 else 2)
    assert all(t.dtype == dtype and t.shape == (blocks, size, heads, dim) for t in cache.k)


def test_a_model_s_paged_cache_matches_its_plain_cache_layout():
    model = _model("gemma2")
    plain: KVCache = model.init_kv_cache(1, 4)
    paged = model.init_paged_kv_cache(3, BLOCK, dtype=torch.bfloat16)
    assert paged.num_layers == plain.num_layers == len(model.model.layers)
    assert paged.k[0].shape[2] == plain.k[0].shape[1]  # kv heads
    assert paged.k[0].shape[3] == plain.k[0].shape[3]  # head dim
    assert paged.k[0].dtype == torch.bfloat16 and plain.k[0].dtype == torch.float32
