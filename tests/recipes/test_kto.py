"""The KTO recipe end to end on a tiny model (issue #36): the logged loss and metrics of step 1
against the paper's formula on independent log-probs (the KL rows built here from the
tokenised rows), gradient accumulation == one big batch (the KL estimate is the step's),
resuming == the uninterrupted run, precomputed reference log-probs == on the fly, the
class-imbalance warning, and the data: formats, sources and bad rows named.

Independent references: log-probs from ``transformers``' own model of the same folder
(float64), the KTO loss written out below.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.recipes.preference_world import hf_sequence_logps, pair_dataset, preference_rows
from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    final_weights,
    largest_change,
    make_model_dir,
    read_eval_metrics,
    read_metrics,
    run_recipe,
)
from tunesmith.data import BadRowError, Tokenizer, collate_padded
from tunesmith.data.labels import make_labels
from tunesmith.data.unpaired_dataset import UnpairedDataset
from tunesmith.training.objectives.unpaired import imbalance_warning

ONE_STEP = ["max_steps=1", "lr_scheduler.num_warmup_steps=0", "shuffle=false"]


def rated_rows(rows: int, seed: int = 0, task: str = "add", every: int = 2) -> list[dict]:
    """``rows`` rated completions of ``task``'s pairs in the ``prompt_completion`` format
    (conversational: a list of prompt messages, a one-message completion): every ``every``-th
    row is the pair's rejected reply (label false), the others its chosen reply.

    Example::

        >>> rated_rows(2)[1]["label"]
        False
    """
    out = []
    for i, pair in enumerate(preference_rows(rows, seed, task)):
        side = "rejected" if i % every == every - 1 else "chosen"
        conversation = pair[side]
        out.append(
            {
                "prompt": conversation[:-1],
                "completion": conversation[-1:],
                "label": side == "chosen",
            }
        )
    return out


def make_rated_data(path: Path, rows: int = 24, seed: int = 0, every: int = 2) -> Path:
    """Write :func:`rated_rows` to the JSONL file ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rated_rows(rows, seed, every=every)))
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny policy, another model (another seed) as a reference, rated 'add' completions of
    different lengths, half of each label (balanced) and one in three undesirable."""
    root = tmp_path_factory.mktemp("kto")
    return {
        "root": root,
        "model": make_model_dir(root / "policy"),
        "other": make_model_dir(root / "other", seed=1),
        "rated": make_rated_data(root / "rated.jsonl", rows=16, every=2),
        "skewed": make_rated_data(root / "skewed.jsonl", rows=12, every=3),
    }


def _reference_model(model_dir: Path) -> str:
    return f"reference_model={{_component_: tunesmith.models.from_hf, path: {model_dir}, dtype: float32}}"


# -- 1. step 1 as logged == the formula on independent log-probs ------------------------------


def _rows_and_kl_rows(dataset: UnpairedDataset, indices: list[int]) -> tuple[dict, dict]:
    """The training rows ``indices`` and their KL rows (prompt of ``i``, completion of the
    dataset's row ``i - 1``, wrapping around), collated from the tokenised samples."""

    def row(prompt, donor):
        ids = prompt + donor["completion_ids"]
        return {
            "input_ids": ids,
            "labels": make_labels(ids, [0] * len(prompt) + donor["completion_mask"]),
        }

    samples, n = dataset.samples, len(dataset)
    main = [row(samples[i]["prompt_ids"], samples[i]) for i in indices]
    kl = [row(samples[i]["prompt_ids"], samples[(i - 1 + n) % n]) for i in indices]
    return collate_padded(main, 0), collate_padded(kl, 0)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def test_logged_step_one_equals_the_kto_formula(world, tmp_path, capsys):
    """4 completions (rows 0-3, not shuffled: row 0's KL partner is the last row of the
    dataset), two of each label, the reference another model, beta and weights not 1."""
    model_dir, other, data = world["model"], world["other"], world["rated"]
    beta, w_d, w_u = 0.5, 1.2, 0.9
    out = run_recipe(
        "kto", "tiny", model_dir, data, tmp_path, "batch_size=4", *ONE_STEP,
        _reference_model(other), f"loss.beta={beta}", f"loss.desirable_weight={w_d}",
        f"loss.undesirable_weight={w_u}",
    )  # fmt: skip
    assert "kto: 8 desirable and 8 undesirable completions" in capsys.readouterr().out
    logged = read_metrics(out)[1]

    dataset = UnpairedDataset(
        Tokenizer.from_pretrained(model_dir), source=str(data), max_seq_len=256
    )
    main, kl_rows = _rows_and_kl_rows(dataset, [0, 1, 2, 3])
    policy, counts = hf_sequence_logps(model_dir, main)
    reference = hf_sequence_logps(other, main)[0]
    kl_policy, kl_counts = hf_sequence_logps(model_dir, kl_rows)
    kl_reference = hf_sequence_logps(other, kl_rows)[0]
    assert len(set(counts.tolist())) > 1 and kl_counts.min() > 0
    desirable = torch.tensor(dataset.labels[:4])
    assert desirable.tolist() == [True, False, True, False]

    kl = (kl_policy - kl_reference).mean()
    z = kl.clamp(min=0)
    ratio = policy - reference
    losses = torch.where(
        desirable,
        w_d * (1 - _sigmoid(beta * (ratio - z))),
        w_u * (1 - _sigmoid(beta * (z - ratio))),
    )
    rewards = beta * ratio
    expected = {
        "loss": losses.mean(), "kl": z, "rewards/chosen": rewards[desirable].mean(),
        "rewards/rejected": rewards[~desirable].mean(),
        "rewards/margins": rewards[desirable].mean() - rewards[~desirable].mean(),
        "logps/chosen": policy[desirable].mean(), "logps/rejected": policy[~desirable].mean(),
        "count/chosen": torch.tensor(2.0), "count/rejected": torch.tensor(2.0),
    }  # fmt: skip
    assert z > 1e-3  # a real reference: the KL estimate is not clamped to 0
    assert logged["completions_in_window"] == 4
    for key, value in expected.items():
        assert logged[key] == pytest.approx(value.item(), rel=1e-5, abs=1e-6), key


def test_class_imbalance_warning():
    """Eq. 8's rule of thumb: ``w_D·n_D / (w_U·n_U)`` in [1, 4/3]; the suggested weights fix it."""
    assert imbalance_warning(8, 8, 1.0, 1.0) is None
    assert imbalance_warning(4, 3, 1.0, 1.0) is None  # 1.33 <= 4/3
    assert imbalance_warning(8, 0, 1.0, 1.0) is None  # one label: nothing to balance
    text = imbalance_warning(8, 4, 1.0, 1.0)
    assert "8 desirable and 4 undesirable completions" in text
    assert "desirable_weight in [0.5, 0.666] or undesirable_weight in [1.5, 2]" in text
    for w_d, w_u in ((0.5, 1.0), (0.666, 1.0), (1.0, 1.5), (1.0, 2.0)):
        assert imbalance_warning(8, 4, w_d, w_u) is None, (w_d, w_u)
    assert imbalance_warning(8, 4, 1.0, 1.4) is not None


def test_recipe_warns_of_class_imbalance(world, tmp_path, capsys):
    """8 desirable and 4 undesirable completions at equal weights: ratio 2, the run warns (and
    trains on); ``undesirable_weight=1.5`` silences it. Also a 1-label batch (the 'skewed'
    first rows: 2 desirable) trains: rewards/rejected is absent from that step's line."""
    model_dir, data = world["model"], world["skewed"]
    out = run_recipe("kto", "tiny", model_dir, data, tmp_path / "a", "batch_size=2", "max_steps=1")
    text = capsys.readouterr().out
    assert "warning: KTO class balance: 8 desirable and 4 undesirable completions" in text
    assert "set desirable_weight in [0.5, 0.666] or undesirable_weight in [1.5, 2]" in text
    run_recipe(
        "kto", "tiny", model_dir, data, tmp_path / "b", "max_steps=1", "loss.undesirable_weight=1.5"
    )
    assert "KTO class balance" not in capsys.readouterr().out
    logged = read_metrics(out)[1]
    assert logged["count/chosen"] + logged["count/rejected"] == 2
    assert math.isfinite(logged["loss"])


# -- 2. gradient accumulation == one big batch ------------------------------------------------


def test_accumulated_micro_batches_equal_one_big_batch(world, tmp_path):
    """The KL estimate is over the step's 4 completions in both runs (TRL's would be over each
    micro-batch's 2): the losses, the KL and the weights agree."""
    model_dir, data = world["model"], world["rated"]
    common = ["max_steps=3", "optimizer.lr=1e-3", "shuffle=false", _reference_model(world["other"])]
    accumulated = run_recipe(
        "kto", "tiny", model_dir, data, tmp_path / "accum", "batch_size=2",
        "gradient_accumulation_steps=2", *common,
    )  # fmt: skip
    big = run_recipe("kto", "tiny", model_dir, data, tmp_path / "big", "batch_size=4", *common)

    logged_a, logged_b = read_metrics(accumulated), read_metrics(big)
    assert sorted(logged_a) == sorted(logged_b) == [1, 2, 3]
    for step in logged_a:
        a, b = logged_a[step], logged_b[step]
        assert a["completions_in_window"] == b["completions_in_window"] == 4
        for key in b:
            if key.split("/")[0] in ("loss", "grad_norm", "kl", "rewards", "logps", "count"):
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"{key} at step {step}"
    assert max(b["kl"] for b in logged_b.values()) > 1e-3  # the estimate is not all clamped
    weights_a = final_weights(accumulated)
    assert_same_weights(
        weights_a, final_weights(big), lambda name: 1e-5 if name.endswith("k_proj.bias") else 1e-6
    )
    assert largest_change(weights_a, checkpoint_weights(model_dir)) > 1e-3


# -- 3. resuming == the uninterrupted run -----------------------------------------------------


@pytest.mark.parametrize("config", ["tiny", "tiny_lora"])
def test_stop_and_resume_equals_uninterrupted(world, tmp_path, config):
    model_dir, data = world["model"], world["rated"]
    common = ["batch_size=4", "max_steps=4", "optimizer.lr=5e-3"]
    reference = run_recipe("kto", config, model_dir, data, tmp_path / "whole", *common)
    out = tmp_path / "run"
    run_recipe("kto", config, model_dir, data, out, *common, "stop_after_steps=2")
    assert [p.name for p in checkpoints(out)] == ["step_000002"]
    run_recipe("kto", config, model_dir, data, out, *common, "resume=true")
    assert checkpoints(out)[-1].name == "step_000004"

    weights, expected = final_weights(out), final_weights(reference)
    assert weights.keys() == expected.keys()
    for name in weights:
        assert torch.equal(weights[name], expected[name]), f"{name} differs after resuming"
    logged, logged_ref = read_metrics(out), read_metrics(reference)
    assert abs(logged_ref[3]["rewards/chosen"]) > 1e-5  # the policy has left the reference
    for step in (3, 4):
        for key in ("loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected"):
            assert logged[step][key] == logged_ref[step][key], f"{key} at step {step}"


# -- 4. precomputed reference log-probs == on the fly ----------------------------------------


def test_precomputed_reference_gives_the_same_run(world, tmp_path, capsys):
    model_dir, data = world["model"], world["rated"]
    common = ["batch_size=4", "max_steps=3", "optimizer.lr=5e-3", "val_fraction=0.25",
              "shuffle=false", _reference_model(world["other"])]  # fmt: skip
    live = run_recipe("kto", "tiny_lora", model_dir, data, tmp_path / "live", *common)
    capsys.readouterr()
    pre = run_recipe(
        "kto", "tiny_lora", model_dir, data, tmp_path / "pre", *common, "precompute_reference=true"
    )
    assert "precomputing the reference log-probabilities" in capsys.readouterr().out
    logged_live, logged_pre = read_metrics(live), read_metrics(pre)
    assert max(logged["kl"] for logged in logged_live.values()) > 1e-3
    for step in logged_live:
        assert logged_pre[step].keys() == logged_live[step].keys()
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen"):
            if key not in logged_live[step]:  # a step with one label
                continue
            assert logged_pre[step][key] == pytest.approx(logged_live[step][key], rel=1e-5), (
                f"{key} at step {step}"
            )
    val_live, val_pre = read_eval_metrics(live)[3], read_eval_metrics(pre)[3]
    for key in ("val_loss", "val_kl", "val_rewards/chosen", "val_logps/rejected"):
        assert val_pre[key] == pytest.approx(val_live[key], abs=1e-5), key
    assert abs(val_live["val_rewards/chosen"]) > 1e-3  # the adapters have moved the policy


# -- 5. data: formats, sources, bad rows ------------------------------------------------------


def test_paired_rows_split_into_a_desirable_and_an_undesirable_row(world, tmp_path):
    """Each preference pair gives its chosen reply (desirable) then its rejected reply
    (undesirable), with the very tokens the preference dataset gives the pair."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in preference_rows(4, task="add")))
    tokenizer = Tokenizer.from_pretrained(world["model"])
    rated = UnpairedDataset(tokenizer, source=str(pairs), format="paired_messages", max_seq_len=256)
    paired = pair_dataset(world["model"], pairs)
    assert rated.labels == [True, False] * 4 and rated.row_indices == [0, 0, 1, 1, 2, 2, 3, 3]
    for i in range(4):
        for side, j in (("chosen", 2 * i), ("rejected", 2 * i + 1)):
            assert rated[j]["input_ids"] == paired[i][f"{side}_input_ids"]
            assert rated[j]["labels"] == paired[i][f"{side}_labels"]


def test_csv_parquet_and_jsonl_give_the_same_rows(world, tmp_path):
    rows = [{"prompt": f"add {i} and 1", "completion": str(i + 1), "label": bool(i % 2)}
            for i in range(4)]  # fmt: skip
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "r.parquet")
    pd.DataFrame(rows).to_csv(tmp_path / "r.csv", index=False)  # labels as True/False text
    tokenizer = Tokenizer.from_pretrained(world["model"])
    built = [UnpairedDataset(tokenizer, source=str(tmp_path / f"r.{ext}")) for ext in
             ("jsonl", "parquet", "csv")]  # fmt: skip
    assert built[0].labels == [False, True, False, True]
    for other in built[1:]:
        assert [other[i] for i in range(4)] == [built[0][i] for i in range(4)]


def test_kl_rows_pair_each_prompt_with_the_previous_completion(world):
    dataset = UnpairedDataset(
        Tokenizer.from_pretrained(world["model"]), source=str(world["rated"]), max_seq_len=256
    )
    samples, n = dataset.samples, len(dataset)
    for i in (0, 1, n - 1):
        prompt, donor = samples[i]["prompt_ids"], samples[(i - 1) % n]
        assert dataset[i]["kl_input_ids"] == prompt + donor["completion_ids"]
        assert dataset[i]["input_ids"] == prompt + samples[i]["completion_ids"]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "hi", "completion": "yo", "label": "maybe"}',
         r"bad row at line 2: wrong_type: column 'label' is 'maybe', expected true or false"),
        ('{"prompt": "hi", "completion": "yo"}',
         r"bad row at line 2: missing_field: column 'label' is missing or null"),
        ('{"prompt": "hi", "completion": "", "label": true}',
         r"bad row at line 2: empty_assistant_turn"),
        ('{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "user", '
         '"content": "yo"}], "label": true}', r"bad row at line 2: "),
    ],
)  # fmt: skip
def test_bad_rows_name_the_file_and_line(world, tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "hi", "completion": "yo", "label": True})
    path.write_text(f"{good}\n{line}\n")
    tokenizer = Tokenizer.from_pretrained(world["model"])
    with pytest.raises(BadRowError, match=rf"bad\.jsonl: {message}"):
        UnpairedDataset(tokenizer, source=str(path))
    skipped = UnpairedDataset(tokenizer, source=str(path), on_bad_row="skip")
    assert len(skipped) == 1 and sum(skipped.report.skipped.values()) == 1


def test_missing_column_is_named(world, tmp_path):
    path = tmp_path / "nolabel.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "completion": "yo"}) + "\n")
    with pytest.raises(ValueError, match=r"format 'prompt_completion' needs column 'label'"):
        UnpairedDataset(Tokenizer.from_pretrained(world["model"]), source=str(path))


def test_shuffled_labels_keep_their_rows(world):
    """``label_counts`` of a split: the labels of the rows the split kept."""
    from torch.utils.data import Subset

    from tunesmith.data.unpaired_dataset import label_counts

    dataset = UnpairedDataset(
        Tokenizer.from_pretrained(world["model"]), source=str(world["skewed"]), max_seq_len=256
    )
    picked = random.Random(0).sample(range(len(dataset)), 5)
    labels = [dataset.labels[i] for i in picked]
    assert label_counts(Subset(dataset, picked)) == (sum(labels), 5 - sum(labels))
    assert label_counts(dataset) == (8, 4)
