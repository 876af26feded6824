"""Run untrusted Python (model-written code) in a throw-away, resource-limited child process.

:func:`run_sandboxed` writes the code into a fresh temporary folder, runs it there with
``python -I -B`` (isolated mode: no user site, no ``PYTHON*`` variables, no current folder on
``sys.path``) in its own session, with an environment of ``PATH`` only (plus ``HOME`` and
``TMPDIR`` pointing into the folder), and deletes the folder afterwards. What it applies:

- **limits**, set by a small bootstrap in the child before the code runs (soft = hard, so the
  code cannot raise them): address space (``memory_mb``), CPU seconds (the timeout rounded
  up, + 1), file size (``file_mb``, which also caps stdout/stderr, written to files), open
  files, no core dumps, and ``RLIMIT_NPROC = 1`` (no new processes or threads; the kernel
  does not enforce it for root);
- **wall timeout**: the whole process group is killed (``SIGKILL``) after ``timeout_s``;
- **network**: with ``network="auto"`` the child runs in new user and network namespaces
  (``unshare --user --net``: no interface but a down loopback) when this machine allows it
  (checked once per process, :func:`network_isolation`), else an audit hook refuses socket
  connect/bind/send and name lookups. :attr:`SandboxResult.network` says which applied;
- **audit hook** (always): refuses starting processes (``subprocess``, ``os.system``,
  ``os.exec*``, ``os.fork``, ``os.posix_spawn``), signalling other processes, changing
  rlimits, and writing, creating, renaming or deleting files outside the temporary folder.

The namespaces and limits are enforced by the kernel; the audit hook is a best effort inside
the interpreter: code that reaches C directly (``ctypes``, a native extension) or tampers with
the interpreter's internals can get past it. There is no filesystem isolation for reads, and a
sandbox started by root runs with root's file permissions (less its capabilities inside a
namespace): run trainers that execute model code as an unprivileged user, or in a container.

Example::

    >>> result = run_sandboxed("print(sum(range(10)))", timeout_s=2, memory_mb=256)
    >>> result.returncode, result.stdout, result.timed_out
    (0, '45\\n', False)
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = [
    "NETWORK_MODES",
    "SandboxResult",
    "network_isolation",
    "run_sandboxed",
    "user_namespaces_available",
]

NETWORK_MODES = ("auto", "namespace", "audit_hook")

_OPEN_FILES = 64

# Events refused in every sandbox: new processes, signals to others, limit changes.
_BLOCKED_ALWAYS = (
    "os.exec",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.startfile",
    "pty.spawn",
    "subprocess.Popen",
    "resource.setrlimit",
    "resource.prlimit",
    "signal.pthread_kill",
)
# Refused when no network namespace isolates the child.
_BLOCKED_NETWORK = (
    "socket.bind",
    "socket.connect",
    "socket.sendmsg",
    "socket.sendto",
    "socket.getaddrinfo",
    "socket.gethostbyname",
    "socket.gethostbyaddr",
    "socket.getnameinfo",
)

# Runs in the child (python -I -B -c BOOTSTRAP CONFIG) before the user's main.py: limits, then
# the audit hook, then main.py as __main__. Paths written to must resolve inside ROOT.
_BOOTSTRAP = r"""
import json, os, resource, runpy, sys
_cfg = json.loads(sys.argv[1])
for _name, _value in _cfg["limits"]:
    _which = getattr(resource, _name)
    _hard = resource.getrlimit(_which)[1]
    if _hard != resource.RLIM_INFINITY:
        _value = min(_value, _hard)
    resource.setrlimit(_which, (_value, _value))

def _make_hook(root, blocked, own_pid):
    realpath, join, fspath, fsdecode = os.path.realpath, os.path.join, os.fspath, os.fsdecode
    getcwd, readlink, O_WRITE = os.getcwd, os.readlink, os.O_WRONLY | os.O_RDWR | os.O_CREAT
    # event -> (path argument, its dir_fd argument or None) pairs that are written to
    written = {
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
        "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)), "os.symlink": ((1, 2),),
        "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),),
        "os.truncate": ((0, None),), "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),
    }

    def inside(path, dir_fd):
        if isinstance(path, int):
            return True  # an open descriptor: checked when it was opened
        path = fsdecode(fspath(path))
        real_fd = isinstance(dir_fd, int) and dir_fd >= 0  # negative: the current folder
        base = readlink(f"/proc/self/fd/{dir_fd}") if real_fd else getcwd()
        full = realpath(join(base, path))
        return full == root or full.startswith(root + "/") or full == "/dev/null"

    def refuse(event, what=""):
        raise PermissionError(f"sandbox: {event}{what} is not allowed")

    def hook(event, args):
        if event in blocked:
            refuse(event)
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & O_WRITE
            )
            if writes and path is not None and not inside(path, None):
                refuse("writing", f" {path!r}")
        elif event in written:
            for index, fd_index in written[event]:
                dir_fd = None if fd_index is None else args[fd_index]
                if not inside(args[index], dir_fd):
                    refuse(event, f" {args[index]!r}")
        elif event in ("os.kill", "os.killpg") and args[0] != own_pid:
            refuse(event, f" on {args[0]}")

    return hook

sys.addaudithook(_make_hook(_cfg["root"], frozenset(_cfg["blocked"]), os.getpid()))
del _make_hook, _cfg, _name, _value, _which, _hard, json, resource
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        returncode: the exit status; negative ``-N`` when signal ``N`` ended it.
        stdout, stderr: its output (UTF-8, undecodable bytes replaced); when longer than
            ``max_output_bytes`` the middle is cut out and marked.
        timed_out: the wall timeout killed it.
        killed_reason: why it was killed, or None when it exited by itself:
            ``"wall_timeout"``, ``"cpu_time"`` (RLIMIT_CPU), ``"file_size"`` (RLIMIT_FSIZE)
            or ``"signal SIGSEGV"``-like. (Over ``memory_mb``, Python raises ``MemoryError``
            and exits with 1.)
        network: how the network was cut: ``"namespace"`` or ``"audit_hook"``.
        wall_s: seconds from start to exit.

    Example::

        >>> SandboxResult(0, "ok\\n", "", False, None, "namespace", 0.05).ok
        True
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    network: str
    wall_s: float

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0."""
        return self.returncode == 0 and self.killed_reason is None


@functools.cache
def user_namespaces_available() -> bool:
    """Whether ``unshare --user --net`` works here (run once per process, then cached).

    Example::

        >>> isinstance(user_namespaces_available(), bool)
        True
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        done = subprocess.run(
            [unshare, "--user", "--net", "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def network_isolation() -> str:
    """What ``network="auto"`` uses on this machine: ``"namespace"`` or ``"audit_hook"``.

    Example::

        >>> network_isolation() in ("namespace", "audit_hook")
        True
    """
    return "namespace" if user_namespaces_available() else "audit_hook"


def _read_output(path: str, limit: int) -> str:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= limit:
            data = f.read()
        else:
            head = f.read(limit // 2)
            f.seek(size - limit // 2)
            data = head + f"\n...[{size - limit} bytes cut]...\n".encode() + f.read()
    return data.decode("utf-8", errors="replace")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _remove_tree(root: str) -> None:
    """Delete ``root`` even where the code took away permissions."""
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    shutil.rmtree(root, ignore_errors=True)


def _killed_reason(returncode: int, timed_out: bool) -> str | None:
    if timed_out:
        return "wall_timeout"
    if returncode >= 0:
        return None
    if -returncode == signal.SIGXCPU:
        return "cpu_time"
    if -returncode == signal.SIGXFSZ:
        return "file_size"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


def run_sandboxed(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    stdin: str = "",
    network: str = "auto",
    file_mb: int = 16,
    max_output_bytes: int = 1 << 20,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandbox (see the module docs) and return what it did.

    Args:
        code: Python source.
        timeout_s: wall-clock limit in seconds; the process group is killed after it.
        memory_mb: address-space limit (RLIMIT_AS) in MiB; the interpreter itself takes some
            tens of MiB of it.
        stdin: text fed to the program's standard input.
        network: ``"auto"`` (a network namespace where allowed, else the audit hook),
            ``"namespace"`` (required: RuntimeError when unavailable) or ``"audit_hook"``.
        file_mb: largest file the program may write, stdout and stderr included, in MiB.
        max_output_bytes: most bytes of stdout and of stderr kept in the result.

    Raises RuntimeError when the sandbox itself cannot start (``unshare`` fails to run the
    interpreter), so that a broken setup is not mistaken for failing programs.

    Example::

        >>> run_sandboxed("while True: pass", timeout_s=1, memory_mb=256).killed_reason
        'wall_timeout'
    """
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1:
        raise ValueError(f"memory_mb must be a positive int, got {memory_mb!r}")
    if isinstance(file_mb, bool) or not isinstance(file_mb, int) or file_mb < 1:
        raise ValueError(f"file_mb must be a positive int, got {file_mb!r}")
    if network not in NETWORK_MODES:
        raise ValueError(f"network={network!r} is not one of {list(NETWORK_MODES)}")
    if network == "auto":
        network = network_isolation()
    elif network == "namespace" and not user_namespaces_available():
        raise RuntimeError(
            "network='namespace': this machine does not allow `unshare --user --net` "
            "(no unshare binary, or unprivileged user namespaces are disabled)"
        )

    root = os.path.realpath(tempfile.mkdtemp(prefix="tunesmith-sandbox-"))
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(root, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        blocked = _BLOCKED_ALWAYS + (_BLOCKED_NETWORK if network == "audit_hook" else ())
        config = {
            "root": work,
            "blocked": list(blocked),
            "limits": [
                ("RLIMIT_AS", memory_mb << 20),
                ("RLIMIT_CPU", math.ceil(timeout_s) + 1),
                ("RLIMIT_FSIZE", file_mb << 20),
                ("RLIMIT_NOFILE", _OPEN_FILES),
                ("RLIMIT_CORE", 0),
                ("RLIMIT_NPROC", 1),
            ],
        }
        command = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, json.dumps(config)]
        if network == "namespace":
            command = [shutil.which("unshare") or "unshare", "--user", "--net", "--", *command]
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": work, "TMPDIR": work}
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        with (
            open(os.path.join(root, "stdin"), "rb") as fin,
            open(out_path, "wb") as fout,
            open(err_path, "wb") as ferr,
        ):
            start = time.monotonic()
            proc = subprocess.Popen(
                command, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=env,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            finally:
                _kill_group(proc.pid)  # whatever it left behind in its group
            wall = time.monotonic() - start
        stderr = _read_output(err_path, max_output_bytes)
        if (
            network == "namespace"
            and proc.returncode in (126, 127)
            and stderr.startswith("unshare:")
        ):
            raise RuntimeError(f"the sandbox did not start: {stderr.strip()}")
        return SandboxResult(
            returncode=proc.returncode,
            stdout=_read_output(out_path, max_output_bytes),
            stderr=stderr,
            timed_out=timed_out,
            killed_reason=_killed_reason(proc.returncode, timed_out),
            network=network,
            wall_s=wall,
        )
    finally:
        _remove_tree(root)
