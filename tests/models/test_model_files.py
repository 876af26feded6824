"""Files copied from a model folder into checkpoints, and what a checkpoint manifest may say.

A checkpoint copies only the known files of a model folder (tokenizer files, the generation
config); a symbolic link among them is copied as its file when it stays inside the folder (or
is the Hugging Face cache's blob), refused with one line naming it and its target when it
leaves. A ``COMPLETE`` manifest must list every file of its folder, each a regular file inside
it (no absolute path, no ``..``, no link, FIFO or device)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tunesmith.models.atomic import UnsafePathError
from tunesmith.models.hf import TOKENIZER_FILES, check_model_files, copy_model_files
from tunesmith.models.manifest import MARKER, entry_problem, manifest_problem, unlisted_problem
from tunesmith.training import CheckpointDirectory


@pytest.fixture
def model(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "secret-notes.txt").write_text("not a model file\n")  # never copied
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool.jinja").write_text("{{ x }}")
    return folder


def _copy(model: Path, tmp_path: Path) -> list[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return sorted(p.name for p in copy_model_files(model, out, TOKENIZER_FILES))


def test_only_known_files_are_copied(model, tmp_path):
    assert _copy(model, tmp_path) == ["additional_chat_templates", "tokenizer.json"]
    assert not (tmp_path / "out" / "secret-notes.txt").exists()
    assert (tmp_path / "out" / "additional_chat_templates" / "tool.jinja").read_text() == "{{ x }}"


def test_a_link_inside_the_folder_is_copied_as_its_file(model, tmp_path):
    os.symlink("tokenizer.json", model / "vocab.json")
    assert "vocab.json" in _copy(model, tmp_path)
    copied = tmp_path / "out" / "vocab.json"
    assert not copied.is_symlink() and copied.read_text() == '{"model": {}}'


@pytest.mark.parametrize("name", ["vocab.txt", "tokenizer_config.json"])
def test_a_link_to_a_file_outside_is_refused(model, tmp_path, name):
    outside = tmp_path / "id_rsa"
    outside.write_text("private\n")
    os.symlink(outside, model / name)
    says = f"{model / name}: is a symbolic link to {outside}, outside the model folder"
    with pytest.raises(UnsafePathError, match=says):
        check_model_files(model)
    with pytest.raises(UnsafePathError, match=says):
        _copy(model, tmp_path)
    assert not (tmp_path / "out" / name).exists()


def test_a_link_to_a_folder_outside_is_refused(model, tmp_path):
    (model / "additional_chat_templates" / "tool.jinja").unlink()
    (model / "additional_chat_templates").rmdir()
    os.symlink(tmp_path, model / "additional_chat_templates")
    with pytest.raises(UnsafePathError, match="additional_chat_templates: is a symbolic link"):
        check_model_files(model)
    inner = model / "x"
    inner.mkdir()
    os.symlink("x", model / "chat_template.jinja")  # a link to a folder inside: refused too
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        copy_model_files(model, tmp_path, ["chat_template.jinja"])


def test_a_link_in_a_copied_folder_that_leaves_is_refused(model, tmp_path):
    os.symlink("/etc/hostname", model / "additional_chat_templates" / "evil.jinja")
    with pytest.raises(UnsafePathError, match="evil.jinja: is a symbolic link to /etc/hostname"):
        check_model_files(model)
    with pytest.raises(UnsafePathError, match="evil.jinja"):
        _copy(model, tmp_path)


def test_a_fifo_is_refused_without_blocking(model, tmp_path):
    os.mkfifo(model / "merges.txt")
    with pytest.raises(UnsafePathError, match="merges.txt: is a FIFO"):
        _copy(model, tmp_path)


def test_the_hugging_face_cache_layout_is_accepted(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (blobs / "f00d").write_text('{"model": {}}')
    os.symlink("../../blobs/f00d", snapshot / "tokenizer.json")
    check_model_files(snapshot)
    assert _copy(snapshot, tmp_path) == ["tokenizer.json"]
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'


# ----------------------------------------------------------------------------- manifests


def _checkpoint(tmp_path: Path) -> Path:
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(b"w" * 64)
        (d / "state").mkdir()
        (d / "state" / "rank0.pt").write_bytes(b"s" * 32)

    return CheckpointDirectory(tmp_path / "ckpts").write(1, write)


def _edit(path: Path, change) -> None:
    manifest = json.loads((path / MARKER).read_text())
    change(manifest["files"])
    (path / MARKER).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "rel", ["/etc/passwd", "../x", "state/../../x", "./model.safetensors", "a//b", "", "a\\b"]
)
def test_entries_outside_the_folder_are_refused(tmp_path, rel):
    assert "is not a path inside the checkpoint" in entry_problem(tmp_path, rel)


def test_every_file_must_be_listed(tmp_path):
    path = _checkpoint(tmp_path)
    assert manifest_problem(path) is None
    _edit(path, lambda files: files.pop("model.safetensors"))
    problem = manifest_problem(path, only=["config.json"])  # also when hashing only some
    assert problem.startswith(f"{path / 'model.safetensors'}: not listed in the {MARKER}")
    assert unlisted_problem(path, ["model.safetensors", "state/rank0.pt"]) is None


def test_links_fifos_and_linked_folders_in_a_checkpoint_are_refused(tmp_path):
    path = _checkpoint(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "rank0.pt").write_bytes(b"s" * 32)
    (path / "state" / "rank0.pt").unlink()
    (path / "state").rmdir()
    os.symlink(outside, path / "state")  # the folder on the way is a link
    assert "state: is a symbolic link" in CheckpointDirectory.problem(path)
    (path / "state").unlink()
    (path / "state").mkdir()
    os.mkfifo(path / "state" / "rank0.pt")
    assert "rank0.pt: is a FIFO" in CheckpointDirectory.problem(path)


def test_a_manifest_that_is_a_fifo_or_a_link_is_refused(tmp_path):
    path = _checkpoint(tmp_path)
    real = tmp_path / "complete.json"
    real.write_bytes((path / MARKER).read_bytes())
    (path / MARKER).unlink()
    os.symlink(real, path / MARKER)
    assert "COMPLETE: is a symbolic link" in CheckpointDirectory.problem(path)
    (path / MARKER).unlink()
    os.mkfifo(path / MARKER)
    assert "COMPLETE: is a FIFO" in CheckpointDirectory.problem(path)
