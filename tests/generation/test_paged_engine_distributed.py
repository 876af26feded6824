"""The rollout engine on two gloo ranks: FSDP2 data parallel and tensor parallel.

FSDP2 (every forward a collective): each rank passes its own prompts, a different number of
rows on each (one rank none at all), with its own engine settings, and ``sync_ranks=True``;
every rank's rows equal what the plain engine gives on the unsharded model, the ranks make the
same number of forwards (none is left waiting in a collective: no hang), and the model is
resharded after. Tensor parallel (tp=2, with and without sequence parallel): both ranks pass
the same prompts and get the unsharded plain engine's rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.gloo_world import run_on_ranks
from tunesmith.generation import generate
from tunesmith.generation.config import EngineSettings
from tunesmith.generation.paged import generate_paged
from tunesmith.models.zoo import llama3

WORLD = 2
BLOCK = 4
LONG = [5, 17, 99, 3, 42, 8, 61, 7, 9, 10, 11]
RANK_PROMPTS = {  # rank 0: four rows (a group of two), rank 1: one
    0: [LONG, [77, 12], LONG, [150, 4, 4, 90, 33, 21]],
    1: [[150, 4, 4, 90, 33, 21, 7, 120, 64, 9, 18, 2, 3]],
}
RANK_LIMITS = {0: [9, 4, 6, 3], 1: [12]}
RANK_KEYS = {0: [11, 12, 13, 14], 1: [21]}
RANK_SETTINGS = {  # the ranks' engines differ: slots, block size, cache budget
    0: EngineSettings(block_size=BLOCK, max_slots=2),
    1: EngineSettings(block_size=8),
}
TP_PROMPTS = [LONG, [77, 12], LONG, [150, 4, 4, 90, 33, 21, 7, 120, 64, 9, 18, 2, 3]]
TP_LIMITS = [9, 4, 6, 11]
TP_KEYS = [31, 32, 33, 34]


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama3.llama3_tiny(initializer_range=0.1).eval()


def _fsdp_cases(rank: int, stop: list[int]) -> dict[str, tuple[list, dict]]:
    """name -> (this rank's prompts, generate kwargs); rank -1: either rank's, for reference."""
    prompts, limits, keys = RANK_PROMPTS[rank], RANK_LIMITS[rank], RANK_KEYS[rank]
    return {
        "greedy": (prompts, dict(max_new_tokens=limits, stop_token_ids=stop)),
        "keyed": (prompts, dict(max_new_tokens=limits, row_keys=keys, temperature=1.0,
                                top_p=0.9)),
        # rank 1 has no rows at all: it still joins every forward of rank 0
        "empty": (prompts if rank == 0 else [],
                  dict(max_new_tokens=limits if rank == 0 else [], row_keys=keys if rank == 0
                       else [], temperature=1.0)),
    }  # fmt: skip


def _fsdp_worker(rank: int, stop: list[int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _tiny()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls: list[int] = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    result: dict = {}
    for name, (prompts, kwargs) in _fsdp_cases(rank, stop).items():
        calls.clear()
        out = generate_paged(model, prompts, sync_ranks=True, settings=RANK_SETTINGS[rank],
                             **kwargs)  # fmt: skip
        result[name] = (out.sequences, out.logprobs, out.finish_reasons, len(calls))
        result[f"{name}_resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
        result[f"{name}_prefill_tokens"] = out.stats["prefill_tokens"]
    return result


def _tp_cases(stop: list[int]) -> dict[str, dict]:
    return {
        "greedy": dict(max_new_tokens=TP_LIMITS, stop_token_ids=stop),
        "keyed": dict(max_new_tokens=TP_LIMITS, row_keys=TP_KEYS, temperature=1.0, top_k=50,
                      top_p=0.9, stop_token_ids=stop),
    }  # fmt: skip


def _tp_worker(rank: int, stop: list[int]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from tunesmith.training.parallel.tensor_parallel import apply_tensor_parallel

    result: dict = {}
    for sequence_parallel in (True, False):
        model = _tiny()
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
        apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
        for name, kwargs in _tp_cases(stop).items():
            settings = EngineSettings(block_size=BLOCK, max_slots=2)
            out = generate_paged(model, TP_PROMPTS, settings=settings, **kwargs)
            key = f"sp={sequence_parallel} {name}"
            result[key] = (out.sequences, out.logprobs, out.finish_reasons)
    return result


def _check(got: tuple, want, where: str) -> None:
    sequences, logprobs, reasons = got[:3]
    assert sequences == want.sequences, where
    assert reasons == want.finish_reasons, where
    for i, (g, w) in enumerate(zip(logprobs, want.logprobs, strict=True)):
        assert g == pytest.approx(w, abs=1e-5, rel=0), f"{where} row {i}"


@pytest.fixture(scope="module")
def stop() -> list[int]:
    """A token that ends rank 0's second row early under greedy decoding."""
    return [generate(_tiny(), RANK_PROMPTS[0], max_new_tokens=4).sequences[1][2]]


def test_fsdp2_ranks_with_different_rows_decode_as_the_unsharded_plain_engine(stop):
    reference = _tiny()
    results = run_on_ranks(_fsdp_worker, WORLD, stop, timeout_s=60)
    expected = {
        rank: {
            name: generate(reference, prompts, **kwargs) if prompts else None
            for name, (prompts, kwargs) in _fsdp_cases(rank, stop).items()
        }
        for rank in range(WORLD)
    }
    assert expected[0]["greedy"].finish_reasons[1] == "stop"  # a row ends early on rank 0
    for rank, result in enumerate(results):
        for name in ("greedy", "keyed", "empty"):
            where = f"rank {rank} {name}"
            want = expected[rank][name]
            if want is None:
                assert result[name][:3] == ([], [], []), where
            else:
                _check(result[name], want, where)
            assert result[f"{name}_resharded"], where
    for name in ("greedy", "keyed", "empty"):  # every forward had its partner on the other rank
        assert results[0][name][3] == results[1][name][3] > 0, name
    # rank 0's group of two was prefilled once
    assert results[0]["greedy_prefill_tokens"] == len(LONG) + 2 + 6
    assert results[1]["empty_prefill_tokens"] == 0


def test_tensor_parallel_ranks_decode_as_the_unsharded_plain_engine(stop):
    reference = _tiny()
    cases = _tp_cases(stop)
    expected = {name: generate(reference, TP_PROMPTS, **kw) for name, kw in cases.items()}
    results = run_on_ranks(_tp_worker, WORLD, stop, timeout_s=60)
    for rank, result in enumerate(results):
        for sequence_parallel in (True, False):
            for name, want in expected.items():
                where = f"rank {rank} sp={sequence_parallel} {name}"
                _check(result[f"sp={sequence_parallel} {name}"], want, where)
