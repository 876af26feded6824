"""Bad inputs refused by the up-front check of the loop's keys (type, range, enum) and by the
resume check that compares a changed config with the checkpoint's."""

from __future__ import annotations

from tests.faults.kit import BadInput

__all__ = ["CASES"]

CASES: list[BadInput] = []
