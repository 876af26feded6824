"""The reward-model recipe end to end on a tiny synthetic preference task.

- Learning: on held-out pairs the recipe's logged ``val_accuracy`` climbs from chance (where a
  randomly headed reward model of the same body sits) to >= 0.8 within a few seconds of CPU.
- Export: the final checkpoint is a ``*ForSequenceClassification`` folder that transformers
  loads with no missing or unexpected key, and scores right-padded held-out pairs exactly as
  tunesmith's :class:`~tunesmith.models.reward.RewardModel` does (with the checkpoint's own
  ``pad_token_id``); ranking the pairs by those scores gives the logged ``val_accuracy``.
- Resuming is bitwise; gradient accumulation equals one big batch.
- A tokenizer with no pad token, or whose pad token ends the sequences (transformers would
  then score an earlier token than the recipe trained), is refused with a message naming the
  file and row; a pad token that only occurs inside the sequences is fine.
- (slow) FSDP2 over two gloo ranks trains like one process.

The task: preference_world's 'say' pairs. The prompt asks for one of four words ("... say
blue"); the chosen reply is that word, the rejected reply another of the four. Every word is
chosen and rejected equally often, so a random reward model ranks pairs at chance; two random
filler words in each prompt make the held-out prompts new ones.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tests.recipes.preference_world import (
    collate_pairs,
    make_held_out_data,
    make_preference_data,
)
from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoints,
    final_weights,
    largest_change,
    launch_ranks,
    make_model_dir,
    read_eval_metrics,
    read_metrics,
    recipe_overrides,
    run_recipe,
)
from tunesmith.data import Tokenizer, split_train_val
from tunesmith.models import reward_model_from_hf

STEPS, BATCH, EVAL_EVERY, SAVE_EVERY, VAL_ROWS = 96, 8, 8, 16, 32
LEARN = ["optimizer.lr=3e-3", "lr_scheduler.num_warmup_steps=5"]
SGD = [
    "optimizer._component_=torch.optim.SGD", "~optimizer.weight_decay", "optimizer.lr=1.0",
    "lr_scheduler.num_warmup_steps=0",
]  # fmt: skip


SAY = {"task": "say", "system": None}
"""The pairs of these tests: preference_world's 'say' task with no system turn (the template
then adds Qwen's default one)."""


def make_pairs(path: Path, rows: int, seed: int) -> Path:
    """JSONL 'say' preference pairs (see :data:`SAY`).

    Example::

        make_pairs(tmp_path / "pairs.jsonl", rows=8, seed=0)
    """
    return make_preference_data(path, rows, seed, **SAY)


def run_rm(
    model_dir: Path, train: Path, output_dir: Path, *overrides: str, val: Path | None = None
) -> Path:
    """Run the reward-model recipe on its shipped ``tiny`` config in this process (``val``: a
    pairs file for ``val_dataset``); returns ``output_dir``."""
    return run_recipe("reward_model", "tiny", model_dir, train, output_dir, *overrides, val=val)


def held_out_batch(folder: Path, val: Path, pad_id: int) -> dict[str, torch.Tensor]:
    """All held-out pairs, tokenized with ``folder``'s tokenizer, as one batch right-padded
    with ``pad_id`` (chosen rows, then rejected rows)."""
    batch = collate_pairs(folder, val, pad_id=pad_id)
    assert batch["input_ids"].shape[0] == 2 * VAL_ROWS
    return batch


def initial_body(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of ``model_dir``'s transformer body (everything but the random score head)
    as a reward model starts from them."""
    initial = reward_model_from_hf(model_dir).state_dict()
    return {k: v for k, v in initial.items() if "score" not in k}


def pair_accuracy(scores: torch.Tensor) -> float:
    """Fraction of pairs whose chosen row (first half) scores above its rejected row."""
    half = scores.shape[0] // 2
    return (scores[:half] > scores[half:]).double().mean().item()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_model")
    model_dir = make_model_dir(root)
    train = make_pairs(root / "train.jsonl", rows=STEPS * BATCH, seed=0)
    val = make_held_out_data(root / "val.jsonl", train, rows=VAL_ROWS, seed=1, **SAY)
    return root, model_dir, train, val


@pytest.fixture(scope="module")
def trained(world) -> Path:
    """One learning run: STEPS steps, validated every EVAL_EVERY steps, a checkpoint kept
    every SAVE_EVERY steps."""
    root, model_dir, train, val = world
    return run_rm(
        model_dir,
        train,
        root / "learn",
        f"batch_size={BATCH}",
        f"max_steps={STEPS}",
        f"eval_every_n_steps={EVAL_EVERY}",
        f"save_every_n_steps={SAVE_EVERY}",
        "keep_last=null",
        *LEARN,
        val=val,
    )


def test_held_out_accuracy_rises_from_chance_to_above_0_8(world, trained):
    _, model_dir, _, val = world
    # Where training starts: the body with a fresh random head (drawn as the recipe draws it,
    # after seeding) ranks the held-out pairs at chance.
    pad_id = Tokenizer.from_pretrained(model_dir).pad_id
    torch.manual_seed(0)
    untrained = reward_model_from_hf(model_dir, pad_token_id=pad_id).eval()
    batch = held_out_batch(model_dir, val, pad_id)
    with torch.no_grad():
        start = pair_accuracy(untrained(batch["input_ids"], attention_mask=batch["attention_mask"]))
    assert 0.25 <= start <= 0.75, f"an untrained reward model already ranks {start:.2f} right"

    logged = read_eval_metrics(trained)
    assert sorted(logged) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    accuracy = [logged[step]["val_accuracy"] for step in sorted(logged)]
    assert accuracy[0] < 0.8, f"already {accuracy[0]} after {EVAL_EVERY} steps: task too easy"
    assert accuracy[-1] >= 0.8, f"held-out accuracy by step: {accuracy}"
    assert logged[STEPS]["val_loss"] < 0.5 < logged[EVAL_EVERY]["val_loss"]


def transformers_scores(folder: Path, val: Path) -> tuple[torch.Tensor, dict]:
    """``AutoModelForSequenceClassification``'s scores of the held-out pairs (right-padded
    with ``folder``'s own pad_token_id), and its loading info."""
    model, info = AutoModelForSequenceClassification.from_pretrained(
        folder, output_loading_info=True, dtype=torch.float32
    )
    batch = held_out_batch(folder, val, model.config.pad_token_id)
    with torch.no_grad():
        logits = model.eval()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return logits.logits[:, 0].float(), info


def test_checkpoint_loads_in_transformers_and_scores_like_tunesmith(world, trained):
    _, model_dir, _, val = world
    final = checkpoints(trained)[-1]
    assert final.name == f"step_{STEPS:06d}"
    config = json.loads((final / "config.json").read_text())
    pad_id = config["pad_token_id"]
    assert pad_id == Tokenizer.from_pretrained(model_dir).pad_id  # the recipe wrote it
    assert config["architectures"] == ["Qwen2ForSequenceClassification"]

    hf_scores, info = transformers_scores(final, val)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loading {final}: {problems}"
    batch = held_out_batch(final, val, pad_id)
    assert (batch["attention_mask"] == 0).any(), "no padding: the comparison would not test it"
    ours = reward_model_from_hf(final).eval()
    with torch.no_grad():
        our_scores = ours(batch["input_ids"], attention_mask=batch["attention_mask"])[:, 0]
    torch.testing.assert_close(our_scores, hf_scores, atol=1e-5, rtol=0)
    assert hf_scores.std() > 0.1  # trained scores that tell pairs apart, not a constant


def test_transformers_ranks_held_out_pairs_as_the_logged_val_accuracy_says(world, trained):
    _, _, _, val = world
    logged = read_eval_metrics(trained)
    saved = checkpoints(trained)
    assert [p.name for p in saved] == [
        f"step_{s:06d}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)
    ]
    accuracies = []
    for folder in saved:
        step = int(folder.name.removeprefix("step_"))
        scores, _ = transformers_scores(folder, val)
        margins = scores[:VAL_ROWS] - scores[VAL_ROWS:]
        accuracies.append(pair_accuracy(scores))
        assert accuracies[-1] == pytest.approx(logged[step]["val_accuracy"], abs=1e-9), step
        assert margins.mean().item() == pytest.approx(logged[step]["val_margin"], rel=1e-4)
    assert len({round(a, 6) for a in accuracies}) > 2, f"accuracies {accuracies} tell little"


RESUME_ROWS, RESUME_BATCH, RESUME_TOTAL = 24, 4, 8  # 6 steps an epoch: the run spans two
COMPARED = ("loss", "lr", "grad_norm", "pairs_in_window", "accuracy", "margin")


def test_stop_and_resume_is_bitwise_the_uninterrupted_run(world, tmp_path):
    root, model_dir, _, _ = world
    data = make_pairs(tmp_path / "pairs.jsonl", rows=RESUME_ROWS, seed=2)
    common = [f"batch_size={RESUME_BATCH}", f"max_steps={RESUME_TOTAL}", *LEARN]
    reference = run_rm(model_dir, data, tmp_path / "whole", *common)
    out = tmp_path / "resumed"
    run_rm(model_dir, data, out, *common, "stop_after_steps=5")
    assert [p.name for p in checkpoints(out)] == ["step_000005"]
    run_rm(model_dir, data, out, *common, "resume=true")

    weights, expected = final_weights(out), final_weights(reference)
    assert weights.keys() == expected.keys() and "score.weight" in weights
    for name in weights:
        assert torch.equal(weights[name], expected[name]), f"{name} differs after resuming"
    logged, logged_ref = read_metrics(out), read_metrics(reference)
    assert sorted(logged) == list(range(1, RESUME_TOTAL + 1))
    for step in range(6, RESUME_TOTAL + 1):
        for key in COMPARED:
            assert logged[step][key] == logged_ref[step][key], f"{key} at step {step}"


def test_gradient_accumulation_equals_one_big_batch(world, tmp_path):
    _, model_dir, _, _ = world
    micro, accum, steps = 2, 3, 3
    data = make_pairs(tmp_path / "pairs.jsonl", rows=micro * accum * steps, seed=3)
    common = [f"max_steps={steps}", *SGD]
    accumulated = run_rm(
        model_dir,
        data,
        tmp_path / "accum",
        f"batch_size={micro}",
        f"gradient_accumulation_steps={accum}",
        *common,
    )
    big = run_rm(model_dir, data, tmp_path / "big", f"batch_size={micro * accum}", *common)

    logged_a, logged_b = read_metrics(accumulated), read_metrics(big)
    assert sorted(logged_a) == sorted(logged_b) == list(range(1, steps + 1))
    for step in logged_a:
        a, b = logged_a[step], logged_b[step]
        assert a["pairs_in_window"] == b["pairs_in_window"] == micro * accum
        for key in ("loss", "grad_norm", "accuracy", "margin"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), f"{key} at step {step}"
    weights_a = final_weights(accumulated)
    assert_same_weights(weights_a, final_weights(big), 1e-6)
    moved = largest_change(weights_a, initial_body(model_dir))
    assert moved > 1e-3, "training barely moved the body: the comparison would not test it"


def tokenizer_variant(model_dir: Path, folder: Path, **changes: object) -> Path:
    """A copy of ``model_dir`` whose tokenizer_config.json has ``changes`` applied (a None
    value removes the key); ``chat_template`` may be a function of the old template."""
    shutil.copytree(model_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    for key, value in changes.items():
        if callable(value):
            config[key] = value(config[key])
        elif value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config))
    return folder


def _turns_end_at_im_end(template: str) -> str:
    """The Qwen template with no newline after a user or assistant turn's <|im_end|>, so each
    conversation ends with the eos token (as Llama 3's ends with <|eot_id|>)."""
    turn = "message.content + '<|im_end|>\\n'"
    assert turn in template
    return template.replace(turn, "message.content + '<|im_end|>'")


def pairs_after_a_skipped_row(path: Path, rows: int, seed: int) -> Path:
    """:func:`make_pairs` with a first row the dataset skips (identical replies), so
    sample i comes from source row i + 1."""
    make_pairs(path, rows, seed)
    user = {"role": "user", "content": "say red"}
    same = [user, {"role": "assistant", "content": "red"}]
    path.write_text(json.dumps({"chosen": same, "rejected": same}) + "\n" + path.read_text())
    return path


NO_PAD = "has no pad token: a reward model checkpoint needs pad_token_id"
ENDS_WITH_PAD = "{data}: row {row}: the chosen sequence ends with the pad token"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        pytest.param({"pad_token": None, "eos_token": None}, NO_PAD, id="no-pad-no-eos"),
        # the pad id falls back to eos, which then ends every sequence
        pytest.param(
            {"pad_token": None, "chat_template": _turns_end_at_im_end},
            ENDS_WITH_PAD,
            id="no-pad-eos-ends-the-sequences",
        ),
        # 'Ċ' is the byte-level token of the newline that ends Qwen turns
        pytest.param({"pad_token": "Ċ"}, ENDS_WITH_PAD, id="pad-is-the-last-token"),
    ],
)
def test_refuses_a_pad_token_that_transformers_would_misread(world, tmp_path, changes, message):
    _, model_dir, _, _ = world
    folder = tokenizer_variant(model_dir, tmp_path / "model", **changes)
    data = pairs_after_a_skipped_row(tmp_path / "pairs.jsonl", rows=8, seed=4)
    # the error names the source row of the first training sample (the split holds out 2)
    first = split_train_val(list(range(8)), 0.25, seed=0)[0].indices[0]
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=re.escape(message.format(data=data, row=first + 1))):
        run_rm(folder, data, out, "max_steps=1", "val_fraction=0.25")
    assert not (out / "checkpoints").exists()  # refused before training


def test_accepts_a_pad_token_inside_the_sequences_but_not_at_their_end(world, tmp_path):
    # No pad token: the pad id falls back to eos (<|im_end|>), which ends every turn, but each
    # Qwen sequence ends with the newline after it, and transformers scores the last token that
    # is not padding: that newline, as the recipe does. Allowed, and written to config.json.
    _, model_dir, _, val = world
    folder = tokenizer_variant(model_dir, tmp_path / "model", pad_token=None)
    eos = Tokenizer.from_pretrained(folder).eos_id
    data = make_pairs(tmp_path / "pairs.jsonl", rows=8, seed=5)
    out = run_rm(folder, data, tmp_path / "run", "batch_size=4", "max_steps=2")
    final = checkpoints(out)[-1]
    assert json.loads((final / "config.json").read_text())["pad_token_id"] == eos
    batch = held_out_batch(final, val, eos)
    assert (batch["input_ids"] == eos).sum() > (batch["attention_mask"] == 0).sum()
    hf = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    ours = reward_model_from_hf(final).eval()
    with torch.no_grad():
        expected = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        scores = ours(batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(scores, expected.float(), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(world, tmp_path):
    _, model_dir, _, _ = world
    per_rank, steps = 2, 3
    data = make_pairs(tmp_path / "pairs.jsonl", rows=4 * per_rank * steps, seed=6)
    # SGD: Adam would turn the ranks' rounding noise in near-zero gradients into lr-sized steps
    common = [f"max_steps={steps}", *SGD]
    single = run_rm(model_dir, data, tmp_path / "single", f"batch_size={2 * per_rank}", *common)
    out = tmp_path / "fsdp"
    overrides = recipe_overrides(model_dir, data, out, *common, f"batch_size={per_rank}")
    launch_ranks(overrides, tmp_path, recipe="reward_model")
    logged_1, logged_2 = read_metrics(single), read_metrics(out)
    assert sorted(logged_1) == sorted(logged_2) == list(range(1, steps + 1))
    for step in logged_1:
        for key in ("loss", "accuracy", "margin", "grad_norm"):
            assert logged_2[step][key] == pytest.approx(logged_1[step][key], rel=1e-5, abs=1e-6), (
                key
            )
    weights_1 = final_weights(single)
    assert "score.weight" in weights_1
    assert_same_weights(final_weights(out), weights_1, 1e-5)
    assert largest_change(weights_1, initial_body(model_dir)) > 1e-3
    config = json.loads((checkpoints(out)[-1] / "config.json").read_text())
    assert config["pad_token_id"] == Tokenizer.from_pretrained(model_dir).pad_id
