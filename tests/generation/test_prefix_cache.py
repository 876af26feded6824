"""Prefixes kept across engine calls (``LocalEngine.keep_prefixes``, generation.prefix_cache).

A conversation's next turn (the last prompt, the reply sampled, an observation) prefills only
what its kept full blocks do not hold, and answers as a fresh engine does (same tokens, log-probs
within 1e-5), for every native family: in a cache large enough for everything, and in a small
one that evicts kept blocks (least recently used first, never a pinned one). New weights drop
what was kept; nothing is kept outside the block, with ``share_prefixes: false`` or on the
plain engine; the kept pool is released when the block ends.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from tests.generation.test_paged_engine import FAMILIES, assert_same, tiny
from tunesmith.generation import LocalEngine
from tunesmith.generation.config import EngineSettings
from tunesmith.generation.prefix_cache import PrefixCache

BLOCK = 4
OPENING = [5, 17, 99, 3, 42, 8, 61, 7, 9, 10, 11]  # 11 tokens: 2 full blocks + 3
PROMPTS = [OPENING] * 3 + [[77, 12, 40, 41, 50]]  # a group of 3 and another prompt
OBSERVATIONS = [[30, 31, 32], [33] * 6, [34], [35, 36, 37, 38, 39]]
SAMPLING = dict(temperature=1.0, top_p=None, top_k=None, min_p=None, stop_strings=[])


def _call(engine, rows, turn, limit=6):
    keys = [1000 * turn + i for i in range(len(rows))]
    return engine.generate(rows, row_keys=keys, max_new_tokens=limit, stop_token_ids=[2],
                           **SAMPLING)  # fmt: skip


def _next_turn(rows, out, turn):
    return [
        r + s + OBSERVATIONS[(i + turn) % 4] for i, (r, s) in enumerate(zip(rows, out.sequences))
    ]


def _kept_tokens(row, previous_row, previous_reply):
    """Positions of ``row`` a kept cache holds: the full blocks of what the last call fed
    (its prompt and every sampled token but the last), leaving one token to prefill."""
    fed = len(previous_row) + len(previous_reply) - 1
    return BLOCK * min(fed // BLOCK, (len(row) - 1) // BLOCK)


def _three_turns(engine, fresh):
    """Three turns through ``engine`` (inside keep_prefixes) checked against ``fresh``; the
    calls' stats, the prefill each next turn should need, and each turn's distinct prompts."""
    rows, stats, expected, distinct_rows = PROMPTS, [], [], []
    with engine.keep_prefixes():
        for turn in range(3):
            distinct_rows.append({tuple(r) for r in rows})
            out = _call(engine, rows, turn)
            assert_same(out, _call(fresh, rows, turn), f"turn {turn}")
            stats.append(out.stats)
            following = _next_turn(rows, out, turn)
            distinct = {tuple(r): (r, p, s) for r, p, s in zip(following, rows, out.sequences)}
            expected.append(sum(len(r) - _kept_tokens(r, p, s) for r, p, s in distinct.values()))
            rows = following
    return stats, expected, distinct_rows


@pytest.mark.parametrize("family", FAMILIES)
def test_each_turn_prefills_only_what_is_new_and_answers_as_a_fresh_engine(family):
    model = tiny(family)
    settings = EngineSettings(block_size=BLOCK)
    stats, expected, distinct_rows = _three_turns(
        LocalEngine(model, None, pad_id=0, settings=settings),
        LocalEngine(model, None, pad_id=0, settings=settings),
    )
    assert stats[0]["cached_tokens"] == 0
    assert stats[0]["prefill_tokens"] == len(OPENING) + len(PROMPTS[-1])  # the group's once
    for turn in (1, 2):
        assert stats[turn]["prefill_tokens"] == expected[turn - 1], f"turn {turn}"
        total = sum(map(len, distinct_rows[turn]))
        assert stats[turn]["cached_tokens"] == total - stats[turn]["prefill_tokens"]


def test_a_small_cache_evicts_kept_blocks_and_changes_no_token():
    model = tiny()
    small = EngineSettings(block_size=BLOCK, kv_cache_mib=0.03, max_slots=2)
    engine = LocalEngine(model, None, pad_id=0, settings=small)
    stats, _, _ = _three_turns(engine, LocalEngine(model, None, pad_id=0, settings=small))
    roomy, _, _ = _three_turns(
        LocalEngine(model, None, pad_id=0, settings=EngineSettings(block_size=BLOCK)),
        LocalEngine(model, None, pad_id=0, settings=small),
    )
    blocks = stats[0]["cache_blocks"]
    assert all(s["cache_blocks"] == blocks and s["peak_blocks"] <= blocks for s in stats)
    assert blocks < roomy[2]["cache_blocks"]  # smaller than everything kept: it evicted ...
    assert 0 < stats[2]["cached_tokens"] < roomy[2]["cached_tokens"]  # ... and still reused


def test_new_weights_drop_the_kept_blocks():
    model = tiny()
    engine = LocalEngine(model, None, pad_id=0, settings=EngineSettings(block_size=BLOCK))
    with engine.keep_prefixes():
        first = _call(engine, PROMPTS, 0)
        rows = _next_turn(PROMPTS, first, 0)
        weight = model.model.norm.weight
        engine.load_weights({"model.norm.weight": weight.detach() * 1.5})
        after = _call(engine, rows, 1)
    fresh = LocalEngine(model, None, pad_id=0, settings=EngineSettings(block_size=BLOCK))
    assert after.stats["cached_tokens"] == 0
    assert_same(after, _call(fresh, rows, 1))


def test_nothing_is_kept_outside_the_block_and_its_pool_is_released():
    model = tiny()
    engine = LocalEngine(model, None, pad_id=0, settings=EngineSettings(block_size=BLOCK))
    with engine.keep_prefixes():
        with engine.keep_prefixes():  # an inner block keeps using the outer one's
            rows = _next_turn(PROMPTS, _call(engine, PROMPTS, 0), 0)
        kept = weakref.ref(engine._prefixes.cache.k[0])
        assert _call(engine, rows, 1).stats["cached_tokens"] > 0
    gc.collect()
    assert kept() is None and engine._prefixes is None
    assert _call(engine, rows, 1).stats["cached_tokens"] == 0


@pytest.mark.parametrize("settings", [EngineSettings(block_size=BLOCK, share_prefixes=False),
                                      EngineSettings(paged=False)])  # fmt: skip
def test_no_prefixes_are_kept_without_sharing_or_on_the_plain_engine(settings):
    model = tiny()
    engine = LocalEngine(model, None, pad_id=0, settings=settings)
    reference = LocalEngine(model, None, pad_id=0, settings=settings)
    with engine.keep_prefixes():
        rows = _next_turn(PROMPTS, _call(engine, PROMPTS, 0), 0)
        out = _call(engine, rows, 1)
    assert engine._prefixes is None and out.stats.get("cached_tokens", 0) == 0
    assert_same(out, _call(reference, rows, 1))


def test_the_trie_keeps_pinned_blocks_and_evicts_the_least_recently_used_leaf_first():
    cache = PrefixCache(block_size=2)
    assert cache.adopt([1, 2, 3, 4, 5], [7, 8], first=0) == [7, 8]  # 1 2 | 3 4
    assert cache.adopt([1, 2, 9, 9], [6, 5], first=1) == [5]  # 1 2 kept: block 6 stays its own
    assert cache.adopt([4, 4, 4, 4], [3, 2], first=1) == []  # no kept path before block 1
    assert cache.kept == cache.evictable == 3
    pinned = cache.match([1, 2, 3, 4, 0], most=9)
    assert [n.block for n in pinned] == [7, 8]
    cache.pin(pinned)
    assert cache.evictable == 1
    assert cache.evict(3) == [5]  # 9 9 is the only unpinned block
    cache.unpin(pinned)
    cache.match([1, 2], most=1)  # 1 2 used last: still evicted after its child
    assert cache.evict(3) == [8, 7] and cache.kept == cache.evictable == 0
    assert cache.match([1, 2, 3, 4], most=2) == []
