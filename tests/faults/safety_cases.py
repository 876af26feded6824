"""The safety cases: code from a config or a file must not run unless the user says so."""

from __future__ import annotations

from tests.faults.kit import Case

__all__ = ["SAFETY"]

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
    Case(
        "component-test-loss-allowed",
        "safety",
        "component",
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
        "pickled-optimizer-metadata",
        "safety",
        "pickle",
        "resume from a checkpoint whose optimizer `.metadata` pickles `os.system` (plain "
        "`dcp.load` runs it: checked)",
        "refused by the allow-list unpickler, the error names the file (exit 1); the command "
        "never runs",
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
        "torch.load only with weights_only=True, no pickle/dill loads, dcp.load only through "
        "tunesmith.training.safe_dcp, no trust_remote_code",
    ),
]
