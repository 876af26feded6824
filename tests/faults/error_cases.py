"""Faults whose error must name the real cause: a file size limit (``ulimit -f``) hit by torch's
writer, a rank failing under torchrun (one line per failed rank, the log path for the rest)."""

from __future__ import annotations

from tests.faults.kit import Case

__all__ = ["ERROR_FAULTS"]

ERROR_FAULTS: list[Case] = []
