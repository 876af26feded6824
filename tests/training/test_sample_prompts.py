"""In-training generations (`sample_prompts`): greedy completions of fixed prompts every N steps,
logged as text to stdout and as `samples` records in the JSONL log."""

from __future__ import annotations

import io
import json

import pytest
from omegaconf import OmegaConf

from tests.recipes.sft_world import make_counting_data, make_model_dir, run_sft
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.config import ConfigError
from tunesmith.generation import generate
from tunesmith.training.logging.loggers import MultiLogger, NullLogger, StdoutLogger
from tunesmith.training.rules import check_rules
from tunesmith.training.sample_prompts import SamplePrompts, log_samples
from tunesmith.training.settings import LOOP_RULES

PROMPTS = '["count 3 from 4", {text: "count"}, {messages: [{role: user, content: "add 1 and 2"}]}]'


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    return make_model_dir(root, initializer_range=0.2), make_counting_data(root / "d.jsonl"), root


def _samples(output_dir) -> dict[int, list[dict]]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["samples"] for r in records if "samples" in r}


def test_samples_every_eval_interval_equal_greedy_decoding_of_the_checkpoint(world, capsys):
    model_dir, data, root = world
    out = run_sft(
        model_dir,
        data,
        root / "run",
        "max_steps=4",
        "eval_every_n_steps=2",
        "save_every_n_steps=2",
        f"sample_prompts={PROMPTS}",
        "sample_max_new_tokens=5",
    )
    samples = _samples(out)
    assert sorted(samples) == [2, 4]
    printed = capsys.readouterr().out
    for step in (2, 4):
        loaded = load_checkpoint(out / "checkpoints" / f"step_{step:06d}")
        tok = loaded.tokenizer
        ids = [
            tok.tokenize_conversation([{"role": "user", "content": "count 3 from 4"}],
                                      add_generation_prompt=True)[0],
            tok.encode("count"),
            tok.tokenize_conversation([{"role": "user", "content": "add 1 and 2"}],
                                      add_generation_prompt=True)[0],
        ]  # fmt: skip
        for got, prompt_ids, shown in zip(
            samples[step], ids, ["count 3 from 4", "count", "add 1 and 2"]
        ):
            tokens = generate(
                loaded.model, [prompt_ids], max_new_tokens=5, stop_token_ids=tok.stop_token_ids
            ).sequences[0]
            if tokens and tokens[-1] in tok.stop_token_ids:
                tokens = tokens[:-1]
            assert got == {
                "prompt": shown,
                "completion": tok.decode(tokens, skip_special_tokens=True),
            }
            line = got["completion"].replace("\n", "\\n")
            assert f"| {shown} -> {line}\n" in printed
    assert "step 4 | sample 2 | add 1 and 2 -> " in printed
    assert samples[2] != samples[4], "the samples follow the training"


def test_sample_every_n_steps_has_its_own_interval(world):
    model_dir, data, root = world
    out = run_sft(
        model_dir,
        data,
        root / "own",
        "max_steps=4",
        "sample_every_n_steps=3",
        "sample_prompts=[hi]",
        "sample_max_new_tokens=2",
    )
    assert sorted(_samples(out)) == [3, 4]  # and after the last step
    quiet = run_sft(model_dir, data, root / "none", "max_steps=2")
    assert _samples(quiet) == {}


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("[3]", "sample_prompts: expected a list of prompts"),
        ("hello", "sample_prompts: expected a list of prompts"),
        ("[[a]]", "sample_prompts: expected a list of prompts"),
    ],
)
def test_a_bad_prompt_list_is_refused_before_training(value, expected):
    cfg = OmegaConf.create(f"sample_prompts: {value}\nsample_every_n_steps: 0")
    issues = [str(i) for i in check_rules(cfg, LOOP_RULES)]
    assert any(i.startswith(expected) for i in issues), issues
    assert any(i.startswith("sample_every_n_steps: expected an int >= 1") for i in issues)


def test_a_bad_prompt_is_named_by_its_index(world):
    model_dir, _, _ = world
    loaded = load_checkpoint(model_dir)
    with pytest.raises(ValueError, match=r"sample_prompts\[1\]: \{'txt': 'a'\} is not a string"):
        SamplePrompts(loaded.model, loaded.tokenizer, ["ok", {"txt": "a"}])
    with pytest.raises(ConfigError, match="sample_prompts"):
        run_sft(model_dir, world[1], world[2] / "bad", "max_steps=1", "sample_prompts=[3]")


def test_log_samples_reaches_each_logger_kind():
    class TextLogger:
        def __init__(self):
            self.calls = []

        def log_text(self, step, samples):
            self.calls.append((step, list(samples)))

    stream, text = io.StringIO(), TextLogger()
    samples = [{"prompt": "a\nb", "completion": "c"}]
    log_samples(MultiLogger([StdoutLogger(stream=stream), NullLogger()]), 3, samples)
    log_samples(text, 3, samples)
    assert stream.getvalue() == "step 3 | sample 0 | a\\nb -> c\n"
    assert text.calls == [(3, samples)]
