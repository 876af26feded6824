"""The Ray cases: a config's Ray ``runtime_env`` runs code, so it needs an opt-in; Ray workers
never import code from the folder a run starts in; a ``ray.address`` that does not answer ends
the run in bounded time.

:data:`RUNTIME_ENV_ROUTES` are config routes to code execution through a Ray runtime
environment, each one catalogue case (group ``safety``, kind ``runtime-env``) that
``test_ray_safety.py`` runs through ``tunesmith validate`` and ``tunesmith run grpo_async
--config tiny`` in this process (the same first line, before Ray starts and before anything is
written). Each route is the override that puts it into the config and the key path the
refusal must name. Routes of kind ``config-route`` (group ``bad_input``) are runtime
environments given as an interpolation that cannot be resolved: the same first line names
the key. Nothing here imports Ray, so the report script lists the catalogue cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.faults.kit import Case
from tests.faults.safety_cases import ENV_UNSET, UNRESOLVED_KIND

__all__ = ["ENV_RUNTIME_ENV", "RAY", "RUNTIME_ENV_ROUTES", "RuntimeEnvRoute"]

ENV_RUNTIME_ENV = "TUNESMITH_TEST_RUNTIME_ENV"  # what the decoded-environment route reads
_REFUSED = (
    "`validate` and `run grpo_async` both exit 1 with the same first line 'tunesmith: error: "
    "{where}: a Ray runtime environment runs code: ...; pass --allow-runtime-env ...', before "
    "Ray starts; nothing written, the payload never runs"
)
_NO_KEY = (
    "`validate` and `run grpo_async` both exit 1 with the same first line 'tunesmith: error: "
    "{where}...' (the section takes no runtime environment), before Ray starts; nothing written"
)

_UNRESOLVED = (
    "`validate` and `run grpo_async` both exit 1 with the same first line 'tunesmith: error: "
    "{where}: interpolation ... cannot be resolved: ...' (the key named, not a bare resolver "
    "error), before Ray starts; nothing written"
)

_VLLM = (
    "`validate` and `run grpo_async` both exit 1 with the same first line 'tunesmith: error: "
    "{where}: not one of the vLLM settings passed on as they are ...; pass --allow-runtime-env "
    "...', before Ray starts; nothing written"
)


@dataclass(frozen=True)
class RuntimeEnvRoute:
    """A runtime environment in a config: ``override`` (``{marker}`` and ``{folder}`` filled in
    by the test) and ``where``, the key path the first line must start with. ``live`` names
    the check in the test that shows the payload runs code (``None``: by Ray's design only,
    not shown here). ``kind``: ``runtime-env`` (a refusal that names the opt-in) or
    ``config-route`` (a value that cannot be resolved)."""

    id: str
    what: str
    override: str
    where: str
    live: str | None = None
    says: str = "a Ray runtime environment runs code"
    kind: str = "runtime-env"


def _rollout(value: str) -> str:
    return f"rollout.runtime_env={value}"


_UNSET = "${{oc.env:" + ENV_UNSET + "}}"  # doubled braces: the test formats the override
_CANNOT = "cannot be resolved"


RUNTIME_ENV_ROUTES = [
    RuntimeEnvRoute("runtime-env-py-executable", "`rollout.runtime_env.py_executable`: a script "
                    "run as the workers' interpreter", _rollout("{{py_executable: {folder}/py.sh}}"),
                    "rollout.runtime_env.py_executable", live="py_executable"),
    RuntimeEnvRoute("runtime-env-env-vars-pythonwarnings", "`env_vars.PYTHONWARNINGS` naming a "
                    "warning class in a module of the case (Python imports it at start-up)",
                    _rollout("{{env_vars: {{PYTHONWARNINGS: 'ignore::tsevil_warn.Boom', "
                             "PYTHONPATH: {folder}/pkgs}}}}"),
                    "rollout.runtime_env.env_vars.PYTHONWARNINGS", live="PYTHONWARNINGS"),
    RuntimeEnvRoute("runtime-env-env-vars-pythonstartup", "`env_vars.PYTHONSTARTUP`: a script "
                    "Python runs (interactive interpreters)",
                    "reward_workers.runtime_env={{env_vars: {{PYTHONSTARTUP: {folder}/startup.py}}}}",
                    "reward_workers.runtime_env.env_vars.PYTHONSTARTUP", live="PYTHONSTARTUP"),
    RuntimeEnvRoute("runtime-env-env-vars-ld-preload", "`env_vars.LD_PRELOAD`: a shared library "
                    "loaded into every worker process", _rollout("{{env_vars: {{LD_PRELOAD: "
                                                                "{folder}/evil.so}}}}"),
                    "rollout.runtime_env.env_vars.LD_PRELOAD", live="LD_PRELOAD"),
    RuntimeEnvRoute("runtime-env-env-vars-browser", "`env_vars.BROWSER`: the command "
                    "`webbrowser` runs", "reward_workers.runtime_env={{env_vars: {{BROWSER: "
                    "'touch {marker} #%s'}}}}", "reward_workers.runtime_env.env_vars.BROWSER",
                    live="BROWSER"),
    RuntimeEnvRoute("runtime-env-pip", "`pip`: packages installed (their build code runs)",
                    _rollout("{{pip: [{folder}/evil_pkg]}}"), "rollout.runtime_env.pip"),
    RuntimeEnvRoute("runtime-env-uv", "`uv`: packages installed", _rollout("{{uv: [evil-pkg]}}"),
                    "rollout.runtime_env.uv"),
    RuntimeEnvRoute("runtime-env-conda", "`conda`: an environment installed",
                    _rollout("{{conda: {{dependencies: [evil-pkg]}}}}"), "rollout.runtime_env.conda"),
    RuntimeEnvRoute("runtime-env-working-dir", "`working_dir`: a folder put first on the "
                    "workers' import path", _rollout("{{working_dir: {folder}/pkgs}}"),
                    "rollout.runtime_env.working_dir"),
    RuntimeEnvRoute("runtime-env-py-modules", "`py_modules`: modules put on the import path",
                    _rollout("{{py_modules: [{folder}/pkgs/tsevil_warn]}}"),
                    "rollout.runtime_env.py_modules"),
    RuntimeEnvRoute("runtime-env-container", "`container`: the workers run in an image",
                    _rollout("{{container: {{image: 'evil:latest'}}}}"),
                    "rollout.runtime_env.container"),
    RuntimeEnvRoute("runtime-env-image-uri", "`image_uri`: the workers run in an image",
                    _rollout("{{image_uri: 'docker.io/evil:latest'}}"),
                    "rollout.runtime_env.image_uri"),
    RuntimeEnvRoute("runtime-env-reward-workers", "`reward_workers.runtime_env.py_executable`",
                    "reward_workers.runtime_env={{py_executable: {folder}/py.sh}}",
                    "reward_workers.runtime_env.py_executable"),
    RuntimeEnvRoute("runtime-env-interpolation", "`rollout.runtime_env` as `${oc.create:...}`: "
                    "checked on the resolved value",
                    "rollout.runtime_env=${{oc.create:{{py_executable: {folder}/py.sh}}}}",
                    "rollout.runtime_env.py_executable"),
    RuntimeEnvRoute("runtime-env-from-environment", "`rollout.runtime_env` decoded "
                    f"(`oc.decode`) from the environment variable {ENV_RUNTIME_ENV}",
                    "rollout.runtime_env=${{oc.decode:${{oc.env:" + ENV_RUNTIME_ENV + "}}}}",
                    "rollout.runtime_env.py_executable"),
    RuntimeEnvRoute("runtime-env-whole-section", "the whole `rollout` section as "
                    "`${oc.create:...}` holding a runtime environment",
                    "rollout=${{oc.create:{{workers: 1, runtime_env: {{working_dir: {folder}}}}}}}",
                    "rollout.runtime_env.working_dir"),
    RuntimeEnvRoute("runtime-env-setup-hook", "`worker_process_setup_hook`: a function every "
                    "worker calls", _rollout("{{worker_process_setup_hook: os.system}}"),
                    "rollout.runtime_env.worker_process_setup_hook"),
    RuntimeEnvRoute("vllm-argument-worker-cls", "`rollout.vllm.worker_cls`: vLLM imports that "
                    "class and runs it as its GPU worker", "rollout.vllm={{worker_cls: "
                    "tsevil.Worker}}", "rollout.vllm.worker_cls", says="can load or run code"),
    RuntimeEnvRoute("vllm-argument-logits-processors", "`rollout.vllm.logits_processors`: vLLM "
                    "imports the dotted paths", "rollout.vllm={{logits_processors: [os.system]}}",
                    "rollout.vllm.logits_processors", says="can load or run code"),
    RuntimeEnvRoute("runtime-env-trainer-group", "`trainer_group.runtime_env` (the trainer "
                    "actors take none)", "trainer_group.runtime_env={{py_executable: "
                    "{folder}/py.sh}}", "trainer_group", says="unknown key 'runtime_env'"),
    RuntimeEnvRoute("runtime-env-ray-section", "`ray.runtime_env` (Ray's job-wide one: not "
                    "read, refused)", "ray.runtime_env={{py_executable: {folder}/py.sh}}",
                    "ray.runtime_env", says="unknown key"),
    RuntimeEnvRoute("runtime-env-unresolvable", f"`rollout.runtime_env: ${{oc.env:{ENV_UNSET}}}`"
                    ": an interpolation that cannot be resolved (the line named no key)",
                    _rollout(_UNSET), "rollout.runtime_env", says=_CANNOT, kind=UNRESOLVED_KIND),
    RuntimeEnvRoute("runtime-env-unresolvable-reward-workers", "`reward_workers.runtime_env: "
                    f"${{oc.env:{ENV_UNSET}}}`", f"reward_workers.runtime_env={_UNSET}",
                    "reward_workers.runtime_env", says=_CANNOT, kind=UNRESOLVED_KIND),
    RuntimeEnvRoute("runtime-env-unresolvable-inside", "`rollout.runtime_env: "
                    f"${{oc.create:{{py_executable: ${{oc.env:{ENV_UNSET}}}}}}}`: a made node "
                    "whose value cannot be resolved", _rollout("${{oc.create:{{py_executable: "
                    + _UNSET + "}}}}"), "rollout.runtime_env", says=_CANNOT, kind=UNRESOLVED_KIND),
]  # fmt: skip


def _route_case(route: RuntimeEnvRoute) -> Case:
    if route.kind == UNRESOLVED_KIND:
        expect = _UNRESOLVED.format(where=route.where)
        return Case(route.id, "bad_input", route.kind, route.what, expect)
    template = {"a Ray runtime environment runs code": _REFUSED, "can load or run code": _VLLM}
    expect = template.get(route.says, _NO_KEY).format(where=route.where)
    if route.live:
        expect += f"; the payload shown live ({route.live} runs code)"
    return Case(route.id, "safety", "runtime-env", route.what, expect)


_HANG_BOUND = "within ray.connect_timeout_s"
RAY = [
    *(_route_case(route) for route in RUNTIME_ENV_ROUTES),
    Case(
        "runtime-env-opt-in-validates",
        "safety",
        "opt-in",
        "`rollout.runtime_env.py_executable` with `--allow-runtime-env` (or "
        "`--allow-any-component`)",
        "`tunesmith --allow-runtime-env validate` says OK; so does `--allow-any-component`",
    ),
    Case(
        "runtime-env-opt-in-runs",
        "safety",
        "opt-in",
        "`tunesmith --allow-runtime-env run grpo_async` with `rollout.runtime_env.py_executable` "
        "a script that creates a marker, then runs Python",
        "the run trains (exit 0) and the marker exists: the opt-in builds it, and the refused "
        "route is a real one",
        ci=False,
    ),
    Case(
        "ray-worker-env-cwd-files",
        "safety",
        "working-dir-import",
        "a Python process started as the pipeline starts a Ray worker (its runtime_env's "
        "env_vars) in a folder holding `sitecustomize.py` and `json.py` (each creates a marker)",
        "no marker: neither file is imported (PYTHONSAFEPATH, no working folder in PYTHONPATH); "
        "both shown live with the workers' former PYTHONPATH=<cwd> and a plain `python -c`",
    ),
    Case(
        "ray-workers-cwd-sitecustomize",
        "safety",
        "working-dir-import",
        "`run grpo_async` from a folder holding `sitecustomize.py` and `torch.py` (each creates "
        "a marker when imported); Ray's workers used to get `PYTHONPATH=<cwd>` and Ray puts "
        "the driver's folder first on their `sys.path`",
        "the run trains (exit 0); no marker: no worker imported either file (both shown live "
        "with the working folder on the path)",
        ci=False,
    ),
    Case(
        "ray-address-closed-port",
        "bad_input",
        "hang",
        "`ray.address=127.0.0.1:<a closed port>` (Ray itself retries for 430+ s)",
        f"exit 1 {_HANG_BOUND} (30 s; measured in seconds) with one line 'ray.address: "
        "127.0.0.1:<port>: cannot connect (Connection refused) ...'; Ray never started",
    ),
    Case(
        "ray-address-auto-no-cluster",
        "bad_input",
        "hang",
        "`ray.address=auto` on a machine where no Ray cluster runs",
        f"exit 1 {_HANG_BOUND} (30 s) with one line 'ray.address: auto, but no Ray cluster "
        "runs on this machine ...'; Ray never started",
    ),
    Case(
        "ray-address-not-ray",
        "bad_input",
        "hang",
        "`ray.address` naming a port where a plain TCP server accepts and never answers "
        "(`ray.connect_timeout_s=5`)",
        "exit 1 within 5 s of ray.init (the process gone within 60 s) with one line "
        "'ray.address: ...: Ray did not connect within 5 s (ray.connect_timeout_s) ...'",
        ci=False,
    ),
    Case(
        "ray-address-malformed",
        "bad_input",
        "ray-config",
        "`ray.address=head-node` (no port)",
        "`validate` and `run` both exit 1 with the same first line 'ray.address: expected "
        "null, 'auto' or HOST:PORT ...'; nothing written",
    ),
]
"""Every Ray case, in catalogue order."""
