"""Bad inputs whose error must name the real cause (file size limits, torchrun failures) and
data that must train the right tokens."""

from __future__ import annotations

from tests.faults.kit import BadInput

__all__ = ["CASES"]

CASES: list[BadInput] = []
