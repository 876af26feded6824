"""Faults whose error must name the real cause: a file size limit (``ulimit -f``) hit by torch's
writer, a rank failing under torchrun (one line per failed rank, the log path for the rest)."""

from __future__ import annotations

from tests.faults.kit import Case

__all__ = ["ERROR_FAULTS"]

_KEEPS = (
    "no partial checkpoint left; the first checkpoint verifies and resuming from it reproduces "
    "the uninterrupted run"
)

ERROR_FAULTS: list[Case] = [
    Case(
        "file-size-limit-in-torch-save",
        "fault",
        "disk_full",
        "RLIMIT_FSIZE lowered to 8 kB just before the second checkpoint's training state "
        "(rank0.pt, 12 kB) is written by torch.save, whose C++ writer loses the errno "
        "('unexpected pos ... vs ...')",
        "one-line error naming the checkpoint and 'file too large: the process's file size "
        "limit (ulimit -f) is 8000 bytes', exit 1; " + _KEEPS,
    ),
    Case(
        "file-size-limit-in-optimizer-state",
        "fault",
        "disk_full",
        "RLIMIT_FSIZE lowered to 100 kB just before the second checkpoint's optimizer state "
        "(1 MB) is written by torch.distributed.checkpoint",
        "one-line error naming the checkpoint and 'file too large: the process's file size "
        "limit (ulimit -f) is 100000 bytes', exit 1; " + _KEEPS,
        ci=False,
    ),
    Case(
        "torchrun-same-error-on-every-rank",
        "fault",
        "torchrun",
        "`tunesmith run --nproc-per-node 2` on a dataset file whose last line is not JSON "
        "(past the CLI's config check, which sees the file is there): both ranks fail the same "
        "way",
        "exit 1 with one line 'tunesmith: error: ranks 0, 1 of 2: ... bad row at line N ...', no "
        "traceback or torchrun output on the console, the log's path; the log, the only file "
        "written, holds each rank's traceback and torchrun's summary",
    ),
]
