"""Code reward: run the completion's Python against the sample's tests, in a sandbox.

:class:`CodeTests` takes the last fenced Python block of the completion (```` ```python ````,
```` ```py ````, ```` ```python3 ```` or an unlabelled ```` ``` ````), runs it with the
sample's ``metadata["tests"]`` (a list of assert statements or one test code string)
through :func:`~tunesmith.rl.rewards.sandbox.run_sandboxed`, and scores 1.0 when every test
passes, else 0.0, or with ``partial=True`` the fraction of tests that pass.

The solution and each test run in one namespace (the solution as ``__main__``), inside a
small harness that prints a random token once the tests are done: a program that exits
early (``sys.exit(0)``, ``os._exit(0)``) before the tests ran never prints it and scores 0.
Like the sandbox's audit hook this is a best effort: code that reads the harness's frames can
forge it.

Example::

    >>> reward = CodeTests(timeout_s=2)
    >>> completion = "Here:\\n```python\\ndef add(a, b):\\n    return a + b\\n```"
    >>> reward([Sample("", completion, metadata={"tests": ["assert add(1, 2) == 3"]})])
    [1.0]
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tunesmith.rl.rewards.base import Sample
from tunesmith.rl.rewards.sandbox import NETWORK_MODES, run_sandboxed

__all__ = ["CODE_EXTRACT_MODES", "CodeTests", "extract_code"]

CODE_EXTRACT_MODES = ("code_block", "none")

_PYTHON_FENCES = ("", "python", "python3", "py")


def extract_code(text: str, mode: str = "code_block") -> str | None:
    """The code in ``text``: the last fenced Python (or unlabelled) block for
    ``"code_block"``, None when there is none; the whole text for ``"none"``.

    Example::

        >>> extract_code("```bash\\nls\\n```\\n```python\\nprint(1)\\n```")
        'print(1)\\n'
    """
    if mode not in CODE_EXTRACT_MODES:
        raise ValueError(f"extract={mode!r} is not one of {list(CODE_EXTRACT_MODES)}")
    if mode == "none":
        return text
    blocks: list[tuple[str, list[str]]] = []  # (language, lines) of each fenced block
    inside = False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if not stripped.startswith("```"):
            if inside:
                blocks[-1][1].append(line)
        elif inside:
            inside = False
        else:
            inside = True
            blocks.append((stripped[3:].strip().lower(), []))
    found = [lines for language, lines in blocks if language in _PYTHON_FENCES]
    return "".join(found[-1]) if found else None


def _tests(metadata: dict[str, Any]) -> list[str]:
    if "tests" not in metadata:
        raise KeyError(f"CodeTests: the sample has no metadata['tests'] (keys: {sorted(metadata)})")
    tests = metadata["tests"]
    if isinstance(tests, str):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not all(isinstance(t, str) for t in tests):
        raise TypeError(
            f"CodeTests: metadata['tests'] must be a string or a list of strings, got "
            f"{type(tests).__name__}"
        )
    if not tests:
        raise ValueError("CodeTests: metadata['tests'] is empty; nothing to check")
    return list(tests)


def harness(solution: str, tests: Sequence[str], token: str, partial: bool) -> str:
    """The program run in the sandbox: ``solution`` then ``tests`` in one ``__main__``
    namespace, then ``token`` printed (with ``partial``, as ``"<token> <passed>/<n>"``, each
    test counted on its own)."""
    lines = [
        "import sys as _sys, traceback as _traceback",
        "_ns = {'__name__': '__main__', '__builtins__': __builtins__}",
        f"exec(compile({solution!r}, 'solution.py', 'exec'), _ns)",
        "_passed = 0",
        f"for _i, _test in enumerate({list(tests)!r}):",
    ]
    if partial:
        lines += [
            "    try:",
            "        exec(compile(_test, f'test_{_i}.py', 'exec'), _ns)",
            "    except BaseException:",
            "        _traceback.print_exc()",
            "    else:",
            "        _passed += 1",
        ]
    else:
        lines += ["    exec(compile(_test, f'test_{_i}.py', 'exec'), _ns)", "    _passed += 1"]
    lines += [
        "_sys.stdout.flush()",
        f"_sys.stdout.write('\\n' + {token!r} + ' ' + str(_passed) + '/' + str({len(tests)}) + '\\n')",
        "_sys.stdout.flush()",
    ]
    return "\n".join(lines) + "\n"


def _passed_fraction(stdout: str, token: str) -> float | None:
    """``passed / n`` from the harness's last token line, or None when it never printed."""
    for line in reversed(stdout.splitlines()):
        parts = line.strip().split(" ")
        if len(parts) == 2 and parts[0] == token:
            passed, _, total = parts[1].partition("/")
            if passed.isdigit() and total.isdigit() and int(total) > 0:
                return int(passed) / int(total)
    return None


class CodeTests:
    """Score code completions by running their tests in a sandbox (see the module docs).

    Args:
        timeout_s: wall-clock limit per sample, in seconds.
        memory_mb: address-space limit per sample, in MiB.
        extract: ``"code_block"`` (the last fenced Python block; none: score 0) or
            ``"none"`` (the whole completion is the program).
        partial: score the fraction of tests that pass instead of all-or-nothing.
        max_workers: samples run at the same time (each is one child process).
        network: the sandbox's ``network`` mode (``"auto"``, ``"namespace"``,
            ``"audit_hook"``).

    A sample without ``metadata["tests"]`` raises (the
    :class:`~tunesmith.rl.rewards.RewardSet` scores it 0 and counts it).

    Example (YAML)::

        tests: {_component_: tunesmith.rl.rewards.CodeTests, timeout_s: 5, memory_mb: 512}
    """

    name = "code_tests"

    def __init__(
        self,
        timeout_s: float = 5,
        memory_mb: int = 256,
        extract: str = "code_block",
        partial: bool = False,
        max_workers: int = 4,
        network: str = "auto",
        name: str = "code_tests",
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"CodeTests: timeout_s must be a positive number, got {timeout_s!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1:
            raise ValueError(f"CodeTests: memory_mb must be a positive int, got {memory_mb!r}")
        if extract not in CODE_EXTRACT_MODES:
            raise ValueError(f"CodeTests: extract={extract!r} is not one of {CODE_EXTRACT_MODES}")
        if network not in NETWORK_MODES:
            raise ValueError(f"CodeTests: network={network!r} is not one of {NETWORK_MODES}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"CodeTests: max_workers must be a positive int, got {max_workers!r}")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.extract = extract
        self.partial = partial
        self.max_workers = max_workers
        self.network = network
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        if len(samples) <= 1 or self.max_workers == 1:
            return [self.score(s) for s in samples]
        with ThreadPoolExecutor(min(self.max_workers, len(samples))) as pool:
            return list(pool.map(self.score, samples))

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        tests = _tests(sample.metadata)
        code = extract_code(sample.completion, self.extract)
        if code is None or not code.strip():
            return 0.0
        token = secrets.token_hex(16)
        result = run_sandboxed(
            harness(code, tests, token, self.partial),
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            network=self.network,
        )
        fraction = _passed_fraction(result.stdout, token)
        if fraction is None or result.killed_reason is not None:
            return 0.0
        if self.partial:
            return fraction
        return 1.0 if result.returncode == 0 and fraction == 1.0 else 0.0
