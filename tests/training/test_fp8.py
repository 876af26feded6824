"""FP8 training (``precision.matmuls``, :mod:`tunesmith.training.fp8`) on the CPU.

No GPU here: the refusals are tested as a user meets them (``tunesmith validate`` and ``tunesmith
run`` say the same line), the layers converted on tiny models, and the float8 maths itself,
which torchao's ``Float8Linear`` runs on the CPU too (``torch._scaled_mm`` has a CPU kernel):
:func:`~tunesmith.training.fp8.apply_fp8` has no device check, and the recipe test replaces
``device_problem`` (:mod:`~tunesmith.training.precision`'s, which ``fp8`` imports) in this
process, a switch no config reaches.
The loss over 50 steps against bf16 at a Qwen3-0.6B shape is the GPU script's
(``benchmarks/gpu/fp8.sh``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.gloo_world import run_on_ranks
from tests.recipes.sft_world import (
    checkpoints,
    make_chat_data,
    make_model_dir,
    read_metrics,
    run_sft_keeping_model,
)
from tunesmith.cli.main import main
from tunesmith.config import ConfigError
from tunesmith.models import build_model, from_hf
from tunesmith.models.zoo import qwen2_5, qwen3_moe
from tunesmith.modules.peft import apply_lora
from tunesmith.training import fp8, precision
from tunesmith.training.memory.compile import compile_model
from tunesmith.training.parallel.distributed import DistributedContext, shard_model

NEED = "needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)"
LOSS_RTOL = 1e-2  # float8 against bf16 matmuls, one step of a random tiny model
GRAD_COSINE = 0.99  # all gradients, flattened, against the bf16 model's


def _float8_names(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")


# ----------------------------------------------------------------------------- refusals


def test_validate_and_run_refuse_it_on_cpu_with_the_same_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a GPU machine too
    model_dir, data = make_model_dir(tmp_path), make_chat_data(tmp_path / "d.jsonl", rows=4)
    out = tmp_path / "out"
    fills = [f"model_dir={model_dir}", f"dataset.source={data}", f"output_dir={out}"]
    fills += ["precision.weights=bf16", "precision.matmuls=fp8_rowwise"]
    assert main(["validate", "sft/tiny", *fills]) == 1
    validated = capsys.readouterr().err.strip()
    assert main(["run", "sft", "--config", "tiny", *fills]) != 0
    ran = capsys.readouterr().err.strip().splitlines()
    expected = (
        f"tunesmith: error: precision: matmuls: fp8_rowwise {NEED}; this machine has no CUDA device"
    )
    assert validated == expected
    assert ran[-1] == expected
    assert not out.exists()


def test_set_up_refuses_an_older_gpu_and_a_cpu_device(monkeypatch):
    cfg = {"precision": {"weights": "bf16", "matmuls": "fp8_tensorwise"}}
    _fake_gpu(monkeypatch, (8, 0))
    with pytest.raises(ConfigError) as older:
        fp8.prepare(nn.Linear(16, 16), cfg, torch.device("cuda"))
    assert str(older.value) == f"precision: matmuls: fp8_tensorwise {NEED}; NVIDIA A100 is 8.0"
    assert fp8.machine_problem(cfg["precision"]) == str(older.value).split(": ", 1)[1]
    _fake_gpu(monkeypatch, (9, 0))
    assert fp8.machine_problem(cfg["precision"]) is None  # Hopper: validate lets it through
    with pytest.raises(ConfigError) as on_cpu:  # device: cpu on that machine: set-up refuses
        fp8.prepare(nn.Linear(16, 16), cfg, torch.device("cpu"))
    assert str(on_cpu.value) == f"precision: matmuls: fp8_tensorwise {NEED}; this run is on the CPU"


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"precision": {"matmuls": "fp8_rowwise"}}, "precision.matmuls: fp8_rowwise needs bf16"),
        ({"lora": True}, "precision.matmuls: fp8_rowwise trains full weights"),
        ({"quantization": {"qat": {"scheme": "int4w"}}}, "quantization: QAT with precision"),
        ({"parallelism": {"tp": 2}}, "parallelism.tp: tensor parallel with precision.matmuls"),
    ],
)
def test_what_it_does_not_combine_with_is_refused_by_key(monkeypatch, change, words):
    _fake_gpu(monkeypatch, (9, 0))
    cfg = {"precision": {"weights": "bf16", "matmuls": "fp8_rowwise"}, **change}
    model = nn.Sequential(nn.Linear(32, 32))
    if cfg.pop("lora", False):
        apply_lora(model, rank=4, alpha=8, target_modules=["0"])
    with pytest.raises(ConfigError) as refused:
        fp8.prepare(model, cfg, torch.device("cuda"))
    assert str(refused.value).startswith(words), refused.value
    assert _float8_names(model) == []  # refused before anything was converted


def test_an_unknown_matmuls_value_is_named():
    assert precision.precision_problem({"matmuls": "fp8"}) == (
        "matmuls: expected one of fp8_rowwise, fp8_tensorwise, or null (the weights' dtype), "
        "got 'fp8'"
    )


# ----------------------------------------------------------------------------- layers


def test_linear_layers_with_sizes_of_16_convert_but_lm_head_and_routers_do_not():
    # kv projections 2 x 12 = 24 wide (not a multiple of 16); 16 experts so the router's size fits
    spec = qwen3_moe.spec("qwen3_moe_tiny", num_experts=16, head_dim=12)
    model = build_model(spec)
    expected = []
    for i in range(spec.num_hidden_layers):
        expected += [f"model.layers.{i}.self_attn.q_proj", f"model.layers.{i}.self_attn.o_proj"]
        if i in spec.mlp_only_layers:  # a dense MLP; the MoE layers' experts are no nn.Linear
            expected += [f"model.layers.{i}.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    assert sorted(fp8.fp8_layers(model)) == sorted(expected)
    fp8.apply_fp8(model, fp8.FP8Settings("tensorwise"))
    assert sorted(_float8_names(model)) == sorted(expected)
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.gate) is nn.Linear


# ----------------------------------------------------------------------------- maths


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_loss_and_gradients_follow_bf16(recipe):
    torch.manual_seed(0)
    plain = build_model(qwen2_5.spec("qwen2_5_tiny")).to(torch.bfloat16)
    converted = fp8.apply_fp8(copy.deepcopy(plain), fp8.FP8Settings(recipe))
    assert len(_float8_names(converted)) == 7 * 2  # q, k, v, o, gate, up, down of 2 layers
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    want, got = _loss(plain, ids), _loss(converted, ids)
    want.backward()
    got.backward()
    assert abs(got.item() - want.item()) <= LOSS_RTOL * want.item()
    grads = [
        (p.grad, q.grad) for p, q in zip(plain.parameters(), converted.parameters(), strict=True)
    ]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for _, g in grads)
    flat = [torch.cat([g.float().flatten() for g in side]) for side in zip(*grads, strict=True)]
    assert F.cosine_similarity(*flat, dim=0) > GRAD_COSINE


def test_compiled_float8_layers_compute_what_eager_ones_do():
    torch.manual_seed(0)
    plain = build_model(qwen2_5.spec("qwen2_5_tiny")).to(torch.bfloat16)
    eager = fp8.apply_fp8(copy.deepcopy(plain), fp8.FP8Settings("tensorwise"))
    compiled = fp8.apply_fp8(copy.deepcopy(plain), fp8.FP8Settings("tensorwise"))
    compile_model(compiled, backend="aot_eager")  # the traced float8 casts, without inductor
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    want, got = _loss(eager, ids), _loss(compiled, ids)
    want.backward()
    got.backward()
    assert got.item() == want.item()
    for p, q in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_sft_trains_with_float8_matmuls_as_bf16_and_saves_a_plain_folder(tmp_path, monkeypatch):
    for module in (fp8, precision):  # the test-only switch: the rule's and the set-up's check
        monkeypatch.setattr(module, "device_problem", lambda device, matmuls="": None)
    model_dir, data = make_model_dir(tmp_path), make_chat_data(tmp_path / "d.jsonl", rows=16)
    bf16 = ["precision.weights=bf16", "precision.master_weights=fp32", "max_steps=4"]
    bf16 += ["optimizer.fused=false"]
    out, model = run_sft_keeping_model(
        model_dir, data, tmp_path / "fp8", *bf16, "precision.matmuls=fp8_rowwise"
    )
    reference, _ = run_sft_keeping_model(model_dir, data, tmp_path / "bf16", *bf16)
    assert len(_float8_names(model)) == 7 * 2
    got, want = read_metrics(out), read_metrics(reference)
    for step in range(1, 5):
        assert abs(got[step]["loss"] - want[step]["loss"]) <= LOSS_RTOL * want[step]["loss"]
    saved = from_hf(checkpoints(out)[-1])  # the HF names, nothing float8 in them
    assert saved.state_dict().keys() == from_hf(model_dir).state_dict().keys()


# ----------------------------------------------------------------------------- FSDP2


def _sharded_against_single(rank: int, world: int) -> dict[str, float]:
    torch.manual_seed(0)
    plain = build_model(qwen2_5.spec("qwen2_5_tiny")).to(torch.bfloat16)
    single = fp8.apply_fp8(copy.deepcopy(plain), fp8.FP8Settings("tensorwise"))
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    want = _loss(single, ids)
    want.backward()
    ctx = DistributedContext(
        rank, world, rank, torch.device("cpu"), init_device_mesh("cpu", (world,))
    )
    sharded = shard_model(fp8.apply_fp8(copy.deepcopy(plain), fp8.FP8Settings("tensorwise")), ctx)
    got = _loss(sharded, ids)  # every rank the same rows: the same loss as one device
    got.backward()
    name = "model.layers.0.self_attn.q_proj.weight"
    grad = dict(sharded.named_parameters())[name].grad.full_tensor()
    return {
        "loss": abs(got.item() - want.item()),
        "grad": (grad - dict(single.named_parameters())[name].grad).abs().max().item(),
        "float8": float(len(_float8_names(sharded))),
    }


def test_fsdp2_shards_float8_layers_as_one_device_runs_them():
    for result in run_on_ranks(_sharded_against_single, 2, 2):
        assert result == {"loss": 0.0, "grad": 0.0, "float8": 14.0}
