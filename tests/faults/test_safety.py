"""Nothing from a config or a file runs code unless the user says so, end to end through
``tunesmith run``: ``_component_`` paths outside the allow-list are refused (and built with
``--allow-any-component``), pickled weights are refused, and a checkpoint whose training state,
optimizer metadata or optimizer entries pickle ``os.system`` is refused when resumed. Each
payload is first shown to be live (plain ``pickle``/``torch.load``/``dcp.load`` run it); the
suite then checks that ours never does. A static scan keeps the package free of unsafe loads."""

from __future__ import annotations

import ast
import contextlib
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader

from tests.faults.catalogue import params
from tests.faults.components import Evil
from tests.recipes.sft_world import REPO_ROOT, checkpoints
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
    code, err = _run(capsys, fault_world, tmp_path / "out", "loss._component_=os.system",
                     f"loss.command='touch {marker}'")  # fmt: skip
    line = _refused(code, err, "loss._component_: component 'os.system' is not allowed",
                    "--allow-any-component")  # fmt: skip
    assert not marker.exists() and not (tmp_path / "out").exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["component-subprocess-run"]])
def test_subprocess_component_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):
    logger = f"metric_loggers=[{{_component_: subprocess.run, args: [touch, {marker}]}}]"
    code, err = _run(capsys, fault_world, tmp_path / "out", logger)
    line = _refused(code, err, "metric_loggers.0._component_: component 'subprocess.run' is not allowed")  # fmt: skip
    assert not marker.exists() and not (tmp_path / "out").exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


RECORDING = "tests.faults.components.RecordingCrossEntropy"


@pytest.mark.parametrize("case", [CASES["component-test-loss-refused"]])
def test_component_outside_allow_list_is_refused(case, fault_world, tmp_path, marker, capsys, monkeypatch, outcome):  # fmt: skip
    monkeypatch.delenv(ALLOW_ANY_ENV, raising=False)
    code, err = _run(capsys, fault_world, tmp_path / "out", f"loss._component_={RECORDING}",
                     f"loss.marker={marker}")  # fmt: skip
    line = _refused(code, err, f"loss._component_: component '{RECORDING}' is not allowed")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["component-test-loss-allowed"]])
def test_allow_any_component_builds_it(case, fault_world, tmp_path, marker, capsys, monkeypatch, outcome):  # fmt: skip
    monkeypatch.setenv(ALLOW_ANY_ENV, "0")  # restored after the test (the flag sets it to 1)
    code, err = _run(capsys, fault_world, tmp_path / "out", f"loss._component_={RECORDING}",
                     f"loss.marker={marker}", flags=("--allow-any-component",))  # fmt: skip
    assert code == 0, err
    assert marker.read_text() == "built"
    assert [p.name for p in checkpoints(tmp_path / "out")] == ["step_000002"]
    outcome.update(outcome="built and trained", exit_code=0)


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
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{state}: refused to load the training state", "posix.system")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


@pytest.mark.parametrize("case", [CASES["pickled-optimizer-metadata"]])
def test_pickled_optimizer_metadata_is_refused(case, fault_world, tmp_path, marker, capsys, outcome):  # fmt: skip
    step = _resume_copy(fault_world, tmp_path)
    optimizer = step / "training_state" / "optimizer"
    (optimizer / ".metadata").write_bytes(pickle.dumps(_payload(marker)))
    _assert_live(marker, lambda: FileSystemReader(optimizer).read_metadata())
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, f"{optimizer / '.metadata'}: refused to unpickle posix.system")
    assert not marker.exists()
    outcome.update(outcome="refused", error=line.replace(str(tmp_path), "<case>"))


def _optimizer_state(world) -> tuple[dict, object]:
    """The recipe's optimizer state dict for the tiny model, loaded from the finished run."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tunesmith.models import from_hf
    from tunesmith.training import safe_dcp

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
    from tunesmith.training.distributed import close_distributed, init_distributed

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
    code, err = _run(capsys, fault_world, tmp_path / "out", f"resume={step}")
    line = _refused(code, err, str(optimizer), "entry 'optimizer.param_groups.0.lr'", "posix.system")  # fmt: skip
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
    "dcp.load": "unpickles its metadata: use tunesmith.training.safe_dcp.load",
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
    """Every unsafe load in ``source``: ``torch.load`` without ``weights_only=True``, calls in
    :data:`UNSAFE_CALLS` (dcp.load allowed only in safe_dcp.py), ``trust_remote_code=True``."""
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
        if call == "torch.load":
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
    bad = ("torch.load(f)\ntorch.load(f, weights_only=False)\npickle.loads(b)\n"
           "dcp.load(s, checkpoint_id=p)\nAutoModel.from_pretrained(p, trust_remote_code=True)\n"
           "from pickle import loads\n")  # fmt: skip
    assert len(unsafe_loads(bad, "x.py")) == 6
    assert unsafe_loads("torch.load(f, weights_only=True)\n", "x.py") == []
    files = sorted((REPO_ROOT / "tunesmith").rglob("*.py"))
    found = [
        hit for f in files for hit in unsafe_loads(f.read_text(), str(f.relative_to(REPO_ROOT)))
    ]
    assert found == []
    loads = sum(f.read_text().count("torch.load(") for f in files)
    outcome.update(files_scanned=len(files), torch_load_calls=loads, unsafe=0)
