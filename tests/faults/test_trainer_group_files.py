"""The log files of a Ray trainer group (``trainer_group.launcher: ray``) are never written
through a planted link, and hold no secret value (``tests/faults/file_cases.py`` lists the
cases):

* a symbolic link planted as ``logs/`` is refused by ``tunesmith run grpo_async`` before Ray
  starts; one planted as ``rank<N>.log``, ``console.log`` or ``driver.log`` in the group's
  folder (or a hard link as ``rank1.log``) is refused by the driver before Ray starts, and by
  the rank itself when it opens its log (planted after the driver looked): one line naming
  the link, nothing redirected, the target unchanged;
* a value read with ``${oc.env:...}`` in a rank's error and output is written to
  ``rank0.log`` and ``console.log`` as ``${oc.env:NAME}`` (a rank run in a child process,
  as an actor runs it; shown live with redaction switched off), and the ranks get the
  variables' names; end to end on Ray (2 trainer actors, ``ci=False``): the CLI line, every
  rank's log and ``driver.log`` hold the name, never the value.

The driver and the rank are tested directly (no Ray instance: the refusals come before one
starts); the one real Ray run is the secret case.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.faults import test_file_safety, test_ray_safety
from tests.faults.catalogue import params
from tests.faults.file_cases import SECRET_ENV
from tests.faults.harness import finish, start_child, with_a_bad_row
from tests.faults.test_async_faults import ENV as RAY_ENV
from tests.faults.test_async_faults import one_error
from tests.recipes.sft_world import REPO_ROOT, free_port, subprocess_env
from tests.rl.rl_world import grpo_overrides, ray_temp_dir
from tunesmith.cli.main import main
from tunesmith.config.secrets import SECRET_NAMES_ENV
from tunesmith.models.atomic import UnsafePathError
from tunesmith.rl.asynchronous.trainer_group import GroupSettings, RankJob, TrainerRank, _Driver

victim = test_file_safety.victim  # the file outside a planted link points at (a fixture)
ray_world = test_ray_safety.ray_world  # a tiny policy folder and prompts (a fixture)
CASES = {p.id: p for p in params("safety")}
_REFUSAL = "tunesmith does not write or read through links inside its own folders"
_HARD = "tunesmith does not write to hard-linked files inside its own folders"
_GROUP = ("trainer_group.launcher=ray", "trainer_group.workers=2")


def _ray_started() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def _driver(out: Path) -> _Driver:
    """The driver of a 2-rank group writing into ``out`` (its log folder made, Ray not started)."""
    cfg = OmegaConf.create(
        {"output_dir": str(out), "trainer_group": dict(launcher="ray", workers=2)}
    )
    return _Driver(
        lambda cfg, ctx: None, cfg, ["output_dir", "trainer_group"], {}, GroupSettings.of(cfg)
    )


def _job(log_dir: Path, rank: int, world: int, config: dict | None = None) -> RankJob:
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}  # fmt: skip
    return RankJob(
        lambda cfg, ctx: None,
        config or {},
        [],
        {},
        env,
        os.getcwd(),
        str(log_dir),
        threads=torch.get_num_threads(),
        console_tty=False,
    )


def _rank_refuses(job: RankJob, monkeypatch) -> dict:
    """What :meth:`TrainerRank.run` returns for ``job`` in this process; it must redirect
    nothing (``sys.stdout`` and file descriptor 1 unchanged)."""
    for key, value in job.env.items():  # put back afterwards: the rank sets them
        monkeypatch.setenv(key, value)
    stdout, fd1 = sys.stdout, os.fstat(1)
    result = TrainerRank().run(job)
    assert sys.stdout is stdout and os.fstat(1)[:3] == fd1[:3]  # nothing redirected
    return result


def _shown(text: str, tmp: Path) -> str:
    return text.replace(str(tmp), "<case>")


# ----------------------------------------------------------------------------- links


@pytest.mark.parametrize("case", [CASES["symlink-trainer-group-logs-dir"]])
def test_a_link_planted_as_the_logs_folder_is_refused_before_ray(
    case, ray_world, tmp_path, capsys, monkeypatch, outcome
):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    model_dir, prompts = ray_world
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    link = out / "logs"
    os.symlink(elsewhere, link)
    assert link.resolve() == elsewhere.resolve()  # live: a plain mkdir/open goes there
    code = main(
        [
            "run",
            "grpo_async",
            "--config",
            "tiny",
            f"model_dir={model_dir}",
            f"prompts.source={prompts}",
            f"output_dir={out}",
            "max_steps=1",
            "progress_bar=false",
            *_GROUP,
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines() == [
        f"tunesmith: error: {link}: is a symbolic link (to {elsewhere}); {_REFUSAL}: remove the link"
    ], err
    assert not _ray_started() and list(elsewhere.iterdir()) == []
    outcome.update(outcome="refused", error=_shown(err.splitlines()[0], tmp_path))


_LOGS = {
    "symlink-trainer-group-rank-log": ("rank0.log", 0),
    "symlink-trainer-group-console-log": ("console.log", 0),
    "symlink-trainer-group-driver-log": ("driver.log", None),
}


@pytest.mark.parametrize("case", [CASES[name] for name in _LOGS])
def test_a_link_planted_as_a_group_log_is_refused(case, tmp_path, victim, monkeypatch, outcome):
    name, rank = _LOGS[case.id]
    driver = _driver(tmp_path / "out")
    link = driver.log_dir / name
    os.symlink(victim, link)
    with open(link) as f:  # live: what the driver and the ranks used to open with "a"
        assert f.read() == "precious\n"
    with pytest.raises(UnsafePathError) as refused:
        driver.run()
    line = str(refused.value)
    assert line == f"{link}: is a symbolic link (to {victim}); {_REFUSAL}: remove the link"
    assert not _ray_started()
    said = {"driver": _shown(line, tmp_path)}
    if rank is not None:  # planted after the driver looked: the rank refuses it itself
        result = _rank_refuses(_job(driver.log_dir, rank, 2), monkeypatch)
        assert result == {"message": f"rank {rank} of 2: {line}", "peer": False}
        said["rank"] = _shown(result["message"], tmp_path)
    assert victim.read_text() == "precious\n" and link.is_symlink()
    outcome.update(outcome="refused", error=said.get("rank", said["driver"]))


@pytest.mark.parametrize("case", [CASES["hardlink-trainer-group-rank-log"]])
def test_a_hard_link_planted_as_a_rank_log_is_refused(case, tmp_path, victim, monkeypatch, outcome):
    driver = _driver(tmp_path / "out")
    link = driver.log_dir / "rank1.log"
    os.link(victim, link)
    assert os.stat(link).st_ino == os.stat(victim).st_ino  # live: appending reaches the victim
    with pytest.raises(UnsafePathError) as refused:
        driver.run()
    line = str(refused.value)
    assert line == (
        f"{link}: is a hard link (the file has 2 names), so writing it would change "
        f"another file too; {_HARD}: remove rank1.log (its other names keep the "
        "content)"
    )
    assert not _ray_started()
    result = _rank_refuses(_job(driver.log_dir, 1, 2), monkeypatch)
    assert result == {"message": f"rank 1 of 2: {line}", "peer": False}
    assert victim.read_text() == "precious\n"
    outcome.update(outcome="refused", error=_shown(result["message"], tmp_path))


def test_the_driver_makes_the_logs_and_reads_rank_0s_console(tmp_path):
    """No link: the driver creates every log of the group (empty), and its tail of
    ``console.log`` copies what is appended."""
    import io

    from tunesmith.rl.asynchronous.trainer_group import _open_log, _Tail

    driver = _driver(tmp_path / "out")
    for name in ["console.log", "rank0.log", "rank1.log", "driver.log"]:
        _open_log(driver.log_dir / name).close()
    assert sorted(p.name for p in driver.log_dir.iterdir()) == [
        "console.log",
        "driver.log",
        "rank0.log",
        "rank1.log",
    ]
    shown = io.StringIO()
    tail = _Tail(driver.log_dir / "console.log", shown)
    log = _open_log(driver.log_dir / "console.log")
    log.write("step 1/4\n")
    log.close()
    tail.pump()
    assert shown.getvalue() == "step 1/4\n"


# ----------------------------------------------------------------------------- secrets

_RANK = """
import json, sys
from pathlib import Path
from tunesmith.config import secrets
from tunesmith.rl.asynchronous.trainer_group import RankJob, TrainerRank

job_file, result_file, live = sys.argv[1], sys.argv[2], sys.argv[3] == "live"
if live:  # redaction off: what the logs held before
    secrets.MIN_SECRET_CHARS = 10**9

def train(cfg, ctx):
    print(f"logging in with {cfg.token}")
    raise PermissionError(f"401 Unauthorized for token {cfg.token}")

job = json.loads(Path(job_file).read_text())
result = TrainerRank().run(RankJob(train, **job))
Path(result_file).write_text(json.dumps(result))
"""


def _run_rank(log_dir: Path, value: str, live: bool) -> dict:
    """Rank 0 of 1 as an actor runs it (``TrainerRank.run``), in a child process: its config
    reads the token from the environment; it prints it and fails naming it."""
    log_dir.mkdir(parents=True)
    config = {"token": f"${{oc.env:{SECRET_ENV}}}", "device": "cpu", "batch_size": 1,
              "output_dir": str(log_dir.parent / "out")}  # fmt: skip
    job = _job(log_dir, 0, 1, config)
    fields = {"config": job.config, "keys": list(config), "rules": {}, "env": job.env,
              "cwd": job.cwd, "log_dir": job.log_dir, "threads": 1, "console_tty": False}  # fmt: skip
    (log_dir.parent / "job.json").write_text(json.dumps(fields))
    result = log_dir.parent / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _RANK,
            str(log_dir.parent / "job.json"),
            str(result),
            "live" if live else "redacted",
        ],
        env=subprocess_env(**{SECRET_ENV: value}),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert value not in done.stdout + done.stderr  # the rank's output went to its logs
    return json.loads(result.read_text())


def _secret(tmp_path: Path) -> str:
    return str(tmp_path / "hf_Zq8xSECRETtoken0123456789.jsonl")  # a token-like path


@pytest.mark.parametrize("case", [CASES["secret-in-rank-log-trainer-group"]])
def test_a_secret_in_a_rank_error_is_redacted_in_its_logs(case, tmp_path, outcome):
    value, name = _secret(tmp_path), f"${{oc.env:{SECRET_ENV}}}"
    live = _run_rank(tmp_path / "live" / "logs", value, live=True)
    assert value in live["message"]
    for log in ("rank0.log", "console.log"):  # live: without redaction the value is written
        assert value in (tmp_path / "live" / "logs" / log).read_text(), log
    result = _run_rank(tmp_path / "run" / "logs", value, live=False)
    assert result == {"message": f"rank 0 of 1: 401 Unauthorized for token {name}", "peer": False}
    rank0 = (tmp_path / "run" / "logs" / "rank0.log").read_text()
    console = (tmp_path / "run" / "logs" / "console.log").read_text()
    assert f"logging in with {name}\n" in console and f"logging in with {name}\n" in rank0
    assert "rank 0 of 1 failed:\nTraceback" in rank0
    assert f"PermissionError: 401 Unauthorized for token {name}" in rank0
    assert value not in rank0 + console
    outcome.update(outcome="refused", error=_shown(result["message"], tmp_path))


def test_the_ranks_get_the_names_of_the_secrets(tmp_path, monkeypatch):
    """The driver hands each rank the names (never the values) of the config's ``oc.env``
    reads, so its logs redact them before it has resolved the config itself."""
    value = _secret(tmp_path)
    monkeypatch.setenv(SECRET_ENV, value)
    assert OmegaConf.create({"t": f"${{oc.env:{SECRET_ENV}}}"}).t == value  # resolved here
    driver = _driver(tmp_path / "out")
    driver.where = [{"pid": 1, "node": "n", "ip": "127.0.0.1", "port": 29500}] * 2
    for job in driver._jobs():
        assert SECRET_ENV in job.env[SECRET_NAMES_ENV].split(",")
        assert value not in json.dumps(job.env)


@pytest.mark.parametrize("case", [CASES["secret-in-rank-error-ray"]])
def test_a_secret_in_the_ranks_errors_is_redacted_on_ray(case, ray_world, tmp_path, outcome):
    """2 trainer actors whose prompts file is read from the environment (a token-like path to
    a file whose last row is not JSON: the CLI's checks pass): the ranks fail naming it (the
    first failure stops the other)."""
    model_dir, prompts = ray_world
    value, name = _secret(tmp_path), f"${{oc.env:{SECRET_ENV}}}"
    _, bad = with_a_bad_row(prompts, value)
    out, log = tmp_path / "out", tmp_path / "cli.log"
    with ray_temp_dir() as temp:
        overrides = grpo_overrides(
            model_dir,
            prompts,
            out,
            "max_steps=1",
            *_GROUP,
            "ray.num_cpus=4",
            f"ray.temp_dir={temp}",
            f"prompts.source={name}",
            "prompts.on_bad_row=error",
        )
        argv = ["--allow-any-component", "run", "grpo_async", "--config", "tiny", *overrides]
        done = finish(
            start_child(argv, log, env={**RAY_ENV, SECRET_ENV: value}),
            log,
            timeout=300,
            started=time.monotonic(),
        )
    assert done.exitcode == 1, done.output[-3000:]
    line = one_error(done.output)
    first = re.match(
        r"tunesmith: error: rank (\d) of 2: prompts: BadRowError: (.*?): bad row", line
    )
    assert first and first.group(2) == name and f"line {bad}: malformed_json" in line, line
    assert value not in done.output
    (group,) = (out / "logs").glob("trainer-group-*")
    assert sorted(p.name for p in group.iterdir()) == [
        "console.log",
        "driver.log",
        "rank0.log",
        "rank1.log",
    ]
    rank = int(first.group(1))  # the other may be stopped before it fails too
    text = (group / f"rank{rank}.log").read_text()
    assert f"rank {rank} of 2 failed:\nTraceback" in text and f"BadRowError: {name}" in text, text
    for file in [p for p in out.rglob("*") if p.is_file()]:
        assert value not in file.read_text(errors="replace"), file
    outcome.update(outcome="refused", error=_shown(line, tmp_path))
