"""`generate` refuses a prompt with as many tokens as the model has positions (it would decode
at positions the model never saw, silently), naming the prompt; shorter prompts decode."""

from __future__ import annotations

import pytest

from tunesmith.generation.generate import generate, model_positions
from tunesmith.models import llama3


@pytest.fixture(scope="module")
def model():
    return llama3.llama3_tiny().eval()


def test_model_positions_reads_the_spec(model):
    assert model_positions(model) == model.spec.max_position_embeddings
    assert model_positions(object()) is None


def test_a_prompt_that_fills_the_positions_is_refused(model):
    positions = model_positions(model)
    with pytest.raises(
        ValueError,
        match=rf"^prompt 1 has {positions} tokens; the model has "
        rf"{positions} positions \(max_position_embeddings\)",
    ):
        generate(model, [[1, 2], [1] * positions], max_new_tokens=1)
    out = generate(model, [[1] * (positions - 1)], max_new_tokens=1)
    assert len(out.sequences[0]) == 1
