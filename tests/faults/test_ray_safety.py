"""Ray and code execution, end to end through ``tunesmith``:

* every route of ``ray_cases.RUNTIME_ENV_ROUTES`` (a Ray ``runtime_env`` in ``rollout``,
  ``reward_workers``, ``trainer_group`` or ``ray``, written out, interpolated, decoded from
  the environment, or an interpolation that cannot be resolved) is refused by ``tunesmith
  validate`` and ``tunesmith run grpo_async`` in this process with the same first line naming
  the key, before Ray starts and before anything is written; each payload that is cheap to
  run is shown live (the script, the module ``PYTHONWARNINGS`` imports, the startup file, the
  preloaded library, the browser command);
* with ``--allow-runtime-env`` (or ``--allow-any-component``) the config validates, and a run
  whose ``py_executable`` creates a marker trains with it (Ray);
* a run started in a folder holding ``sitecustomize.py`` and ``torch.py`` imports neither in
  its Ray workers (both shown live with that folder on the path);
* ``ray.address`` at a closed port, ``auto`` with no cluster, a port that answers but is not
  Ray, and an address with no port each end the run with one line in bounded time.

Ray starts only in the cases marked ``ci=False``, each in a temp dir of its own with
``RAY_AUTH_MODE=disabled``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults import ray_cases
from tests.faults.catalogue import params
from tests.faults.safety_cases import ENV_UNSET, UNRESOLVED_KIND
from tests.recipes.sft_world import REPO_ROOT, make_model_dir
from tests.rl.rl_world import make_prompts, ray_temp_dir
from tunesmith.cli.main import ALLOW_ANY_ENV, ALLOW_RUNTIME_ENV, main

CASES = {p.id: p for p in [*params("safety"), *params("bad_input")]}
ROUTES = {r.id: r for r in ray_cases.RUNTIME_ENV_ROUTES}
TINY = REPO_ROOT / "tunesmith" / "recipes" / "configs" / "grpo_async" / "tiny.yaml"
FAST = ("max_steps=1", "generation.max_new_tokens=4", "progress_bar=false", "ray.num_cpus=2")


@pytest.fixture(scope="module")
def ray_world(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny policy folder and addition prompts."""
    root = tmp_path_factory.mktemp("ray_safety")
    return make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=8)


@pytest.fixture
def no_opt_in(monkeypatch) -> None:
    """Neither allow-list opt-in set (restored afterwards, also when a test's flag sets one)."""
    for name in (ALLOW_ANY_ENV, ALLOW_RUNTIME_ENV):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")


def _common(world: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    model_dir, prompts = world
    return [f"model_dir={model_dir}", f"prompts.source={prompts}", f"output_dir={out}", *FAST,
            *extra]  # fmt: skip


def _cli(capsys, argv: list[str]) -> tuple[int, str, str]:
    """``tunesmith ARGV`` in this process: exit code, stdout, stderr (no traceback allowed)."""
    capsys.readouterr()
    code = main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    return code, captured.out, captured.err


def _first_line(code: int, err: str) -> str:
    assert code == 1, err
    first = err.splitlines()[0]
    assert first.startswith("tunesmith: error: "), err
    return first


def _ray_started() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


# ----------------------------------------------------------------------------- payloads


def _payloads(folder: Path, marker: Path) -> None:
    """The case's payload files: a Python wrapper script, a module whose import (a warning
    category of ``PYTHONWARNINGS``) creates ``marker``, a startup file, a shared library."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "py.sh"
    script.write_text(f'#!/bin/sh\ntouch {marker}\nexec {sys.executable} "$@"\n')
    script.chmod(0o755)
    package = folder / "pkgs" / "tsevil_warn"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\nclass Boom(Warning):\n    pass\n"
    )
    (folder / "startup.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is not None:
        source = folder / "evil.c"
        source.write_text(
            "#include <stdio.h>\n__attribute__((constructor)) static void boom(void) {\n"
            f'  FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n}}\n'
        )
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-o", str(folder / "evil.so"), str(source)], check=True
        )


def _live(what: str, folder: Path, marker: Path) -> str:
    """Show that the payload of ``what`` runs code (outside Ray, as a worker would start);
    returns how it was shown."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONWARNINGS")}
    run = {"cwd": folder, "stdin": subprocess.DEVNULL, "capture_output": True, "timeout": 60}
    shown = what
    if what == "py_executable":
        subprocess.run([str(folder / "py.sh"), "-c", "pass"], env=env, **run)
    elif what == "PYTHONWARNINGS":
        env.update(PYTHONWARNINGS="ignore::tsevil_warn.Boom", PYTHONPATH=str(folder / "pkgs"))
        subprocess.run([sys.executable, "-c", "pass"], env=env, **run)
    elif what == "PYTHONSTARTUP":
        env.update(PYTHONSTARTUP=str(folder / "startup.py"))
        subprocess.run([sys.executable, "-i"], env=env, **run)
    elif what == "BROWSER":
        env.update(BROWSER=f"touch {marker} #%s")
        subprocess.run(
            [sys.executable, "-c", "import webbrowser; webbrowser.open('x')"], env=env, **run
        )
    elif what == "LD_PRELOAD" and (folder / "evil.so").is_file():
        env.update(LD_PRELOAD=str(folder / "evil.so"))
        subprocess.run(["/bin/true"], env=env, **run)
    elif what == "LD_PRELOAD":  # no C compiler here: the loader is shown to read the variable
        env.update(LD_PRELOAD=str(folder / "missing.so"))
        done = subprocess.run(["/bin/true"], env=env, **run)
        assert "LD_PRELOAD" in done.stderr.decode(), done.stderr
        return "LD_PRELOAD read by the loader (no C compiler to build a library)"
    assert marker.exists(), f"the {what} payload did not run"
    marker.unlink()
    return shown


# ----------------------------------------------------------------------------- runtime_env


# the routes that name the opt-in, and those whose value cannot be resolved (bad inputs)
REFUSED = [*params("safety", "runtime-env"),
           *(p for p in params("bad_input", UNRESOLVED_KIND) if p.id in ROUTES)]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_runtime_env_is_refused(case, ray_world, tmp_path, capsys, monkeypatch, no_opt_in, outcome):
    route = ROUTES[case.id]
    folder, marker, out = tmp_path / "case", tmp_path / "payload-ran", tmp_path / "out"
    _payloads(folder, marker)
    monkeypatch.setenv(ray_cases.ENV_RUNTIME_ENV, f"{{py_executable: {folder}/py.sh}}")
    monkeypatch.delenv(ENV_UNSET, raising=False)
    override = route.override.format(folder=folder, marker=marker)
    common = _common(ray_world, out, override)
    code, stdout, err = _cli(capsys, ["validate", str(TINY), *common])
    validated = _first_line(code, err)
    assert "OK" not in stdout
    code, _, err = _cli(capsys, ["run", "grpo_async", "--config", "tiny", *common])
    assert _first_line(code, err) == validated, (validated, err)
    assert validated.startswith(f"tunesmith: error: {route.where}"), validated
    assert route.says in validated, validated
    assert ("--allow-runtime-env" in validated) == (route.kind == "runtime-env"), validated
    assert not marker.exists() and not out.exists() and not _ray_started()
    details = {"outcome": "refused", "error": validated.replace(str(folder), "<case>")}
    if route.live:
        details["live"] = _live(route.live, folder, marker)
    outcome.update(details)


@pytest.mark.parametrize("case", [CASES["runtime-env-opt-in-validates"]])
def test_opt_in_validates(case, ray_world, tmp_path, capsys, no_opt_in, outcome):
    override = ROUTES["runtime-env-py-executable"].override.format(folder=tmp_path, marker="")
    common = _common(ray_world, tmp_path / "out", override)
    code, _, err = _cli(capsys, ["validate", str(TINY), *common])
    assert "--allow-runtime-env" in _first_line(code, err)
    for flag in ("--allow-runtime-env", "--allow-any-component"):
        code, stdout, err = _cli(capsys, [flag, "validate", str(TINY), *common])
        assert code == 0 and "tiny.yaml: OK" in stdout, err
    assert not (tmp_path / "out").exists()
    outcome.update(outcome="validated with either flag", exit_code=0)


def _tunesmith(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The ``tunesmith`` console script in a process of its own (Ray starts there), run from
    ``cwd`` with no ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run(
        [str(Path(sys.executable).parent / "tunesmith"), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("case", [CASES["runtime-env-opt-in-runs"]])
def test_opt_in_runs_the_runtime_env(case, ray_world, tmp_path, no_opt_in, outcome):
    folder, marker, out = tmp_path / "case", tmp_path / "payload-ran", tmp_path / "out"
    _payloads(folder, marker)
    override = ROUTES["runtime-env-py-executable"].override.format(folder=folder, marker=marker)
    with ray_temp_dir() as temp:
        done = _tunesmith(
            [
                "--allow-runtime-env",
                "run",
                "grpo_async",
                "--config",
                "tiny",
                *_common(ray_world, out, override, f"ray.temp_dir={temp}"),
            ],
            tmp_path,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists(), "the rollout worker did not start through py_executable"
    assert (out / "checkpoints").is_dir()
    outcome.update(outcome="built and trained", exit_code=0, marker="created by the worker")


# ----------------------------------------------------------------------------- working folder


def _plant(folder: Path, names: tuple[str, ...], tmp_path: Path) -> dict[str, Path]:
    """``NAME.py`` in ``folder`` for each name, creating ``tmp_path/NAME-imported`` (then
    failing) when imported; returns the markers."""
    folder.mkdir(exist_ok=True)
    markers = {name: tmp_path / f"{name}-imported" for name in names}
    for name, marker in markers.items():
        (folder / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'w').write('imported')\nraise ImportError('planted')\n"
        )
    return markers


def _imported(markers: dict[str, Path]) -> list[str]:
    """The planted files that ran (their markers removed)."""
    ran = [name for name, marker in markers.items() if marker.exists()]
    for name in ran:
        markers[name].unlink()
    return ran


@pytest.mark.parametrize("case", [CASES["ray-worker-env-cwd-files"]])
def test_the_worker_environment_imports_nothing_from_the_folder(
    case, tmp_path, monkeypatch, no_opt_in, outcome
):
    from tunesmith.rl.asynchronous.pipeline import runtime_env

    here = tmp_path / "run_here"
    markers = _plant(here, ("sitecustomize", "json"), tmp_path)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    probe = [sys.executable, "-c", "import json"]
    run = {"cwd": here, "capture_output": True, "timeout": 60}
    subprocess.run(probe, env={**base, "PYTHONPATH": str(here)}, **run)  # the former workers'
    assert _imported(markers) == ["sitecustomize", "json"], "the planted files did not run"
    monkeypatch.chdir(here)  # the pipeline makes its actors from the run's folder
    worker = runtime_env({}, "rollout")["env_vars"]
    assert str(here) not in worker["PYTHONPATH"].split(os.pathsep)
    done = subprocess.run(probe, env={**base, **worker}, **run)
    assert done.returncode == 0, done.stderr
    assert _imported(markers) == []
    outcome.update(
        outcome="refused",
        imported="neither sitecustomize.py nor json.py",
        env="PYTHONSAFEPATH=1, PYTHONPATH=" + (worker["PYTHONPATH"] or "''"),
    )


@pytest.mark.parametrize("case", [CASES["ray-workers-cwd-sitecustomize"]])
def test_workers_import_nothing_from_the_working_folder(
    case, ray_world, tmp_path, no_opt_in, outcome
):
    here, out = tmp_path / "run_here", tmp_path / "out"
    here.mkdir()
    markers = {name: tmp_path / f"{name}-imported" for name in ("sitecustomize", "torch")}
    for name, marker in markers.items():
        (here / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'w').write('imported')\nraise ImportError('planted')\n"
        )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    # live: with the folder on the path, as the workers had it, both files run
    subprocess.run(
        [sys.executable, "-c", "pass"],
        env={**env, "PYTHONPATH": str(here)},
        capture_output=True,
        timeout=60,
    )
    subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(here)!r}); import torch"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert all(m.exists() for m in markers.values()), "the planted files did not run"
    for marker in markers.values():
        marker.unlink()
    with ray_temp_dir() as temp:
        done = _tunesmith(
            [
                "run",
                "grpo_async",
                "--config",
                "tiny",
                *_common(ray_world, out, f"ray.temp_dir={temp}"),
            ],
            here,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any(m.exists() for m in markers.values()), [str(m) for m in markers.values()]
    assert (out / "checkpoints").is_dir()
    outcome.update(outcome="refused", imported="neither sitecustomize.py nor torch.py")


# ----------------------------------------------------------------------------- ray.address


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed_run(capsys, world, out: Path, *extra: str) -> tuple[str, float]:
    start = time.monotonic()
    code, _, err = _cli(
        capsys, ["run", "grpo_async", "--config", "tiny", *_common(world, out, *extra)]
    )
    return _first_line(code, err), time.monotonic() - start


@pytest.mark.parametrize("case", [CASES["ray-address-closed-port"]])
def test_closed_port_is_refused_in_bounded_time(
    case, ray_world, tmp_path, capsys, no_opt_in, outcome
):
    port = _closed_port()
    line, seconds = _timed_run(capsys, ray_world, tmp_path / "out", f"ray.address=127.0.0.1:{port}")
    assert line.startswith(f"tunesmith: error: ray.address: 127.0.0.1:{port}: cannot connect"), line
    assert seconds < 30 and not _ray_started()
    outcome.update(
        outcome="refused", error=line.replace(str(port), "<port>"), seconds=round(seconds, 1)
    )


@pytest.mark.parametrize("case", [CASES["ray-address-auto-no-cluster"]])
def test_auto_without_a_cluster_is_refused(
    case, ray_world, tmp_path, capsys, monkeypatch, no_opt_in, outcome
):
    from ray._private import services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # a machine where no Ray runs: other tests' instances (found by a process scan) hidden
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    empty = tmp_path / "ray_tmp"  # holds no ray_current_cluster file
    empty.mkdir()
    line, seconds = _timed_run(
        capsys, ray_world, tmp_path / "out", "ray.address=auto", f"ray.temp_dir={empty}"
    )
    assert line.startswith("tunesmith: error: ray.address: auto, but no Ray cluster"), line
    assert seconds < 30 and not _ray_started()
    outcome.update(outcome="refused", error=line, seconds=round(seconds, 1))


@pytest.mark.parametrize("case", [CASES["ray-address-not-ray"]])
def test_port_that_is_not_ray_is_refused(case, ray_world, tmp_path, no_opt_in, outcome):
    with socket.socket() as server, ray_temp_dir() as temp:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # connections complete in the kernel; nothing ever answers
        port = server.getsockname()[1]
        argv = ["run", "grpo_async", "--config", "tiny",
                *_common(ray_world, tmp_path / "out", f"ray.address=127.0.0.1:{port}",
                         "ray.connect_timeout_s=5", f"ray.temp_dir={temp}")]  # fmt: skip
        start = time.monotonic()
        done = _tunesmith(argv, tmp_path)
        seconds = time.monotonic() - start
    errors = [line for line in done.stderr.splitlines() if line.startswith("tunesmith: error:")]
    assert done.returncode == 1 and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"tunesmith: error: ray.address: 127.0.0.1:{port}: "), errors
    assert "within 5 s (ray.connect_timeout_s)" in errors[0] or "cannot connect" in errors[0]
    assert seconds < 60, seconds
    outcome.update(
        outcome="refused", error=errors[0].replace(str(port), "<port>"), seconds=round(seconds, 1)
    )


@pytest.mark.parametrize("case", [CASES["ray-address-malformed"]])
def test_malformed_address_is_refused(case, ray_world, tmp_path, capsys, no_opt_in, outcome):
    common = _common(ray_world, tmp_path / "out", "ray.address=head-node")
    code, _, err = _cli(capsys, ["validate", str(TINY), *common])
    validated = _first_line(code, err)
    code, _, err = _cli(capsys, ["run", "grpo_async", "--config", "tiny", *common])
    assert _first_line(code, err) == validated
    assert validated.startswith("tunesmith: error: ray.address: expected null, 'auto' or HOST:PORT")
    assert not (tmp_path / "out").exists()
    outcome.update(outcome="refused", error=validated)
