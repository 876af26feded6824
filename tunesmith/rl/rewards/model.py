"""Reward-model reward: score ``prompt + completion`` with a trained reward model.

:class:`RewardModelScore` loads a folder written by the ``reward_model`` recipe (a HF
``*ForSequenceClassification`` checkpoint with its tokenizer files) through
:func:`~tunesmith.models.reward.reward_model_from_hf` and
:meth:`~tunesmith.data.Tokenizer.from_pretrained`, and scores each sample's text in batches:
tokenised without adding special tokens (the rendered prompt already holds them), right
padded, read at each row's last real token, in eval mode without gradients. The scores are
the model's raw outputs; normalise them (e.g. by the group advantage) downstream.

The text is re-tokenised from strings, so its ids can differ from the policy's sampled ids
where BPE merges across the prompt/completion boundary. A completion is decoded without its
end-of-turn token; ``suffix`` appends one (e.g. ``"<|im_end|>"``) when the reward model was
trained on turns that end with it.

Example::

    rm = RewardModelScore("out/rm/step_001000", batch_size=16, device="cuda")
    rm([Sample("<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n", "Hello!")])
    # -> [0.83]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tunesmith.config.registry import component
from tunesmith.models.hf import DTypeSetting, HFFolder
from tunesmith.rl.rewards.base import Sample

__all__ = ["RewardModelScore"]


@component
class RewardModelScore:
    """The score a reward model gives ``prompt + completion + suffix``.

    Args:
        model_dir: a reward model folder (checkpoint + tokenizer), as the ``reward_model``
            recipe writes it.
        batch_size: texts per forward pass.
        device: where the model runs.
        dtype: weight dtype (``"bf16"``, ``torch.float32``...); default the checkpoint's.
        suffix: text appended to every completion (see the module docs).
        max_length: keep at most this many tokens of each text, cutting from the left (the
            score is read at the end); None keeps all.

    Example (YAML)::

        preference: {_component_: tunesmith.rl.rewards.RewardModelScore,
                     model_dir: out/rm/step_001000, batch_size: 16, device: cuda}
    """

    name = "reward_model"

    def __init__(
        self,
        model_dir: HFFolder,
        batch_size: int = 8,
        device: str | torch.device = "cpu",
        dtype: DTypeSetting | torch.dtype | None = None,
        suffix: str = "",
        max_length: int | None = None,
        name: str = "reward_model",
    ) -> None:
        from tunesmith.data import Tokenizer
        from tunesmith.models.reward import reward_model_from_hf

        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"RewardModelScore: batch_size must be a positive int, got {batch_size!r}"
            )
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ValueError(
                f"RewardModelScore: max_length must be a positive int, got {max_length!r}"
            )
        self.model_dir = str(model_dir)
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.suffix = suffix
        self.max_length = max_length
        self.name = name
        self.model = reward_model_from_hf(model_dir, dtype=dtype, device=self.device).eval()
        self.model.requires_grad_(False)
        if self.model.num_labels != 1:
            raise ValueError(
                f"RewardModelScore: {model_dir} has {self.model.num_labels} labels; a reward "
                "needs a single-score model"
            )
        self.tokenizer = Tokenizer.from_pretrained(model_dir)
        pad = self.model.spec.pad_token_id if self.model.spec is not None else None
        pad = self.tokenizer.pad_id if pad is None else pad
        self.pad_id = 0 if pad is None else int(pad)

    def encode(self, sample: Sample) -> list[int]:
        """Token ids of one sample's scored text."""
        ids = self.tokenizer.encode(
            sample.prompt + sample.completion + self.suffix, add_special_tokens=False
        )
        if not ids:
            raise ValueError("RewardModelScore: the sample's text is empty; nothing to score")
        return ids if self.max_length is None else ids[-self.max_length :]

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        rows = [self.encode(s) for s in samples]
        scores: list[float] = []
        for start in range(0, len(rows), self.batch_size):
            scores.extend(self._score_batch(rows[start : start + self.batch_size]))
        return scores

    @torch.inference_mode()
    def _score_batch(self, rows: list[list[int]]) -> list[float]:
        length = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            attention_mask[i, : len(row)] = 1
        scores = self.model(
            input_ids.to(self.device), attention_mask=attention_mask.to(self.device)
        )
        return scores[:, 0].float().cpu().tolist()
