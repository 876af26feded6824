"""Bad inputs about checkpoints and output folders: damaged content, foreign folders, a second
run in the same output dir."""

from __future__ import annotations

from tests.faults.kit import BadInput

__all__ = ["CASES"]

CASES: list[BadInput] = []
