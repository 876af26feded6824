"""``from_hf`` of one of our checkpoints checks its files against the ``COMPLETE`` manifest: a
same-size corruption of the weights is an error naming the file, not a model with wrong
numbers; plain HF folders (no manifest) load as before."""

from __future__ import annotations

import json

import pytest
import torch

from tunesmith.models import build_model, from_hf, qwen2_5
from tunesmith.models.hf import write_hf_checkpoint
from tunesmith.models.manifest import MARKER, file_entry, manifest_problem
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.training import CheckpointDirectory


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=300))
    weights = dict(model.state_dict())
    ckpts = CheckpointDirectory(tmp_path / "checkpoints")
    return ckpts.write(1, lambda tmp: write_hf_checkpoint(weights, tmp, spec=model.spec)), model


def _flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x10
    path.write_bytes(bytes(data))


def test_from_hf_verifies_our_checkpoint(checkpoint):
    path, model = checkpoint
    loaded = from_hf(path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    weights = path / "model.safetensors"
    _flip(weights)
    with pytest.raises(CheckpointError, match=f"^{weights}: content differs from the {MARKER}"):
        from_hf(path)
    corrupted = from_hf(path, verify=False)  # what loading without the check would have given
    assert not all(
        torch.equal(a, b) for a, b in zip(corrupted.parameters(), model.parameters(), strict=True)
    )


def test_a_folder_without_manifest_is_not_checked(checkpoint):
    path, _ = checkpoint
    (path / MARKER).unlink()
    _flip(path / "model.safetensors")
    from_hf(path)  # a plain HF folder: nothing to check against


def test_manifest_problem_checks_only_the_files_asked_for(checkpoint):
    path, _ = checkpoint
    (path / "generation_config.json").write_text("{}")
    assert "generation_config.json" in manifest_problem(path)
    assert manifest_problem(path, only=["model.safetensors", "config.json"]) is None
    manifest = json.loads((path / MARKER).read_text())
    entry = file_entry(path / "config.json")
    assert manifest["files"]["config.json"] == entry and len(entry["crc32"]) == 8
