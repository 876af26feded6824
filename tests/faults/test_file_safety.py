"""Files a run writes or reads are never reached through a planted link, a lying manifest or a
device, through ``tunesmith run`` (``tests/faults/file_cases.py`` lists the cases):

* a symbolic link planted as the run's lock, ``config.yaml``, ``metrics.jsonl``,
  ``checkpoints/``, a step folder or ``logs/``, or in the model folder whose files every
  checkpoint copies: each target is shown to be reachable through the link, the run is
  refused with one line naming the link, and the target is unchanged afterwards;
* a hard link planted as the lock, ``config.yaml`` or ``metrics.jsonl`` (the files a run
  appends to or writes in place): refused with one line naming the file, the other file
  unchanged; a hard-linked file in the model folder is read as its file (the run trains);
* a value read with ``${oc.env:...}`` that ends up in an error (one process, or every rank
  under torchrun) is written to no log and no console line: shown as ``${oc.env:NAME}``;
* a full disk under ``metrics.jsonl``: one line naming the file and 'disk full', the earlier
  records kept byte for byte.

The checkpoint manifest cases run through ``test_bad_inputs.py``; here each one's harm is shown
live (a flipped byte loads silently, ``/dev/zero`` never ends, a FIFO blocks) and bounded.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.faults.catalogue import params
from tests.faults.file_cases import SECRET_ENV
from tests.faults.harness import finish, start_child, with_a_bad_row
from tests.faults.kit import World, resume_copy
from tests.faults.test_disk_full import tmpfs_permitted
from tests.recipes.sft_world import checkpoints, cli_command, sft_overrides, subprocess_env
from tunesmith.cli.main import main
from tunesmith.config import secrets
from tunesmith.training import CheckpointDirectory

CASES = {
    p.id: p
    for p in [
        *params("safety", "symlink"),
        *params("safety", "hardlink"),
        *params("safety", "secret"),
    ]
}
_LINK = "is a symbolic link"
_REFUSAL = "tunesmith does not write or read through links inside its own folders"
_HARD = "tunesmith does not write to hard-linked files inside its own folders"


def _run(
    capsys,
    world,
    out: Path,
    *overrides: str,
    flags: tuple[str, ...] = (),
    model_dir: Path | None = None,
    data: str | None = None,
) -> tuple[int, str]:
    argv = [*flags, "run", "sft", "--config", "tiny", f"model_dir={model_dir or world.model_dir}",
            f"dataset.source={data or world.chat}", f"output_dir={out}", "max_steps=2",
            "progress_bar=false", *overrides]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _refused(code: int, err: str, *words: str) -> str:
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("tunesmith: error: ")]
    assert len(errors) == 1, err
    for word in words:
        assert word in errors[0], f"{word!r} not in {errors[0]}"
    return errors[0]


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file outside the run that a planted link points at; it must never change."""
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


def _reachable(link: Path, target: Path) -> None:
    """The payload is live: a plain open of ``link`` reaches ``target``."""
    assert link.is_symlink() and link.resolve() == target.resolve()
    if target.is_file():
        with open(link) as f:  # what the writers used to do (with "w" or "a")
            assert f.read() == target.read_text()


def _shown(text: str, tmp: Path) -> str:
    return text.replace(str(tmp), "<case>")


# ----------------------------------------------------------------------------- run folders

_RUN_FILES = {
    "symlink-run-lock": ".tunesmith.lock",
    "symlink-config-yaml": "config.yaml",
    "symlink-metrics-jsonl": "metrics.jsonl",
    "hardlink-run-lock": ".tunesmith.lock",
    "hardlink-config-yaml": "config.yaml",
    "hardlink-metrics-jsonl": "metrics.jsonl",
}


def _plant(link: Path, victim: Path, *, hard: bool) -> tuple[str, ...]:
    """``link`` made a symbolic (or a hard) link to ``victim``, shown live; what the refusal
    line must hold."""
    if not hard:
        os.symlink(victim, link)
        _reachable(link, victim)
        return f"{link}: {_LINK} (to {victim})", _REFUSAL
    os.link(victim, link)
    with open(link, "a") as f:  # live: a no-follow open would not see it (no link by name)
        assert os.fstat(f.fileno()).st_ino == os.stat(victim).st_ino
    return f"{link}: is a hard link (the file has 2 names)", _HARD, f"remove {link.name}"


@pytest.mark.parametrize("case", [CASES[name] for name in _RUN_FILES])
def test_a_link_planted_as_a_run_file_is_refused(
    case, fault_world, tmp_path, victim, capsys, outcome
):
    out = tmp_path / "out"
    out.mkdir()
    link = out / _RUN_FILES[case.id]
    says = _plant(link, victim, hard=case.kind == "hardlink")
    code, err = _run(capsys, fault_world, out)
    line = _refused(code, err, *says)
    assert victim.read_text() == "precious\n"
    assert link.is_symlink() if case.kind == "symlink" else os.stat(link).st_nlink == 2
    assert checkpoints(out) == []
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


def test_a_hard_linked_model_file_is_read_as_its_file(fault_world, tmp_path, capsys):
    """Hard links in a model folder (tools that deduplicate identical files make them) are
    read, never refused: reading changes nothing; the checkpoint gets a file of its own."""
    model = Path(shutil.copytree(fault_world.model_dir, tmp_path / "model"))
    shared = tmp_path / "shared-tokenizer.json"
    os.link(model / "tokenizer.json", shared)
    assert os.stat(model / "tokenizer.json").st_nlink == 2
    code, err = _run(capsys, fault_world, tmp_path / "out", model_dir=model)
    assert code == 0, err
    (step,) = checkpoints(tmp_path / "out")
    copied = step / "tokenizer.json"
    assert copied.read_bytes() == shared.read_bytes() and os.stat(copied).st_nlink == 1


@pytest.mark.parametrize("case", [CASES["symlink-checkpoints-dir"]])
def test_a_link_planted_as_the_checkpoint_root_is_refused(
    case, fault_world, tmp_path, capsys, outcome
):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    link = out / "checkpoints"
    os.symlink(elsewhere, link)
    _reachable(link, elsewhere)
    code, err = _run(capsys, fault_world, out)
    line = _refused(code, err, f"{link}: {_LINK} (to {elsewhere})")
    assert list(elsewhere.iterdir()) == []
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


@pytest.mark.parametrize("case", [CASES["symlink-step-folder"]])
def test_a_link_planted_as_a_step_folder_is_not_resumed(
    case, fault_world, tmp_path, capsys, outcome
):
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    target = fault_world.finished / "checkpoints" / "step_000002"
    link = out / "checkpoints" / "step_000002"
    os.symlink(target, link)
    _reachable(link, target)
    assert CheckpointDirectory.problem(link) is None  # a good checkpoint: it would resume
    before = {p: p.stat().st_mtime_ns for p in target.rglob("*")}
    code, err = _run(capsys, fault_world, out, "resume=true")
    line = _refused(code, err, "no usable checkpoint", f"{link}: {_LINK} (to {target})")
    assert {p: p.stat().st_mtime_ns for p in target.rglob("*")} == before
    assert "resumed from" not in capsys.readouterr().out
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


@pytest.mark.parametrize("case", [CASES["symlink-logs-dir-torchrun"]])
def test_a_link_planted_as_the_logs_folder_is_refused_before_torchrun(
    case, fault_world, tmp_path, capsys, outcome
):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    link = out / "logs"
    os.symlink(elsewhere, link)
    _reachable(link, elsewhere)
    started = time.monotonic()
    code = main(
        [
            "run",
            "sft",
            "--config",
            "tiny",
            "--nproc-per-node",
            "2",
            *sft_overrides(fault_world.model_dir, fault_world.chat, out, "max_steps=2"),
        ]
    )
    err = capsys.readouterr().err
    line = _refused(code, err, f"{link}: {_LINK} (to {elsewhere})")
    assert "ranks through torchrun" not in err and time.monotonic() - started < 120
    assert list(elsewhere.iterdir()) == []
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


# ----------------------------------------------------------------------------- model folders


def _model_with_link(fault_world, tmp_path: Path, name: str, target: Path) -> tuple[Path, Path]:
    model = Path(shutil.copytree(fault_world.model_dir, tmp_path / "model"))
    (model / name).unlink(missing_ok=True)
    os.symlink(target, model / name)
    return model, model / name


@pytest.mark.parametrize("case", [CASES["symlink-model-file-outside"]])
def test_a_model_file_linked_outside_is_refused(
    case, fault_world, tmp_path, victim, capsys, outcome
):
    from tunesmith.models.hf import TOKENIZER_FILES

    assert "vocab.txt" in TOKENIZER_FILES  # a known file: it used to be copied as it points
    model, link = _model_with_link(fault_world, tmp_path, "vocab.txt", victim)
    _reachable(link, victim)
    shutil.copy2(link, tmp_path / "copied")  # what the checkpoint writer used to do
    assert (tmp_path / "copied").read_text() == "precious\n"
    out = tmp_path / "out"
    code, err = _run(capsys, fault_world, out, model_dir=model)
    line = _refused(code, err, f"{link}: {_LINK} to {victim}, outside the model folder")
    assert not any(out.rglob("vocab.txt")) and checkpoints(out) == []
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


@pytest.mark.parametrize("case", [CASES["symlink-model-dir-outside"]])
def test_a_model_folder_linked_outside_is_refused(case, fault_world, tmp_path, capsys, outcome):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "id_rsa").write_text("not a chat template\n")
    model, link = _model_with_link(fault_world, tmp_path, "additional_chat_templates", elsewhere)
    _reachable(link, elsewhere)
    out = tmp_path / "out"
    code, err = _run(capsys, fault_world, out, model_dir=model)
    line = _refused(code, err, f"{link}: {_LINK} to {elsewhere}, outside the model folder")
    assert not any(out.rglob("id_rsa"))
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


def test_a_link_inside_the_model_folder_is_copied_as_its_file(fault_world, tmp_path, capsys):
    """A link that stays inside the model folder (a deduplicated vocab) is the folder's own
    file: it is copied as a regular file, and the run trains."""
    model, link = _model_with_link(fault_world, tmp_path, "vocab.txt", Path("tokenizer.json"))
    code, err = _run(capsys, fault_world, tmp_path / "out", model_dir=model)
    assert code == 0, err
    (step,) = checkpoints(tmp_path / "out")
    copied = step / "vocab.txt"
    assert (
        not copied.is_symlink() and copied.read_bytes() == (model / "tokenizer.json").read_bytes()
    )


# ----------------------------------------------------------------------------- secrets


def _secret(tmp_path: Path) -> str:
    return str(tmp_path / "hf_Zq8xSECRETtoken0123456789.jsonl")  # a token-like path


@pytest.mark.parametrize("case", [CASES["secret-in-error-line"]])
def test_a_secret_in_the_error_line_is_redacted(
    case, fault_world, tmp_path, capsys, monkeypatch, outcome
):
    value = _secret(tmp_path)
    monkeypatch.setenv(SECRET_ENV, value)
    with monkeypatch.context() as off:  # live: without redaction the value is in the line
        off.setattr(secrets, "MIN_SECRET_CHARS", 10**9)
        code, err = _run(capsys, fault_world, tmp_path / "live", data=f"${{oc.env:{SECRET_ENV}}}")
        assert code == 1 and value in err, err
    out = tmp_path / "out"
    code, err = _run(capsys, fault_world, out, data=f"${{oc.env:{SECRET_ENV}}}")
    line = _refused(code, err, f"${{oc.env:{SECRET_ENV}}}: no such file")
    assert value not in err
    for file in [p for p in out.rglob("*") if p.is_file()]:
        assert value not in file.read_text(errors="replace"), file
    outcome.update(outcome="refused", error=_shown(line, tmp_path))


@pytest.mark.parametrize("case", [CASES["secret-in-rank-error-torchrun"]])
def test_a_secret_in_a_rank_error_is_redacted_in_every_log(case, fault_world, tmp_path, outcome):
    from tests.faults.test_error_faults import torchrun_errors

    value = _secret(tmp_path)  # a file there (the CLI's checks pass) that the ranks fail on
    _, bad = with_a_bad_row(fault_world.chat, value)
    out = tmp_path / "out"
    overrides = sft_overrides(fault_world.model_dir, fault_world.chat, out, "max_steps=2")
    overrides += [f"dataset.source=${{oc.env:{SECRET_ENV}}}", "dataset.on_bad_row=error"]
    argv = ["run", "sft", "--config", "tiny", "--nproc-per-node", "2", *overrides]
    log = tmp_path / "cli.log"
    done = finish(
        start_child(argv, log, env={SECRET_ENV: value}), log, timeout=240, started=time.monotonic()
    )
    assert done.exitcode == 1, done.output[-3000:]
    lines, run_log = torchrun_errors(done.output)
    assert len(lines) == 1 and lines[0].startswith(
        f"tunesmith: error: ranks 0, 1 of 2: dataset: BadRowError: ${{oc.env:{SECRET_ENV}}}: "
        f"bad row at line {bad}: malformed_json"
    ), lines
    assert value not in done.output
    text = run_log.read_text()
    for rank in (0, 1):  # each rank's traceback is there, with the name instead of the value
        assert f"[rank{rank}]: rank {rank} of 2 failed:" in text
    assert f"${{oc.env:{SECRET_ENV}}}" in text and "tunesmith.cli.launch FAILED" in text
    for file in [p for p in out.rglob("*") if p.is_file()]:
        assert value not in file.read_text(errors="replace"), file
    outcome.update(outcome="refused", error=_shown(lines[0], tmp_path))


# ----------------------------------------------------------------------------- a full disk

_FILL = (  # in `unshare -Urm`: $0 the mount point, $1 the earlier records; then the command
    'mount -t tmpfs -o size=8k tmpfs "$0" || exit 97; cp "$1" "$0/metrics.jsonl"; shift; '
    '"$@"; rc=$?; cp "$0/metrics.jsonl" "$SNAPSHOT"; exit $rc'
)


def _earlier_records(path: Path, size: int = 3900) -> bytes:
    """A resumed run's metrics.jsonl of about ``size`` bytes (whole records)."""
    data, step = b"", 0
    while len(data) < size - 200:
        step += 1
        record = {"step": step, "loss": 2.0, "note": "x" * 120, "elapsed_s": float(step)}
        data += (json.dumps(record) + "\n").encode()
    data += (json.dumps({"step": step + 1, "pad": "y" * (size - len(data) - 30)}) + "\n").encode()
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("case", params("fault", "disk_full_log"))
def test_a_full_disk_under_metrics_keeps_the_earlier_records(case, fault_world, tmp_path, outcome):
    earlier = _earlier_records(tmp_path / "earlier.jsonl")
    logs, snapshot, out = tmp_path / "disk", tmp_path / "after.jsonl", tmp_path / "out"
    logs.mkdir()
    argv = cli_command(
        "run",
        "sft",
        "--config",
        "tiny",
        *sft_overrides(
            fault_world.model_dir,
            fault_world.chat,
            out,
            "max_steps=2",
            "dataset.cache_dir=null",
            f"metric_loggers.1.log_dir={logs}",
        ),
    )
    tmpfs = tmpfs_permitted(tmp_path)
    if tmpfs:
        command = [
            "unshare",
            "-Urm",
            "sh",
            "-c",
            _FILL,
            str(logs),
            str(tmp_path / "earlier.jsonl"),
            *argv,
        ]
        result = subprocess.run(
            command,
            env=subprocess_env(SNAPSHOT=str(snapshot)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode != 97, result.stderr
    else:  # the file may not grow past what it holds plus 100 bytes
        shutil.copy(tmp_path / "earlier.jsonl", logs / "metrics.jsonl")
        limit = len(earlier) + 100

        def lower_limit() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        result = subprocess.run(
            argv,
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=300,
            preexec_fn=lower_limit,
        )
        shutil.copy(logs / "metrics.jsonl", snapshot)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [x for x in result.stderr.splitlines() if x.startswith("tunesmith: error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    says = "disk full" if tmpfs else "file too large"
    assert f"{logs / 'metrics.jsonl'}: cannot append the record of step 1: {says}" in errors[0]
    assert snapshot.read_bytes() == earlier  # kept byte for byte, no half record
    outcome.update(
        mechanism="tmpfs (ENOSPC)" if tmpfs else "RLIMIT_FSIZE (EFBIG)",
        error=_shown(errors[0], tmp_path),
        records_kept=earlier.count(b"\n"),
        lost_checkpoints=0,
    )


# ----------------------------------------------------------------------------- the manifest cases, live


def _within(seconds: float, fn) -> object:
    """``fn()``'s result, failing if it takes longer than ``seconds`` (it runs in a thread)."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    return box[0]


def _world(fault_world, tmp_path: Path) -> World:
    return World(fault_world.model_dir, fault_world.chat, fault_world.finished, tmp_path)


def test_a_manifest_without_the_weights_would_load_a_flipped_byte(fault_world, tmp_path):
    from tests.faults.file_cases import _omits_weights

    _omits_weights(_world(fault_world, tmp_path))
    step = tmp_path / "out" / "checkpoints" / "step_000001"
    load_file(step / "model.safetensors")  # live: the damaged weights load without complaint
    original = load_file(fault_world.finished / "checkpoints" / "step_000001" / "model.safetensors")
    damaged = load_file(step / "model.safetensors")
    assert any(not (damaged[k] == original[k]).all() for k in original)
    problem = CheckpointDirectory.problem(step)
    assert problem.startswith(f"{step / 'model.safetensors'}: not listed in the COMPLETE"), problem


def test_dev_zero_and_a_fifo_in_a_manifest_are_refused_within_seconds(fault_world, tmp_path):
    from tests.faults.file_cases import _entry, _fifo_file

    with open("/dev/zero", "rb") as f:  # live: size 0, yet it never ends
        assert os.fstat(f.fileno()).st_size == 0 and len(f.read(1 << 20)) == 1 << 20
    _entry(_world(fault_world, tmp_path / "zero"), "/dev/zero")
    step = tmp_path / "zero" / "out" / "checkpoints" / "step_000001"
    assert "'/dev/zero' is not a path inside" in _within(
        10, lambda: CheckpointDirectory.problem(step)
    )
    _fifo_file(_world(fault_world, tmp_path / "fifo"))
    step = tmp_path / "fifo" / "out" / "checkpoints" / "step_000001"
    assert "is a FIFO" in _within(10, lambda: CheckpointDirectory.problem(step))


def test_a_dotdot_entry_would_be_read_outside(fault_world, tmp_path):
    from tests.faults.file_cases import _dotdot_entry

    _dotdot_entry(_world(fault_world, tmp_path))
    step = tmp_path / "out" / "checkpoints" / "step_000001"
    (rel,) = [r for r in json.loads((step / "COMPLETE").read_text())["files"] if r.startswith("..")]
    assert (step / rel).resolve() == (tmp_path / "outside.txt").resolve()  # live: it is there
    assert "is not a path inside the checkpoint" in CheckpointDirectory.problem(step)


def test_resume_copy_still_resumes(fault_world, tmp_path, capsys):
    """The rule holds our own checkpoints: a good one resumes (every file listed, all real)."""
    step = resume_copy(_world(fault_world, tmp_path))
    assert CheckpointDirectory.problem(step) is None
