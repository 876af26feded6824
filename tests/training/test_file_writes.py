"""What a run writes in its folders: never through a planted symbolic link or into a FIFO (the
no-follow helpers of ``tunesmith.models.atomic`` and their writers), and ``metrics.jsonl`` on a
full disk or past the file size limit keeps every whole record with one line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tunesmith.models.atomic import UnsafePathError, open_no_follow, real_folder
from tunesmith.training import CheckpointDirectory, JSONLLogger
from tunesmith.training.checkpoint.run_lock import OutputDirInUseError, RunLock, hold_run_lock


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.txt"
    path.write_text("precious\n")
    return path


@pytest.mark.parametrize("mode", ["w", "a", "x", "r+", "wb"])
def test_open_no_follow_refuses_a_link_for_every_mode(tmp_path, victim, mode):
    link = tmp_path / "link"
    os.symlink(victim, link)
    with open(link) as f:  # live: a plain open reaches the target
        assert f.read() == "precious\n"
    with pytest.raises(UnsafePathError, match=f"^{link}: is a symbolic link \\(to {victim}\\)"):
        open_no_follow(link, mode)
    assert victim.read_text() == "precious\n"


def test_open_no_follow_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "metrics.jsonl"
    os.mkfifo(fifo)
    for mode in ("w", "a", "r"):  # a plain open would block until a reader/writer comes
        with pytest.raises(UnsafePathError, match=f"^{fifo}: is a FIFO, not a regular file"):
            open_no_follow(fifo, mode)


def test_open_no_follow_writes_and_truncates_regular_files(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old and long\n")
    with open_no_follow(path, "w") as f:
        f.write("new\n")
    with open_no_follow(path, "a") as f:
        f.write("more\n")
    assert path.read_text() == "new\nmore\n"


def test_real_folder_refuses_a_link_but_follows_the_users_parent(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "users-link")  # the user's own output_dir as a link: fine
    assert real_folder(tmp_path / "users-link" / "logs").is_dir()
    assert (real / "logs").is_dir()
    os.symlink(tmp_path, real / "checkpoints")  # planted inside: refused
    with pytest.raises(UnsafePathError, match="checkpoints: is a symbolic link"):
        real_folder(tmp_path / "users-link" / "checkpoints")
    os.symlink(tmp_path / "nowhere", real / "dangling")
    with pytest.raises(UnsafePathError, match="dangling: is a symbolic link"):
        real_folder(real / "dangling")


def test_the_run_lock_refuses_a_link_and_leaves_its_target(tmp_path, victim):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim, out / ".tunesmith.lock")
    with pytest.raises(UnsafePathError, match=r"\.tunesmith\.lock: is a symbolic link"):
        RunLock.acquire(out)
    assert victim.read_text() == "precious\n"

    class One:
        is_rank_zero = True

    with pytest.raises(OutputDirInUseError, match="is a symbolic link"):
        hold_run_lock(out, One())


def test_jsonl_logger_refuses_links_for_metrics_and_config(tmp_path, victim):
    os.symlink(victim, tmp_path / "metrics.jsonl")
    with pytest.raises(UnsafePathError, match="metrics.jsonl: is a symbolic link"):
        JSONLLogger(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    os.symlink(victim, tmp_path / "config.yaml")
    with JSONLLogger(tmp_path) as logger, pytest.raises(UnsafePathError, match="config.yaml"):
        logger.log_config({"lr": 1.0})
    assert victim.read_text() == "precious\n"


def test_checkpoint_root_and_step_links_are_refused(tmp_path):
    good = CheckpointDirectory(tmp_path / "elsewhere").write(1, lambda d: (d / "w").write_text("1"))
    os.symlink(tmp_path / "elsewhere", tmp_path / "checkpoints")
    with pytest.raises(UnsafePathError, match="checkpoints: is a symbolic link"):
        CheckpointDirectory(tmp_path / "checkpoints")
    ckpts = CheckpointDirectory(tmp_path / "own")
    os.symlink(good, tmp_path / "own" / "step_000005")
    assert ckpts.list() == [] and ckpts.step_dirs() == [tmp_path / "own" / "step_000005"]
    path, skipped = ckpts.newest_good()
    assert path is None and "step_000005: is a symbolic link" in skipped[0][1]
    assert ckpts.prune() == [] and (tmp_path / "own" / "step_000005").is_symlink()


_WRITER = textwrap.dedent(
    """
    import resource, sys
    from tunesmith.training import JSONLLogger
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    logger = JSONLLogger(sys.argv[1], timestamps=False)
    try:
        for step in range(1, 1000):
            logger.log(step, {"loss": 1.0 / step, "pad": 1.0})
    except OSError as err:
        print(err)
    """
)


def test_metrics_past_the_file_size_limit_keep_every_whole_record(tmp_path):
    limit = 1000
    done = subprocess.run(
        [sys.executable, "-c", _WRITER, str(tmp_path), str(limit)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    path = tmp_path / "metrics.jsonl"
    data = path.read_bytes()
    lines = data.decode().splitlines()
    assert data.endswith(b"\n") and len(data) <= limit
    assert [json.loads(x)["step"] for x in lines] == list(range(1, len(lines) + 1))
    message = done.stdout.strip()
    assert message.startswith(
        f"{path}: cannot append the record of step {len(lines) + 1}: file too large"
    ), message
    assert f"the file size limit (ulimit -f) is {limit} bytes" in message
    assert f"the {len(data)} bytes written before it are kept" in message


def test_plot_refuses_a_link_planted_as_its_default_png(tmp_path, victim):
    from tunesmith.training import plot_run

    with JSONLLogger(tmp_path, timestamps=False) as logger:
        logger.log(1, {"loss": 2.0})
        logger.log(2, {"loss": 1.0})
    assert plot_run(tmp_path).read_bytes().startswith(b"\x89PNG")
    (tmp_path / "loss.png").unlink()
    os.symlink(victim, tmp_path / "loss.png")
    with pytest.raises(UnsafePathError, match="loss.png: is a symbolic link"):
        plot_run(tmp_path)
    assert victim.read_text() == "precious\n"


def test_the_rollouts_log_refuses_a_planted_link(tmp_path, victim):
    from tunesmith.rl.asynchronous.source import log_rollouts

    log_rollouts(tmp_path / "rollouts.jsonl", 1, 0, [], {})  # a regular file: appended
    assert json.loads((tmp_path / "rollouts.jsonl").read_text())["batch"] == 1
    (tmp_path / "rollouts.jsonl").unlink()
    os.symlink(victim, tmp_path / "rollouts.jsonl")
    with pytest.raises(UnsafePathError, match="rollouts.jsonl: is a symbolic link"):
        log_rollouts(tmp_path / "rollouts.jsonl", 1, 0, [], {})
    assert victim.read_text() == "precious\n"
