"""Generations during training: greedy completions of a few fixed prompts, logged as text.

Config keys (all optional; checked with the loop's own in
:data:`~tunesmith.training.settings.LOOP_RULES`):

* ``sample_prompts``: a list of prompts, each a string (a user message, through the chat
  template when the tokenizer has one), ``{messages: [...]}`` (a conversation, through the
  template) or ``{text: ...}`` (encoded as is). ``null`` (the default) turns sampling off.
* ``sample_every_n_steps``: how often; ``null`` follows ``eval_every_n_steps`` (and, like it,
  samples after the last step in any case).
* ``sample_max_new_tokens``: the length of each completion (default 64).

:class:`SamplePrompts` is the hook :func:`~tunesmith.training.loop.fit` calls after each step.
Every rank decodes the same prompts (a sharded model's forward is a collective); rank 0's
loggers get the text through :func:`log_samples`: a ``step N | sample i | PROMPT -> COMPLETION``
line on stdout, one ``{"step": N, "samples": [{"prompt", "completion"}, ...]}`` record in the
JSONL file, a text entry in TensorBoard, a table in W&B.

Example::

    >>> from tunesmith.data import Tokenizer
    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> from tunesmith.models import build_model, qwen2_5
    >>> from tunesmith.training import StdoutLogger
    >>> tokenizer = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
    >>> model = build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=tokenizer.vocab_size))
    >>> hook = SamplePrompts(model, tokenizer, ["add 2 and 3"], every=50, max_new_tokens=4)
    >>> _ = hook.maybe_log(step=50, total_steps=200, logger=StdoutLogger())  # untrained: noise
    step 50 | sample 0 | add 2 and 3 -> ...
    >>> hook.maybe_log(step=51, total_steps=200, logger=StdoutLogger()) is None  # not due
    True
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from tunesmith.config import instantiate
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with
from tunesmith.training.logging.loggers import (
    JSONLLogger,
    MultiLogger,
    StdoutLogger,
    TensorBoardLogger,
    WandBLogger,
)

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "SAMPLE_KEYS",
    "SamplePrompts",
    "log_samples",
    "prompt_ids",
]

DEFAULT_MAX_NEW_TOKENS = 64
SAMPLE_KEYS = ("sample_prompts", "sample_every_n_steps", "sample_max_new_tokens")
"""The top-level config keys of in-training generations."""


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, Mapping) and len(prompt) == 1:
        if isinstance(prompt.get("text"), str):
            return None
        messages = prompt.get("messages")
        if isinstance(messages, Sequence) and all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in messages
        ):
            return None
    return f"{prompt!r} is not a string, {{messages: [...]}} or {{text: ...}}"


def prompt_ids(
    tokenizer: Any,
    prompt: str | Mapping[str, Any],
    *,
    chat_template: bool | None = None,
    system: str | None = None,
) -> list[int]:
    """Token ids of one prompt: ``{messages: [...]}`` (``system`` first, when given) through
    the chat template with the generation prompt; a string (or ``{prompt: ...}``) as one user
    message when ``chat_template`` is on (None: on when the tokenizer has a template), else
    encoded as is; ``{text: ...}`` always as is.

    Example::

        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> prompt_ids(tok, {"text": "Once upon"}) == tok.encode("Once upon")
        True
    """
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if "text" in prompt:
        return tokenizer.encode(prompt["text"])
    use_template = tokenizer.chat_template is not None if chat_template is None else chat_template
    if "messages" in prompt:
        if tokenizer.chat_template is None:
            raise ValueError(
                f"{tokenizer.name}: has no chat template for a conversation "
                f"prompt; choose one (a chat_template option)"
            )
        messages = list(prompt["messages"])
    elif use_template:
        messages = [{"role": "user", "content": prompt["prompt"]}]
    else:
        return tokenizer.encode(prompt["prompt"])
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    ids, _ = tokenizer.tokenize_conversation(messages, add_generation_prompt=True)
    return ids


def _shown(prompt: str | Mapping[str, Any]) -> str:
    """The text a log shows for a prompt: the string, the text, or the last message."""
    if isinstance(prompt, str):
        return prompt
    if "text" in prompt:
        return prompt["text"]
    return str(prompt["messages"][-1]["content"]) if prompt["messages"] else ""


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def log_samples(logger: Any, step: int, samples: Sequence[Mapping[str, str]]) -> None:
    """Send ``samples`` (``{"prompt", "completion"}`` each) to ``logger`` as text: a logger
    with a ``log_text(step, samples)`` method gets that call; the built-in ones get the
    forms in the module docs; any other logger (and :class:`NullLogger`) nothing.

    Example::

        >>> log_samples(StdoutLogger(), 10, [{"prompt": "2+3?", "completion": "5"}])
        step 10 | sample 0 | 2+3? -> 5
    """
    if hasattr(logger, "log_text"):
        logger.log_text(step, samples)
    elif isinstance(logger, MultiLogger):
        for each in logger.loggers:
            log_samples(each, step, samples)
    elif isinstance(logger, StdoutLogger):
        lines = [
            f"step {step} | sample {i} | {_one_line(s['prompt'])} -> {_one_line(s['completion'])}"
            for i, s in enumerate(samples)
        ]
        write = getattr(logger, "_write", None) or sys.stdout.write
        write("\n".join(lines) + "\n")
    elif isinstance(logger, JSONLLogger):
        record = {"step": step, "samples": [dict(s) for s in samples]}
        logger.append(json.dumps(record, ensure_ascii=False) + "\n", f"the samples of step {step}")
    elif isinstance(logger, TensorBoardLogger):
        text = "\n\n".join(f"**{s['prompt']}**\n\n    {s['completion']}" for s in samples)
        logger._writer.add_text("samples", text, global_step=step)
    elif isinstance(logger, WandBLogger):
        import wandb

        table = wandb.Table(
            columns=["prompt", "completion"], data=[[s["prompt"], s["completion"]] for s in samples]
        )
        logger._run.log({"samples": table}, step=step)


class SamplePrompts:
    """Greedy completions of fixed ``prompts`` every ``every`` steps (see the module docs).

    ``every=None`` samples after the last step only. ``sync_ranks`` makes every rank of a
    distributed run decode in step (needed when the model's forward is a collective).

    Example::

        hook = SamplePrompts(model, tok, ["add 2 and 3"], every=10, max_new_tokens=8)
        hook()
        # -> [{'prompt': 'add 2 and 3', 'completion': '5'}]
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        prompts: Sequence[str | Mapping[str, Any]],
        *,
        every: int | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        sync_ranks: bool = False,
    ) -> None:
        for i, prompt in enumerate(prompts):
            problem = _prompt_problem(prompt)
            if problem is not None:
                raise ValueError(f"sample_prompts[{i}]: {problem}")
        self.model = model
        self.tokenizer = tokenizer
        self.prompts = list(prompts)
        self.every = every
        self.max_new_tokens = int(max_new_tokens)
        self.sync_ranks = sync_ranks
        self._ids = [prompt_ids(tokenizer, p) for p in self.prompts]

    @classmethod
    def from_config(
        cls, cfg: DictConfig, model: nn.Module, *, world_size: int = 1
    ) -> SamplePrompts | None:
        """The hook ``cfg`` asks for (its tokenizer built from ``cfg.tokenizer``), or None
        when ``sample_prompts`` is unset or empty.

        Example::

            >>> SamplePrompts.from_config(OmegaConf.create({"sample_prompts": None}), None) is None
            True
        """
        prompts = cfg.get("sample_prompts")
        if not prompts:
            return None
        prompts = OmegaConf.to_container(prompts, resolve=True)
        every = cfg.get("sample_every_n_steps")
        if every is None:
            every = cfg.get("eval_every_n_steps")
        return cls(
            model,
            instantiate(cfg.tokenizer),
            prompts,  # type: ignore[arg-type]
            every=every,
            max_new_tokens=cfg.get("sample_max_new_tokens") or DEFAULT_MAX_NEW_TOKENS,
            sync_ranks=world_size > 1,
        )

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to sample after ``step``: every ``every`` steps, and after the last."""
        return step == total_steps or bool(self.every) and step % int(self.every) == 0

    def __call__(self) -> list[dict[str, str]]:
        """The completions now (greedy; the model's train/eval mode is restored after)."""
        engine = LocalEngine(
            self.model,
            self.tokenizer,
            pad_id=self.tokenizer.pad_id or 0,
            sync_ranks=self.sync_ranks,
        )
        greedy = GenerationConfig(max_new_tokens=self.max_new_tokens, temperature=0.0)
        out = generate_with(engine, self._ids, None, greedy, self.tokenizer.stop_token_ids)
        stops = set(self.tokenizer.stop_token_ids)
        samples = []
        for prompt, tokens in zip(self.prompts, out.sequences):
            if tokens and tokens[-1] in stops:
                tokens = tokens[:-1]
            completion = self.tokenizer.decode(tokens, skip_special_tokens=True)
            samples.append({"prompt": _shown(prompt), "completion": completion})
        return samples

    def maybe_log(self, step: int, total_steps: int, logger: Any) -> list[dict[str, str]] | None:
        """Sample and log (:func:`log_samples`) when :meth:`due`; returns the samples or None."""
        if not self.due(step, total_steps):
            return None
        samples = self()
        log_samples(logger, step, samples)
        return samples
