"""The ``tunesmith`` command line.

Every subcommand has ``--help``. Errors print as one line (``tunesmith: error: ...``) and exit 1;
``--debug`` shows the full traceback instead.

Example::

    $ tunesmith ls
    $ tunesmith ls --models
    $ tunesmith run sft --config demo max_steps=10
    $ tunesmith run sft --config qwen3_0_6b --nproc-per-node 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tunesmith.cli import catalog, data_cmd, quickstart

ALLOW_ANY_ENV = "TUNESMITH_ALLOW_ANY_COMPONENT"
ALLOW_RUNTIME_ENV = (
    "TUNESMITH_ALLOW_RUNTIME_ENV"  # tunesmith.rl.asynchronous.pipeline.ALLOW_RUNTIME_ENV_ENV
)


class CLIError(Exception):
    """A user-facing error: printed as one line, never with a traceback."""


# --------------------------------------------------------------------------- subcommands


def cmd_ls(args: argparse.Namespace) -> int:
    """List the built-in recipes and their configs (--models: the model families)."""
    if args.models:
        from tunesmith.models.catalog import text_table

        print(text_table())
        print("TP / CP / EP: tensor, context, expert parallel (docs/architecture.md)")
        print(
            "any other causal LM model_type transformers ships runs on the transformers "
            "backend: every recipe, LoRA, FSDP2, TP where transformers has a plan; no CP/EP"
        )
        return 0
    print(f"{'RECIPE':<12} CONFIGS")
    for recipe in catalog.recipe_names():
        configs = catalog.config_names(recipe)
        print(f"{recipe:<12} {', '.join(configs) if configs else '-'}")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy a built-in recipe or config to a file you can edit (a config's first line then
    names its recipe, for `validate` and `run`)."""
    try:
        source = catalog.recipe_path(args.source)
    except catalog.CatalogError:
        source = catalog.config_path(args.source)
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        raise CLIError(f"{dest} already exists (use --force to overwrite)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    recipe = catalog.recipe_of_config(source) if source.suffix == ".yaml" else None
    if recipe is None:
        shutil.copyfile(source, dest)
    else:
        dest.write_text(catalog.recipe_header(recipe) + "\n" + source.read_text(encoding="utf-8"))
    print(f"copied {source.name} to {dest}")
    return 0


def _load(args: argparse.Namespace, recipe: str | None = None):
    from tunesmith.config import load_config

    return load_config(catalog.config_path(args.config, recipe), args.overrides)


def cmd_cat(args: argparse.Namespace) -> int:
    """Print a config with the overrides applied and interpolations resolved (those that
    cannot be yet, such as ${model_dir} while model_dir is ???, shown as written)."""
    from omegaconf import OmegaConf

    from tunesmith.config import display_config

    print(OmegaConf.to_yaml(OmegaConf.create(display_config(_load(args)))), end="")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Check a config against the real signatures of its components and its recipe's keys
    (the recipe: --recipe, a built-in config's, a `# recipe: NAME` first line, or inferred):
    the very checks `tunesmith run` makes first (catalog.check_run), so both name the same
    first problem."""
    config_file = catalog.config_path(args.config)
    recipe, how = args.recipe, ""
    if recipe is None:
        recipe = catalog.recipe_of_config(config_file)
        if recipe is not None and recipe not in catalog.recipe_names():
            raise CLIError(
                f"{config_file}: its `# recipe: {recipe}` line names no built-in "
                f"recipe ({', '.join(catalog.recipe_names())}); fix it or give "
                "--recipe NAME or a .py file"
            )
    from tunesmith.config import load_config
    from tunesmith.recipes import check_run, infer_recipe

    cfg = load_config(config_file, args.overrides)
    if recipe is None:
        recipe = infer_recipe(cfg)
        if recipe is not None:
            how = f" (recipe {recipe}, inferred from its keys; --recipe NAME to choose)"
    recipe_file = catalog.recipe_path(recipe) if recipe else None
    backends = check_run(cfg, recipe_file)
    print(f"{config_file.name}: OK{how}")
    for line in backends:
        print(f"  {line}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """Run a recipe on a config, in this process or on N ranks through torchrun."""
    for flag, value, what in (
        ("--nproc-per-node", args.nproc_per_node, "processes per node"),
        ("--nnodes", args.nnodes, "nodes"),
    ):
        if value < 1:
            raise CLIError(f"{flag} {value}: expected a number of {what} >= 1")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise CLIError(
            f"--node-rank {args.node_rank}: expected a node rank >= 0 and < --nnodes {args.nnodes}"
        )
    from tunesmith.recipes import prepare_run, run

    if args.preflight:  # the recipe's `preflight` key: one step on the longest batch first
        args.overrides = [*args.overrides, "preflight=true"]
    if args.nproc_per_node == 1 and args.nnodes == 1:
        run(args.recipe, args.config, args.overrides)  # tunesmith.run: checks, then trains
        return 0
    # every problem reported before anything is written
    recipe_file, config_file, cfg = prepare_run(args.recipe, args.config, args.overrides)
    from tunesmith.training.parallel.distributed import ParallelDims

    # a parallel layout that does not fit the world: one line now, not one per rank later
    ParallelDims.resolve(cfg.get("parallelism"), args.nproc_per_node * args.nnodes)
    from tunesmith.recipes import Recipe

    check_launch = Recipe.load(recipe_file).check_launch
    if check_launch is not None:  # a recipe's own refusal, e.g. a trainer group of Ray actors
        check_launch(cfg, args.nproc_per_node * args.nnodes)
    return _run_torchrun(args, cfg, recipe_file, config_file)


def _run_torchrun(args: argparse.Namespace, cfg, recipe_file: Path, config_file: Path) -> int:
    """Run the recipe on N ranks through torchrun (:mod:`tunesmith.cli.torchrun`): local rank
    0's output on the console as in a single-process run, one ``tunesmith: error:`` line per
    failure (ranks with the same error share one), everything else (every rank's output and
    traceback, torchrun's own) in a log file whose path is printed at the start and the end.
    Ctrl-C, SIGTERM and SIGHUP go to every rank (:class:`_SignalForwarder`): 0 when the ranks
    saved and stopped, 130 when they were interrupted before they could."""
    from tunesmith.cli.torchrun import FAILURES_ENV, RUN_LOG_ENV, failure_lines

    # torchrun and every rank start with a safe path (see python_module): a json.py in the
    # working directory is not imported; PYTHONPATH=... adds a folder of one's own deliberately
    command = [*python_module("tunesmith.cli.torchrun"), *_torchrun_args(args), "--no-python"]
    command += [*python_module("tunesmith.cli.launch"), str(recipe_file), str(config_file)]
    command += args.overrides
    log, world_size = _run_log(cfg, args.nnodes), args.nproc_per_node * args.nnodes
    fd, failures = tempfile.mkstemp(prefix="tunesmith-failures-", suffix=".json")
    os.close(fd)
    print(
        f"tunesmith: {world_size} ranks through torchrun; the full output of every rank and "
        f"of torchrun goes to {log}",
        file=sys.stderr,
    )
    try:
        env = {**os.environ, RUN_LOG_ENV: str(log), FAILURES_ENV: failures, **_secret_env()}
        env["PYTHONSAFEPATH"] = "1"  # and whatever Python the ranks start (3.11+)
        with _SignalForwarder() as forwarder:
            # torchrun in a session of its own: a Ctrl-C in the terminal reaches this process
            # alone, which passes it on to the ranks (torchrun, signalled, would stop them)
            code = forwarder.start(subprocess.Popen(command, env=env, start_new_session=True))
        records = _read_failures(Path(failures)) if code != 0 else []
    finally:
        os.unlink(failures)
    if code == 0:
        return 0
    for line in failure_lines(records, world_size) or [f"torchrun exited with code {code}"]:
        print(f"tunesmith: error: {_redacted(line)}", file=sys.stderr)
    if forwarder.received:
        names = ", ".join(forwarder.received)
        print(f"tunesmith: interrupted ({names}) before the ranks could save", file=sys.stderr)
    print(f"tunesmith: the full output of every rank and of torchrun is in {log}", file=sys.stderr)
    return 130 if forwarder.received else 1


_SAFE_PATH_BOOT = (  # Python 3.10 has no -P: drop the '' (cwd) that -c put first, then run
    "import sys; del sys.path[0]; import runpy; runpy.run_module(sys.argv.pop(1), "
    "run_name='__main__', alter_sys=True)"
)


def python_module(module: str) -> list[str]:
    """The command line that runs ``module`` like ``python -m`` but with no working directory
    (nor script folder) on ``sys.path``: ``-P`` (``PYTHONSAFEPATH``), or on Python 3.10 a
    ``-c`` that removes it before anything is imported from there. Folders on ``PYTHONPATH``
    are kept: that is how a user adds their own modules deliberately.

    Example::

        >>> python_module("tunesmith.cli.launch")[1:]  # Python >= 3.11
        ['-P', '-m', 'tunesmith.cli.launch']
    """
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", _SAFE_PATH_BOOT, module]


def _run_log(cfg, nnodes: int) -> Path:
    """Where a torchrun run's full output goes: ``<output_dir>/logs/torchrun-<date>-<time>.log``
    (the host name added on several nodes), or a temp file when there is no output_dir. A
    symbolic link planted as ``logs/`` is refused (the log file itself is opened without
    following a link by :mod:`tunesmith.cli.torchrun` and every rank).

    Example::

        >>> from omegaconf import OmegaConf
        >>> _run_log(OmegaConf.create({"output_dir": "out"}), 1)
        PosixPath('out/logs/torchrun-...-....log')
    """
    from tunesmith.models.atomic import UnsafePathError, open_no_follow, real_folder

    name = "torchrun-" + time.strftime("%Y%m%d-%H%M%S")
    name += f"-{socket.gethostname()}" if nnodes > 1 else ""
    try:
        output_dir = cfg.get("output_dir")
        if output_dir:
            log = real_folder(Path(str(output_dir)) / "logs") / f"{name}.log"
            open_no_follow(log, "a").close()  # here, so a planted link is refused in one line
            return log
    except UnsafePathError:  # a link planted as logs/: refused, never written through
        raise
    except Exception:  # no output_dir, or not writable: a temp file instead
        pass
    fd, path = tempfile.mkstemp(prefix=f"tunesmith-{name}-", suffix=".log")
    os.close(fd)
    return Path(path)


def _secret_env() -> dict[str, str]:
    """For torchrun and the ranks: the names (never the values) of the environment variables
    the config read, so their logs redact those values (:mod:`tunesmith.config.secrets`)."""
    from tunesmith.config.secrets import SECRET_NAMES_ENV, secret_names

    names = secret_names()
    return {SECRET_NAMES_ENV: ",".join(names)} if names else {}


def _redacted(line: str) -> str:
    """``line`` with the run's secret values (``${oc.env:...}`` reads) shown as their names."""
    if "tunesmith.config" not in sys.modules:  # nothing resolved: nothing to hide
        return line
    from tunesmith.config.secrets import redact

    return redact(line)


def _read_failures(path: Path) -> list[dict]:
    """The failed ranks torchrun recorded (none when it was killed before it could)."""
    try:
        records = json.loads(path.read_text() or "[]")
    except (OSError, ValueError):
        return []
    return records if isinstance(records, list) else []


class _SignalForwarder:
    """While it is entered, each stop signal this process receives (Ctrl-C, SIGTERM, SIGHUP:
    :mod:`tunesmith.training.stop_signals`) goes to every rank of the torchrun given to
    :meth:`start`: a rank in training saves a checkpoint at the end of the step with the
    others and exits 0, as one process does, so torchrun and this command exit 0; a second
    Ctrl-C aborts the ranks at once. A signal that comes before torchrun has started is sent
    when it has; ``received`` names them all.

    Example::

        with _SignalForwarder() as forwarder:
            code = forwarder.start(subprocess.Popen(command, start_new_session=True))
    """

    def __init__(self) -> None:
        self.received: list[str] = []
        self._pending: collections.deque[int] = collections.deque()  # popleft: atomic
        self._launcher: subprocess.Popen | None = None

    def __enter__(self) -> _SignalForwarder:
        from tunesmith.training.stop_signals import handle_stop_signals

        self._restore = handle_stop_signals(self._receive)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def start(self, launcher: subprocess.Popen) -> int:
        """Forward to ``launcher``'s ranks until it exits (after its ranks); its exit code."""
        self._launcher = launcher
        self._send()
        return launcher.wait()

    def _receive(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        self._pending.append(signum)
        if self._launcher is not None:
            self._send()

    def _send(self) -> None:
        while self._pending:
            try:
                signum = self._pending.popleft()
            except IndexError:  # a signal's handler, run in between, sent it
                return
            _signal_ranks(self._launcher, signum)


def _signal_ranks(launcher: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to torchrun's worker processes (found in Linux's /proc), or to torchrun
    itself when there are none yet (it then stops with the ranks it is starting)."""
    ranks: list[int] = []
    for children in Path(f"/proc/{launcher.pid}/task").glob("*/children"):
        try:
            ranks += [int(pid) for pid in children.read_text().split()]
        except OSError:  # the thread ended meanwhile
            continue
    for pid in ranks or [launcher.pid]:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # that rank has already exited
            continue


def _torchrun_args(args: argparse.Namespace) -> list[str]:
    """torchrun's arguments: one node standalone; several through the rendezvous at
    ``--rdzv-endpoint``: c10d (node ranks in the order the nodes join), or with ``--node-rank``
    torchrun's static rendezvous (node R runs global ranks ``R * nproc .. R * nproc + nproc -
    1``; node 0 hosts it, so the endpoint must be node 0's address), the only one that reads
    a node rank (c10d would ignore it).

    Example::

        >>> out = _torchrun_args(build_parser().parse_args(["run", "sft", "--config", "tiny",
        ...     "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "head:29500"]))
        >>> out[4:6], out[-2:]
        (['--rdzv-backend', 'static'], ['--node-rank', '1'])
    """
    out = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes)]
    if args.nnodes == 1 and args.rdzv_endpoint is None:
        return [*out, "--standalone"]
    if args.rdzv_endpoint is None:
        raise CLIError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    backend = "c10d" if args.node_rank is None else "static"
    out += [
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        args.rdzv_endpoint,
        "--rdzv-id",
        args.rdzv_id,
    ]
    return out if args.node_rank is None else [*out, "--node-rank", str(args.node_rank)]


def download_dir(repo_id: str) -> Path:
    """Where ``tunesmith download REPO_ID`` writes without ``--output-dir``: the folder the
    shipped configs' ``model_dir`` names.

    Example::

        >>> download_dir("Qwen/Qwen3-0.6B")
        PosixPath('models/Qwen3-0.6B')
    """
    return Path("models") / repo_id.split("/")[-1]


def cmd_download(args: argparse.Namespace) -> int:
    """Download a model repository from the Hugging Face Hub into a local folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    dest = Path(args.output_dir or download_dir(args.repo_id))
    try:
        path = snapshot_download(
            args.repo_id,
            revision=args.revision,
            local_dir=dest,
            allow_patterns=args.allow_patterns,
            token=args.token,
        )
    except LocalEntryNotFoundError as e:
        raise CLIError(
            f"cannot download {args.repo_id}: the Hub is not reachable (offline, or HF_HUB_OFFLINE=1)"
            f" and no local copy exists; copy the model folder here by hand and pass its path"
        ) from e
    except HfHubHTTPError as e:
        raise CLIError(f"cannot download {args.repo_id}: {e}".splitlines()[0]) from e
    print(f"downloaded {args.repo_id} to {path}")
    return 0


def _load_checkpoint(args: argparse.Namespace):
    """The model and tokenizer of ``args.checkpoint`` (a model, adapter or run folder); says
    on stderr which checkpoint (and base) that was."""
    import torch

    from tunesmith.cli.checkpoint_loading import chosen, load_checkpoint

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    loaded = load_checkpoint(
        args.checkpoint,
        base_dir=args.base_dir,
        dtype=args.dtype,
        device=device,
        chat_template=args.chat_template,
    )
    print(chosen(args.checkpoint, loaded.path, loaded.base), file=sys.stderr)
    return loaded


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate replies from a checkpoint (model, LoRA adapter or run folder): one prompt or
    chat, or a JSONL file of them (--input, --output)."""
    from tunesmith.cli.generate_batch import (
        PromptRows,
        generate_rows,
        read_chat_file,
        read_prompt_rows,
        write_rows,
    )

    if args.input is not None:
        if args.output is None:
            raise CLIError("--input needs --output FILE.jsonl")
        rows = read_prompt_rows(args.input)
    elif args.chat is not None:
        rows = read_chat_file(args.chat)
    elif args.prompt is not None:
        rows = PromptRows([{"prompt": args.prompt}], ["--prompt"])
    else:
        raise CLIError(
            "give --prompt TEXT, --chat FILE.json (a list of messages) or --input "
            "FILE.jsonl --output FILE.jsonl"
        )
    loaded = _load_checkpoint(args)
    out = generate_rows(
        loaded.model,
        loaded.tokenizer,
        rows,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        batch_size=args.batch_size,
        chat_template=False if args.raw else None,
        system=args.system,
    )
    if args.input is None:
        print(out[0]["completion"])
    else:
        print(f"wrote {len(out)} completions to {write_rows(args.output, out)}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat with a checkpoint in the terminal (multi-turn, chat template); /reset, /exit."""
    from tunesmith.cli.chat import ChatSession, chat_loop

    loaded = _load_checkpoint(args)
    session = ChatSession(
        loaded.model,
        loaded.tokenizer,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if sys.stdin.isatty():
        print(f"chatting with {loaded.path} ({loaded.kind}); /reset starts over, /exit ends")
    chat_loop(session, sys.stdin, sys.stdout)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a checkpoint (model, LoRA adapter or run folder) on lm-evaluation-harness
    tasks; prints lm-eval's table."""
    from tunesmith.cli.lm_eval_adapter import run_lm_eval

    loaded = _load_checkpoint(args)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    run_lm_eval(
        loaded,
        tasks,
        include_path=args.include_path,
        num_fewshot=args.num_fewshot,
        batch_size=args.batch_size,
        limit=args.limit,
        apply_chat_template=args.apply_chat_template,
        output_path=args.output_path,
        max_length=args.max_length,
        seed=args.seed,
    )
    return 0


def check_output_dir(
    out: str | os.PathLike, *, force: bool, keep: Sequence[str | os.PathLike] = ()
) -> None:
    """Refuse an output folder that exists unless ``force`` (as ``cp`` without ``-f``), and,
    even with ``force``, one that is or holds a folder in ``keep`` (the model being read):
    replacing it would delete that.

    >>> check_output_dir("/", force=False)
    Traceback (most recent call last):
    FileExistsError: --output-dir / already exists: pass --force to replace it
    """
    out = Path(out)
    if not (out.exists() or out.is_symlink()):
        return
    if not force:
        raise FileExistsError(f"--output-dir {out} already exists: pass --force to replace it")
    target = out.resolve()
    for source in keep:
        source = Path(source).resolve()
        if source == target or target in source.parents:
            raise ValueError(
                f"--output-dir {out} holds {source}, which this command reads: replacing it "
                "would delete that; choose another folder"
            )


def cmd_export(args: argparse.Namespace) -> int:
    """Merge a LoRA/DoRA adapter into its base and write a plain HF checkpoint."""
    from tunesmith.cli.checkpoint_loading import adapter_base, chosen, resolve_checkpoint
    from tunesmith.models.export import export_merged
    from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME

    path = resolve_checkpoint(args.path)  # a run folder: its newest checkpoint
    base = args.base_dir
    if (path / ADAPTER_CONFIG_NAME).is_file():
        base = adapter_base(path, base)  # found (and checked) from any working directory
    if args.format == "gguf":
        return _export_gguf(args, path, base)
    if args.outtype is not None:
        raise ValueError("--outtype is the type of a GGUF file's weights: add --format gguf")
    check_output_dir(args.output_dir, force=args.force, keep=[p for p in (path, base) if p])
    print(chosen(args.path, path, base), file=sys.stderr)
    if args.quantize is not None:
        from tunesmith.models.export import export_quantized

        out = export_quantized(
            path, args.output_dir, scheme=args.quantize, group_size=args.group_size,
            base_dir=base, dtype=args.dtype,
        )  # fmt: skip
        print(f"exported {args.path} to {out} ({args.quantize}, torchao)")
        return 0
    out = export_merged(path, args.output_dir, base_dir=base, dtype=args.dtype)
    print(f"exported {args.path} to {out}")
    return 0


def _export_gguf(args: argparse.Namespace, path: Path, base: Path | None) -> int:
    """``export --format gguf``: ``--output-dir/<name>-<OUTTYPE>.gguf``, an adapter merged
    into its base first (in a temporary folder beside the file)."""
    from tunesmith.cli.checkpoint_loading import chosen
    from tunesmith.models.export import export_merged
    from tunesmith.models.gguf_export import export_gguf

    if args.dtype is not None or args.quantize is not None:
        raise ValueError(
            "--dtype and --quantize are a HF folder's; a GGUF file's weights take --outtype"
        )
    outtype = args.outtype or "f16"
    out_dir = Path(args.output_dir)
    name = Path(args.path).resolve().name
    target = out_dir / f"{name}-{outtype.upper()}.gguf"
    if (target.exists() or target.is_symlink()) and not args.force:
        raise FileExistsError(f"{target} already exists: pass --force to replace it")
    print(chosen(args.path, path, base), file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    if base is None:
        out = export_gguf(path, target, outtype=outtype)
    else:
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".merged-") as merged:
            export_merged(path, Path(merged) / "model", base_dir=base)
            out = export_gguf(Path(merged) / "model", target, outtype=outtype)
    print(f"exported {args.path} to {out}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    """Write a PNG of the loss curves of a run directory (its metrics.jsonl)."""
    from tunesmith.training import plot_run

    print(plot_run(args.run_dir, args.output))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Fine-tune a tiny model on a generated task; print held-out accuracy before and after.
    `demo` (or `demo sft`): SFT; `demo rl`: SFT on few demonstrations, then GRPO
    (`demo rl --async`: asynchronous GRPO, rollouts sampled by Ray workers while it trains);
    `demo agent`: SFT on tool-use traces, then GRPO with a calculator tool and without it."""
    overrides = list(args.overrides)
    kind = overrides.pop(0) if overrides and overrides[0] in ("sft", "rl", "agent") else "sft"
    if args.asynchronous and kind != "rl":
        raise CLIError("--async is an option of `tunesmith demo rl` (asynchronous GRPO)")
    if kind == "agent":
        from tunesmith.demo.agent import AgentDemoSettings, run_agent_demo

        run_agent_demo(
            args.output_dir or "outputs/demo_agent",
            settings=AgentDemoSettings(seed=args.seed),
            overrides=overrides,
            threads=args.threads,
        )
        return 0
    if kind == "rl":
        from tunesmith.demo.rl import RLDemoSettings, run_rl_demo

        run_rl_demo(
            args.output_dir or "outputs/demo_rl",
            settings=RLDemoSettings(seed=args.seed),
            overrides=overrides,
            threads=args.threads,
            asynchronous=args.asynchronous,
        )
        return 0
    from tunesmith.demo.assets import AssetSettings
    from tunesmith.demo.run import run_demo

    run_demo(
        args.output_dir or "outputs/demo",
        settings=AssetSettings(seed=args.seed),
        overrides=[f"seed={args.seed}", *overrides],
        threads=args.threads,
    )
    return 0


# --------------------------------------------------------------------------- parser


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="overrides: a.b=value, ~a.b (delete), a=pkg.Cls")


def _add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help="run folder (output_dir: its newest complete checkpoint), HF model folder, or "
        "LoRA adapter folder (a LoRA run's step_N, or a copy of it)",
    )
    p.add_argument(
        "--base-dir",
        help="base model of an adapter (default: the one it records, found from anywhere; "
        "also searched in the folders of $TUNESMITH_MODEL_PATH)",
    )
    p.add_argument("--chat-template", help="template name (llama3, qwen2_5, qwen3) or .jinja file")
    p.add_argument("--dtype", help="float32, bfloat16, ... (default: the checkpoint's)")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")


def _add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--seed", type=int, help="seed of sampling (temperature > 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tunesmith", description=__doc__.split("\n\n")[0])
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument(
        "--allow-any-component",
        action="store_true",
        help="let configs instantiate _component_ paths outside the allow-list (runs their code)",
    )
    parser.add_argument(
        "--allow-runtime-env",
        action="store_true",
        help="let configs give Ray workers a runtime_env (py_executable, env_vars, pip, "
        "working_dir...: runs their code)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, fn: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
        doc = (fn.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc, description=doc)
        p.set_defaults(func=fn)
        return p

    p = add("ls", cmd_ls)
    p.add_argument(
        "--models",
        action="store_true",
        help="list the model families instead: model_type, sizes, template, what works with each",
    )

    p = add("cp", cmd_cp)
    p.add_argument("source", help="recipe name (sft) or config name (demo, sft/demo)")
    p.add_argument("dest", help="destination file or directory")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")

    p = add("cat", cmd_cat)
    p.add_argument("config", help="config name or path to a .yaml file")
    _add_config_args(p)

    p = add("validate", cmd_validate)
    p.add_argument("config", help="config name or path to a .yaml file")
    p.add_argument("--recipe", help="recipe the config is for (built-in configs know theirs)")
    _add_config_args(p)

    p = add("run", cmd_run)
    p.add_argument("recipe", help="recipe name (see `tunesmith ls`) or path to a .py file")
    p.add_argument("--config", required=True, help="config name or path to a .yaml file")
    # torchrun's spellings (--nproc_per_node, ...) are accepted too
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        help="processes (ranks) per node",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        help="this node's index, 0 .. nnodes-1 (node 0 hosts the rendezvous; "
        "without it nodes are numbered as they join)",
    )
    p.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", help="HOST:PORT of the rendezvous for multi-node runs"
    )
    p.add_argument("--rdzv-id", "--rdzv_id", default="tunesmith", help="job id shared by all nodes")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="run one step on the longest batch first (same as preflight=true)",
    )
    _add_config_args(p)
    quickstart.add_parsers(sub, cmd_run)  # tunesmith sft/dpo/grpo MODEL_DIR DATA, no config

    p = add("demo", cmd_demo)
    p.add_argument(
        "--output-dir",
        help="assets, checkpoints and plot (default: outputs/demo, outputs/demo_rl for `demo rl`, "
        "outputs/demo_agent for `demo agent`)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the task data, model and run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny: 1 is fastest)")
    p.add_argument(
        "--async",
        dest="asynchronous",
        action="store_true",
        help="demo rl: GRPO through grpo_async (overlap mode: a Ray rollout worker "
        "samples while the trainer trains)",
    )
    _add_config_args(p)

    p = add("download", cmd_download)
    p.add_argument("repo_id", help="Hub repository, e.g. Qwen/Qwen3-0.6B")
    p.add_argument("--output-dir", help="destination folder (default: models/<name>)")
    p.add_argument("--revision", help="branch, tag or commit")
    p.add_argument("--allow-patterns", nargs="*", help="only files matching these globs")
    p.add_argument("--token", help="Hub token (default: HF_TOKEN or the cached login)")

    p = add("generate", cmd_generate)
    _add_checkpoint_args(p)
    p.add_argument("--prompt", help="user message (or raw text with --raw)")
    p.add_argument("--chat", help="JSON file with a list of {role, content} messages")
    p.add_argument(
        "--input",
        help="JSONL of prompts: a string, or {prompt: ...} or "
        "{messages: [...]} (other keys are copied to the output)",
    )
    p.add_argument("--output", help="JSONL to write: each input row plus its completion")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    p.add_argument("--system", help="system prompt to put first")
    p.add_argument(
        "--raw", action="store_true", help="encode prompt strings as is, no chat template"
    )
    _add_sampling_args(p, max_new_tokens=128)

    p = add("chat", cmd_chat)
    _add_checkpoint_args(p)
    p.add_argument("--system", help="system prompt to put first")
    _add_sampling_args(p, max_new_tokens=256)

    p = add("eval", cmd_eval)
    _add_checkpoint_args(p)
    p.add_argument("--tasks", required=True, help="lm-eval task names, comma separated")
    p.add_argument("--include-path", help="folder of your own lm-eval task YAML files")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward")
    p.add_argument(
        "--limit",
        type=float,
        help="first N examples per task (a fraction when < 1); for quick checks",
    )
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render prompts with the chat template (few-shot as multi-turn)",
    )
    p.add_argument("--output-path", help="JSON file for the results (and per-sample outputs)")
    p.add_argument(
        "--max-length",
        type=int,
        help="context length (default: the model's max_position_embeddings)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of few-shot sampling and sampling")

    p = add("export", cmd_export)
    p.add_argument(
        "path",
        help="run folder (output_dir: its newest complete checkpoint), adapter folder, or a "
        "HF model folder",
    )
    p.add_argument(
        "--output-dir",
        required=True,
        help="where to write the merged HF folder (gguf: the folder of the .gguf file)",
    )
    p.add_argument("--base-dir", help="base model folder (default: the one the adapter records)")
    p.add_argument("--dtype", help="float32 or bfloat16 (default: the base's)")
    p.add_argument(
        "--format",
        choices=("hf", "gguf"),
        default="hf",
        help="hf: a Hugging Face folder (default); gguf: one file for llama.cpp/Ollama, "
        "OUTPUT_DIR/<name>-<OUTTYPE>.gguf",
    )
    p.add_argument(
        "--outtype",
        choices=("f32", "f16", "bf16", "q8_0"),
        help="with --format gguf: the weights' type (norms and biases stay f32; default f16)",
    )
    p.add_argument(
        "--quantize",
        choices=("int8da-int4w", "int4w", "int8w"),
        help="a torchao-quantized HF folder (linear layers but lm_head): the scheme a QAT run "
        "trained with (quantization.qat.scheme), or post-training quantization",
    )
    p.add_argument(
        "--group-size", type=int, default=32, help="with --quantize: weights per int4 group"
    )
    p.add_argument(
        "--force", action="store_true", help="replace --output-dir when it exists (as cp -f)"
    )

    p = add("plot", cmd_plot)
    p.add_argument("run_dir", help="run directory holding metrics.jsonl")
    p.add_argument("--output", help="PNG path (default: RUN_DIR/loss.png)")

    data_cmd.add_parser(sub)  # tunesmith data preview
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tunesmith`` console script."""
    parser = build_parser()
    # Overrides may follow options (`run sft --config demo a=1`): collect what argparse leaves.
    args, extra = parser.parse_known_args(argv)
    if extra and (not hasattr(args, "overrides") or any(x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.allow_any_component:
        os.environ[ALLOW_ANY_ENV] = "1"  # inherited by torchrun ranks
    if args.allow_runtime_env:
        os.environ[ALLOW_RUNTIME_ENV] = "1"  # inherited by torchrun ranks and Ray workers
    try:
        return args.func(args)
    except KeyboardInterrupt:  # before training, or a second Ctrl-C (in training: a checkpoint, 0)
        print("tunesmith: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one clear line for the user; --debug for the traceback
        if args.debug:
            raise
        message = str(e).strip() or type(e).__name__
        print(f"tunesmith: error: {_redacted(message)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
