"""The tokenised-rows cache: a second build of the same data hits it and gives the very same
samples and report; any change that changes tokens (the file's bytes, a setting, the template)
misses it; a damaged entry is ignored with a warning and rebuilt; a re-run of a recipe logs the
hit and trains bitwise the same."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    final_weights,
    make_counting_data,
    make_model_dir,
    read_metrics,
    run_recipe,
    run_sft,
)
from tunesmith.data import PreferenceDataset, SFTDataset, Tokenizer
from tunesmith.data.token_cache import TokenCache


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_tokenizer_folder(tmp_path_factory.mktemp("tok") / "qwen", "qwen2_5")


@pytest.fixture
def data(tmp_path) -> Path:
    return make_counting_data(tmp_path / "count.jsonl", rows=12)


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.npz"))


def test_second_build_hits_and_equals_the_first(tok_dir, data, tmp_path):
    tok, cache = Tokenizer.from_pretrained(tok_dir), tmp_path / "cache"
    kwargs = {"source": str(data), "max_seq_len": 72, "truncation": "left"}  # some rows cut
    first = SFTDataset(tok, **kwargs, cache_dir=cache)
    [entry] = _entries(cache)
    assert first.cache_note == f"tokenized data: cached to {entry}"
    second = SFTDataset(Tokenizer.from_pretrained(tok_dir), **kwargs, cache_dir=cache)
    assert second.cache_note == f"tokenized data: cache hit {entry}"
    uncached = SFTDataset(tok, **kwargs)  # tokenised here, without any cache
    assert uncached.cache_note is None
    assert second.samples == first.samples == uncached.samples
    assert second.row_indices == uncached.row_indices
    assert second.report == uncached.report
    assert uncached.report.truncated > 0  # the report's counts came through the cache too
    assert all(type(i) is int for s in second.samples for i in s["input_ids"])


def test_what_changes_tokens_misses_the_cache(tok_dir, data, tmp_path):
    tok, cache = Tokenizer.from_pretrained(tok_dir), tmp_path / "cache"
    SFTDataset(tok, source=str(data), cache_dir=cache)
    changed_setting = SFTDataset(tok, source=str(data), cache_dir=cache, train_on="all")
    assert "cached to" in changed_setting.cache_note
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[:-1]) + "\n")  # the file changed in place
    changed_file = SFTDataset(tok, source=str(data), cache_dir=cache)
    assert "cached to" in changed_file.cache_note and len(changed_file) == len(lines) - 1
    other_template = Tokenizer.from_pretrained(tok_dir, chat_template="qwen3")
    changed_template = SFTDataset(other_template, source=str(data), cache_dir=cache)
    assert "cached to" in changed_template.cache_note
    assert len(_entries(cache)) == 4
    assert changed_template.samples == SFTDataset(other_template, source=str(data)).samples


def test_a_damaged_entry_is_ignored_with_a_warning_and_rebuilt(tok_dir, data, tmp_path):
    tok, cache = Tokenizer.from_pretrained(tok_dir), tmp_path / "cache"
    expected = SFTDataset(tok, source=str(data), cache_dir=cache).samples
    [entry] = _entries(cache)
    entry.write_bytes(entry.read_bytes()[:100])  # cut short, as by a crash mid-copy
    with pytest.warns(UserWarning, match=f"{entry} cannot be read"):
        rebuilt = SFTDataset(tok, source=str(data), cache_dir=cache)
    assert rebuilt.cache_note == f"tokenized data: cached to {entry}"
    assert rebuilt.samples == expected
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rewritten entry reads back without a warning
        assert SFTDataset(tok, source=str(data), cache_dir=cache).samples == expected
    assert not list(cache.glob(".*.tmp"))  # writes go through a temporary file, renamed


def test_preference_pairs_are_cached_too(tok_dir, tmp_path):
    tok, cache = Tokenizer.from_pretrained(tok_dir), tmp_path / "cache"
    pairs = make_preference_data(tmp_path / "pairs.jsonl", rows=8)
    first = PreferenceDataset(tok, source=str(pairs), max_seq_len=64, cache_dir=cache)
    second = PreferenceDataset(tok, source=str(pairs), max_seq_len=64, cache_dir=cache)
    assert "cache hit" in second.cache_note and "cached to" in first.cache_note
    assert second.samples == PreferenceDataset(tok, source=str(pairs), max_seq_len=64).samples
    assert {type(s["prompt_len"]) for s in second.samples} == {int}
    assert second.report == first.report


def test_only_local_files_with_a_real_tokenizer_have_a_key(tok_dir, data, tmp_path):
    cache, tok = TokenCache(tmp_path), Tokenizer.from_pretrained(tok_dir)
    assert cache.key(data, tok, {}) is not None
    assert cache.key(tmp_path, tok, {}) is None  # a folder
    assert cache.key(data, object(), {}) is None  # no fingerprint()
    assert cache.key(data, tok, {"a": 1}) != cache.key(data, tok, {"a": 2})


def test_a_rerun_logs_the_hit_and_trains_bitwise_the_same(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path)
    data = make_counting_data(tmp_path / "count.jsonl", rows=16)
    first = run_sft(model_dir, data, tmp_path / "first", "max_steps=3")
    assert "tokenized data: cached to" in capsys.readouterr().out
    second = run_sft(model_dir, data, tmp_path / "second", "max_steps=3")
    [entry] = _entries(tmp_path / ".tunesmith_cache")  # the shipped config's cache_dir
    assert f"tokenized data: cache hit {entry}" in capsys.readouterr().out
    a, b = final_weights(first), final_weights(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert read_metrics(first)[3]["loss"] == read_metrics(second)[3]["loss"]


def test_dpo_rerun_hits_the_cache(tmp_path, capsys):
    model_dir = make_model_dir(tmp_path)
    pairs = make_preference_data(tmp_path / "pairs.jsonl", rows=8)
    run_recipe("dpo", "tiny", model_dir, pairs, tmp_path / "a", "max_steps=1")
    capsys.readouterr()
    run_recipe("dpo", "tiny", model_dir, pairs, tmp_path / "b", "max_steps=1")
    assert "tokenized data: cache hit" in capsys.readouterr().out
    records = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["step"] == 1
