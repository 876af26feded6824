"""LoRA / DoRA under tensor parallel == one device (issue #15).

Two gloo ranks shard adapted models with :func:`apply_tensor_parallel` and compare, against
the same model unsharded, the logits and the gradients of every ``lora_A``, ``lora_B`` and DoRA
magnitude (gathered from their DTensors): LoRA and DoRA on every linear of the body (column-
and row-wise layers), with and without sequence parallel, a sequence 2 does not divide, qkv
biases (Qwen2.5), an adapted untied ``lm_head`` (Llama 3); every model has an odd vocabulary
and GQA. The adapters start non-trivial (``B`` and the magnitude randomised), so every
gradient and the DoRA norms are exercised. Also: the adapters' placements, adapter dropout
(the one-device masks), ``merge_adapters`` on the sharded model, a PEFT folder gathered from
it and loaded back into it, and the refusal of QLoRA. The recipe-level checks run ``sft`` with
the shipped ``tiny_lora`` config on every linear layer on 2 ranks with ``parallelism.tp=2``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests.gloo_world import run_on_ranks
from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoints,
    final_weights,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    read_metrics,
    recipe_overrides,
    run_sft,
)
from tunesmith.models import build_model
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, load_peft_adapter, save_peft_adapter
from tunesmith.models.zoo import llama3, qwen2_5, qwen3
from tunesmith.modules.peft import adapter_state_dict, apply_lora, merge_adapters
from tunesmith.training.parallel.distributed import full_tensor
from tunesmith.training.parallel.tensor_parallel import apply_tensor_parallel

VOCAB = 259  # odd: uneven vocabulary shards (130 + 129)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SPECS = {
    "qwen3": lambda: qwen3.spec("qwen3_tiny", vocab_size=VOCAB, num_key_value_heads=2),
    "qwen2_5_bias": lambda: qwen2_5.spec("qwen2_5_tiny", vocab_size=VOCAB),
    "llama3_untied": lambda: llama3.spec("llama3_tiny", vocab_size=VOCAB),
}
# (spec, DoRA, sequence parallel, sequence length, extra targets)
CASES = [
    ("qwen3", False, True, 11, ()),
    ("qwen3", False, False, 12, ()),
    ("qwen3", True, True, 12, ()),
    ("qwen3", True, False, 11, ()),
    ("qwen2_5_bias", True, True, 11, ()),
    ("qwen2_5_bias", False, False, 12, ()),
    ("llama3_untied", True, True, 11, ("lm_head",)),
]
EXPECTED_PLACEMENTS = {  # (layer of block 0, parameter) -> placement on the tp mesh
    ("self_attn.q_proj", "weight"): Shard(0),
    ("self_attn.q_proj", "lora_A.weight"): Replicate(),
    ("self_attn.q_proj", "lora_B.weight"): Shard(0),
    ("self_attn.q_proj", "lora_magnitude_vector"): Shard(0),
    ("self_attn.o_proj", "weight"): Shard(1),
    ("self_attn.o_proj", "lora_A.weight"): Shard(1),
    ("self_attn.o_proj", "lora_B.weight"): Replicate(),
    ("self_attn.o_proj", "lora_magnitude_vector"): Replicate(),
    ("mlp.up_proj", "lora_B.weight"): Shard(0),
    ("mlp.down_proj", "lora_A.weight"): Shard(1),
}


def _adapted(spec_name: str, dora: bool, targets: tuple[str, ...] = (), dropout: float = 0.0):
    """A random model of ``spec_name`` with adapters on every linear (and ``targets``), whose
    ``B`` and magnitudes are random too (a fresh adapter is a no-op with zero ``A`` gradients)."""
    torch.manual_seed(0)
    model = build_model(SPECS[spec_name]())
    apply_lora(
        model,
        target_modules=[*ALL_LINEAR, *targets],
        rank=4,
        alpha=8,
        dropout=dropout,
        use_dora=dora,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B.weight"):
                param.normal_(0, 0.2)
            elif name.endswith("lora_magnitude_vector"):
                param.mul_(1 + 0.2 * torch.randn_like(param))
    return model


def _sharded(model, sp: bool):
    sharded = copy.deepcopy(model)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    return apply_tensor_parallel(sharded, mesh, sequence_parallel=sp)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    return full_tensor(tensor).detach()


def _placements(model) -> dict:
    block = model.model.layers[0]
    found = {}
    for layer, local in EXPECTED_PLACEMENTS:
        if not hasattr(block.get_submodule(layer), local.partition(".")[0]):
            continue  # LoRA: no magnitude
        param = block.get_submodule(layer).get_parameter(local)
        found[(layer, local)] = param.placements if isinstance(param, DTensor) else None
    return found


def _compare(spec_name, dora, sp, seq, targets) -> dict:
    """Logits, adapter gradients and merged weights: TP vs one device."""
    reference = _adapted(spec_name, dora, targets)
    sharded = _sharded(reference, sp)
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq))
    expected, actual = reference(ids), sharded(ids)
    out = {"logits": (expected - actual).abs().max().item(), "placements": _placements(sharded)}
    expected.square().mean().backward()
    actual.square().mean().backward()
    grads, n = 0.0, 0
    for (name, p), (name_2, q) in zip(
        reference.named_parameters(), sharded.named_parameters(), strict=True
    ):
        assert name == name_2
        if p.requires_grad:
            grads, n = max(grads, _max_rel(_gathered(q.grad), p.grad)), n + 1
    out["grads"], out["trained"] = grads, n
    with torch.no_grad():  # merging keeps the sharded model a working TP model
        merge_adapters(reference)
        merge_adapters(sharded)
        out["merged_logits"] = (reference(ids) - sharded(ids)).abs().max().item()
        weights = {k: _gathered(v) for k, v in sharded.state_dict().items()}
        out["merged_weights"] = max(
            (weights[k] - v).abs().max().item() for k, v in reference.state_dict().items()
        )
        q, o = sharded.model.layers[0].self_attn.q_proj, sharded.model.layers[0].self_attn.o_proj
        out["merged_placements"] = (type(q).__name__, q.weight.placements, o.weight.placements)
    return out


def _dropout(sp: bool, seq: int) -> dict:
    """Training-mode forward and backward with adapter dropout 0.3, the same seed on both."""
    reference = _adapted("qwen3", True, dropout=0.3)
    sharded = _sharded(reference, sp)
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(3)
    expected = reference(ids)
    torch.manual_seed(3)
    actual = sharded(ids)
    expected.square().mean().backward()
    actual.square().mean().backward()
    pairs = zip(reference.parameters(), sharded.parameters(), strict=True)
    grads = [(p.grad, q.grad) for p, q in pairs if p.requires_grad]
    trained = [q for _, q in grads]
    with torch.no_grad():
        plain = reference.eval()(ids)
    return {
        "logits": (expected - actual).abs().max().item(),
        "grads": max(_max_rel(_gathered(q), p) for p, q in grads),
        "dropped": (expected - plain).abs().max().item(),  # dropout changed the output
        "finite": all(torch.isfinite(t).all() for t in [actual, *map(_gathered, trained)]),
    }


def _peft_round_trip(tmp: str, rank: int) -> dict:
    """A PEFT folder written from the gathered TP adapters == the one-device folder; loaded
    back into a freshly sharded model, it gives the one-device logits."""
    reference = _adapted("qwen3", True)
    sharded = _sharded(reference, True)
    gathered = {k: _gathered(v) for k, v in adapter_state_dict(sharded).items()}
    out = {}
    if rank == 0:
        save_peft_adapter(reference, f"{tmp}/one")
        save_peft_adapter(sharded, f"{tmp}/tp", state_dict=gathered)
    dist.barrier()
    fresh = _adapted("qwen3", True)
    with torch.no_grad():
        for param in fresh.parameters():
            if param.requires_grad:
                param.zero_()  # the folder must bring every adapter tensor back
    fresh = _sharded(fresh, True)
    load_peft_adapter(fresh, f"{tmp}/tp")
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out["loaded_logits"] = (reference(ids) - fresh(ids)).abs().max().item()
    return out


def _qlora_refusal() -> str:
    model = build_model(SPECS["qwen3"]())
    apply_lora(model, target_modules=["v_proj"], rank=2, alpha=4, quantize_base="nf4")
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    try:
        apply_tensor_parallel(model, mesh)
    except ValueError as e:
        return str(e)
    return "not refused"


def _worker(rank: int, tmp: str) -> dict:
    results = {case: _compare(*case) for case in CASES}
    for sp, seq in ((False, 12), (True, 12), (True, 11)):
        results[("dropout", sp, seq)] = _dropout(sp, seq)
    results["peft"] = _peft_round_trip(tmp, rank)
    results["qlora"] = _qlora_refusal()
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp_adapters")
    return run_on_ranks(_worker, 2, str(tmp))[0], tmp


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=[f"{c[0]}-{'dora' if c[1] else 'lora'}-sp{int(c[2])}-seq{c[3]}" for c in CASES],
)
def test_adapters_under_tp_equal_one_device(results, case):
    got = results[0][case]
    assert got["logits"] < 2e-6, got
    assert got["grads"] < 1e-5, got
    spec, dora, _, _, targets = case
    layers = 2
    assert got["trained"] == layers * 7 * (3 if dora else 2) + len(targets) * (3 if dora else 2)
    for key, placement in EXPECTED_PLACEMENTS.items():
        if key[1] == "lora_magnitude_vector" and not dora:
            continue
        assert got["placements"][key] == (placement,), (key, got["placements"][key])
    assert got["merged_logits"] < 2e-6, got
    assert got["merged_weights"] < 1e-6, got
    assert got["merged_placements"] == ("Linear", (Shard(0),), (Shard(1),))


@pytest.mark.parametrize(("sp", "seq"), [(False, 12), (True, 12), (True, 11)])
def test_adapter_dropout_under_tp(results, sp, seq):
    got = results[0][("dropout", sp, seq)]
    assert got["finite"]
    assert got["dropped"] > 1e-3  # the masks did something
    if seq % 2 == 0:  # the one-device shapes: the one-device masks
        assert got["logits"] < 2e-6, got
        assert got["grads"] < 1e-5, got


def test_peft_folder_from_tp_is_the_one_device_folder(results):
    got, tmp = results
    one, tp = tmp / "one", tmp / "tp"
    assert (one / ADAPTER_CONFIG_NAME).read_bytes() == (tp / ADAPTER_CONFIG_NAME).read_bytes()
    assert json.loads((tp / ADAPTER_CONFIG_NAME).read_text())["use_dora"] is True
    from safetensors.torch import load_file

    a, b = load_file(one / "adapter_model.safetensors"), load_file(tp / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(a) == 2 * 7 * 3
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert got["peft"]["loaded_logits"] < 2e-6


def test_qlora_is_refused_under_tp(results):
    assert "model.layers.0.self_attn.v_proj.weight: an NF4" in results[0]["qlora"]


# -- the recipe: sft with the shipped LoRA config on 2 ranks, tp=2 -----------------------------

STEPS, BATCH = 3, 4
TARGETS = "model.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_lora_sft")
    model_dir = make_model_dir(root, vocab_size=653)  # odd, GQA (4 heads, 2 kv heads)
    data = make_counting_data(root / "count.jsonl", rows=24)
    return root, model_dir, data


def _same_run(
    world, tmp_path, *overrides: str, dp_shard: int = 1, weights_atol: float = 1e-5
) -> None:
    """``sft`` on ``tiny_lora`` (every linear adapted) on ``2 * dp_shard`` ranks (tp 2) logs the
    single process's losses and grad norms and saves the same PEFT folder."""
    root, model_dir, data = world
    common = (f"max_steps={STEPS}", TARGETS, *overrides)
    single = run_sft(
        model_dir, data, tmp_path / "single", f"batch_size={BATCH}", *common, config="tiny_lora"
    )
    out = tmp_path / "tp"
    launch_ranks(
        recipe_overrides(
            model_dir,
            data,
            out,
            f"batch_size={BATCH // dp_shard}",
            *common,
            "parallelism.tp=2",
            f"parallelism.dp_shard={dp_shard}",
        ),
        tmp_path,
        config="tiny_lora",
        world_size=2 * dp_shard,
        timeout=120 * dp_shard,
    )
    mesh = next(
        line
        for line in (tmp_path / "rank0.log").read_text().splitlines()
        if line.startswith("parallelism:")
    )
    assert "'tp') mesh of (" in mesh and ", 2) ranks" in mesh, mesh
    one, two = read_metrics(single), read_metrics(out)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    for step in one:
        for key in ("loss", "grad_norm"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5), (step, key)
    weights = final_weights(out)
    assert_same_weights(weights, final_weights(single), weights_atol)
    assert max(w.abs().max().item() for k, w in weights.items() if "lora_B" in k) > 1e-3
    config_1, config_2 = (checkpoints(run)[-1] / ADAPTER_CONFIG_NAME for run in (single, out))
    assert config_1.read_bytes() == config_2.read_bytes()


def test_sft_lora_tp2_equals_one_process(world, tmp_path):
    _same_run(world, tmp_path)


@pytest.mark.slow
def test_sft_dora_tp2_equals_one_process(world, tmp_path):
    _same_run(world, tmp_path, "model.use_dora=true", "parallelism.sequence_parallel=false")


@pytest.mark.slow
def test_sft_dora_dp_shard2_tp2_equals_one_process(world, tmp_path):
    _same_run(world, tmp_path, "model.use_dora=true", dp_shard=2)


@pytest.mark.slow
def test_sft_lora_dropout_tp2_equals_one_process(world, tmp_path):
    """Adapter dropout draws the single process's masks (the step-1 grad norm, which depends on
    them, matches); Adam's normalisation turns rounding in near-zero gradient entries into
    ~3e-5 weight differences here, hence the looser weight tolerance."""
    _same_run(
        world,
        tmp_path,
        "model.dropout=0.2",
        "parallelism.sequence_parallel=false",
        weights_atol=1e-4,
    )
