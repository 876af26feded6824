"""LocalEngine: generate() behind the RolloutEngine interface, and weight updates by name."""

from __future__ import annotations

import pytest
import torch

from tunesmith.generation import LocalEngine, RolloutEngine, generate
from tunesmith.generation.config import EngineSettings
from tunesmith.generation.paged import generate_paged
from tunesmith.models import llama3
from tunesmith.modules.peft.apply import apply_lora

PROMPTS = [[1, 5, 7, 9], [1, 12], [1, 30, 31, 32, 33, 34]]
SETTINGS = dict(max_new_tokens=6, top_p=None, top_k=None, min_p=None, stop_strings=[])


def tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return llama3.llama3_tiny().eval()


class LetterCodec:
    """A real (if tiny) decoder: token i -> the letter chr(97 + i % 26)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def test_local_engine_is_a_rollout_engine():
    assert isinstance(LocalEngine(tiny(0), None, pad_id=0), RolloutEngine)


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0),
        dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02),
    ],
    ids=["greedy", "filtered"],
)
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "plain"])
def test_generate_is_generate_called_directly(sampling, paged):
    model = tiny(0)
    keys = [101, 202, 303]
    settings = {**SETTINGS, **sampling}
    call = generate_paged if paged else generate
    direct = call(model, PROMPTS, row_keys=keys, stop_token_ids=[3], pad_id=0, **settings)
    engine = LocalEngine(model, None, pad_id=0, settings=EngineSettings(paged=paged))
    out = engine.generate(PROMPTS, row_keys=keys, stop_token_ids=[3], **settings)
    assert out.sequences == direct.sequences
    assert out.logprobs == direct.logprobs
    assert out.prompt_lengths == [4, 2, 6]
    assert out.finish_reasons == direct.finish_reasons
    # keyed: a row alone decodes as in the batch
    alone = engine.generate(PROMPTS[2:], row_keys=keys[2:], stop_token_ids=[3], **settings)
    assert alone.sequences[0] == out.sequences[2]


def test_generate_runs_in_eval_mode_without_grad_and_restores_the_mode():
    model = tiny(0).train()
    modes: list[tuple[bool, bool]] = []
    model.register_forward_hook(lambda m, i, o: modes.append((m.training, o.requires_grad)))
    LocalEngine(model, None, pad_id=0).generate(
        PROMPTS, row_keys=None, temperature=0.0, stop_token_ids=[], **SETTINGS
    )
    assert modes and all(m == (False, False) for m in modes)
    assert model.training


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "plain"])
def test_stop_strings_use_the_tokenizer_and_autocast_matches_direct_autocast(paged):
    model = tiny(0)
    codec = LetterCodec()
    engine_settings = EngineSettings(paged=paged)
    call = generate_paged if paged else generate
    greedy = dict(SETTINGS, temperature=0.0, max_new_tokens=8)
    free = generate(model, PROMPTS, **{**greedy, "stop_strings": []})
    stop = codec.decode(free.sequences[0][1:3])  # the text of tokens 1..2 of row 0
    engine = LocalEngine(model, codec, pad_id=0, settings=engine_settings)
    out = engine.generate(
        PROMPTS, row_keys=None, stop_token_ids=[], **{**greedy, "stop_strings": [stop]}
    )
    assert out.finish_reasons[0] == "stop" and out.sequences[0] == free.sequences[0][:3]
    with pytest.raises(ValueError, match="tokenizer=None"):
        LocalEngine(model, None, pad_id=0, settings=engine_settings).generate(
            PROMPTS, row_keys=None, stop_token_ids=[], **{**greedy, "stop_strings": ["x"]}
        )
    # under autocast the engine decodes as the function it calls does under the same autocast
    # (bf16 rounding differs between batchings, so the paged engine is compared to paged)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        direct = call(model, PROMPTS, **greedy)
    bf16 = LocalEngine(
        model, None, pad_id=0, autocast_dtype=torch.bfloat16, settings=engine_settings
    )
    out = bf16.generate(PROMPTS, row_keys=None, stop_token_ids=[], **greedy)
    assert out.sequences == direct.sequences and out.logprobs == direct.logprobs


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "plain"])
def test_load_weights_round_trip_gives_the_sender_s_model(paged):
    target, source = tiny(0), tiny(1)
    engine = LocalEngine(target, None, pad_id=0, settings=EngineSettings(paged=paged))
    sent = {n: p.detach().clone().double() for n, p in source.named_parameters()}  # cast too
    engine.load_weights(sent)
    for name, param in target.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, sent[name].float()), name
    settings = dict(SETTINGS, temperature=1.0)
    keys = [7, 8, 9]
    ours = engine.generate(PROMPTS, row_keys=keys, stop_token_ids=[], **settings)
    theirs = (generate_paged if paged else generate)(source, PROMPTS, row_keys=keys, **settings)
    assert ours.sequences == theirs.sequences and ours.logprobs == theirs.logprobs


def test_partial_update_changes_only_the_sent_tensors():
    model = tiny(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    new = torch.full_like(before["model.norm.weight"], 0.5)
    LocalEngine(model, None, pad_id=0).load_weights({"model.norm.weight": new})
    for name, param in model.named_parameters():
        expected = new if name == "model.norm.weight" else before[name]
        assert torch.equal(param, expected), name


def test_bad_names_and_shapes_raise_before_anything_is_copied():
    model = tiny(0)
    engine = LocalEngine(model, None, pad_id=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    good = {"model.norm.weight": torch.zeros(64)}
    with pytest.raises(KeyError, match="'model.layers.9.mlp.up_proj.weight' is not a parameter"):
        engine.load_weights({**good, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[65\] .* holds \[64\]"):
        engine.load_weights(
            {
                "model.embed_tokens.weight": torch.zeros(256, 64),
                "model.norm.weight": torch.zeros(65),
            }
        )
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name  # all or nothing


def test_a_lora_policy_sends_only_its_adapter_weights():
    def lora(seed: int) -> torch.nn.Module:
        model = tiny(0)
        apply_lora(model, target_modules=["q_proj", "v_proj"], rank=2, alpha=4)
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_()
        return model

    target, trained = lora(1), lora(2)
    adapters = {n: p.detach() for n, p in trained.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_" in n for n in adapters)
    engine = LocalEngine(target, None, pad_id=0)
    engine.load_weights(adapters)
    assert all(
        torch.equal(a, b)
        for a, b in zip(target.state_dict().values(), trained.state_dict().values())
    )
    greedy = dict(SETTINGS, temperature=0.0)
    out = engine.generate(PROMPTS, row_keys=None, stop_token_ids=[], **greedy)
    assert out.sequences == generate(trained, PROMPTS, **greedy).sequences
