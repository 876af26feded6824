"""Run untrusted Python (model-written code) in a throw-away, resource-limited child process.

:func:`run_sandboxed` has two isolation modes (``isolation=``):

``"namespaces"`` (what ``"auto"`` picks; isolation is a property of the operating system)
    util-linux ``unshare`` starts a small trusted init in new user, mount, PID, network, IPC
    and UTS namespaces. The init builds a new root: a size-capped tmpfs (``disk_mb``: the only
    writable place, so also the total disk cap) holding read-only binds of ``/usr``, ``/lib*``,
    ``/bin``, ``/sbin``, ``/etc/ld.so.cache`` and the interpreter's own prefix, the device
    nodes ``null``, ``zero``, ``full``, ``random`` and ``urandom``, a fresh ``/proc`` of the new
    PID namespace and no ``/sys``; it ``pivot_root``\\ s into it and detaches the host's tree,
    so no host file (``/tmp``, ``/home``, ``/root``, the project, sockets) is visible. It
    forbids further user namespaces (``max_user_namespaces = 0``), then forks the program,
    which drops every capability (empty bounding set, ``SECBIT_NOROOT`` locked,
    ``no_new_privs``), sets its limits and execs ``python -I -S -B main.py`` in ``/sandbox``
    with an environment of ``PATH``, ``HOME`` and ``TMPDIR`` only. No network of any family exists (a new network
    namespace has only a down loopback; abstract AF_UNIX names are per network namespace),
    no process outside can be seen, signalled or traced, and the init kills everything when
    the program exits, when more than ``max_processes`` processes exist (fork bombs: the
    kernel does not enforce ``RLIMIT_NPROC`` for root) or at its own deadline.
``"best_effort"`` (opt-in by name only, where user namespaces are not allowed, as in a default
    Docker container)
    the program runs in a temporary folder with the same limits and an audit hook inside the
    interpreter that refuses new processes, signals, sockets, writes outside the folder (paths
    resolved with C functions only; writes through ``..`` and path-like objects refused, as
    the ``open`` event has no ``dir_fd``), opening host folders, other processes' ``/proc``
    entries, ``/sys``, devices, ``ctypes``, ``readline``, ``gc``, frames of tracebacks and
    generators and function-code swaps; ``pidfd_open`` is removed. It is **not** isolation:
    :data:`BEST_EFFORT_GAPS` lists what it does not protect against.

In both modes: the limits (soft = hard) are address space (``memory_mb``), CPU seconds (the
timeout rounded up, + 1), file size (``file_mb``), open files, processes and no core dumps;
stdout and stderr are pipes the parent reads with a size cap (``max_output_bytes`` kept, the
run killed past :data:`OUTPUT_KILL_BYTES`) and a deadline, never files in the child's reach;
at ``timeout_s`` the whole tree is killed (SIGKILL to ``unshare``, whose death kills the init,
whose death kills its PID namespace; in best-effort mode the process group). The program
gets the standard library only (``-S``) unless ``site_packages=True`` (this interpreter's
packages, a venv's included, shown read-only).

Cost per call on a loaded 2-core machine (median of 15 runs of ``pass``): namespaces about
0.17-0.2 s, best effort about 0.1-0.13 s, the former ``unshare --user --net`` + audit hook
mode 0.14-0.23 s (two interpreter starts and the mounts; the tests in
``tests/faults/test_sandbox_escapes.py`` try 52 escape routes in each mode).

Example::

    >>> result = run_sandboxed("print(sum(range(10)))", timeout_s=2, memory_mb=256)
    >>> result.returncode, result.stdout, result.timed_out, result.isolation
    (0, '45\\n', False, 'namespaces')
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = [
    "BEST_EFFORT_GAPS",
    "ISOLATION_MODES",
    "OUTPUT_KILL_BYTES",
    "SandboxResult",
    "available_isolation",
    "namespaces_available",
    "namespaces_problem",
    "resolve_isolation",
    "run_sandboxed",
]

Isolation = Literal["auto", "namespaces", "best_effort"]
ISOLATION_MODES: tuple[str, ...] = get_args(Isolation)
OUTPUT_KILL_BYTES = 64 << 20  # more stdout + stderr than this: killed ("output_limit")

BEST_EFFORT_GAPS = (
    "isolation='best_effort' is not isolation: the program runs as this user on this machine "
    "with only an audit hook inside the interpreter; it can read any file this user can read "
    "(except other processes' /proc entries, /sys and devices), there is no cap on the total "
    "disk it writes (only on each file), it can use the CPU and memory within its limits, and "
    "code that reaches C below the hook (a native extension on sys.path, reloading a builtin "
    "module to get back a removed function, a bug in the interpreter) can write files, signal "
    "or trace processes, start detached children that outlive the timeout, and open sockets; "
    "run it only on a machine or container you are ready to lose, or allow user namespaces"
)
_OPT_IN = (
    "the code sandbox needs user namespaces (`unshare --user` as this user: {why}); allow "
    "them (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, or run "
    "the container with --security-opt seccomp=unconfined), or opt into the unprotected mode "
    "by name with isolation='best_effort' (CodeTests(isolation='best_effort')) and read what "
    "it does not protect against (tunesmith.rl.rewards.sandbox.BEST_EFFORT_GAPS)"
)

_OPEN_FILES = 64
_INIT_GRACE_S = 0.5  # the init's own deadline is timeout_s + this (the parent's comes first)
_READ_GRACE_S = 0.2  # after the program ended, how long the parent still reads its pipes
_BIND_CANDIDATES = (
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
)  # fmt: skip
_DEVICES = ("null", "zero", "full", "random", "urandom")
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

# The init of the namespaces mode: pid 1 of the new PID namespace, run as
# `python -I -S -B -c _INIT STATUS_FD` with its config (JSON) on stdin. It reports on STATUS_FD
# (a pipe only the parent reads; the program never holds it): "ready", then "exit N" or
# "killed REASON"; or "error ..." when the sandbox cannot be built.
_INIT = r"""
import ctypes, json, os, resource, sys, time
status = os.fdopen(int(sys.argv[1]), "w", buffering=1)
def say(line):
    status.write(line + "\n")
try:
    cfg = json.loads(sys.stdin.buffer.read())
    libc = ctypes.CDLL(None, use_errno=True)
    def ok(result, what):
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")
    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: None if s is None else s.encode()
        ok(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {src or fstype} on {dst}")
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
    R = cfg["mountpoint"]
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", R, "tmpfs", NOSUID | NODEV,
          f"size={cfg['disk_mb']}m,nr_inodes={cfg['inodes']},mode=0755")
    for path in cfg["binds"]:
        dst = R + path
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(path):
            os.symlink(os.readlink(path), dst)
            continue
        if os.path.isdir(path):
            os.makedirs(dst, exist_ok=True)
        else:
            open(dst, "w").close()
        mount(path, dst, None, BIND)
        st = os.statvfs(path).f_flag  # keep the flags a user namespace may not clear
        keep = (st & (NOEXEC | 1024 | 2048)) | ((1 << 21) if st & 4096 else 0)
        mount(None, dst, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | keep)
    os.mkdir(R + "/dev")
    for name in cfg["devices"]:
        open(R + "/dev/" + name, "w").close()
        mount("/dev/" + name, R + "/dev/" + name, None, BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, R + "/dev/" + name)
    os.mkdir(R + "/proc")
    mount("proc", R + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    for name in ("sandbox", "tmp", ".old"):  # exist already where a bind lies below them
        os.makedirs(R + "/" + name, 0o777, exist_ok=True)
    ok(libc.syscall(cfg["pivot_root"], R.encode(), (R + "/.old").encode()), "pivot_root")
    os.chdir("/")
    ok(libc.umount2(b"/.old", 2), "umount the host's root")  # MNT_DETACH
    os.rmdir("/.old")
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    # mapped to the caller's uid (root, for a trainer run as root), the program would pass the
    # owner checks of the kernel's global settings: cover them read-only, mask the leaky files
    for name in ("sys", "sysrq-trigger", "irq", "bus", "fs"):
        if os.path.exists("/proc/" + name):
            mount("/proc/" + name, "/proc/" + name, None, BIND | REC)
            mount(None, "/proc/" + name, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV | NOEXEC)
    for name in ("kcore", "kallsyms", "keys", "timer_list", "sched_debug", "kmsg"):
        if os.path.exists("/proc/" + name):
            mount("/dev/null", "/proc/" + name, None, BIND)
    with open("/sandbox/main.py", "w", encoding="utf-8") as f:
        f.write(cfg["code"])
    with open("/stdin", "w", encoding="utf-8") as f:
        f.write(cfg["stdin"])
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
except BaseException as e:
    say(f"error {type(e).__name__}: {e}".replace("\n", " "))
    sys.exit(125)
say("ready")
pid = os.fork()
if pid == 0:
    try:
        status.close()
        fd = os.open("/stdin", os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        os.chdir("/sandbox")
        for name, value in cfg["limits"]:
            resource.setrlimit(getattr(resource, name), (value, value))
        ok(libc.prctl(28, 0x2F, 0, 0, 0), "securebits")  # NOROOT, NO_SETUID_FIXUP, locked
        for cap in range(last_cap + 1):
            ok(libc.prctl(24, cap, 0, 0, 0), "drop from the bounding set")
        ok(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
        os.execve(cfg["python"], [*cfg["argv"], "main.py"], cfg["env"])
    finally:
        os._exit(126)
libc.prctl(4, 0, 0, 0, 0)  # not dumpable: the program cannot ptrace its init
deadline = time.monotonic() + cfg["timeout_s"]
while True:
    try:
        while True:  # reap everything; the program is the one that matters
            done, code = os.waitpid(-1, os.WNOHANG)
            if done == 0:
                break
            if done == pid:
                say(f"exit {os.waitstatus_to_exitcode(code)}")
                sys.exit(0)
    except ChildProcessError:
        pass
    if time.monotonic() > deadline:
        say("killed wall_timeout")
        sys.exit(0)
    if sum(n.isdigit() for n in os.listdir("/proc")) > cfg["max_processes"] + 1:
        say("killed processes")
        sys.exit(0)  # the end of pid 1 ends every process of the namespace
    time.sleep(0.005)
"""

# The best-effort mode's bootstrap (python -I -B -c _BOOTSTRAP CONFIG) before main.py: limits,
# then the audit hook, then main.py as __main__. Its state lives in default arguments (changing
# a function's __code__ / __defaults__ is refused), never in closure cells.
_BOOTSTRAP = r"""
import json, os, posix, resource, runpy, signal, stat, sys, types
_cfg = json.loads(sys.argv[1])
for _name, _value in _cfg["limits"]:
    _which = getattr(resource, _name)
    _hard = resource.getrlimit(_which)[1]
    if _hard != resource.RLIM_INFINITY:
        _value = min(_value, _hard)
    resource.setrlimit(_which, (_value, _value))
for _module, _attr in ((os, "pidfd_open"), (posix, "pidfd_open"), (signal, "pidfd_send_signal")):
    if hasattr(_module, _attr):
        delattr(_module, _attr)

def _resolve(path, base, lstat=os.lstat, readlink=os.readlink, S_ISLNK=stat.S_ISLNK,
             reversed=reversed, list=list, OSError=OSError):
    # like os.path.realpath, with C functions only (nothing the program can patch)
    todo = list(reversed((path if path.startswith("/") else base + "/" + path).split("/")))
    done, hops = [], 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        current = "/" + "/".join(done + [part])
        try:
            link = S_ISLNK(lstat(current).st_mode)
        except OSError:
            link = False
        if not link:
            done.append(part)
            continue
        hops += 1
        if hops > 40:
            return "/.symlink-loop"
        target = readlink(current)
        if target.startswith("/"):
            done = []
        todo.extend(reversed(target.split("/")))
    return "/" + "/".join(done)

def _inside(path, dir_fd, root, mode, resolve=_resolve, readlink=os.readlink, getcwd=os.getcwd,
            type=type, str=str, bytes=bytes, int=int, encoding=sys.getfilesystemencoding(),
            own=f"/proc/{os.getpid()}", devices=("/dev/null", "/dev/zero", "/dev/full",
            "/dev/random", "/dev/urandom"), S_ISDIR=stat.S_ISDIR, stat_of=os.stat,
            OSError=OSError):
    # mode: "write", "read" or "list"; path: str, bytes or an open descriptor, nothing else
    kind = type(path)
    if kind is int:
        full = readlink(f"/proc/self/fd/{path}")
        if not full.startswith("/"):
            return True  # a pipe, a socket: already open, no new file
    elif kind is str or kind is bytes:
        if kind is bytes:
            path = path.decode(encoding, "surrogateescape")
        if type(dir_fd) is str:  # a symlink's target: from the link's folder
            base = dir_fd
        elif type(dir_fd) is int and dir_fd >= 0:  # negative: the current folder
            base = readlink(f"/proc/self/fd/{dir_fd}")
        else:
            base = getcwd()
        full = resolve(path, base)
    else:
        return False  # a path-like object could give another path to the call itself
    if full == root or full.startswith(root + "/"):
        return True
    if full == own or full.startswith(own + "/"):
        return mode != "write"
    if full.startswith("/proc/") or full == "/proc":
        return False  # other processes' entries
    if full.startswith("/dev/"):
        return full in devices
    if full == "/sys" or full.startswith("/sys/"):
        return False
    if mode == "list":  # a host folder: imports list sys.path folders
        return True
    try:
        folder = S_ISDIR(stat_of(full).st_mode)
    except OSError:
        folder = False
    return mode == "read" and not folder  # reading a host file: allowed; a folder: not

def _hook(event, args, root=_cfg["root"], blocked=frozenset(_cfg["blocked"]),
          modules=frozenset(_cfg["modules"]), own_pid=os.getpid(), inside=_inside,
          resolve=_resolve, readlink=os.readlink, getcwd=os.getcwd, type=type, str=str,
          int=int, any=any, PermissionError=PermissionError, repr=repr,
          O_WRITE=os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
          frames=frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame")),
          written=types.MappingProxyType({
              "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),),
              "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
              "os.symlink": ((1, 2),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
              "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.mknod": ((0, 3),),
              "os.chdir": ((0, None),), "sqlite3.connect": ((0, None),),
              "shutil.rmtree": ((0, 1),), "os.setxattr": ((0, None),),
              "os.removexattr": ((0, None),), "os.chflags": ((0, None),),
          })):
    if event in blocked:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in mode for c in "wax+")) or (
            type(flags) is int and flags & O_WRITE)
        if path is None:
            return
        if writes and type(path) is str and not path.startswith("/") and ".." in path.split("/"):
            raise PermissionError("sandbox: writing through '..' is not allowed")  # dir_fd=?
        if not inside(path, None, root, "write" if writes else "read"):
            raise PermissionError(f"sandbox: opening {path!r} is not allowed")
    elif event == "import" and (args[0] in modules or args[0].split(".")[0] in modules):
        raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
    elif event in written:
        if event == "sqlite3.connect" and type(args[0]) is str and (
                args[0] == ":memory:" or args[0] == ""):
            return
        if event == "sqlite3.connect" and type(args[0]) is str and args[0].startswith("file:"):
            raise PermissionError("sandbox: sqlite3 URIs are not allowed")
        for index, fd_index in written[event]:
            dir_fd = None if fd_index is None else args[fd_index]
            if not inside(args[index], dir_fd, root, "write"):
                raise PermissionError(f"sandbox: {event} {args[index]!r} is not allowed")
        if event == "os.symlink":  # and its target, from the link's folder
            base = readlink(f"/proc/self/fd/{args[2]}") if type(args[2]) is int and (
                args[2] >= 0) else getcwd()
            link = resolve(args[1] if type(args[1]) is str else "/", base)
            if not inside(args[0], link.rsplit("/", 1)[0] or "/", root, "write"):
                raise PermissionError(f"sandbox: os.symlink to {args[0]!r} is not allowed")
    elif event in ("os.listdir", "os.scandir") and args[0] is not None and type(
            args[0]) is not int and not inside(args[0], None, root, "list"):
        raise PermissionError(f"sandbox: listing {args[0]!r} is not allowed")
    elif event in ("os.kill", "os.killpg") and args[0] != own_pid:
        raise PermissionError(f"sandbox: {event} on {args[0]} is not allowed")
    elif event == "object.__setattr__" and args[1] in ("__code__", "__defaults__",
                                                       "__kwdefaults__"):
        raise PermissionError(f"sandbox: setting {args[1]} is not allowed")
    elif event == "object.__getattr__" and args[1] in frames:
        raise PermissionError(f"sandbox: reading {args[1]} is not allowed")

sys.addaudithook(_hook)
del _hook, _inside, _resolve, _cfg, _name, _value, _which, _hard, _module, _attr
del json, resource, posix, stat, types
sys.argv = ["main.py"]
runpy.run_path("main.py", run_name="__main__")
"""

# Events the best-effort hook refuses: new processes, signals, limit changes, sockets, hooks.
_BLOCKED = (
    "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
    "os.startfile", "pty.spawn", "subprocess.Popen", "resource.setrlimit", "resource.prlimit",
    "signal.pthread_kill", "socket.__new__", "socket.bind", "socket.connect", "socket.sendmsg",
    "socket.sendto", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
    "socket.getnameinfo", "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    "sys.addaudithook", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "mmap.__new__",
    "os.mkfifo",
)  # fmt: skip
_BLOCKED_MODULES = (
    "ctypes", "_ctypes", "readline", "gc", "_posixsubprocess", "_testcapi",
    "_testinternalcapi", "_xxsubinterpreters", "cffi", "_cffi_backend", "mmap",
)  # fmt: skip


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    Attributes:
        returncode: the exit status; negative ``-N`` when signal ``N`` ended it.
        stdout, stderr: its output (UTF-8, undecodable bytes replaced); when longer than
            ``max_output_bytes`` the middle is cut out and marked.
        timed_out: the wall timeout killed it.
        killed_reason: why it was killed, or None when it exited by itself:
            ``"wall_timeout"``, ``"cpu_time"`` (RLIMIT_CPU), ``"file_size"`` (RLIMIT_FSIZE),
            ``"processes"`` (more than ``max_processes``), ``"output_limit"`` or
            ``"signal SIGSEGV"``-like. (Over ``memory_mb``, Python raises ``MemoryError``
            and exits with 1.)
        isolation: ``"namespaces"`` or ``"best_effort"``.
        wall_s: seconds from start to exit.

    Example::

        >>> SandboxResult(0, "ok\\n", "", False, None, "namespaces", 0.05).ok
        True
    """

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None
    isolation: str
    wall_s: float

    @property
    def ok(self) -> bool:
        """Exited by itself with status 0."""
        return self.returncode == 0 and self.killed_reason is None


# ----------------------------------------------------------------------------- where we run


def _python() -> str:
    """The base interpreter (a venv's ``python`` needs the venv's folder; its base does not)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _program(site_packages: bool) -> list[str]:
    """The interpreter and its flags: the base one with the standard library only (``-S``), or
    this one (a venv's, its site-packages included)."""
    if site_packages:
        return [os.path.abspath(sys.executable), "-I", "-B"]
    return [_python(), "-I", "-S", "-B"]


def _binds(site_packages: bool = False) -> list[str]:
    """Host paths the namespaces sandbox shows read-only: the system's and the interpreter's."""
    python = _python()
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    if site_packages:
        prefixes |= {os.path.realpath(sys.prefix), os.path.dirname(os.path.abspath(sys.executable))}
    if not any(python.startswith(p + "/") for p in prefixes):
        prefixes.add(os.path.dirname(python))
    binds = [p for p in _BIND_CANDIDATES if os.path.lexists(p)]
    covered = [os.path.realpath(p) for p in binds if os.path.isdir(p) and not os.path.islink(p)]
    for prefix in sorted(prefixes):
        if not any(prefix == c or prefix.startswith(c + "/") for c in covered):
            binds.append(prefix)
    return binds


@functools.cache
def namespaces_problem() -> str | None:
    """Why the namespaces sandbox cannot run here (one phrase), or None when it can: a real
    run of ``pass`` through it, done once per process.

    Example::

        >>> namespaces_problem() is None or isinstance(namespaces_problem(), str)
        True
    """
    if shutil.which("unshare") is None:
        return "no `unshare` program (util-linux) on PATH"
    if platform.machine() not in _PIVOT_ROOT:
        return f"no pivot_root system call number known for {platform.machine()}"
    try:
        result = _run_namespaces("pass", "", 10.0, 256, 4, 16, 16, 1 << 16, False)
    except RuntimeError as e:
        return str(e).removeprefix("the code sandbox did not start: ")
    if not result.ok:
        return f"a test run ended with {result.returncode}: {result.stderr.strip()[-200:]}"
    return None


def namespaces_available() -> bool:
    """Whether ``isolation="namespaces"`` works on this machine (see :func:`namespaces_problem`).

    Example::

        >>> isinstance(namespaces_available(), bool)
        True
    """
    return namespaces_problem() is None


def available_isolation() -> tuple[str, ...]:
    """The isolation modes this machine offers, strongest first.

    Example::

        >>> available_isolation()[-1]
        'best_effort'
    """
    return ("namespaces", "best_effort") if namespaces_available() else ("best_effort",)


def resolve_isolation(isolation: str) -> str:
    """``"namespaces"`` or ``"best_effort"`` for ``isolation``; ``"auto"`` and ``"namespaces"``
    raise RuntimeError (one line saying how to opt in) where namespaces cannot run.

    Example::

        >>> resolve_isolation("best_effort")
        'best_effort'
    """
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"isolation={isolation!r} is not one of {list(ISOLATION_MODES)}")
    if isolation == "best_effort":
        return isolation
    problem = namespaces_problem()
    if problem is not None:
        raise RuntimeError(_OPT_IN.format(why=problem))
    return "namespaces"


# ----------------------------------------------------------------------------- the parent side


class _Output:
    """One output pipe's bytes: the first and the last ``limit // 2`` kept, the total counted."""

    def __init__(self, limit: int) -> None:
        self.limit, self.head, self.tail, self.total = limit, bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        self.tail += data
        del self.tail[: max(0, len(self.tail) - self.limit // 2)]

    def text(self) -> str:
        cut = self.total - len(self.head) - len(self.tail)
        mark = f"\n...[{cut} bytes cut]...\n".encode() if cut > 0 else b""
        return bytes(self.head + mark + self.tail).decode("utf-8", errors="replace")


def _pump(proc, feeds, outputs, deadline: float) -> str | None:
    """Write ``feeds`` (file -> bytes; each closed once written), read ``outputs`` (fd -> _Output) until the process ended
    and its pipes are drained (or :data:`_READ_GRACE_S` after it ended), or ``deadline``.
    Returns ``"wall_timeout"``, ``"output_limit"`` or None. Never blocks on the child."""
    selector = selectors.DefaultSelector()
    for file, data in feeds.items():
        os.set_blocking(file.fileno(), False)
        selector.register(file, selectors.EVENT_WRITE, memoryview(data))
    for fd in outputs:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    ended_at = None
    try:
        while True:
            now = time.monotonic()
            if ended_at is None and proc.poll() is not None:
                ended_at = now
            if now >= deadline:
                return "wall_timeout"
            if ended_at is not None and (now - ended_at > _READ_GRACE_S or not selector.get_map()):
                _drain(selector, outputs)  # what is already in the pipes
                return None
            if not selector.get_map():  # it closed its pipes and goes on: wait for its end
                time.sleep(min(0.01, deadline - now))
                continue
            for key, _ in selector.select(timeout=min(0.05, deadline - now)):
                if key.events & selectors.EVENT_WRITE:
                    try:
                        rest = key.data[os.write(key.fd, key.data[:65536]) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        rest = b""  # it stopped reading: nothing more to give
                    if len(rest):
                        selector.modify(key.fileobj, selectors.EVENT_WRITE, rest)
                    else:
                        selector.unregister(key.fileobj)
                        key.fileobj.close()
                    continue
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not data:
                    selector.unregister(key.fd)
                    continue
                outputs[key.fd].add(data)
                if sum(o.total for o in outputs.values()) > OUTPUT_KILL_BYTES:
                    return "output_limit"
    finally:
        selector.close()


def _drain(selector, outputs) -> None:
    """Read what the pipes hold now, without waiting (a child left behind may keep one open)."""
    for key in list(selector.get_map().values()):
        if key.fd not in outputs:
            continue
        while outputs[key.fd].total <= OUTPUT_KILL_BYTES:
            try:
                data = os.read(key.fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            outputs[key.fd].add(data)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()


def _limits(timeout_s: float, memory_mb: int, file_mb: int, processes: int) -> list:
    return [
        ("RLIMIT_AS", memory_mb << 20),
        ("RLIMIT_CPU", math.ceil(timeout_s) + 1),
        ("RLIMIT_FSIZE", file_mb << 20),
        ("RLIMIT_NOFILE", _OPEN_FILES),
        ("RLIMIT_CORE", 0),
        ("RLIMIT_NPROC", processes),
    ]


def _signal_reason(returncode: int) -> str | None:
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


def _start(command, cwd, stdin, env, pass_fds=()) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=pass_fds,
    )


def _collect(proc, feeds, limit, deadline) -> tuple[str | None, _Output, _Output]:
    out, err = _Output(limit), _Output(limit)
    try:
        reason = _pump(
            proc, feeds, {proc.stdout.fileno(): out, proc.stderr.fileno(): err}, deadline
        )
    finally:
        _kill(proc)  # and whatever it left in its group
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return reason, out, err


def _run_namespaces(
    code,
    stdin,
    timeout_s,
    memory_mb,
    file_mb,
    disk_mb,
    max_processes,
    max_output_bytes,
    site_packages,
) -> SandboxResult:
    mountpoint = tempfile.mkdtemp(prefix="tunesmith-sandbox-")
    config = {
        "mountpoint": mountpoint,
        "disk_mb": disk_mb,
        "inodes": 4096,
        "binds": _binds(site_packages),
        "devices": list(_DEVICES),
        "pivot_root": _PIVOT_ROOT[platform.machine()],
        "python": _program(site_packages)[0],
        "argv": _program(site_packages),
        "code": code,
        "stdin": stdin,
        "limits": _limits(timeout_s, memory_mb, file_mb, max_processes),
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/tmp"},
        "timeout_s": timeout_s + _INIT_GRACE_S,
        "max_processes": max_processes,
    }
    status_r, status_w = os.pipe()
    unshare = [
        shutil.which("unshare") or "unshare", "--user", "--map-root-user", "--mount", "--pid",
        "--fork", "--kill-child", "--net", "--ipc", "--uts", "--",
        _python(), "-I", "-S", "-B", "-c", _INIT, str(status_w), "tunesmith-sandbox-init",
    ]  # fmt: skip
    try:
        start = time.monotonic()
        try:
            proc = _start(unshare, "/", subprocess.PIPE, {"PATH": os.defpath}, (status_w,))
        finally:
            os.close(status_w)
        status = _Output(1 << 16)
        feeds = {proc.stdin: json.dumps(config).encode()}
        out, err = _Output(max_output_bytes), _Output(max_output_bytes)
        outputs = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
        try:
            reason = _pump(proc, feeds, outputs, start + timeout_s)
        finally:
            _kill(proc)
            proc.wait()
            for f in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    f.close()
        wall = time.monotonic() - start
    finally:
        os.close(status_r)
        with contextlib.suppress(OSError):
            os.rmdir(mountpoint)
    lines = status.text().splitlines()
    if not lines or lines[0] != "ready":
        if reason == "wall_timeout" and not lines:
            raise RuntimeError(f"the code sandbox did not start within {timeout_s} s")
        why = lines[0].removeprefix("error ") if lines else err.text().strip()[-300:]
        raise RuntimeError(f"the code sandbox did not start: {why or 'no reason given'}")
    returncode, killed = -signal.SIGKILL, reason
    last = lines[-1].split(" ", 1)
    if last[0] == "exit" and reason is None:
        returncode = int(last[1])
        killed = _signal_reason(returncode)
    elif last[0] == "killed" and reason is None:
        killed = last[1]
    return SandboxResult(
        returncode=returncode,
        stdout=out.text(),
        stderr=err.text(),
        timed_out=killed == "wall_timeout",
        killed_reason=killed,
        isolation="namespaces",
        wall_s=wall,
    )


def _remove_tree(root: str) -> None:
    """Delete ``root`` even where the code took away permissions."""
    for dirpath, dirnames, _ in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    shutil.rmtree(root, ignore_errors=True)


def _run_best_effort(
    code, stdin, timeout_s, memory_mb, file_mb, max_output_bytes, site_packages
) -> SandboxResult:
    root = os.path.realpath(tempfile.mkdtemp(prefix="tunesmith-sandbox-"))
    try:
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(root, "stdin"), "w", encoding="utf-8") as f:
            f.write(stdin)
        config = {
            "root": work,
            "blocked": list(_BLOCKED),
            "modules": list(_BLOCKED_MODULES),
            "limits": _limits(timeout_s, memory_mb, file_mb, 1),
        }
        command = [*_program(site_packages), "-c", _BOOTSTRAP, json.dumps(config)]
        env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": work, "TMPDIR": work}
        with open(os.path.join(root, "stdin"), "rb") as fin:
            start = time.monotonic()
            proc = _start(command, work, fin, env)
        reason, out, err = _collect(proc, {}, max_output_bytes, start + timeout_s)
        wall = time.monotonic() - start
        returncode = proc.returncode if reason is None else -signal.SIGKILL
        return SandboxResult(
            returncode=returncode,
            stdout=out.text(),
            stderr=err.text(),
            timed_out=reason == "wall_timeout",
            killed_reason=reason or _signal_reason(returncode),
            isolation="best_effort",
            wall_s=wall,
        )
    finally:
        _remove_tree(root)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def run_sandboxed(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    stdin: str = "",
    isolation: str = "auto",
    file_mb: int = 16,
    disk_mb: int = 32,
    max_processes: int = 16,
    max_output_bytes: int = 1 << 20,
    site_packages: bool = False,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a sandbox (see the module docs) and return what it did.

    Args:
        code: Python source.
        timeout_s: wall-clock limit in seconds; the whole tree is killed after it.
        memory_mb: address-space limit (RLIMIT_AS) per process in MiB; the interpreter itself
            takes some tens of MiB of it.
        stdin: text fed to the program's standard input.
        isolation: ``"auto"`` (= ``"namespaces"``: RuntimeError naming the opt-in where this
            machine cannot), ``"namespaces"`` or ``"best_effort"`` (see
            :data:`BEST_EFFORT_GAPS`).
        file_mb: largest file the program may write, in MiB.
        disk_mb: all files together, in MiB (the tmpfs's size; namespaces mode).
        max_processes: processes the program may have at once (namespaces mode; best effort
            allows none).
        max_output_bytes: most bytes of stdout and of stderr kept in the result.
        site_packages: run this interpreter with its site-packages (a venv's included, shown
            read-only) instead of the base interpreter with the standard library only (``-S``;
            faster, and no ``.pth`` file runs).

    Raises RuntimeError when the sandbox itself cannot start, so that a broken setup is not
    mistaken for failing programs.

    Example::

        >>> run_sandboxed("while True: pass", timeout_s=1, memory_mb=256).killed_reason
        'wall_timeout'
    """
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number, got {timeout_s!r}")
    for name, value in (
        ("memory_mb", memory_mb),
        ("file_mb", file_mb),
        ("disk_mb", disk_mb),
        ("max_processes", max_processes),
        ("max_output_bytes", max_output_bytes),
    ):
        _positive_int(name, value)
    mode = resolve_isolation(isolation)
    if mode == "best_effort":
        return _run_best_effort(
            code, stdin, timeout_s, memory_mb, file_mb, max_output_bytes, site_packages
        )
    return _run_namespaces(
        code,
        stdin,
        timeout_s,
        memory_mb,
        file_mb,
        disk_mb,
        max_processes,
        max_output_bytes,
        site_packages,
    )
