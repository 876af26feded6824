"""gpt-oss == transformers (fp32, odd configs: 5/3/7 experts, top-1..3, window 4 < the rows):
logits, router logits and aux loss, gradients, each feature shown to matter, greedy generation
with a KV cache, checkpoints both ways (sharded); attention sinks in every backend (packed ==
separate rows; ring attention under cp 2); LoRA folders peft loads (attention, experts); ep2,
tp2 == one process; harmony templates' masks == transformers'. Every recipe on gpt-oss:
tests/recipes/test_recipes_on_moe_families.py; the SFT recipe on two ranks:
tests/recipes/test_sft_moe_parallel.py; the shipped config:
tests/recipes/test_moe_shipped_configs.py."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import peft
import pytest
import tokenizers
import torch
import transformers
import trl

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.gloo_world import run_on_ranks
from tests.models.conftest import randomize_
from tests.models.parity_checks import assert_greedy_matches_transformers
from tunesmith.data.tokenizer import Tokenizer
from tunesmith.models import build_model, from_hf, gpt_oss, spec_from_hf_config
from tunesmith.models.hf import save_hf_checkpoint
from tunesmith.models.peft_io import load_peft_adapter, save_peft_adapter
from tunesmith.modules.attention_backends import AttentionBatch
from tunesmith.modules.masks import document_position_ids
from tunesmith.modules.moe import load_balancing_loss
from tunesmith.modules.peft import apply_lora, disable_adapters, trainable_parameters
from tunesmith.modules.sinks import sink_attention
from tunesmith.training.parallel.distributed import ParallelDims, expert_mesh_of
from tunesmith.training.parallel.expert_parallel import apply_expert_parallel

ATOL = 1e-4
SEQ = 11  # longer than the window (4): sliding layers differ from full ones
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 8}  # fmt: skip
# Odd sizes: width 48, six heads over two kv heads, vocab 131; a low swiglu_limit and an odd
# swiglu_alpha so that the clamps bite at this weight scale.
BASE = {"vocab_size": 131, "hidden_size": 48, "intermediate_size": 40, "num_hidden_layers": 3,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 4, "swiglu_limit": 0.6, "swiglu_alpha": 1.3, "rope_parameters": YARN,
        "max_position_embeddings": 64, "pad_token_id": 0, "eos_token_id": None,
        "bos_token_id": None}  # fmt: skip
CASES = {
    "top3_of_5": {"num_local_experts": 5, "num_experts_per_tok": 3},
    "top1_of_3": {"num_local_experts": 3, "num_experts_per_tok": 1},
    "top2_of_7": {"num_local_experts": 7, "num_experts_per_tok": 2},
}


def _hf_model(seed: int = 0, std: float = 0.2, **overrides) -> transformers.PreTrainedModel:
    config = transformers.GptOssConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize_(model, seed, std=std).eval()


def _variant(hf: torch.nn.Module, **config) -> torch.nn.Module:
    """``hf`` with other config values and the same weights."""
    changed = copy.deepcopy(hf.config)
    for key, value in config.items():
        setattr(changed, key, value)
    model = transformers.AutoModelForCausalLM.from_config(
        changed, attn_implementation="eager", dtype=torch.float32
    )
    model.load_state_dict(hf.state_dict())
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(transformers model, ours by ``from_hf`` of its sharded ``save_pretrained`` folder)."""
    hf = _hf_model(**CASES[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    return hf, from_hf(folder).eval()


def _ids(seed: int, shape=(2, SEQ)) -> torch.Tensor:
    return torch.randint(1, 131, shape, generator=torch.Generator().manual_seed(seed))


def test_logits_router_logits_and_aux_loss_match_transformers(pair):
    hf, ours = pair
    ids = _ids(1)
    with torch.no_grad():
        theirs = hf(ids, output_router_logits=True)
        logits, router_logits = ours(ids, output_router_logits=True)
    assert (logits - theirs.logits).abs().max() < ATOL
    assert len(router_logits) == len(theirs.router_logits) == 3
    for mine, hf_layer in zip(router_logits, theirs.router_logits, strict=True):
        assert (mine - hf_layer).abs().max() < ATOL
    top_k = hf.config.num_experts_per_tok
    aux = load_balancing_loss(router_logits, top_k=top_k)
    assert torch.allclose(aux, theirs.aux_loss.float(), atol=1e-5, rtol=0)


def test_gradients_of_a_summed_loss_match_transformers(pair):
    hf, ours = pair
    ids = _ids(2)
    weights = torch.randn(2, SEQ, hf.config.vocab_size, generator=torch.Generator().manual_seed(3))
    hf.zero_grad()
    ours.zero_grad()
    (hf(ids).logits * weights).sum().backward()
    (ours(ids) * weights).sum().backward()
    grads = copy.deepcopy(ours)  # our gradients, laid out as transformers' tensors
    with torch.no_grad():
        for p, g in zip(grads.parameters(), ours.parameters(), strict=True):
            p.copy_(g.grad)
    mine = ours.spec.checkpoint_renames.state_to_disk(grads.state_dict())
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    assert mine.keys() == theirs.keys()
    for name, grad in theirs.items():
        scale = grad.abs().max()
        # top-1: the softmax over one chosen logit is 1, so the router gets no gradient.
        assert scale > 0 or (hf.config.num_experts_per_tok == 1 and ".router." in name), name
        assert (mine[name] - grad).abs().max() <= 1e-4 * scale, name


@pytest.mark.parametrize(
    "ablation",
    ["sinks", "router_bias", "swiglu_limit", "swiglu_alpha", "sliding_window", "yarn"],
)
def test_each_gpt_oss_feature_changes_the_logits(pair, ablation):
    """Turning a feature off in transformers moves the logits far beyond the tolerance."""
    hf, ours = pair
    if ablation in ("sinks", "router_bias"):
        off = _variant(hf)
        with torch.no_grad():
            for name, p in off.named_parameters():
                if name.endswith("self_attn.sinks" if ablation == "sinks" else "router.bias"):
                    p.fill_(-1e9 if ablation == "sinks" else 0.0)
    else:
        config = {
            "swiglu_limit": {"swiglu_limit": 1e9},
            "swiglu_alpha": {"swiglu_alpha": 1.702},
            "sliding_window": {"sliding_window": 64},
            "yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
        }[ablation]
        off = _variant(hf, **config)
        if ablation in ("swiglu_limit", "swiglu_alpha"):  # read once, at construction
            for layer in off.model.layers:
                layer.mlp.experts.limit = off.config.swiglu_limit
                layer.mlp.experts.alpha = off.config.swiglu_alpha
    ids = _ids(4)
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max() < ATOL
        assert (off(ids).logits - hf(ids).logits).abs().max() > 100 * ATOL


def test_greedy_generation_with_kv_cache_matches_transformers(pair):
    hf, ours = pair
    prompts = [[5, 17, 99, 3, 42, 8, 61], [77, 12], [100, 4, 4, 90, 33, 21, 7, 120, 64]]
    assert_greedy_matches_transformers(hf, ours, prompts)


def test_our_checkpoint_loads_in_transformers_with_equal_logits(pair, tmp_path):
    hf, ours = pair
    save_hf_checkpoint(ours, tmp_path / "ours", max_shard_size="40KB")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager", dtype=torch.float32
    ).eval()
    again = from_hf(tmp_path / "ours").eval()
    assert again.spec == ours.spec
    ids = _ids(5)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
        assert torch.equal(again(ids), ours(ids))


# --- attention sinks in every backend ------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    """Our model with a transformers model's weights (no folder)."""
    hf = _hf_model(seed=6, **CASES["top3_of_5"])
    ours = build_model(spec_from_hf_config(hf.config.to_dict()))
    state = {ours.spec.checkpoint_renames.from_disk(k): v for k, v in hf.state_dict().items()}
    ours.load_state_dict(state, strict=True)
    return ours.eval()


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "loop", "flex"])
def test_packed_rows_equal_separate_documents_with_sinks(model, backend):
    """Nothing leaks across documents: packed logits == each document alone (windowed
    layers included: the longest document is longer than the window)."""
    docs = [_ids(7, (1, 5)), _ids(8, (1, 9)), _ids(9, (1, 3))]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(docs)], dim=1)
    model.model.attention_backend = backend
    try:
        with torch.no_grad():
            logits = model(
                packed, document_ids=document_ids,
                position_ids=document_position_ids(document_ids),
            )  # fmt: skip
            model.model.attention_backend = "sdpa"
            alone = torch.cat([model(d) for d in docs], dim=1)
    finally:
        model.model.attention_backend = "auto"
    assert (logits - alone).abs().max() < 1e-5


def test_sinks_train_through_the_varlen_backend(model):
    """Packed training (varlen) gives the sinks the gradients of separate rows."""
    docs = [_ids(10, (1, 6)), _ids(11, (1, 7))]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.tensor([[0] * 6 + [1] * 7])
    sinks = model.model.layers[0].self_attn.sinks
    model.zero_grad()
    model.model.attention_backend = "varlen"
    model(packed, document_ids=document_ids,
          position_ids=document_position_ids(document_ids)).sum().backward()  # fmt: skip
    packed_grad = sinks.grad.clone()
    model.zero_grad()
    model.model.attention_backend = "auto"
    sum(model(d).sum() for d in docs).backward()
    assert packed_grad.abs().max() > 0
    assert torch.allclose(packed_grad, sinks.grad, atol=1e-5, rtol=1e-4)
    model.zero_grad()


def test_an_unknown_backend_refuses_sinks_by_name():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="attention sinks"):
        sink_attention(q, k, v, AttentionBatch("chunked"), torch.zeros(2))


def _cp_worker(rank: int) -> dict:
    """tests/training/test_context_parallel_families.py's comparison on gpt-oss (float64):
    ring attention with the sinks, padded and packed rows."""
    from tests.training import test_context_parallel_families as harness

    harness.SPECS["gpt_oss"] = lambda: gpt_oss.spec("gpt_oss_tiny")
    return {kind: harness._compare("gpt_oss", kind, rank) for kind in ("padded", "packed")}


def test_context_parallel_cp2_equals_one_process():
    """Ring attention adds each head's sink once per row: logits and gradients (the sinks'
    included) of two cp ranks == the unsplit model's."""
    for rank, results in enumerate(run_on_ranks(_cp_worker, 2)):
        for kind, (logits_error, grad_error) in results.items():
            assert logits_error < 2e-6, f"rank {rank} {kind}: logits differ by {logits_error}"
            assert grad_error < 2e-5, f"rank {rank} {kind}: gradients differ by {grad_error}"


def test_sinks_are_a_trainable_parameter_named_as_transformers():
    model = gpt_oss.gpt_oss_tiny()
    names = [n for n, _ in model.named_parameters() if n.endswith("sinks")]
    assert names == [f"model.layers.{i}.self_attn.sinks" for i in range(3)]
    assert all(p.requires_grad for n, p in model.named_parameters() if n in names)


# --- LoRA ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "targets",
    [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]],
    ids=["attention", "experts"],
)
def test_lora_peft_folder_loads_in_peft_and_back_with_equal_logits(tmp_path, targets):
    """LoRA on attention or on the experts (sinks stay frozen): peft computes our logits from
    the folder (experts: interleaved fused gate_up_proj rows), and our loader reads it back."""
    hf = _hf_model(seed=12, **CASES["top3_of_5"])
    hf.save_pretrained(tmp_path / "hf")
    ours = apply_lora(from_hf(tmp_path / "hf").eval(), target_modules=targets, rank=2, alpha=4)
    assert not any(n.endswith("sinks") for n in trainable_parameters(ours))
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in trainable_parameters(ours).values():
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    folder = save_peft_adapter(ours, tmp_path / "adapter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = peft.PeftModel.from_pretrained(hf, folder).eval()
    back = load_peft_adapter(from_hf(tmp_path / "hf").eval(), folder)
    ids = _ids(14)
    with torch.no_grad():
        expected = ours(ids)
        with disable_adapters(ours):
            assert (expected - ours(ids)).abs().max() > 1e-3  # the adapters do something
        assert (loaded(ids).logits - expected).abs().max() < 2e-5
        assert torch.equal(back(ids), expected)


# --- expert parallel -------------------------------------------------------------------------


def _moe_layer() -> torch.nn.Module:
    """gpt-oss's MoE layer (4 experts, top-2) with every weight and bias random."""
    layer = gpt_oss.gpt_oss_tiny(num_experts=4, num_experts_per_tok=2).model.layers[0].mlp
    return randomize_(layer, seed=15, std=0.3)


def _ep_worker(rank: int, world: int) -> dict[str, float]:
    """EP 2 vs the unsplit layer on every rank's tokens: largest differences on this rank."""
    reference, split = _moe_layer(), _moe_layer()
    inputs = [
        torch.randn(5 + 3 * r, 48, generator=torch.Generator().manual_seed(r)) for r in range(world)
    ]
    ref_inputs = [x.clone().requires_grad_() for x in inputs]
    sum(reference(x[None])[0].sum() * (r + 1) for r, x in enumerate(ref_inputs)).backward()
    apply_expert_parallel(split, expert_mesh_of(ParallelDims(dp_shard=world, ep=world), "cpu"))
    x = inputs[rank].clone().requires_grad_()
    out = split(x[None])[0]
    (out.sum() * (rank + 1)).backward()
    expected_out = reference(inputs[rank][None])[0][0]
    diffs = {
        "out": (out[0] - expected_out).abs().max().item(),
        "out_scale": expected_out.abs().max().item(),
        "input_grad": (x.grad - ref_inputs[rank].grad).abs().max().item(),
        "input_grad_scale": ref_inputs[rank].grad.abs().max().item(),
    }
    for name in ("gate_proj", "up_proj", "down_proj", "gate_proj_bias", "down_proj_bias"):
        param = getattr(split.experts, name)
        assert param.to_local().shape[0] == 2  # split over the ranks
        expected = getattr(reference.experts, name).grad / world  # the data-parallel average
        diffs[name] = (param.grad.full_tensor() - expected).abs().max().item()
        diffs[name + "_scale"] = expected.abs().max().item()
    return diffs


def test_expert_parallel_ep2_equals_one_process():
    """Biased experts split over two gloo ranks: outputs, input and expert (bias) gradients."""
    for rank, diffs in enumerate(run_on_ranks(_ep_worker, 2, 2)):
        for name, diff in diffs.items():
            if not name.endswith("_scale"):  # relative to the largest entry (fp32)
                scale = diffs[name + "_scale"]
                assert scale > 1e-3, f"rank {rank}: {name} is all zeros"
                assert diff <= 1e-5 * scale, f"rank {rank}: {name} differs by {diff}"


# --- tensor parallel -------------------------------------------------------------------------


def _tp_worker(rank: int) -> dict:
    """tests/training/test_tensor_parallel.py's comparison on gpt-oss: the sinks split by head."""
    from tests.training import test_tensor_parallel as harness

    harness.SPECS["gpt_oss"] = lambda: gpt_oss.spec("gpt_oss_tiny", vocab_size=harness.VOCAB)
    cases = [(True, "padded", 9), (False, "packed", 10), (False, "plain", 11)]
    return {case: harness._compare("gpt_oss", *case) for case in cases}


def test_tensor_parallel_tp2_equals_one_process():
    results = run_on_ranks(_tp_worker, 2)[0]
    assert len(results) == 3
    for (sp, kind, seq), (logits_error, grad_error) in results.items():
        where = f"sequence_parallel={sp} {kind} seq={seq}"
        assert logits_error < 2e-6, f"{where}: logits differ by {logits_error}"
        assert grad_error < 2e-5, f"{where}: gradients differ by {grad_error} (relative)"


# --- the harmony chat format -----------------------------------------------------------------

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                  "<|call|>", "<|constrain|>"]  # fmt: skip
CONVERSATIONS = {
    "one_turn": [{"role": "user", "content": "add 2 and 3"},
                 {"role": "assistant", "content": "5"}],
    "system_two_turns": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello there"},
                         {"role": "user", "content": "add 1 and 1"},
                         {"role": "assistant", "content": "2", "thinking": "one plus one"}],
}  # fmt: skip


def _harmony_folder(root: Path, template: str) -> Path:
    """A tiny tokenizer with harmony's special tokens and gpt-oss's own chat template
    (``template``: TRL's copy of the published one, or its copy with generation tags)."""
    folder = make_tokenizer_folder(
        root, "qwen2_5", chat_template=(TRL_TEMPLATES / template).read_text(),
        eos_token="<|return|>",
    )  # fmt: skip
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    backend.add_special_tokens(HARMONY_TOKENS)
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    for token in HARMONY_TOKENS:  # transformers reads the added tokens from here too
        config["added_tokens_decoder"][str(backend.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _hf_render(folder: Path, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' ids and ``assistant_masks`` of ``messages`` by ``folder``'s template."""
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    out = hf.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_harmony_template_with_generation_tags_masks_as_transformers(tmp_path, name):
    """gpt-oss's template with ``{% generation %}`` tags (TRL's training copy) in the folder:
    our ids and assistant mask == transformers' ``return_assistant_tokens_mask``."""
    folder = _harmony_folder(tmp_path, "gptoss_training.jinja")
    ids, mask = Tokenizer.from_pretrained(folder).tokenize_conversation(CONVERSATIONS[name])
    hf_ids, hf_mask = _hf_render(folder, CONVERSATIONS[name])
    assert ids == hf_ids
    assert sum(hf_mask) > 0 and mask == hf_mask


def test_published_harmony_template_renders_as_transformers(tmp_path):
    """The published template (no tags): the same ids as transformers; a one-turn reply is
    masked from what the model generates after the ``<|start|>assistant`` generation prompt;
    a multi-turn conversation (history turns end in ``<|end|>``, the last in ``<|return|>``, so
    a prefix does not render as the start of the whole) is refused, naming the fix."""
    published = Tokenizer.from_pretrained(_harmony_folder(tmp_path / "plain", "gptoss.jinja"))
    tagged = _harmony_folder(tmp_path / "tagged", "gptoss_training.jinja")
    ids, mask = published.tokenize_conversation(CONVERSATIONS["one_turn"])
    hf_ids, hf_mask = _hf_render(tagged, CONVERSATIONS["one_turn"])
    assert ids == hf_ids
    reply = published.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert reply == "<|channel|>final<|message|>5<|return|>"
    header, first = len(published.encode("<|start|>assistant")), hf_mask.index(1)
    assert mask == hf_mask[:first] + [0] * header + hf_mask[first + header :]
    messages = CONVERSATIONS["system_two_turns"]
    text = published.apply_chat_template(messages)
    assert published.encode(text, add_special_tokens=False) == _hf_render(tagged, messages)[0]
    with pytest.raises(ValueError, match="generation"):
        published.tokenize_conversation(messages)


# --- configs as published, refusals ----------------------------------------------------------


def test_published_20b_config_reads_as_the_shipped_size():
    """openai/gpt-oss-20b's config.json (4.x keys: rope_scaling, MXFP4 quantization_config)
    reads as ``gpt_oss_20b``; the 120b differs in depth and experts only."""
    layer_types = ["sliding_attention", "full_attention"] * 12
    published = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": layer_types, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
        "output_router_logits": False, "pad_token_id": 199999, "quantization_config": {
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
            "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0,
            "factor": 32.0, "original_max_position_embeddings": 4096, "rope_type": "yarn",
            "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 201088,
    }  # fmt: skip
    assert spec_from_hf_config(published) == gpt_oss.spec("gpt_oss_20b")
    bigger = {**published, "num_hidden_layers": 36, "num_local_experts": 128,
              "layer_types": ["sliding_attention", "full_attention"] * 18}  # fmt: skip
    assert spec_from_hf_config(bigger) == gpt_oss.spec("gpt_oss_120b")


def test_sinks_refuse_packed_rows_without_their_mask():
    """Document ids (or spans) without the dense mask would attend across documents."""
    q = k = v = torch.randn(1, 2, 4, 8)
    docs = torch.tensor([[0, 0, 1, 1]])
    with pytest.raises(ValueError, match="dense mask"):
        sink_attention(q, k, v, AttentionBatch("varlen", document_ids=docs), torch.zeros(2))
