"""Multi-turn rollouts: a policy and an environment taking turns, kept as exact token rows.

A trajectory starts from the environment's opening messages rendered by the chat template
with the tools (``tools=env.tool_schemas()``) and its generation prompt: the prompt ids. Then,
in the order they happened, come each turn's **sampled** ids (as the engine returned them,
never re-tokenised: mask 1, with their sampling log-probs) and the **observation** ids (mask 0,
log-prob 0): the template's text after the assistant turn (the rest of its closing, the
observation messages, the next generation prompt), tokenised once
(:class:`ObservationTokens`). Decoding the sampled ids and rendering the whole conversation
again would give other ids (a tokenizer merges differently, a template rewrites earlier
turns): that drift between sampler and trainer is what this layout rules out.

:func:`sample_trajectories` runs ``group_size`` trajectories of each prompt turn by turn, all
live trajectories of a turn in one engine call (keyed sampling: turn ``t`` of sample ``j``
draws with ``row_key(seed, round, prompt, j)`` at ``t = 0`` (a one-turn trajectory samples
what single-turn GRPO does) and ``row_key(seed, round, prompt, j, t)`` after), the
environments' steps of a turn side by side in threads (a slow tool holds up only the turn it
is in). :class:`EpisodeSettings` bounds each trajectory: turns, seconds per step, tokens after
the prompt (``max_tokens``: a trajectory that reaches it ends ``"token_limit"``, reward 0,
``finish == "length"``, so ``overlong_filter`` drops it, as it drops one whose last reply ran
to ``max_new_tokens``).

Example::

    >>> from tunesmith.data import Tokenizer
    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
    >>> obs = ObservationTokens(tok)
    >>> print(obs.text("<|im_end|>", [{"role": "tool", "name": "calculator", "content": "4"}]))
    <BLANKLINE>
    <|im_start|>user
    <tool_response>
    4
    </tool_response><|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from tunesmith.generation.generate import GenerationOutput
from tunesmith.generation.keyed import row_key
from tunesmith.rl.envs.base import Environment, Message
from tunesmith.rl.envs.episode import Episode, EpisodeLimits
from tunesmith.rl.prompts import Prompt, encode_prompt

__all__ = [
    "EpisodeSettings",
    "ObservationTokens",
    "TurnGenerateFn",
    "Trajectory",
    "sample_trajectories",
]

TurnGenerateFn = Callable[[list[list[int]], list[int], list[int]], GenerationOutput]
"""``generate_fn(rows, row_keys, max_new_tokens)``: one completion per row (keyed sampling),
each with its own token limit."""

_MARK = "\u2063tunesmith-assistant-turn\u2063"  # an assistant reply no template rewrites


@dataclass(frozen=True)
class EpisodeSettings:
    """The ``episode:`` section: limits of each trajectory.

    Attributes:
        max_turns: assistant turns before the trajectory is cut (``"turn_limit"``).
        step_timeout_s: seconds one environment ``reset`` or ``step`` may take.
        max_tokens: tokens after the prompt (sampled and observations) a trajectory may
            hold; one that would pass it ends ``"token_limit"`` (None: ``max_turns`` x
            ``generation.max_new_tokens`` sampled, observations unbounded).

    Example::

        >>> EpisodeSettings.of({"max_turns": 3}).limits
        EpisodeLimits(max_turns=3, step_timeout_s=30.0)
        >>> EpisodeSettings.of({"turns": 3})
        Traceback (most recent call last):
        ValueError: episode.turns: not a setting (max_turns, step_timeout_s, max_tokens)
    """

    max_turns: int = 4
    step_timeout_s: float = 30.0
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        self.limits  # noqa: B018 - checks max_turns and step_timeout_s
        tokens = self.max_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise ValueError(f"episode.max_tokens must be an int >= 1 or null, got {tokens!r}")
        if tokens is not None and tokens < 1:
            raise ValueError(f"episode.max_tokens must be an int >= 1 or null, got {tokens}")

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(self.max_turns, self.step_timeout_s)

    @classmethod
    def of(cls, value: Mapping[str, Any] | None) -> EpisodeSettings:
        names = ("max_turns", "step_timeout_s", "max_tokens")
        for key in value or {}:
            if key not in names:
                raise ValueError(f"episode.{key}: not a setting ({', '.join(names)})")
        return cls(**dict(value or {}))


class ObservationTokens:
    """The ids a chat template puts after an assistant turn: the rest of the turn's closing,
    the observation messages and the next generation prompt, rendered once in a probe
    conversation (``[user, assistant, *observations]``) and cut after the assistant's reply,
    so no earlier turn is rendered again. ``tools`` and ``template_kwargs`` as the prompt's.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.template_kwargs = dict(template_kwargs or {})

    def text(self, end_text: str, observations: Sequence[Message]) -> str:
        """The text after an assistant reply that ended with ``end_text`` (the decoded stop
        token it sampled, or ``""``): the part of the template's closing the reply did not
        sample, then the observations and the generation prompt."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        try:
            rendered = self.tokenizer.apply_chat_template(
                [*probe, *observations],
                tools=self.tools,
                add_generation_prompt=True,
                **self.template_kwargs,
            )
        except Exception as e:  # a template's raise_exception, or one that fails to render
            raise ValueError(
                f"the chat template of {getattr(self.tokenizer, 'name', 'the tokenizer')} cannot "
                f"render observation messages (roles {[m.get('role') for m in observations]}) "
                f"after an assistant turn: {type(e).__name__}: {e}"
            ) from e
        if rendered.count(_MARK) != 1:
            raise ValueError(
                f"the chat template of {getattr(self.tokenizer, 'name', 'the tokenizer')} does "
                "not render an assistant reply as it is, so observation tokens cannot be cut "
                "after it"
            )
        after = rendered[rendered.index(_MARK) + len(_MARK) :]
        return after[len(end_text) :] if end_text and after.startswith(end_text) else after

    def __call__(self, end_text: str, observations: Sequence[Message]) -> list[int]:
        return self.tokenizer.encode(self.text(end_text, observations), add_special_tokens=False)


@dataclass
class Trajectory:
    """One trajectory's rows after its prompt, and what happened.

    Attributes:
        ids / mask / logprobs: every token after the prompt; mask 1 on sampled tokens (their
            sampling log-probs), 0 on observation tokens (log-prob 0).
        finish: ``"length"`` when cut by ``max_tokens`` or when the last reply ran to
            ``max_new_tokens`` (as a single-turn completion would be), else ``"stop"``.
        answer: the last assistant reply's text (what ``rewards`` beside the environment
            score).
        episode: the :class:`~tunesmith.rl.envs.episode.Episode` (messages, reward, terms,
            counts, ending).
    """

    ids: list[int]
    mask: list[int]
    logprobs: list[float]
    finish: str
    answer: str
    episode: Episode

    @property
    def sampled_tokens(self) -> int:
        return sum(self.mask)


class _Live:
    """A trajectory being sampled: its episode, prompt ids and rows so far."""

    def __init__(
        self,
        episode: Episode,
        prompt_ids: list[int],
        key: tuple[int, ...],
        observe: ObservationTokens,
    ) -> None:
        self.episode, self.prompt_ids, self.key, self.observe = episode, prompt_ids, key, observe
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.answer = ""
        self.end = ""  # the last reply's stop token, decoded
        self.last_finish = "stop"  # how the last reply ended
        self.cut = False

    def cut_short(self) -> None:
        """End the trajectory at its token budget (reward 0)."""
        self.cut = True
        self.episode.cut("token_limit")

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None) -> None:
        self.ids += list(ids)
        self.mask += [0 if logprobs is None else 1] * len(ids)
        self.logprobs += [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]

    def done(self) -> Trajectory:
        return Trajectory(
            self.ids, self.mask, self.logprobs,
            "length" if self.cut or self.last_finish != "stop" else "stop", self.answer,
            self.episode,
        )  # fmt: skip


def sample_trajectories(
    generate_fn: TurnGenerateFn,
    tokenizer: Any,
    environment: Environment,
    prompts: Sequence[Prompt],
    *,
    round: int,
    group_size: int,
    seed: int,
    settings: EpisodeSettings,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    template_kwargs: Mapping[str, Any] | None = None,
    keep_going: Callable[[bool], bool] = bool,
) -> list[tuple[list[int], str, list[Trajectory]]]:
    """``group_size`` trajectories of each prompt (see the module docs): per prompt, its
    prompt ids, prompt text and trajectories in sample order. ``keep_going(any_live)``
    decides whether another turn is sampled (ranks that decode together answer alike: a rank
    whose trajectories are over calls ``generate_fn`` with no rows while another's run)."""
    kwargs = dict(template_kwargs or {})
    stops = set(stop_token_ids)
    live: list[_Live] = []
    encoded: list[tuple[list[int], str]] = []
    for prompt in prompts:
        episodes = [Episode(environment, prompt, settings.limits) for _ in range(group_size)]
        # the opening of a trajectory that started (a reset that failed ended its own at
        # reward 0, with no turn; when all did, the row keeps the prompt's own messages)
        opened = next((e for e in episodes if not e.done), None)
        tools = None if opened is None else opened.env.tool_schemas()
        messages = prompt.messages if opened is None else opened.messages
        opening = Prompt(prompt.index, messages, prompt.answer, prompt.metadata)
        ids, text = encode_prompt(tokenizer, opening, template_kwargs={"tools": tools, **kwargs})
        encoded.append((ids, text))
        observe = ObservationTokens(tokenizer, tools, kwargs)
        live += [
            _Live(e, ids, (seed, round, prompt.index, j), observe) for j, e in enumerate(episodes)
        ]
    budget = settings.max_tokens or math.inf
    turn = 0
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="tunesmith-env") as pool:
        while keep_going(bool(active := [t for t in live if not t.episode.done])):
            limits = [int(min(max_new_tokens, budget - len(t.ids))) for t in active]
            out = generate_fn(
                [t.prompt_ids + t.ids for t in active],
                [row_key(*t.key) if turn == 0 else row_key(*t.key, turn) for t in active],
                limits,
            )
            stepping = []
            for t, limit, seq, lps, finish in zip(
                active, limits, out.sequences, out.logprobs, out.finish_reasons
            ):
                t.add(seq, lps)
                t.last_finish = finish
                stopped = finish == "stop" and bool(seq) and seq[-1] in stops
                t.answer = tokenizer.decode(seq[:-1] if stopped else seq, skip_special_tokens=False)
                t.end = tokenizer.decode(seq[-1:], skip_special_tokens=False) if stopped else ""
                if finish != "stop" and limit < max_new_tokens:  # the budget cut the reply
                    t.cut_short()
                else:
                    stepping.append(t)
            steps = pool.map(
                lambda t: t.episode.step({"role": "assistant", "content": t.answer}), stepping
            )
            for t, observations in zip(stepping, list(steps)):
                if t.episode.done:
                    continue
                ids = t.observe(t.end, observations)
                if len(t.ids) + len(ids) >= budget:  # no room left for a reply
                    t.cut_short()
                else:
                    t.add(ids, None)
            turn += 1
    trajectories = [t.done() for t in live]
    return [
        (ids, text, trajectories[g * group_size : (g + 1) * group_size])
        for g, (ids, text) in enumerate(encoded)
    ]
