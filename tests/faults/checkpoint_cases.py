"""Faults about checkpoint integrity and output folders: same-size corruption, rollback past a
damaged checkpoint, a second run in the same folder, a user's folder left alone."""

from __future__ import annotations

from tests.faults.kit import Case

__all__ = ["CHECKPOINT_FAULTS"]

CHECKPOINT_FAULTS: list[Case] = []
