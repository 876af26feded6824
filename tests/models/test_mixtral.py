"""Mixtral: parity with transformers (logits, gradients, router logits, aux loss, greedy
decoding), its on-disk names both ways, config-only features, packed rows, shipped sizes."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.models.conftest import randomize_, read_safetensors_folder
from tests.models.parity_checks import assert_greedy_matches_transformers
from tunesmith.models import build_model, from_hf, mixtral, spec_from_hf_config
from tunesmith.models.family import UnsupportedModelError
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.modules.masks import document_position_ids, padding_position_ids
from tunesmith.training.forward import router_aux_loss

ATOL = 1e-4
SEQ = 13
# Odd sizes: vocab 131, width 48, 6 heads over 2 kv heads; window 5 < SEQ; experts 5, top-3
# (and 3 experts, top-1, no window).
CASES = {
    "experts5_top3_window5": {"num_local_experts": 5, "num_experts_per_tok": 3,
                              "sliding_window": 5, "num_hidden_layers": 3},
    "experts3_top1": {"num_local_experts": 3, "num_experts_per_tok": 1, "sliding_window": None,
                      "num_hidden_layers": 2},
}  # fmt: skip


def hf_mixtral(seed: int = 0, std: float = 0.1, **overrides) -> transformers.PreTrainedModel:
    """A random fp32 ``MixtralForCausalLM`` (eager attention) of odd sizes, in eval mode."""
    config = transformers.MixtralConfig(
        **{
            "vocab_size": 131,
            "hidden_size": 48,
            "intermediate_size": 40,
            "num_attention_heads": 6,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "max_position_embeddings": 256,
            "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.05,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": None,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, seed, std=std).eval()


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of SEQ tokens; row 0 left-padded by 3 (ids, mask, positions)."""
    ids = torch.randint(3, vocab, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    ids[0, :3] = 0
    return ids, mask, padding_position_ids(mask)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(case, transformers model, ours by ``from_hf`` of its sharded ``save_pretrained`` folder,
    the folder)."""
    hf = hf_mixtral(seed=1, **CASES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, max_shard_size="20KB")
    return request.param, hf, from_hf(folder).eval(), folder


def test_transformers_writes_the_per_expert_names_we_read(pair):
    """The folder is sharded and holds Mixtral's original names (w1/w2/w3 under
    ``block_sparse_moe``); ours keeps transformers' in-memory names."""
    _, hf, ours, folder = pair
    keys = set(read_safetensors_folder(folder))
    assert len(list(folder.glob("*.safetensors"))) > 1
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight" in keys
    assert not any(".mlp." in k for k in keys)
    assert "model.layers.0.mlp.experts.gate_proj" in dict(ours.named_parameters())


@torch.no_grad()
def test_logits_router_logits_and_aux_loss_match_transformers(pair):
    _, hf, ours, _ = pair
    spec = ours.spec
    ids, mask, pos = _batch(spec.vocab_size, seed=3)
    theirs = hf(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    logits, router_logits = ours(
        ids, attention_mask=mask, position_ids=pos, output_router_logits=True
    )
    real = mask.bool()
    assert (logits - theirs.logits)[real].abs().max() < ATOL
    assert len(router_logits) == len(theirs.router_logits) == spec.num_hidden_layers
    for mine, hf_layer in zip(router_logits, theirs.router_logits, strict=True):
        assert mine.shape == (2 * SEQ, spec.num_experts)
        assert (mine - hf_layer)[real.flatten()].abs().max() < ATOL
    # transformers adds router_aux_loss_coef * aux to the loss; so does our objective term.
    ours_aux = router_aux_loss(ours, router_logits, {"attention_mask": mask})
    assert spec.router_aux_loss_coef == 0.05
    torch.testing.assert_close(
        ours_aux, spec.router_aux_loss_coef * theirs.aux_loss.float(), atol=1e-6, rtol=0
    )
    # The padded row equals its tokens run alone.
    torch.testing.assert_close(logits[0, 3:], ours(ids[:1, 3:])[0], atol=ATOL, rtol=0)


def test_gradients_match_transformers(pair):
    """Gradients of one summed loss (random weights on every logit, padded rows), parameter
    by parameter, within a relative 1e-4 of the largest entry; experts compared stacked."""
    _, hf, ours, _ = pair
    ids, mask, pos = _batch(ours.spec.vocab_size, seed=8)
    weights = torch.randn(2, SEQ, ours.spec.vocab_size, generator=torch.Generator().manual_seed(9))
    grads = []
    for model, logits_of in ((hf, lambda out: out.logits), (ours, lambda out: out)):
        model.zero_grad(set_to_none=True)
        out = logits_of(model(ids, attention_mask=mask, position_ids=pos))
        (out * weights * mask[..., None]).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    theirs, mine = grads
    for name in list(mine):  # our gate_proj + up_proj == their gate_up_proj
        if name.endswith("experts.gate_proj"):
            up = mine.pop(name.replace("gate_proj", "up_proj"))
            mine[name.replace("gate_proj", "gate_up_proj")] = torch.cat([mine.pop(name), up], 1)
    assert mine.keys() == theirs.keys()
    for name, grad in mine.items():
        if name.endswith("mlp.gate.weight") and ours.spec.num_experts_per_tok == 1:
            # top-1 renormalised: the one weight is always 1, the router gets no gradient
            assert max(grad.abs().max(), theirs[name].abs().max()) < 1e-5, name
            continue
        scale = theirs[name].abs().max()
        assert scale > 0, name
        assert (grad - theirs[name]).abs().max() <= 1e-4 * scale, name


@torch.no_grad()
def test_save_gives_the_files_transformers_writes_and_loads(pair, tmp_path):
    _, hf, ours, folder = pair
    save_hf_checkpoint(ours, tmp_path / "ours", max_shard_size="30KB")
    assert (
        read_safetensors_folder(tmp_path / "ours").keys() == read_safetensors_folder(folder).keys()
    )
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    ids = _batch(ours.spec.vocab_size, seed=4)[0][1:]
    torch.testing.assert_close(back(ids).logits, ours(ids), atol=ATOL, rtol=0)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and "num_experts" not in config
    assert spec_from_hf_config(config) == ours.spec.replace(torch_dtype="float32")


@torch.no_grad()
@pytest.mark.parametrize(
    "ablation",
    [{"sliding_window": None}, {"norm_topk_prob": False}],
    ids=["window", "renormalised_top_k"],
)
def test_features_change_the_logits(ablation):
    """Parity would be vacuous if the window (config) or the renormalised top-k weights
    (implied by the family) did not matter: without either, logits move > 100x ATOL."""
    hf = hf_mixtral(seed=1, **CASES["experts5_top3_window5"])
    spec = spec_from_hf_config(hf.config.to_dict())
    ablated = build_model(spec.replace(**ablation)).eval()
    ablated.load_state_dict(build_model(spec).state_dict() | _ours_state(hf))
    ids = _batch(spec.vocab_size)[0][1:]
    assert (ablated(ids) - hf(ids).logits).abs().max() > 100 * ATOL


def _ours_state(hf: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    """transformers' in-memory state (fused ``gate_up_proj``) under our per-expert keys."""
    out = {}
    for name, tensor in hf.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for part, stacked in (("gate_proj", gate), ("up_proj", up)):
                for i, w in enumerate(stacked):
                    out[name.replace("gate_up_proj", f"{i}.{part}.weight")] = w
        elif name.endswith("experts.down_proj"):
            for i, w in enumerate(tensor):
                out[name.replace("down_proj", f"{i}.down_proj.weight")] = w
        else:
            out[name] = tensor
    return out


def test_greedy_generation_with_kv_cache_matches_transformers(tmp_path):
    """20 greedy tokens from left-padded prompts longer than the window, with our KV cache.
    No eos in the model's config: transformers' ``min_new_tokens`` would mask it there only."""
    case = CASES["experts5_top3_window5"]
    hf = hf_mixtral(seed=0, std=0.2, eos_token_id=None, pad_token_id=0, **case)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path).eval()
    prompts = [[5, 17, 99, 3, 42, 8, 61], [77, 12], [120, 4, 4, 90, 33, 21, 7, 110, 64, 9]]
    assert_greedy_matches_transformers(hf, ours, prompts)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_packed_rows_equal_separate_documents(backend):
    """Documents of 4 and 11 tokens packed in one row (window 8 < 11) == each alone."""
    model = randomize_(mixtral.mixtral_tiny(), seed=2).eval()
    model.model.attention_backend = backend
    docs = torch.tensor([[0] * 4 + [1] * 11])
    ids = torch.randint(0, 256, docs.shape, generator=torch.Generator().manual_seed(3))
    packed = model(ids, document_ids=docs, position_ids=document_position_ids(docs))
    torch.testing.assert_close(packed[:, :4], model(ids[:, :4]), atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:, 4:], model(ids[:, 4:]), atol=1e-5, rtol=0)


def test_shipped_sizes_are_the_published_configs():
    big = mixtral.spec("mixtral_8x7b")
    config = big.to_hf_config()
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert (config["hidden_size"], config["intermediate_size"]) == (4096, 14336)
    assert config["router_aux_loss_coef"] == 0.02 and config["sliding_window"] is None
    assert round(big.approx_parameters() / 1e9, 1) == 46.7
    assert round(mixtral.spec("mixtral_8x22b").approx_parameters() / 1e9) == 141


def test_router_jitter_noise_is_refused():
    config = hf_mixtral(router_jitter_noise=0.1, num_hidden_layers=1).config.to_dict()
    with pytest.raises(UnsupportedModelError, match="router_jitter_noise 0.1"):
        spec_from_hf_config(config)


def test_a_folder_of_fused_experts_is_refused_naming_the_missing_tensors(tmp_path):
    """transformers' in-memory layout (``mlp.experts.gate_up_proj``), which its
    ``save_pretrained`` never writes, is not read as something else."""
    hf = hf_mixtral(num_hidden_layers=1)
    hf.save_pretrained(tmp_path)
    for path in tmp_path.glob("*.safetensors"):
        path.unlink()
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()}, tmp_path / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match=r"missing .*mlp\.experts\.0\.gate_proj\.weight"):
        from_hf(tmp_path)
