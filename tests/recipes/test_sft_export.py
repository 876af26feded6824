"""A checkpoint the recipe writes is a Hugging Face folder: ``transformers`` loads it as is (no
missing or unexpected weights) and gives the same logits as our model loaded from the same
folder (fp32), and the weights in it are the trained ones."""

from __future__ import annotations

import torch
import transformers

from tests.recipes.sft_world import (
    checkpoint_weights,
    checkpoints,
    make_chat_data,
    make_model_dir,
    run_sft,
)
from tunesmith.data import SFTDataset, Tokenizer, collate_padded
from tunesmith.models import from_hf


def test_exported_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    model_dir = make_model_dir(tmp_path)
    data = make_chat_data(tmp_path / "chat.jsonl", rows=16)
    out = run_sft(model_dir, data, tmp_path / "out", "max_steps=3")
    step_dir = checkpoints(out)[-1]
    assert step_dir.name == "step_000003"

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        step_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    ours = from_hf(step_dir, dtype=torch.float32)
    hf.eval()
    ours.eval()

    tokenizer = Tokenizer.from_pretrained(step_dir)  # the tokenizer was exported too
    samples = SFTDataset(tokenizer, source=str(data)).samples[:3]
    batch = collate_padded(samples, pad_id=tokenizer.pad_id)
    noise = torch.randint(
        0,
        hf.config.vocab_size,
        (2, batch["input_ids"].shape[1]),
        generator=torch.Generator().manual_seed(0),
    )
    ids = torch.cat([batch["input_ids"], noise])  # real conversations and random tokens
    with torch.no_grad():
        expected = hf(ids).logits
        logits = ours(ids)
    assert logits.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    trained, initial = checkpoint_weights(step_dir), checkpoint_weights(model_dir)
    assert trained.keys() == initial.keys()
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-3
    for name, tensor in hf.state_dict().items():
        if name in trained:
            assert torch.equal(tensor, trained[name]), name
