"""Model-written code against the CodeTests sandbox: every route of
``sandbox_cases.ESCAPES`` in every isolation mode this machine offers.

Each attempt runs in a disposable *trainer*: a child Python (``DRIVER``, ``-I -S``) that loads
``tunesmith/rl/rewards/sandbox.py`` by path (stdlib only: no torch, so ~50 ms), holds a secret in
its environment and calls ``run_sandboxed`` with the route's program, as a reward worker would;
the route's own harms (it killing or tracing that trainer, reading its environment) land on that
process, never on pytest. From outside, after the call, the test looks for every harm the route
could do (see ``sandbox_cases``). ``live`` routes are first run unsandboxed by the same trainer,
and their harm must show: the payload is real. Namespaces mode must contain every route;
best-effort mode must contain it or the route's gap must be in ``BEST_EFFORT_GAPS``
('documented'). Reward routes are CodeTests solutions that try to forge a pass: they must
score 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.faults import sandbox_cases
from tests.faults.catalogue import params
from tests.recipes.sft_world import REPO_ROOT
from tunesmith.rl.rewards import CodeTests, Sample, available_isolation
from tunesmith.rl.rewards.sandbox import BEST_EFFORT_GAPS

ROUTES = {f"sandbox-{e.id}": e for e in sandbox_cases.ESCAPES}
MODES = available_isolation()
SECRET_ENV = "TUNESMITH_TEST_SECRET"
BOUND_S = 1.5  # the call's own wall time past timeout_s (start-up and teardown, 2 loaded cores)
SANDBOX_PY = REPO_ROOT / "tunesmith" / "rl" / "rewards" / "sandbox.py"

DRIVER = r"""
import importlib.util, json, os, subprocess, sys, tempfile, time
cfg = json.loads(sys.argv[1])
code = cfg["code"].replace("TRAINER_PID", str(os.getpid()))
if cfg["mode"] == "none":  # the payload run as a plain child: does its harm happen?
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-S", "-c", code], cwd=tempfile.mkdtemp(),
                              capture_output=True, timeout=cfg["timeout_s"])
        out, err, rc = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"), done.returncode
    except subprocess.TimeoutExpired:
        out, err, rc = "", "", -9
    result = {"returncode": rc, "stdout": out, "stderr": err, "killed_reason": None,
              "wall_s": time.monotonic() - start}
else:
    spec = importlib.util.spec_from_file_location("sandbox_under_test", cfg["sandbox"])
    sandbox = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = sandbox  # dataclasses look their module up
    spec.loader.exec_module(sandbox)
    sandbox.namespaces_problem = lambda: None if cfg["mode"] == "namespaces" else "not asked"
    r = sandbox.run_sandboxed(code, timeout_s=cfg["timeout_s"], memory_mb=256,
                              isolation=cfg["mode"], max_output_bytes=1 << 16)
    result = {"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
              "killed_reason": r.killed_reason, "wall_s": r.wall_s}
print(json.dumps(result))
"""


@dataclass
class Context:
    """The outside world of one attempt: what the route aims at, and how to see if it hit."""

    tmp: Path
    secret: str
    key_secret: str
    mark: str
    server: socket.socket
    unix: socket.socket
    abstract: socket.socket

    @property
    def fields(self) -> dict:
        return {
            "marker": str(self.tmp / "marker"),
            "outdir": str(self.tmp),
            "outside": str(self.tmp / "outside.txt"),
            "prefix_marker": os.path.join(sys.base_prefix, f"tunesmith-escape-{self.mark}.pth"),
            "project_file": str(REPO_ROOT / "pyproject.toml"),
            "ssh_key": str(self.tmp / "home" / ".ssh" / "id_ed25519"),
            "mark": self.mark,
            "port": self.server.getsockname()[1],
            "sock": str(self.tmp / "host.sock"),
            "abstract": "\0" + self.mark,
        }


@pytest.fixture
def context(tmp_path):
    tag = secrets.token_hex(8)
    (tmp_path / "outside.txt").write_text(f"keep-{tag}")
    (tmp_path / "outside.txt").chmod(0o644)
    key_secret = f"PRIVATE-KEY-{tag}"
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "home" / ".ssh" / "id_ed25519").write_text(key_secret)
    server = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(tmp_path / "host.sock"))
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind("\0" + f"tunesmith-escape-{tag}")
    for s in (server, unix, abstract):
        s.listen(4)
        s.setblocking(False)
    ctx = Context(
        tmp_path,
        f"sk-{secrets.token_hex(12)}",
        key_secret,
        f"tunesmith-escape-{tag}",
        server,
        unix,
        abstract,
    )
    yield ctx
    prefix_marker = Path(ctx.fields["prefix_marker"])
    for s in (server, unix, abstract):
        s.close()
    _kill_marked(ctx.mark)
    prefix_marker.unlink(missing_ok=True)


def _marked(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _kill_marked(mark: str) -> None:
    for pid in _marked(mark):
        with contextlib.suppress(OSError):
            os.kill(pid, 9)


def _accepted(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _attempt(route, mode: str, ctx: Context) -> tuple[list[str], dict]:
    """Run the route once in ``mode`` (``"none"``: unsandboxed); the harms seen from outside."""
    code = route.code.format(**ctx.fields)
    cfg = {"mode": mode, "code": code, "timeout_s": route.timeout_s, "sandbox": str(SANDBOX_PY)}
    env = {"PATH": os.environ.get("PATH", os.defpath), SECRET_ENV: ctx.secret,
           "HOME": str(ctx.tmp / "home")}  # fmt: skip
    outside = ctx.tmp / "outside.txt"
    before = (outside.read_text(), stat.S_IMODE(outside.stat().st_mode))
    start = time.monotonic()
    trainer = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", DRIVER, json.dumps(cfg)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = trainer.communicate(timeout=route.timeout_s + 20)
    except subprocess.TimeoutExpired:  # stopped (traced) or hung: harm either way
        trainer.kill()
        out, err = trainer.communicate()
    elapsed = time.monotonic() - start
    harms = []
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        result = {"stdout": "", "stderr": err.decode(errors="replace")[-500:], "wall_s": elapsed}
        harms.append(
            f"the trainer did not finish (exit {trainer.returncode}): "
            + err.decode(errors="replace")[-300:]
        )
    if trainer.returncode not in (0, None) and not harms:
        harms.append(f"the trainer ended with {trainer.returncode}")
    if result["wall_s"] > route.timeout_s + BOUND_S:
        harms.append(f"the call took {result['wall_s']:.1f} s")
    text = result["stdout"] + result["stderr"]
    for name, secret in (
        ("the trainer's secret", ctx.secret),
        ("the ssh key", ctx.key_secret),
        ("an outside file", before[0]),
        ("the project's file", (REPO_ROOT / "pyproject.toml").read_text()[:60]),
    ):
        if secret in text:
            harms.append(f"{name} is in the output")
    if "ESCAPED" in result["stdout"]:
        harms.append("the program saw its escape: " + result["stdout"][:80].strip())
    if (ctx.tmp / "marker").exists():
        harms.append("a file was created outside")
        (ctx.tmp / "marker").unlink()
    if Path(ctx.fields["prefix_marker"]).exists():
        harms.append("a file was created in the interpreter's prefix")
        Path(ctx.fields["prefix_marker"]).unlink()
    if (outside.read_text(), stat.S_IMODE(outside.stat().st_mode)) != before:
        harms.append("an outside file was changed")
        outside.write_text(before[0])
        outside.chmod(before[1])
    for name, server in (
        ("TCP", ctx.server),
        ("AF_UNIX", ctx.unix),
        ("abstract AF_UNIX", ctx.abstract),
    ):
        if _accepted(server):
            harms.append(f"a host {name} socket was reached")
    deadline = time.monotonic() + 2
    while _marked(ctx.mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _marked(ctx.mark):
        harms.append("a process outlived the call")
        _kill_marked(ctx.mark)
    return harms, {"seconds": round(result["wall_s"], 3), "elapsed": round(elapsed, 3)}


TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def _reward_attempt(route, mode: str) -> tuple[list[str], dict]:
    solution = "```python\n" + route.code.format() + "\n```"
    start = time.monotonic()
    reward = CodeTests(timeout_s=route.timeout_s, isolation=mode)
    score = reward([Sample("Write add(a, b).", solution, metadata={"tests": TESTS})])[0]
    harms = [] if score == 0.0 else [f"scored {score}"]
    return harms, {"seconds": round(time.monotonic() - start, 3), "score": score}


@pytest.mark.parametrize("case", params("safety", "sandbox-escape"))
def test_sandbox_escape_is_contained(case, context, outcome) -> None:
    route = ROUTES[case.id]
    if route.live:
        harms, _ = _attempt(route, "none", context)
        assert harms, f"{case.id}: the payload does no harm even unsandboxed: not a real route"
    modes = {}
    for mode in MODES:
        if route.reward:
            harms, details = _reward_attempt(route, mode)
        else:
            harms, details = _attempt(route, mode, context)
        if not harms:
            modes[mode] = {"outcome": "contained", **details}
            continue
        assert mode == "best_effort", f"{case.id} escaped the {mode} sandbox: {harms}"
        assert route.gap is not None, f"{case.id} escaped the best-effort sandbox: {harms}"
        assert route.gap in BEST_EFFORT_GAPS, f"{case.id}: the gap {route.gap!r} is not documented"
        modes[mode] = {"outcome": "documented", "harms": harms, **details}
    outcome.update(
        outcome="contained" if "namespaces" in modes else modes["best_effort"]["outcome"],
        modes=modes,
        seconds=max(m["seconds"] for m in modes.values()),
    )
