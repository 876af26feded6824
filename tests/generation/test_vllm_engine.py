"""The vLLM rollout engine.

On CPU (no vLLM needed): our conversions of documented vLLM structures (SamplingParams keyword
arguments from our settings; ``RequestOutput`` -> ``GenerationOutput``, fed dataclasses with
vLLM's attribute names), weight packing and the worker-side loader, version and import checks.

On a GPU with vLLM (``@pytest.mark.gpu``, ``make test-gpu``): VLLMEngine against LocalEngine
and teacher-forced float32 log-probs of the same checkpoint, and weight updates.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from tests.recipes.sft_world import make_model_dir
from tunesmith.data import Tokenizer
from tunesmith.generation import LocalEngine
from tunesmith.generation.vllm_engine import (
    VLLMEngine,
    VLLMWorkerExtension,
    check_vllm_version,
    generation_output,
    llm_kwargs,
    pack_weights,
    sampling_params_kwargs,
    unpack_weights,
    weight_update_blobs,
)
from tunesmith.models.hf import from_hf
from tunesmith.models.safetensors_io import read_tensor_index

# ------------------------------------------------- vLLM's output structures (same attributes)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)


NO_FILTERS = dict(top_p=None, top_k=None, min_p=None)


def kwargs_for(**overrides):
    settings = dict(max_new_tokens=8, temperature=0.7, stop_token_ids=[], stop_strings=[])
    return sampling_params_kwargs(**{**settings, **NO_FILTERS, "seed": None, **overrides})


def test_sampling_params_from_our_settings():
    assert kwargs_for(seed=123, stop_token_ids=[5, 2, 5]) == {
        "n": 1,
        "max_tokens": 8,
        "temperature": 0.7,
        "seed": 123,
        "stop_token_ids": [2, 5],
        "stop": [],
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
    }
    with_stops = kwargs_for(stop_strings=["</answer>"])
    assert with_stops["stop"] == ["</answer>"] and with_stops["detokenize"] is True
    # greedy: the filters cannot change the argmax, so they are validated and left out
    greedy = kwargs_for(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)
    assert greedy["temperature"] == 0.0
    assert not {"top_k", "top_p", "min_p"} & set(greedy)
    # filters that filter nothing are neither refused nor sent
    assert not {"top_k", "top_p", "min_p"} & set(kwargs_for(top_p=1.0, min_p=0.0))


def test_sampling_filters_are_refused_unless_allowed():
    with pytest.raises(ValueError, match=r"top_k=50, top_p=None, min_p=None .* filtered"):
        kwargs_for(top_k=50)
    with pytest.raises(ValueError, match="allow_filtered_logprobs=True"):
        kwargs_for(top_p=0.9)
    with pytest.raises(ValueError, match="min_p=0.05"):
        kwargs_for(min_p=0.05)
    allowed = kwargs_for(top_k=50, top_p=0.9, min_p=0.05, allow_filtered_logprobs=True)
    assert (allowed["top_k"], allowed["top_p"], allowed["min_p"]) == (50, 0.9, 0.05)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(top_k=0), "top_k must be a positive int"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
        (dict(max_new_tokens=2.0), "max_new_tokens must be an int"),
        (dict(stop_strings=["ok", ""]), r"stop_strings\[1\] must be a non-empty string"),
    ],
)
def test_bad_settings_raise_as_generate_does(bad, message):
    with pytest.raises(ValueError, match=message):
        kwargs_for(**bad)


def completion(tokens, logprobs, reason, extra=None):
    """Logprobs as vLLM returns them: the sampled token's entry, plus ``extra`` top entries."""
    steps = [
        {t: Logprob(lp, rank=2), **({} if extra is None else {extra: Logprob(-0.01, rank=1)})}
        for t, lp in zip(tokens, logprobs)
    ]
    return CompletionOutput(0, "", tokens, sum(logprobs), steps, reason)


def test_request_outputs_become_a_generation_output():
    outputs = [
        RequestOutput("0", None, [1, 2, 3], None, [completion([7, 8, 2], [-0.5, -1.5, -0.25], "stop")]),
        RequestOutput("1", None, [4], None, [completion([9, 9], [-2.0, -3.0], "length", extra=5)]),
    ]  # fmt: skip
    out = generation_output(outputs, seconds=2.0)
    assert out.sequences == [[7, 8, 2], [9, 9]]
    assert out.logprobs == [[-0.5, -1.5, -0.25], [-2.0, -3.0]]  # the sampled token's, not top-1
    assert out.prompt_lengths == [3, 1]
    assert out.finish_reasons == ["stop", "length"]
    assert (out.new_tokens, out.seconds) == (5, 2.0)
    assert generation_output([]).sequences == []


def test_malformed_request_outputs_raise_naming_the_row():
    ok = completion([7], [-0.5], "stop")
    aborted = completion([7], [-0.5], "abort")
    with pytest.raises(ValueError, match=r"output 1 \(request 7\) finished with reason 'abort'"):
        generation_output(
            [
                RequestOutput("6", None, [1], None, [ok]),
                RequestOutput("7", None, [1], None, [aborted]),
            ]
        )
    no_logprobs = CompletionOutput(0, "", [7], None, None, "stop")
    with pytest.raises(ValueError, match="without log-probs"):
        generation_output([RequestOutput("0", None, [1], None, [no_logprobs])])
    with pytest.raises(ValueError, match="holds 2 completions, expected 1"):
        generation_output([RequestOutput("0", None, [1], None, [ok, ok])])
    short = CompletionOutput(0, "", [7, 8], None, [{7: Logprob(-0.5)}], "length")
    with pytest.raises(ValueError, match="2 tokens but 1 log-prob entries"):
        generation_output([RequestOutput("0", None, [1], None, [short])])
    wrong = CompletionOutput(0, "", [7], None, [{8: Logprob(-0.5)}], "length")
    with pytest.raises(ValueError, match=r"token 0 \(7\) has no log-prob"):
        generation_output([RequestOutput("0", None, [1], None, [wrong])])


def test_pack_weights_chunks_by_bytes_and_round_trips():
    named = {
        "a": torch.arange(4, dtype=torch.float32),  # 16 bytes
        "b": torch.randn(2, 5),  # 40 bytes
        "c": torch.tensor([1.5, -2.0]),  # 8 bytes
    }

    def groups(max_bytes, dtype=None):
        return [unpack_weights(b) for b in pack_weights(named, dtype=dtype, max_bytes=max_bytes)]

    assert [[n for n, _ in g] for g in groups(32)] == [["a"], ["b"], ["c"]]
    assert [[n for n, _ in g] for g in groups(56)] == [["a", "b"], ["c"]]
    assert [[n for n, _ in g] for g in groups(64)] == [["a", "b", "c"]]
    received = dict(pair for g in groups(64) for pair in g)
    assert all(torch.equal(received[n], t) for n, t in named.items())
    halved = dict(pair for g in groups(64, torch.bfloat16) for pair in g)
    assert all(torch.equal(halved[n], t.bfloat16()) for n, t in named.items())
    # tied tensors (one storage, two names) travel as two tensors; the sender's are untouched
    embed = nn.Parameter(torch.randn(3, 2))
    tied = dict(
        unpack_weights(next(pack_weights({"e": embed, "h": embed}, dtype=None, max_bytes=1 << 20)))
    )
    tied["e"].zero_()
    assert torch.equal(tied["h"], embed.detach()) and embed.abs().sum() > 0
    with pytest.raises(TypeError, match="'x' is a list; send plain"):
        list(pack_weights({"x": [1.0]}, dtype=None, max_bytes=64))
    with pytest.raises(ValueError, match="max_bytes must be >= 1"):
        list(pack_weights(named, dtype=None, max_bytes=0))


def test_weight_updates_are_checked_against_the_checkpoint(tmp_path):
    model_dir = make_model_dir(tmp_path)
    shapes = {n: info.shape for n, info in read_tensor_index(model_dir).items()}
    policy = from_hf(model_dir)
    named = dict(policy.named_parameters())

    def blobs(update):
        return list(
            weight_update_blobs(
                update,
                shapes=shapes,
                where=f"the checkpoint {model_dir}",
                dtype=torch.bfloat16,
                max_bytes=1 << 20,
            )
        )

    sent = dict(pair for b in blobs(named) for pair in unpack_weights(b))
    assert sent.keys() == named.keys()
    assert all(torch.equal(sent[n], p.detach().bfloat16()) for n, p in named.items())
    norm = "model.norm.weight"
    with pytest.raises(ValueError, match=rf"'{norm}' has shape \[3\] but the checkpoint"):
        blobs({norm: torch.zeros(3)})
    with pytest.raises(KeyError, match="'model.layers.7.mlp.up_proj.weight' is not a parameter"):
        blobs({"model.layers.7.mlp.up_proj.weight": named["model.layers.0.mlp.up_proj.weight"]})
    adapter = "model.layers.0.self_attn.q_proj.lora_A.weight"
    with pytest.raises(ValueError, match="takes full weights.*merge_adapters"):
        blobs({adapter: torch.zeros(2, 64)})


class LoadsByName(nn.Module):
    """A module with vLLM's model loading entry point: ``load_weights(weights=pairs)``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 2)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


@dataclass
class Runner:
    model: nn.Module

    def get_model(self) -> nn.Module:
        return self.model


@dataclass
class OldRunner:  # a runner without get_model(): the model is an attribute
    model: nn.Module


class Worker(VLLMWorkerExtension):
    def __init__(self, runner) -> None:
        self.model_runner = runner


@pytest.mark.parametrize("runner_type", [Runner, OldRunner])
def test_worker_extension_loads_a_blob_into_the_worker_model(runner_type):
    target = LoadsByName()
    update = {"proj.weight": torch.randn(2, 3), "proj.bias": torch.randn(2)}
    blob = next(pack_weights(update, dtype=None, max_bytes=1 << 20))
    assert Worker(runner_type(target)).tunesmith_load_weights(blob) == 2
    assert torch.equal(target.proj.weight, update["proj.weight"])
    assert torch.equal(target.proj.bias, update["proj.bias"])


@pytest.mark.parametrize(
    "version, ok",
    [
        ("0.10.2", True),
        ("0.10.2.post1", True),
        ("0.11.0+cu128", True),
        ("0.12.0rc1", True),
        ("1.0.0", True),
        ("0.10.1", False),
        ("0.9.2", False),
        ("0.10.1.1", False),
    ],
)
def test_vllm_version_check(version, ok):
    if ok:
        check_vllm_version(version)
    else:
        with pytest.raises(ImportError, match=f"needs vllm >= 0.10.2.*found {version}"):
            check_vllm_version(version)


def test_llm_kwargs_fix_the_logprobs_mode_and_the_worker_extension():
    kwargs = llm_kwargs("/m", tensor_parallel_size=2)
    assert kwargs == {
        "model": "/m",
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.5,
        "seed": 0,
        "enforce_eager": True,
        "tensor_parallel_size": 2,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": "tunesmith.generation.vllm_engine.VLLMWorkerExtension",
    }
    assert llm_kwargs("/m", max_model_len=256)["max_model_len"] == 256
    assert llm_kwargs("/m", logprobs_mode="processed_logprobs")["logprobs_mode"]
    with pytest.raises(ValueError, match="sets logprobs_mode='processed_logprobs' itself"):
        llm_kwargs("/m", logprobs_mode="raw_logprobs")
    # the extension vLLM is told to import is this class
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is VLLMWorkerExtension


def test_missing_vllm_is_one_line_naming_pip_install_and_cuda(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError
    with pytest.raises(ImportError) as error:
        VLLMEngine(tmp_path)
    message = str(error.value)
    assert "pip install vllm" in message and "CUDA" in message and "\n" not in message


def test_importing_tunesmith_generation_does_not_import_vllm():
    code = (
        "import sys, tunesmith.generation, tunesmith.generation.vllm_engine; "
        "assert 'vllm' not in sys.modules, 'vllm imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- GPU + vLLM

TIE = 0.05  # logits closer than this are a tie that bf16 may break either way
LOGPROB_ATOL = 0.05  # vLLM's bf16 log-probs vs our float32 ones


def _needs_cuda_and_vllm() -> None:
    missing = []
    if not torch.cuda.is_available():
        missing.append("no CUDA device")
    if importlib.util.find_spec("vllm") is None:
        missing.append("vllm is not installed (pip install vllm)")
    if missing:
        pytest.skip("needs CUDA and vllm: " + "; ".join(missing))


@pytest.fixture(scope="module")
def gpu_world(tmp_path_factory):
    _needs_cuda_and_vllm()
    root = tmp_path_factory.mktemp("vllm_engine")
    # head_dim 64: a size every vLLM attention backend supports
    sizes = dict(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    model_dir = make_model_dir(root / "a", seed=0, **sizes)
    other_dir = make_model_dir(root / "b", seed=1, **sizes)
    engine = VLLMEngine(
        model_dir, dtype="bfloat16", gpu_memory_utilization=0.25, seed=0, max_model_len=256
    )
    reference = from_hf(model_dir, dtype=torch.float32).eval()  # float32, on CPU
    other = from_hf(other_dir, dtype=torch.float32).eval()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    texts = ["count 3 from 7", "add 4 and 9", "hello", "count 1 from 40 then stop"]
    prompts = [tokenizer.encode(t) for t in texts]
    yield engine, reference, other, prompts, tokenizer
    del engine


def _settings(**overrides):
    base = dict(
        row_keys=None,
        max_new_tokens=12,
        temperature=0.0,
        stop_token_ids=[],
        stop_strings=[],
        **NO_FILTERS,
    )
    return {**base, **overrides}


@torch.no_grad()
def _teacher_forced(model, prompt, completion, temperature=0.0):
    """Float32 ``policy_logprobs`` of every completion position: ``[len(completion), V]``."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids)[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)].float()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def _assert_matches_reference(out, model, prompts, temperature=0.0):
    """Every vLLM log-prob is the float32 one of its token; greedily, every token is the
    float32 argmax or ties with it."""
    for prompt, seq, lps in zip(prompts, out.sequences, out.logprobs):
        ref = _teacher_forced(model, prompt, seq, temperature)
        chosen = ref.gather(-1, torch.tensor(seq)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), chosen, atol=LOGPROB_ATOL, rtol=0)
        if temperature == 0:
            assert bool((ref.max(-1).values - chosen <= TIE).all()), (seq, ref.argmax(-1))


def _assert_same_greedy(ours, theirs, model, prompts):
    """Same tokens, except after a step where the two choices tie in float32."""
    for prompt, a, b in zip(prompts, ours.sequences, theirs.sequences):
        j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if j is None:
            assert a == b
            continue
        ref = _teacher_forced(model, prompt, a[: j + 1])[j]
        assert abs(float(ref[a[j]] - ref[b[j]])) <= TIE, (j, a, b)


@pytest.mark.gpu
def test_vllm_greedy_matches_the_local_engine(gpu_world):
    engine, reference, _, prompts, tokenizer = gpu_world
    local = LocalEngine(reference, tokenizer, pad_id=0)
    ours, theirs = engine.generate(prompts, **_settings()), local.generate(prompts, **_settings())
    assert ours.prompt_lengths == [len(p) for p in prompts]
    assert ours.finish_reasons == ["length"] * len(prompts)
    assert all(len(s) == 12 for s in ours.sequences)
    _assert_same_greedy(ours, theirs, reference, prompts)
    _assert_matches_reference(ours, reference, prompts)
    # a stop token ends the row where it first appears, kept in the completion
    stop = ours.sequences[0][3]
    first = ours.sequences[0].index(stop)
    stopped = engine.generate(prompts, **_settings(stop_token_ids=[stop]))
    assert stopped.sequences[0] == ours.sequences[0][: first + 1]
    assert stopped.finish_reasons[0] == "stop"


@pytest.mark.gpu
def test_vllm_sampled_logprobs_are_tempered_and_keys_reproduce_rows(gpu_world):
    engine, reference, _, prompts, _ = gpu_world
    keys = [11, 12, 13, 14]
    settings = _settings(temperature=0.5, row_keys=keys, max_new_tokens=16)
    out = engine.generate(prompts, **settings)
    _assert_matches_reference(out, reference, prompts, temperature=0.5)
    # the untempered log-probs are far off: the check above tells the two apart
    raw = torch.cat(
        [
            _teacher_forced(reference, p, s).gather(-1, torch.tensor(s)[:, None])[:, 0]
            for p, s in zip(prompts, out.sequences)
        ]
    )
    assert (raw - torch.tensor(sum(out.logprobs, []))).abs().max() > 4 * LOGPROB_ATOL
    # a row's key fixes its completion, whatever the batch order
    again = engine.generate(prompts[::-1], **{**settings, "row_keys": keys[::-1]})
    assert again.sequences[::-1] == out.sequences


@pytest.mark.gpu
def test_vllm_load_weights_changes_outputs_as_the_local_engine_s(gpu_world):
    engine, reference, other, prompts, tokenizer = gpu_world
    before = engine.generate(prompts, **_settings())
    local = LocalEngine(from_hf(engine.model_dir, dtype=torch.float32).eval(), tokenizer, pad_id=0)
    update = {n: p.detach() for n, p in other.named_parameters()}
    engine.load_weights(update)
    local.load_weights(update)
    after, local_after = (
        engine.generate(prompts, **_settings()),
        local.generate(prompts, **_settings()),
    )
    assert after.sequences != before.sequences
    _assert_same_greedy(after, local_after, other, prompts)
    _assert_matches_reference(after, other, prompts)
    # a partial update: the original weights back, tensor by tensor, restore the first outputs
    original = dict(reference.named_parameters())
    for name in original:
        engine.load_weights({name: original[name].detach()})
    assert engine.generate(prompts, **_settings()).sequences == before.sequences


class RecordingLLM:
    """``vllm.LLM.generate`` as the engine calls it: records each request's prompt and
    ``SamplingParams`` keywords, answers ``max_tokens`` tokens (``7, 8, ...``) of log-prob
    -0.5 each."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], dict]] = []

    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for row, (prompt, kwargs) in enumerate(zip(prompts, params)):
            self.requests.append((prompt["prompt_token_ids"], kwargs))
            tokens = list(range(7, 7 + kwargs["max_tokens"]))
            done = completion(tokens, [-0.5] * len(tokens), "length")
            outputs.append(RequestOutput(str(row), None, prompt["prompt_token_ids"], None, [done]))
        return outputs


def _recording_engine() -> tuple[VLLMEngine, RecordingLLM]:
    engine = object.__new__(VLLMEngine)  # no vLLM here: the engine's own logic, a fake LLM
    engine.llm, engine.allow_filtered_logprobs = RecordingLLM(), False
    engine._sampling_params = dict
    return engine, engine.llm


def test_one_limit_per_prompt_asks_vllm_for_each_row_and_skips_zero_limits():
    engine, llm = _recording_engine()
    out = engine.generate(
        [[1, 2], [3], [4, 5, 6]],
        row_keys=[10, 11, 12],
        max_new_tokens=[2, 0, 3],
        temperature=1.0,
        stop_token_ids=[],
        stop_strings=[],
        **NO_FILTERS,
    )
    asked = [(prompt, kwargs["max_tokens"], kwargs["seed"]) for prompt, kwargs in llm.requests]
    assert asked == [([1, 2], 2, 10), ([4, 5, 6], 3, 12)]
    assert out.sequences == [[7, 8], [], [7, 8, 9]]
    assert out.logprobs == [[-0.5, -0.5], [], [-0.5] * 3]
    assert (out.prompt_lengths, out.finish_reasons) == ([2, 1, 3], ["length"] * 3)


def test_a_wrong_number_of_limits_is_refused_before_vllm_is_asked():
    engine, llm = _recording_engine()
    with pytest.raises(ValueError, match="max_new_tokens has 1 entries but there are 2 prompts"):
        engine.generate(
            [[1], [2]],
            row_keys=None,
            max_new_tokens=[4],
            temperature=1.0,
            stop_token_ids=[],
            stop_strings=[],
            **NO_FILTERS,
        )
    assert llm.requests == []
