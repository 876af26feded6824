"""KTO's first step equals TRL's ``KTOTrainer`` (issue #36): the same tiny model folder, a
second model as the reference (so the rewards and the KL estimate are not the trivial zeros of
a reference equal to the policy), the same raw-text rated completions in one batch; the logged
loss, KL estimate, rewards, log-probs and the gradient norm before the first update agree to
float32 rounding.

TRL pairs each row's prompt with the completion of the row before it within a batch of
``per_device_train_batch_size`` rows; with one batch of the whole dataset that is tunesmith's
pairing by dataset index (row ``i`` with row ``i - 1 mod N``). Raw text: both append EOS to
the completion and tokenise ``prompt + completion`` as one text; the completions start with a
space, so no token straddles the boundary and both split the ids at the same place. TRL's
configs default to bf16 autocast; it is turned off here (the recipe runs float32).
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import transformers
import trl  # a dev dependency (pyproject), as a reference only

from tests.recipes.sft_world import make_model_dir, read_metrics, run_recipe

ROWS = [  # raw text, two labels, completions of different lengths
    {"prompt": "add 3 and 4:", "completion": " 7", "label": True},
    {"prompt": "add 4 and 5:", "completion": " 4 or so", "label": False},
    {"prompt": "add 2 and 2:", "completion": " 4", "label": True},
    {"prompt": "add 6 and 1:", "completion": " 8 8", "label": False},
    {"prompt": "add 1 and 1:", "completion": " 2", "label": True},
]
SAME_METRICS = (  # the same names in both
    "loss", "grad_norm", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins",
    "logps/chosen", "logps/rejected",
)  # fmt: skip
CASES = {  # id -> KTOLoss / KTOConfig settings (the same names in both)
    "kto": {"beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0},
    "weighted": {"beta": 0.5, "desirable_weight": 0.8, "undesirable_weight": 1.2},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_kto")
    data = root / "rated.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return {
        "model": make_model_dir(root / "policy"),
        "reference": make_model_dir(root / "reference", seed=3),
        "data": data,
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_step_equals_trl_kto_trainer(world, tmp_path, case):
    settings = CASES[case]
    loss = ", ".join(f"{k}: {v}" for k, v in settings.items())
    reference = (
        f"{{_component_: tunesmith.models.from_hf, path: {world['reference']}, dtype: float32}}"
    )
    overrides = [
        "max_steps=1", f"batch_size={len(ROWS)}", "shuffle=false",
        "dataset.use_chat_template=false", f"reference_model={reference}",
        f"loss={{_component_: tunesmith.modules.losses.KTOLoss, {loss}}}",
    ]  # fmt: skip
    out = run_recipe("kto", "tiny", world["model"], world["data"], tmp_path / "ours", *overrides)
    ours = read_metrics(out)[1]
    theirs = _trl_first_step(world, tmp_path / "trl", settings)
    assert theirs["kl"] > 1e-3  # a real reference: the KL estimate is not clamped to zero
    assert min(abs(theirs["rewards/chosen"]), abs(theirs["rewards/rejected"])) > 1e-3
    assert ours["count/chosen"] == 3 and ours["count/rejected"] == 2
    for name in SAME_METRICS:
        assert ours[name] == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), name


def _trl_first_step(world, output_dir, settings) -> dict[str, float]:
    """TRL's logged metrics of its first step over all of ``ROWS`` in one batch, float32."""

    def load(key):
        return transformers.AutoModelForCausalLM.from_pretrained(world[key], dtype=torch.float32)

    args = trl.KTOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=len(ROWS), max_steps=1,
        learning_rate=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, seed=0, **settings,
    )  # fmt: skip
    trainer = trl.KTOTrainer(
        model=load("model"),
        ref_model=load("reference"),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=transformers.AutoTokenizer.from_pretrained(world["model"]),
    )
    trainer.train()
    return trainer.state.log_history[0]
