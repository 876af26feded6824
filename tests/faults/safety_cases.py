"""The safety cases: code from a config or a file must not run unless the user says so.

:data:`ROUTES` are config routes to code execution, each one catalogue case (kind
``component-route``) that ``test_safety.py`` runs through ``tunesmith run sft`` and then
through ``tunesmith validate``: a ``_component_`` path (placed as ``loss``, a list item, a
nested component or an interpolation), the arguments that would make the call create the
case's marker file (or do its harm), and the words of the refusal. The payload builders write
their files (a pickle, a hub repo, a package that runs code when imported...) inside the case's
own folder and import nothing heavy, so the report script lists the catalogue cheaply.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.faults.kit import Case

__all__ = [
    "ENV_COMPONENT",
    "ENV_UNSET",
    "ROUTES",
    "SAFETY",
    "UNRESOLVED",
    "UNRESOLVED_KIND",
    "Route",
    "Unresolved",
    "evil_package",
]

ENV_COMPONENT = "TUNESMITH_TEST_COMPONENT"  # what the interpolation route reads
ENV_UNSET = "TUNESMITH_TEST_UNSET"  # never set: `${oc.env:...}` of it cannot be resolved
UNRESOLVED_KIND = "config-route"  # the kind of the unresolvable-interpolation cases
_OS = "is the module 'os', outside the allowed packages"
_DENIED = "loads pickles, TorchScript or downloaded code, or runs code or commands"
_PRIVATE = "(names starting with '_' are never resolved)"
_UNMARKED = "which is not marked as a component"
_UNBOUND = "is an unbound method of the class"
_NOT_TRUE = "is not true: only true (or leaving it out) is accepted"
_NOT_FALSE = "is not false: only false (or leaving it out) is accepted"

Payload = Callable[[Path, Path], dict[str, Any]]  # (case folder, marker) -> call arguments


@dataclass(frozen=True)
class Route:
    """A route to code execution from a config.

    ``component`` is the dotted path, ``payload`` the arguments the call would get, ``placement``
    where the node goes (``loss``, ``list``: ``metric_loggers.0``, ``nested``: ``loss.inner``,
    ``env``: ``loss`` whose path is ``${oc.env:...}``), ``says`` the words of the refusal and
    ``where`` the config path it names (default: the node's ``_component_``); ``create``,
    ``create-nested``, ``create-list``: the node made by ``${oc.create:{...}}`` as ``loss``,
    ``loss.inner`` or ``metric_loggers.0``. ``live``: the test shows that building it (with
    ``--allow-any-component``) runs the payload. ``never_imported``: a module the refusal must
    not have imported.
    """

    id: str
    what: str
    component: str
    says: str
    payload: Payload
    placement: str = "loss"
    where: str | None = None
    live: bool = True
    never_imported: str | None = None

    @property
    def node(self) -> str:
        return {
            "list": "metric_loggers.0",
            "nested": "loss.inner",
            "create-list": "metric_loggers.0",
            "create-nested": "loss.inner",
        }.get(self.placement, "loss")


# ----------------------------------------------------------------------------- payloads


def _shell(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"command": f"touch {marker}"}


def _argv(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"args": ["touch", str(marker)]}


def evil_package(tmp: Path, marker: Path, name: str) -> Path:
    """A package ``name`` under ``tmp/pkgs`` (which the test puts on ``sys.path``) whose import
    creates ``marker``; returns the package folder."""
    package = tmp / "pkgs" / name
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\ndef boom(**kwargs):\n    pass\n"
    )
    return package


def _import_evil(name: str) -> Payload:
    def payload(tmp: Path, marker: Path) -> dict[str, Any]:
        evil_package(tmp, marker, name)
        return {"name": name}

    return payload


def _evil_direct(tmp: Path, marker: Path) -> dict[str, Any]:
    evil_package(tmp, marker, "tsevil_direct")
    return {}


def _evil_pickle(tmp: Path, marker: Path) -> Path:
    from tests.faults.components import Evil

    path = tmp / "evil.pt"
    path.write_bytes(pickle.dumps(Evil(f"touch {marker}")))
    return path


def _torch_file(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"f": str(_evil_pickle(tmp, marker)), "weights_only": False}


def _hub_repo(tmp: Path, marker: Path) -> dict[str, Any]:
    repo = tmp / "hub"
    repo.mkdir(exist_ok=True)
    (repo / "hubconf.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\ndef entry():\n    return None\n"
    )
    return {"repo_or_dir": str(repo), "model": "entry", "source": "local"}


def _dcp_folder(tmp: Path, marker: Path) -> dict[str, Any]:
    folder = tmp / "dcp"
    folder.mkdir(exist_ok=True)
    (folder / ".metadata").write_bytes(_evil_pickle(tmp, marker).read_bytes())
    return {"state_dict": {}, "checkpoint_id": str(folder)}


def _pickled_bytes(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"data": "pickled bytes (a config cannot hold bytes; the hop is refused first)"}


def _flight_dump(tmp: Path, marker: Path) -> dict[str, Any]:
    dump = tmp / "dumps" / "0"
    dump.parent.mkdir(exist_ok=True)
    dump.write_bytes(_evil_pickle(tmp, marker).read_bytes())
    return {"prefix": "", "filename": str(dump)}


def _source_folder(tmp: Path, marker: Path) -> dict[str, Any]:
    folder = tmp / "source"
    folder.mkdir(exist_ok=True)
    (folder / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return {"path": str(folder)}


def _torchscript(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"lang": "def f(x: int) -> int:\n    return x + 1\n"}


def _remote_code(tmp: Path, marker: Path) -> dict[str, Any]:
    folder = tmp / "remote"
    folder.mkdir(exist_ok=True)
    (folder / "evil_model.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\nclass Thing:\n    pass\n"
    )
    return {"class_reference": "evil_model.Thing", "pretrained_model_name_or_path": str(folder)}


def _command_string(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"command_string": f"touch {marker}"}


def _nested_run(tmp: Path, marker: Path) -> dict[str, Any]:
    inner = f"loss={{_component_: os.system, command: 'touch {marker}'}}"
    return {"argv": ["--allow-any-component", "run", "sft", "--config", "tiny", inner]}


def _shared_library(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"path": str(tmp / "evil.so")}


def _get_exec(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"key": "exec"}


def _bytes(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"b": "not bytes"}


def _folder(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"folder": str(tmp)}


def _sandboxed_code(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"code": f"open({str(marker)!r}, 'w').write('ran')", "timeout_s": 5,
            "memory_mb": 256, "isolation": "best_effort"}  # fmt: skip


def _harness(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"solution": f"open({str(marker)!r}, 'w')", "tests": [], "token": "t",
            "partial": False}  # fmt: skip


def _hf_weights(tmp: Path, marker: Path) -> dict[str, Any]:
    return {"model": {"_component_": "torch.nn.Linear", "in_features": 1, "out_features": 1},
            "path": str(marker)}  # fmt: skip


def _score_through_self(tmp: Path, marker: Path) -> dict[str, Any]:
    sample = {"prompt": "p", "completion": f"```python\nopen({str(marker)!r}, 'w')\n```",
              "metadata": {"tests": ["assert True"]}}  # fmt: skip
    return {"self": {"_component_": "tunesmith.rl.rewards.CodeTests"}, "sample": sample}


def _hook_through_self(tmp: Path, marker: Path) -> dict[str, Any]:
    linear = {"_component_": "torch.nn.Linear", "in_features": 1, "out_features": 1}
    return {"self": linear, "hook": {"_component_": "torch.nn.Identity"}}


def _apply_through_self(tmp: Path, marker: Path) -> dict[str, Any]:
    linear = {"_component_": "torch.nn.Linear", "in_features": 1, "out_features": 1}
    return {"self": linear, "fn": {"_component_": "torch.nn.Identity"}}


def _to_json_through_self(tmp: Path, marker: Path) -> dict[str, Any]:
    rows = {"_component_": "datasets.Dataset.from_dict", "mapping": {"a": [1]}}
    return {"self": rows, "path_or_buf": str(marker)}  # writes (overwrites) any file


def _weights_only(value: object) -> Payload:
    def payload(tmp: Path, marker: Path) -> dict[str, Any]:
        return {"f": str(_evil_pickle(tmp, marker)), "weights_only": value}

    return payload


def _trust_remote_code(value: object) -> Payload:
    def payload(tmp: Path, marker: Path) -> dict[str, Any]:
        folder = tmp / "remote"
        folder.mkdir(exist_ok=True)
        return {"pretrained_model_name_or_path": str(folder), "trust_remote_code": value}

    return payload


# ----------------------------------------------------------------------------- routes


ROUTES = [
    Route("component-route-torch-os", "`torch.os.system`: a shell through torch's import of os",
          "torch.os.system", f"'torch.os' {_OS}", _shell),
    Route("component-route-transformers-os", "`transformers.utils.hub.os.system`",
          "transformers.utils.hub.os.system", f"'transformers.utils.hub.os' {_OS}", _shell),
    Route("component-route-datasets-importlib", "`datasets.load.importlib.import_module` of a "
          "package whose import runs code", "datasets.load.importlib.import_module",
          "'datasets.load.importlib' is the module 'importlib'", _import_evil("tsevil_importlib"),
          never_imported="tsevil_importlib"),
    Route("component-route-peft-os", "`peft.utils.other.os.system`",
          "peft.utils.other.os.system", f"'peft.utils.other.os' {_OS}", _shell),
    Route("component-route-torchao-os", "`torchao.os.system`", "torchao.os.system",
          f"'torchao.os' {_OS}", _shell),
    Route("component-route-bitsandbytes-subprocess", "`bitsandbytes.cuda_specs.subprocess.run`",
          "bitsandbytes.cuda_specs.subprocess.run",
          "'bitsandbytes.cuda_specs.subprocess' is the module 'subprocess'", _argv),
    Route("component-route-tunesmith-os", "`tunesmith.data.sources.os.system`: tunesmith's own "
          "import of os", "tunesmith.data.sources.os.system",
          f"'tunesmith.data.sources.os' {_OS}", _shell),
    Route("component-route-tunesmith-cli", "`tunesmith.cli.main.main` with argv "
          "`--allow-any-component run ...`: a nested run that lifts the allow-list",
          "tunesmith.cli.main.main", f"'tunesmith.cli' {_DENIED}", _nested_run, live=False),
    Route("component-route-torch-load", "`torch.load` of a pickle that runs a command, "
          "`weights_only: false`", "torch.load",
          "'torch.load' is the function 'torch.serialization.load', denied", _torch_file),
    Route("component-route-torch-load-reexport", "`torch.optim.optimizer.torch.load`: the loader "
          "through another module", "torch.optim.optimizer.torch.load",
          "is the function 'torch.serialization.load', denied", _torch_file),
    Route("component-route-weights-only-false", "an allowed loader "
          "(`peft.utils.save_and_load.torch_load`) told `weights_only: false`",
          "peft.utils.save_and_load.torch_load", "weights_only=false would unpickle arbitrary "
          "objects", _torch_file, where="loss.weights_only"),
    Route("component-route-torch-hub", "`torch.hub.load` of a local repo whose hubconf.py runs "
          "code", "torch.hub.load", f"'torch.hub' {_DENIED}", _hub_repo),
    Route("component-route-dcp-load-reexport",
          "`tunesmith.training.checkpoint.safe_dcp.dcp.load` (plain `dcp.load`) of a folder "
          "whose .metadata pickle runs a command",
          "tunesmith.training.checkpoint.safe_dcp.dcp.load",
          "'tunesmith.training.checkpoint.safe_dcp.dcp' is the module "
          "'torch.distributed.checkpoint', denied", _dcp_folder),
    Route("component-route-pickle-reexport", "`torch.distributed.distributed_c10d.pickle.loads`",
          "torch.distributed.distributed_c10d.pickle.loads",
          "'torch.distributed.distributed_c10d.pickle' is the module 'pickle'", _pickled_bytes,
          live=False),
    Route("component-route-pickle-loader", "`torch.distributed.flight_recorder.components.loader."
          "read_dump`: `pickle.load` of a file", "torch.distributed.flight_recorder.components."
          "loader.read_dump", f"'torch.distributed.flight_recorder' {_DENIED}", _flight_dump),
    Route("component-route-exec-source", "`transformers.utils.import_utils."
          "direct_transformers_import`: runs a folder's __init__.py",
          "transformers.utils.import_utils.direct_transformers_import",
          f"'transformers.utils.import_utils' {_DENIED}", _source_folder),
    Route("component-route-torchscript-source", "`torch.CompilationUnit` (torch.jit's, "
          "re-exported): compiles source text", "torch.CompilationUnit",
          "is the class 'torch.jit.CompilationUnit', denied", _torchscript, live=False),
    Route("component-route-remote-code", "`transformers.dynamic_module_utils."
          "get_class_from_dynamic_module`: imports a model folder's .py", "transformers."
          "dynamic_module_utils.get_class_from_dynamic_module",
          f"'transformers.dynamic_module_utils' {_DENIED}", _remote_code, live=False),
    Route("component-route-shell-helper", "`torch.utils.collect_env.run`: a shell command",
          "torch.utils.collect_env.run", f"'torch.utils.collect_env' {_DENIED}", _shell),
    Route("component-route-command-helper", "`bitsandbytes.utils.execute_and_return`: a "
          "command string", "bitsandbytes.utils.execute_and_return", f"denied: it {_DENIED}",
          _command_string),
    Route("component-route-load-library", "`torch.ops.load_library`: dlopen of a shared "
          "library", "torch.ops.load_library",
          "is the function 'torch._ops._Ops.load_library', denied", _shared_library, live=False),
    Route("component-route-dunder", "`torch.nn.modules.module.__builtins__.get` (key exec): a "
          "dunder hop to builtins", "torch.nn.modules.module.__builtins__.get",
          f"names the special attribute '__builtins__' {_PRIVATE}", _get_exec, live=False),
    Route("component-route-private", "`torch.storage._load_from_bytes`: a private loader",
          "torch.storage._load_from_bytes",
          f"names the private attribute '_load_from_bytes' {_PRIVATE}", _bytes, live=False),
    Route("component-route-outside-package", "`tsevil_direct.boom`: a package outside the "
          "allow-list whose import runs code", "tsevil_direct.boom",
          "'tsevil_direct.boom' is outside the allowed packages", _evil_direct,
          never_imported="tsevil_direct"),
    Route("component-route-list-item", "`metric_loggers.0` is `transformers.utils.hub.os.system`",
          "transformers.utils.hub.os.system", f"'transformers.utils.hub.os' {_OS}", _shell,
          placement="list"),
    Route("component-route-nested", "`loss.inner`, a component nested in the loss, is "
          "`torch.os.system`", "torch.os.system", f"'torch.os' {_OS}", _shell,
          placement="nested"),
    Route("component-route-interpolation", f"`loss._component_: ${{oc.env:{ENV_COMPONENT}}}`, "
          "the variable holding `peft.utils.other.os.system`", "peft.utils.other.os.system",
          f"'peft.utils.other.os' {_OS}", _shell, placement="env"),
    # tunesmith's own callables that carry no @component mark
    Route("component-run-sandboxed", "`tunesmith.rl.rewards.run_sandboxed` with `code:`: the "
          "CodeTests sandbox runner runs any Python a config gives it",
          "tunesmith.rl.rewards.run_sandboxed", f"'tunesmith.rl.rewards.sandbox.run_sandboxed', "
          f"{_UNMARKED}", _sandboxed_code, live=False),
    Route("component-run-sandboxed-module", "`tunesmith.rl.rewards.sandbox.run_sandboxed`: the "
          "runner by its own module", "tunesmith.rl.rewards.sandbox.run_sandboxed", _UNMARKED,
          _sandboxed_code, live=False),
    Route("component-code-harness", "`tunesmith.rl.rewards.code.harness`: builds the program "
          "CodeTests runs", "tunesmith.rl.rewards.code.harness",
          f"'tunesmith.rl.rewards.code.harness', {_UNMARKED}", _harness, live=False),
    Route("component-save-hf-checkpoint", "`tunesmith.models.hf.save_hf_checkpoint`: writes a "
          "checkpoint wherever `path:` says", "tunesmith.models.hf.save_hf_checkpoint",
          _UNMARKED, _hf_weights, live=False),
    Route("component-tokenizer-internals", "`tunesmith.data.tokenizer.Tokenizer`: the class "
          "itself (only its `from_pretrained` is a component)", "tunesmith.data.tokenizer."
          "Tokenizer", f"'tunesmith.data.tokenizer.Tokenizer', {_UNMARKED}", _folder,
          live=False),
    # methods reached through their class, called on an object a `self:` argument builds
    Route("component-method-through-self", "`tunesmith.rl.rewards.CodeTests.score` with `self: "
          "{_component_: ...CodeTests}`: any method of an allowed class",
          "tunesmith.rl.rewards.CodeTests.score",
          f"{_UNBOUND} 'tunesmith.rl.rewards.code.CodeTests'", _score_through_self, live=False),
    Route("component-torch-method-through-self", "`torch.nn.Module.register_forward_hook` with "
          "`self:` a Linear", "torch.nn.Module.register_forward_hook",
          f"{_UNBOUND} 'torch.nn.modules.module.Module'", _hook_through_self, live=False),
    Route("component-torch-apply-through-self", "`torch.nn.Module.apply` with `self:` a Linear "
          "and `fn:`", "torch.nn.Module.apply", f"{_UNBOUND} 'torch.nn.modules.module.Module'",
          _apply_through_self, live=False),
    Route("component-datasets-method-through-self", "`datasets.Dataset.to_json` with `self:` a "
          "`Dataset.from_dict`: writes any file", "datasets.Dataset.to_json",
          f"{_UNBOUND} 'datasets.arrow_dataset.Dataset'", _to_json_through_self),
    # safety keywords that are not exactly their safe value
    *(
        Route(f"weights-only-{name}", f"`weights_only: {shown}` to an allowed loader "
              "(`peft.utils.save_and_load.torch_load`)", "peft.utils.save_and_load.torch_load",
              f"weights_only={said} {_NOT_TRUE}", _weights_only(value),
              where="loss.weights_only", live=live)
        for name, shown, said, value, live in (
            ("zero", "0", "0", 0, True),
            ("zero-float", "0.0", "0.0", 0.0, True),
            ("empty-list", "[]", "[]", [], True),
            ("empty-string", '""', "''", "", True),
            ("string-false", '"false"', "'false'", "false", False),
            ("null", "null", "null", None, False),
        )
    ),
    Route("weights-only-zero-nested", "`loss.inner.weights_only: 0`: a falsy value one level "
          "down", "peft.utils.save_and_load.torch_load", f"weights_only=0 {_NOT_TRUE}",
          _weights_only(0), placement="nested", where="loss.inner.weights_only"),
    *(
        Route(f"trust-remote-code-{name}", f"`trust_remote_code: {shown}` to "
              "`transformers.AutoConfig.from_pretrained`", "transformers.AutoConfig."
              "from_pretrained", f"trust_remote_code={said} {_NOT_FALSE}",
              _trust_remote_code(value), where="loss.trust_remote_code", live=False)
        for name, shown, said, value in (("one", "1", "1", 1), ("null", "null", "null", None),
                                         ("string", '"yes"', "'yes'", "yes"))
    ),
    # nodes made by ${oc.create:{...}}: validate walks them where they are used
    Route("oc-create-top-level", "`loss: ${oc.create:{_component_: os.system, command: ...}}`",
          "os.system", "'os.system' is outside the allowed packages", _shell,
          placement="create"),
    Route("oc-create-nested", "`loss.inner: ${oc.create:{_component_: os.system, ...}}`: an "
          "argument of an allowed loss", "os.system", "'os.system' is outside the allowed "
          "packages", _shell, placement="create-nested"),
    Route("oc-create-list-item", "`metric_loggers: ['${oc.create:{_component_: os.system, "
          "...}}']`", "os.system", "'os.system' is outside the allowed packages", _shell,
          placement="create-list"),
    Route("oc-create-torch-os", "`loss: ${oc.create:{_component_: torch.os.system, ...}}`",
          "torch.os.system", f"'torch.os' {_OS}", _shell, placement="create"),
    Route("oc-create-weights-only", "`loss: ${oc.create:{..., weights_only: 0}}`: a falsy "
          "safety keyword inside a made node", "peft.utils.save_and_load.torch_load",
          f"weights_only=0 {_NOT_TRUE}", _weights_only(0), placement="create",
          where="loss.weights_only"),
    Route("oc-create-unmarked", "`loss: ${oc.create:{_component_: tunesmith.rl.rewards."
          "run_sandboxed, code: ...}}`", "tunesmith.rl.rewards.run_sandboxed", _UNMARKED,
          _sandboxed_code, placement="create", live=False),
]  # fmt: skip

# ----------------------------------------------------------------------------- unresolvable


@dataclass(frozen=True)
class Unresolved:
    """A safety-relevant key (``_component_``, ``weights_only``, ``trust_remote_code``, or a
    node that would hold one) whose value is an interpolation that cannot be resolved:
    ``override`` puts it into the tiny sft config, ``where`` is the key the first line of
    ``validate`` and ``run`` must name (the node itself for one ``${oc.create:...}`` makes)."""

    id: str
    what: str
    override: str
    where: str


_UNSET = f"${{oc.env:{ENV_UNSET}}}"
_LOSS = "tunesmith.modules.losses.CrossEntropyLoss"
_LOADER = "peft.utils.save_and_load.torch_load"


def _loss(**node: Any) -> str:
    return f"loss={json.dumps(node)}"


def _loggers(item: object) -> str:
    return f"metric_loggers=[{json.dumps(item)}]"


def _create(component: str, *arguments: str) -> str:
    """``${oc.create:{_component_: COMPONENT, ARGUMENT...}}``."""
    return "${oc.create:{" + ", ".join([f"_component_: {component}", *arguments]) + "}}"


UNRESOLVED = [
    Unresolved("unresolved-component", f"`loss._component_: {_UNSET}`",
               f"loss._component_={_UNSET}", "loss._component_"),
    Unresolved("unresolved-component-decoded", f"`loss._component_: ${{oc.decode:{_UNSET}}}`",
               f"loss._component_=${{oc.decode:{_UNSET}}}", "loss._component_"),
    Unresolved("unresolved-component-nested", "`loss.inner._component_` an unresolvable "
               "interpolation", _loss(_component_=_LOSS, inner={"_component_": _UNSET}),
               "loss.inner._component_"),
    Unresolved("unresolved-component-list-item", "`metric_loggers.0._component_` an "
               "unresolvable interpolation", _loggers({"_component_": _UNSET}),
               "metric_loggers.0._component_"),
    Unresolved("unresolved-list-item", f"`metric_loggers: ['{_UNSET}']`: a list item (the "
               "list check used to raise a bare resolver error)",
               _loggers(_UNSET), "metric_loggers.0"),
    Unresolved("unresolved-create-list-item", f"`metric_loggers: ['{_create(_UNSET)}']`",
               _loggers(_create(_UNSET)), "metric_loggers.0"),
    Unresolved("unresolved-create-list-weights-only", "a list item made by `${oc.create:...}` "
               f"whose `weights_only` is `{_UNSET}`",
               _loggers(_create(_LOADER, f"weights_only: {_UNSET}")), "metric_loggers.0"),
    Unresolved("unresolved-create", f"`loss: {_create(_UNSET)}`", f"loss={_create(_UNSET)}",
               "loss"),
    Unresolved("unresolved-weights-only", f"`weights_only: {_UNSET}` to an allowed loader "
               f"(`{_LOADER}`)", _loss(_component_=_LOADER, f="x.pt", weights_only=_UNSET),
               "loss.weights_only"),
    Unresolved("unresolved-weights-only-nested", f"`loss.inner.weights_only: {_UNSET}`",
               _loss(_component_=_LOSS, inner={"_component_": _LOADER, "weights_only": _UNSET}),
               "loss.inner.weights_only"),
    Unresolved("unresolved-trust-remote-code", f"`trust_remote_code: {_UNSET}` to "
               "`transformers.AutoConfig.from_pretrained`", _loss(
                   _component_="transformers.AutoConfig.from_pretrained",
                   pretrained_model_name_or_path="x", trust_remote_code=_UNSET),
               "loss.trust_remote_code"),
    Unresolved("unresolved-trust-remote-code-tokenizer", f"`tokenizer.trust_remote_code: "
               f"{_UNSET}`", f"tokenizer.trust_remote_code={_UNSET}",
               "tokenizer.trust_remote_code"),
]  # fmt: skip

_UNRESOLVED_CASES = [
    Case(
        u.id,
        "bad_input",
        UNRESOLVED_KIND,
        u.what,
        "`validate` and `run sft` both exit 1 with the same first line 'tunesmith: error: "
        f"{u.where}: interpolation ... cannot be resolved: ...' (the key named, not a bare "
        "resolver error); nothing built, nothing written",
    )
    for u in UNRESOLVED
]

_ROUTE_CASES = [
    Case(
        r.id,
        "safety",
        "component-route",
        r.what,
        f"refused before any call (exit 1, names {r.where or r.node + '._component_'} and "
        "--allow-any-component)"
        + ("; the call is shown to run the payload when allowed" if r.live else "")
        + (f"; `{r.never_imported}` never imported" if r.never_imported else ""),
    )
    for r in ROUTES
]

SAFETY = [
    Case(
        "component-os-system",
        "safety",
        "component",
        "config: `loss._component_: os.system` with a command that creates a file",
        "refused before anything runs (exit 1, names loss._component_ and "
        "--allow-any-component); the file is never created",
    ),
    Case(
        "component-subprocess-run",
        "safety",
        "component",
        "config: a metric logger `_component_: subprocess.run` with a command",
        "refused (exit 1, names metric_loggers.0._component_); nothing is executed",
    ),
    Case(
        "component-test-loss-refused",
        "safety",
        "component",
        "config: a harmless test loss outside the allow-list, without the flag",
        "refused (exit 1), the component is never built",
    ),
    *_ROUTE_CASES,
    Case(
        "validate-refuses-every-route",
        "safety",
        "validate",
        f"`tunesmith validate` on the config of each of the {len(ROUTES)} routes above",
        "exit 1 with the very line `tunesmith run` printed for that route; nothing runs",
    ),
    Case(
        "cwd-module-safe-path",
        "safety",
        "launch",
        "a `json.py` that creates a file, in the working directory, and the command line "
        "`tunesmith run --nproc-per-node` starts torchrun and its ranks with "
        "(`python -m` puts the working directory first on sys.path: checked)",
        "the working directory is not on the ranks' sys.path (`-P`, PYTHONSAFEPATH=1): the "
        "stdlib module runs, the file is never created",
    ),
    Case(
        "cwd-module-under-torchrun",
        "safety",
        "launch",
        "`tunesmith run sft --nproc-per-node 2` in a working directory holding a `json.py` "
        "that creates a file (torchrun itself, started the old way, imports it: checked)",
        "2 ranks train and checkpoint (exit 0); the file is never created",
        ci=False,
    ),
    Case(
        "component-test-loss-allowed",
        "safety",
        "opt-in",
        "the same config with `tunesmith --allow-any-component run ...`",
        "the component is built and trains (exit 0, checkpoint written)",
    ),
    Case(
        "pickled-weights",
        "safety",
        "pickle",
        "model folder with only `pytorch_model.bin`, a pickle whose load runs a command",
        "refused: 'only safetensors weights are loaded' (exit 1); the command never runs",
    ),
    Case(
        "pickled-training-state",
        "safety",
        "pickle",
        "resume from a checkpoint whose `training_state/rank0.pt` pickles `os.system`",
        "refused by torch.load(weights_only=True), the error names the file and "
        "'posix.system' (exit 1); the command never runs",
    ),
    Case(
        "pickled-training-state-protocol-4",
        "safety",
        "pickle",
        "`training_state/rank0.pt` saved with pickle protocol 4 (STACK_GLOBAL `posix.system`)",
        "refused, the error names the file and the protocol-4 opcode (exit 1); the command "
        "never runs",
    ),
    Case(
        "pickled-training-state-safe-globals",
        "safety",
        "pickle",
        "`rank0.pt` pickles `subprocess.call`, which the process allowed with "
        "`torch.serialization.add_safe_globals` (plain `torch.load(weights_only=True)` runs "
        "it: checked)",
        "refused: registered safe globals are set aside while a checkpoint is read (exit 1, "
        "names the file and subprocess.call); the command never runs",
    ),
    Case(
        "pickled-optimizer-metadata",
        "safety",
        "pickle",
        "resume from a checkpoint whose optimizer `.metadata` pickles `os.system` (plain "
        "`dcp.load` runs it: checked)",
        "refused by the allow-list unpickler, the error names the file (exit 1); the command "
        "never runs",
    ),
    Case(
        "pickled-optimizer-metadata-dotted-name",
        "safety",
        "pickle",
        "optimizer `.metadata`, protocol 4: STACK_GLOBAL "
        "`torch.distributed.checkpoint.metadata` / `os.system` (a dotted name through the "
        "metadata module's imports; plain `pickle` runs it: checked)",
        "refused: only listed (module, name) pairs are built, nothing is walked (exit 1, "
        "names the file); the command never runs",
    ),
    Case(
        "optimizer-metadata-path-outside",
        "safety",
        "pickle",
        "optimizer `.metadata` whose storage entry points at `../../rank0.pt` (outside the "
        "checkpoint folder)",
        "refused: the error names the metadata file and the path (exit 1)",
    ),
    Case(
        "pickled-optimizer-entry",
        "safety",
        "pickle",
        "resume from a checkpoint whose optimizer entry `param_groups.0.lr` pickles "
        "`os.system` (plain `dcp.load` runs it: checked)",
        "refused (weights_only), the error names the entry (exit 1); the command never runs",
    ),
    Case(
        "no-unsafe-loading-in-source",
        "safety",
        "static",
        "the package source: every torch.load, pickle, dcp.load, trust_remote_code",
        "torch.load and dcp.load only in tunesmith.training.checkpoint.safe_dcp "
        "(weights_only=True, registered safe globals set aside), no pickle/dill loads, no "
        "trust_remote_code",
    ),
    *_UNRESOLVED_CASES,
]
