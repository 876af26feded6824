"""The quick start: ``tunesmith sft MODEL_DIR DATA``, ``tunesmith dpo MODEL_DIR PAIRS`` and
``tunesmith grpo MODEL_DIR PROMPTS``: a run without writing a config, as ``trl sft
--model_name_or_path ... --dataset_name ...`` or ``tune run`` on a shipped config.

The config is the recipe's shipped ``default`` (``default_lora`` with ``--lora``), with each
of these laid over the one before:

1. the data's format, detected from its columns: the first format of the dataset's table
   (:data:`~tunesmith.data.formats.FORMAT_FIELDS`, DPO's
   :data:`~tunesmith.data.preference_dataset.PREFERENCE_FORMAT_FIELDS`) whose required columns
   the data has (through ``column_map`` when given); GRPO's prompts find their column
   themselves (``prompt`` or ``messages``);
2. ``--config FILE``: a YAML file (or a shipped config's name) holding only what differs,
   e.g. ``model_dir``, ``dataset.source`` and ``output_dir``; a mapping whose ``_component_``
   is another class replaces the default's whole node;
3. the arguments: MODEL_DIR (``model_dir``), DATA (``dataset.source``, GRPO's
   ``prompts.source``), ``--epochs``, ``--max-steps``, ``--output-dir``, and GRPO's
   ``--reward`` (built-in rewards, :data:`REWARDS`) and ``--answer-column``, and ``--tool``
   (built-in tools, :data:`TOOLS`): multi-turn GRPO in a ``ToolEnv`` of those tools whose
   final answers the rewards score (``rewards`` move into ``environment.rewards``), the
   tool-call format that of the model's chat template (``--tool-format`` to choose);
4. ``key=value`` and ``~key`` overrides, as for ``tunesmith run``.

It then runs as ``tunesmith run RECIPE --config CONFIG`` does (in this process, or on
``--nproc-per-node N`` ranks through torchrun), and the run saves the config as
``<output_dir>/config.yaml``: ``tunesmith run RECIPE --config <output_dir>/config.yaml
overwrite=true`` runs it again from the start. ``--print-config`` checks the config, prints
that file's text and exits.

Example::

    >>> from tunesmith.cli.main import build_parser
    >>> args = build_parser().parse_args(["sft", "models/m", "chat.jsonl", "seed=3", "--lora"])
    >>> args.quick.base(args.lora), split_words(args.overrides)
    ('default_lora', (['models/m', 'chat.jsonl'], ['seed=3']))
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "QUICK_RECIPES",
    "REWARDS",
    "QuickRecipe",
    "add_parsers",
    "build_config",
    "cmd_quickstart",
    "config_text",
    "data_columns",
    "detect_format",
    "layered",
    "saved_config",
    "split_words",
]


@dataclass(frozen=True)
class QuickRecipe:
    """One quick-start command: its recipe, the config node DATA fills (its ``source``), what
    DATA holds, and the table of formats to detect (``module:NAME``; None: nothing to detect).

    Example::

        >>> QUICK_RECIPES["dpo"].base(lora=False), QUICK_RECIPES["grpo"].data_node
        ('default', 'prompts')
    """

    name: str
    data_node: str
    data_help: str
    formats: str | None = None
    rewards: bool = False  # --reward and --answer-column (GRPO)

    def base(self, lora: bool) -> str:
        """The shipped config the command starts from."""
        return "default_lora" if lora else "default"

    def format_table(self) -> Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] | None:
        """format -> (required fields, optional fields) of the recipe's dataset, or None."""
        if self.formats is None:
            return None
        module, name = self.formats.split(":")
        return getattr(importlib.import_module(module), name)


_SOURCES = "a JSONL/JSON/Parquet/CSV file, a folder or a Hub dataset name"
QUICK_RECIPES: dict[str, QuickRecipe] = {
    quick.name: quick
    for quick in (
        QuickRecipe(
            "sft",
            "dataset",
            f"conversations or prompt/completion rows: {_SOURCES} (or a .txt file)",
            "tunesmith.data.formats:FORMAT_FIELDS",
        ),
        QuickRecipe(
            "dpo",
            "dataset",
            f"preference pairs (chosen/rejected, with or without a prompt column): {_SOURCES}",
            "tunesmith.data.preference_dataset:PREFERENCE_FORMAT_FIELDS",
        ),
        QuickRecipe(
            "grpo",
            "prompts",
            f"prompts (a prompt or messages column) with answers: {_SOURCES}",
            rewards=True,
        ),
    )
}
"""The quick-start commands, by recipe name."""

REWARDS: dict[str, str] = {
    "exact_answer": "tunesmith.rl.rewards.ExactAnswer",
    "math_answer": "tunesmith.rl.rewards.MathAnswer",
    "string_match": "tunesmith.rl.rewards.StringMatch",
    "character_match": "tunesmith.rl.rewards.CharacterMatch",
    "think_answer_format": "tunesmith.rl.rewards.ThinkAnswerFormat",
}
"""``grpo --reward NAME``: the built-in rewards that need no argument and score a completion
from the prompt's answer (or its format); NAME is the reward's own ``name``."""

TOOLS: dict[str, str] = {
    "calculator": "tunesmith.rl.envs.Calculator",
    "python": "tunesmith.rl.envs.PythonTool",
}
"""``grpo --tool NAME``: the built-in tools that need no argument (``Retrieve`` needs a corpus:
give it in a config's ``environment``)."""

TOOL_FORMATS = ("qwen", "llama3", "plain")
PLAIN_TOOLS_PROMPT = (
    "You can use tools. To call one, write a line `CALL <name> <JSON object of arguments>`; "
    "its result comes back in the next message. Answer without a CALL line when you are done. "
    "Tools: {tools}."
)
"""The system prompt of ``--tool`` with the ``plain`` format (a template without tool calls)."""


# ----------------------------------------------------------------------------- the config


def split_words(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """The positional words (MODEL_DIR, DATA) and the overrides of a command line: a word
    that parses as an override (``key=value``, ``~key``) is one.

    Example::

        >>> split_words(["models/m", "~/data.jsonl", "optimizer.lr=1e-5", "~compile"])
        (['models/m', '~/data.jsonl'], ['optimizer.lr=1e-5', '~compile'])
    """
    from tunesmith.config import ConfigError
    from tunesmith.config.overrides import parse_override

    positional, overrides = [], []
    for word in words:
        try:
            parse_override(word)
        except ConfigError:
            positional.append(word)
        else:
            overrides.append(word)
    return positional, overrides


def layered(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` laid over ``base`` (plain mappings): mappings merge key by key, anything else is
    replaced; a mapping whose ``_component_`` differs from ``base``'s replaces it whole (another
    class takes other arguments).

    Example::

        >>> base = {"optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3, "fused": True}}
        >>> layered(base, {"optimizer": {"lr": 1e-4}})["optimizer"]["fused"]
        True
        >>> layered(base, {"optimizer": {"_component_": "torch.optim.SGD", "lr": 0.1}})
        {'optimizer': {'_component_': 'torch.optim.SGD', 'lr': 0.1}}
    """
    out = dict(base)
    for key, value in top.items():
        old = out.get(key)
        same = (
            isinstance(value, Mapping)
            and isinstance(old, Mapping)
            and value.get("_component_", old.get("_component_")) == old.get("_component_")
        )
        out[key] = layered(old, value) if same else value
    return out


def _with_values(tree: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` with each dotted key of ``values`` set (replaced whole, parents made)."""
    out = dict(tree)
    for dotted, value in values.items():
        key, _, rest = dotted.partition(".")
        if rest:
            child = out.get(key)
            value = _with_values(child if isinstance(child, Mapping) else {}, {rest: value})
        out[key] = value
    return out


def _argument_values(quick: QuickRecipe, args: argparse.Namespace, positional: list[str]):
    """What the command's arguments set, by dotted key (in the order given)."""
    if len(positional) > 2:
        raise ValueError(
            f"tunesmith {quick.name} takes MODEL_DIR and DATA, then key=value overrides; got "
            f"{len(positional)} other words: {' '.join(positional)}"
        )
    values: dict[str, Any] = dict(zip(("model_dir", f"{quick.data_node}.source"), positional))
    for key in ("epochs", "max_steps", "output_dir"):  # --epochs, --max-steps, --output-dir
        if getattr(args, key, None) is not None:
            values[key] = getattr(args, key)
    if getattr(args, "reward", None):
        values["rewards.rewards"] = {name: {"_component_": REWARDS[name]} for name in args.reward}
    if getattr(args, "answer_column", None) is not None:
        values["prompts.answer_column"] = args.answer_column
    return values


def _user_layer(quick: QuickRecipe, config: str | None) -> dict[str, Any]:
    """The ``--config`` file (or shipped config) as a plain mapping; empty without one."""
    if config is None:
        return {}
    from omegaconf import OmegaConf

    from tunesmith.cli import catalog
    from tunesmith.config import load_config

    path = catalog.config_path(config, quick.name)
    owner = catalog.recipe_of_config(path)
    if owner is not None and owner != quick.name:
        raise ValueError(
            f"--config {config} is a config of recipe {owner!r}: run `tunesmith {owner} "
            f"--config {config}` (or `tunesmith run {owner} --config {config}`)"
        )
    return OmegaConf.to_container(load_config(path), resolve=False)


def _compose(
    base: Mapping[str, Any],
    detected: Mapping[str, Any],
    user: Mapping[str, Any],
    values: Mapping[str, Any],
    overrides: Sequence[str],
):
    """The layers, in order: base, detected, the user's file, the arguments, the overrides."""
    from omegaconf import OmegaConf

    from tunesmith.config.overrides import apply_overrides

    tree = _with_values(layered(_with_values(base, detected), user), values)
    return apply_overrides(OmegaConf.create(tree), overrides)


def _user_sets(path: str, user: Mapping[str, Any], overrides: Sequence[str]) -> bool:
    """Whether the user's file or overrides give ``path`` (or a node above it)."""
    from tunesmith.config.overrides import parse_override

    keys = tuple(path.split("."))
    node: Any = user
    for key in keys:
        if not isinstance(node, Mapping) or key not in node:
            break
        node = node[key]
    else:
        return True
    given = [parse_override(o).keys for o in overrides]
    return any(keys[: len(k)] == k for k in given)


def build_config(quick: QuickRecipe, args: argparse.Namespace):
    """The config of a quick-start command line (see the module docs), not yet checked.

    Example::

        cfg = build_config(QUICK_RECIPES["sft"], build_parser().parse_args(
            ["sft", "models/m", "chat.jsonl", "--epochs", "2"]))
    """
    from omegaconf import OmegaConf

    from tunesmith.cli import catalog
    from tunesmith.config import load_config

    positional, overrides = split_words(args.overrides)
    base_file = catalog.config_path(quick.base(args.lora), quick.name)
    base = OmegaConf.to_container(load_config(base_file), resolve=False)
    user = _user_layer(quick, args.config)
    values = _argument_values(quick, args, positional)
    cfg = _compose(base, {}, user, values, overrides)
    _require_inputs(quick, cfg)
    format_key = f"{quick.data_node}.format"
    if quick.formats is not None and not _user_sets(format_key, user, overrides):
        node = OmegaConf.to_container(cfg[quick.data_node], resolve=True)
        detected = detect_format(quick, node)
        if detected != node.get("format"):
            cfg = _compose(base, {format_key: detected}, user, values, overrides)
    if getattr(args, "tool", None):
        cfg = _with_tools(cfg, args.tool, args.tool_format)
    return cfg


def _with_tools(cfg, tools: Sequence[str], tool_format: str | None):
    """``cfg`` with an ``environment`` of the named built-in tools (a ``ToolEnv`` in the
    format of the model's chat template unless ``tool_format`` is given) scoring final
    answers with ``cfg.rewards``, and no ``rewards`` beside it."""
    from omegaconf import OmegaConf

    from tunesmith.data import Tokenizer
    from tunesmith.rl.envs.toolcalls import template_tool_format

    if tool_format is None:
        template = OmegaConf.select(cfg, "tokenizer.chat_template", default=None)
        tokenizer = Tokenizer.from_pretrained(cfg.model_dir, chat_template=template)
        tool_format = template_tool_format(*tokenizer.chat_templates.values())
    names = list(dict.fromkeys(tools))
    environment = {
        "_component_": "tunesmith.rl.envs.ToolEnv",
        "format": tool_format,
        "tools": [{"_component_": TOOLS[name]} for name in names],
        "rewards": OmegaConf.to_container(cfg.rewards, resolve=False),
    }
    if tool_format == "plain":
        environment["system_prompt"] = PLAIN_TOOLS_PROMPT.format(tools=", ".join(names))
    cfg.environment = environment
    cfg.rewards = None
    return cfg


def _require_inputs(quick: QuickRecipe, cfg) -> None:
    """One line naming MODEL_DIR or DATA when neither the arguments nor ``--config`` gave it."""
    from omegaconf import OmegaConf

    needed = [
        (cfg, "model_dir", "MODEL_DIR (a Hugging Face model folder)"),
        (cfg[quick.data_node], "source", f"DATA ({quick.data_help})"),
    ]
    for node, key, what in needed:
        if OmegaConf.is_missing(node, key):
            raise ValueError(
                f"tunesmith {quick.name} needs {what}: `tunesmith {quick.name} MODEL_DIR DATA` "
                f"(or a --config file that sets model_dir and {quick.data_node}.source)"
            )


def data_columns(node: Mapping[str, Any]) -> list[str]:
    """The columns of a dataset node's ``source``: a local ``.jsonl`` file's first row (the
    file is not read whole), else every row's, read as the dataset reads them.

    Example::

        >>> _ = Path("pc.jsonl").write_text('{"prompt": "Hi", "completion": "Hello"}\\n')
        >>> data_columns({"source": "pc.jsonl"})
        ['prompt', 'completion']
    """
    import json

    from tunesmith.data.sources import load_rows

    path = Path(str(node["source"])).expanduser()
    if path.suffix.lower() == ".jsonl" and path.is_file():
        with open(path, encoding="utf-8", errors="replace") as f:
            first = next((line for line in f if line.strip()), "")
        try:
            row = json.loads(first)
        except ValueError:
            row = None  # a broken first line: read as the dataset does, which names it
        if isinstance(row, dict):
            return list(row)
    kwargs = {k: node[k] for k in ("split", "data_files") if node.get(k) is not None}
    if node.get("text_sample_by") is not None:
        kwargs["sample_by"] = node["text_sample_by"]
    return load_rows(str(node["source"]), **kwargs).columns


def detect_format(quick: QuickRecipe, node: Mapping[str, Any]) -> str:
    """The first format of ``quick``'s table whose required fields are columns of the data
    (each field through the node's ``column_map``); a ``ValueError`` names the columns and
    what each format needs when none is.

    Example::

        >>> _ = Path("alpaca.jsonl").write_text('{"instruction": "Hi", "output": "Hello"}\\n')
        >>> detect_format(QUICK_RECIPES["sft"], {"source": "alpaca.jsonl"})
        'alpaca'
    """
    table = quick.format_table() or {}
    columns = set(data_columns(node))
    column_map = dict(node.get("column_map") or {})
    for name, (required, _) in table.items():
        if all(column_map.get(field, field) in columns for field in required):
            return name
    needs = "; ".join(f"{name}: {', '.join(required)}" for name, (required, _) in table.items())
    raise ValueError(
        f"{node['source']}: no {quick.name} data format fits its columns {sorted(columns)} "
        f"({needs}); name yours with {quick.data_node}.column_map={{field: column}} "
        f"(and {quick.data_node}.format=NAME)"
    )


def config_text(cfg) -> str:
    """The text a run writes as ``<output_dir>/config.yaml`` for ``cfg`` (interpolations
    resolved, environment reads kept as ``${oc.env:...}``): what ``--print-config`` prints.

    Example::

        >>> from omegaconf import OmegaConf
        >>> print(config_text(OmegaConf.create({"out": "runs", "log_dir": "${out}/logs"})), end="")
        out: runs
        log_dir: runs/logs
    """
    import yaml

    from tunesmith.config import plain_config

    return yaml.safe_dump(plain_config(cfg), sort_keys=False)


# ----------------------------------------------------------------------------- running


@contextmanager
def _config_file(recipe: str, cfg) -> Iterator[Path]:
    """``cfg`` written (interpolations kept) to a temporary file whose first line names
    ``recipe``: what ``tunesmith run`` loads, removed afterwards."""
    from omegaconf import OmegaConf

    from tunesmith.cli import catalog

    fd, name = tempfile.mkstemp(prefix=f"tunesmith-{recipe}-", suffix=".yaml")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(catalog.recipe_header(recipe) + "\n" + OmegaConf.to_yaml(cfg))
        yield Path(name)
    finally:
        os.unlink(name)


def cmd_quickstart(args: argparse.Namespace) -> int:
    """Build the config (the recipe's shipped default, the data's format, --config, the
    arguments, the overrides), then print it (--print-config) or run it as `tunesmith run`."""
    from tunesmith.recipes import prepare_run

    quick: QuickRecipe = args.quick
    with _config_file(quick.name, build_config(quick, args)) as path:
        cfg = prepare_run(quick.name, path)[2]  # checked: every problem before anything runs
        if args.print_config:
            print(config_text(cfg), end="")
            return 0
        _announce(quick, args, cfg)
        run_args = argparse.Namespace(**vars(args))
        run_args.recipe, run_args.config, run_args.overrides = quick.name, str(path), []
        return args.run_command(run_args)


def _announce(quick: QuickRecipe, args: argparse.Namespace, cfg) -> None:
    """Say which config runs, the model's backend, and where the config will be saved."""
    from tunesmith.recipes import model_backends

    base = f"{quick.name}/{quick.base(args.lora)}"
    print(f"tunesmith {quick.name}: config {base} with your arguments (--print-config shows it)")
    for line in model_backends(cfg):
        print(f"  {line}")
    saved = saved_config(cfg)
    if saved is None:
        print("  metric_loggers has no JSONLLogger: the run saves no config.yaml")
        return
    print(
        f"  the run saves it as {saved}; run it again with: tunesmith run {quick.name} "
        f"--config {saved} overwrite=true"
    )


def saved_config(cfg) -> Path | None:
    """Where a run of ``cfg`` writes its ``config.yaml``: the folder of its ``JSONLLogger``
    (the shipped configs': ``output_dir``); None when it has none.

    Example::

        >>> from omegaconf import OmegaConf
        >>> saved_config(OmegaConf.create({"metric_loggers": [
        ...     {"_component_": "tunesmith.training.JSONLLogger", "log_dir": "runs/a"}]}))
        PosixPath('runs/a/config.yaml')
    """
    for logger in cfg.get("metric_loggers") or []:
        if str(logger.get("_component_", "")).rpartition(".")[2] == "JSONLLogger":
            return Path(str(logger["log_dir"])) / "config.yaml"
    return None


# ----------------------------------------------------------------------------- the parsers


def add_parsers(sub: Any, run: Callable[[argparse.Namespace], int]) -> None:
    """Register ``sft``, ``dpo`` and ``grpo`` on the ``tunesmith`` subparsers; a built config
    runs through ``run`` (``tunesmith run``'s own command, so one launcher serves both)."""
    for quick in QUICK_RECIPES.values():
        _add_parser(sub, quick, run)


def _add_parser(
    sub: Any, quick: QuickRecipe, run: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    about = (
        f"Quick start: {quick.name} on MODEL_DIR and DATA from the shipped {quick.name}/default "
        f"config (--lora: {quick.name}/default_lora), no config to write; the run saves its "
        f"config as OUTPUT_DIR/config.yaml for `tunesmith run {quick.name} --config`."
    )
    p = sub.add_parser(
        quick.name,
        help=f"Quick start: {quick.name} on MODEL_DIR and DATA with no config to write "
        f"({quick.name}/default; --lora: {quick.name}/default_lora).",
        description=about,
        usage=f"tunesmith {quick.name} [options] [MODEL_DIR] [DATA] [key=value ...]",
    )
    p.set_defaults(func=cmd_quickstart, run_command=run, quick=quick)
    p.set_defaults(nnodes=1, node_rank=None, rdzv_endpoint=None, rdzv_id="tunesmith")
    p.set_defaults(preflight=False)
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="MODEL_DIR DATA key=value",
        help=f"a Hugging Face model folder; DATA: {quick.data_help}; then overrides as for "
        "`tunesmith run` (a.b=value, ~a.b)",
    )
    p.add_argument("--lora", action="store_true", help="LoRA adapters on every linear layer")
    if not quick.rewards:  # rollouts have no epochs: max_steps says how long
        p.add_argument("--epochs", type=int, help="passes over the data")
    length = "the run's length in optimizer steps"
    p.add_argument(
        "--max-steps", type=int, help=length + ("" if quick.rewards else " (not epochs)")
    )
    p.add_argument("--output-dir", help=f"the run's folder (default: outputs/{quick.name}...)")
    p.add_argument(
        "--config",
        help="a YAML file (or shipped config name) of values laid over the default, e.g. "
        f"model_dir, {quick.data_node}.source and output_dir",
    )
    if quick.rewards:
        p.add_argument(
            "--reward",
            action="append",
            choices=list(REWARDS),
            help="a built-in reward (repeat for several, each weighing 1; default: exact_answer)",
        )
        p.add_argument("--answer-column", help="the column of the answers (default: answer)")
        p.add_argument(
            "--tool",
            action="append",
            choices=list(TOOLS),
            help="a built-in tool the policy may call (repeat for several): multi-turn GRPO, "
            "the rewards scoring the final answer",
        )
        p.add_argument(
            "--tool-format",
            choices=TOOL_FORMATS,
            help="how the policy writes tool calls (default: its chat template's)",
        )
    p.add_argument(
        "--print-config", action="store_true", help="check and print the config; run nothing"
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        help="processes (ranks) per node, through torchrun as `tunesmith run`",
    )
    return p
