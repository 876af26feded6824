"""Rollout-grade generation: min-p, per-row limits, stop strings, timing, the generator /
trainer log-prob parity, and ranks of a sharded (FSDP2) model that stop together."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.gloo_world import run_on_ranks
from tunesmith.data import Tokenizer
from tunesmith.generation import (
    MinP,
    Temperature,
    apply_processors,
    build_processors,
    generate,
    left_pad,
    policy_logprobs,
    sample,
)
from tunesmith.models import llama3

TEXTS = [
    "The cat sat on the mat, and then it ran away.",
    "Add 12 and 30.",
    "Once upon a time there was a small tokenizer that",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)  # a wide init: well separated logits, varied greedy continuations
    return llama3.llama3_tiny(vocab_size=tokenizer.vocab_size, initializer_range=0.2).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    assert len({len(r) for r in rows}) == 3  # a left-padded batch
    return rows


def _kept(logits: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(logits[0].tolist()) if v != float("-inf")}


# -- min-p ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        # probs 0.05, 0.40, 0.10, 0.25, 0.20: the threshold is p * 0.40
        (0.55, {1, 3}),  # >= 0.22
        (0.30, {1, 3, 4}),  # >= 0.12
        (0.20, {1, 2, 3, 4}),  # >= 0.08
        (0.10, {0, 1, 2, 3, 4}),  # >= 0.04
        (1.00, {1}),
        (0.00, {0, 1, 2, 3, 4}),
    ],
)
def test_min_p_keeps_tokens_above_fraction_of_top_probability(p, expected):
    logits = torch.tensor([[math.log(q) for q in (0.05, 0.40, 0.10, 0.25, 0.20)]])
    out = MinP(p)(logits)
    assert _kept(out) == expected
    assert torch.equal(out[0, sorted(expected)], logits[0, sorted(expected)])


def test_min_p_applies_after_temperature():
    probs = [0.05, 0.40, 0.10, 0.25, 0.20]
    logits = torch.tensor([[math.log(q) for q in probs]])
    # at temperature 2 the probabilities go as sqrt(q): ratios to the top are
    # sqrt(q / 0.40) = 0.354, 1, 0.5, 0.791, 0.707
    processors = build_processors(2.0, min_p=0.6)
    assert [type(p) for p in processors] == [Temperature, MinP]
    assert _kept(apply_processors(logits, processors)) == {1, 3, 4}
    assert _kept(MinP(0.6)(logits)) == {1, 3}  # ratios 0.125, 1, 0.25, 0.625, 0.5
    assert build_processors(0.0, min_p=0.6) == []  # greedy
    assert [type(p) for p in build_processors(1.0, min_p=0.0)] == [Temperature]


def test_min_p_matches_brute_force_and_keeps_the_top_token():
    logits = torch.randn(32, 11, generator=torch.Generator().manual_seed(0)) * 3
    for p in (0.05, 0.3, 0.9, 1.0):
        out = MinP(p)(logits)
        for row in range(logits.shape[0]):
            probs = torch.softmax(logits[row].double(), dim=-1).tolist()
            expected = {i for i, q in enumerate(probs) if q >= p * max(probs)}
            assert _kept(out[row : row + 1]) == expected
            assert int(logits[row].argmax()) in expected


def test_min_p_bad_values_raise():
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_p"):
            MinP(bad)
        with pytest.raises(ValueError, match="min_p"):
            build_processors(1.0, min_p=bad)
        with pytest.raises(ValueError, match="min_p"):
            sample(torch.zeros(1, 3), temperature=1.0, min_p=bad)


def test_min_p_sampling_draws_only_kept_tokens_and_reports_raw_logprobs():
    logits = torch.tensor([[math.log(q) for q in (0.05, 0.40, 0.10, 0.25, 0.20)]]).repeat(500, 1)
    out = sample(logits, temperature=1.0, min_p=0.55, generator=torch.Generator().manual_seed(0))
    assert set(out.tokens.tolist()) == {1, 3}
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert out.logprobs.tolist() == pytest.approx(raw[out.tokens].tolist(), abs=1e-6)


def test_min_p_generation_is_seeded_repeatable(model, prompts):
    def run(seed: int):
        return generate(
            model,
            prompts,
            max_new_tokens=12,
            temperature=1.3,
            min_p=0.05,
            generator=torch.Generator().manual_seed(seed),
        )

    a, b, c = run(1), run(1), run(2)
    assert a.sequences == b.sequences and a.logprobs == b.logprobs
    assert a.sequences != c.sequences
    # min_p = 1 keeps only the top token: sampling at any temperature is greedy
    greedy = generate(model, prompts, max_new_tokens=12)
    top_only = generate(
        model,
        prompts,
        max_new_tokens=12,
        temperature=2.0,
        min_p=1.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert top_only.sequences == greedy.sequences


# -- per-row limits, stop strings, batching -------------------------------------------------


def test_per_row_max_new_tokens(model, prompts):
    full = generate(model, prompts, max_new_tokens=9)
    out = generate(model, prompts, max_new_tokens=[3, 0, 9])
    assert [len(s) for s in out.sequences] == [3, 0, 9]
    assert out.sequences == [full.sequences[0][:3], [], full.sequences[2]]
    assert out.logprobs[0] == pytest.approx(full.logprobs[0][:3], abs=1e-5)
    assert out.finish_reasons == ["length"] * 3
    assert generate(model, prompts, max_new_tokens=torch.tensor([2, 1, 0])).sequences == [
        full.sequences[0][:2],
        full.sequences[1][:1],
        [],
    ]
    with pytest.raises(ValueError, match="2 entries but there are 3 prompts"):
        generate(model, prompts, max_new_tokens=[3, 4])
    with pytest.raises(ValueError, match=r"max_new_tokens\[1\] must be an int >= 0"):
        generate(model, prompts, max_new_tokens=[3, -1, 2])


def _first_stop(tokenizer: Tokenizer, seq: list[int], stops: list[str]) -> int | None:
    """The spec, by brute force: the fewest tokens whose decoded text holds a stop string."""
    for n in range(1, len(seq) + 1):
        text = tokenizer.decode(seq[:n])
        if any(s in text for s in stops):
            return n
    return None


def test_stop_strings_cut_right_after_the_completing_token(model, tokenizer, prompts):
    n = 30
    full = generate(model, prompts[:1], max_new_tokens=n).sequences[0]
    cases = 0
    for k in (2, 9, 17, 26, 30):  # short stops late in the row use the decode window
        prefix_text = tokenizer.decode(full[:k])
        for stop in (prefix_text, prefix_text[-3:]):
            if not stop:
                continue
            out = generate(
                model,
                prompts[:1],
                max_new_tokens=n,
                stop_strings=[stop],
                decode=tokenizer.decode,
            )
            expected = _first_stop(tokenizer, full, [stop])
            assert expected is not None and expected <= k
            assert out.sequences[0] == full[:expected], (k, stop)
            assert out.finish_reasons == ["stop"]
            cases += 1
    assert cases >= 8
    # the decoded greedy prefix as a stop string: cut exactly after its last token
    text = tokenizer.decode(full[:5])
    assert _first_stop(tokenizer, full, [text]) == 5  # the text grew at token 5
    out = generate(
        model, prompts[:1], max_new_tokens=n, stop_strings=[text], decode=tokenizer.decode
    )
    assert out.sequences[0] == full[:5] and out.logprobs[0] == pytest.approx(
        generate(model, prompts[:1], max_new_tokens=5).logprobs[0], abs=1e-6
    )


def test_stop_strings_follow_the_whole_completion_not_a_decoded_tail(model, prompts):
    """A decoder whose text is not prefix-stable (here: it capitalises the first letter, as
    some detokenizers do) must not stop a row on text only a decoded tail shows."""

    def decode(ids: list[int]) -> str:
        text = "".join(chr(ord("a") + i % 26) for i in ids)
        return text[:1].upper() + text[1:]

    n = 40
    full = generate(model, prompts[:1], max_new_tokens=n).sequences[0]
    letters = decode(full).lower()
    # the last 3 + 8 tokens of the first 31, decoded alone, start with this capitalised text
    start = 31 - (3 + 8)
    stop = letters[start].upper() + letters[start + 1 : start + 3]
    assert stop in decode(full[start:31])
    out = generate(model, prompts[:1], max_new_tokens=n, stop_strings=[stop], decode=decode)
    first = next((k for k in range(1, n + 1) if stop in decode(full[:k])), None)
    assert out.sequences[0] == full[: first or n]
    assert out.finish_reasons == ["stop" if first else "length"]
    assert first is None or first < 31


def test_stop_string_absent_or_only_in_prompt_does_not_stop(model, tokenizer, prompts):
    full = generate(model, prompts[:1], max_new_tokens=12)
    completion = tokenizer.decode(full.sequences[0])
    in_prompt = next(
        w for w in TEXTS[0].split() if w not in completion and len(w) > 2
    )  # a prompt word the completion never says
    out = generate(
        model,
        prompts[:1],
        max_new_tokens=12,
        stop_strings=[in_prompt, "\x00never\x00"],
        decode=tokenizer.decode,
    )
    assert out.sequences == full.sequences and out.finish_reasons == ["length"]


def test_stop_strings_need_decode(model, prompts):
    with pytest.raises(ValueError, match="stop_strings need decode="):
        generate(model, prompts, max_new_tokens=3, stop_strings=["x"])
    with pytest.raises(ValueError, match=r"stop_strings\[1\] must be a non-empty string"):
        generate(model, prompts, max_new_tokens=3, stop_strings=["x", ""], decode=str)


def test_batched_mixed_limits_and_stops_equal_each_row_alone(model, tokenizer, prompts):
    alone_full = [generate(model, [p], max_new_tokens=14).sequences[0] for p in prompts]
    stop_token = alone_full[1][4]
    stop_text = tokenizer.decode(alone_full[2][:7])[-3:]
    kwargs = dict(stop_token_ids=[stop_token], stop_strings=[stop_text], decode=tokenizer.decode)
    limits = [3, 14, 12]
    batched = generate(model, prompts, max_new_tokens=limits, **kwargs)
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        alone = generate(model, [prompt], max_new_tokens=limit, **kwargs)
        assert batched.sequences[i] == alone.sequences[0]
        assert batched.finish_reasons[i] == alone.finish_reasons[0]
        assert batched.logprobs[i] == pytest.approx(alone.logprobs[0], abs=1e-5)
    # the rows end at different steps, by different rules
    lengths = [len(s) for s in batched.sequences]
    assert len(set(lengths)) == 3
    assert batched.finish_reasons[0] == "length" and lengths[0] == 3
    assert batched.finish_reasons[1] == "stop" and batched.sequences[1][-1] == stop_token
    assert batched.finish_reasons[2] == "stop" and lengths[2] < 12
    assert stop_text in tokenizer.decode(batched.sequences[2])
    assert stop_text not in tokenizer.decode(batched.sequences[2][:-1])


# -- log-prob parity with the trainer's forward ---------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "options"),
    [(0.0, {}), (0.7, {}), (0.7, {"top_k": 50, "top_p": 0.9, "min_p": 0.02})],
)
def test_logprobs_equal_policy_logprobs_of_left_padded_forward(
    model, prompts, temperature, options
):
    """What an RL trainer does: one left-padded forward over prompt + completion, whose
    log-probs at the completion tokens must equal those the generator returned."""
    full_greedy = generate(model, prompts, max_new_tokens=10).sequences
    out = generate(
        model,
        prompts,
        max_new_tokens=[10, 7, 10],
        temperature=temperature,
        stop_token_ids=[full_greedy[2][5]],
        generator=torch.Generator().manual_seed(11),
        **options,
    )
    assert len({len(s) for s in out.sequences}) > 1  # completions of different lengths
    rows = [p + s for p, s in zip(prompts, out.sequences)]
    ids, mask, pos = left_pad(rows, pad_id=0)
    with torch.no_grad():
        logits = model(ids, position_ids=pos, attention_mask=mask)
    logp = policy_logprobs(logits, temperature=temperature)
    width = ids.shape[1]
    for i, seq in enumerate(out.sequences):
        cols = torch.arange(width - len(seq) - 1, width - 1)  # each token predicted one earlier
        expected = logp[i, cols, torch.tensor(seq)]
        torch.testing.assert_close(torch.tensor(out.logprobs[i]), expected, rtol=0, atol=1e-5)


# -- timing, empty ranks ----------------------------------------------------------------------


def test_output_reports_seconds_and_new_tokens(model, prompts):
    before = time.perf_counter()
    out = generate(model, prompts, max_new_tokens=[4, 6, 2])
    elapsed = time.perf_counter() - before
    assert out.new_tokens == 12
    assert 0 < out.seconds <= elapsed
    assert generate(model, prompts, max_new_tokens=0).new_tokens == 0


def test_empty_prompts_only_with_sync(model):
    with pytest.raises(ValueError, match="prompts is empty"):
        generate(model, [], max_new_tokens=3)
    out = generate(model, [], max_new_tokens=[], sync_ranks=True)  # one process: no peers
    assert out.sequences == [] and out.finish_reasons == [] and out.new_tokens == 0


def test_generate_then_train_the_same_model(model, prompts):
    trained = llama3.llama3_tiny(vocab_size=model.spec.vocab_size)
    trained.load_state_dict(model.state_dict())
    out = generate(trained, prompts, max_new_tokens=5)
    ids, mask, pos = left_pad([p + s for p, s in zip(prompts, out.sequences)])
    loss = -policy_logprobs(trained(ids, position_ids=pos, attention_mask=mask)).mean()
    loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in trained.parameters())


# -- two ranks, FSDP2 -------------------------------------------------------------------------

WORLD = 2
RANK_PROMPTS = {
    0: [[5, 17, 99, 3, 42, 8, 61], [77, 12]],
    1: [[150, 4, 4, 90, 33, 21, 7, 120, 64, 9, 18]],
}
RANK_LIMITS = {0: [3, 11], 1: [7]}
LR = 0.5


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return llama3.llama3_tiny(initializer_range=0.2)


def _rank_kwargs(rank: int, stop_token_ids: list[int]) -> dict:
    return dict(max_new_tokens=RANK_LIMITS[rank], stop_token_ids=stop_token_ids)


def _completion_loss(model, prompts, sequences) -> torch.Tensor:
    """Minus the summed log-prob of the completions, one left-padded forward."""
    ids, mask, pos = left_pad([p + s for p, s in zip(prompts, sequences)])
    logp = policy_logprobs(model(ids, position_ids=pos, attention_mask=mask))
    width, total = ids.shape[1], 0.0
    for i, seq in enumerate(sequences):
        cols = torch.arange(width - len(seq) - 1, width - 1)
        total = total + logp[i, cols, torch.tensor(seq, dtype=torch.long)].sum()
    return -total


def _fsdp_worker(rank: int, stop_token_ids: list[int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _tiny()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    prompts, kwargs = RANK_PROMPTS[rank], _rank_kwargs(rank, stop_token_ids)
    result: dict = {}

    first = generate(model, prompts, sync_ranks=True, **kwargs)
    result["first"] = (first.sequences, first.logprobs, first.finish_reasons)
    result["calls"] = len(calls)
    result["resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    # train on the rollout: forward + backward + an optimizer step on the sharded model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    _completion_loss(model, prompts, first.sequences).backward()
    result["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    # generate again with the updated weights, then train again
    second = generate(model, prompts, sync_ranks=True, **kwargs)
    result["second"] = (second.sequences, second.logprobs, second.finish_reasons)
    _completion_loss(model, prompts, second.sequences).backward()
    result["second_grads_finite"] = all(
        p.grad.to_local().isfinite().all() for p in model.parameters()
    )
    # a rank with no prompts still joins every decode step
    calls.clear()
    empty = generate(
        model,
        prompts if rank == 0 else [],
        max_new_tokens=RANK_LIMITS[0] if rank == 0 else [],
        stop_token_ids=stop_token_ids,
        sync_group=dist.group.WORLD,
    )
    result["empty"] = (empty.sequences, empty.finish_reasons, len(calls))
    return result


def test_fsdp2_ranks_stop_together_match_unsharded_and_train_after():
    """Two gloo ranks, an FSDP2-sharded model, different prompts, batch sizes and limits per
    rank: every rank runs the same number of forwards, each rank's rows equal what the
    unsharded model generates for them, and the policy trains right after generating (the
    gradients FSDP2 averages are those of the unsharded model; the next generation uses the
    updated weights)."""
    reference = _tiny()
    probe = generate(reference, RANK_PROMPTS[0], max_new_tokens=11).sequences[1]
    stop_token_ids = [probe[5]]  # ends rank 0's second row early (step 6 at the latest)
    expected = {
        r: generate(reference, RANK_PROMPTS[r], **_rank_kwargs(r, stop_token_ids))
        for r in range(WORLD)
    }
    # the rows end at different steps, on different ranks
    ends = [len(s) for r in range(WORLD) for s in expected[r].sequences]
    assert len(set(ends)) == 3 and "stop" in expected[0].finish_reasons

    results = run_on_ranks(_fsdp_worker, WORLD, stop_token_ids, timeout_s=60)

    grads = []
    for rank, result in enumerate(results):
        sequences, logprobs, reasons = result["first"]
        assert sequences == expected[rank].sequences
        assert reasons == expected[rank].finish_reasons
        for got, want in zip(logprobs, expected[rank].logprobs):
            assert got == pytest.approx(want, abs=1e-5)
        assert result["resharded"]
        reference.zero_grad()
        _completion_loss(reference, RANK_PROMPTS[rank], sequences).backward()
        grads.append({n: p.grad.clone() for n, p in reference.named_parameters()})
    # both ranks ran prefill + max(steps) forwards, as many as the slowest rank needs
    assert results[0]["calls"] == results[1]["calls"] == max(ends)
    for name, _ in reference.named_parameters():  # FSDP2 averages the ranks' gradients
        want = (grads[0][name] + grads[1][name]) / WORLD
        for result in results:
            torch.testing.assert_close(result["grads"][name], want, rtol=1e-4, atol=1e-6)

    with torch.no_grad():
        for name, param in reference.named_parameters():
            param -= LR * (grads[0][name] + grads[1][name]) / WORLD
    for rank, result in enumerate(results):
        again = generate(reference, RANK_PROMPTS[rank], **_rank_kwargs(rank, stop_token_ids))
        assert result["second"][0] == again.sequences
        assert result["second"][0] != result["first"][0]  # the weights did change
        assert result["second_grads_finite"]

    alone = generate(reference, RANK_PROMPTS[0], **_rank_kwargs(0, stop_token_ids))
    assert results[0]["empty"][:2] == (alone.sequences, alone.finish_reasons)
    assert results[1]["empty"][:2] == ([], [])
    assert results[0]["empty"][2] == results[1]["empty"][2] == max(map(len, alone.sequences))
