"""The code sandbox and the code-test reward: real child processes, short limits.

Each test runs real programs (nothing is mocked): loops are killed at the wall timeout,
memory bombs stop at the address-space limit, sockets, spawns, signals and writes outside the
temporary folder are refused, and the folder is gone afterwards. Both network modes are
exercised: the audit hook always, the network namespace where this machine allows it (on one
that does not, ``"auto"`` must fall back to the audit hook)."""

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
    extract_code,
    network_isolation,
    run_sandboxed,
    user_namespaces_available,
)

TIMEOUT = 1.0
MARGIN = 1.5  # interpreter start-up and process teardown on a loaded 2-core machine
MODES = ["audit_hook", "auto"]


def _run(code: str, **kwargs):
    kwargs.setdefault("timeout_s", TIMEOUT)
    kwargs.setdefault("memory_mb", 256)
    return run_sandboxed(code, **kwargs)


def test_a_program_runs_with_stdin_and_an_empty_environment() -> None:
    result = _run(
        "import os, sys\nprint(input()[::-1])\nprint(sorted(os.environ))\n"
        "print('cwd', os.getcwd())\nprint(sys.flags.isolated)\nsys.exit(3)",
        stdin="abc\n",
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "cba"
    # PATH, HOME and TMPDIR only (the C runtime may add LC_CTYPE for the UTF-8 locale)
    assert set(eval(lines[1])) - {"LC_CTYPE"} == {"PATH", "HOME", "TMPDIR"}
    assert lines[3] == "1"
    assert result.returncode == 3 and not result.ok and result.killed_reason is None
    assert result.network == network_isolation()


@pytest.mark.parametrize("program", ["while True: pass", "import time\ntime.sleep(60)"])
def test_an_endless_program_is_killed_at_the_wall_timeout(program) -> None:
    start = time.monotonic()
    result = _run(program)
    elapsed = time.monotonic() - start
    assert result.timed_out and result.killed_reason == "wall_timeout"
    assert result.returncode < 0
    assert TIMEOUT <= elapsed < TIMEOUT + MARGIN


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie is dead, waiting to be reaped


def test_the_whole_process_group_is_killed() -> None:
    # ctypes reaches fork() below the audit hook; RLIMIT_NPROC stops it unless we are root.
    program = (
        "import ctypes, os, time\n"
        "pid = ctypes.CDLL(None).fork()\n"
        "if pid == 0:\n    time.sleep(60)\n    os._exit(0)\n"
        "print('child', pid, flush=True)\n"
        "while True: pass\n"
    )
    result = _run(program)
    assert result.killed_reason == "wall_timeout"
    pid = int(result.stdout.split()[1])
    if os.geteuid() != 0:
        assert pid == -1, "RLIMIT_NPROC should have refused the fork"
        return
    assert pid > 0
    deadline = time.monotonic() + 2
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"the grandchild {pid} survived the sandbox"


@pytest.mark.parametrize(
    "program",
    ["x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(bytearray(10**6))"],
)
def test_a_memory_bomb_fails_within_its_limit(program) -> None:
    result = _run(program, memory_mb=128, timeout_s=5)
    assert result.returncode == 1 and not result.timed_out
    assert "MemoryError" in result.stderr
    assert result.wall_s < 5


@pytest.mark.parametrize("network", MODES)
def test_a_socket_to_localhost_fails(network) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        result = _run(
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))\nprint('in')",
            network=network,
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert result.returncode == 1 and "in" not in result.stdout
    if result.network == "audit_hook":
        assert "PermissionError: sandbox: socket.connect" in result.stderr
    else:  # the namespace has no usable interface, not even loopback
        assert "Network is unreachable" in result.stderr


def test_auto_network_mode_follows_what_the_machine_allows() -> None:
    expected = "namespace" if user_namespaces_available() else "audit_hook"
    assert network_isolation() == expected
    assert _run("pass", network="auto").network == expected
    if not user_namespaces_available():
        with pytest.raises(RuntimeError, match="unshare"):
            _run("pass", network="namespace")


@pytest.mark.parametrize(
    ("program", "refused"),
    [
        ("import os\nos.system('true')", "os.system"),
        ("import os\nos.kill(os.getppid(), 0)", "os.kill on"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "resource.setrlimit"),
        ("open({outside!r}, 'w').write('x')", "writing"),
        ("import os\nos.remove({outside!r})", "os.remove"),
        ("import os\nos.symlink({outside!r}, 'link')\nopen('link', 'w').write('x')", "writing"),
    ],
)
def test_the_audit_hook_refuses(program, refused, tmp_path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    result = _run(program.format(outside=str(outside)), network="audit_hook")
    assert result.returncode == 1
    assert f"PermissionError: sandbox: {refused}" in result.stderr
    assert outside.read_text() == "keep"


def test_files_stay_in_a_temporary_folder_that_is_removed(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    program = (
        "import os, tempfile\n"
        "open('out.txt', 'w').write('data')\n"
        "os.mkdir('sub')\nos.rename('out.txt', 'sub/moved.txt')\n"
        "with tempfile.NamedTemporaryFile(delete=False) as f:\n    f.write(b'x')\n"
        "os.chmod('sub', 0)\n"  # removal must still work
        "print(os.getcwd())\nprint(f.name)\n"
    )
    result = _run(program)
    assert result.ok, result.stderr
    cwd, temp_file = result.stdout.splitlines()
    assert Path(cwd).parent.parent == Path(tempfile.gettempdir()).resolve()
    assert Path(temp_file).parent == Path(cwd)  # TMPDIR points into the sandbox
    assert not Path(cwd).exists() and not Path(cwd).parent.exists()
    assert list(tmp_path.iterdir()) == []  # nothing landed where the caller was


def test_long_output_is_cut_in_the_middle() -> None:
    result = _run("print('a' * 5000)\nprint('end')", max_output_bytes=1000)
    assert len(result.stdout) < 1100
    assert result.stdout.startswith("a" * 400) and result.stdout.endswith("end\n")
    assert "bytes cut" in result.stdout


def test_a_big_file_hits_the_size_limit() -> None:
    result = _run("open('big', 'wb').write(b'x' * (3 << 20))", file_mb=1)
    assert result.returncode == 1 and "File too large" in result.stderr


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        run_sandboxed("pass", timeout_s=0, memory_mb=64)
    with pytest.raises(ValueError, match="memory_mb"):
        run_sandboxed("pass", timeout_s=1, memory_mb=0.5)
    with pytest.raises(ValueError, match="network='none'"):
        run_sandboxed("pass", timeout_s=1, memory_mb=64, network="none")


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


def test_code_tests_scores() -> None:
    reward = CodeTests(timeout_s=2)
    samples = [
        _code_sample("Sure:\n" + SOLUTION + "\nDone."),  # right
        _code_sample(SOLUTION.replace("a + b", "a - b")),  # wrong
        _code_sample("```python\ndef add(a, b):\n    while True: pass\n```"),  # loops
        _code_sample("```python\nimport sys\nsys.exit(0)\n```"),  # exits before the tests
        _code_sample("```python\nimport os\nos._exit(0)\n```"),
        _code_sample("def add(a, b): return a + b"),  # no code block
        _code_sample("```python\ndef add(a, b) return\n```"),  # syntax error
        _code_sample(SOLUTION, tests="assert add(2, 3) == 5\nassert add(0, 0) == 0"),  # a string
    ]
    start = time.monotonic()
    assert reward(samples) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < 2 + 2 * MARGIN  # samples run side by side
    whole = CodeTests(timeout_s=2, extract="none")
    assert whole([_code_sample("def add(a, b):\n    return a + b")]) == [1.0]


def test_code_tests_partial_credit() -> None:
    reward = CodeTests(timeout_s=2, partial=True)
    # right for positives only: add(-1, 1) == 0 fails
    half = "```python\ndef add(a, b):\n    return abs(a) + abs(b)\n```"
    samples = [_code_sample(SOLUTION), _code_sample(half), _code_sample("```python\n1/0\n```")]
    assert reward(samples) == pytest.approx([1.0, 2 / 3, 0.0])


def test_code_tests_memory_bomb_and_socket_score_zero() -> None:
    reward = CodeTests(timeout_s=2, memory_mb=128)
    bomb = "```python\nx = bytearray(10**10)\ndef add(a, b):\n    return a + b\n```"
    net = (
        "```python\nimport socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)\n"
        "def add(a, b):\n    return a + b\n```"
    )
    assert reward([_code_sample(bomb), _code_sample(net)]) == [0.0, 0.0]


def test_code_tests_without_tests_is_a_counted_failure() -> None:
    samples = [_code_sample(SOLUTION), Sample("", SOLUTION)]
    result = RewardSet([CodeTests(timeout_s=2)])(samples)
    assert result.per_reward["code_tests"].tolist() == [1.0, 0.0]
    assert result.failures == {"code_tests": 1}


def test_no_sandbox_folders_are_left_behind() -> None:
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tunesmith-sandbox-")}
    CodeTests(timeout_s=1)([_code_sample(SOLUTION), _code_sample("```python\nwhile 1: pass\n```")])
    after = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith("tunesmith-sandbox-")}
    assert after <= before
