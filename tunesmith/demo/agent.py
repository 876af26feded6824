"""``tunesmith demo agent``: a tiny model learns by GRPO to call a calculator tool for products
it cannot compute in its head, against the same GRPO run with the tool answering errors.

The task: multiply two ``digits``-digit numbers (``"What is 482*617?"``), answered by the exact
product. A tiny, randomly initialised Qwen2.5-style model cannot multiply 3-digit numbers, but
it can copy digits: a reply ``CALL calculator {"expression": "482*617"}`` (the ``plain``
tool-call format, stated in a short system prompt) gets the product back as a ``tool``
message, and copying it (``Answer: 297394``) is the answer. Steps:

1. the local world under the output folder: ``data/traces.jsonl`` (``num_traces`` SFT rows:
   user, the assistant's call, the tool's result, the assistant's answer; after the first
   ``direct_from`` share of the rows, a ``direct_fraction`` of them answer at once instead),
   ``data/prompts.jsonl`` (RL prompts) and ``data/held_out_prompts.jsonl``, a byte-level BPE
   tokenizer trained on the traces' chat text (:func:`~tunesmith.demo.assets.build_tokenizer`)
   and a random base model (:data:`AGENT_MODEL`);
2. the SFT warm-up on the traces in file order, ``tunesmith run sft --config demo_agent``:
   the tool-use traces first teach the copying (the question into the call, the result into
   the answer), the mixed ones last leave the warm-up answering at once (its first reply is
   ``Answer: ...`` in about 2 of 3 samples, so greedily always), and those answers are wrong;
3. GRPO, ``tunesmith run grpo --config demo_agent``: an ``environment:`` of
   :class:`~tunesmith.rl.envs.ToolEnv` with the :class:`~tunesmith.rl.envs.Calculator`
   (``describe_tools: false``: the system prompt states the tool, not the template's long
   tools block); the final answer scores 1 when its last number is the product, else 0 (no
   partial credit, which would reward close guesses): what GRPO can learn is the decision
   to call;
4. the **control**: the same GRPO run from the same warm-up with the calculator replaced by
   :class:`~tunesmith.rl.envs.Unavailable`, which answers every call with an error (same
   prompts, format, turns, token budget, rewards and seed: only the tool's information is
   gone);
5. held-out accuracy (greedy trajectories, exact final answer) of the warm-up and of the
   GRPO checkpoint with the calculator, and of the control checkpoint without it.

What it shows at its default size (benchmarks/results/agent_demo.md, seeds 0-2, about 4
minutes a seed on one core): the warm-up answers every held-out question at once (0%); GRPO
with the calculator learns to call it for every question (98-100%); the control, whose
calls get errors, has no reward to learn from and stays at 0%.

Example::

    result = run_agent_demo("outputs/demo_agent", threads=1)
    result.accuracy_before, result.accuracy_after, result.accuracy_without_tool
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tunesmith.config import instantiate
from tunesmith.data import Tokenizer
from tunesmith.demo.assets import DEFAULT_MODEL, build_base_model, build_tokenizer
from tunesmith.demo.rl import split_overrides
from tunesmith.demo.run import run_to_checkpoint
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.models import from_hf
from tunesmith.recipes import prepare_run
from tunesmith.rl.envs import EpisodeSettings, ToolEnv, Trajectory
from tunesmith.rl.envs.trajectory import sample_trajectories
from tunesmith.rl.prompts import Prompt
from tunesmith.rl.setup import plain

__all__ = [
    "ACCURACY_REWARD",
    "AGENT_MODEL",
    "ANSWER_PREFIX",
    "CONFIG",
    "NO_TOOL",
    "SYSTEM_PROMPT",
    "WARMUP_CONFIG",
    "AgentDemoData",
    "AgentDemoResult",
    "AgentDemoSettings",
    "Product",
    "agent_accuracy",
    "called_tool",
    "make_products",
    "read_prompts",
    "run_agent_demo",
    "summary",
    "write_agent_data",
]

CONFIG = WARMUP_CONFIG = "demo_agent"
"""The configs: ``sft/demo_agent.yaml`` (warm-up) and ``grpo/demo_agent.yaml`` (GRPO)."""
ACCURACY_REWARD = "correct"
"""The environment's reward term that is accuracy (1 for the exact product, else 0)."""
SYSTEM_PROMPT = 'To multiply, reply CALL calculator {"expression": "A*B"}, then Answer: its result.'
"""The system prompt: the tool and its call format (in place of the template's tools block)."""
ANSWER_PREFIX = "Answer: "
"""The final answer's start, after the tool's result or at once: the first reply's first token
is the decision, ``C`` (``CALL``) or ``A`` (``Answer``)."""
NO_TOOL = "environment.tools.0._component_=tunesmith.rl.envs.Unavailable"
"""The override that turns the GRPO run into the control (the calculator answers errors)."""
AGENT_MODEL: dict[str, Any] = {**DEFAULT_MODEL, "rope_theta": 30.0}
"""The demo's base model: the demos' tiny size with a RoPE base of 30 instead of Qwen's 1e6: the
copying (attending a fixed number of tokens back) is then learned within the warm-up's
tool-use traces on seeds 0-2; at 1e6 it was a late, seed-dependent phase transition, at 100 or
10 it missed on one seed of three (benchmarks/results/agent_demo.md)."""
SFT_DIR, GRPO_DIR, CONTROL_DIR = "sft", "grpo", "grpo_no_tool"
TRACES, PROMPTS, HELD_OUT = "traces.jsonl", "prompts.jsonl", "held_out_prompts.jsonl"
MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------- task


@dataclass(frozen=True)
class Product:
    """One question: ``a * b``; the reply is the calculator call, then the product.

    Example::

        >>> p = Product(12, 34)
        >>> p.answer, p.call, p.reply
        ('408', 'CALL calculator {"expression": "12*34"}', 'Answer: 408')
        >>> [m["role"] for m in p.messages()]
        ['system', 'user', 'assistant', 'tool', 'assistant']
    """

    a: int
    b: int

    @property
    def answer(self) -> str:
        return str(self.a * self.b)

    @property
    def reply(self) -> str:
        """The assistant's final answer (after the tool's result, or at once)."""
        return ANSWER_PREFIX + self.answer

    @property
    def call(self) -> str:
        """The assistant's tool call in the ``plain`` format."""
        return "CALL calculator " + json.dumps({"expression": f"{self.a}*{self.b}"})

    def prompt_messages(self) -> list[dict[str, str]]:
        """The conversation up to the assistant's first turn."""
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"What is {self.a}*{self.b}?"},
        ]

    def direct_messages(self) -> list[dict[str, str]]:
        """A trace that answers at once, without the tool (an SFT row)."""
        return [*self.prompt_messages(), {"role": "assistant", "content": self.reply}]

    def messages(self) -> list[dict[str, str]]:
        """A whole tool-use trace (an SFT row): the call, the tool's result, the answer."""
        return [
            *self.prompt_messages(),
            {"role": "assistant", "content": self.call},
            {"role": "tool", "name": "calculator", "content": self.answer},
            {"role": "assistant", "content": self.reply},
        ]


def make_products(
    count: int, digits: int, seed: int, *, full_length: bool = False
) -> list[Product]:
    """``count`` distinct products of two ``digits``-digit numbers; ``full_length``: only those
    whose product has ``2 * digits`` digits (every result and answer the same length).

    >>> make_products(2, 3, seed=0)
    [Product(a=964, b=494), Product(a=876, b=530)]
    >>> [len(p.answer) for p in make_products(50, 2, seed=0, full_length=True)] == [4] * 50
    True
    """
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    low, high = 10 ** (digits - 1), 10**digits - 1
    smallest = 10 ** (2 * digits - 1) if full_length else 0
    possible = sum(high - max(low, -(-smallest // a)) + 1 for a in range(low, high + 1))
    if count > possible:
        kind = f"{2 * digits}-digit products" if full_length else "products"
        raise ValueError(
            f"{count} distinct {kind} of {digits}-digit numbers requested, only {possible} exist"
        )
    rng, drawn = random.Random(seed), {}
    while len(drawn) < count:  # a dict keeps the order drawn
        product = Product(rng.randint(low, high), rng.randint(low, high))
        if product.a * product.b >= smallest:
            drawn.setdefault(product, None)
    return list(drawn)


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class AgentDemoSettings:
    """Sizes of the task and the model, and the seed (data, model and every run).

    ``num_traces`` problems become SFT traces (in the warm-up's order: ``sft/demo_agent.yaml``
    reads them once, unshuffled), ``num_prompts`` RL prompts, ``num_held_out`` are never
    trained on; ``digits``: of each factor; ``full_length``: only products of ``2 * digits``
    digits, so every result sits at the same place. After the first ``direct_from`` share of
    the traces, a ``direct_fraction`` of them answer at once (the right product, without the
    tool), the others call the calculator: the warm-up answers new questions at once.
    """

    seed: int = 0
    digits: int = 3
    full_length: bool = True
    num_traces: int = 19200
    direct_from: float = 0.75
    direct_fraction: float = 0.65
    num_prompts: int = 2000
    num_held_out: int = 200
    vocab_size: int = 320
    model: dict[str, Any] = field(default_factory=lambda: dict(AGENT_MODEL))


@dataclass(frozen=True)
class AgentDemoData:
    """The demo's files (see :func:`write_agent_data`)."""

    root: Path
    model_dir: Path
    traces_file: Path
    prompts_file: Path
    held_out_file: Path

    @classmethod
    def under(cls, root: str | os.PathLike[str]) -> AgentDemoData:
        root = Path(root)
        data = root / "data"
        return cls(root, root / "base_model", data / TRACES, data / PROMPTS, data / HELD_OUT)


def _write_rows(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def _prompt_row(product: Product) -> dict[str, Any]:
    return {"prompt": product.prompt_messages(), "answer": product.answer}


def write_agent_data(
    root: str | os.PathLike[str], settings: AgentDemoSettings, *, force: bool = False
) -> AgentDemoData:
    """Write (or reuse, when built with the same ``settings``) the traces, the prompts, the
    tokenizer (trained on the traces' chat text of every training problem) and the base model.

    Example::

        >>> data = write_agent_data("outputs/demo_agent", AgentDemoSettings(
        ...     num_traces=4, num_prompts=8, num_held_out=2))
        >>> json.loads(data.prompts_file.read_text().splitlines()[0])["prompt"][1]["role"]
        'user'
    """
    data = AgentDemoData.under(root)
    recorded = asdict(settings)
    if not force and _manifest(data.root) == recorded:
        return data
    products = make_products(
        settings.num_traces + settings.num_prompts + settings.num_held_out,
        settings.digits,
        settings.seed,
        full_length=settings.full_length,
    )
    held_out, train = products[: settings.num_held_out], products[settings.num_held_out :]
    traces = train[: settings.num_traces]
    _write_rows(_traces(traces, settings.direct_fraction, settings.direct_from), data.traces_file)
    _write_rows(map(_prompt_row, train[settings.num_traces :]), data.prompts_file)
    _write_rows(map(_prompt_row, held_out), data.held_out_file)
    tokenizer_dir = build_tokenizer(data.root / "tokenizer", train, settings.vocab_size)
    build_base_model(data.model_dir, tokenizer_dir, seed=settings.seed, **settings.model)
    (data.root / MANIFEST).write_text(json.dumps(recorded, indent=2), encoding="utf-8")
    return data


def _traces(
    products: Sequence[Product], direct_fraction: float, direct_from: float = 0.0
) -> Iterable[dict[str, Any]]:
    """SFT rows: every product's tool-use trace, except a ``direct_fraction`` of those after
    the first ``direct_from`` share of the rows (spread evenly) that answer at once."""
    for name, value in (("direct_fraction", direct_fraction), ("direct_from", direct_from)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    start = round(len(products) * direct_from)
    for i, product in enumerate(products):
        j = i - start
        direct = j >= 0 and int((j + 1) * direct_fraction) > int(j * direct_fraction)
        yield {"messages": product.direct_messages() if direct else product.messages()}


def _manifest(root: Path) -> Any:
    try:
        return json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def read_prompts(path: str | os.PathLike[str]) -> list[Prompt]:
    """The prompt rows of ``path`` as :class:`~tunesmith.rl.prompts.Prompt` (index = row)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            row = json.loads(line)
            prompts.append(Prompt(index, row["prompt"], row["answer"]))
    return prompts


# ----------------------------------------------------------------------------- scoring


@torch.no_grad()
def agent_accuracy(
    model: nn.Module,
    tokenizer: Tokenizer,
    environment: ToolEnv,
    prompts: Sequence[Prompt],
    *,
    episode: EpisodeSettings,
    max_new_tokens: int,
    reward: str = ACCURACY_REWARD,
) -> tuple[float, list[Trajectory]]:
    """Greedy trajectories of ``model`` in ``environment`` (one per prompt, turns and token
    budget of ``episode``, as GRPO samples them) and the mean of their ``reward`` term: the
    held-out accuracy.

    Example::

        acc, trajectories = agent_accuracy(model, tok, env, prompts,
                                           episode=EpisodeSettings(max_turns=3),
                                           max_new_tokens=24)
    """
    if not prompts:
        raise ValueError("accuracy of no prompts is undefined")
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    engine = LocalEngine(model, tokenizer, pad_id=pad_id)
    greedy = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    stops = tokenizer.stop_token_ids

    def generate(rows: list[list[int]], keys: list[int], limits: list[int]) -> Any:
        return generate_with(engine, rows, None, greedy, stops, max_new_tokens=limits)

    groups = sample_trajectories(
        generate, tokenizer, environment, prompts, round=0, group_size=1, seed=0,
        settings=episode, max_new_tokens=max_new_tokens, stop_token_ids=stops,
    )  # fmt: skip
    trajectories = [t for _, _, group in groups for t in group]
    scores = [t.episode.terms.get(reward, 0.0) if t.episode.ended == "done" else 0.0
              for t in trajectories]  # fmt: skip
    return sum(scores) / len(scores), trajectories


def called_tool(trajectory: Trajectory) -> bool:
    """Whether the trajectory ran at least one tool call (well-formed, known tool)."""
    return trajectory.episode.counts.get("tool_calls", 0) > 0


# ----------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class AgentDemoResult:
    """What :func:`run_agent_demo` measured.

    ``accuracy_before``: the warm-up's held-out accuracy with the calculator;
    ``accuracy_after``: the GRPO checkpoint's, with the calculator; ``accuracy_without_tool``:
    the control's (GRPO with :class:`~tunesmith.rl.envs.Unavailable`), in its own environment;
    ``calls_*``: the fraction of held-out trajectories that ran a call.
    """

    accuracy_before: float
    accuracy_after: float
    accuracy_without_tool: float
    calls_before: float
    calls_after: float
    held_out: list[Prompt]
    trajectories_before: list[Trajectory]
    trajectories_after: list[Trajectory]
    trajectories_without_tool: list[Trajectory]
    warmup_checkpoint: Path
    checkpoint: Path
    control_checkpoint: Path
    seconds: float
    grpo_seconds: float
    control_seconds: float


def run_agent_demo(
    output_dir: str | os.PathLike[str] = "outputs/demo_agent",
    *,
    settings: AgentDemoSettings | None = None,
    overrides: Sequence[str] = (),
    threads: int | None = None,
    verbose: bool = True,
) -> AgentDemoResult:
    """Build the files, warm up with SFT, train GRPO with and without the tool, score all three.

    Args:
        output_dir: where the files (reused when present) and the runs (replaced) go.
        settings: task and model sizes, seed (default :class:`AgentDemoSettings`).
        overrides: ``sft.KEY=V`` for the warm-up, ``KEY=V`` (or ``grpo.KEY=V``) for both GRPO
            runs (the control differs by the calculator alone).
        threads: torch CPU threads during the demo (restored after).
        verbose: print the progress and the summary.
    """
    settings = settings or AgentDemoSettings()
    sft_overrides, grpo_overrides = split_overrides(overrides)  # refuses the keys set here
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(Path(output_dir), settings, sft_overrides, grpo_overrides, verbose)
    finally:
        torch.set_num_threads(previous)


def _run(
    root: Path,
    settings: AgentDemoSettings,
    sft_overrides: list[str],
    grpo_overrides: list[str],
    verbose: bool,
) -> AgentDemoResult:
    say = print if verbose else (lambda *a, **k: None)
    start = time.perf_counter()
    data = AgentDemoData.under(root)
    sft = [f"seed={settings.seed}", f"model_dir={data.model_dir}",
           f"dataset.source={data.traces_file}", f"output_dir={root / SFT_DIR}", *sft_overrides]  # fmt: skip
    grpo = [f"seed={settings.seed}", f"prompts.source={data.prompts_file}", *grpo_overrides]
    stand_in = f"model_dir={root / SFT_DIR / 'checkpoints'}"
    prepare_run("sft", WARMUP_CONFIG, sft, files=False)  # every config checked first
    prepare_run("grpo", CONFIG, [stand_in, *grpo, NO_TOOL], files=False)

    say(f"[1/6] task ({settings.digits}-digit products), tokenizer and base model in {root}/")
    write_agent_data(root, settings)
    say(f"      {settings.num_traces} tool-use traces (SFT), {settings.num_prompts} prompts "
        f"(RL), {settings.num_held_out} held-out prompts")  # fmt: skip

    say(f"[2/6] SFT warm-up on the traces: tunesmith run sft --config {WARMUP_CONFIG}")
    warmup = run_to_checkpoint("sft", WARMUP_CONFIG, sft, root / SFT_DIR)
    grpo = [f"model_dir={warmup}", *grpo]
    _, _, cfg = prepare_run("grpo", CONFIG, grpo)
    _, _, control_cfg = prepare_run("grpo", CONFIG, [*grpo, NO_TOOL])
    score = _scorer(cfg, Tokenizer.from_pretrained(warmup), read_prompts(data.held_out_file))

    say("[3/6] held-out accuracy of the SFT model with the calculator (greedy trajectories)")
    before, traj_before = score(from_hf(warmup), instantiate(cfg.environment))
    say(f"      {before:.1%} exact; {_rate(traj_before):.0%} of the trajectories call the tool")

    say(f"[4/6] GRPO with the calculator: tunesmith run grpo --config {CONFIG}")
    checkpoint, grpo_seconds = _timed_run([*grpo, f"output_dir={root / GRPO_DIR}"], root / GRPO_DIR)
    say(f"[5/6] the same GRPO run, the calculator answering errors: ... {NO_TOOL}")
    control, control_seconds = _timed_run(
        [*grpo, NO_TOOL, f"output_dir={root / CONTROL_DIR}"], root / CONTROL_DIR
    )

    say("[6/6] held-out accuracy of both GRPO checkpoints")
    after, traj_after = score(from_hf(checkpoint), instantiate(cfg.environment))
    without, traj_without = score(from_hf(control), instantiate(control_cfg.environment))
    result = AgentDemoResult(
        accuracy_before=before, accuracy_after=after, accuracy_without_tool=without,
        calls_before=_rate(traj_before), calls_after=_rate(traj_after),
        held_out=read_prompts(data.held_out_file), trajectories_before=traj_before,
        trajectories_after=traj_after, trajectories_without_tool=traj_without,
        warmup_checkpoint=warmup, checkpoint=checkpoint, control_checkpoint=control,
        seconds=time.perf_counter() - start, grpo_seconds=grpo_seconds,
        control_seconds=control_seconds,
    )  # fmt: skip
    say(summary(result))
    return result


def _scorer(cfg: Any, tokenizer: Tokenizer, prompts: list[Prompt]) -> Any:
    """``score(model, environment) -> (accuracy, trajectories)`` on ``prompts`` with the GRPO
    config's episode limits and reply length."""
    episode = EpisodeSettings.of(plain(cfg.get("episode")))
    max_new_tokens = int(cfg.generation.max_new_tokens)

    def score(model: nn.Module, environment: ToolEnv) -> tuple[float, list[Trajectory]]:
        return agent_accuracy(
            model, tokenizer, environment, prompts, episode=episode, max_new_tokens=max_new_tokens
        )

    return score


def _timed_run(overrides: list[str], run_dir: Path) -> tuple[Path, float]:
    start = time.perf_counter()
    checkpoint = run_to_checkpoint("grpo", CONFIG, overrides, run_dir)
    return checkpoint, time.perf_counter() - start


def _rate(trajectories: Sequence[Trajectory]) -> float:
    return sum(map(called_tool, trajectories)) / max(1, len(trajectories))


# ----------------------------------------------------------------------------- report


def summary(result: AgentDemoResult, examples: int = 3) -> str:
    """The closing report: a few held-out conversations after GRPO, the three accuracies."""
    lines = ["", "held-out questions -> the GRPO model's turns (tool results in brackets):"]
    for prompt, trajectory in list(zip(result.held_out, result.trajectories_after))[:examples]:
        turns = map(_shown, trajectory.episode.messages[len(prompt.messages) :])
        lines.append(f"  {prompt.messages[-1]['content']} -> {' | '.join(turns)}")
    n = len(result.held_out)
    lines += [
        "",
        f"held-out accuracy ({n} products never trained on, exact answer):",
        f"  after SFT, with the calculator:       {result.accuracy_before:6.1%}"
        f"  (calls it in {result.calls_before:.0%})",
        f"  after GRPO, with the calculator:      {result.accuracy_after:6.1%}"
        f"  (calls it in {result.calls_after:.0%})",
        f"  after GRPO without it (the control):  {result.accuracy_without_tool:6.1%}",
        f"checkpoint (Hugging Face folder): {result.checkpoint}",
        f"total time: {result.seconds:.0f} s (GRPO: {result.grpo_seconds:.0f} s, control: "
        f"{result.control_seconds:.0f} s)",
    ]
    return "\n".join(lines)


def _shown(message: dict[str, Any]) -> str:
    """A turn in one line: a tool result in brackets, a call as the model wrote it."""
    if message["role"] == "tool":
        return f"[{message['content']}]"
    calls = [c["function"] for c in message.get("tool_calls") or []]
    written = [f"CALL {c['name']} {json.dumps(c['arguments'])}" for c in calls]
    return " ".join([str(message.get("content") or ""), *written]).strip()
