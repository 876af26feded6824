"""Prompts for RL: datasets of prompts (with reference answers) and a resumable prompt stream.

A :class:`Prompt` is the chat that a policy answers (messages ending with the user turn), the
reference answer a reward can check against, and extra metadata. Two sources make them:

- :class:`PromptDataset`: rows of a local JSONL/JSON/Parquet/CSV file, a local folder or a Hub
  dataset (read by :func:`~tunesmith.data.sources.load_rows`), with a prompt column (a string
  = one user message, or a list of chat messages) and, optionally, an answer column. Bad rows
  stop construction with a :class:`~tunesmith.data.report.BadRowError` naming the source and
  the row (``on_bad_row="error"``, the default) or are skipped and counted in
  :attr:`PromptDataset.report` (``on_bad_row="skip"``), as in the SFT dataset.
- :class:`ReasoningGymPrompts`: procedurally generated tasks of ``reasoning_gym`` (no
  download), one task or a deterministic round-robin mixture of several.

:func:`encode_prompt` renders a prompt with the chat template and its generation prompt and
tokenises it; :class:`PromptStream` hands each data-parallel rank its share of the prompts of
every step, epoch after epoch, and resumes exactly from its ``state_dict()``.

Example (YAML)::

    prompts:
      _component_: tunesmith.rl.prompts.PromptDataset
      source: data/math.jsonl
      prompt_column: question
      answer_column: answer
      prompt_template: "{prompt}\\nPut the final answer inside <answer></answer>."
      on_bad_row: skip
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import torch

from tunesmith.config.errors import override_hint
from tunesmith.config.registry import component
from tunesmith.data.chat_template import chat_template_hint
from tunesmith.data.formats import check_messages
from tunesmith.data.report import (
    BAD_ROW_POLICIES,
    EMPTY_TEXT,
    MISSING_FIELD,
    NO_ASSISTANT_TURN,
    ROLES_OUT_OF_ORDER,
    WRONG_TYPE,
    BadRow,
    DataError,
    DataReport,
    OnBadRow,
    raise_if_empty,
    read_samples,
)
from tunesmith.data.sources import MAX_ROW_BYTES, DataSource, check_max_row_bytes, load_rows

if TYPE_CHECKING:
    from tunesmith.data.tokenizer import Tokenizer

__all__ = [
    "BAD_ROW_POLICIES",
    "Prompt",
    "PromptDataset",
    "PromptStream",
    "ReasoningGymPrompts",
    "check_prompt_template",
    "encode_prompt",
]


@dataclass(frozen=True)
class Prompt:
    """One RL prompt.

    Attributes:
        index: its row number in its source (a stable id: the same prompt keeps it).
        messages: chat messages ending with the user turn (the system prompt first, if any).
        answer: the reference answer (None when the source has none).
        metadata: extra columns, or the task entry of a generated task.

    Example::

        >>> p = Prompt(0, [{"role": "user", "content": "2+2?"}], answer="4")
        >>> p.messages[-1]["content"], p.answer
        ('2+2?', '4')
    """

    index: int
    messages: list[dict[str, str]]
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Building the messages


def check_prompt_template(template: str | None) -> None:
    """Refuse a ``prompt_template`` that is not a format string with exactly the ``{prompt}``
    field (literal braces are written ``{{`` and ``}}``).

    Example::

        >>> check_prompt_template("Solve: {prompt}")
        >>> check_prompt_template("Answer in {}: {prompt}")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: prompt_template may only use the field {prompt}, found {} ...
    """
    if template is None:
        return
    if not isinstance(template, str):
        raise TypeError(f"prompt_template must be a str, got {type(template).__name__}")
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
    except ValueError as e:
        raise ValueError(
            f"prompt_template is not a valid format string ({e}; write literal braces as "
            f"{{{{ and }}}}): {template!r}"
        ) from e
    for name in fields:
        if name != "prompt":
            raise ValueError(
                f"prompt_template may only use the field {{prompt}}, found {{{name}}} (write "
                f"literal braces as {{{{ and }}}}): {template!r}"
            )
    if not fields:
        raise ValueError(f"prompt_template has no {{prompt}} field: {template!r}")


def _prompt_messages(value: object, column: str) -> list[dict[str, Any]]:
    """A string (one user message) or a chat list that ends with a user message, checked."""
    if isinstance(value, str):
        if not value.strip():
            raise BadRow(EMPTY_TEXT, f"column {column!r} is an empty prompt")
        return [{"role": "user", "content": value}]
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise BadRow(
            WRONG_TYPE,
            f"column {column!r} is {type(value).__name__}, expected a str or a list of messages",
        )
    messages = list(value)
    if not messages:
        raise BadRow(MISSING_FIELD, f"column {column!r} is an empty list of messages")
    last = messages[-1]
    if isinstance(last, Mapping) and last.get("role") == "user":
        # A stand-in reply lets check_messages check roles, order and types of the prompt.
        checked = check_messages([*messages, {"role": "assistant", "content": "-"}], column)[:-1]
        if not checked[-1]["content"].strip():
            raise BadRow(EMPTY_TEXT, f"{column}[{len(messages) - 1}] is an empty user message")
        return checked
    try:
        check_messages(messages, column)
    except BadRow as bad:
        if bad.reason != NO_ASSISTANT_TURN:
            raise
    role = last.get("role") if isinstance(last, Mapping) else None
    raise BadRow(
        ROLES_OUT_OF_ORDER,
        f"{column}[{len(messages) - 1}] is {role!r}; a prompt must end with a user message",
    )


def _finish_messages(
    messages: list[dict[str, Any]], system_prompt: str | None, template: str | None
) -> list[dict[str, Any]]:
    """The template applied to the last user message, the system prompt put first (unless
    the messages have a system message of their own)."""
    if template is not None:
        last = messages[-1]
        messages = [*messages[:-1], {**last, "content": template.format(prompt=last["content"])}]
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


class _PromptSequence(Sequence[Prompt]):
    prompts: list[Prompt]

    def __len__(self) -> int:
        return len(self.prompts)

    @overload
    def __getitem__(self, index: int) -> Prompt: ...

    @overload
    def __getitem__(self, index: slice) -> list[Prompt]: ...

    def __getitem__(self, index: int | slice) -> Prompt | list[Prompt]:
        return self.prompts[index]


# ---------------------------------------------------------------------------------------------
# Prompt datasets


@component
class PromptDataset(_PromptSequence):
    """RL prompts (and reference answers) from a local file or a Hub dataset.

    Args:
        source: local ``.jsonl``/``.json``/``.parquet``/``.csv``/``.tsv`` file, local folder
            or ``datasets.load_dataset`` name.
        prompt_column: the column of the prompt: a string (one user message) or a list of
            ``{role, content}`` messages that ends with a user message.
        messages_column: the same, named for chat lists. Give at most one of the two; with
            neither, ``"prompt"`` is read if the data has it, else ``"messages"``.
        answer_column: the reference answer column (any JSON value; a row where it is null
            or missing is a ``missing_field`` bad row); ``None`` for data without answers.
        system_prompt: a system message put first in prompts that have none of their own.
        prompt_template: a format string with one ``{prompt}`` field applied to the (last)
            user message, e.g. ``"Solve: {prompt}\\nAnswer inside <answer></answer>."``;
            literal braces are written ``{{`` and ``}}``.
        metadata_columns: columns copied into :attr:`Prompt.metadata` (null values as None).
        split, data_files: passed to ``datasets.load_dataset`` (folders, Hub names).
        max_samples: keep only the first this many good prompts (``None``: all).
        on_bad_row: ``"error"`` (raise at the first bad row) or ``"skip"`` (count it).
        max_row_bytes: the largest row read, in bytes (16 MiB by default): a bigger line,
            JSON array element or CSV record is a ``row_too_large`` bad row, skipped unread.

    Attributes:
        prompts: the :class:`Prompt` list, in source order (``Prompt.index`` is the row).
        report: a :class:`~tunesmith.data.report.DataReport` (log ``report.summary()``).

    Example::

        >>> from pathlib import Path
        >>> _ = Path("math.jsonl").write_text(json.dumps({"prompt": "1+1?", "answer": "2"}))
        >>> ds = PromptDataset("math.jsonl", prompt_template="{prompt} Think.")
        >>> ds[0].messages, ds[0].answer
        ([{'role': 'user', 'content': '1+1? Think.'}], '2')
    """

    def __init__(
        self,
        source: DataSource,
        *,
        prompt_column: str | None = None,
        messages_column: str | None = None,
        answer_column: str | None = "answer",
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        metadata_columns: Sequence[str] = (),
        split: str = "train",
        data_files: str | Sequence[str] | Mapping[str, Any] | None = None,
        max_samples: int | None = None,
        on_bad_row: OnBadRow = "error",
        max_row_bytes: int = MAX_ROW_BYTES,
    ) -> None:
        if on_bad_row not in BAD_ROW_POLICIES:
            raise ValueError(f"on_bad_row must be one of {BAD_ROW_POLICIES}, got {on_bad_row!r}")
        check_max_row_bytes(max_row_bytes)
        if prompt_column is not None and messages_column is not None:
            raise ValueError(
                f"give prompt_column ({prompt_column!r}) or messages_column "
                f"({messages_column!r}), not both"
            )
        if max_samples is not None and max_samples < 1:
            raise ValueError(f"max_samples must be >= 1 (or None), got {max_samples}")
        if isinstance(metadata_columns, str):
            metadata_columns = [metadata_columns]
        check_prompt_template(prompt_template)
        rows = load_rows(source, split=split, data_files=data_files, max_row_bytes=max_row_bytes)
        available = rows.columns
        column = prompt_column or messages_column
        if column is None:
            column = next((c for c in ("prompt", "messages") if c in available), None)
            if column is None:
                raise DataError(
                    f"{rows.name}: has neither a 'prompt' nor a 'messages' column (columns: "
                    f"{sorted(available)}); set {override_hint('prompt_column', '<your column>')}"
                )
        wanted = [("prompt column", column)]
        if answer_column is not None:
            wanted.append(("answer_column", answer_column))
        wanted += [("metadata column", c) for c in metadata_columns]
        for what, name in wanted:
            if name not in available:
                hint = ""
                if what == "answer_column":
                    hint = f"; set {override_hint('answer_column', None)} for data without answers"
                raise DataError(
                    f"{rows.name}: {what} {name!r} is not in the data (columns: "
                    f"{sorted(available)}){hint}"
                )

        self.source = rows.name
        self.prompt_column = column
        self.answer_column = answer_column
        self.prompts: list[Prompt] = []
        self.report = DataReport(source=rows.name)

        def make_prompt(row: Any) -> tuple[tuple[list[dict[str, Any]], Any, dict[str, Any]], bool]:
            if not isinstance(row, Mapping):
                raise BadRow(WRONG_TYPE, f"row is {type(row).__name__}, expected an object")
            if row.get(column) is None:
                raise BadRow(MISSING_FIELD, f"column {column!r} is missing or null")
            messages = _prompt_messages(row[column], column)
            answer = None
            if answer_column is not None:
                answer = row.get(answer_column)
                if answer is None:
                    raise BadRow(MISSING_FIELD, f"column {answer_column!r} is missing or null")
            metadata = {c: row.get(c) for c in metadata_columns}
            messages = _finish_messages(messages, system_prompt, prompt_template)
            return (messages, answer, metadata), False

        for index, (messages, answer, metadata), _ in read_samples(
            rows, make_prompt, on_bad_row, self.report
        ):
            self.prompts.append(Prompt(index, messages, answer, metadata))
            self.report.samples += 1
            if max_samples is not None and len(self.prompts) >= max_samples:
                break
        raise_if_empty(self.report, "prompts")


def _jsonable(entry: Any) -> Any:
    """A JSON round trip: tuples become lists, keys strings, other objects their ``str``."""
    return json.loads(json.dumps(entry, default=str))


@component
class ReasoningGymPrompts(_PromptSequence):
    """Prompts of procedurally generated ``reasoning_gym`` tasks (generated here, no download).

    Several tasks make a mixture, interleaved round-robin: prompt ``i`` is the ``i // n``-th
    entry of task ``i % n`` (``n`` tasks, in the order given), each task generated with the
    same ``seed``. The same arguments always give the same prompts.

    Args:
        task: a task name (e.g. ``"basic_arithmetic"``) or a list of them.
        size: how many prompts in all (at least one per task).
        seed: the tasks' seed.
        system_prompt: a system message put first in every prompt.
        prompt_template: a format string with one ``{prompt}`` field applied to the question.
        config: the task's options (``reasoning_gym`` config fields, e.g. ``{"min_terms": 2}``),
            or ``{task: options}`` for any of the tasks (the only form for several tasks).

    Each :attr:`Prompt.answer` is the entry's ``answer`` (None for tasks whose answers are
    checked another way) and :attr:`Prompt.metadata` is ``{"gym_entry": entry, "task": name}``
    with the entry made JSON data (tuples become lists); score a completion with
    ``reasoning_gym.get_score_answer_fn(name)(answer_text, entry)``.

    Example::

        >>> gym = ReasoningGymPrompts(["basic_arithmetic", "chain_sum"], size=4, seed=1)
        >>> [p.metadata["task"] for p in gym]
        ['basic_arithmetic', 'chain_sum', 'basic_arithmetic', 'chain_sum']
    """

    def __init__(
        self,
        task: str | Sequence[str],
        size: int,
        seed: int = 0,
        *,
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        import reasoning_gym  # optional dependency (the ``rl`` extra), imported when used
        from reasoning_gym.factory import DATASETS

        tasks = [task] if isinstance(task, str) else [str(t) for t in task]
        if not tasks:
            raise ValueError("task must name at least one reasoning_gym task")
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"task lists a task twice: {tasks}")
        unknown = [t for t in tasks if t not in DATASETS]
        if unknown:
            raise ValueError(f"unknown reasoning_gym task(s) {unknown}; known: {sorted(DATASETS)}")
        if size < len(tasks):
            raise ValueError(f"size must be >= the number of tasks ({len(tasks)}), got {size}")
        check_prompt_template(prompt_template)
        config = dict(config or {})
        per_task = bool(config) and all(
            k in tasks and isinstance(v, Mapping) for k, v in config.items()
        )
        if len(tasks) == 1 and not per_task:
            options = {tasks[0]: config}
        else:
            stray = sorted(set(config) - set(tasks))
            if stray:
                raise ValueError(
                    f"with several tasks, config maps task -> options; {stray} are not among "
                    f"the tasks {tasks}"
                )
            options = {t: dict(config.get(t) or {}) for t in tasks}
        for name, opts in options.items():
            clash = sorted({"size", "seed"} & set(opts))
            if clash:
                raise ValueError(
                    f"config for task {name!r} sets {clash}; give size and seed as arguments"
                )

        self.tasks = tasks
        self.seed = seed
        entries: dict[str, list[dict[str, Any]]] = {}
        n = len(tasks)
        for i, name in enumerate(tasks):
            try:
                ds = reasoning_gym.create_dataset(
                    name, size=len(range(i, size, n)), seed=seed, **options[name]
                )
                entries[name] = [_jsonable(ds[j]) for j in range(len(ds))]
            except (TypeError, ValueError, AssertionError) as e:
                raise ValueError(
                    f"reasoning_gym task {name!r} with options {options[name]} failed: "
                    f"{type(e).__name__}: {e}"
                ) from e
        self.prompts = []
        for index in range(size):
            name = tasks[index % n]
            entry = entries[name][index // n]
            messages = _finish_messages(
                [{"role": "user", "content": entry["question"]}], system_prompt, prompt_template
            )
            metadata = {"gym_entry": entry, "task": name}
            self.prompts.append(Prompt(index, messages, entry.get("answer"), metadata))


# ---------------------------------------------------------------------------------------------
# Tokenising


def encode_prompt(
    tokenizer: Tokenizer,
    prompt: Prompt,
    *,
    chat_template: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[int], str]:
    """The token ids and the text that a policy continues for ``prompt``.

    With ``chat_template`` (the default) the messages are rendered with the tokenizer's chat
    template and its generation prompt, and the text is encoded without adding special tokens
    (the template writes BOS itself, so there is one), as the SFT dataset and transformers'
    ``apply_chat_template(..., tokenize=True)`` do. ``template_kwargs`` become template
    variables (e.g. ``{"enable_thinking": False}``). With ``chat_template=False`` the message
    contents, joined by blank lines, are encoded with the tokenizer's special tokens.

    Example::

        >>> from tunesmith.data import Tokenizer
        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> prompt = Prompt(0, [{"role": "system", "content": "Be brief."},
        ...                     {"role": "user", "content": "Hi"}])
        >>> ids, text = encode_prompt(tok, prompt)
        >>> print(text)
        <|im_start|>system
        Be brief.<|im_end|>
        <|im_start|>user
        Hi<|im_end|>
        <|im_start|>assistant
        <BLANKLINE>
        >>> ids == tok.encode(text, add_special_tokens=False)
        True
    """
    if not chat_template:
        text = "\n\n".join(m["content"] for m in prompt.messages)
        return tokenizer.encode(text, add_special_tokens=True), text
    if not tokenizer.chat_templates:
        raise ValueError(
            f"prompt {prompt.index}: chat_template=True, but the tokenizer "
            f"{getattr(tokenizer, 'name', '')} has no chat template (tokenizer_config.json has "
            f"no chat_template and there is no chat_template.jinja): {chat_template_hint()}, or "
            "set the config's chat_template=false (chat_template=False in Python)"
        )
    try:
        text = tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=True, **dict(template_kwargs or {})
        )
    except Exception as e:  # a template's raise_exception, or one that fails to render
        raise ValueError(
            f"prompt {prompt.index}: the chat template of {getattr(tokenizer, 'name', '')} "
            f"failed: {type(e).__name__}: {e}"
        ) from e
    return tokenizer.encode(text, add_special_tokens=False), text


# ---------------------------------------------------------------------------------------------
# The prompt stream


class PromptStream:
    """This data-parallel rank's prompts, step after step, epoch after epoch; exactly resumable.

    Each epoch is an order of the whole dataset: a permutation drawn from ``seed + epoch``
    with its own ``torch.Generator`` (the same on every rank, untouched by the global RNG), or
    the source order when ``shuffle`` is off. A step takes the next ``prompts_per_step``
    prompts of that order; rank ``r`` gets the contiguous slice
    ``[r * k, (r + 1) * k)`` of them (``k = prompts_per_step // dp_size``), so the ranks'
    prompts, concatenated in rank order, are the step's prompts on one process. The prompts
    left at the end of an epoch that do not fill a step are dropped (how many is printed
    once, by rank 0); the next epoch starts.

    Attributes:
        epoch: the epoch the next step comes from (it turns over right after an epoch's last
            full step).
        position: how many prompts of this epoch's order the steps so far have taken.

    The state (``state_dict()``) counts prompts of the global order, so a run may resume
    with another ``dp_size``; it refuses a dataset of another size or another seed/shuffle.

    Example::

        >>> stream = PromptStream(list(range(10)), prompts_per_step=4, dp_rank=1, dp_size=2)
        >>> len(stream.next_prompts()), stream.steps_per_epoch
        (2, 2)
    """

    def __init__(
        self,
        dataset: Sequence[Prompt],
        prompts_per_step: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if prompts_per_step % dp_size:
            raise ValueError(
                f"prompts_per_step={prompts_per_step} (all data-parallel ranks together) is not "
                f"divisible by dp_size={dp_size}"
            )
        if prompts_per_step > len(dataset):
            raise ValueError(
                f"prompts_per_step={prompts_per_step} is more than the {len(dataset)} prompts of "
                f"the dataset"
            )
        self.dataset = dataset
        self.prompts_per_step = prompts_per_step
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None
        dropped = len(dataset) % prompts_per_step
        if dropped and dp_rank == 0:
            which = "a different draw each epoch" if self.shuffle else "always the same ones"
            print(
                f"prompts: {len(dataset)} prompts, prompts_per_step {prompts_per_step}: "
                f"{dropped} prompt(s) left out of each epoch ({which})"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Full steps in one epoch."""
        return len(self.dataset) // self.prompts_per_step

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(n, generator=generator).tolist()
            else:
                self._order = list(range(n))
        return self._order

    def _turn_epoch_if_done(self) -> None:
        if self.position + self.prompts_per_step > len(self.dataset):
            self.epoch += 1
            self.position = 0
            self._order = None

    def next_prompts(self) -> list[Prompt]:
        """This rank's ``prompts_per_step // dp_size`` prompts of the next step.

        Example::

            >>> PromptStream(["a", "b", "c", "d"], 2, shuffle=False).next_prompts()
            ['a', 'b']
        """
        self._turn_epoch_if_done()
        share = self.prompts_per_step // self.dp_size
        start = self.position + self.dp_rank * share
        indices = self._epoch_order()[start : start + share]
        self.position += self.prompts_per_step
        self._turn_epoch_if_done()
        return [self.dataset[i] for i in indices]

    def state_dict(self) -> dict[str, int]:
        """Plain-data position: ``epoch`` and ``position``, with the dataset size, seed and
        shuffle flag that fix the order (checked on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "dataset_size": len(self.dataset),
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`); refuses one made for another
        dataset size, seed or shuffle setting, naming both values."""
        missing = [k for k in ("epoch", "position") if k not in state]
        if missing:
            raise KeyError(f"prompt stream state has no {missing} (keys: {sorted(state)})")
        mine = {"dataset_size": len(self.dataset), "seed": self.seed, "shuffle": int(self.shuffle)}
        for key, value in mine.items():
            if key in state and int(state[key]) != value:
                raise ValueError(
                    f"prompt stream state was saved with {key}={int(state[key])}, this stream "
                    f"has {key}={value}: the prompt order would differ"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise ValueError(
                f"prompt stream state out of range: epoch={epoch}, position={position} "
                f"(dataset of {len(self.dataset)})"
            )
        self.epoch, self.position = epoch, position
        self._order = None
        self._turn_epoch_if_done()
