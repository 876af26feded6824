"""Child processes for the suite, forked from one server that imported torch and tunesmith once.

A fresh interpreter pays 5 to 10 s of imports (torch, transformers, tunesmith) on a 2-core
machine, and the suite starts hundreds of ranks and runs. A child of :data:`CONTEXT` is forked
from a ``multiprocessing`` fork server that already imported them (this module and
:mod:`tests.faults.child`), so it starts in well under a second, and it is still a process of
its own: its own pid, signals, gloo rank and environment. The pytest process itself never forks
after running torch code (the server is a clean interpreter). Where the launcher is what a test
checks (``torchrun``, ``tunesmith run --nproc-per-node``, multi-node), tests still start real
interpreters.

Example::

    process = start(run_module, "tunesmith.cli.launch", [recipe, config], log=log, env=env)
    assert wait_all([process], timeout=120) == [0]
    assert run_cli(["ls"]).returncode == 0  # `tunesmith ls`, as subprocess.run would report it
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import transformers  # noqa: F401  (imported once in the server, not in every child)
import transformers.modeling_utils  # noqa: F401  (the transformers backend's ranks need it)

import tunesmith.cli.launch  # noqa: F401
import tunesmith.recipes.dpo  # noqa: F401
import tunesmith.recipes.kd  # noqa: F401
import tunesmith.recipes.sft  # noqa: F401
from tunesmith.cli.main import main

CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["tests.forked", "tests.faults.child"])


def start(
    target: Callable[..., Any],
    *args: Any,
    log: str | os.PathLike | None = None,
    err: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
) -> BaseProcess:
    """Start ``target(*args)`` in a forked child with stdout appended to ``log`` and stderr to
    ``err`` (or to ``log`` too; both left as they are when no ``log``) and ``env`` as its whole
    environment (when given; else the server's), one intra-op thread. Its exit code is
    ``target``'s ``sys.exit`` code, 1 when it raises."""
    files = [log and str(log), err and str(err)]
    process = CONTEXT.Process(target=_enter, args=(target, args, files, env))
    process.start()
    return process


def redirect_output(out: str | None, err: str | None = None) -> None:
    """This process's stdout appended to the file ``out`` and stderr to ``err`` (``out`` when
    None), line-buffered; C and C++ output too (file descriptors 1 and 2)."""
    for fd, (path, stream) in enumerate(zip((out, err or out), (sys.stdout, sys.stderr)), 1):
        if path is not None:
            file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(file, fd)
            os.close(file)
            stream.reconfigure(line_buffering=True)


def _enter(
    target: Callable[..., Any], args: tuple, files: list[str | None], env: dict[str, str] | None
) -> Any:
    redirect_output(*files)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    torch.set_num_threads(1)  # as the in-process runs (and OMP_NUM_THREADS=1 in subprocesses)
    return target(*args)


class Child:
    """A forked child with the part of :class:`subprocess.Popen`'s interface the tests use
    (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``: ``-N`` when signal
    N ended it), so a test written for a subprocess reads the same.

    Example::

        run = Child.cli(["run", "sft", "--config", "tiny", *overrides], log)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 0
    """

    def __init__(self, process: BaseProcess) -> None:
        self.process, self.pid = process, process.pid

    @classmethod
    def cli(
        cls, args: Sequence[str], log: str | os.PathLike, *, env: dict[str, str] | None = None
    ) -> Child:
        """``tunesmith ARGS`` with its output in ``log`` and ``env`` (default: this process's)."""
        return cls.module("tunesmith.cli.main", args, log, env=env)

    @classmethod
    def module(
        cls,
        module: str,
        args: Sequence[str],
        log: str | os.PathLike,
        *,
        env: dict[str, str] | None = None,
    ) -> Child:
        """``python -m MODULE ARGS`` with its output in ``log``."""
        argv = [str(a) for a in args]
        environment = dict(os.environ) if env is None else env
        return cls(start(run_module, module, argv, log=log, env=environment))

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.process.name), timeout or 0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()


def run_cli(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    """``tunesmith ARGS`` (the console script's function, :func:`tunesmith.cli.main.main`) in a
    forked child, in ``cwd``, with ``env`` (default: this process's environment), reported as
    ``subprocess.run(..., capture_output=True, text=True)`` would; past ``timeout`` s it is
    killed and :class:`subprocess.TimeoutExpired` raised."""
    argv = [str(a) for a in args]
    with tempfile.TemporaryDirectory(prefix="tunesmith_cli_") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        started = time.monotonic()
        child = start(
            _cli,
            cwd and str(cwd),
            argv,
            log=out,
            err=err,
            env=dict(os.environ) if env is None else env,
        )
        (code,) = wait_all([child], timeout=timeout)
        if code == -9 and time.monotonic() - started >= timeout:
            raise subprocess.TimeoutExpired(["tunesmith", *argv], timeout)
        stdout = out.read_text() if out.exists() else ""
        stderr = err.read_text() if err.exists() else ""
        return subprocess.CompletedProcess(["tunesmith", *argv], code, stdout, stderr)


def _cli(cwd: str | None, argv: list[str]) -> None:
    if cwd is not None:
        os.chdir(cwd)
    sys.argv = ["tunesmith", *argv]
    sys.exit(main(argv))


def run_module(module: str, argv: Sequence[str]) -> None:
    """``python -m MODULE ARGV...`` in this process (for :func:`start`)."""
    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_script(path: str, argv: Sequence[str], cwd: str) -> None:
    """``python PATH ARGV...`` run in ``cwd``, in this process (for :func:`start`): the
    script's folder first on ``sys.path``, as the interpreter puts it."""
    os.chdir(cwd)
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).resolve().parent))
    runpy.run_path(path, run_name="__main__")


def wait_all(processes: list[BaseProcess], *, timeout: float) -> list[int]:
    """Wait for every process and return their exit codes; when one fails (a non-zero code) the
    others are killed at once (they would wait in a collective until it times out), and so is
    every process still running after ``timeout`` s (its code: ``-9``)."""
    deadline = time.monotonic() + timeout
    running = list(processes)
    while running:
        left = deadline - time.monotonic()
        ready = wait([p.sentinel for p in running], timeout=max(left, 0))
        for process in [p for p in running if p.sentinel in ready]:
            process.join()
            running.remove(process)
            if process.exitcode != 0:
                left = 0
        if left <= 0:
            for process in running:
                process.kill()
                process.join()
            break
    return [p.exitcode for p in processes]


__all__ = [
    "CONTEXT",
    "Child",
    "redirect_output",
    "run_cli",
    "run_module",
    "run_script",
    "start",
    "wait_all",
]
