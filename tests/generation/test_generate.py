"""Batched decoding: parity with transformers, log-probs, cache vs no cache, stopping."""

from __future__ import annotations

import pytest
import torch

from tests.models.conftest import HF_FAMILIES, randomize_, tiny_hf_model
from tests.models.parity_checks import hf_greedy
from tunesmith.generation import generate, left_pad, policy_logprobs
from tunesmith.models import build_model, from_hf

VOCAB = 160
PROMPTS = [
    [5, 17, 99, 3, 42, 8, 61],
    [77, 12],
    [150, 4, 4, 90, 33, 21, 7, 120, 64, 9, 18],
]


# tests/models/conftest.py's tiny models with larger weights (std 0.2: varied greedy output),
# pad 0 and no eos in the model's own config: ``generate`` fills the unset fields of the config
# it is given from the model's, and min_new_tokens would then mask the eos logit in
# transformers only. Qwen3 with a tied head.
_GEN_CONFIG = {"vocab_size": VOCAB, "eos_token_id": None, "pad_token_id": 0}
_GEN_FAMILY = {"qwen3": {"tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """``pairs(family)``: (transformers model, our model loaded by ``from_hf`` from its
    checkpoint), built once per family."""
    built: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}

    def get(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
        if family not in built:
            overrides = {**_GEN_CONFIG, **_GEN_FAMILY.get(family, {})}
            hf = randomize_(tiny_hf_model(family, seed=0, **overrides), seed=0, std=0.2)
            folder = tmp_path_factory.mktemp(family)
            hf.save_pretrained(folder)  # Qwen3-MoE: fused experts in memory, not on disk
            built[family] = (hf, from_hf(folder).eval())
        return built[family]

    return get


@pytest.fixture(params=HF_FAMILIES)
def pair(request, pairs):
    return pairs(request.param)


@pytest.fixture
def model(pairs):
    return pairs("llama")[1]


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no_cache"])
def test_greedy_matches_transformers_with_left_padding(pair, use_cache):
    hf, ours = pair
    expected = hf_greedy(hf, PROMPTS, 20)
    out = generate(ours, PROMPTS, max_new_tokens=20, use_cache=use_cache)
    assert out.sequences == expected
    assert out.finish_reasons == ["length"] * 3
    assert out.prompt_lengths == [len(p) for p in PROMPTS]
    # the rows are not trivially identical continuations
    assert len({tuple(s) for s in expected}) == 3


def test_greedy_batched_equals_each_prompt_alone(model):
    batched = generate(model, PROMPTS, max_new_tokens=8)
    for i, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt], max_new_tokens=8)
        assert alone.sequences[0] == batched.sequences[i]
        assert alone.logprobs[0] == pytest.approx(batched.logprobs[i], abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_plain_forward_over_prompt_and_completion(pair, temperature):
    hf, ours = pair
    out = generate(
        ours,
        PROMPTS,
        max_new_tokens=10,
        temperature=temperature,
        top_k=40,
        top_p=0.95,
        generator=torch.Generator().manual_seed(3),
    )
    for prompt, seq, lps in zip(PROMPTS, out.sequences, out.logprobs):
        assert len(seq) == len(lps) == 10
        full = torch.tensor([prompt + seq])
        with torch.no_grad():
            logits = hf(full).logits[0].double()  # transformers as the independent oracle
        if temperature > 0:
            logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(seq) - 1)
        expected = logp[positions, torch.tensor(seq)].tolist()
        assert lps == pytest.approx(expected, abs=1e-4)


def test_logprobs_equal_our_padded_batch_forward(model):
    """What an RL trainer does: one left-padded forward over prompt + completion."""
    temperature = 0.7
    out = generate(
        model,
        PROMPTS,
        max_new_tokens=9,
        temperature=temperature,
        generator=torch.Generator().manual_seed(4),
    )
    full = [p + s for p, s in zip(PROMPTS, out.sequences)]
    ids, mask, pos = left_pad(full, pad_id=0)
    with torch.no_grad():
        logp = policy_logprobs(
            model(ids, position_ids=pos, attention_mask=mask), temperature=temperature
        )
    width = ids.shape[1]
    for i, seq in enumerate(out.sequences):
        # completion token j sits at column width - len(seq) + j, predicted one column earlier
        cols = torch.arange(width - len(seq) - 1, width - 1)
        expected = logp[i, cols, torch.tensor(seq)].tolist()
        assert out.logprobs[i] == pytest.approx(expected, abs=1e-4)


def test_cache_path_equals_no_cache_path(model):
    kwargs = dict(max_new_tokens=10, temperature=1.0, top_p=0.9)
    cached = generate(model, PROMPTS, generator=torch.Generator().manual_seed(9), **kwargs)
    plain = generate(
        model, PROMPTS, generator=torch.Generator().manual_seed(9), use_cache=False, **kwargs
    )
    assert cached.sequences == plain.sequences
    for a, b in zip(cached.logprobs, plain.logprobs):
        assert a == pytest.approx(b, abs=1e-5)
    greedy_cached = generate(model, PROMPTS, max_new_tokens=10)
    greedy_plain = generate(model, PROMPTS, max_new_tokens=10, use_cache=False)
    assert greedy_cached.sequences == greedy_plain.sequences


def test_stop_token_ends_row_and_sets_finish_reason(model):
    full = generate(model, PROMPTS, max_new_tokens=12)
    stop = full.sequences[0][3]
    out = generate(model, PROMPTS, max_new_tokens=12, stop_token_ids=[stop], pad_id=0)
    for i, seq in enumerate(full.sequences):
        if stop in seq:
            end = seq.index(stop) + 1
            assert out.sequences[i] == seq[:end]
            assert out.finish_reasons[i] == "stop"
            assert out.logprobs[i] == pytest.approx(full.logprobs[i][:end], abs=1e-5)
        else:
            assert out.sequences[i] == seq
            assert out.finish_reasons[i] == "length"
    assert out.finish_reasons[0] == "stop"
    assert len(out.sequences[0]) <= 4


def test_stop_on_last_step_is_stop_not_length(model):
    full = generate(model, PROMPTS[:1], max_new_tokens=6)
    last = full.sequences[0][-1]
    first = full.sequences[0].index(last)
    out = generate(model, PROMPTS[:1], max_new_tokens=first + 1, stop_token_ids=[last])
    assert out.sequences[0] == full.sequences[0][: first + 1]
    assert out.finish_reasons == ["stop"]


def test_loop_ends_when_all_rows_finished(model):
    first_tokens = [s[0] for s in generate(model, PROMPTS, max_new_tokens=1).sequences]
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        out = generate(model, PROMPTS, max_new_tokens=20, stop_token_ids=first_tokens)
    finally:
        handle.remove()
    assert out.sequences == [[t] for t in first_tokens]
    assert out.finish_reasons == ["stop"] * 3
    assert len(calls) == 1  # prefill only


def test_top_k_1_sampling_equals_greedy(model):
    greedy = generate(model, PROMPTS, max_new_tokens=8)
    sampled = generate(
        model,
        PROMPTS,
        max_new_tokens=8,
        temperature=1.5,
        top_k=1,
        generator=torch.Generator().manual_seed(0),
    )
    assert sampled.sequences == greedy.sequences


def test_same_seed_same_samples(model):
    def run(seed: int):
        return generate(
            model,
            PROMPTS,
            max_new_tokens=10,
            temperature=1.2,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = run(1), run(1), run(2)
    assert a.sequences == b.sequences and a.logprobs == b.logprobs
    assert a.sequences != c.sequences


def test_tensor_prompts_and_zero_new_tokens(model):
    as_lists = generate(model, [PROMPTS[0], PROMPTS[0][::-1]], max_new_tokens=5)
    as_tensor = generate(model, torch.tensor([PROMPTS[0], PROMPTS[0][::-1]]), max_new_tokens=5)
    assert as_tensor.sequences == as_lists.sequences
    single = generate(model, torch.tensor(PROMPTS[0]), max_new_tokens=5)
    assert single.sequences == as_lists.sequences[:1]
    empty = generate(model, PROMPTS, max_new_tokens=0)
    assert empty.sequences == [[], [], []] and empty.finish_reasons == ["length"] * 3


def test_bad_input_raises_clear_errors(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[3], []], max_new_tokens=2)
    with pytest.raises(ValueError, match=f"prompt 0 holds token id {VOCAB}"):
        generate(model, [[VOCAB]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[3]], max_new_tokens=-1)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[3]], max_new_tokens=2, temperature=1.0, top_p=2.0)


def test_runs_in_bfloat16(model):
    spec = model.spec
    low = build_model(spec, dtype=torch.bfloat16)
    low.load_state_dict(model.state_dict())
    out = generate(low, PROMPTS, max_new_tokens=4, temperature=1.0, stop_token_ids=[VOCAB - 1])
    assert all(1 <= len(s) <= 4 for s in out.sequences)
    assert all(0 <= t < VOCAB for s in out.sequences for t in s)
    assert all(lp <= 0.0 and lp == lp for lps in out.logprobs for lp in lps)
