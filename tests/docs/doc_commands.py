"""The shell commands a Markdown page shows, as the docs test runs them.

A fenced block whose info string is ``bash``, ``sh`` or ``shell`` holds commands, one per line
(``\\`` continues a line; ``#`` starts a comment outside quotes). A ``console`` block is a
transcript: each ``$ `` line is a command and the lines up to the next ``$ `` line are the
output it shows. Every other fenced block must say what it holds (``text``, ``yaml``,
``python``, ...): :func:`untagged_blocks` finds the ones that do not, so that no command can
hide from the test in an unlabelled block.

Example::

    >>> page = "```bash\\ntunesmith ls   # recipes\\n```\\n"
    >>> [c.text for c in page_commands(page, "README.md")]
    ['tunesmith ls']
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "SHELL_TAGS",
    "DocCommand",
    "FencedBlock",
    "doc_commands",
    "fenced_blocks",
    "page_commands",
    "strip_comment",
    "untagged_blocks",
]

SHELL_TAGS = ("bash", "sh", "shell")
_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


@dataclass(frozen=True)
class FencedBlock:
    """A fenced code block: its info string (``""`` when none), the page line of its opening
    fence (1-based) and its lines."""

    tag: str
    line: int
    lines: tuple[str, ...]


@dataclass(frozen=True)
class DocCommand:
    """One command of a page: where it is, its text (comment and surrounding blanks removed)
    and, from a ``console`` block, the output lines the page shows for it."""

    file: str
    line: int
    text: str
    shown_output: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text}"


def fenced_blocks(page: str) -> list[FencedBlock]:
    """Every fenced block of the Markdown text ``page``, in order. An unclosed fence raises
    ValueError naming its line.

    Example::

        >>> fenced_blocks("a\\n```yaml\\nx: 1\\n```\\n")
        [FencedBlock(tag='yaml', line=2, lines=('x: 1',))]
    """
    blocks: list[FencedBlock] = []
    lines = page.splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, start = match.group(2), i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start + 1}: fenced block is never closed")
        blocks.append(FencedBlock(match.group(3), start + 1, tuple(body)))
        i += 1
    return blocks


def strip_comment(line: str) -> str:
    """``line`` without a trailing shell comment (a ``#`` after a blank, outside quotes).

    Example::

        >>> strip_comment('tunesmith generate x --prompt "a # b"   # a reply')
        'tunesmith generate x --prompt "a # b"'
    """
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def page_commands(page: str, file: str) -> list[DocCommand]:
    """The commands of the Markdown text ``page`` (named ``file`` in the results), in order."""
    commands: list[DocCommand] = []
    for block in fenced_blocks(page):
        if block.tag in SHELL_TAGS:
            commands += _shell_commands(block, file)
        elif block.tag == "console":
            commands += _console_commands(block, file)
    return commands


def _shell_commands(block: FencedBlock, file: str) -> list[DocCommand]:
    out: list[DocCommand] = []
    pending, first = "", 0
    for offset, raw in enumerate(block.lines, start=block.line + 1):
        text = strip_comment(raw).strip()
        if not text and not pending:
            continue
        if not pending:
            first = offset
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        out.append(DocCommand(file, first, (pending + text).strip()))
        pending = ""
    if pending:
        raise ValueError(f"{file}:{first}: a command ends in a line continuation")
    return out


def _console_commands(block: FencedBlock, file: str) -> list[DocCommand]:
    out: list[DocCommand] = []
    for offset, raw in enumerate(block.lines, start=block.line + 1):
        if raw.startswith("$ "):
            out.append(DocCommand(file, offset, strip_comment(raw[2:]).strip()))
        elif out:
            last = out[-1]
            out[-1] = DocCommand(last.file, last.line, last.text, (*last.shown_output, raw))
        elif raw.strip():
            raise ValueError(f"{file}:{offset}: a console block must start with a `$ ` line")
    return out


def untagged_blocks(page: str) -> list[int]:
    """The lines of the fenced blocks of ``page`` that have no info string."""
    return [block.line for block in fenced_blocks(page) if not block.tag]


def doc_commands(files: list[Path], root: Path) -> list[DocCommand]:
    """The commands of every page in ``files``, named by their path relative to ``root``."""
    out: list[DocCommand] = []
    for path in files:
        out += page_commands(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    return out
