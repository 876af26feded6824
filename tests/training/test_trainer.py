"""A toy recipe (not shipped) on the Trainer: an objective, a batch source that makes batches
on the fly from a seeded generator, and a short loop; exact resume, hooks, train/eval mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from tunesmith.models.builder import build_model
from tunesmith.models.spec import ModelSpec
from tunesmith.training.parallel.distributed import DistributedContext
from tunesmith.training.sources import BatchSource
from tunesmith.training.trainer import LossOutput, Trainer

CTX = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), mesh=None)
SPEC = ModelSpec(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


class RandomTokens:
    """Batches made on the fly: ``accum`` micro-batches of random token ids per step, drawn
    from a seeded generator whose state is the source's state."""

    def __init__(self, seed: int = 0, accum: int = 2, batch_size: int = 2, length: int = 8):
        self.generator = torch.Generator().manual_seed(seed)
        self.accum, self.batch_size, self.length = accum, batch_size, length
        self.epoch = 0

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        return [self._batch() for _ in range(self.accum)]

    def _batch(self) -> dict[str, torch.Tensor]:
        ids = torch.randint(
            0, SPEC.vocab_size, (self.batch_size, self.length), generator=self.generator
        )
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


class NextToken:
    """Next-token cross-entropy summed over the predicted tokens; records the model's mode."""

    unit = "tokens"

    def __init__(self) -> None:
        self.modes: list[bool] = []

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["input_ids"][:, 1:].numel()

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> LossOutput:
        self.modes.append(model.training)
        logits = model(batch["input_ids"])[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            batch["input_ids"][:, 1:].reshape(-1),
            reduction="sum",
        )
        return LossOutput(loss)


def config(out: Path, **overrides: Any):
    return OmegaConf.create(
        {
            "output_dir": str(out),
            "seed": 0,
            "batch_size": 2,
            "max_steps": 6,
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-2},
            "lr_scheduler": {
                "_component_": "tunesmith.training.cosine_with_warmup",
                "num_warmup_steps": 2,
            },
            "max_grad_norm": 1.0,
            **overrides,
        }
    )


def toy_recipe(out: Path, stop_at: int | None = None, **overrides: Any) -> Trainer:
    """The whole recipe: model, objective, source, and the loop an algorithm box would show."""
    torch.manual_seed(0)
    model = build_model(SPEC)
    source = RandomTokens()
    trainer = Trainer.from_config(
        config(out, **overrides), CTX, model=model, objective=NextToken(), source=source
    )
    trainer.start()
    while not trainer.done:
        trainer.step(source.next_step())
        if trainer.progress["step"] == stop_at:
            trainer.save()
            break
    return trainer


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_toy_source_is_a_batch_source():
    assert isinstance(RandomTokens(), BatchSource)


def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path):
    whole = weights(toy_recipe(tmp_path / "whole"))
    toy_recipe(tmp_path / "split", stop_at=3)
    torch.manual_seed(123)  # the checkpoint's RNG state wins over whatever came before
    resumed = toy_recipe(tmp_path / "split", resume=True)
    assert resumed.progress["step"] == 6
    assert resumed.last_checkpoint.name == "step_000003"
    after = weights(resumed)
    assert after.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(after[name], tensor), name


def test_load_restores_a_new_trainer_at_the_saved_step(tmp_path):
    path = toy_recipe(tmp_path / "a", stop_at=2).last_checkpoint
    source = RandomTokens(seed=99)  # another position: load puts it back
    trainer = Trainer.from_config(
        config(tmp_path / "b"), CTX, model=build_model(SPEC), objective=NextToken(), source=source
    )
    trainer.load(path)
    assert trainer.progress["step"] == 2
    reference = RandomTokens()
    reference.next_step(), reference.next_step()
    assert torch.equal(source.next_step()[0]["input_ids"], reference.next_step()[0]["input_ids"])


def test_hooks_see_each_step_and_the_step_trains_in_train_mode(tmp_path):
    torch.manual_seed(0)
    model, objective, source = build_model(SPEC), NextToken(), RandomTokens()
    seen: list[tuple[int, dict[str, float]]] = []

    def generate_in_eval_mode(trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        seen.append((step, metrics))
        trainer.model.eval()  # as an RL step generates between updates

    trainer = Trainer.from_config(
        config(tmp_path, max_steps=3),
        CTX,
        model=model,
        objective=objective,
        source=source,
        on_step_end=[generate_in_eval_mode],
    )
    returned = [trainer.step(source.next_step()) for _ in range(3)]
    assert [step for step, _ in seen] == [1, 2, 3]
    assert [metrics for _, metrics in seen] == returned
    assert set(returned[0]) >= {"loss", "lr", "grad_norm", "tokens_seen", "tokens"}
    assert returned[0]["tokens"] == 2 * 2 * 7
    assert objective.modes == [True] * 6  # every micro-batch in train mode
    assert not model.training  # the hook's eval mode stays until the next step

    val = [RandomTokens(seed=5)._batch() for _ in range(3)]
    metrics = trainer.evaluate(val, collate=lambda items: items[0])
    assert set(metrics) == {"val_loss"} and objective.modes[-1] is False
    assert not model.training  # evaluate restores the mode it found
    model.train()
    trainer.evaluate(val, collate=lambda items: items[0])
    assert model.training


def test_a_source_without_epochs_needs_max_steps(tmp_path):
    with pytest.raises(ValueError, match="max_steps"):
        Trainer.from_config(
            config(tmp_path, max_steps=None),
            CTX,
            model=build_model(SPEC),
            objective=NextToken(),
            source=RandomTokens(),
        )
