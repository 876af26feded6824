"""generate on a tensor-parallel model == generate on one device, on two gloo ranks.

The model is sharded with ``apply_tensor_parallel`` over a ``tp`` mesh of 2 ranks (sequence
parallel on and off; and with FSDP2 on top, over a ``(dp_shard=1, tp=2)`` mesh whose
parameters are 2-D DTensors); both ranks pass the same prompts. For greedy decoding, keyed
sampling (temperature + top-p) and plain sampling with a ``torch.Generator`` (seeded
*differently* on the two ranks: the ranks must still agree, on the first rank's draws), every
rank's tokens, finish reasons and forward count equal the unsharded model's on one process,
log-probs within 1e-5; rows end at different steps (a stop token, per-row limits). Ranks that
pass different prompts get an error on both ranks, not a hang.
"""

from __future__ import annotations

import pytest
import torch

from tests.gloo_world import run_on_ranks
from tunesmith.generation import generate
from tunesmith.models import build_model
from tunesmith.models.zoo import deepseek_v3, llama3, qwen3

WORLD = 2
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [77, 12], [150, 4, 4, 90, 33, 21, 7, 120, 64, 9, 18]]
LIMITS = [3, 11, 7]
SEEDS = {0: 7, 1: 1234}  # plain sampling: the tp ranks' generators differ on purpose
MODELS = {  # qwen3: tied embeddings, qk-norm and an odd vocabulary (shards of 130 + 129)
    "llama3": lambda: llama3.spec("llama3_tiny", initializer_range=0.2),
    "qwen3": lambda: qwen3.spec("qwen3_tiny", vocab_size=259, initializer_range=0.2),
    # multi-head latent attention: heads split, the cached latent replicated on every rank
    "deepseek_v3": lambda: deepseek_v3.spec(
        "deepseek_v3_tiny", num_attention_heads=4, num_key_value_heads=4, initializer_range=0.2
    ),
}
LAYOUTS = {  # (model, sequence_parallel, FSDP2 on top)
    "llama3_sp": ("llama3", True, False),
    "llama3_no_sp": ("llama3", False, False),
    "llama3_fsdp2_sp": ("llama3", True, True),
    "qwen3_sp": ("qwen3", True, False),
    "deepseek_v3_fsdp2_sp": ("deepseek_v3", True, True),
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(MODELS[name]()).eval()


def _cases(stop: list[int], rank: int) -> dict[str, dict]:
    """The generate calls to compare; ``rank`` picks the plain sampler's seed (-1: one process,
    seeded as the tp group's first rank)."""
    seed = SEEDS.get(rank, SEEDS[0])
    return {
        "greedy": dict(max_new_tokens=LIMITS, stop_token_ids=stop),
        "keyed": dict(max_new_tokens=8, stop_token_ids=stop, temperature=0.8, top_p=0.9,
                      row_keys=[11, 12, 13], sync_ranks=True),  # as the RL rollouts call it
        "plain": dict(max_new_tokens=LIMITS, temperature=1.0, top_k=50,
                      generator=torch.Generator().manual_seed(seed)),
        "no_cache": dict(max_new_tokens=5, stop_token_ids=stop, use_cache=False),
    }  # fmt: skip


def _run_cases(model: torch.nn.Module, stop: list[int], rank: int) -> dict[str, tuple]:
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    results = {}
    for name, kwargs in _cases(stop, rank).items():
        calls.clear()
        out = generate(model, PROMPTS, **kwargs)
        results[name] = (out.sequences, out.logprobs, out.finish_reasons, len(calls))
    handle.remove()
    return results


def _worker(rank: int, stop: list[int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tunesmith.training.parallel.tensor_parallel import apply_tensor_parallel

    result: dict = {}
    for layout, (name, sequence_parallel, fsdp) in LAYOUTS.items():
        model = _model(name)
        if fsdp:
            mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp_shard", "tp"))
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh["dp_shard"])
            fully_shard(model, mesh=mesh["dp_shard"])
        else:
            mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
            apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        result[layout] = _run_cases(model, stop, rank)
    # the ranks of a tp group must decode the same batch: both are told so
    try:
        generate(model, PROMPTS[: rank + 1], max_new_tokens=4)
        result["mismatch"] = None
    except ValueError as error:
        result["mismatch"] = str(error)
    return result


@pytest.fixture(scope="module")
def runs():
    """(the single-process results per model, the two ranks' results, the stop token)."""
    probe = generate(_model("llama3"), PROMPTS, max_new_tokens=11).sequences[1]
    stop = [probe[4]]  # ends row 1 early under greedy decoding
    expected = {name: _run_cases(_model(name), stop, rank=-1) for name in MODELS}
    ranks = run_on_ranks(_worker, WORLD, stop, timeout_s=60)
    return expected, ranks, stop


def test_the_reference_rows_end_at_different_steps(runs):
    expected, _, _ = runs
    sequences, _, reasons, calls = expected["llama3"]["greedy"]
    assert reasons[1] == "stop" and len(sequences[1]) <= 5  # the stop token
    assert [len(s) for s in (sequences[0], sequences[2])] == [3, 7]  # their own limits
    assert calls == 7  # prefill + 6 decode forwards: the longest row's 7 tokens
    for name in ("keyed", "plain"):  # sampling draws other tokens than greedy decoding
        assert expected["llama3"][name][0] != sequences


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_tp_rank_generates_what_one_device_does(runs, layout):
    expected, ranks, _ = runs
    model = LAYOUTS[layout][0]
    for case, (sequences, logprobs, reasons, calls) in expected[model].items():
        for rank, result in enumerate(ranks):
            got_sequences, got_logprobs, got_reasons, got_calls = result[layout][case]
            where = f"{layout} {case} rank {rank}"
            assert got_sequences == sequences, where
            assert got_reasons == reasons, where
            assert got_calls == calls, where  # the ranks stop together, when one device does
            for got, want in zip(got_logprobs, logprobs, strict=True):
                assert got == pytest.approx(want, abs=1e-5), where


def test_tp_ranks_with_different_prompts_are_refused_on_every_rank(runs):
    _, ranks, _ = runs
    for result in ranks:
        assert "ranks of a tp group decode one batch together" in result["mismatch"]
