"""Child side of the fault suite: numbered events inside a real training process, and a signal
delivered to the process itself at a chosen one.

A child (see :mod:`tests.faults.harness`) installs :class:`Probes` and then runs the
``tunesmith`` CLI. Every probe point the run passes is one event, numbered from 0 in the order
they happen; a run of a fixed config passes the same events in the same order every time:

* training: the model's forward, ``Tensor.backward``, each optimizer step;
* checkpoint writing: ``Checkpointer.save`` begin/end, the Hugging Face files, each safetensors
  shard, the distributed optimizer state, each ``torch.save``, each ``os.fsync`` (with the file
  it syncs), each ``os.rename`` and ``shutil.rmtree`` (before and after).

With ``trace`` the events are written to a JSON file when the run ends (the map of a run); with
``at`` (or ``on`` and ``nth``: the nth event of that name) and ``signal`` the process sends
itself that signal when it reaches that event (SIGKILL: dies there; SIGTERM: the recipe's
handler runs; SIGSTOP: the process freezes), after writing the event's name and the monotonic
time into ``mark``; with ``file_size_limit`` it lowers ``RLIMIT_FSIZE`` there instead, so later
writes fail as on a full disk (EFBIG). Everything here is test-only
patching inside the child; the library has no hooks for it.

Example (inside a child)::

    Probes(trace=Path("trace.json")).install()
    main(["run", "sft", "--config", "tiny", ...])
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.optim.optimizer import register_optimizer_step_post_hook

from tunesmith.models import safetensors_io
from tunesmith.modules.decoder import DecoderLayer, TransformerLM
from tunesmith.training import JSONLLogger
from tunesmith.training.checkpoint import checkpointer as checkpointer_module

# ``.tmp-step_000004-12345`` -> ``.tmp-step_000004``: events must not depend on the pid.
_PID_SUFFIX = re.compile(r"(\.(?:tmp|del|old)-step_\d+)-\d+")


def _short(path: object) -> str:
    """A path as ``step_000004/training_state/rank0.pt`` (below ``checkpoints/``), pid-free."""
    text = _PID_SUFFIX.sub(r"\1", str(path))
    if text.endswith("/checkpoints"):
        return "checkpoints"
    return text.split("/checkpoints/", 1)[-1]


def _file_event(what: str, target: object) -> str | None:
    """An event for writing a file; None for an in-memory buffer."""
    if isinstance(target, (str, os.PathLike)):
        return f"{what} {_short(target)}"
    return None


@dataclass
class Probes:
    """Numbered events of one run; optionally a signal to this process at event ``at``."""

    trace: Path | None = None
    at: int | None = None
    on: str | None = None  # instead of ``at``: the ``nth`` event named ``on`` (1-based)
    nth: int = 1
    signal: int = signal.SIGKILL
    file_size_limit: int | None = None  # instead of a signal: set RLIMIT_FSIZE to this
    mark: Path | None = None
    events: list[str] = field(default_factory=list)

    def event(self, name: str) -> None:
        index = len(self.events)
        self.events.append(name)
        if index == self.at or (name == self.on and self.events.count(name) == self.nth):
            if self.mark is not None:
                self.mark.write_text(json.dumps({"event": name, "time": time.monotonic()}))
            if self.file_size_limit is None:
                os.kill(os.getpid(), self.signal)
                return
            # From now on no file may grow past the limit; writes fail with EFBIG instead of
            # the default SIGXFSZ killing the process.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_limit, hard))

    def dump(self) -> None:
        if self.trace is not None:
            self.trace.write_text(json.dumps(self.events))

    def install(self) -> Probes:
        """Patch the probe points (in this process only)."""
        torch.nn.modules.module.register_module_forward_pre_hook(self._forward)
        register_optimizer_step_post_hook(lambda *_: self.event("optimizer_step"))
        backward = torch.Tensor.backward

        def probed_backward(tensor, *args, **kwargs):
            self.event("backward")
            return backward(tensor, *args, **kwargs)

        torch.Tensor.backward = probed_backward
        self._wrap(JSONLLogger, "log", lambda logger, step, metrics: f"log_metrics {step}")
        self._wrap(checkpointer_module, "write_hf_checkpoint", lambda *a, **k: "hf_files")
        self._wrap(safetensors_io, "_write_shard", lambda t, path, m: f"shard {_short(path)}")
        self._wrap(dcp, "save", lambda *a, **k: "optimizer_state")
        self._wrap(torch, "save", lambda obj, f, *a, **k: _file_event("torch_save", f))
        self._wrap(os, "rename", lambda a, b, *r, **k: f"rename {_short(a)} -> {_short(b)}")
        self._wrap(shutil, "rmtree", lambda path, *a, **k: f"rmtree {_short(path)}")
        fsync = os.fsync

        def probed_fsync(fd):
            self.event(f"fsync {_short(os.readlink(f'/proc/self/fd/{fd}'))}")
            return fsync(fd)

        os.fsync = probed_fsync
        save = checkpointer_module.Checkpointer.save

        def probed_save(ckpt, step, *args, **kwargs):
            self.event(f"save_begin {step}")
            path = save(ckpt, step, *args, **kwargs)
            self.event(f"save_end {step}")
            return path

        checkpointer_module.Checkpointer.save = probed_save
        return self

    def _forward(self, module, args) -> None:
        if isinstance(module, TransformerLM):
            self.event("forward")
        elif isinstance(module, DecoderLayer):
            self.event("forward_layer")

    def _wrap(self, owner: object, name: str, describe) -> None:
        original = getattr(owner, name)

        def probed(*args, **kwargs):
            what = describe(*args, **kwargs)
            if what is None:  # not a probe point (e.g. torch.save into memory)
                return original(*args, **kwargs)
            self.event(f"{what} begin")
            result = original(*args, **kwargs)
            self.event(f"{what} end")
            return result

        setattr(owner, name, probed)
