"""File cases: symbolic links planted in a run's folders or a model folder, checkpoint manifests
that lie, devices and FIFOs in a checkpoint, a full disk under ``metrics.jsonl``, and secret
values (``${oc.env:...}``) in the errors a run logs.

* :data:`SAFETY`: group ``safety``. Kind ``symlink``: a link planted where the run writes (its
  lock, ``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, a step folder, ``logs/``, a Ray
  trainer group's ``rank<N>.log``, ``console.log``, ``driver.log``) or in the model folder
  whose files every checkpoint copies; each is a refused attempt to write or read through the
  link (``test_file_safety.py`` and ``test_trainer_group_files.py`` show the target would be
  reached, then that it is untouched). Kind ``hardlink``: a hard link planted as a file the
  run appends to or writes in place (:data:`HARD_LINKS`; a model folder's hard links are read
  as its files). Kind ``secret``: a value read from the environment that ends up in a rank's
  error is written to no log.
* :data:`BAD_INPUTS`: group ``bad_input`` (kinds ``manifest`` and ``device``): checkpoints
  whose ``COMPLETE`` manifest leaves a file out, lists a file outside the folder or a device,
  or whose files are a FIFO or a link; ``resume=true`` refuses each with one line naming the
  file, through the bad-input test of ``test_bad_inputs.py`` (nothing written).
* :data:`FAULTS`: group ``fault``, kind ``disk_full_log``: the disk under ``metrics.jsonl``
  fills up.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tests.faults.kit import REFUSED, BadInput, Case, Setup, World, reseal, resume_copy

__all__ = ["BAD_INPUTS", "CASES", "FAULTS", "HARD_LINKS", "SAFETY", "SECRET_ENV", "TRAINER_GROUP"]

SECRET_ENV = "TUNESMITH_TEST_SECRET"  # what the secret cases put in the environment

_NOT_THROUGH = "refused with one line naming the link and its target; the target unchanged"

_NOT_HARD = (
    "refused with one line naming the file ('is a hard link (the file has 2 names)'); the other "
    "file unchanged"
)

HARD_LINKS: list[Case] = [
    Case(
        "hardlink-metrics-jsonl",
        "safety",
        "hardlink",
        "output_dir/metrics.jsonl is a hard link to a file of the user's (records would be "
        "appended to it: a no-follow open does not see a hard link)",
        _NOT_HARD,
    ),
    Case(
        "hardlink-run-lock",
        "safety",
        "hardlink",
        "output_dir/.tunesmith.lock is a hard link to a file of the user's (the lock's JSON "
        "would be written into it)",
        _NOT_HARD,
    ),
    Case(
        "hardlink-config-yaml",
        "safety",
        "hardlink",
        "output_dir/config.yaml is a hard link to a file of the user's (it would be truncated "
        "and overwritten in place)",
        _NOT_HARD,
    ),
]
"""Hard links planted where a run appends or writes in place (``test_file_safety.py``)."""

_GROUP_RUN = "`tunesmith run grpo_async` with `trainer_group.launcher=ray` (2 trainer actors)"
_GROUP_REFUSED = (
    "refused with one line naming the link and its target, by the driver before Ray starts "
    "and by the rank when it opens its log (nothing redirected); the target unchanged"
)

TRAINER_GROUP: list[Case] = [
    Case(
        "symlink-trainer-group-logs-dir",
        "safety",
        "symlink",
        f"{_GROUP_RUN} where output_dir/logs is a symbolic link to a folder outside (the "
        "group's logs used to be written there)",
        "refused by the driver with one line naming the link, before Ray starts; nothing "
        "written in the folder outside",
    ),
    Case(
        "symlink-trainer-group-rank-log",
        "safety",
        "symlink",
        "a trainer group's rank0.log is a symbolic link to a file outside (every line of the "
        "rank, its C++ output and traceback used to be appended to it)",
        _GROUP_REFUSED,
    ),
    Case(
        "symlink-trainer-group-console-log",
        "safety",
        "symlink",
        "a trainer group's console.log is a symbolic link to a file outside (rank 0's console "
        "used to be appended to it, and shown by the driver)",
        _GROUP_REFUSED,
    ),
    Case(
        "symlink-trainer-group-driver-log",
        "safety",
        "symlink",
        "a trainer group's driver.log is a symbolic link to a file outside (Ray's messages used "
        "to be appended to it)",
        "refused by the driver with one line naming the link and its target, before Ray "
        "starts; the target unchanged",
    ),
    Case(
        "hardlink-trainer-group-rank-log",
        "safety",
        "hardlink",
        "a trainer group's rank1.log is a hard link to a file of the user's",
        "refused with one line naming the file, by the driver before Ray starts and by the "
        "rank when it opens its log; the other file unchanged",
    ),
    Case(
        "secret-in-rank-log-trainer-group",
        "safety",
        "secret",
        f"a trainer-group rank (as its actor runs it) whose config reads a token with "
        f"${{oc.env:{SECRET_ENV}}}, prints it and fails naming it",
        "rank0.log (its output, traceback) and console.log hold `${oc.env:...}`, never the "
        "value, and so does its one-line error; shown live with redaction off",
    ),
    Case(
        "secret-in-rank-error-ray",
        "safety",
        "secret",
        f"{_GROUP_RUN} whose prompts.source is ${{oc.env:{SECRET_ENV}}} (a token-like path to "
        "a file whose last line is not JSON, prompts.on_bad_row=error: past the CLI's checks): "
        "the ranks fail with the value in their error",
        "the console line and the failed rank's rank<N>.log (its traceback) hold "
        "`${oc.env:...}`; no file of the run (every rank's log, console.log, driver.log) holds "
        "the value",
        ci=False,
    ),
]
"""A Ray trainer group's logs (``test_trainer_group_files.py``)."""

SAFETY: list[Case] = [
    Case(
        "symlink-run-lock",
        "safety",
        "symlink",
        "output_dir/.tunesmith.lock is a symbolic link to a file outside (it used to be "
        "truncated and overwritten with the lock's JSON)",
        _NOT_THROUGH,
    ),
    Case(
        "symlink-config-yaml",
        "safety",
        "symlink",
        "output_dir/config.yaml is a symbolic link to a file outside (it used to be overwritten "
        "with the run's config)",
        _NOT_THROUGH,
    ),
    Case(
        "symlink-metrics-jsonl",
        "safety",
        "symlink",
        "output_dir/metrics.jsonl is a symbolic link to a file outside (records used to be "
        "appended to it)",
        _NOT_THROUGH,
    ),
    Case(
        "symlink-checkpoints-dir",
        "safety",
        "symlink",
        "output_dir/checkpoints is a symbolic link to a folder outside (checkpoints used to be "
        "written there)",
        "refused with one line naming the link; nothing written in the folder outside",
    ),
    Case(
        "symlink-step-folder",
        "safety",
        "symlink",
        "`resume=true` where checkpoints/step_000002 is a symbolic link to a good checkpoint "
        "outside (it used to be resumed from)",
        "refused with one line naming the link: no usable checkpoint; nothing resumed",
    ),
    Case(
        "symlink-logs-dir-torchrun",
        "safety",
        "symlink",
        "`--nproc-per-node 2` where output_dir/logs is a symbolic link to a folder outside (the "
        "torchrun log used to be written there)",
        "refused by the CLI with one line naming the link, before torchrun starts; nothing "
        "written in the folder outside",
    ),
    Case(
        "symlink-model-file-outside",
        "safety",
        "symlink",
        "the model folder's vocab.txt is a symbolic link to a file outside it (its content used "
        "to be copied into every checkpoint)",
        "refused before training with one line naming the link and its target; no checkpoint "
        "holds the file",
    ),
    Case(
        "symlink-model-dir-outside",
        "safety",
        "symlink",
        "the model folder's additional_chat_templates is a symbolic link to a folder outside it "
        "(the folder used to be copied into every checkpoint)",
        "refused before training with one line naming the link and its target",
    ),
    Case(
        "secret-in-error-line",
        "safety",
        "secret",
        f"dataset.source=${{oc.env:{SECRET_ENV}}} whose value (a token-like path) does not exist: "
        "the error names the value",
        "the `tunesmith: error:` line shows `${oc.env:...}`, never the value",
    ),
    Case(
        "secret-in-rank-error-torchrun",
        "safety",
        "secret",
        "`--nproc-per-node 2` whose dataset.source is ${oc.env:...} (a token-like path to a "
        "file whose last line is not JSON, dataset.on_bad_row=error: past the CLI's checks): "
        "both ranks fail with the value in their error",
        "the console lines, logs/torchrun-*.log (every rank's traceback, torchrun's summary) "
        "hold `${oc.env:...}`, never the value",
        ci=False,
    ),
    *HARD_LINKS,
    *TRAINER_GROUP,
]

FAULTS: list[Case] = [
    Case(
        "disk-full-metrics-jsonl",
        "fault",
        "disk_full_log",
        "the filesystem of metrics.jsonl (a resumed run's, 3.9 kB of earlier records) is full: "
        "the next record does not fit (an 8 kB tmpfs; RLIMIT_FSIZE where mounting is not "
        "permitted)",
        "exit 1 with one line naming metrics.jsonl and 'disk full' (or 'file too large'); the "
        "earlier records kept byte for byte, no half record",
    ),
]


# ----------------------------------------------------------------------------- bad inputs


def _manifest(step: Path) -> dict:
    return json.loads((step / "COMPLETE").read_text())


def _write_manifest(step: Path, manifest: dict) -> None:
    (step / "COMPLETE").write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-9] ^= 0xFF
    path.write_bytes(bytes(data))


def _omits_weights(world: World) -> Setup:
    """The manifest leaves model.safetensors out, and one byte of it is flipped."""
    step = resume_copy(world)
    manifest = _manifest(step)
    del manifest["files"]["model.safetensors"]
    _write_manifest(step, manifest)
    _flip_byte(step / "model.safetensors")
    return Setup(["resume=true"], [f"{step / 'model.safetensors'}: not listed in the COMPLETE"])


def _unlisted_file(world: World) -> Setup:
    step = resume_copy(world)
    (step / "training_state" / "notes.txt").write_text("added later\n")
    return Setup(["resume=true"], [f"{step / 'training_state' / 'notes.txt'}: not listed"])


def _entry(world: World, rel: str) -> Setup:
    """The manifest lists ``rel`` (recorded with the size and hash of what it names)."""
    from tunesmith.models.manifest import HASH

    step = resume_copy(world)
    manifest = _manifest(step)
    target = Path(rel) if rel.startswith("/") else step / rel
    info = {"size": 0, HASH: "00000000"}
    if target.is_file() and target.stat().st_size < 1 << 20:
        import zlib

        info = {"size": target.stat().st_size, HASH: f"{zlib.crc32(target.read_bytes()):08x}"}
    manifest["files"][rel] = info
    _write_manifest(step, manifest)
    return Setup(["resume=true"], [str(step / "COMPLETE"), repr(rel), "not a path inside"])


def _dotdot_entry(world: World) -> Setup:
    outside = world.tmp / "outside.txt"
    outside.write_text("not part of the checkpoint\n")
    rel = os.path.relpath(outside, world.out / "checkpoints" / "step_000001")
    return _entry(world, rel)


def _fifo_file(world: World) -> Setup:
    """training_state/rank0.pt replaced by a FIFO, the manifest recording it as empty."""
    from tunesmith.models.manifest import HASH

    step = resume_copy(world)
    rank0 = step / "training_state" / "rank0.pt"
    rank0.unlink()
    os.mkfifo(rank0)
    manifest = _manifest(step)
    manifest["files"]["training_state/rank0.pt"] = {"size": 0, HASH: "00000000"}
    _write_manifest(step, manifest)
    return Setup(["resume=true"], [f"{rank0}: is a FIFO"])


def _symlinked_file(world: World) -> Setup:
    """model.safetensors replaced by a link to a copy outside (the manifest resealed for it)."""
    step = resume_copy(world)
    weights = step / "model.safetensors"
    outside = Path(shutil.copy(weights, world.tmp / "other.safetensors"))
    weights.unlink()
    reseal(step)  # lists every regular file (the link is not one)
    manifest = _manifest(step)
    from tunesmith.models.manifest import file_entry

    manifest["files"]["model.safetensors"] = file_entry(outside)
    _write_manifest(step, manifest)
    os.symlink(outside, weights)
    return Setup(["resume=true"], [f"{weights}: is a symbolic link (to {outside})"])


BAD_INPUTS: list[BadInput] = [
    BadInput(
        "manifest-omits-weights",
        "manifest",
        "`resume=true` on a checkpoint whose COMPLETE manifest leaves out model.safetensors, "
        "one byte of which is flipped (the check used to be skipped: it loaded silently)",
        REFUSED.format("model.safetensors: not listed in the COMPLETE manifest"),
        _omits_weights,
    ),
    BadInput(
        "manifest-unlisted-file",
        "manifest",
        "`resume=true` on a checkpoint holding a file its manifest does not list",
        REFUSED.format("the unlisted file"),
        _unlisted_file,
    ),
    BadInput(
        "manifest-dotdot-entry",
        "manifest",
        "`resume=true` on a checkpoint whose manifest lists `../../../outside.txt` (it used to "
        "be read and hashed outside the folder)",
        REFUSED.format("the manifest and the entry"),
        _dotdot_entry,
    ),
    BadInput(
        "manifest-absolute-entry",
        "manifest",
        "`resume=true` on a checkpoint whose manifest lists `/etc/hostname`",
        REFUSED.format("the manifest and the entry"),
        lambda world: _entry(world, "/etc/hostname"),
    ),
    BadInput(
        "manifest-dev-zero-entry",
        "device",
        "`resume=true` on a checkpoint whose manifest lists `/dev/zero` with size 0 (hashing it "
        "used to hang the resume forever)",
        REFUSED.format("the manifest and the entry, within seconds"),
        lambda world: _entry(world, "/dev/zero"),
    ),
    BadInput(
        "checkpoint-file-is-fifo",
        "device",
        "`resume=true` on a checkpoint whose training_state/rank0.pt is a FIFO, listed with size "
        "0 (opening it used to block forever)",
        REFUSED.format("the FIFO, within seconds"),
        _fifo_file,
    ),
    BadInput(
        "checkpoint-file-is-symlink",
        "manifest",
        "`resume=true` on a checkpoint whose model.safetensors is a symbolic link to weights "
        "outside, the manifest resealed to match them",
        REFUSED.format("the link and its target"),
        _symlinked_file,
    ),
]

CASES: list[Case] = [*SAFETY, *FAULTS]
