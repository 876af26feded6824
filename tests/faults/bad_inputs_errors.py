"""Bad inputs whose error must name the real cause (file size limits, torchrun failures) and
data that must train the right tokens: here, the launch flags of ``tunesmith run``, refused
before torchrun starts or anything is written."""

from __future__ import annotations

from collections.abc import Callable

from tests.faults.kit import REFUSED, BadInput, Setup, World

__all__ = ["CASES"]


def _flags(*flags: str, words: list[str]) -> Callable[[World], Setup]:
    return lambda world: Setup(list(flags), words)


CASES: list[BadInput] = [
    BadInput(
        "cli-nproc-per-node-zero",
        "cli",
        "`--nproc-per-node 0` (torchrun failed with a bare AssertionError)",
        REFUSED.format("--nproc-per-node 0 and what is allowed (>= 1)"),
        _flags(
            "--nproc-per-node",
            "0",
            words=["--nproc-per-node 0: expected a number of processes per node >= 1"],
        ),
    ),
    BadInput(
        "cli-nproc-per-node-negative",
        "cli",
        "`--nproc-per-node -2`",
        REFUSED.format("--nproc-per-node -2 and what is allowed (>= 1)"),
        _flags(
            "--nproc-per-node",
            "-2",
            words=["--nproc-per-node -2: expected a number of processes per node >= 1"],
        ),
    ),
    BadInput(
        "cli-nnodes-zero",
        "cli",
        "`--nnodes 0` (was reported as '--nnodes > 1 needs --rdzv-endpoint')",
        REFUSED.format("--nnodes 0 and what is allowed (>= 1)"),
        _flags("--nnodes", "0", words=["--nnodes 0: expected a number of nodes >= 1"]),
    ),
    BadInput(
        "cli-nnodes-without-rendezvous",
        "cli",
        "`--nnodes 2` without `--rdzv-endpoint`",
        REFUSED.format("--nnodes and --rdzv-endpoint HOST:PORT"),
        _flags("--nnodes", "2", words=["--nnodes > 1 needs --rdzv-endpoint HOST:PORT"]),
    ),
    BadInput(
        "cli-node-rank-negative",
        "cli",
        "`--nnodes 2 --node-rank -1`",
        REFUSED.format("--node-rank -1 and what is allowed (>= 0 and < --nnodes 2)"),
        _flags(
            "--nnodes",
            "2",
            "--node-rank",
            "-1",
            "--rdzv-endpoint",
            "127.0.0.1:29500",
            words=["--node-rank -1: expected a node rank >= 0 and < --nnodes 2"],
        ),
    ),
    BadInput(
        "cli-node-rank-not-below-nnodes",
        "cli",
        "`--nnodes 2 --node-rank 2` (node ranks count from 0)",
        REFUSED.format("--node-rank 2 and what is allowed (>= 0 and < --nnodes 2)"),
        _flags(
            "--nnodes",
            "2",
            "--node-rank",
            "2",
            "--rdzv-endpoint",
            "127.0.0.1:29500",
            words=["--node-rank 2: expected a node rank >= 0 and < --nnodes 2"],
        ),
    ),
    BadInput(
        "cli-node-rank-without-nnodes",
        "cli",
        "`--node-rank 1` without `--nnodes` (one node by default)",
        REFUSED.format("--node-rank 1 and --nnodes 1"),
        _flags(
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            "127.0.0.1:29500",
            words=["--node-rank 1: expected a node rank >= 0 and < --nnodes 1"],
        ),
    ),
]
