"""The RL tests' world: a tiny policy folder (``tests.recipes.sft_world.make_model_dir``),
addition prompts with answers, and a dense test reward so that every group's rewards differ
and every step has a gradient (a tiny random model is never right, so an answer check alone
would give all-zero advantages)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tests.recipes.sft_world import _any_component_allowed, launch_ranks
from tunesmith.config import load_config
from tunesmith.recipes import config_path
from tunesmith.rl.rewards import Sample

DIGIT_REWARD = "tests.rl.rl_world.DigitFraction"


def make_prompts(path: Path, rows: int = 32, seed: int = 0) -> Path:
    """JSONL of ``{"prompt": "add A and B", "answer": "A+B"}`` rows."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"add {a} and {b}", "answer": str(a + b)}) + "\n")
    return path


class DigitFraction:
    """The fraction of a completion's characters that are digits (0 for an empty one)."""

    name = "digits"

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [
            sum(ch.isdigit() for ch in s.completion) / len(s.completion) if s.completion else 0.0
            for s in samples
        ]


EVEN_FLAT_REWARD = "tests.rl.rl_world.FlatOnEvenAnswers"


class FlatOnEvenAnswers:
    """0.5 for every completion of a prompt whose answer is even (a group with no signal, for
    dynamic sampling to replace), the completion's length / 100 otherwise."""

    name = "even_flat"

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [0.5 if int(s.answer) % 2 == 0 else len(s.completion) / 100 for s in samples]


def grpo_overrides(model_dir: Path, prompts: Path, output_dir: Path, *extra: str) -> list[str]:
    """The tiny GRPO config pointed at this world, scored by :class:`DigitFraction`."""
    return [
        f"model_dir={model_dir}", f"prompts.source={prompts}", f"output_dir={output_dir}",
        "progress_bar=false", f"rewards.rewards={{digits: {{_component_: {DIGIT_REWARD}}}}}",
        *extra,
    ]  # fmt: skip


def run_rl(recipe: str, config: str, overrides: Sequence[str], *, model: Any = None) -> None:
    """Run ``recipe`` on its shipped ``config`` in this process with one torch thread (as the
    ranks and the rollout workers of other tests), test components allowed; ``model``:
    another model node."""
    cfg = load_config(config_path(config, recipe), list(overrides))
    if model is not None:
        cfg.model = model
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _any_component_allowed():  # the test rewards live in tests/
            importlib.import_module(f"tunesmith.recipes.{recipe}").main(cfg)
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def ray_temp_dir() -> Iterator[str]:
    """A temp folder for a Ray instance of a test's own, short (Ray's socket paths must stay
    short), removed afterwards."""
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    try:
        yield temp
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def local_ray(num_cpus: int = 4) -> Iterator[None]:
    """A local Ray instance of a test module's own (runs in the test process join it), in a
    :func:`ray_temp_dir`, its workers allowed the test rewards; shut down afterwards."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with ray_temp_dir() as temp:
        with _any_component_allowed():  # the workers start with the test reward allowed
            ray.init(
                num_cpus=num_cpus, _temp_dir=temp, include_dashboard=False, log_to_driver=False
            )
        try:
            yield
        finally:
            ray.shutdown()


def launch_async_ranks(overrides: Sequence[str], log_dir: Path) -> None:
    """``grpo_async`` on 2 torchrun ranks (:func:`tests.recipes.sft_world.launch_ranks`) with
    a Ray instance of the run's own in a :func:`ray_temp_dir`, the test components allowed in
    the ranks and their workers."""
    with ray_temp_dir() as temp, _any_component_allowed():  # inherited by ranks and workers
        launch_ranks(
            [*overrides, f"ray.temp_dir={temp}"], log_dir, recipe="grpo_async", timeout=300
        )


def run_killing_the_rollout_worker(
    overrides: Sequence[str], log: Path, *, delay_s: float = 0.0
) -> int:
    """``tunesmith run grpo_async --config tiny OVERRIDES`` (its output in ``log``) as a
    child of the fork server (:mod:`tests.forked`: the CLI in a process of its own), its
    rollout worker SIGKILLed ``delay_s`` after step 1 is logged (batch 2 is being sampled);
    waits for the run to end (it must exit 0) and returns the killed pid."""
    import re
    import signal

    from tests import forked
    from tunesmith.config import ALLOW_ANY_COMPONENT_ENV

    env = {**os.environ, "OMP_NUM_THREADS": "1", ALLOW_ANY_COMPONENT_ENV: "1",
           "RAY_AUTH_MODE": "disabled"}  # fmt: skip
    log.touch()
    argv = ["run", "grpo_async", "--config", "tiny", *overrides]
    process = forked.Child.cli(argv, log, env=env)
    lines: list[str] = []
    killed = pid = None
    try:
        for line in follow(log, process, timeout=300):
            lines.append(line)
            found = re.search(r"rollout workers \(pids \[(\d+)", line)
            if found:
                pid = int(found.group(1))
            if line.startswith("step 1/") and killed is None and pid is not None:
                time.sleep(delay_s)
                os.kill(pid, signal.SIGKILL)
                killed = pid
        assert process.wait(timeout=10) == 0, "".join(lines)
    finally:
        process.kill()
    assert killed is not None, "".join(lines)
    return killed


def follow(log: Path, process: Any, *, timeout: float) -> Iterator[str]:
    """The lines of ``log`` as ``process`` (a :class:`tests.forked.Child`) writes them, until
    it exits (past ``timeout`` s the test fails)."""
    deadline, pending = time.monotonic() + timeout, ""
    with open(log) as f:
        while True:
            ended = process.poll() is not None  # read once more after the exit
            pending += f.read()
            *lines, pending = pending.split("\n")
            yield from (line + "\n" for line in lines)
            if ended:
                break
            assert time.monotonic() < deadline, f"still running after {timeout} s: {log}"
            time.sleep(0.05)
    if pending:
        yield pending
