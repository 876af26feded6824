"""The code sandbox and the code-test reward: real child processes, short limits.

Each test runs real programs (nothing is mocked): loops are killed at the wall timeout,
memory bombs stop at the address-space limit, sockets fail, the host's files are out of reach
(namespaces) or writes outside the temporary folder are refused (best effort), and nothing is
left behind. Every test runs in each isolation mode this machine offers
(:func:`available_isolation`: namespaces where user namespaces are allowed, best effort always,
opted into by name); ``auto`` must pick namespaces or refuse with the opt-in. The escape
routes are in ``tests/faults/test_sandbox_escapes.py``."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from tunesmith.rl.rewards import (
    CodeTests,
    RewardSet,
    Sample,
    available_isolation,
    extract_code,
    namespaces_available,
    run_sandboxed,
)
from tunesmith.rl.rewards.code import decode_plain, plan_test

TIMEOUT = 1.0
MARGIN = 1.5  # interpreter start-up and process teardown on a loaded 2-core machine
MODES = available_isolation()


def _run(code: str, **kwargs):
    kwargs.setdefault("timeout_s", TIMEOUT)
    kwargs.setdefault("memory_mb", 256)
    return run_sandboxed(code, **kwargs)


@pytest.mark.parametrize("isolation", MODES)
def test_a_program_runs_with_stdin_and_an_empty_environment(isolation) -> None:
    result = _run(
        "import os, sys\nprint(input()[::-1])\nprint(sorted(os.environ))\n"
        "print('cwd', os.getcwd())\nprint(sys.flags.isolated)\nsys.exit(3)",
        stdin="abc\n",
        isolation=isolation,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "cba", result.stderr
    # PATH, HOME and TMPDIR only (the C runtime may add LC_CTYPE for the UTF-8 locale)
    assert set(eval(lines[1])) - {"LC_CTYPE"} == {"PATH", "HOME", "TMPDIR"}
    assert lines[3] == "1"
    assert result.returncode == 3 and not result.ok and result.killed_reason is None
    assert result.isolation == isolation


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize("program", ["while True: pass", "import time\ntime.sleep(60)"])
def test_an_endless_program_is_killed_at_the_wall_timeout(program, isolation) -> None:
    start = time.monotonic()
    result = _run(program, isolation=isolation)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.killed_reason == "wall_timeout"
    assert result.returncode < 0
    assert TIMEOUT <= elapsed < TIMEOUT + MARGIN


def _processes_with(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_the_whole_namespace_is_killed_with_its_program() -> None:
    if "namespaces" not in MODES:
        assert not namespaces_available()
        return
    mark = f"tunesmith-orphan-{os.getpid()}-{time.monotonic_ns()}"
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {mark!r}])\n"
        "time.sleep(0.3)\nprint('forked', flush=True)\nwhile True: pass\n"
    )
    result = _run(program, isolation="namespaces")
    assert result.killed_reason == "wall_timeout" and "forked" in result.stdout, result.stderr
    deadline = time.monotonic() + 2
    while _processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _processes_with(mark), "a detached child survived the sandbox"


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize(
    "program",
    ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(10**6))"],
)
def test_a_memory_bomb_fails_within_its_limit(program, isolation) -> None:
    result = _run(program, memory_mb=128, timeout_s=5, isolation=isolation)
    assert result.returncode == 1 and not result.timed_out
    assert "MemoryError" in result.stderr
    assert result.wall_s < 5


@pytest.mark.parametrize("isolation", MODES)
def test_a_socket_to_localhost_fails(isolation) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        result = _run(
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('in')",
            isolation=isolation,
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert result.returncode == 1 and "in" not in result.stdout
    if isolation == "best_effort":
        assert "PermissionError: sandbox: socket.__new__" in result.stderr
    else:  # the namespace has no usable interface, not even loopback
        assert "Network is unreachable" in result.stderr


def test_auto_is_namespaces_or_a_refusal_naming_the_opt_in() -> None:
    if namespaces_available():
        assert _run("pass", isolation="auto").isolation == "namespaces"
        assert _run("pass").isolation == "namespaces"
        return
    with pytest.raises(RuntimeError, match="isolation='best_effort'"):
        _run("pass")
    with pytest.raises(RuntimeError, match="CodeTests: .*isolation='best_effort'"):
        CodeTests()


@pytest.mark.parametrize(
    ("program", "refused"),
    [
        ("import os\nos.system('true')", "os.system"),
        ("import os\nos.kill(os.getppid(), 0)", "os.kill on"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit"),
        ("open({outside!r}, 'w').write('x')", "opening"),
        ("import os\nos.remove({outside!r})", "os.remove"),
        ("import os\nos.symlink({outside!r}, 'link')\nopen('link', 'w').write('x')", "os.symlink"),
        ("import ctypes", "importing ctypes"),
        ("import gc\ngc.get_objects()", "importing gc"),
    ],
)
def test_the_best_effort_audit_hook_refuses(program, refused, tmp_path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    result = _run(program.format(outside=str(outside)), isolation="best_effort")
    assert result.returncode == 1
    assert f"PermissionError: sandbox: {refused}" in result.stderr
    assert outside.read_text() == "keep"


def _sandbox_folders() -> set[str]:
    return {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tunesmith-sandbox-")}


@pytest.fixture
def own_temp(tmp_path_factory, monkeypatch) -> Path:
    """A temporary folder of this test's own as the process's default (where the sandboxes
    make theirs): another test running beside it (``make test``'s other worker) cannot add
    or remove sandbox folders in it."""
    folder = tmp_path_factory.mktemp("temp")
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.parametrize("isolation", MODES)
def test_files_stay_in_a_temporary_place_that_is_removed(
    isolation, tmp_path, monkeypatch, own_temp
) -> None:
    monkeypatch.chdir(tmp_path)
    before = _sandbox_folders()
    program = (
        "import os, tempfile\n"
        "open('out.txt', 'w').write('data')\n"
        "os.mkdir('sub')\nos.rename('out.txt', 'sub/moved.txt')\n"
        "with tempfile.NamedTemporaryFile(delete=False) as f:\n    f.write(b'x')\n"
        "os.chmod('sub', 0)\n"  # removal must still work
        "print(os.getcwd())\nprint(f.name)\n"
    )
    result = _run(program, isolation=isolation)
    assert result.ok, result.stderr
    cwd, temp_file = result.stdout.splitlines()
    if isolation == "best_effort":
        assert Path(cwd).parent.parent == Path(tempfile.gettempdir()).resolve()
        assert Path(temp_file).parent == Path(cwd)  # TMPDIR points into the sandbox
        assert not Path(cwd).exists() and not Path(cwd).parent.exists()
    else:  # its own root: /sandbox and /tmp exist only in the sandbox's tmpfs
        assert (cwd, str(Path(temp_file).parent)) == ("/sandbox", "/tmp")
    assert list(tmp_path.iterdir()) == []  # nothing landed where the caller was
    assert _sandbox_folders() <= before


@pytest.mark.parametrize("isolation", MODES)
def test_long_output_is_cut_in_the_middle(isolation) -> None:
    result = _run("print('a' * 5000)\nprint('end')", max_output_bytes=1000, isolation=isolation)
    assert len(result.stdout) < 1100
    assert result.stdout.startswith("a" * 400) and result.stdout.endswith("end\n")
    assert "bytes cut" in result.stdout


@pytest.mark.parametrize("isolation", MODES)
def test_a_big_file_hits_the_size_limit(isolation) -> None:
    result = _run("open('big', 'wb').write(b'x' * (3 << 20))", file_mb=1, isolation=isolation)
    assert result.returncode == 1 and "File too large" in result.stderr


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        run_sandboxed("pass", timeout_s=0, memory_mb=64)
    with pytest.raises(ValueError, match="memory_mb"):
        run_sandboxed("pass", timeout_s=1, memory_mb=0.5)
    with pytest.raises(ValueError, match="isolation='none'"):
        run_sandboxed("pass", timeout_s=1, memory_mb=64, isolation="none")
    with pytest.raises(ValueError, match="isolation='audit_hook'"):
        CodeTests(isolation="audit_hook")


# ----------------------------------------------------------------------------- CodeTests

SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def _code_sample(completion: str, tests=TESTS) -> Sample:
    return Sample("Write add(a, b).", completion, metadata={"tests": tests})


def test_extract_code() -> None:
    text = "```bash\nls\n```\nthen\n```python\nx = 1\n```\n```py\ny = 2\n```\n```js\nz\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("no code") is None
    assert extract_code("print(1)", "none") == "print(1)"


def test_a_test_is_split_into_child_probes_and_parent_values() -> None:
    plan = plan_test("x = [3, 1]\nassert sort(x) == [1, 3] and not f(x)\nassert 0 < g() <= 2")
    assert plan.steps == [
        ("exec", "x = [3, 1]"),
        ("probe", "sort(x)"),
        ("probe", "f(x)"),
        ("probe", "g()"),
    ]
    assert "[1, 3]" not in repr(plan.steps)  # the expected value never reaches the child
    assert plan.opaque and not plan_test("assert f(1) == 2").opaque
    assert decode_plain({"D": [[{"T": [1, 2]}, {"F": ["a"]}]]}) == {(1, 2): frozenset("a")}
    with pytest.raises(ValueError, match="not valid Python"):
        plan_test("assert (")


@pytest.mark.parametrize("isolation", MODES)
def test_code_tests_scores(isolation) -> None:
    reward = CodeTests(timeout_s=2, isolation=isolation)
    samples = [
        _code_sample("Sure:\n" + SOLUTION + "\nDone."),  # right
        _code_sample(SOLUTION.replace("a + b", "a - b")),  # wrong
        _code_sample("```python\ndef add(a, b):\n    while True: pass\n```"),  # loops
        _code_sample("```python\nimport sys\nsys.exit(0)\n```"),  # exits before the tests
        _code_sample("```python\nimport os\nos._exit(0)\n```"),
        _code_sample("def add(a, b): return a + b"),  # no code block
        _code_sample("```python\ndef add(a, b) return\n```"),  # syntax error
        _code_sample(SOLUTION, tests="assert add(2, 3) == 5\nassert add(0, 0) == 0"),  # a string
        _code_sample(  # an object equal to everything is not a plain value
            "```python\nclass E:\n    def __eq__(s, o): return True\ndef add(a, b): return E()\n```"
        ),
        _code_sample(
            SOLUTION,
            tests=[
                "x = (1,)\nassert add(x, (2,)) == (1, 2) and add(1, 1) in {2}",
                "for i in range(3):\n    assert add(i, 0) == i",
            ],
        ),
    ]
    start = time.monotonic()
    assert reward(samples) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert time.monotonic() - start < 2 + 3 * MARGIN  # samples run side by side
    whole = CodeTests(timeout_s=2, extract="none", isolation=isolation)
    assert whole([_code_sample("def add(a, b):\n    return a + b")]) == [1.0]


@pytest.mark.parametrize("isolation", MODES)
def test_code_tests_io_tests_compare_stdout_in_the_parent(isolation) -> None:
    program = "```python\nprint(sum(map(int, input().split())))\n```"
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}]
    reward = CodeTests(timeout_s=2, isolation=isolation, partial=True)
    assert reward(
        [
            _code_sample(program, tests),
            _code_sample(program, [*tests, {"input": "1 1", "output": "3"}]),
        ]
    ) == pytest.approx([1.0, 2 / 3])


@pytest.mark.parametrize("isolation", MODES)
def test_code_tests_partial_credit(isolation) -> None:
    reward = CodeTests(timeout_s=2, partial=True, isolation=isolation)
    # right for positives only: add(-1, 1) == 0 fails
    half = "```python\ndef add(a, b):\n    return abs(a) + abs(b)\n```"
    samples = [_code_sample(SOLUTION), _code_sample(half), _code_sample("```python\n1/0\n```")]
    assert reward(samples) == pytest.approx([1.0, 2 / 3, 0.0])


@pytest.mark.parametrize("isolation", MODES)
def test_code_tests_memory_bomb_and_socket_score_zero(isolation) -> None:
    reward = CodeTests(timeout_s=2, memory_mb=128, isolation=isolation)
    bomb = "```python\nx = bytearray(10**10)\ndef add(a, b):\n    return a + b\n```"
    net = (
        "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "def add(a, b):\n    return a + b\n```"
    )
    assert reward([_code_sample(bomb), _code_sample(net)]) == [0.0, 0.0]


@pytest.mark.parametrize("isolation", MODES)
def test_code_tests_without_tests_is_a_counted_failure(isolation) -> None:
    samples = [_code_sample(SOLUTION), Sample("", SOLUTION)]
    result = RewardSet([CodeTests(timeout_s=2, isolation=isolation)])(samples)
    assert result.per_reward["code_tests"].tolist() == [1.0, 0.0]
    assert result.failures == {"code_tests": 1}


@pytest.mark.parametrize("isolation", MODES)
def test_no_sandbox_folders_are_left_behind(isolation, own_temp) -> None:
    before = _sandbox_folders()
    CodeTests(timeout_s=1, isolation=isolation)(
        [_code_sample(SOLUTION), _code_sample("```python\nwhile 1: pass\n```")]
    )
    assert _sandbox_folders() <= before


@pytest.mark.parametrize("isolation", MODES)
def test_site_packages_only_when_asked(isolation) -> None:
    program = "import yaml\nprint('imported')"  # a package of this venv, not of the stdlib
    assert "No module named 'yaml'" in _run(program, isolation=isolation).stderr
    result = _run(program, isolation=isolation, site_packages=True, timeout_s=5)
    assert result.ok and result.stdout == "imported\n", result.stderr


def test_without_user_namespaces_only_the_named_opt_in_runs(monkeypatch, capsys) -> None:
    """Where the machine has no user namespaces (simulated here: this one has them), auto and
    namespaces refuse in one line naming the opt-in; best_effort runs and says what it lacks."""
    import tunesmith.rl.rewards.code as code_module
    from tunesmith.rl.rewards import sandbox

    monkeypatch.setattr(sandbox, "namespaces_problem", lambda: "unshare: Operation not permitted")
    monkeypatch.setattr(code_module, "_WARNED", set())
    for isolation in ("auto", "namespaces"):
        with pytest.raises(RuntimeError) as refused:
            run_sandboxed("pass", timeout_s=1, memory_mb=64, isolation=isolation)
        assert "\n" not in str(refused.value) and "isolation='best_effort'" in str(refused.value)
        assert "Operation not permitted" in str(refused.value)
        with pytest.raises(
            RuntimeError, match="^CodeTests: the code sandbox needs user namespaces"
        ):
            CodeTests(isolation=isolation)
    assert available_isolation() == ("best_effort",)
    CodeTests(isolation="best_effort")
    CodeTests(isolation="best_effort")
    warning = capsys.readouterr().err
    assert warning.count("is not isolation") == 1 and "read any file" in warning
