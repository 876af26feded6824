"""torchrun without the noise: what ``tunesmith run --nproc-per-node N`` starts.

``python -m tunesmith.cli.torchrun [TORCHRUN ARGS]`` runs torch's own launcher
(``torch.distributed.run``) in this process, with its log lines (rendezvous, warnings, the
failure summary and tracebacks) going to the run's log file (``TUNESMITH_RUN_LOG``) instead of
the console. Started by the CLI in a session of its own (no terminal signal reaches it: the CLI
passes Ctrl-C, SIGTERM and SIGHUP on to the ranks), it gets SIGTERM when the CLI ends however it
ends (Linux), and then stops its ranks as torchrun does on SIGTERM: each rank in training saves
at the end of its step first. When ranks fail it writes one JSON record per failed rank to
``TUNESMITH_FAILURES`` and exits 1; the CLI turns them into one line per failure
(:func:`failure_lines`). Each rank (:mod:`tunesmith.cli.launch`) writes its own one-line error
to the error file torchrun gives it (``TORCHELASTIC_ERROR_FILE``, torch's ``@record`` format)
and its traceback to the log.

Example::

    $ TUNESMITH_RUN_LOG=run.log TUNESMITH_FAILURES=f.json python -m tunesmith.cli.torchrun \\
        --nproc-per-node 2 --standalone -m tunesmith.cli.launch recipe.py config.yaml
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import tempfile
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from tunesmith.config.secrets import redact
from tunesmith.models.atomic import open_no_follow

__all__ = ["FAILURES_ENV", "RUN_LOG_ENV", "failure_lines", "main"]

RUN_LOG_ENV = "TUNESMITH_RUN_LOG"
"""The run's log file: torchrun's output and every rank's (ranks append, lines ``[rankN]: ``)."""
FAILURES_ENV = "TUNESMITH_FAILURES"
"""Where :func:`main` writes the failed ranks as a JSON list (see :func:`failure_lines`)."""

_RANK_PREFIX = re.compile(r"^rank \d+ of \d+: ")


def main(argv: Sequence[str]) -> int:
    """Run torchrun with ``argv``; 0 when every rank succeeded, else 1 (failures recorded)."""
    _stop_with_parent()
    path = os.environ[RUN_LOG_ENV]
    log = _RedactingLog(open_no_follow(path, "a", buffering=1, errors="replace"))
    sys.stdout = sys.stderr = log  # torchrun's prints and warnings; the ranks keep the console
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _log_to(log)
    args = parse_args(list(argv))
    with tempfile.TemporaryDirectory(prefix="tunesmith-torchrun-") as error_files:
        args.log_dir = error_files  # the ranks' error files, gone afterwards
        try:
            run(args)
        except ChildFailedError as error:
            log.write(error.format_msg() + "\n")
            _write_failures([_record(rank, f) for rank, f in error.failures.items()])
            return 1
        except Exception as error:  # rendezvous or launch failed: torchrun's own error
            log.write("".join(traceback.format_exception(error)))
            message = str(error).strip().splitlines()
            _write_failures([{"rank": None, "message": message[0] if message else repr(error)}])
            return 1
    return 0


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop_with_parent() -> None:
    """Ask Linux for SIGTERM to this process when its parent (the CLI) ends, even by SIGKILL or
    SIGQUIT, so no torchrun and no rank outlives the command that started them; elsewhere,
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


class _RedactingLog:
    """The run's log file, with the run's secret values (the environment variables the config
    read, named by the CLI in ``TUNESMITH_SECRET_ENV``) written as ``${oc.env:NAME}``.

    Example::

        >>> import io
        >>> os.environ.update(TUNESMITH_SECRET_ENV="DEMO_TOKEN", DEMO_TOKEN="hf_abcdefghijkl")
        >>> log = _RedactingLog(io.StringIO())
        >>> log.write("token hf_abcdefghijkl refused")
        29
        >>> log.getvalue()
        'token ${oc.env:DEMO_TOKEN} refused'
        >>> del os.environ["TUNESMITH_SECRET_ENV"], os.environ["DEMO_TOKEN"]
    """

    def __init__(self, file: TextIO) -> None:
        self.file = file

    def write(self, text: str) -> int:
        self.file.write(redact(text))
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, encoding, ...
        return getattr(self.file, name)


def _log_to(log: TextIO) -> None:
    """Point every logging handler that writes to the console (torch's) at ``log``."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and not isinstance(
                handler, logging.FileHandler
            ):
                handler.setStream(log)


def _record(rank: int, failure: Any) -> dict[str, Any]:
    """A failed rank as plain data: its exit code, the signal that killed it, and its own
    one-line error when it wrote one (a dict message in torch's error-file format)."""
    data = failure.message if isinstance(failure.message, dict) else {}
    extra = data.get("extraInfo") or {}
    signame = None
    if failure.exitcode < 0:
        try:
            signame = signal.Signals(-failure.exitcode).name
        except ValueError:
            signame = None
    return {
        "rank": rank,
        "exitcode": failure.exitcode,
        "signal": signame,
        "message": data.get("message"),
        "time": float(extra.get("time", failure.timestamp)),
    }


def _write_failures(records: list[dict[str, Any]]) -> None:
    path = os.environ.get(FAILURES_ENV)
    if path:
        records = [{**r, "message": redact(r["message"])} for r in records]
        with open(path, "w") as f:
            json.dump(records, f)


# ------------------------------------------------------------------------- the CLI's lines


def failure_lines(failures: Sequence[Mapping[str, Any]], world_size: int) -> list[str]:
    """One line per distinct failure, the likely root cause first: ranks killed by a signal,
    then ranks' own errors in the order they happened. Ranks that torchrun stopped (SIGTERM,
    no error of their own) after another failed are left out; ranks with the same error share
    one line.

    Example::

        >>> failure_lines([
        ...     {"rank": 0, "exitcode": -15, "signal": "SIGTERM", "message": None, "time": 2.0},
        ...     {"rank": 1, "exitcode": 1, "signal": None, "time": 1.0,
        ...      "message": "dataset.source: no such file"}], 2)
        ['rank 1 of 2: dataset.source: no such file']
        >>> failure_lines([{"rank": r, "exitcode": 1, "signal": None, "message": "bad key",
        ...                 "time": 1.0} for r in range(8)], 8)
        ['ranks 0-7 of 8: bad key']
    """
    ordered = sorted(failures, key=_order)
    own = [f for f in ordered if not _stopped(f)] or ordered
    groups: dict[str, list[int]] = {}
    for failure in own:
        if failure.get("rank") is None:  # torchrun itself
            groups.setdefault(f"torchrun: {failure.get('message')}", [])
            continue
        groups.setdefault(_what(failure), []).append(int(failure["rank"]))
    return [
        f"{_ranks(ranks, world_size)}: {what}" if ranks else what for what, ranks in groups.items()
    ]


def _order(failure: Mapping[str, Any]) -> tuple[int, float, int]:
    killed = failure.get("message") is None and failure.get("signal") not in (None, "SIGTERM")
    return (0 if killed else 1, float(failure.get("time") or 0), int(failure.get("rank") or 0))


def _stopped(failure: Mapping[str, Any]) -> bool:
    return failure.get("message") is None and failure.get("signal") == "SIGTERM"


def _what(failure: Mapping[str, Any]) -> str:
    """The failure without its rank: the rank's own error, or how its process ended."""
    message = failure.get("message")
    if message:
        return _RANK_PREFIX.sub("", str(message).strip())
    code = int(failure.get("exitcode") or 0)
    if failure.get("signal"):
        hint = "; out of memory? see `dmesg`" if failure["signal"] == "SIGKILL" else ""
        return f"killed by {failure['signal']} (signal {-code}){hint}"
    return f"exited with code {code} without an error message"


def _ranks(ranks: list[int], world_size: int) -> str:
    """``[1]`` -> ``'rank 1 of 4'``; ``[0, 1, 2, 5]`` -> ``'ranks 0-2, 5 of 8'``."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]} of {world_size}"
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    parts = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    return f"ranks {', '.join(parts)} of {world_size}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
