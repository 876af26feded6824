"""The rollout engine (``generate_paged``) answers as the plain engine (``generate``) does.

For every native family's tiny model (sliding windows and a mixture of experts included),
greedy decoding and keyed sampling (temperature, top-k, top-p, min-p), stop tokens and stop
strings, per-row limits (0 included), prompts of different lengths and groups of identical
ones: the paged engine's tokens and finish reasons equal the plain engine's, its log-probs
within 1e-5 (its batches are composed differently, so fp32 rounding differs), whatever its
settings (prefix sharing on or off, 1 or 2 slots, a cache small enough that blocks are reused).
Its stats show the work it saved (each shared prompt prefilled once, no decode work for a
finished row) within its limits (slots, blocks); a cache too small for one row is refused
naming ``kv_cache_mib``; LoRA adapters decode unmerged; a transformers-backend model decodes
on the plain engine; a compiled decode step gives the eager tokens; and the cache pool is
released when the call returns.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from tunesmith.generation import LocalEngine, generate
from tunesmith.generation.config import EngineSettings
from tunesmith.generation.paged import generate_paged, supports_paged
from tunesmith.models import zoo
from tunesmith.models.zoo import phi3
from tunesmith.modules.paged_cache import PagedKVCache
from tunesmith.modules.peft.apply import apply_lora

BLOCK = 4  # small blocks: prompts span several, shared full blocks and copied partial ones
LONG = [5, 17, 99, 3, 42, 8, 61, 7, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # 18: 4 full + 2
PROMPTS = [
    LONG,
    [77, 12],
    LONG,  # a group with row 0 (and row 6)
    [150, 4, 4, 90, 33],
    [77, 12],  # a group with row 1
    [5, 17, 99, 3, 42, 8, 61, 7],  # 8 tokens: two full blocks, nothing to copy
    LONG,
]
LIMITS = [12, 7, 9, 10, 3, 8, 5]
KEYS = [101, 202, 303, 404, 505, 606, 707]
FAMILIES = sorted(zoo.FAMILY_FILES)


def letters(ids: list[int]) -> str:
    """A tiny tokenizer's decode: token i is the letter chr(97 + i % 26)."""
    return "".join(chr(97 + i % 26) for i in ids)


def tiny(name: str = "llama3", seed: int = 0, **overrides) -> torch.nn.Module:
    """A family's tiny random model, weights large enough (0.1) that tokens are far from ties
    and rows differ (0.2 makes activations so large that fp32 noise nears 1e-5 in log-probs).
    Phi-3's LongRoPE switch is off here (see the phi3 tests below)."""
    if name == "phi3":
        overrides.setdefault("rope_scaling", None)
    torch.manual_seed(seed)
    return getattr(zoo.FAMILY_FILES[name], f"{name}_tiny")(
        initializer_range=0.1, **overrides
    ).eval()


def assert_same(paged, plain, where: str = "") -> None:
    assert paged.sequences == plain.sequences, where
    assert paged.finish_reasons == plain.finish_reasons, where
    assert paged.prompt_lengths == plain.prompt_lengths, where
    for i, (got, want) in enumerate(zip(paged.logprobs, plain.logprobs, strict=True)):
        assert len(got) == len(want), f"{where} row {i}"
        assert got == pytest.approx(want, abs=1e-5, rel=0), f"{where} row {i}"


def both(model, prompts=PROMPTS, settings=None, where: str = "", **kwargs):
    """(plain, paged) outputs of one call, checked equal."""
    plain = generate(model, prompts, **kwargs)
    paged = generate_paged(model, prompts, settings=settings or EngineSettings(block_size=BLOCK),
                           **kwargs)  # fmt: skip
    assert_same(paged, plain, where)
    return plain, paged


def decode_rows(out) -> int:
    """The rows a decode step must feed: every sampled token but each row's last."""
    return sum(max(len(s) - 1, 0) for s in out.sequences)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny("llama3")


@pytest.fixture(scope="module")
def reference(model):
    """The plain engine's greedy completions of PROMPTS (no stops)."""
    return generate(model, PROMPTS, max_new_tokens=LIMITS)


# -- every family ------------------------------------------------------------------------------


def test_the_family_list_covers_windows_and_experts():
    assert {"llama3", "mistral", "gemma2", "gemma3", "qwen3_moe", "phi3"} <= set(FAMILIES)
    assert len(FAMILIES) >= 13
    assert tiny("mistral").spec.sliding_window < len(LONG)  # the window cuts the long rows
    assert tiny("qwen3_moe").spec.num_experts > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_as_the_plain_engine(family):
    model = tiny(family)
    assert supports_paged(model)
    greedy, _ = both(model, max_new_tokens=LIMITS, where=f"{family} greedy")
    assert greedy.sequences[0] != greedy.sequences[1]  # the model tells prompts apart
    keyed = dict(max_new_tokens=LIMITS, row_keys=KEYS, temperature=1.0, top_k=40, top_p=0.9)
    sampled, _ = both(model, settings=EngineSettings(block_size=BLOCK, max_slots=2),
                      where=f"{family} keyed", **keyed)  # fmt: skip
    assert sampled.sequences[0] != sampled.sequences[2]  # a group's rows draw apart


# -- sampling, stops, limits -------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1.0, top_p=0.8),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.3, top_k=50, top_p=0.95, min_p=0.01),
    ],
    ids=["t1", "t0.7", "top_p", "top_k", "all_filters"],
)
def test_keyed_sampling_draws_the_plain_engine_s_tokens(model, reference, sampling):
    plain, paged = both(model, max_new_tokens=LIMITS, row_keys=KEYS, **sampling)
    assert plain.sequences != reference.sequences  # sampling, not greedy
    # a row's draws depend on its key, not on what else is in the batch or the slot count
    alone = generate_paged(
        model,
        PROMPTS[3:4],
        max_new_tokens=LIMITS[3:4],
        row_keys=KEYS[3:4],
        settings=EngineSettings(block_size=BLOCK, max_slots=1),
        **sampling,
    )
    assert alone.sequences[0] == paged.sequences[3]


def test_stop_tokens_end_rows_as_in_the_plain_engine(model, reference):
    stop = reference.sequences[0][3]  # row 0 (and its group) stops at its 4th token
    plain, paged = both(model, max_new_tokens=LIMITS, stop_token_ids=[stop, 255])
    assert plain.finish_reasons[0] == "stop" and len(plain.sequences[0]) <= 4
    assert "length" in plain.finish_reasons
    assert paged.stats["decode_rows"] == decode_rows(paged)  # stopped rows decode no more
    both(model, max_new_tokens=LIMITS, stop_token_ids=[stop], row_keys=KEYS, temperature=1.0,
         settings=EngineSettings(block_size=BLOCK, max_slots=2))  # fmt: skip


def test_stop_strings_end_rows_as_in_the_plain_engine(model, reference):
    text = letters(reference.sequences[3][2:4])  # row 3's 3rd and 4th tokens
    kwargs = dict(max_new_tokens=LIMITS, stop_strings=[text], decode=letters)
    plain, paged = both(model, **kwargs)
    assert plain.finish_reasons[3] == "stop" and len(plain.sequences[3]) <= 4
    assert text in letters(plain.sequences[3])
    assert paged.stats["decode_rows"] == decode_rows(paged)
    both(model, settings=EngineSettings(block_size=BLOCK, max_slots=2), row_keys=KEYS,
         temperature=1.0, **{**kwargs, "stop_strings": ["ab", "q", text]})  # fmt: skip


def test_per_row_limits(model):
    limits = [1, 2, 4, 9, 3, 5, 16]
    plain, paged = both(model, max_new_tokens=limits)
    assert [len(s) for s in paged.sequences] == limits
    assert set(paged.finish_reasons) == {"length"}
    assert paged.stats["decode_rows"] == sum(n - 1 for n in limits)
    both(model, max_new_tokens=1, row_keys=KEYS, temperature=1.0)  # the prefill's token only


def test_rows_with_max_new_tokens_0_are_answered_empty(model):
    limits = [5, 0, 3, 1, 0, 2, 0]
    plain, paged = both(model, max_new_tokens=limits, row_keys=KEYS, temperature=1.0,
                        settings=EngineSettings(block_size=BLOCK, max_slots=2))  # fmt: skip
    assert [len(s) for s in paged.sequences] == limits
    assert paged.sequences[1] == paged.sequences[4] == paged.sequences[6] == []
    # a row with nothing to generate is not prefilled: row 4's prompt ([77, 12], row 1's) never
    assert paged.stats["prefill_tokens"] == len(LONG) + 5 + 8
    out = generate_paged(model, PROMPTS, max_new_tokens=0)
    assert out.sequences == [[]] * len(PROMPTS) and out.stats["prefill_tokens"] == 0


# -- prefix sharing, continuous batching, the cache budget -------------------------------------


def test_prefix_sharing_prefills_each_prompt_once_and_changes_no_token(model):
    kwargs = dict(max_new_tokens=LIMITS, row_keys=KEYS, temperature=1.0)
    on = generate_paged(model, PROMPTS, settings=EngineSettings(block_size=BLOCK), **kwargs)
    off = generate_paged(
        model, PROMPTS, settings=EngineSettings(block_size=BLOCK, share_prefixes=False), **kwargs
    )
    assert_same(on, generate(model, PROMPTS, **kwargs), "shared")
    assert_same(off, on, "not shared")
    distinct = {tuple(p) for p in PROMPTS}
    assert on.stats["prefill_tokens"] == sum(map(len, distinct)) == 18 + 2 + 5 + 8
    assert off.stats["prefill_tokens"] == sum(map(len, PROMPTS))
    assert on.stats["cache_blocks"] < off.stats["cache_blocks"]  # a prompt's full blocks once
    assert on.stats["decode_rows"] == off.stats["decode_rows"] == decode_rows(on)
    # a GRPO group: one prompt, eight keys, eight different completions, one prefill
    group = [LONG] * 8
    plain, paged = both(model, group, max_new_tokens=6, row_keys=range(8), temperature=1.0)
    assert len({tuple(s) for s in paged.sequences}) > 1
    assert paged.stats["prefill_tokens"] == len(LONG)


def _block_bytes(model) -> int:
    attn = model.model.layers[0].self_attn
    return PagedKVCache.bytes_per_block(
        len(model.model.layers), BLOCK, attn.num_kv_heads, attn.head_dim, torch.float32
    )


def _row_blocks(prompt: list[int], limit: int) -> int:
    """Blocks one row needs alone: its prompt's, and its tokens' (all but the last fed)."""
    return -(-(len(prompt) + limit - 1) // BLOCK)


@pytest.mark.parametrize("slots", [1, 2])
def test_continuous_batching_in_a_small_cache_reuses_blocks_and_changes_no_token(model, slots):
    biggest = max(_row_blocks(p, n) for p, n in zip(PROMPTS, LIMITS))
    blocks = biggest + 3  # room for one big row and a little: rows must wait for blocks
    mib = (blocks + 1) * _block_bytes(model) / 2**20  # + the scratch block
    settings = EngineSettings(block_size=BLOCK, max_slots=slots, kv_cache_mib=mib)
    for sampling in (dict(), dict(row_keys=KEYS, temperature=1.0, top_p=0.9)):
        plain, paged = both(model, settings=settings, max_new_tokens=LIMITS, **sampling)
        stats = paged.stats
        assert stats["cache_blocks"] == blocks
        assert stats["cache_mib"] == pytest.approx(mib)
        assert stats["peak_slots"] == slots
        assert stats["peak_blocks"] <= stats["cache_blocks"]
        # more blocks were used over the call than the cache holds: they were reused
        assert sum(_row_blocks(p, n) for p, n in zip(PROMPTS, LIMITS)) > blocks
        assert stats["decode_rows"] == decode_rows(paged)
        assert stats["decode_steps"] >= max(LIMITS) - 1


def test_unbounded_settings_run_every_row_at_once(model):
    plain, paged = both(model, max_new_tokens=LIMITS)
    stats = paged.stats
    assert stats["peak_slots"] == len(PROMPTS)
    assert stats["decode_steps"] == max(LIMITS) - 1  # every row decodes from the first step
    assert stats["peak_blocks"] == stats["cache_blocks"]  # sized to what the rows need
    assert stats["cache_mib"] == pytest.approx(
        (stats["cache_blocks"] + 1) * _block_bytes(model) / 2**20
    )


def test_a_cache_too_small_for_one_row_is_refused_naming_kv_cache_mib(model):
    one_block = _block_bytes(model) / 2**20
    positions = _row_blocks(LONG, 12)  # row 0 alone: its 29 positions' blocks, at the least
    for blocks in (positions, 2, 0.01):  # (one is scratch) fewer blocks, one, less than one
        settings = EngineSettings(block_size=BLOCK, kv_cache_mib=blocks * one_block)
        with pytest.raises(ValueError, match="kv_cache_mib"):
            generate_paged(model, PROMPTS, max_new_tokens=LIMITS, settings=settings)


def test_a_cache_that_holds_the_longest_row_alone_answers_every_row(model):
    """Room for the longest row (and the copy of its prompt's partial block) and little more:
    rows run one or two at a time, a group's prompt blocks wait in the cache for the group's
    later rows while other prompts come first; every row is still answered in full."""
    one_block = _block_bytes(model) / 2**20
    blocks = _row_blocks(LONG, 12) + 1
    settings = EngineSettings(block_size=BLOCK, kv_cache_mib=(blocks + 1) * one_block)
    plain, paged = both(model, settings=settings, max_new_tokens=LIMITS)
    assert [len(s) for s in paged.sequences] == LIMITS  # no row left out (empty)
    assert paged.stats["cache_blocks"] == blocks
    assert paged.stats["peak_blocks"] <= paged.stats["cache_blocks"]


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_any_block_size_gives_the_same_tokens(model, block_size):
    both(model, settings=EngineSettings(block_size=block_size, max_slots=3),
         max_new_tokens=LIMITS, row_keys=KEYS, temperature=1.0)  # fmt: skip


# -- models: LoRA, the transformers backend, LongRoPE, compile ---------------------------------


def test_lora_adapters_decode_unmerged():
    model = tiny("qwen3")
    base = generate(model, PROMPTS, max_new_tokens=LIMITS).sequences
    apply_lora(model, target_modules=["q_proj", "v_proj", "down_proj"], rank=2, alpha=4)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.5)
    assert any("lora_" in n for n, _ in model.named_parameters())  # not merged
    plain, paged = both(model, max_new_tokens=LIMITS)
    assert plain.sequences != base  # the adapters change the tokens
    both(model, max_new_tokens=LIMITS, row_keys=KEYS, temperature=1.0,
         settings=EngineSettings(block_size=BLOCK, max_slots=2))  # fmt: skip
    engine = LocalEngine(model, None, pad_id=0, settings=EngineSettings(block_size=BLOCK))
    assert engine.paged
    out = engine.generate(PROMPTS, row_keys=None, max_new_tokens=LIMITS, temperature=0.0,
                          top_p=None, top_k=None, min_p=None, stop_token_ids=[],
                          stop_strings=[])  # fmt: skip
    assert out.sequences == plain.sequences and out.stats["prefill_tokens"] > 0


def test_a_transformers_backend_model_decodes_on_the_plain_engine():
    from tunesmith.models.transformers_backend import build_transformers_model, tiny_config

    torch.manual_seed(0)
    model = build_transformers_model(tiny_config("starcoder2")).eval()
    assert not supports_paged(model)
    engine = LocalEngine(model, None, pad_id=0)  # the default settings ask for the paged engine
    assert engine.settings.paged and engine.paged is False
    kwargs = dict(row_keys=KEYS[:3], max_new_tokens=[4, 6, 2], temperature=1.0)
    prompts = [[5, 17, 99, 3, 42], [77, 12], [5, 17, 99, 3, 42]]
    out = engine.generate(prompts, top_p=None, top_k=None, min_p=None, stop_token_ids=[],
                          stop_strings=[], **kwargs)  # fmt: skip
    assert [len(s) for s in out.sequences] == [4, 6, 2]
    assert out.sequences == generate(model, prompts, **kwargs).sequences


def test_local_engine_decodes_native_models_on_the_paged_engine(model):
    settings = EngineSettings(block_size=BLOCK, max_slots=2)
    engine = LocalEngine(model, None, pad_id=0, settings=settings)
    assert engine.paged
    kwargs = dict(row_keys=KEYS, max_new_tokens=LIMITS, temperature=1.0, top_p=0.9, top_k=None,
                  min_p=None, stop_token_ids=[3], stop_strings=[])  # fmt: skip
    out = engine.generate(PROMPTS, **kwargs)
    assert out.stats["peak_slots"] == 2
    assert_same(out, generate(model, PROMPTS, **kwargs))
    plain = LocalEngine(model, None, pad_id=0, settings=EngineSettings(paged=False))
    assert not plain.paged and plain.generate(PROMPTS, **kwargs).stats == {}


def test_phi3_longrope_short_prompts_of_different_lengths():
    """No position reaches LongRoPE's switch (8): every forward must use the short table. The
    paged prefill batches prompts of different lengths; its padding must not count as a
    position past the switch."""
    torch.manual_seed(0)
    model = phi3.phi3_tiny(initializer_range=0.1).eval()
    prompts = [[5, 17, 99, 3, 42], [77, 12]]
    for block_size in (4, 16):
        both(model, prompts, settings=EngineSettings(block_size=block_size),
             max_new_tokens=[3, 3], where=f"block_size {block_size}")  # fmt: skip


def test_phi3_longrope_rows_crossing_the_switch_together():
    """Rows of one length decode in step (every forward has the same largest position in both
    engines), across the switch at 8 positions."""
    torch.manual_seed(0)
    model = phi3.phi3_tiny(initializer_range=0.1).eval()
    prompts = [[5, 17, 99, 3, 42], [77, 12, 4, 8, 9], [5, 17, 99, 3, 42]]
    both(model, prompts, max_new_tokens=10)
    both(model, prompts, max_new_tokens=10, row_keys=KEYS[:3], temperature=1.0)


@pytest.mark.slow
def test_a_compiled_decode_step_gives_the_eager_tokens(model):
    compiled = torch.compile(model, dynamic=False)
    calls: list[int] = []

    def step(*args, **kwargs):
        calls.append(args[0].shape[0])
        return compiled(*args, **kwargs)

    settings = EngineSettings(block_size=BLOCK, max_slots=3)
    kwargs = dict(max_new_tokens=LIMITS, row_keys=KEYS, temperature=1.0, stop_token_ids=[3])
    eager = generate_paged(model, PROMPTS, settings=settings, **kwargs)
    for _ in range(2):  # the second call reuses the graphs
        calls.clear()
        out = generate_paged(model, PROMPTS, settings=settings, compiled_step=step, **kwargs)
        assert_same(out, eager, "compiled")
        assert len(calls) == out.stats["decode_steps"] > 0  # every decode step ran compiled
        assert set(calls) <= {1, 2, 4}  # batches rounded up to powers of two
    assert_same(eager, generate(model, PROMPTS, **kwargs), "eager")


# -- the pool is released ----------------------------------------------------------------------


def _track_caches(model, monkeypatch) -> list[weakref.ref]:
    """Weak references to every cache ``model.init_paged_kv_cache`` makes from now on."""
    refs: list[weakref.ref] = []
    make = model.init_paged_kv_cache

    def tracking(*args, **kwargs):
        cache = make(*args, **kwargs)
        refs.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(model, "init_paged_kv_cache", tracking)
    return refs


def test_the_cache_pool_is_released_after_the_call(monkeypatch):
    model = tiny("llama3")
    refs = _track_caches(model, monkeypatch)
    alive_during: list[bool] = []
    model.register_forward_pre_hook(
        lambda *_: alive_during.append(any(r() is not None for r in refs))
    )
    settings = EngineSettings(block_size=BLOCK, max_slots=2)
    out = generate_paged(model, PROMPTS, max_new_tokens=LIMITS, row_keys=KEYS, temperature=1.0,
                         stop_token_ids=[3], settings=settings)  # fmt: skip
    assert alive_during and all(alive_during)  # the refs do see a live pool while decoding
    gc.collect()
    assert refs and all(r() is None for r in refs), "a PagedKVCache outlived generate_paged"
    # through the engine too, which keeps nothing but its settings between calls
    engine = LocalEngine(model, None, pad_id=0, settings=settings)
    engine.generate(PROMPTS, row_keys=KEYS, max_new_tokens=LIMITS, temperature=1.0, top_p=None,
                    top_k=None, min_p=None, stop_token_ids=[], stop_strings=[])  # fmt: skip
    gc.collect()
    assert len(refs) >= 4 and all(r() is None for r in refs)
    assert out.sequences  # the output holds no cache, only token lists
