"""``tunesmith data``: look at a config's dataset before training on it.

``tunesmith data preview --config CONFIG [overrides] [--n 3]`` checks the config's tokenizer
and dataset as ``tunesmith validate`` does (:func:`check_preview`), builds them (as the recipe
does) and prints the dataset's report, a few samples with the trained tokens marked (colour on
a terminal, ``[[...]]`` otherwise), truncation stats and a histogram of the sample lengths
(see :mod:`tunesmith.data.preview`).

Example::

    $ tunesmith data preview --config sft/tiny model_dir=models/tiny dataset.source=chat.jsonl
    $ tunesmith data preview --config my_sft.yaml --n 5 --random --color never
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Any

__all__ = ["PREVIEWED", "add_parser", "check_preview", "cmd_data_preview", "use_color"]


def use_color(choice: str, stream: Any = None) -> bool:
    """Whether to colour: ``"always"``, ``"never"``, or ``"auto"`` (on a terminal, unless the
    ``NO_COLOR`` environment variable is set).

    Example::

        >>> use_color("never"), use_color("always")
        (False, True)
    """
    if choice not in ("auto", "always", "never"):
        raise ValueError(f"--color must be auto, always or never, got {choice!r}")
    if choice != "auto":
        return choice == "always"
    stream = sys.stdout if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def cmd_data_preview(args: argparse.Namespace) -> int:
    """Render a few samples of a config's dataset (trained tokens marked), token counts,
    truncation stats and the length histogram."""
    from tunesmith.cli import catalog
    from tunesmith.config import instantiate, load_config
    from tunesmith.config.nodes import has_key
    from tunesmith.data.preview import preview
    from tunesmith.training.settings import value_of

    if args.n < 1 or args.bins < 1:
        raise ValueError(f"--n and --bins must be >= 1, got --n {args.n}, --bins {args.bins}")
    cfg = load_config(catalog.config_path(args.config), args.overrides)
    if not has_key(cfg, "dataset") or cfg.get("dataset") is None:
        raise ValueError(f"{args.config}: the config has no dataset to preview")
    check_preview(cfg)
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    size = len(dataset)
    if args.random:
        indices = random.Random(int(value_of(cfg, "seed"))).sample(range(size), min(args.n, size))
    else:
        indices = list(range(min(args.n, size)))
    color = use_color(args.color)
    text = preview(tokenizer, dataset, indices=indices, color=color, bins=args.bins)
    sys.stdout.write(text)
    return 0


PREVIEWED = ("tokenizer", "dataset")
"""The keys ``data preview`` builds: the tokenizer, then the dataset given it."""


def check_preview(cfg: Any) -> None:
    """Check what ``data preview`` builds (:data:`PREVIEWED`) as ``tunesmith validate`` checks
    it, before anything is read: one ``ConfigError`` listing every problem, the ``???`` values
    they use (``model_dir``) included.

    Example::

        >>> from tunesmith.config import load_config
        >>> from tunesmith.cli import catalog
        >>> check_preview(load_config(catalog.config_path("sft/tiny")))
        Traceback (most recent call last):
        tunesmith.config.errors.ConfigError: model_dir: value is missing (???); ...
        dataset.source: value is missing (???); set it in the config or with an override
    """
    from tunesmith.config import ConfigError, validate_config

    issues = validate_config(cfg, runtime_args={"dataset": 1}, keys=PREVIEWED)
    if issues:
        raise ConfigError.from_issues(issues)


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``data`` (with its ``preview`` subcommand) on the ``tunesmith`` subparsers."""
    about = "look at a config's dataset before training on it"
    data = sub.add_parser("data", help=about, description=about)
    commands = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    doc = (cmd_data_preview.__doc__ or "").strip()
    p = commands.add_parser("preview", help=doc, description=doc)
    p.set_defaults(func=cmd_data_preview)
    p.add_argument("--config", required=True, help="config name or path to a .yaml file")
    p.add_argument("--n", type=int, default=3, help="samples to render (default 3)")
    p.add_argument(
        "--random",
        action="store_true",
        help="render N samples drawn with the config's seed, not the first N",
    )
    p.add_argument("--bins", type=int, default=10, help="bins of the length histogram")
    p.add_argument(
        "--color",
        choices=("auto", "always", "never"),
        default="auto",
        help="mark trained tokens in colour (auto: on a terminal) or [[brackets]]",
    )
    p.add_argument("overrides", nargs="*", help="overrides: a.b=value, ~a.b (delete), a=pkg.Cls")
    return p
