"""CPO's first step equals TRL's ``CPOTrainer`` (issue #36): the same tiny model folder, the
same four raw-text pairs, one batch; the logged loss, SFT term, rewards, accuracy and the
gradient norm before the first update agree to float32 rounding.

The chosen responses all have the same number of tokens: TRL averages the SFT term over every
chosen token of its batch, tunesmith over each pair's own tokens (so that accumulation and
data parallelism equal one big batch, see :class:`~tunesmith.modules.losses.CPOLoss`); the two
are equal exactly when the lengths are. TRL's configs default to bf16 autocast; it is turned off
here (the recipe runs float32).
"""

from __future__ import annotations

import json

import datasets
import pytest
import torch
import transformers
from trl.experimental import cpo  # a dev dependency (pyproject), as a reference only

from tests.recipes.sft_world import make_model_dir, read_metrics, run_recipe
from tunesmith.data import Tokenizer

ROWS = [  # raw text: prompt + response, EOS appended by both
    {"prompt": "add 3 and 4:", "chosen": " 7", "rejected": " 9 or so"},
    {"prompt": "add 4 and 5:", "chosen": " 9", "rejected": " 4"},
    {"prompt": "add 2 and 2:", "chosen": " 4", "rejected": " five"},
    {"prompt": "add 6 and 1:", "chosen": " 7", "rejected": " 8 8"},
]
# ours -> TRL's name of the same metric (TRL's logps are length-averaged for ipo and simpo)
SAME_METRICS = {
    "loss": "loss", "nll_loss": "nll_loss", "grad_norm": "grad_norm",
    "rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
    "rewards/margin": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
}  # fmt: skip
CASES = {  # id -> CPOLoss / CPOConfig settings (the same names in both)
    "sigmoid": {"loss_type": "sigmoid", "beta": 0.1, "cpo_alpha": 1.0, "label_smoothing": 0.1},
    "simpo": {"loss_type": "simpo", "beta": 2.0, "cpo_alpha": 0.5, "simpo_gamma": 0.5},
    "ipo": {"loss_type": "ipo", "beta": 0.1, "cpo_alpha": 1.0},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl_cpo")
    model_dir = make_model_dir(root / "policy")
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return {"model": model_dir, "data": data}


def test_the_chosen_responses_have_one_length(world):
    """The premise of the comparison (see the module docstring)."""
    tokenizer = Tokenizer.from_pretrained(world["model"])

    def response_tokens(row):
        whole = tokenizer.encode(row["prompt"] + row["chosen"], add_special_tokens=False)
        return len(whole) - len(tokenizer.encode(row["prompt"], add_special_tokens=False))

    assert len({response_tokens(row) for row in ROWS}) == 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_first_step_equals_trl_cpo_trainer(world, tmp_path, case):
    settings = CASES[case]
    loss = ", ".join(f"{k}: {v}" for k, v in settings.items())
    overrides = [
        "max_steps=1", f"batch_size={len(ROWS)}", "shuffle=false",
        "dataset.format=prompt_chosen_rejected", "dataset.use_chat_template=false",
        f"loss={{_component_: tunesmith.modules.losses.CPOLoss, {loss}}}",
    ]  # fmt: skip
    out = run_recipe("dpo", "tiny", world["model"], world["data"], tmp_path / "ours", *overrides)
    ours = read_metrics(out)[1]
    theirs = _trl_first_step(world, tmp_path / "trl", settings)
    for mine, name in SAME_METRICS.items():
        assert ours[mine] == pytest.approx(theirs[name], rel=1e-5, abs=1e-6), mine


def _trl_first_step(world, output_dir, settings) -> dict[str, float]:
    """TRL's logged metrics of its first step over all of ``ROWS`` in one batch, float32."""
    model = transformers.AutoModelForCausalLM.from_pretrained(world["model"], dtype=torch.float32)
    args = cpo.CPOConfig(
        output_dir=str(output_dir), per_device_train_batch_size=len(ROWS), max_steps=1,
        learning_rate=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, seed=0, **settings,
    )  # fmt: skip
    trainer = cpo.CPOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        processing_class=transformers.AutoTokenizer.from_pretrained(world["model"]),
    )
    trainer.train()
    return trainer.state.log_history[0]
