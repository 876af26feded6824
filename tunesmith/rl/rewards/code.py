"""Code reward: run the completion's Python against the sample's tests, in a sandbox.

:class:`CodeTests` takes the last fenced Python block of the completion (```` ```python ````,
```` ```py ````, ```` ```python3 ```` or an unlabelled ```` ``` ````), runs it with the
sample's ``metadata["tests"]`` through :func:`~tunesmith.rl.rewards.sandbox.run_sandboxed`,
and scores 1.0 when every test passes, else 0.0, or with ``partial=True`` the fraction of
tests that pass. A test is

- a string of Python: ``assert`` statements (and setup statements such as ``x = [3, 1]``);
  a list of strings is a list of tests, one string may hold several asserts (one test);
- or ``{"input": "...", "output": "..."}``: the program is run with that stdin and passes when
  its stdout equals ``output`` (trailing whitespace of each line and trailing blank lines
  ignored).

**Where a test is decided.** The solution runs in the same interpreter as the harness that
runs its tests, so anything that interpreter says can be forged by a solution that targets the
harness (reads its source, prints its records, patches ``json``). The pass/fail of a test is
therefore decided in the parent, on plain data: each ``assert`` is split (:func:`plan_test`)
into the literal values (kept in the parent, never sent to the child) and the other operands
of its comparisons, ``and``, ``or`` and ``not`` (*probes*: expressions the child evaluates and
sends back as strict JSON: ``None``, ``bool``, ``int``, ``float``, ``str`` and ``list``,
``tuple``, ``dict``, ``set``, ``frozenset``, ``bytes`` of them, exact types only). The parent
evaluates the comparisons on the decoded builtin values, so ``assert add(1, 2) == 3`` passes
only when the child sends ``3``: an object with an always-true ``__eq__`` is not JSON and
fails, and a forged record must guess the expected value. What stays forgeable, and is only as
strong as the child: a comparison whose other side is computed in the child too
(``assert f(x) == g(x)``, ``assert abs(f(1) - 0.5) < 1e-6``) and asserts inside loops,
``if``, ``with`` or functions (run in the child, which reports that they did not raise).
Prefer ``assert <call> == <literal>`` or I/O tests for RL rewards. I/O tests compare the
program's stdout in the parent.

Example::

    >>> reward = CodeTests(timeout_s=2)
    >>> completion = "Here:\\n```python\\ndef add(a, b):\\n    return a + b\\n```"
    >>> reward([Sample("", completion, metadata={"tests": ["assert add(1, 2) == 3"]})])
    [1.0]
"""

from __future__ import annotations

import ast
import contextlib
import json
import operator
import secrets
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from tunesmith.config.registry import component
from tunesmith.rl.rewards.base import Sample
from tunesmith.rl.rewards.sandbox import (
    BEST_EFFORT_GAPS,
    ISOLATION_MODES,
    Isolation,
    resolve_isolation,
    run_sandboxed,
)

__all__ = ["CODE_EXTRACT_MODES", "CodeTests", "decode_plain", "extract_code", "plan_test"]

CodeExtractMode = Literal["code_block", "none"]
CODE_EXTRACT_MODES: tuple[str, ...] = get_args(CodeExtractMode)

_PYTHON_FENCES = ("", "python", "python3", "py")
_OUTPUT_BYTES = 4 << 20
_WARNED: set[str] = set()


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


def _tests(metadata: dict[str, Any]) -> list:
    if "tests" not in metadata:
        raise KeyError(f"CodeTests: the sample has no metadata['tests'] (keys: {sorted(metadata)})")
    tests = metadata["tests"]
    if isinstance(tests, (str, dict)):
        tests = [tests]
    if not isinstance(tests, (list, tuple)) or not all(_is_test(t) for t in tests):
        raise TypeError(
            "CodeTests: metadata['tests'] must be a string, an {'input', 'output'} dict of "
            f"strings, or a list of them; got {type(tests).__name__}"
        )
    if not tests:
        raise ValueError("CodeTests: metadata['tests'] is empty; nothing to check")
    return list(tests)


def _is_test(test: object) -> bool:
    if isinstance(test, dict):
        return set(test) == {"input", "output"} and all(isinstance(v, str) for v in test.values())
    return isinstance(test, str)


# ----------------------------------------------------------------------------- plans

_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_, ast.IsNot: operator.is_not,
}  # fmt: skip


@dataclass
class TestPlan:
    """One test split for the child and the parent.

    ``steps`` are what the child runs in order: ``("exec", source)`` (run; the child reports
    that it did not raise) or ``("probe", source)`` (evaluated; the child sends the value).
    ``checks`` are what the parent evaluates: trees over probe numbers (``("probe", k)``,
    ``("lit", value)``, ``("cmp", [op...], [tree...])``, ``("and"|"or", [tree...])``,
    ``("not", tree)``), one per assert, each true for the test to pass."""

    steps: list[tuple[str, str]] = field(default_factory=list)
    checks: list[tuple] = field(default_factory=list)

    @property
    def opaque(self) -> bool:
        """Some step's outcome is decided in the child (see the module docs)."""
        return any(kind == "exec" for kind, _ in self.steps)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _tree(node: ast.expr, plan: TestPlan) -> tuple:
    """The parent's check tree of ``node``; its non-literal leaves become probes of ``plan``."""
    is_literal, value = _literal(node)
    if is_literal:
        return ("lit", value)
    if isinstance(node, ast.BoolOp):
        kind = "and" if isinstance(node.op, ast.And) else "or"
        return (kind, [_tree(v, plan) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _tree(node.operand, plan))
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        operands = [_tree(n, plan) for n in (node.left, *node.comparators)]
        return ("cmp", [type(op) for op in node.ops], operands)
    plan.steps.append(("probe", ast.unparse(node)))
    return ("probe", sum(kind == "probe" for kind, _ in plan.steps) - 1)


def plan_test(test: str) -> TestPlan:
    """Split the test ``test`` (Python source) into the child's steps and the parent's checks.

    Example::

        >>> plan = plan_test("assert add(1, 2) == 3")
        >>> plan.steps, plan.checks
        ([('probe', 'add(1, 2)')], [('cmp', [<class 'ast.Eq'>], [('probe', 0), ('lit', 3)])])
    """
    try:
        module = ast.parse(test, "<test>")
    except SyntaxError as e:
        raise ValueError(
            f"CodeTests: a test is not valid Python ({e.msg}, line {e.lineno}): {test[:80]!r}"
        ) from None
    plan = TestPlan()
    for statement in module.body:
        if isinstance(statement, ast.Assert):
            plan.checks.append(_tree(statement.test, plan))
        else:
            plan.steps.append(("exec", ast.unparse(statement)))
    return plan


class _Missing(Exception):
    """A probe the child did not report (or reported twice, or as an error)."""


def _evaluate(tree: tuple, values: dict[int, Any]) -> Any:
    kind = tree[0]
    if kind == "lit":
        return tree[1]
    if kind == "probe":
        if tree[1] not in values:
            raise _Missing(tree[1])
        return values[tree[1]]
    if kind == "not":
        return not _evaluate(tree[1], values)
    if kind in ("and", "or"):
        result = None
        for item in tree[1]:
            result = _evaluate(item, values)
            if bool(result) == (kind == "or"):
                return result
        return result
    left = _evaluate(tree[2][0], values)
    for op, operand in zip(tree[1], tree[2][1:], strict=True):
        right = _evaluate(operand, values)
        if not _COMPARE[op](left, right):
            return False
        left = right
    return True


def decode_plain(value: Any) -> Any:
    """The builtin value of the child's tagged JSON (``{"T": [...]}`` a tuple, ``"D"`` a dict,
    ``"S"`` a set, ``"F"`` a frozenset, ``"B"`` bytes in hex).

    Example::

        >>> decode_plain({"T": [1, {"S": ["a"]}]})
        (1, {'a'})
    """
    if isinstance(value, list):
        return [decode_plain(v) for v in value]
    if not isinstance(value, dict):
        return value
    ((tag, body),) = value.items()
    if tag == "B":
        return bytes.fromhex(body)
    items = [decode_plain(v) for v in body]
    if tag == "D":
        return dict(items)
    return {"T": tuple, "S": set, "F": frozenset}[tag](items)


# ----------------------------------------------------------------------------- the harness

# Runs in the sandbox: the solution, then each test's steps; every record is one line
# "<token> <json>" written straight to fd 1. Values are converted to plain data by exact type.
_HARNESS = r"""
import json as _json, os as _os, sys as _sys
def _plain(v, _type=type, _list=list, _sorted=sorted, _repr=repr):
    t = _type(v)
    if t in (int, float, str, bool) or v is None:
        return v
    if t is list:
        return [_plain(x) for x in v]
    if t is tuple:
        return {"T": [_plain(x) for x in v]}
    if t is dict:
        return {"D": [[_plain(k), _plain(x)] for k, x in v.items()]}
    if t in (set, frozenset):
        return {"S" if t is set else "F": _sorted((_plain(x) for x in v), key=_repr)}
    if t is bytes:
        return {"B": v.hex()}
    raise TypeError(f"a {t.__name__} cannot be sent to the parent (only plain builtin types)")
def _say(record, _dumps=_json.dumps, _write=_os.write):
    data = ("\n" + TOKEN + " " + _dumps(record) + "\n").encode()
    while data:
        data = data[_write(1, data):]
_ns = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(SOLUTION, "solution.py", "exec"), _ns)
except BaseException as _e:
    _say({"solution": type(_e).__name__})
    raise
_say({"solution": "ok"})
for _t, _steps in enumerate(PLAN):
    for _s, (_kind, _src) in enumerate(_steps):
        try:
            if _kind == "exec":
                exec(compile(_src, f"test_{_t}.py", "exec"), _ns)
                _say({"t": _t, "s": _s, "ok": True})
            else:
                _say({"t": _t, "s": _s, "v": _plain(eval(compile(_src, f"test_{_t}.py", "eval"), _ns))})
        except BaseException as _e:
            _sys.__excepthook__(type(_e), _e, _e.__traceback__)  # C: no frame is read
            _say({"t": _t, "s": _s, "error": type(_e).__name__})
            if _kind == "exec":
                break
_say({"end": True})
"""


def harness(solution: str, plans: Sequence[TestPlan], token: str) -> str:
    """The program run in the sandbox: ``solution`` then each plan's steps (see the module
    docs); no expected value is in it."""
    plan = [[list(step) for step in p.steps] for p in plans]
    header = f"TOKEN = {token!r}\nSOLUTION = {solution!r}\nPLAN = {plan!r}\n"
    return header + _HARNESS


def _records(stdout: str, token: str) -> list[dict]:
    records = []
    for line in stdout.splitlines():
        if line.startswith(token + " "):
            try:
                record = json.loads(line[len(token) + 1 :])
            except (ValueError, RecursionError):
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _passed(plan: TestPlan, index: int, records: list[dict]) -> bool:
    """Whether test ``index`` passed: every exec step reported once as done, every probe
    reported once with a value, and every check true on those values, in the parent."""
    mine: dict[int, list[dict]] = {}
    for r in records:
        if r.get("t") == index and isinstance(r.get("s"), int):
            mine.setdefault(r["s"], []).append(r)
    values: dict[int, Any] = {}
    probe = 0
    for step, (kind, _) in enumerate(plan.steps):
        got = mine.get(step, [])
        if len(got) != 1 or "error" in got[0]:
            if kind == "exec":
                return False
        elif kind == "exec" and got[0].get("ok") is not True:
            return False
        elif kind == "probe" and "v" in got[0]:
            with contextlib.suppress(
                ValueError, TypeError, KeyError, AttributeError, RecursionError
            ):
                values[probe] = decode_plain(got[0]["v"])
        probe += kind == "probe"
    try:
        return all(bool(_evaluate(check, values)) for check in plan.checks)
    except (_Missing, TypeError, ValueError, RecursionError):
        return False


def _same_output(got: str, expected: str) -> bool:
    def norm(text: str) -> list[str]:
        lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


@component
class CodeTests:
    """Score code completions by running their tests in a sandbox (see the module docs).

    Args:
        timeout_s: wall-clock limit per sample (per I/O test), in seconds.
        memory_mb: address-space limit per sample, in MiB.
        extract: ``"code_block"`` (the last fenced Python block; none: score 0) or
            ``"none"`` (the whole completion is the program).
        partial: score the fraction of tests that pass instead of all-or-nothing.
        max_workers: samples run at the same time (each is one sandbox).
        isolation: the sandbox's mode: ``"auto"`` (namespaces; refused with one line where
            this machine has no user namespaces), ``"namespaces"``, or ``"best_effort"``
            (the unprotected opt-in; see
            :data:`~tunesmith.rl.rewards.sandbox.BEST_EFFORT_GAPS`, printed once).
        site_packages: solutions may import this interpreter's installed packages (default:
            the standard library only).

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
        extract: CodeExtractMode = "code_block",
        partial: bool = False,
        max_workers: int = 4,
        isolation: Isolation = "auto",
        site_packages: bool = False,
        name: str = "code_tests",
    ) -> None:
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"CodeTests: timeout_s must be a positive number, got {timeout_s!r}")
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1:
            raise ValueError(f"CodeTests: memory_mb must be a positive int, got {memory_mb!r}")
        if extract not in CODE_EXTRACT_MODES:
            raise ValueError(f"CodeTests: extract={extract!r} is not one of {CODE_EXTRACT_MODES}")
        if isolation not in ISOLATION_MODES:
            raise ValueError(f"CodeTests: isolation={isolation!r} is not one of {ISOLATION_MODES}")
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"CodeTests: max_workers must be a positive int, got {max_workers!r}")
        try:
            self.isolation = resolve_isolation(isolation)
        except RuntimeError as e:
            raise RuntimeError(f"CodeTests: {e}") from None
        if self.isolation == "best_effort" and "best_effort" not in _WARNED:
            _WARNED.add("best_effort")
            print(f"tunesmith: warning: CodeTests: {BEST_EFFORT_GAPS}", file=sys.stderr)
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.extract = extract
        self.partial = partial
        self.site_packages = bool(site_packages)
        self.max_workers = max_workers
        self.name = name

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        if len(samples) <= 1 or self.max_workers == 1:
            return [self.score(s) for s in samples]
        with ThreadPoolExecutor(min(self.max_workers, len(samples))) as pool:
            return list(pool.map(self.score, samples))

    def _run(self, code: str, stdin: str = ""):
        return run_sandboxed(
            code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            stdin=stdin,
            isolation=self.isolation,
            max_output_bytes=_OUTPUT_BYTES,
            site_packages=self.site_packages,
        )

    def score(self, sample: Sample) -> float:
        """The score of one sample."""
        tests = _tests(sample.metadata)
        code = extract_code(sample.completion, self.extract)
        if code is None or not code.strip():
            return 0.0
        passed = [False] * len(tests)
        asserts = [(i, plan_test(t)) for i, t in enumerate(tests) if isinstance(t, str)]
        ran_clean = True
        if asserts:
            token = secrets.token_hex(16)
            result = self._run(harness(code, [p for _, p in asserts], token))
            records = _records(result.stdout, token)
            ran_clean = result.ok
            if result.killed_reason is None:
                for number, (i, plan) in enumerate(asserts):
                    passed[i] = _passed(plan, number, records)
        for i, test in enumerate(tests):
            if isinstance(test, dict):
                result = self._run(code, test["input"])
                passed[i] = result.ok and _same_output(result.stdout, test["output"])
        if self.partial:
            return sum(passed) / len(tests)
        return 1.0 if ran_clean and all(passed) else 0.0
