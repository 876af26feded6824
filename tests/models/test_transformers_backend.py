"""The transformers backend's model: transformers' own causal LM behind our model protocol.

Each contract compares the wrapper with the transformers model it wraps (or with itself by
another path): logits, hidden states through the head, the KV cache, packed rows, names and
checkpoints; what the backend cannot do is refused with one line naming it.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.models.transformers_world import ARCHITECTURES, make_transformers_model_dir
from tests.recipes.sft_world import make_model_dir
from tunesmith.cli.main import main
from tunesmith.config import ConfigError
from tunesmith.generation import generate
from tunesmith.models import UnsupportedModelError, from_hf, reward_model_from_hf
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.transformers_backend import (
    TransformersLM,
    build_transformers_model,
    choose_backend,
    tiny_config,
)
from tunesmith.modules.decoder import decoder_layers
from tunesmith.modules.losses import LinearCrossEntropyLoss
from tunesmith.modules.peft import apply_lora
from tunesmith.rl.ppo.critic import critic_from_policy
from tunesmith.training.forward import forward_batch, head_transform, head_weight, router_aux_loss
from tunesmith.training.memory.activations import apply_activation_checkpointing
from tunesmith.training.parallel.distributed import ParallelDims
from tunesmith.training.parallelize import check_backend_plans
from tunesmith.training.setup import apply_attention_backend


def _model(model_type: str, seed: int = 0, **overrides) -> TransformersLM:
    torch.manual_seed(seed)
    config = tiny_config(model_type, **{**ARCHITECTURES[model_type], **overrides})
    return build_transformers_model(config).eval()


def _ids(rows: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model(request) -> TransformersLM:
    return _model(request.param)


# -- choosing the backend ----------------------------------------------------------------------


def test_native_families_stay_native_and_others_run_on_transformers():
    assert choose_backend({"model_type": "llama"}).backend == "native"
    assert choose_backend({"model_type": "llama"}, "transformers").backend == "transformers"
    for model_type in ARCHITECTURES:
        assert choose_backend({"model_type": model_type}).backend == "transformers"
    with pytest.raises(UnsupportedModelError, match="'cohere2' has no native family"):
        choose_backend({"model_type": "cohere2"}, "native")
    with pytest.raises(ValueError, match="backend 'fast': expected one of"):
        choose_backend({"model_type": "llama"}, "fast")
    with pytest.raises(UnsupportedModelError, match="neither a native family nor a model type"):
        choose_backend({"model_type": "no_such_arch"})
    with pytest.raises(UnsupportedModelError, match="'t5' has no causal language model class"):
        choose_backend({"model_type": "t5"})  # an encoder-decoder: no AutoModelForCausalLM


def test_a_folder_of_remote_code_is_refused_naming_trust_remote_code(tmp_path, capsys):
    model_dir = make_transformers_model_dir(tmp_path / "sc", "starcoder2")
    remote = tmp_path / "remote"
    shutil.copytree(model_dir, remote)
    config = json.loads((remote / "config.json").read_text())
    config |= {"model_type": "my_arch", "auto_map": {"AutoModelForCausalLM": "modeling.MyLM"}}
    (remote / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="trust_remote_code: tunesmith refuses"):
        from_hf(remote)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "b"}]}) + "\n")  # fmt: skip
    args = ["validate", "sft/tiny", f"dataset.source={data}"]
    assert main([*args, f"model_dir={remote}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs the folder's own code (its auto_map)" in err[0], err
    assert "trust_remote_code" in err[0]
    assert main([*args, f"model_dir={model_dir}"]) == 0  # validate names the backend and why
    assert "model: transformers backend (starcoder2 has no native family" in capsys.readouterr().out


# -- the forward protocol ----------------------------------------------------------------------


def test_logits_are_transformers_own(model):
    ids = _ids()
    with torch.no_grad():
        theirs = model.hf_model(input_ids=ids).logits
        torch.testing.assert_close(model(ids), theirs, rtol=0, atol=1e-6)
        last = model(ids, logits_to_keep=3)
    torch.testing.assert_close(last, theirs[:, -3:], rtol=0, atol=1e-6)


def test_hidden_states_and_the_head_give_the_loss_of_full_logits(model):
    """The chunked loss (hidden states, head weight, transform) == cross-entropy of the
    logits transformers' forward gives; gradients too."""
    ids, labels = _ids(), _ids(seed=2)
    labels[:, :3] = -100
    model.zero_grad()
    hidden = model(ids, return_hidden_states=True)
    loss = (
        LinearCrossEntropyLoss(num_chunks=3)(
            hidden, head_weight(model), labels, transform=head_transform(model)
        )
        / (labels != -100).sum()
    )
    loss.backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model.hf_model(input_ids=ids).logits
    reference = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_cohere_logit_scale_is_the_transform():
    model = _model("cohere2")
    assert head_transform(model).scale == model.hf_model.config.logit_scale != 1.0
    model.logit_transform = None  # a wrong transform is caught at construction
    with pytest.raises(UnsupportedModelError, match="differ from lm_head"):
        model.check_head()


def test_packed_rows_equal_each_document_alone():
    model = _model("starcoder2")
    a, b = _ids(1, 5, seed=3), _ids(1, 6, seed=4)
    packed = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(5), torch.arange(6)])[None]
    documents = torch.tensor([[0] * 5 + [1] * 6])
    with torch.no_grad():
        out = model(packed, position_ids=positions, document_ids=documents)
        alone = torch.cat([model(a), model(b)], 1)
    torch.testing.assert_close(out, alone, rtol=0, atol=1e-5)


def test_a_model_with_convolution_layers_refuses_packed_rows():
    model = _model("lfm2")
    assert not model.accepts_packing
    ids = _ids(1, 6)
    with pytest.raises(ValueError, match="lfm2 .* not attention.* packed: false"):
        model(ids, position_ids=torch.arange(6)[None], document_ids=torch.zeros_like(ids))


def test_cached_decoding_equals_recomputing(model):
    """generate() through transformers' own cache (a hybrid's convolution states included)
    == recomputing every step, on left-padded prompts of unequal length."""
    prompts = [list(range(5, 12)), list(range(20, 24))]
    kwargs = dict(max_new_tokens=6, temperature=0.0, pad_id=0)
    cached = generate(model, prompts, use_cache=True, **kwargs)
    recomputed = generate(model, prompts, use_cache=False, **kwargs)
    assert cached.sequences == recomputed.sequences
    for a, b in zip(cached.logprobs, recomputed.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)


def test_attention_backends_are_transformers_own():
    model = _model("cohere2")
    ids = _ids()
    with torch.no_grad():
        sdpa = model(ids)
        apply_attention_backend(model, "eager")
        assert model.hf_model.config._attn_implementation == "eager"
        torch.testing.assert_close(model(ids), sdpa, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="transformers backend .* takes one of"):
        apply_attention_backend(model, "varlen")


def test_decoder_layers_are_found_and_checkpointed_alike():
    model = _model("starcoder2").train()
    assert decoder_layers(model) == list(model.hf_model.model.layers)
    ids = _ids()
    loss = model(ids).square().mean()
    loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    assert apply_activation_checkpointing(model) == 2
    again = model(ids).square().mean()
    again.backward()
    assert again.item() == loss.item()
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain[name], rtol=0, atol=0, msg=name)


# -- names and checkpoints ---------------------------------------------------------------------


def test_names_are_transformers_and_a_saved_folder_loads_in_both(tmp_path, model):
    theirs = list(model.hf_model.state_dict())
    if model.spec.tie_word_embeddings:  # a tied head is stored once, as transformers saves it
        theirs.remove("lm_head.weight")
    assert list(model.state_dict()) == theirs
    folder = save_hf_checkpoint(model, tmp_path / "out")
    ids = _ids()
    with torch.no_grad():
        expected = model(ids)
        reloaded = from_hf(folder)
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert isinstance(reloaded, TransformersLM)
        torch.testing.assert_close(reloaded(ids), expected, rtol=0, atol=0)
        torch.testing.assert_close(theirs(input_ids=ids).logits, expected, rtol=0, atol=0)


# -- what it cannot do -------------------------------------------------------------------------


def test_reward_models_critics_and_other_plans_are_refused_naming_the_backend(tmp_path):
    model_dir = make_transformers_model_dir(tmp_path / "sc", "starcoder2")
    with pytest.raises(UnsupportedModelError, match="'starcoder2' has no native family, and "
                                                    "reward models need one"):  # fmt: skip
        reward_model_from_hf(model_dir)
    with pytest.raises(ValueError, match="transformers backend, which has no critic head"):
        critic_from_policy(from_hf(model_dir), pad_token_id=0)
    for dims, what in ((ParallelDims(cp=2), "context parallel"),
                       (ParallelDims(ep=2), "expert parallel"),
                       (ParallelDims(tp=2), "sequence parallel")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"starcoder2 runs on the transformers .* {what}"):
            check_backend_plans(from_hf(model_dir).spec, dims)
    native = make_model_dir(tmp_path / "native")  # a native folder on the other backend
    model = from_hf(native, backend="transformers")
    assert isinstance(model, TransformersLM) and model.spec.model_type == "qwen2"
    with pytest.raises(UnsupportedModelError, match="has no native family"):
        from_hf(model_dir, backend="native")


# -- mixture of experts ------------------------------------------------------------------------


def _mixtral() -> TransformersLM:
    torch.manual_seed(0)
    config = tiny_config("mixtral", num_local_experts=4, num_experts_per_tok=2,
                         router_aux_loss_coef=0.02)  # fmt: skip
    return build_transformers_model(config)


def test_moe_router_logits_give_transformers_own_auxiliary_loss():
    model = _mixtral()
    ids = _ids()
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None]}
    _, router_logits = forward_batch(model, batch)
    assert len(router_logits) == 2 and router_logits[0].shape == (ids.numel(), 4)
    theirs = model.hf_model(input_ids=ids, output_router_logits=True).aux_loss
    ours = router_aux_loss(model, router_logits, batch)
    torch.testing.assert_close(ours, 0.02 * theirs, rtol=1e-6, atol=0)


def test_moe_checkpoints_are_in_the_layout_transformers_saves(tmp_path):
    """transformers 5 fuses Mixtral's per-expert w1/w3 on load; a checkpoint holds them as
    transformers' own save_pretrained writes them, and loads back equal."""
    model = _mixtral()
    ours = save_hf_checkpoint(model, tmp_path / "ours")
    model.hf_model.save_pretrained(tmp_path / "theirs")
    assert set(load_file(ours / "model.safetensors")) == set(
        load_file(tmp_path / "theirs" / "model.safetensors")
    )
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in load_file(
        ours / "model.safetensors"
    )
    ids = _ids()
    with torch.no_grad():
        reloaded = AutoModelForCausalLM.from_pretrained(ours, dtype=torch.float32)
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(ids), rtol=0, atol=0)


def test_gpt2_sizes_come_through_the_attribute_map_and_conv1d_is_not_adapted():
    """GPT-2 names its sizes n_layer/n_embd and stores its projections as Conv1D ([in, out])."""
    torch.manual_seed(0)
    model = build_transformers_model(
        tiny_config("gpt2", n_embd=32, num_hidden_layers=3, n_head=4, n_positions=64)
    ).eval()
    assert model.spec.config["n_layer"] == 3 and "num_hidden_layers" not in model.spec.config
    assert (model.spec.num_hidden_layers, model.spec.hidden_size) == (3, 32)
    assert len(decoder_layers(model)) == 3
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model.hf_model(input_ids=ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\['c_attn'\] are transformers Conv1D layers"):
        apply_lora(model, target_modules=["c_attn"], rank=2, alpha=4)
