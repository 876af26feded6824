"""Two "nodes" on loopback: two ``tunesmith run --nnodes 2 --node-rank R --rdzv-endpoint
127.0.0.1:PORT`` launchers (each its own torchrun with one rank), as two machines would start
them, make one world of 2 ranks that trains exactly as one process on the same global batch;
a rank dying on node 1 ends both launchers within a bounded time, node 0 with one clear line.
The slow test puts 2 ranks on each node, ``tp: 2`` inside the nodes and ``dp_replicate: 2``
across them, launched with torchrun's spellings of the flags (``--node_rank``, ...).

Why the runs see the same samples: see ``tests/recipes/test_sft_distributed.py`` (the sampler
draws one permutation from the seed and hands rank r ``perm[r::2]``). With ``--node-rank``
torchrun's static rendezvous numbers the ranks by node (node 1 runs global rank 1), so the
victim of the second test is on node 1 whatever order the launchers start in.

The SLURM example (``examples/slurm/multinode.sbatch``) runs under bash with stand-ins for
``srun``/``scontrol``/``tunesmith``, and each node's ``tunesmith run`` line must parse with the
CLI's own parser into the flags above; every ``tunesmith`` command of ``docs/parallelism.md``
must parse too, its ``parallelism`` overrides making the world it launches.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.recipes.sft_world import (
    assert_same_as_single,
    cli_command,
    free_port,
    make_counting_data,
    make_model_dir,
    run_sft,
    sft_overrides,
    subprocess_env,
)
from tunesmith.cli.main import _torchrun_args, build_parser
from tunesmith.training.parallel.distributed import ParallelDims
from tunesmith.training.settings import LOOP_RULES

REPO = Path(__file__).resolve().parents[2]

PER_RANK, STEPS = 2, 3
TIMEOUT_S = 10  # distributed_timeout_s of the failing run
BOUND_S = TIMEOUT_S + 30  # the last launcher must end this soon after the first one


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("multinode")
    model_dir = make_model_dir(root)
    data = make_counting_data(root / "count.jsonl", rows=24)
    single = run_sft(
        model_dir, data, root / "single", f"batch_size={2 * PER_RANK}", f"max_steps={STEPS}"
    )
    return model_dir, data, single


def _start_nodes(
    overrides: list[str], tmp_path, *flags: str, nproc: int = 1, sep: str = "-"
) -> list[subprocess.Popen]:
    """Node 0 and node 1: one launcher each, ``nproc`` ranks per node, the same rendezvous
    (``sep="_"``: torchrun's spellings of the flags); their console output (stdout and
    stderr) goes to ``tmp_path/node<R>.out``."""
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for node in range(2):
        argv = cli_command(
            *flags,
            "run",
            "sft",
            "--config",
            "tiny",
            f"--nproc{sep}per{sep}node",
            str(nproc),
            "--nnodes",
            "2",
            f"--node{sep}rank",
            str(node),
            f"--rdzv{sep}endpoint",
            endpoint,
            *overrides,
        )
        with open(tmp_path / f"node{node}.out", "w") as out:
            nodes.append(
                subprocess.Popen(argv, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)
            )
    return nodes


def _wait(nodes: list[subprocess.Popen], timeout: float) -> tuple[list[int], list[float]]:
    """The launchers' exit codes and the times (``time.monotonic()``) they exited at; any
    still running after ``timeout`` seconds is killed and the test fails."""
    deadline, ended = time.monotonic() + timeout, [0.0] * len(nodes)
    try:
        while not all(ended) and time.monotonic() < deadline:
            for i, process in enumerate(nodes):
                if not ended[i] and process.poll() is not None:
                    ended[i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for process in nodes:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert all(ended), f"launcher(s) still running after {timeout} s: killed"
    return [process.returncode for process in nodes], ended


def test_two_nodes_on_loopback_equal_one_process(world, tmp_path):
    """2 nodes x 1 rank (FSDP2 over both) == one process on the same global batch."""
    model_dir, data, single = world
    out = tmp_path / "out"
    overrides = sft_overrides(model_dir, data, out, f"batch_size={PER_RANK}", f"max_steps={STEPS}")
    codes, _ = _wait(_start_nodes(overrides, tmp_path), timeout=240)
    outputs = [(tmp_path / f"node{n}.out").read_text() for n in range(2)]
    assert codes == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)
    assert "tunesmith: 2 ranks through torchrun" in outputs[0]
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=2)


@pytest.mark.slow
def test_tp_inside_nodes_and_hsdp_across_them_equal_one_process(world, tmp_path):
    """2 nodes x 2 ranks, ``tp: 2`` inside each node and ``dp_replicate: 2`` across them
    (the layout docs/parallelism.md recommends), launched with torchrun's flag spellings."""
    model_dir, data, single = world
    out = tmp_path / "out"
    overrides = sft_overrides(
        model_dir,
        data,
        out,
        f"batch_size={PER_RANK}",
        f"max_steps={STEPS}",
        "parallelism.tp=2",
        "parallelism.dp_replicate=2",
    )
    codes, _ = _wait(_start_nodes(overrides, tmp_path, nproc=2, sep="_"), timeout=400)
    outputs = [(tmp_path / f"node{n}.out").read_text() for n in range(2)]
    assert codes == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)
    logs = "".join(log.read_text() for log in (out / "logs").glob("torchrun-*.log"))
    assert "mesh of (2, 1, 2) ranks, 2 data-parallel" in logs
    assert_same_as_single(model_dir, single, out, steps=STEPS, ranks=4)


def test_rank_dying_on_the_other_node_ends_both_launchers(world, tmp_path):
    """Node 1's rank SIGKILLs itself at its third loss call (the fault suite's
    ``DieOnCall``): node 1's launcher reports it, node 0's rank sees its collective fail and
    node 0's launcher reports that, each in one line with no traceback on the console."""
    model_dir, data, _ = world
    overrides = sft_overrides(
        model_dir,
        data,
        tmp_path / "out",
        f"batch_size={PER_RANK}",
        "max_steps=50",
        f"distributed_timeout_s={TIMEOUT_S}",
        "loss._component_=tests.faults.components.DieOnCall",
        "loss.call=3",
        "loss.rank=1",
    )
    nodes = _start_nodes(overrides, tmp_path, "--allow-any-component")
    codes, ended = _wait(nodes, timeout=240)
    node0, node1 = ((tmp_path / f"node{n}.out").read_text() for n in range(2))
    assert codes == [1, 1], f"exit codes {codes}\n{node0[-3000:]}\n----\n{node1[-3000:]}"
    after_s = max(ended) - min(ended)  # the first launcher ends right after the death
    assert after_s < BOUND_S, f"the second launcher ended {after_s:.0f} s after the first"

    for output in (node0, node1):
        assert "Traceback" not in output, output[-3000:]
        assert output.splitlines()[-1].startswith("tunesmith: the full output of every rank")
    errors = [line for line in node0.splitlines() if line.startswith("tunesmith: error: ")]
    assert len(errors) == 1, node0[-3000:]
    assert errors[0].startswith(
        "tunesmith: error: rank 0 of 2: a collective operation with the other ranks failed"
    ), errors
    assert "another rank has probably died or hangs" in errors[0]
    errors = [line for line in node1.splitlines() if line.startswith("tunesmith: error: ")]
    assert errors == [
        "tunesmith: error: rank 1 of 2: killed by SIGKILL (signal 9); out of memory? see `dmesg`"
    ], node1[-3000:]


# ---------------------------------------------------------------- the SLURM script and the docs


def _parse_cli(argv: list[str]):
    """``argv`` parsed as :func:`tunesmith.cli.main.main` does (overrides may follow options);
    an unknown flag fails."""
    args, extra = build_parser().parse_known_args(argv)
    assert not [x for x in extra if x.startswith("-")], f"unknown flags {extra} in {argv}"
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(body)
    path.chmod(0o755)


def test_slurm_script_starts_one_launcher_per_node_with_valid_flags(tmp_path):
    """The script under bash: ``srun`` runs its command once per node with that node's
    ``SLURM_NODEID``; ``tunesmith`` records its arguments, which our parser must accept."""
    record = tmp_path / "argv.jsonl"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "scontrol", "#!/bin/bash\nprintf 'gpu-a7\\ngpu-a8\\ngpu-b1\\n'\n")
    _stub(
        bin_dir,
        "srun",
        (
            "#!/bin/bash\nwhile [[ $1 == -* ]]; do shift; done\n"
            'for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit; done\n'
        ),
    )
    _stub(
        bin_dir,
        "tunesmith",
        (
            f"#!{sys.executable}\nimport json, sys\n"
            f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        ),
    )
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_NNODES": "3", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu-a[7-8],gpu-b1", "SLURM_GPUS_ON_NODE": "4"}  # fmt: skip
    script = REPO / "examples" / "slurm" / "multinode.sbatch"
    overrides = ["parallelism.tp=4", "parallelism.dp_replicate=3", "optimizer.lr=1e-5"]
    result = subprocess.run(
        ["bash", str(script), "sft", "my sft.yaml", *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    launches = [json.loads(line) for line in record.read_text().splitlines()]
    assert len(launches) == 3  # one launcher per node
    for node, argv in enumerate(launches):
        args = _parse_cli(argv)
        assert (args.command, args.recipe, args.config) == ("run", "sft", "my sft.yaml")
        assert (args.nproc_per_node, args.nnodes, args.node_rank) == (4, 3, node)
        assert (args.rdzv_endpoint, args.rdzv_id) == ("gpu-a7:29500", "4242")
        assert args.overrides == overrides
        torchrun = _torchrun_args(args)
        assert torchrun[torchrun.index("--rdzv-backend") + 1] == "static"
        assert torchrun[-2:] == ["--node-rank", str(node)]
    usage = subprocess.run(["bash", str(script), "sft"], env=env, capture_output=True, text=True)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
    assert len(record.read_text().splitlines()) == 3  # the usage error launched nothing


def _doc_commands(text: str) -> list[str]:
    """Every ``tunesmith ...`` command line of the markdown's code blocks (a trailing ``#``
    comment dropped, ``\\`` continuations joined)."""
    shell = "\n".join(body for lang, body in _code_blocks(text) if lang in ("", "bash", "sh"))
    lines = [line.strip().removeprefix("$ ") for line in shell.replace("\\\n", " ").split("\n")]
    commands = [line.split(" # ")[0] for line in lines]
    return [c for c in commands if c.startswith("tunesmith ")] + [
        _sbatch_as_run(c) for c in commands if c.startswith("sbatch ")
    ]


def _sbatch_as_run(command: str) -> str:
    """``sbatch --nodes=N .../multinode.sbatch RECIPE CONFIG OVERRIDES...`` as the command the
    script runs on node 0 (8 GPUs a node, the script's default)."""
    words = shlex.split(command)
    nodes = next(w.removeprefix("--nodes=") for w in words if w.startswith("--nodes="))
    at = next(i for i, w in enumerate(words) if w.endswith("multinode.sbatch"))
    recipe, config, *overrides = words[at + 1 :]
    flags = f"--nproc-per-node 8 --nnodes {nodes} --node-rank 0 --rdzv-endpoint head:29500"
    return shlex.join(["tunesmith", "run", recipe, "--config", config, *flags.split(), *overrides])


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """The markdown's fenced code blocks as ``(language, body)``."""
    blocks, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def test_every_command_of_the_parallelism_doc_parses_and_fits_its_world():
    text = (REPO / "docs" / "parallelism.md").read_text()
    commands = _doc_commands(text)
    assert len(commands) >= 10, commands
    for command in commands:
        args = _parse_cli(shlex.split(command)[1:])
        if args.command != "run":
            continue
        world = args.nproc_per_node * args.nnodes
        if args.nnodes > 1:
            assert args.rdzv_endpoint, command
            assert args.node_rank is None or 0 <= args.node_rank < args.nnodes, command
        section = {
            key.removeprefix("parallelism."): yaml.safe_load(value)  # 2 -> int, true -> bool
            for key, _, value in (o.partition("=") for o in args.overrides)
            if key.startswith("parallelism.")
        }
        if section:
            dims = ParallelDims.resolve(section, world_size=world)  # refuses a product != world
            assert dims.world_size == world, command
    yaml_blocks = [body for lang, body in _code_blocks(text) if lang == "yaml"]
    sections = [yaml.safe_load(b)["parallelism"] for b in yaml_blocks if "parallelism:" in b]
    assert sections, "no parallelism: example in the doc"
    for section in sections:
        assert LOOP_RULES["parallelism"].problem(section) is None, section
