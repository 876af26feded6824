"""Console plumbing shared by the launchers: a stream that writes to the console and a log.

Example::

    >>> import io
    >>> console, log = io.StringIO(), io.StringIO()
    >>> tee = Tee(console, log)
    >>> _ = tee.write("step 1\\n"), tee.write("\\r 50%|#####     |")
    >>> console.getvalue(), log.getvalue()
    ('step 1\\n\\r 50%|#####     |', 'step 1\\n')
"""

from __future__ import annotations

from typing import Any, TextIO

__all__ = ["Tee"]


class Tee:
    """Writes to ``console`` and to ``log``; progress-bar redraws (text with ``\\r``) go to
    the console only. ``tty``: what :meth:`isatty` answers (default: the console's), so
    ``progress_bar: auto`` decides as the user's terminal would. Other attributes
    (``encoding``, ``fileno``, ...) are the console's."""

    def __init__(self, console: TextIO, log: TextIO, tty: bool | None = None) -> None:
        self.console, self.log, self.tty = console, log, tty

    def write(self, text: str) -> int:
        self.console.write(text)
        if "\r" not in text:
            self.log.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return self.console.isatty() if self.tty is None else self.tty

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)
