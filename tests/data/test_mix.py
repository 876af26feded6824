"""DatasetMix: parts of different formats mixed by epochs or weights, their rows exactly the
parts' in hand-computed numbers, the same for the same seed, resumable through the training
loader, and training end to end in the SFT recipe."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import (
    make_counting_data,
    make_model_dir,
    read_metrics,
    recipe_config,
    run_config,
)
from tunesmith.cli import catalog
from tunesmith.data import (
    DataError,
    DatasetMix,
    PreferenceDataset,
    SFTDataset,
    Tokenizer,
    collate_padded,
    packed_or_padded,
)
from tunesmith.data.mix import mix_counts
from tunesmith.recipes import check_config
from tunesmith.training.sources import make_loader


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model folder and three data files of three formats: 4 chat rows, 6 alpaca
    rows, 5 lines of text."""
    root = tmp_path_factory.mktemp("mix")
    model_dir = make_model_dir(root)
    chat = make_counting_data(root / "chat.jsonl", rows=4)
    alpaca = root / "alpaca.jsonl"
    alpaca.write_text(
        "".join(
            json.dumps({"instruction": f"double {i}", "output": str(2 * i)}) + "\n"
            for i in range(6)
        )
    )
    text = root / "books.txt"
    text.write_text("".join(f"line {i} of a book\n" for i in range(5)))
    return SimpleNamespace(model_dir=model_dir, chat=chat, alpaca=alpaca, text=text, root=root)


@pytest.fixture(scope="module")
def tok(world):
    return Tokenizer.from_pretrained(world.model_dir)


def _parts(world):
    return {
        "chat": {"source": str(world.chat)},
        "alpaca": {"source": str(world.alpaca), "format": "alpaca"},
        "books": {"source": str(world.text), "format": "text"},
    }


def _alone(world, tok, max_seq_len=None):
    """Each part built on its own, as a plain SFTDataset (the reference)."""
    return {
        "chat": SFTDataset(tok, source=str(world.chat), max_seq_len=max_seq_len),
        "alpaca": SFTDataset(
            tok, source=str(world.alpaca), format="alpaca", max_seq_len=max_seq_len
        ),
        "books": SFTDataset(tok, source=str(world.text), format="text", max_seq_len=max_seq_len),
    }


@pytest.fixture(scope="module")
def alone(world, tok):
    return _alone(world, tok)


def _key(sample):
    return tuple(sample["input_ids"]), tuple(sample["labels"])


def _which(mix, alone):
    """For each part: how often each of its samples occurs in the mix, found by content."""
    lookup = {_key(ds[i]): (name, i) for name, ds in alone.items() for i in range(len(ds))}
    counts = {name: Counter() for name in alone}
    for i in range(len(mix)):
        name, row = lookup[_key(mix[i])]  # KeyError: a sample that is no part's
        counts[name][row] += 1
    return counts


def test_epochs_give_whole_passes_and_a_seeded_fraction(world, tok):
    mix = DatasetMix(
        tok, parts=_parts(world), epochs={"chat": 2, "alpaca": 0.5}, defaults={"max_seq_len": 64}
    )
    alone = _alone(world, tok, max_seq_len=64)  # the defaults reach every part
    assert alone["chat"].report.truncated > 0  # (which 64 tokens cut)
    # chat: 4 rows x 2 = 8; alpaca: 6 x 0.5 = 3 distinct rows; books (not named): 5 x 1
    assert len(mix) == 8 + 3 + 5
    counts = _which(mix, alone)
    assert counts["chat"] == {0: 2, 1: 2, 2: 2, 3: 2}
    assert sorted(counts["alpaca"].values()) == [1, 1, 1]
    assert counts["books"] == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}
    # the parts follow one another; origin names the part and its row
    assert [mix.origin(i)[0] for i in range(len(mix))] == ["chat"] * 8 + ["alpaca"] * 3 + [
        "books"
    ] * 5
    for i in range(len(mix)):
        name, row = mix.origin(i)
        assert mix[i] == alone[name][row]
    assert mix.max_seq_len == 64


def test_fractional_epochs_above_one(world, tok, alone):
    mix = DatasetMix(tok, parts=_parts(world), epochs={"alpaca": 1.5, "books": 1.4})
    counts = _which(mix, alone)
    # alpaca: 6 x 1.5 = 9 = every row once + 3 rows twice; books: 5 x 1.4 = 7 = 5 + 2
    assert sorted(counts["alpaca"].values()) == [1, 1, 1, 2, 2, 2]
    assert sorted(counts["books"].values()) == [1, 1, 1, 2, 2]
    assert len(mix) == 4 + 9 + 7


def test_weights_are_shares_of_the_mix(world, tok, alone):
    # sizes 4, 6, 5 (sum 15), weights 1:1:2 -> 3.75, 3.75, 7.5 -> 3, 3, 7 plus the two
    # largest remainders (0.75, 0.75; 0.5 loses) -> 4, 4, 7
    mix = DatasetMix(tok, parts=_parts(world), weights={"chat": 1, "alpaca": 1, "books": 2})
    counts = _which(mix, alone)
    assert sum(counts["chat"].values()) == 4 and set(counts["chat"].values()) == {1}
    assert sum(counts["alpaca"].values()) == 4 and set(counts["alpaca"].values()) == {1}
    assert sorted(counts["books"].values()) == [1, 1, 1, 2, 2]  # one pass + 2 drawn
    # num_samples sets the size: 10 x (0.2, 0.3, 0.5) = 2, 3, 5
    mix = DatasetMix(
        tok, parts=_parts(world), weights={"chat": 2, "alpaca": 3, "books": 5}, num_samples=10
    )
    assert [sum(c.values()) for c in _which(mix, alone).values()] == [2, 3, 5]
    assert [len(p.indices) for p in mix.parts] == [2, 3, 5]


def test_mix_counts_rules():
    assert mix_counts({"a": 3, "b": 5}) == {"a": 3, "b": 5}
    assert mix_counts({"a": 3, "b": 5}, epochs={"a": 0.5}) == {"a": 2, "b": 5}  # 1.5 -> 2
    assert mix_counts({"a": 10, "b": 10}, weights={"a": 1, "b": 1}, num_samples=7) == {
        "a": 4,  # 3.5 and 3.5: the tie goes to the earlier part
        "b": 3,
    }
    assert mix_counts({"a": 2, "b": 2, "c": 2}, weights={"a": 1, "b": 1, "c": 1}) == {
        "a": 2,
        "b": 2,
        "c": 2,
    }


def test_same_seed_same_mix_and_parts_drawn_independently(world, tok):
    def origins(seed, parts=None, epochs=None):
        mix = DatasetMix(
            tok,
            parts=parts or _parts(world),
            epochs=epochs or {"alpaca": 0.5, "books": 0.6},
            seed=seed,
        )
        return [mix.origin(i) for i in range(len(mix))]

    first = origins(0)
    assert origins(0) == first
    assert any(origins(seed) != first for seed in (1, 2, 3))
    # a part's draw depends on the seed and its name, not on the other parts
    alpaca_only = {"alpaca": _parts(world)["alpaca"]}
    drawn = [row for name, row in first if name == "alpaca"]
    assert [row for _, row in origins(0, alpaca_only, {"alpaca": 0.5})] == drawn


def test_resumes_through_the_training_loader(world, tok):
    ctx = SimpleNamespace(dp_size=1, dp_rank=0, is_rank_zero=True)

    def loader():
        mix = DatasetMix(tok, parts=_parts(world), epochs={"chat": 1.5, "alpaca": 0.5})
        collate = lambda b: collate_padded(b, pad_id=0)  # noqa: E731
        return make_loader(mix, collate, ctx, batch_size=2, shuffle=True, seed=3)[0]

    whole = [b["input_ids"].tolist() for b in loader()]
    first = loader()
    stream = iter(first)
    head = [next(stream)["input_ids"].tolist() for _ in range(3)]
    state = first.state_dict()
    resumed = loader()  # a fresh mix (a new process) at the saved position
    resumed.load_state_dict(state)
    tail = [b["input_ids"].tolist() for b in resumed]
    assert head + tail == whole
    assert len(whole) == (6 + 3 + 5) // 2


def test_report_names_each_part(world, tok):
    mix = DatasetMix(tok, parts=_parts(world), weights={"chat": 1, "alpaca": 1, "books": 2})
    summary = mix.report.summary()
    lines = summary.splitlines()
    assert lines[0] == "mix of 3 parts -> 15 samples (seed 0)"
    assert lines[1] == "  chat: 4 samples x 1 epochs -> 4 samples (27%, weight 1)"
    assert lines[2].startswith(f"    {world.chat}: 4 rows -> 4 samples")
    assert "  alpaca: 6 samples x 0.667 epochs -> 4 samples (27%, weight 1)" in lines
    assert "  books: 5 samples x 1.4 epochs -> 7 samples (47%, weight 2)" in lines
    assert any(line.startswith(f"    {world.text}: 5 rows -> 5 samples") for line in lines)
    parts = mix.report.as_dict()["parts"]
    assert parts["books"]["samples"] == 7 and parts["books"]["report"]["rows"] == 5


def test_preference_parts_mix_for_dpo(world, tok):
    copy = make_preference_data(world.root / "copy.jsonl", rows=4, task="copy")
    add = make_preference_data(world.root / "add.jsonl", rows=6, task="add")
    part = {"component": "tunesmith.data.PreferenceDataset", "max_seq_len": 128}
    mix = DatasetMix(
        tok,
        parts={"copy": {**part, "source": str(copy)}, "add": {**part, "source": str(add)}},
        epochs={"add": 0.5},
    )
    reference = PreferenceDataset(tok, source=str(copy), max_seq_len=128)
    assert len(mix) == 4 + 3
    assert [mix[i] for i in range(4)] == [reference[i] for i in range(4)]
    assert mix.max_seq_len == 128
    with pytest.raises(DataError, match="parts 'chat' and 'pairs' give different samples"):
        DatasetMix(
            tok, parts={"chat": _parts(world)["chat"], "pairs": {**part, "source": str(copy)}}
        )


def test_bad_input_names_the_part(world, tok):
    parts = _parts(world)
    with pytest.raises(ValueError, match="weights names part 'boooks'.*did you mean 'books'"):
        DatasetMix(tok, parts=parts, weights={"chat": 1, "alpaca": 1, "boooks": 1})
    with pytest.raises(ValueError, match="epochs names part 'code'.*parts are"):
        DatasetMix(tok, parts=parts, epochs={"code": 1})
    for bad in (0, -1, math.nan, "a lot"):
        with pytest.raises(ValueError, match=r"weights\['alpaca'\] is .*must be a number > 0"):
            DatasetMix(tok, parts=parts, weights={"chat": 1, "alpaca": bad, "books": 1})
    with pytest.raises(ValueError, match=r"epochs\['books'\] is 0"):
        DatasetMix(tok, parts=parts, epochs={"books": 0})
    with pytest.raises(
        ValueError, match=r"weights must give every part a weight; missing: \['books'\]"
    ):
        DatasetMix(tok, parts=parts, weights={"chat": 1, "alpaca": 1})
    with pytest.raises(ValueError, match="not both"):
        DatasetMix(tok, parts=parts, weights={"chat": 1}, epochs={"chat": 1})
    with pytest.raises(
        ValueError,
        match=r"parts.alpaca: tunesmith.data.SFTDataset has no "
        r"argument 'fromat'; did you mean 'format'",
    ):
        DatasetMix(tok, parts={**parts, "alpaca": {"source": str(world.alpaca), "fromat": "x"}})
    # every part is checked before any is built: the typo of the last part is found first
    late_typo = {"chat": {"source": "/no/such/file.jsonl"}, "books": {"source": "x", "sourc": 1}}
    with pytest.raises(ValueError, match="parts.books: .* no argument 'sourc'; did you mean"):
        DatasetMix(tok, parts=late_typo)
    with pytest.raises(ValueError, match="parts.chat: write component:, not _component_"):
        DatasetMix(tok, parts={"chat": {"_component_": "tunesmith.data.SFTDataset"}})
    with pytest.raises(DataError, match="parts.empty: has no samples"):
        DatasetMix(tok, parts={**parts, "empty": []})
    # a part whose every row is unusable: the part's own error, named
    junk = world.root / "junk.jsonl"
    junk.write_text('{"messages": []}\n{"messages": 3}\n')
    with pytest.raises(DataError, match="parts.junk: DataError: .*junk.jsonl: no usable samples"):
        DatasetMix(tok, parts={**parts, "junk": {"source": str(junk), "on_bad_row": "skip"}})
    with pytest.raises(ValueError, match=r"weights\['chat'\] = 0.01 gives part 'chat' 0 of 3"):
        mix_counts({"chat": 4, "books": 5}, weights={"chat": 0.01, "books": 1}, num_samples=3)
    with pytest.raises(ValueError, match=r"epochs\['chat'\] = 0.1 gives part 'chat' 0 of its 4"):
        mix_counts({"chat": 4, "books": 5}, epochs={"chat": 0.1})


def test_sft_trains_on_a_mixed_config(world, tmp_path, capsys):
    cfg = recipe_config(
        "sft",
        "tiny",
        world.model_dir,
        world.chat,
        tmp_path / "out",
        "max_steps=3",
        "batch_size=2",
    )
    cfg.dataset = OmegaConf.create(
        {
            "_component_": "tunesmith.data.DatasetMix",
            "defaults": {"max_seq_len": 64, "on_bad_row": "skip"},
            "parts": _parts(world),
            "weights": {"chat": 2, "alpaca": 1, "books": 1},
            "num_samples": 8,
        }
    )
    check_config(cfg, catalog.recipe_path("sft"))  # `tunesmith validate` accepts it
    run_config("sft", cfg)
    out = capsys.readouterr().out
    assert "dataset: mix of 3 parts -> 8 samples (seed 0)" in out
    metrics = read_metrics(tmp_path / "out")
    assert sorted(metrics) == [1, 2, 3]
    assert all(
        math.isfinite(m["loss"]) and m["trained_tokens_in_window"] > 0 for m in metrics.values()
    )


def test_a_mix_packs_to_its_longest_max_seq_len(world, tok):
    mix = DatasetMix(
        tok,
        parts={
            "chat": {"source": str(world.chat), "max_seq_len": 128},
            "books": {"source": str(world.text), "format": "text", "max_seq_len": 32},
        },
    )
    assert mix.max_seq_len == 128
    packs, _ = packed_or_padded(mix, packed=True, max_seq_len=mix.max_seq_len, pad_id=0)
    lengths = [len(mix[i]["input_ids"]) for i in range(len(mix))]
    assert all(len(pack["input_ids"]) == 128 for pack in packs)
    assert sorted(i for members in packs.members for i in members) == list(range(len(mix)))
    real = sum(sum(1 for d in pack["document_ids"] if d >= 0) for pack in packs)
    assert real == sum(lengths)
    loose = DatasetMix(tok, parts={"chat": {"source": str(world.chat)}, "books": [mix[0]]})
    assert loose.max_seq_len is None  # a part without a limit: the mix has none


def test_cache_notes_name_their_part(world, tok, tmp_path):
    parts = {
        "chat": {"source": str(world.chat)},
        "books": {"source": str(world.text), "format": "text"},
    }
    mix = DatasetMix(tok, parts=parts, defaults={"cache_dir": str(tmp_path / "cache")})
    again = DatasetMix(tok, parts=parts, defaults={"cache_dir": str(tmp_path / "cache")})
    assert [line.split(": ")[0] for line in again.cache_note.splitlines()] == ["chat", "books"]
    assert [again[i] for i in range(len(again))] == [mix[i] for i in range(len(mix))]
    assert DatasetMix(tok, parts=parts).cache_note is None


def test_dpo_trains_on_a_mix_of_preference_sets(world, tmp_path, capsys):
    copy = make_preference_data(tmp_path / "copy.jsonl", rows=6, task="copy")
    add = make_preference_data(tmp_path / "add.jsonl", rows=6, task="add")
    cfg = recipe_config("dpo", "tiny", world.model_dir, copy, tmp_path / "out", "max_steps=2")
    cfg.dataset = OmegaConf.create(
        {
            "_component_": "tunesmith.data.DatasetMix",
            "defaults": {"component": "tunesmith.data.PreferenceDataset", "max_seq_len": 128},
            "parts": {"copy": {"source": str(copy)}, "add": {"source": str(add)}},
            "epochs": {"add": 0.5},
        }
    )
    run_config("dpo", cfg)
    assert "dataset: mix of 2 parts -> 9 samples (seed 0)" in capsys.readouterr().out
    metrics = read_metrics(tmp_path / "out")
    assert sorted(metrics) == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics.values())
