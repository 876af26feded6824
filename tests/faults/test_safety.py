"""Nothing from a config or a file runs code unless the user says so, end to end through
``tunesmith run``: ``_component_`` paths outside the allow-list are refused (and built with
``--allow-any-component``); every route of ``safety_cases.ROUTES`` (attribute chains through
each allowed package, re-exported loaders, code runners, dunder and private hops, list items,
nested components, interpolations) is refused by ``run`` and by ``validate`` with the same
line; pickled weights are refused; and a checkpoint whose training state, optimizer metadata or
optimizer entries pickle a command (protocol 2 or 4, a dotted STACK_GLOBAL name, a global some
code allowed with ``add_safe_globals``) is refused when resumed. Each payload is shown to be
live (the unsafe call or plain ``pickle``/``torch.load``/``dcp.load`` runs it); the suite then
checks that ours never does. A static scan keeps the package free of unsafe loads."""

from __future__ import annotations

import ast
import contextlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

from tests.faults import safety_cases
from tests.faults.catalogue import params
from tests.faults.components import Evil
from tests.faults.kit import reseal
from tests.recipes.sft_world import REPO_ROOT, checkpoints, subprocess_env
from tunesmith.cli.main import ALLOW_ANY_ENV, main

CASES = {p.id: p for p in params("safety")}


def _run(capsys, world, out: Path, *overrides: str, flags: tuple[str, ...] = ()) -> tuple[int, str]:
    argv = [*flags, "run", "sft", "--config", "tiny", f"model_dir={world.model_dir}",
            f"dataset.source={world.chat}", f"output_dir={out}", "max_steps=2",
            "progress_bar=false", *overrides]  # fmt: skip
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def _refused(code: int, err: str, *words: str) -> str:
    assert code == 1, err
    first = err.splitlines()[0]
    assert first.startswith("tunesmith: error: "), err
    for word in words:
        assert word in err, f"{word!r} not in {err}"
    return first


@pytest.fixture
def marker(tmp_path) -> Path:
    """The file a payload would create; it must never appear."""
    return tmp_path / "payload-ran"


# ----------------------------------------------------------------------------- components


@pytest.mark.parametrize("case", [CASES["component-os-system"]])
def test_os_system_component_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    code, err = _run(
        capsys,
        fault_world,
        tmp_path / "out",
        "loss._component_=os.system",
        f"loss.command='touch {marker}'",
    )
    line = _refused(
        code, err, "loss._component_: component 'os.system' is not allowed", "--allow-any-component"
    )
    assert not marker.exists() and not (tmp_path / "out").exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["component-subprocess-run"]])
def test_subprocess_component_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    logger = f"metric_loggers=[{{_component_: subprocess.run, args: [touch, {marker}]}}]"
    code, err = _run(capsys, fault_world, tmp_path / "out", logger)
    line = _refused(
        code, err, "metric_loggers.0._component_: component 'subprocess.run' is not allowed"
    )
    assert not marker.exists() and not (tmp_path / "out").exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


RECORDING = "tests.faults.components.RecordingCrossEntropy"


@pytest.mark.parametrize("case", [CASES["component-test-loss-refused"]])
def test_component_outside_allow_list_is_refused(
    case, fault_world, tmp_path, marker, capsys, monkeypatch, outcome
):
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    code, err = _run(
        capsys,
        fault_world,
        tmp_path / "out",
        f"loss._component_={RECORDING}",
        f"loss.marker={marker}",
    )
    line = _refused(code, err, f"loss._component_: component '{RECORDING}' is not allowed")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["component-test-loss-allowed"]])
def test_allow_any_component_builds_it(
    case, fault_world, tmp_path, marker, capsys, monkeypatch, outcome
):
    monkeypatch.setenv(ALLOW_ANY_ENV, "0")  # restored after the test (the flag sets it to 1)
    code, err = _run(
        capsys,
        fault_world,
        tmp_path / "out",
        f"loss._component_={RECORDING}",
        f"loss.marker={marker}",
        flags=("--allow-any-component",),
    )
    assert code == 0, err
    assert marker.read_text() == "built"
    assert [p.name for p in checkpoints(tmp_path / "out")] == ["step_000002"]
    outcome.update(outcome="built and trained", exit_code=0)


# ----------------------------------------------------------------------------- routes

ROUTES = {r.id: r for r in safety_cases.ROUTES}
SFT_TINY = REPO_ROOT / "tunesmith" / "recipes" / "configs" / "sft" / "tiny.yaml"


@pytest.fixture(scope="module")
def allowed_packages_imported() -> None:
    """Import the allowed packages the routes go through once, up front: their import-time
    warnings would otherwise come before the one-line error."""
    import bitsandbytes.cuda_specs  # noqa: F401
    import datasets.load  # noqa: F401
    import peft.utils.other  # noqa: F401
    import torchao  # noqa: F401
    import transformers.utils.hub  # noqa: F401


def _grammar(value: object) -> str:
    """``value`` written in omegaconf's interpolation grammar (keys unquoted), for
    ``${oc.create:...}``.

    >>> _grammar({"_component_": "os.system", "command": "touch x"})
    '{_component_: "os.system", command: "touch x"}'
    """
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_grammar(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_grammar(item) for item in value) + "]"
    return json.dumps(value)  # strings quoted, numbers, true/false, null


def _route_overrides(route: safety_cases.Route, folder: Path, marker: Path) -> list[str]:
    """The CLI overrides that put ``route`` into the tiny sft config."""
    node = {"_component_": route.component, **route.payload(folder, marker)}
    loss = "tunesmith.modules.losses.CrossEntropyLoss"
    if route.placement == "env":
        node["_component_"] = f"${{oc.env:{safety_cases.ENV_COMPONENT}}}"
    if route.placement == "list":
        return [f"metric_loggers=[{json.dumps(node)}]"]
    if route.placement == "nested":
        node = {"_component_": loss, "inner": node}
    if route.placement.startswith("create"):
        made = f"${{oc.create:{_grammar(node)}}}"
        if route.placement == "create-list":
            return [f"metric_loggers=[{json.dumps(made)}]"]
        if route.placement == "create-nested":
            return [f"loss={{_component_: {loss}, inner: {json.dumps(made)}}}"]
        return [f"loss={made}"]
    return [f"loss={json.dumps(node)}"]


def _prepare(route: safety_cases.Route, folder: Path, marker: Path, monkeypatch) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    overrides = _route_overrides(route, folder, marker)
    if route.placement == "env":
        monkeypatch.setenv(safety_cases.ENV_COMPONENT, route.component)
    else:  # a variable the config once read is redacted from messages while it is set
        monkeypatch.delenv(safety_cases.ENV_COMPONENT, raising=False)
    if (folder / "pkgs").is_dir():
        monkeypatch.syspath_prepend(str(folder / "pkgs"))
    return overrides


def _show_live(route: safety_cases.Route, folder: Path, marker: Path) -> None:
    """Called as the config would call it, with the allow-list lifted, the route runs its
    payload: the refused route is a real one."""
    from tunesmith.config import instantiate

    node = {"_component_": route.component, **route.payload(folder, marker)}

    def call() -> None:
        try:  # built as the config would build it: nested nodes (a `self:`) first
            instantiate(node, allow_any_component=True)
        except KeyboardInterrupt:
            raise
        except BaseException:  # dcp's CheckpointException is one; the payload ran before it
            pass

    _assert_live(marker, call)
    if route.never_imported:
        sys.modules.pop(route.never_imported, None)


@pytest.mark.parametrize("case", params("safety", "component-route"))
def test_route_to_code_execution_is_refused(
    case, fault_world, tmp_path, marker, capsys, monkeypatch, allowed_packages_imported, outcome
):
    route = ROUTES[case.id]
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    capsys.readouterr()
    overrides = _prepare(route, tmp_path / "case", marker, monkeypatch)
    code, err = _run(capsys, fault_world, tmp_path / "out", *overrides)
    where = route.where or f"{route.node}._component_"
    line = _refused(code, err, f"{where}: ", route.says, "--allow-any-component")
    assert not marker.exists() and not (tmp_path / "out").exists()
    if route.never_imported:
        assert route.never_imported not in sys.modules, f"{route.never_imported} was imported"
    if route.live:
        _show_live(route, tmp_path / "case", marker)
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["validate-refuses-every-route"]])
def test_validate_refuses_what_run_refuses(
    case, fault_world, tmp_path, marker, capsys, monkeypatch, allowed_packages_imported, outcome
):
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    capsys.readouterr()
    for route in safety_cases.ROUTES:
        folder = tmp_path / route.id
        overrides = _prepare(route, folder, marker, monkeypatch)
        common = [f"model_dir={fault_world.model_dir}", f"dataset.source={fault_world.chat}",
                  f"output_dir={folder / 'out'}", *overrides]  # fmt: skip
        code = main(["validate", str(SFT_TINY), *common])
        validated = capsys.readouterr()
        assert code == 1 and "OK" not in validated.out, (route.id, validated)
        code, err = _run(capsys, fault_world, folder / "out", *overrides)
        assert code == 1 and validated.err.splitlines()[0] == err.splitlines()[0], route.id
        assert not marker.exists() and not (folder / "out").exists(), route.id
    outcome.update(outcome="refused", routes=len(safety_cases.ROUTES))


UNRESOLVED = {u.id: u for u in safety_cases.UNRESOLVED}


@pytest.mark.parametrize(
    "case", [p for p in params("bad_input", safety_cases.UNRESOLVED_KIND) if p.id in UNRESOLVED]
)
def test_unresolvable_safety_key_is_named(
    case, fault_world, tmp_path, capsys, monkeypatch, allowed_packages_imported, outcome
):
    """A ``_component_``, ``weights_only`` or ``trust_remote_code`` (or a node holding one)
    that is an interpolation that cannot be resolved: ``validate`` and ``run`` give the same
    first line, naming the key."""
    route = UNRESOLVED[case.id]
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    monkeypatch.delenv(safety_cases.ENV_UNSET, raising=False)
    out = tmp_path / "out"
    capsys.readouterr()
    data = [f"model_dir={fault_world.model_dir}", f"dataset.source={fault_world.chat}"]
    code = main(["validate", str(SFT_TINY), *data, f"output_dir={out}", route.override])
    validated = capsys.readouterr()
    assert "OK" not in validated.out and "Traceback" not in validated.err, validated
    line = _refused(code, validated.err)
    assert _refused(*_run(capsys, fault_world, out, route.override)) == line
    assert line.startswith(f"tunesmith: error: {route.where}: interpolation "), line
    assert "cannot be resolved" in line and safety_cases.ENV_UNSET in line, line
    assert not out.exists()
    outcome.update(outcome="refused", error=line)


# ----------------------------------------------------------------------------- launch


def _planted_json(cwd: Path, marker: Path) -> Path:
    """A ``json.py`` in ``cwd`` that records its import in ``marker`` (and then fails)."""
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "json.py").write_text(
        f"open({str(marker)!r}, 'a').write('imported')\n"
        "raise ImportError('the working directory json.py was imported')\n"
    )
    return cwd


def _show_cwd_is_imported(cwd: Path, marker: Path) -> None:
    """Started the way ranks were (``python -m``), torchrun imports the planted json.py."""
    env = subprocess_env()
    old = [sys.executable, "-m", "tunesmith.cli.torchrun", "--help"]
    _assert_live(marker, lambda: subprocess.run(old, cwd=cwd, env=env, capture_output=True))


@pytest.mark.parametrize("case", [CASES["cwd-module-safe-path"]])
def test_launch_command_keeps_the_working_directory_off_sys_path(case, tmp_path, marker, outcome):
    from tunesmith.cli.main import _torchrun_args, build_parser, python_module

    cwd = _planted_json(tmp_path / "cwd", marker)
    _show_cwd_is_imported(cwd, marker)
    done = subprocess.run(
        [*python_module("json.tool"), "--help"],
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "json.tool" in done.stdout, done.stderr
    assert not marker.exists()
    args = build_parser().parse_args(["run", "sft", "--config", "tiny", "--nproc-per-node", "2"])
    torchrun = [*python_module("tunesmith.cli.torchrun"), *_torchrun_args(args), "--no-python"]
    assert torchrun[1] in ("-P", "-c") and python_module("tunesmith.cli.launch")[1] == torchrun[1]
    outcome.update(outcome="not imported", command=" ".join(python_module("m")[1:]))


@pytest.mark.parametrize("case", [CASES["cwd-module-under-torchrun"]])
def test_ranks_do_not_import_the_working_directory(case, fault_world, tmp_path, marker, outcome):
    from tunesmith.cli.main import python_module

    cwd = _planted_json(tmp_path / "cwd", marker)
    _show_cwd_is_imported(cwd, marker)
    out = tmp_path / "out"
    script = Path(sys.executable).with_name("tunesmith")  # what a user runs: the console script
    tunesmith = [str(script)] if script.exists() else python_module("tunesmith.cli.main")
    command = [*tunesmith, "run", "sft", "--config", "tiny", "--nproc-per-node", "2",
               f"model_dir={fault_world.model_dir}", f"dataset.source={fault_world.chat}",
               f"output_dir={out}", "max_steps=2", "progress_bar=false"]  # fmt: skip
    done = subprocess.run(
        command, cwd=cwd, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not marker.exists(), "a rank imported the working directory's json.py"
    assert [p.name for p in checkpoints(out)] == ["step_000002"]
    outcome.update(outcome="not imported", exit_code=0, ranks=2)


# ----------------------------------------------------------------------------- pickles


def _payload(marker: Path) -> Evil:
    return Evil(f"touch {marker}")


def _assert_live(marker: Path, load) -> None:
    """``load()`` (the unsafe way) runs the payload: the test's payload is real. (What the
    payload returns is not what the loader expected, so the loader may fail afterwards.)"""
    with contextlib.suppress(Exception):
        load()
    assert marker.exists(), "the payload did not run under the unsafe loader"
    marker.unlink()


def _resume_copy(world, tmp_path: Path) -> Path:
    out = Path(shutil.copytree(world.finished, tmp_path / "out"))
    return out / "checkpoints" / "step_000001"


@pytest.mark.parametrize("case", [CASES["pickled-weights"]])
def test_pickled_weights_are_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    model = Path(shutil.copytree(fault_world.model_dir, tmp_path / "model"))
    (model / "model.safetensors").unlink()
    weights = model / "pytorch_model.bin"
    torch.save({"model.norm.weight": _payload(marker)}, weights)
    _assert_live(marker, lambda: torch.load(weights, weights_only=False))
    code, err = _run(capsys, fault_world, tmp_path / "out", f"model_dir={model}")
    line = _refused(code, err, str(model), "pytorch_model.bin: only safetensors weights are loaded")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["pickled-training-state"]])
def test_pickled_training_state_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    step = _resume_copy(fault_world, tmp_path)
    state = step / "training_state" / "rank0.pt"
    torch.save({"progress": _payload(marker)}, state)
    _assert_live(marker, lambda: torch.load(state, weights_only=False))
    reseal(step)  # a crafted checkpoint comes with a manifest that matches it
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{state}: refused to load the training state", "posix.system")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["pickled-optimizer-metadata"]])
def test_pickled_optimizer_metadata_is_refused(
    case, fault_world, tmp_path, marker, capsys, outcome
):
    step = _resume_copy(fault_world, tmp_path)
    optimizer = step / "training_state" / "optimizer"
    (optimizer / ".metadata").write_bytes(pickle.dumps(_payload(marker)))
    _assert_live(marker, lambda: FileSystemReader(optimizer).read_metadata())
    reseal(step)  # a crafted checkpoint comes with a manifest that matches it
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{optimizer / '.metadata'}: refused to unpickle posix.system")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["pickled-training-state-protocol-4"]])
def test_protocol_4_training_state_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    step = _resume_copy(fault_world, tmp_path)
    state = step / "training_state" / "rank0.pt"
    torch.save({"progress": _payload(marker)}, state, pickle_protocol=4)
    _assert_live(marker, lambda: torch.load(state, weights_only=False))
    reseal(step)
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{state}: refused to load the training state", "protocol-4")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


class _Call:
    """Pickles as ``subprocess.call(["touch", marker])``: no module torch blocks by name."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (subprocess.call, (["touch", str(self.marker)],))


@pytest.mark.parametrize("case", [CASES["pickled-training-state-safe-globals"]])
def test_safe_globals_do_not_reach_checkpoints(
    case, fault_world, tmp_path, marker, capsys, outcome
):
    step = _resume_copy(fault_world, tmp_path)
    state = step / "training_state" / "rank0.pt"
    torch.save({"progress": _Call(marker)}, state, pickle_protocol=3)  # 2 renames the module
    reseal(step)
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([subprocess.call])  # as a careless plugin might
    try:
        _assert_live(marker, lambda: torch.load(state, weights_only=True))
        code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
        assert subprocess.call in torch.serialization.get_safe_globals()  # restored after
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
    line = _refused(code, err, f"{state}: refused to load the training state", "subprocess.call")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


def _stack_global(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle of ``module``-then-``name`` (STACK_GLOBAL) called with ``arg``."""

    def text(value: str) -> bytes:
        data = value.encode()
        return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE

    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."


@pytest.mark.parametrize("case", [CASES["pickled-optimizer-metadata-dotted-name"]])
def test_dotted_name_in_metadata_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    step = _resume_copy(fault_world, tmp_path)
    metadata = step / "training_state" / "optimizer" / ".metadata"
    module = "torch.distributed.checkpoint.metadata"
    payload = _stack_global(module, "os.system", f"touch {marker}")
    _assert_live(marker, lambda: pickle.loads(payload))  # the module's own `os` reaches a shell
    metadata.write_bytes(payload)
    reseal(step)
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{metadata}: refused to unpickle {module}.os.system")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["optimizer-metadata-path-outside"]])
def test_metadata_pointing_outside_is_refused(case, fault_world, tmp_path, capsys, outcome):
    from tunesmith.training.checkpoint.safe_dcp import SafeFileSystemReader

    step = _resume_copy(fault_world, tmp_path)
    optimizer = step / "training_state" / "optimizer"
    metadata = SafeFileSystemReader(optimizer).read_metadata()
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../rank0.pt"
    (optimizer / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(step)
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{optimizer / '.metadata'}: a storage entry names '../../rank0.pt'")
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


def _optimizer_state(world) -> tuple[dict, object]:
    """The recipe's optimizer state dict for the tiny model, loaded from the finished run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tunesmith.models import from_hf
    from tunesmith.training.checkpoint import safe_dcp

    model = from_hf(world.model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0
    )  # adds initial_lr, as the recipe's
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    step = world.finished / "checkpoints" / "step_000001"
    safe_dcp.load(state, step / "training_state" / "optimizer")
    return state, model


@pytest.mark.parametrize("case", [CASES["pickled-optimizer-entry"]])
def test_pickled_optimizer_entry_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    from tunesmith.training.parallel.distributed import close_distributed, init_distributed

    step = _resume_copy(fault_world, tmp_path)
    optimizer = step / "training_state" / "optimizer"
    init_distributed("cpu")  # get_optimizer_state_dict wants a process group, as in the recipe
    try:
        state, _ = _optimizer_state(fault_world)
        state["optimizer"]["param_groups"][0]["lr"] = _payload(marker)
        shutil.rmtree(optimizer)
        dcp.save(state, checkpoint_id=optimizer)  # pickles the payload, runs nothing
        assert not marker.exists()
        clean, _ = _optimizer_state(fault_world)
        _assert_live(marker, lambda: dcp.load(clean, checkpoint_id=optimizer))
    finally:
        close_distributed()
    reseal(step)  # a crafted checkpoint comes with a manifest that matches it
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(
        code, err, str(optimizer), "entry 'optimizer.param_groups.0.lr'", "posix.system"
    )
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


# ----------------------------------------------------------------------------- the source


UNSAFE_CALLS = {  # dotted call -> why
    "pickle.load": "unpickles arbitrary objects",
    "pickle.loads": "unpickles arbitrary objects",
    "dill.load": "unpickles arbitrary objects",
    "dill.loads": "unpickles arbitrary objects",
    "cloudpickle.load": "unpickles arbitrary objects",
    "cloudpickle.loads": "unpickles arbitrary objects",
    "joblib.load": "unpickles arbitrary objects",
    "torch.hub.load": "downloads and runs code",
    "dcp.load": "unpickles its metadata: use tunesmith.training.checkpoint.safe_dcp.load",
    "torch.distributed.checkpoint.load": "unpickles its metadata: use safe_dcp.load",
    "torch.distributed.checkpoint.state_dict_loader.load": "unpickles its metadata",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def unsafe_loads(source: str, name: str) -> list[str]:
    """Every unsafe load in ``source``: ``torch.load`` outside safe_dcp.py (whose
    ``load_plain`` sets registered safe globals aside) or without ``weights_only=True``, calls
    in :data:`UNSAFE_CALLS` (dcp.load allowed only in safe_dcp.py), ``trust_remote_code=True``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):  # `from pickle import loads` would hide the call
            for alias in node.names:
                if f"{node.module}.{alias.name}" in UNSAFE_CALLS:
                    found.append(f"{name}:{node.lineno}: imports {node.module}.{alias.name}")
        if not isinstance(node, ast.Call):
            continue
        call = _dotted(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        if call == "torch.load" and not name.endswith("safe_dcp.py"):
            found.append(f"{name}:{node.lineno}: torch.load: use safe_dcp.load_plain")
        elif call == "torch.load":
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{name}:{node.lineno}: torch.load without weights_only=True")
        elif call in UNSAFE_CALLS and not (
            call.endswith("dcp.load") and name.endswith("safe_dcp.py")
        ):
            found.append(f"{name}:{node.lineno}: {call} {UNSAFE_CALLS[call]}")
        trust = keywords.get("trust_remote_code")
        if isinstance(trust, ast.Constant) and trust.value is True:
            found.append(f"{name}:{node.lineno}: trust_remote_code=True")
    return found


@pytest.mark.parametrize("case", [CASES["no-unsafe-loading-in-source"]])
def test_package_source_has_no_unsafe_loading(case, outcome):
    # the scanner itself catches each kind of unsafe load
    bad = (
        "torch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\n"
        "dcp.load(s, checkpoint_id=p)\nAutoModel.from_pretrained(p, trust_remote_code=True)\n"
        "from pickle import loads\n"
    )
    assert len(unsafe_loads(bad, "x.py")) == 6
    assert len(unsafe_loads("torch.load(f, weights_only=True)\n", "x.py")) == 1
    assert unsafe_loads("torch.load(f, weights_only=True)\n", "safe_dcp.py") == []
    assert len(unsafe_loads("torch.load(f)\n", "safe_dcp.py")) == 1
    files = sorted((REPO_ROOT / "tunesmith").rglob("*.py"))
    found = [
        hit for f in files for hit in unsafe_loads(f.read_text(), str(f.relative_to(REPO_ROOT)))
    ]
    assert found == []
    loads = sum(f.read_text().count("torch.load(") for f in files)
    outcome.update(files_scanned=len(files), torch_load_calls=loads, unsafe=0)
