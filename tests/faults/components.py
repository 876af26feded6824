"""Test-only components and payloads for the fault suite (outside the component allow-list, so
configs may name them only with ``--allow-any-component``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from tunesmith.modules.losses import CrossEntropyLoss

__all__ = ["DieOnCall", "Evil", "RecordingCrossEntropy"]


class RecordingCrossEntropy(CrossEntropyLoss):
    """Summed cross-entropy that writes ``marker`` when it is built: a harmless component whose
    construction a test can see.

    Example::

        loss = RecordingCrossEntropy(marker=str(tmp_path / "built"))
    """

    def __init__(self, marker: str) -> None:
        super().__init__()
        Path(marker).write_text("built")


class DieOnCall(CrossEntropyLoss):
    """Summed cross-entropy; on its ``call``-th call (1-based) the process of rank ``rank``
    (``RANK`` in the environment) SIGKILLs itself, the way a crashing or OOM-killed rank dies."""

    def __init__(self, call: int, rank: int) -> None:
        super().__init__()
        self.call, self.rank, self.calls = call, rank, 0

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.call and int(os.environ.get("RANK", 0)) == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(logits, labels)


class Evil:
    """Pickles as a call of ``os.system(command)``: whoever unpickles it runs the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))
