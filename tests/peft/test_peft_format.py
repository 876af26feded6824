"""PEFT-format adapters: ours load in ``peft`` and ``peft``'s load in ours, with equal logits
and gradients; merged export loads in transformers; bad adapters fail naming file and tensor."""

from __future__ import annotations

import json
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from tests.peft.conftest import dense_family_params, randomize_adapters_, token_batch
from tunesmith.models import from_hf, glm4, phi3
from tunesmith.models.export import export_merged
from tunesmith.models.family import family_for
from tunesmith.models.peft_io import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    load_peft_adapter,
    peft_adapter_config,
    read_peft_adapter,
    save_peft_adapter,
)
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.modules.peft import (
    DoRALinear,
    adapter_modules,
    adapter_state_dict,
    apply_lora,
    trainable_parameters,
)

ATTN_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# fp32 logits of two implementations: Gemma 3's (up to 14 here) differ from peft's by up to
# 2.6e-5, as each does from an fp64 run of ours (rounding, not a formula difference).
ATOL = 1e-4


def _hf(folder: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    )


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _peft_name(ours: str) -> str:
    """Our adapter parameter name -> the PeftModel parameter name (adapter 'default')."""
    module, _, kind = ours.rpartition(".lora_")
    kind = "lora_" + kind
    if kind == "lora_magnitude_vector":
        return f"base_model.model.{module}.lora_magnitude_vector.default.weight"
    return f"base_model.model.{module}.{kind.replace('.weight', '.default.weight')}"


def _peft_view(model, ours: str) -> tuple[str, tuple[slice, ...]]:
    """Our adapter parameter name -> (PeftModel parameter name, the part of it that is ours):
    a part of a fused projection (Phi-3's ``q_proj`` in ``qkv_proj``) is its rows of the
    fused lora_B and magnitude, its block of columns of lora_B and its rows of lora_A."""
    module, _, kind = ours.rpartition(".lora_")
    parent, _, leaf = module.rpartition(".")
    fused = family_for(model.spec.model_type).fused
    name = next((f for f, parts in fused.items() if leaf in parts), None)
    if name is None:
        return _peft_name(ours), (slice(None),)
    layers = adapter_modules(model)
    parts = [layers[f"{parent}.{p}"] for p in fused[name]]
    i = fused[name].index(leaf)
    rows = sum(m.out_features for m in parts[:i])
    rows = slice(rows, rows + parts[i].out_features)
    cols = sum(m.rank for m in parts[:i])
    cols = slice(cols, cols + parts[i].rank)
    index = {"A.weight": (cols,), "B.weight": (rows, cols), "magnitude_vector": (rows,)}[kind]
    return _peft_name(f"{parent}.{name}.lora_{kind}"), index


def _hf_leaves(family: str, leaves: list[str]) -> list[str]:
    """``leaves`` with every complete group of a fused projection as its fused name."""
    out = set(leaves)
    for name, parts in family_for(family).fused.items():
        if out >= set(parts):
            out = (out - set(parts)) | {name}
    return sorted(out)


def _our_model(folder: Path, case: str):
    model = from_hf(folder)
    if case == "mixed_ranks":
        apply_lora(model, target_modules=["q_proj", "o_proj"], rank=4, alpha=8)
        apply_lora(model, target_modules=["v_proj", "lm_head"], rank=2, alpha=6, use_rslora=False)
    elif case == "fused_mixed":  # parts of one fused projection: ranks differ, scaling equal
        apply_lora(model, target_modules=["q_proj", "o_proj"], rank=4, alpha=8)
        apply_lora(model, target_modules=["k_proj", "v_proj"], rank=2, alpha=4)
        apply_lora(model, target_modules=["gate_up_proj", "lm_head"], rank=2, alpha=6)
    else:
        targets = [*ATTN_MLP, "lm_head"]
        apply_lora(model, target_modules=targets, rank=4, alpha=8, use_dora=case == "dora")
    randomize_adapters_(trainable_parameters(model), seed=11)
    return model


# Plain LoRA on every dense family; DoRA and per-layer ranks on Qwen2 (q/k/v biases); DoRA and
# parts of a fused projection with different ranks on Phi-3 (q/k/v and gate/up fused on disk).
FAMILY_CASES = [
    *dense_family_params("lora"),
    ("qwen2", "dora"),
    ("qwen2", "mixed_ranks"),
    ("phi3", "dora"),
    ("phi3", "fused_mixed"),
]


@pytest.mark.parametrize(("family", "case"), FAMILY_CASES)
def test_our_adapter_loads_in_peft_with_equal_logits_and_grads(family_dir, tmp_path, family, case):
    folder = family_dir(family)
    ours = _our_model(folder, case)
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(folder))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG_NAME).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["use_dora"] == (case == "dora")
    assert config["base_model_name_or_path"] == str(folder)
    if case == "mixed_ranks":
        assert config["r"] == 4 and config["lora_alpha"] == 8
        assert config["rank_pattern"]["model.layers.1.self_attn.v_proj"] == 2
        assert config["alpha_pattern"]["lm_head"] == 6
    elif case == "fused_mixed":  # qkv_proj: rank 4 + 2 + 2, scaling 2; gate_up_proj: 2 + 2, 3
        assert config["target_modules"] == ["gate_up_proj", "lm_head", "o_proj", "qkv_proj"]
        assert config["rank_pattern"]["model.layers.1.self_attn.qkv_proj"] == 8
        assert config["r"] == 4 and config["alpha_pattern"]["model.layers.1.mlp.gate_up_proj"] == 12
    else:
        assert config["target_modules"] == _hf_leaves(family, [*ATTN_MLP, "lm_head"])

    theirs = peft.PeftModel.from_pretrained(_hf(folder), tmp_path / "adapter", is_trainable=True)
    ids = token_batch(seed=3)
    our_logits, their_logits = ours(ids), theirs(input_ids=ids).logits
    torch.testing.assert_close(our_logits, their_logits, rtol=0, atol=ATOL)
    with torch.no_grad(), theirs.disable_adapter():  # the adapters matter
        assert (their_logits - theirs(input_ids=ids).logits).abs().max() > 100 * ATOL
    _loss(our_logits, ids).backward()
    _loss(their_logits, ids).backward()
    their_params = dict(theirs.named_parameters())
    our_params = trainable_parameters(ours)
    views = {name: _peft_view(ours, name) for name in our_params}
    assert {name for name, _ in views.values()} == {
        n for n, p in their_params.items() if p.requires_grad
    }
    for name, param in our_params.items():
        their_name, index = views[name]  # a fused projection's part: its block of peft's
        torch.testing.assert_close(
            param.grad, their_params[their_name].grad[index], atol=1e-5, rtol=1e-3
        )


@pytest.mark.parametrize(
    ("family", "use_dora"), [*dense_family_params(False), ("qwen2", True), ("phi3", True)]
)
def test_peft_made_adapter_loads_in_tunesmith(family_dir, tmp_path, family, use_dora):
    folder = family_dir(family)
    hf = _hf(folder)
    # Every linear layer under its transformers name (Phi-3: qkv_proj, gate_up_proj).
    targets = sorted(
        {n.rpartition(".")[2] for n, m in hf.named_modules() if type(m) is torch.nn.Linear}
    )
    torch.manual_seed(0)
    fused = family_for(family).fused  # Phi-3, GLM-4: a rank keyed by a fused name too
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        rank_pattern={"down_proj": 2, **({"gate_up_proj": 6} if fused else {})},
        alpha_pattern={"o_proj": 3},
        use_rslora=True,
        use_dora=use_dora,
        init_lora_weights=False,  # random B: a non-trivial adapter
        task_type="CAUSAL_LM",
    )
    theirs = peft.get_peft_model(hf, config)
    with torch.no_grad():
        randomize_adapters_(
            {n: p for n, p in theirs.named_parameters() if "magnitude" in n}, seed=5
        )
        theirs.base_model.model.lm_head.base_layer.weight.mul_(1.5)  # saved with the adapter
    theirs.save_pretrained(tmp_path / "adapter")
    assert "base_model.model.lm_head.base_layer.weight" in load_file(
        tmp_path / "adapter" / ADAPTER_WEIGHTS_NAME
    )

    ours = load_peft_adapter(from_hf(folder), tmp_path / "adapter")
    layers = adapter_modules(ours)
    assert len(layers) == ours.spec.num_hidden_layers * 7 + 1
    assert layers["model.layers.0.mlp.down_proj"].rank == 2
    assert layers["model.layers.0.self_attn.o_proj"].alpha == 3
    assert all(isinstance(m, DoRALinear) == use_dora and m.use_rslora for m in layers.values())
    if fused:  # every part: the whole fused lora_A (peft's rank), its rows of lora_B
        file = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS_NAME)
        mlp = "model.layers.0.mlp"
        a = file[f"base_model.model.{mlp}.gate_up_proj.lora_A.weight"]
        b = file[f"base_model.model.{mlp}.gate_up_proj.lora_B.weight"]
        gate, up = layers[f"{mlp}.gate_proj"], layers[f"{mlp}.up_proj"]
        assert (gate.rank, up.rank, gate.alpha) == (6, 6, 8)
        assert torch.equal(gate.lora_A.weight, a) and torch.equal(up.lora_A.weight, a)
        assert torch.equal(torch.cat([gate.lora_B.weight, up.lora_B.weight]), b)
    ids = token_batch(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, rtol=0, atol=ATOL)


def _phi3():
    torch.manual_seed(0)  # one base model
    return phi3.phi3_tiny()


def _fused_file(tmp_path: Path, model) -> tuple[dict[str, torch.Tensor], dict]:
    folder = save_peft_adapter(model, tmp_path / "adapter")
    config = json.loads((folder / ADAPTER_CONFIG_NAME).read_text())
    tensors = load_file(folder / ADAPTER_WEIGHTS_NAME)
    return {k.removeprefix("base_model.model."): v for k, v in tensors.items()}, config


@pytest.mark.parametrize("use_rslora", [False, True])
def test_fused_dora_adapter_has_the_parts_row_norms(tmp_path, use_rslora):
    """Written fused adapter: A stacked, B block-diagonal, rank 3r, scaling kept (alpha 3a, or
    a*sqrt(3) with rsLoRA); W + s'BA then has exactly the parts' rows, so DoRA's per-row norms
    (and the magnitudes, concatenated) are the parts'."""
    model = apply_lora(
        phi3.phi3_tiny(), target_modules=["qkv_proj"], rank=2, alpha=4, use_dora=True,
        use_rslora=use_rslora,
    )  # fmt: skip
    randomize_adapters_(trainable_parameters(model), seed=2)
    file, config = _fused_file(tmp_path, model)
    attn = "model.layers.0.self_attn"
    parts = [adapter_modules(model)[f"{attn}.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
    assert config["target_modules"] == ["qkv_proj"] and config["r"] == 6
    assert config["lora_alpha"] == (4 * 3**0.5 if use_rslora else 12)
    a, b = file[f"{attn}.qkv_proj.lora_A.weight"], file[f"{attn}.qkv_proj.lora_B.weight"]
    assert torch.equal(a, torch.cat([m.lora_A.weight for m in parts]))
    assert torch.equal(b, torch.block_diag(*[m.lora_B.weight for m in parts]))
    magnitude = file[f"{attn}.qkv_proj.lora_magnitude_vector"]
    assert torch.equal(magnitude, torch.cat([m.lora_magnitude_vector for m in parts]))
    scaling = config["lora_alpha"] / (6**0.5 if use_rslora else 6)
    assert scaling == pytest.approx(parts[0].scaling, rel=1e-12)
    with torch.no_grad():
        fused = torch.cat([m.weight for m in parts]) + scaling * b @ a
        split = torch.cat([m.weight + m.scaling * m.lora_B.weight @ m.lora_A.weight for m in parts])
        torch.testing.assert_close(fused, split, rtol=1e-6, atol=1e-7)  # row for row
        torch.testing.assert_close(
            torch.linalg.vector_norm(fused, dim=1),
            torch.cat([m.weight_norm(m.weight, m.lora_B.weight @ m.lora_A.weight) for m in parts]),
        )

    back = load_peft_adapter(phi3.phi3_tiny(), tmp_path / "adapter")  # the same adapters back
    assert adapter_state_dict(back).keys() == adapter_state_dict(model).keys()
    for key, value in adapter_state_dict(model).items():
        assert torch.equal(adapter_state_dict(back)[key], value), key
    for name in adapter_modules(model):
        other = adapter_modules(back)[name]
        assert (other.rank, other.alpha, other.use_rslora) == (2, 4, use_rslora)


def test_resume_a_fused_adapter_with_the_parts_ranks(tmp_path):
    """Parts of one fused projection with different ranks (same scaling): written exactly;
    resuming into a model adapted the same way takes every block back."""

    def adapted():
        model = _phi3()
        apply_lora(model, target_modules=["q_proj", "o_proj"], rank=4, alpha=8)
        apply_lora(model, target_modules=["k_proj", "v_proj", "gate_up_proj"], rank=2, alpha=4)
        return model

    ours = adapted()
    randomize_adapters_(trainable_parameters(ours), seed=4)
    _, config = _fused_file(tmp_path, ours)
    assert config["r"] == 4 and config["lora_alpha"] == 8  # gate_up_proj: 2 + 2
    assert config["rank_pattern"]["model.layers.0.self_attn.qkv_proj"] == 8
    assert config["alpha_pattern"]["model.layers.0.self_attn.qkv_proj"] == 16
    resumed = load_peft_adapter(adapted(), tmp_path / "adapter")
    for key, value in adapter_state_dict(ours).items():
        assert torch.equal(adapter_state_dict(resumed)[key], value), key
    ids = torch.randint(0, 256, (2, 6))
    fresh = load_peft_adapter(_phi3(), tmp_path / "adapter")  # unequal blocks
    assert adapter_modules(fresh)["model.layers.0.self_attn.q_proj"].rank == 8  # the whole A
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids), ours(ids), rtol=0, atol=1e-5)
    other = phi3.phi3_tiny()
    apply_lora(other, target_modules=["qkv_proj"], rank=3, alpha=6)
    with pytest.raises(CheckpointError, match=r"qkv_proj' is rank 8 in the file, its parts"):
        load_peft_adapter(other, tmp_path / "adapter")


def test_parts_of_a_fused_projection_go_together(tmp_path):
    only_q = apply_lora(phi3.phi3_tiny(), target_modules=["q_proj", "o_proj"], rank=4, alpha=8)
    message = (
        r"model.layers.0.self_attn: q_proj adapted without k_proj and v_proj, but phi3's "
        r"checkpoints fuse q_proj, k_proj and v_proj into qkv_proj, which peft adapts as one "
        r"layer: adapt q_proj, k_proj and v_proj together with the same rank and alpha for "
        r"phi3 \(target_modules: \[qkv_proj\]\), or none of them"
    )
    with pytest.raises(ValueError, match=message):
        save_peft_adapter(only_q, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    scalings = phi3.phi3_tiny()
    apply_lora(scalings, target_modules=["gate_proj"], rank=4, alpha=8)
    apply_lora(scalings, target_modules=["up_proj"], rank=4, alpha=16)
    with pytest.raises(
        ValueError,
        match=r"mlp.gate_up_proj: gate_proj \(rank 4, alpha 8\), up_proj \(rank 4, alpha 16\) "
        r"cannot be written as one gate_up_proj adapter .*give gate_proj and up_proj the same",
    ):
        save_peft_adapter(scalings, tmp_path / "a")


@pytest.mark.parametrize(
    ("build", "targets", "adapted"),
    [
        (phi3.phi3_tiny, ["qkv_proj"], ["q_proj", "k_proj", "v_proj"]),
        (
            phi3.phi3_tiny,
            ["self_attn.qkv_proj", "o_proj", "gate_up_proj"],
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"],
        ),
        (
            glm4.glm4_tiny,
            ["gate_up_proj", "down_proj"],
            ["gate_proj", "up_proj", "down_proj"],
        ),
    ],
)
def test_fused_names_as_lora_targets(build, targets, adapted):
    """The names peft users write for Phi-3 / GLM-4 (``qkv_proj``, ``gate_up_proj``) adapt
    the parts tunesmith keeps apart."""
    model = apply_lora(build(), target_modules=targets, rank=2, alpha=4)
    layers = adapter_modules(model)
    assert {n.rpartition(".")[2] for n in layers} == set(adapted)
    assert len(layers) == model.spec.num_hidden_layers * len(adapted)
    assert peft_adapter_config(model)["target_modules"] == _hf_leaves(
        model.spec.model_type, adapted
    )
    with pytest.raises(ValueError, match=r"\['qkv'\] match no linear layer.*'o_proj'.*fused "
                       r"checkpoint names: .*gate_up_proj \(gate_proj, up_proj\)"):  # fmt: skip
        apply_lora(build(), target_modules=["qkv"], rank=2, alpha=4)


def test_resume_into_an_adapted_model_and_config_mismatch(llama_dir, tmp_path):
    ours = _our_model(llama_dir, "dora")
    save_peft_adapter(ours, tmp_path / "a")
    fresh = apply_lora(
        from_hf(llama_dir), target_modules=[*ATTN_MLP, "lm_head"], rank=4, alpha=8, use_dora=True
    )
    load_peft_adapter(fresh, tmp_path / "a")
    for key, value in adapter_state_dict(ours).items():
        assert torch.equal(adapter_state_dict(fresh)[key], value), key
    other = apply_lora(
        from_hf(llama_dir), target_modules=[*ATTN_MLP, "lm_head"], rank=2, alpha=8, use_dora=True
    )
    with pytest.raises(CheckpointError, match=r"rank=4.*in the file but rank=2"):
        load_peft_adapter(other, tmp_path / "a")
    fewer = apply_lora(
        from_hf(llama_dir), target_modules=["q_proj"], rank=4, alpha=8, use_dora=True
    )
    with pytest.raises(CheckpointError, match="adapted layers differ"):
        load_peft_adapter(fewer, tmp_path / "a")


def test_adapter_file_is_a_small_fraction_of_the_model(llama_dir, tmp_path):
    model = apply_lora(from_hf(llama_dir), target_modules=["q_proj", "v_proj"], rank=2, alpha=4)
    save_peft_adapter(model, tmp_path / "adapter")
    adapter_bytes = (tmp_path / "adapter" / ADAPTER_WEIGHTS_NAME).stat().st_size
    model_bytes = (llama_dir / "model.safetensors").stat().st_size
    assert adapter_bytes < 0.03 * model_bytes
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        ADAPTER_CONFIG_NAME,
        ADAPTER_WEIGHTS_NAME,
    ]


def test_export_merged_loads_in_transformers(llama_dir, tmp_path):
    ours = _our_model(llama_dir, "dora")
    save_peft_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(llama_dir))
    (tmp_path / "adapter" / "tokenizer_config.json").write_text('{"model_max_length": 7}\n')
    ids = token_batch(seed=9)
    with torch.no_grad():
        expected = ours(ids)

    export_merged(tmp_path / "adapter", tmp_path / "fp32")  # base from adapter_config.json
    assert not any(".lora_" in k for k in load_file(tmp_path / "fp32" / "model.safetensors"))
    assert (
        json.loads((tmp_path / "fp32" / "tokenizer_config.json").read_text())["model_max_length"]
        == 7
    )
    with torch.no_grad():
        torch.testing.assert_close(_hf(tmp_path / "fp32")(ids).logits, expected, rtol=0, atol=ATOL)

    export_merged(tmp_path / "adapter", tmp_path / "bf16", base_dir=llama_dir, dtype="bf16")
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    tensors = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    fp32 = load_file(tmp_path / "fp32" / "model.safetensors")
    assert all(torch.equal(tensors[k], fp32[k].bfloat16()) for k in fp32)

    export_merged(tmp_path / "fp32", tmp_path / "copy", dtype="bf16")  # a model folder
    copy = load_file(tmp_path / "copy" / "model.safetensors")
    assert all(torch.equal(copy[k], tensors[k]) for k in tensors)


def _write_adapter(tmp_path: Path, llama_dir: Path) -> Path:
    model = apply_lora(from_hf(llama_dir), target_modules=["q_proj"], rank=2, alpha=4)
    return save_peft_adapter(model, tmp_path / "adapter")


def _edit_config(folder: Path, **changes) -> None:
    path = folder / ADAPTER_CONFIG_NAME
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=.*not supported"),
        ({"bias": "all"}, "bias='all'"),
        ({"peft_type": "IA3"}, "peft_type 'IA3'"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"use_dora": True}, "lacks a lora_magnitude_vector"),
        ({"r": 8}, "has rank 2, but adapter_config.json says r=8"),
    ],
)
def test_unsupported_or_inconsistent_configs_are_refused(llama_dir, tmp_path, changes, message):
    folder = _write_adapter(tmp_path, llama_dir)
    _edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_peft_adapter(from_hf(llama_dir), folder)


def test_bad_tensors_are_named(llama_dir, tmp_path):
    folder = _write_adapter(tmp_path, llama_dir)
    weights = folder / ADAPTER_WEIGHTS_NAME
    good = load_file(weights)
    key_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    save_file({**good, key_a: torch.zeros(2, 63)}, weights)
    with pytest.raises(CheckpointError, match=rf"'{key_a}' has shape \[2, 63\].*needs \[2, 64\]"):
        load_peft_adapter(from_hf(llama_dir), folder)

    save_file(
        {k: v for k, v in good.items() if "layers.1.self_attn.q_proj.lora_B" not in k}, weights
    )
    with pytest.raises(
        CheckpointError, match="layer 'model.layers.1.self_attn.q_proj' has no lora_B"
    ):
        read_peft_adapter(folder)

    ghost = "base_model.model.model.layers.5.self_attn.q_proj"
    save_file(
        {
            **good,
            f"{ghost}.lora_A.weight": good[key_a].clone(),
            f"{ghost}.lora_B.weight": torch.zeros(64, 2),
        },
        weights,
    )
    with pytest.raises(CheckpointError, match="targets 'model.layers.5.self_attn.q_proj', which"):
        load_peft_adapter(from_hf(llama_dir), folder)

    save_file({k.removeprefix("base_model.model."): v for k, v in good.items()}, weights)
    with pytest.raises(CheckpointError, match="lacks the 'base_model.model.' prefix"):
        read_peft_adapter(folder)

    weights.unlink()
    (folder / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="adapter_model.bin found: only safetensors"):
        read_peft_adapter(folder)
    with pytest.raises(CheckpointError, match="is not a PEFT adapter"):
        read_peft_adapter(tmp_path)


def test_export_needs_a_base(llama_dir, tmp_path):
    folder = _write_adapter(tmp_path, llama_dir)  # base_model_name_or_path: null
    with pytest.raises(CheckpointError, match="--base-dir DIR`, or base_dir=DIR"):
        export_merged(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
