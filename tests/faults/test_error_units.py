"""The small pieces behind the suite's clear errors, each on its own: the peer-failure message
of a multi-rank run, the distributed timeout's validation, the disk-full hint of a failed
checkpoint write, and the allow-list unpickler of optimizer metadata."""

from __future__ import annotations

import errno
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.faults.components import Evil
from tunesmith.config import ConfigError
from tunesmith.training.checkpoint import safe_dcp
from tunesmith.training.checkpoint.checkpointer import _write_error
from tunesmith.training.parallel.distributed import (
    DistributedContext,
    PeerFailureError,
    close_distributed,
    init_distributed,
    peer_failure,
)

GLOO_CLOSED = (
    "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:14255. This is typically caused by a remote worker crashing. GLHF!"
)


def _ctx(rank: int, world_size: int, timeout_s: float | None) -> DistributedContext:
    return DistributedContext(rank, world_size, rank, torch.device("cpu"), None, timeout_s)


def test_peer_failure_names_rank_cause_and_bound():
    failure = peer_failure(RuntimeError(GLOO_CLOSED), _ctx(1, 4, 30.0))
    assert isinstance(failure, PeerFailureError)
    assert str(failure) == (
        "rank 1 of 4: a collective operation with the other ranks failed (Connection closed by "
        "peer [127.0.0.1]:14255); another rank has probably died or hangs, see its log "
        "(collectives wait at most distributed_timeout_s: 30 s)"
    )
    assert "the backend's default" in str(peer_failure(RuntimeError(GLOO_CLOSED), _ctx(0, 2, None)))


def test_peer_failure_leaves_other_errors_alone():
    assert peer_failure(RuntimeError(GLOO_CLOSED), _ctx(0, 1, 10.0)) is None  # one process
    assert peer_failure(ValueError("bad batch_size"), _ctx(0, 2, 10.0)) is None


@pytest.mark.parametrize("bad", [0, -1, True, "10"])
def test_distributed_timeout_must_be_positive_seconds(bad):
    with pytest.raises(
        ConfigError, match="distributed_timeout_s: expected a number of seconds > 0"
    ):
        init_distributed("cpu", bad)


def test_distributed_timeout_is_kept_in_the_context():
    try:
        assert init_distributed("cpu", 12).timeout_s == 12.0
    finally:
        close_distributed()


def test_write_error_says_disk_full_from_errno_or_free_space(tmp_path):
    enospc = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("unexpected pos 704 vs 598")
    wrapped.__context__ = enospc
    error = _write_error(4, tmp_path, wrapped, free=10**9, needed=100)
    assert error.errno == errno.ENOSPC and "(disk full" in str(error)
    assert str(error).startswith(f"failed to write checkpoint step 4 in {tmp_path} (disk full")
    low = _write_error(4, tmp_path, RuntimeError("unexpected pos"), free=0, needed=2 * 2**20)
    assert "(disk full: 0 B free, the checkpoint needs about 2.0 MiB)" in str(low)
    too_big = _write_error(
        4, tmp_path, OSError(errno.EFBIG, "File too large"), free=10**9, needed=1
    )
    assert "file too large" in str(too_big)
    plain = _write_error(4, tmp_path, ValueError("boom"), free=10**9, needed=1)
    assert str(plain) == (
        f"failed to write checkpoint step 4 in {tmp_path}: ValueError: boom. "
        f"Older checkpoints in {tmp_path} are untouched."
    )
    assert "\n" not in str(low) + str(plain)


def test_safe_dcp_round_trips_and_refuses_foreign_objects(tmp_path):
    state = {"w": torch.arange(4.0), "lr": 0.5, "betas": (0.9, 0.99)}
    dcp.save(state, checkpoint_id=tmp_path / "ok")
    loaded = {"w": torch.zeros(4), "lr": 0.0, "betas": (0.0, 0.0)}
    safe_dcp.load(loaded, tmp_path / "ok")
    assert torch.equal(loaded["w"], state["w"]) and loaded["lr"] == 0.5
    assert tuple(loaded["betas"]) == (0.9, 0.99)

    marker = tmp_path / "ran"
    (tmp_path / "ok" / ".metadata").write_bytes(pickle.dumps(Evil(f"touch {marker}")))
    with pytest.raises(
        safe_dcp.UnsafeCheckpointError, match=r"\.metadata: refused to unpickle posix\.system"
    ):
        safe_dcp.load(loaded, tmp_path / "ok")
    assert not marker.exists()
