"""Sizes in a config.json (and a ModelSpec) are checked against generous limits before
anything is built: a hostile ``num_hidden_layers: 10000000`` is one line naming the file, the
key and the limit, while every shipped size of every family passes."""

from __future__ import annotations

import json

import pytest

from tunesmith.models import llama3, mistral, qwen2_5, qwen3, qwen3_moe
from tunesmith.models.hf import spec_from_hf_folder
from tunesmith.models.spec import SIZE_LIMITS, ModelSpec, check_sizes

FAMILIES = (llama3, mistral, qwen2_5, qwen3, qwen3_moe)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.__name__.rsplit(".", 1)[-1])
def test_every_shipped_size_is_within_the_limits(family):
    for size in family.SIZES:
        spec = family.spec(size)
        check_sizes(spec.to_hf_config())


@pytest.mark.parametrize("key", sorted(SIZE_LIMITS))
def test_a_size_over_its_limit_is_refused_naming_the_key(key):
    high = SIZE_LIMITS[key][1]
    with pytest.raises(ValueError, match=rf"^{key} = {high + 1} is over the limit {high} "):
        check_sizes({key: high + 1})
    check_sizes({key: high})


@pytest.mark.parametrize("value", [True, 1.5, "12", [4]])
def test_a_size_that_is_not_an_integer_is_refused(value):
    with pytest.raises(ValueError, match="num_hidden_layers must be an integer"):
        check_sizes({"num_hidden_layers": value})


def test_under_the_minimum_is_refused():
    with pytest.raises(ValueError, match="vocab_size = 0 is under the minimum 1"):
        check_sizes({"vocab_size": 0})


def test_a_spec_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match="num_hidden_layers = 10000000 is over the limit 1024"):
        qwen2_5.spec("qwen2_5_tiny", num_hidden_layers=10_000_000)
    assert isinstance(qwen2_5.spec("qwen2_5_tiny"), ModelSpec)


def test_config_json_error_names_the_file_key_and_limit(tmp_path):
    config = qwen2_5.spec("qwen2_5_tiny").to_hf_config()
    config["num_hidden_layers"] = 10_000_000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        spec_from_hf_folder(tmp_path)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: num_hidden_layers = 10000000")
    assert "limit 1024" in message and "\n" not in message


def test_a_model_larger_than_the_memory_is_not_built(tmp_path):
    """Within every limit, yet 10^13 parameters: refused before a byte is allocated."""
    from tunesmith.models.hf import from_hf

    config = qwen2_5.spec("qwen2_5_tiny").to_hf_config()
    config.update(
        num_hidden_layers=1024,
        hidden_size=65536,
        intermediate_size=2**18,
        num_attention_heads=512,
        num_key_value_heads=64,
        head_dim=128,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"config\.json: the model has about .* parameters .* "
        r"more than the .* GiB of memory of cpu",
    ):
        from_hf(tmp_path, load_weights=False, device="cpu")
    assert qwen2_5.spec("qwen2_5_tiny").approx_parameters() < 10**6
