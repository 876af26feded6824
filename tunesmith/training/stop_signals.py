"""The signals that stop a run: Ctrl-C (SIGINT), SIGTERM (a preemption notice, ``kill``) and
SIGHUP (the terminal closed). In training each asks for a checkpoint at the end of the current
step and a clean exit, code 0 (:func:`~tunesmith.training.loop.fit`); a second Ctrl-C aborts at
once. Every launcher passes them on: ``tunesmith run --nproc-per-node N`` sends each one it
receives to every torchrun rank, the Ray trainer group's driver to every trainer actor, so a
run of many ranks stops as one process does. A SIGHUP that the run was started ignoring
(``nohup``) stays ignored.

Example::

    restore = handle_stop_signals(lambda signum, frame: print(signal.Signals(signum).name))
    # kill -HUP <pid>  ->  SIGHUP
    restore()  # the handlers from before
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["STOP_SIGNALS", "handle_stop_signals", "keep_handlers", "stop_signals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, a preemption notice (or ``kill``), the terminal hanging up."""

Handler = Callable[[int, Any], None]


def stop_signals() -> tuple[signal.Signals, ...]:
    """:data:`STOP_SIGNALS` less SIGHUP when this process ignores it (started with ``nohup``:
    the run is meant to outlive its terminal).

    Example::

        >>> [s.name for s in stop_signals()][:2]  # and SIGHUP, unless under nohup
        ['SIGINT', 'SIGTERM']
    """
    nohup = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    return tuple(s for s in STOP_SIGNALS if not (nohup and s == signal.SIGHUP))


def keep_handlers(signals: Sequence[int] = STOP_SIGNALS) -> Callable[[], None]:
    """A function that puts back the handlers ``signals`` have now (one set outside Python,
    which Python cannot name, is left as it is then).

    Example::

        >>> restore = keep_handlers([signal.SIGTERM])
        >>> _ = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        >>> restore()
        >>> signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        False
    """
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def restore() -> None:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)

    return restore


def handle_stop_signals(handler: Handler) -> Callable[[], None]:
    """Install ``handler`` for each of :func:`stop_signals`; returns the function that puts
    the previous handlers back. Only the main thread receives signals: called from another
    thread it installs nothing.

    Example::

        >>> import os
        >>> seen = []
        >>> restore = handle_stop_signals(lambda signum, frame: seen.append(signum))
        >>> os.kill(os.getpid(), signal.SIGTERM)
        >>> restore()
        >>> seen == [signal.SIGTERM]
        True
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    signals = stop_signals()
    restore = keep_handlers(signals)
    for sig in signals:
        signal.signal(sig, handler)
    return restore
