"""Every shell command of README.md and docs/*.md, run as written on a tiny model.

The commands are read from the pages' fenced ``bash``/``sh``/``console`` blocks
(:mod:`tests.docs.doc_commands`) and run one by one, each in a process of its own forked from
the suite's fork server (:mod:`tests.forked`), through the console script's function
(``tunesmith.cli.main.main``) with the words bash would pass it; a command that needs a shell
(a pipe, a redirection, a variable) runs through bash, and
:func:`test_the_console_script_runs_through_bash` runs the installed ``tunesmith`` through bash
with the venv's ``bin/`` first on PATH. They run in a workspace that holds what the pages
assume:

- ``models/Qwen3-0.6B``: a tiny Qwen2.5-style model and tokenizer
  (:func:`tests.recipes.sft_world.make_model_dir`) where ``tunesmith download Qwen/Qwen3-0.6B``
  would put the real one; ``models/Qwen3-1.7B``: another (seed 1), the KD teacher;
- ``data.jsonl`` (16 chat rows: 4 steps of the tiny configs' batch of 4), ``chat.jsonl``,
  ``pairs.jsonl`` (preference pairs) and ``prompts.jsonl`` (prompt + answer rows).

Every command is either run or listed in :data:`SKIP` with the reason it cannot run here;
:func:`test_every_command_is_run_or_skipped_with_a_reason` fails on a new command that is
neither, and on a table entry no page holds any more. The tables below are the only places
where a command is changed: :data:`SUBSTITUTE` (empty now: the pages name run folders) and
:data:`CAPS` (overrides appended to keep a run short). The default set runs the README and the
single-process commands in one shared workspace, in page order (README first), so the
commands after a run find what it wrote; the multi-rank commands are marked slow and each runs
in a fresh workspace (``my_sft.yaml`` there is ``sft/tiny`` with ``model_dir`` and
``dataset.source`` filled in, as a user would have edited it).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked
from tests.docs.doc_commands import DocCommand, doc_commands, untagged_blocks
from tests.recipes.preference_world import make_preference_data
from tests.recipes.sft_world import make_chat_data, make_counting_data, make_model_dir
from tests.rl.rl_world import make_prompts
from tunesmith.cli.main import main

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent

# Text to change in a command before it runs (none: the pages name run folders, which mean
# their newest checkpoint whatever the number of steps).
SUBSTITUTE: dict[str, str] = {}

_SFT = "tunesmith run sft --config my_sft.yaml"
_MY = "model_dir=models/Qwen3-0.6B dataset.source=data.jsonl"
_PROMPTS = "--config tiny model_dir=models/Qwen3-0.6B prompts.source=prompts.jsonl"
_ASYNC = f"tunesmith run grpo_async {_PROMPTS}"
_EIGHT = "8 ranks: too many for a CI machine's cores; the same layouts run on 2 and 4 ranks"

# Commands that cannot run here, each with the reason (and what tests it instead).
SKIP: dict[str, str] = {
    "make demo": "the whole demo (minutes): tests/demo/test_demo.py runs `tunesmith demo`",
    "make test": "runs this test suite itself",
    "python train.py": "docs/library.md's script: tests/docs/test_library_page.py writes it to "
    "train.py and runs it (stopped, resumed, uninterrupted)",
    "python train.py --resume": "docs/library.md's script: tests/docs/test_library_page.py",
    "torchrun --standalone --nproc-per-node 2 train.py": "docs/library.md's script on 2 ranks: "
    "tests/docs/test_library_page.py",
    "source .venv/bin/activate": "shell set-up: these tests put the venv's bin/ first on PATH",
    "tunesmith download Qwen/Qwen3-0.6B": "needs the Hub; the workspace holds a tiny model "
    "where it would write (models/Qwen3-0.6B); tests/cli/test_cli.py checks the offline error",
    "tunesmith run grpo --config qwen3_0_6b --nproc-per-node 8": f"{_EIGHT}, and the real model",
    "tunesmith run grpo --config llama3_2_1b prompts.source=gsm8k.jsonl": "the real 1B model "
    "and GSM8K; tests/recipes/test_shipped_configs.py checks the config's keys",
    f"{_SFT} --nproc-per-node 8 parallelism.tp=4 parallelism.sequence_parallel=false": _EIGHT,
    f"{_SFT} --nproc-per-node 8 parallelism.cp=2 parallelism.tp=2": _EIGHT,
    "tunesmith run sft --config my_moe_sft.yaml --nproc-per-node 8 parallelism.ep=8": _EIGHT,
    f"{_SFT} --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0.cluster:29500 "
    "parallelism.tp=4 parallelism.dp_replicate=2": "two nodes of 8 GPUs: "
    "tests/cli/test_multinode.py runs two launchers on loopback",
    f"{_SFT} --nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint node0.cluster:29500 "
    "parallelism.tp=4 parallelism.dp_replicate=2": "two nodes of 8 GPUs: "
    "tests/cli/test_multinode.py runs two launchers on loopback",
    "sbatch --nodes=2 examples/slurm/multinode.sbatch sft my_sft.yaml parallelism.tp=4 "
    "parallelism.dp_replicate=2": "SLURM: tests/cli/test_multinode.py runs the script with "
    "stand-ins for srun",
    "sbatch --nodes=4 examples/slurm/multinode.sbatch dpo my_dpo.yaml parallelism.tp=8": "SLURM "
    "and 32 ranks: tests/cli/test_multinode.py runs the script with stand-ins for srun",
    'pip install -e ".[eval]"': "installs packages; the dev set-up has lm-eval already",
    "tunesmith eval outputs/sft-tiny_lora --tasks hellaswag,arc_easy --batch-size 16": "lm-eval "
    "reads these tasks' data from the Hub; tests/cli/test_eval.py runs a local task",
    "tunesmith eval outputs/sft-tiny --tasks my_task --include-path eval_tasks/ --limit 100 "
    "--num-fewshot 5 --apply-chat-template --output-path results/eval.json": "needs the page's "
    "eval_tasks/ folder (a task over a local JSONL): tests/cli/test_eval.py builds one",
}

_QUICK_SFT = "tunesmith sft models/Qwen3-0.6B data.jsonl"
_QUICK_LORA = f"{_QUICK_SFT} --lora --epochs 3 --output-dir outputs/my-lora"
_ONE_ROW = ("batch_size=1", "gradient_accumulation_steps=1")
_FEW_ROLLOUTS = ("max_steps=2", "prompts_per_step=4", "group_size=2", "generation.max_new_tokens=8")

# Overrides appended to a command (the RL configs' 10 steps of generation take a while).
CAPS: dict[str, tuple[str, ...]] = {
    f"tunesmith run grpo {_PROMPTS}": ("max_steps=2",),
    f"tunesmith run ppo {_PROMPTS}": ("max_steps=2",),
    _ASYNC: ("max_steps=2",),
    # a resume across layouts: the first run stops early so that the others have steps left
    f"{_SFT} --nproc-per-node 4 parallelism.tp=2 batch_size=2": ("stop_after_steps=2",),
    f"{_SFT} --nproc-per-node 2 parallelism.tp=1 batch_size=2 resume=true": ("stop_after_steps=3",),
    # the quick start's defaults are a real model's (2 x 8 packed rows of 2048 tokens a step;
    # 500 GRPO steps of 32 x 8 completions): here one row a step, a few short rollouts
    _QUICK_SFT: _ONE_ROW,
    _QUICK_LORA: _ONE_ROW,
    "tunesmith dpo models/Qwen3-0.6B pairs.jsonl --lora": (*_ONE_ROW, "max_steps=2"),
    "tunesmith grpo models/Qwen3-0.6B prompts.jsonl --reward math_answer": _FEW_ROLLOUTS,
}

# Multi-rank commands: slow (each rank imports torch); each in a fresh workspace, except the
# documented resume across layouts, whose three commands share one (in page order).
SLOW: set[str] = {
    f"{_SFT} {_MY} output_dir=outputs/fsdp2 --nproc-per-node 2",
    f"{_SFT} {_MY} output_dir=outputs/hsdp --nproc-per-node 4 parallelism.dp_replicate=2 "
    "parallelism.dp_shard=2",
    f"{_SFT} {_MY} output_dir=outputs/tp --nproc-per-node 4 parallelism.tp=2",
    f"{_SFT} --nproc-per-node 2 parallelism.tp=2",
    f"{_SFT} --nproc-per-node 4 parallelism.tp=2",
    f"{_SFT} --nproc-per-node 4 parallelism.tp=2 parallelism.dp_replicate=2",
    f"{_SFT} --nproc-per-node 2 parallelism.cp=2",
    "tunesmith run dpo --config my_dpo.yaml --nproc-per-node 4 parallelism.cp=4",
    "tunesmith run sft --config my_moe_sft.yaml --nproc-per-node 4 parallelism.ep=2",
    _ASYNC,  # starts a local Ray cluster
    *(c for c in CAPS if "batch_size=" in c),
    f"{_SFT} parallelism.tp=1 batch_size=4 resume=true",
}
SHARED_SLOW = [c for c in CAPS if "batch_size=" in c] + [
    f"{_SFT} parallelism.tp=1 batch_size=4 resume=true"
]

# What a command must leave behind (besides exiting 0), checked in its workspace.
FILES: dict[str, list[str]] = {
    "tunesmith cp sft/tiny my_sft.yaml": ["my_sft.yaml"],
    f"{_SFT} {_MY}": ["outputs/sft-tiny/checkpoints/step_000004/model.safetensors"],
    "tunesmith plot outputs/sft-tiny": ["outputs/sft-tiny/loss.png"],
    _QUICK_SFT: ["outputs/sft/config.yaml", "outputs/sft/checkpoints/step_000001/config.json"],
    _QUICK_LORA: ["outputs/my-lora/checkpoints/step_000003/adapter_model.safetensors"],
    "tunesmith export outputs/sft-tiny_lora --output-dir merged": [
        "merged/config.json",
        "merged/model.safetensors",
    ],
}
# Text a command must print.
PRINTS: dict[str, list[str]] = {
    "tunesmith ls": ["sft ", "dpo ", "grpo "],
    "tunesmith ls --models": ["qwen3_moe ", "olmo2 ", "gemma3_1b"],
    "tunesmith cat my_sft.yaml optimizer.lr=1e-4": ["lr: 0.0001", "folder: ${model_dir}"],
    f"tunesmith validate my_sft.yaml {_MY}": ["my_sft.yaml: OK"],
    f"{_QUICK_SFT} --print-config": ["source: data.jsonl", "format: messages"],
}


def _commands() -> list[DocCommand]:
    return doc_commands(PAGES, REPO)


def _unique(commands: list[DocCommand]) -> list[DocCommand]:
    """First occurrence of each command text (README first): a command shown on two pages
    runs once."""
    seen: set[str] = set()
    out = []
    for command in commands:
        if command.text not in seen:
            seen.add(command.text)
            out.append(command)
    return out


def test_every_fenced_block_says_what_it_holds():
    untagged = {p.name: lines for p in PAGES if (lines := untagged_blocks(p.read_text()))}
    assert not untagged, (
        f"fenced blocks without a language (page: opening lines): {untagged}; tag commands "
        "`bash` (or `console` for a transcript with `$ ` lines) and anything else `text`, "
        "`yaml`, ..."
    )


def test_every_command_is_run_or_skipped_with_a_reason():
    commands = {c.text for c in _commands()}
    assert len(commands) >= 20, commands
    tables = {"SKIP": set(SKIP), "CAPS": set(CAPS), "SLOW": SLOW, "FILES": set(FILES),
              "PRINTS": set(PRINTS)}  # fmt: skip
    stale = {name: sorted(keys - commands) for name, keys in tables.items() if keys - commands}
    assert not stale, f"table entries that no page shows any more: {stale}"
    assert not set(SKIP) & SLOW, "a command is either skipped or run"
    others = sorted(c for c in commands if not c.startswith("tunesmith ") and c not in SKIP)
    assert not others, f"only `tunesmith` commands run here; give these a SKIP reason: {others}"
    assert all(len(reason) > 10 for reason in SKIP.values())


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The folders and files the pages assume (see the module docstring), built once."""
    root = tmp_path_factory.mktemp("docs_world")
    build = root / "_build"
    (root / "models").mkdir()
    shutil.copytree(make_model_dir(build / "student"), root / "models" / "Qwen3-0.6B")
    shutil.copytree(make_model_dir(build / "teacher", seed=1), root / "models" / "Qwen3-1.7B")
    shutil.rmtree(build)
    make_counting_data(root / "data.jsonl", rows=16)
    make_chat_data(root / "chat.jsonl", rows=8)
    make_preference_data(root / "pairs.jsonl", rows=8)
    make_prompts(root / "prompts.jsonl", rows=8)
    return root


def _workspace(world: Path, path: Path) -> Path:
    """A fresh folder with the world's models and data files (links: nothing is copied)."""
    path.mkdir(parents=True)
    for item in world.iterdir():
        (path / item.name).symlink_to(item, target_is_directory=item.is_dir())
    return path


def _env() -> dict[str, str]:
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


SHELL_SYNTAX = re.compile(r"[|&;<>$`\\(){}*?~]")
"""Characters that make a command line more than words for ``tunesmith`` (pipes, redirections,
variables, globs...): such a line runs through bash."""


def execute(text: str, cwd: Path, timeout: float = 600) -> tuple[int, str]:
    """Run the command line ``text`` in ``cwd`` as a user would and return its exit code and
    output (stdout, then stderr): a plain ``tunesmith ...`` line in a forked child calling the
    console script's function with the words bash would pass it, anything else through bash.

    Example::

        execute("tunesmith ls", tmp_path)  # -> (0, 'sft ...')
    """
    if text.startswith("tunesmith ") and not SHELL_SYNTAX.search(text.replace('"', "")):
        result = forked.run_cli(shlex.split(text)[1:], cwd=cwd, env=_env(), timeout=timeout)
    else:
        result = subprocess.run(
            ["bash", "-c", text],
            cwd=cwd,
            env=_env(),
            capture_output=True,
            stdin=subprocess.DEVNULL,
            text=True,
            timeout=timeout,
        )
    return result.returncode, result.stdout + result.stderr


def test_the_console_script_runs_through_bash(tmp_path):
    """The installed ``tunesmith`` console script, started by bash from the venv's ``bin/``,
    prints what the function the other cases call prints."""
    result = subprocess.run(
        ["bash", "-c", "tunesmith ls"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout + result.stderr == execute("tunesmith ls", tmp_path)[1]
    assert "sft " in result.stdout


def _run(command: DocCommand, cwd: Path, timeout: float = 600) -> list[str]:
    """Run ``command`` as written (with its :data:`SUBSTITUTE` and :data:`CAPS`) in ``cwd``;
    the problems found, each naming the page line (empty when it did what the page says)."""
    text = command.text
    for old, new in SUBSTITUTE.items():
        text = text.replace(old, new)
    text = " ".join([text, *CAPS.get(command.text, ())])
    returncode, output = execute(text, cwd, timeout)
    where = f"{command} (ran: {text})"
    if command.shown_output:  # a transcript: the same lines, in the same order
        shown = [line for line in command.shown_output if line.strip()]
        printed = [line for line in output.splitlines() if line.strip()]
        if printed != shown:
            return [f"{where}\n  the page shows:\n    " + "\n    ".join(shown)
                    + "\n  it printed:\n    " + "\n    ".join(printed)]  # fmt: skip
        return []
    if returncode != 0:
        return [f"{where}: exit code {returncode}\n{output[-3000:]}"]
    problems = [
        f"{where}: {path} is missing"
        for path in FILES.get(command.text, [])
        if not (cwd / path).exists()
    ]
    problems += [
        f"{where}: did not print {text!r}\n{output[-2000:]}"
        for text in PRINTS.get(command.text, [])
        if text not in output
    ]
    return problems


def test_readme_and_docs_commands_run_as_written(world, tmp_path):
    """Every single-process command, in page order (README first), in one workspace; after
    the README, ``my_sft.yaml`` is the edited copy the docs pages assume."""
    workspace = _workspace(world, tmp_path / "ws")
    problems: list[str] = []
    commands = [
        c
        for c in _unique(_commands())
        if c.text.startswith("tunesmith ") and c.text not in SKIP and c.text not in SLOW
    ]
    assert any(c.text.startswith("tunesmith run sft") for c in commands)
    edited = False
    for command in commands:
        if command.file != "README.md" and not edited:
            _edited_configs(workspace)
            edited = True
        problems += _run(command, workspace)
    assert not problems, "\n\n".join(problems)


def _edited_configs(workspace: Path) -> None:
    """``my_sft.yaml``, ``my_dpo.yaml``, ``my_moe_sft.yaml``: the shipped tiny configs copied
    with ``tunesmith cp`` and their required values filled in, as the pages assume."""
    edits = [("sft/tiny", "my_sft.yaml", "Qwen3-0.6B", "data.jsonl"),
             ("dpo/tiny", "my_dpo.yaml", "Qwen3-0.6B", "pairs.jsonl"),
             ("sft/tiny", "my_moe_sft.yaml", "moe", "data.jsonl")]  # fmt: skip
    for source, name, model, data in edits:
        code, output = execute(f"tunesmith cp --force {source} {name}", workspace)
        assert code == 0, output
        path = workspace / name
        text = path.read_text()
        text = text.replace("model_dir: ???", f"model_dir: models/{model}")
        path.write_text(text.replace("source: ???", f"source: {data}"))


@pytest.fixture(scope="module")
def moe_world(world, tmp_path_factory) -> Path:
    """The world plus ``models/moe``: a tiny Qwen3-MoE model with the same tokenizer."""
    import torch

    from tests.data.tokenizer_factory import make_tokenizer_folder
    from tunesmith.data import Tokenizer
    from tunesmith.models import build_model
    from tunesmith.models.hf import save_hf_checkpoint
    from tunesmith.models.zoo import qwen3_moe

    tok_dir = make_tokenizer_folder(tmp_path_factory.mktemp("docs_moe") / "tokenizer", "qwen2_5")
    vocab = Tokenizer.from_pretrained(tok_dir).vocab_size
    torch.manual_seed(0)
    model = build_model(qwen3_moe.spec("qwen3_moe_tiny", vocab_size=vocab))
    save_hf_checkpoint(model, world / "models" / "moe", source_dir=tok_dir)
    return world


@pytest.mark.slow
def test_multi_rank_commands_run_as_written(world, moe_world, tmp_path):
    """Every multi-rank command (2 or 4 local gloo ranks through torchrun), each in a fresh
    workspace; the documented resume across layouts in one, in page order."""
    problems: list[str] = []
    commands = [c for c in _unique(_commands()) if c.text in SLOW]
    assert len(commands) == len(SLOW), sorted(SLOW - {c.text for c in commands})
    shared = None
    for i, command in enumerate(commands):
        if command.text in SHARED_SLOW and shared is not None:
            workspace = shared
        else:
            workspace = _workspace(moe_world, tmp_path / f"ws{i}")
            _edited_configs(workspace)
            if command.text in SHARED_SLOW:
                shared = workspace
        problems += _run(command, workspace)
    assert not problems, "\n\n".join(problems)


def _override_table() -> list[str]:
    """The overrides of the README's "override | meaning" table (its code spans)."""
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("| override | meaning |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows += re.findall(r"`([^`]+)`", line.split("|")[1])
    return rows


def test_every_override_of_the_readme_table_works_on_the_copied_config(world, tmp_path, capsys):
    """Each row on `sft/tiny` (what the README's `my_sft.yaml` is a copy of), validated through
    the CLI with the quick start's values; the shell quoting of a row is removed as bash would."""
    overrides = _override_table()
    assert len(overrides) >= 7, overrides
    given = [
        f"model_dir={world / 'models' / 'Qwen3-0.6B'}",
        f"dataset.source={world / 'data.jsonl'}",
    ]
    for override in overrides:
        words = shlex.split(override)
        assert main(["validate", "sft/tiny", *given, *words]) == 0, (override, capsys.readouterr())
        assert capsys.readouterr().out.splitlines()[0] == "tiny.yaml: OK"
