"""lm-evaluation-harness on tunesmith models: an ``lm_eval`` model backed by our model and
tokenizer.

:class:`TunesmithLM` answers the three request types of ``lm_eval`` (the ``lm-eval`` package,
``pip install tunesmith[eval]``) the way its Hugging Face backend (``HFLM``) does, so the
numbers match it on the same checkpoint:

* ``loglikelihood(context, continuation)``: the context and continuation are tokenised as one
  text and split where the context's tokens end (trailing spaces of the context move to the
  continuation; an empty context becomes the BOS token, else EOS), as lm-eval's
  ``TemplateLM`` does; requests are scored in batches, longest first, right-padded (a causal
  model's scores do not see the padding), the sequence cut to the last ``max_length + 1``
  tokens. Returns ``(sum of log-probs, whether greedy decoding gives the continuation)``.
* ``loglikelihood_rolling(text)``: the text's log-likelihood over disjoint windows of at most
  ``max_length`` tokens (lm-eval's own window maker), the first conditioned on BOS/EOS.
* ``generate_until(context, gen_kwargs)``: batched KV-cache decoding (a
  :class:`~tunesmith.generation.LocalEngine` through
  :func:`~tunesmith.generation.generate_with`), requests grouped by their generation settings and
  sorted longest first; greedy unless ``do_sample``/``temperature`` say otherwise; each row
  stops at ``max_gen_toks`` new tokens, an end-of-turn token or one of the ``until`` strings
  (EOS's text added to them), and the text is cut before the first stop string.

With ``--apply_chat_template`` lm-eval renders prompts through :meth:`apply_chat_template`
(the tokenizer's Jinja template; a prefilled assistant turn is continued, not closed);
:meth:`chat_template` and :attr:`tokenizer_name` key lm-eval's caches.

Example::

    import lm_eval
    lm = TunesmithLM.from_checkpoint("outputs/sft-tiny_lora", batch_size=8)
    out = lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"], limit=20)
"""

from __future__ import annotations

import difflib
import json
import os
import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import torch
import torch.nn.functional as F
from torch import nn

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as error:  # pragma: no cover - the eval extra is not installed
    raise ImportError(
        "tunesmith eval needs lm-evaluation-harness: pip install 'tunesmith[eval]' "
        "(or: pip install lm-eval)"
    ) from error

from tunesmith.cli.checkpoint_loading import LoadedCheckpoint, load_checkpoint
from tunesmith.data import Tokenizer
from tunesmith.generation import GenerationConfig, LocalEngine, generate_with

__all__ = ["DEFAULT_MAX_LENGTH", "TunesmithLM", "run_lm_eval", "task_manager"]

DEFAULT_MAX_LENGTH = 2048
"""The context length used when neither the model nor the tokenizer states one (lm-eval's)."""

_SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p")


def _model_device(model: nn.Module) -> torch.device:
    for param in model.parameters():
        return param.device
    return torch.device("cpu")


class TunesmithLM(TemplateLM):
    """An ``lm_eval`` model (``lm_eval.api.model.LM``) over a tunesmith model and tokenizer.

    Args:
        model: a ``TransformerLM`` (plain, with LoRA adapters, any dtype/device); put in eval
            mode.
        tokenizer: its :class:`~tunesmith.data.Tokenizer`.
        batch_size: requests per forward (loglikelihood) or per decoding batch (generation).
        max_length: longest sequence fed to the model; default: the model's
            ``max_position_embeddings``, else the tokenizer's ``model_max_length``, else 2048.
        max_gen_toks: new tokens per generation when the task gives no ``max_gen_toks``.
        add_bos_token: ``None`` encodes as the tokenizer's post-processor does (BOS for
            Llama 3, nothing for Qwen) unless the text already starts with the BOS token;
            ``True``/``False`` force it.
        chat_template_kwargs: template variables for :meth:`apply_chat_template` (e.g.
            ``{"enable_thinking": False}``).

    Example::

        lm = TunesmithLM(model, tokenizer, batch_size=4)
        lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"], limit=10)
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if tokenizer.eos_id is None and tokenizer.bos_id is None:
            raise ValueError(
                f"{tokenizer.name}: names neither an EOS nor a BOS token; lm-eval "
                f"needs one to condition an empty context on"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        spec = getattr(model, "spec", None)
        self.max_length = int(
            max_length
            or getattr(spec, "max_position_embeddings", None)
            or tokenizer.model_max_length
            or DEFAULT_MAX_LENGTH
        )
        self.max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._device = _model_device(model)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | os.PathLike[str],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str = "cpu",
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> TunesmithLM:
        """Wrap a model folder, an adapter folder or a run folder's newest checkpoint (see
        :func:`~tunesmith.cli.checkpoint_loading.load_checkpoint`); ``kwargs`` go to the
        constructor.

        Example::

            lm = TunesmithLM.from_checkpoint("out/checkpoints/step_000100", batch_size=8)
        """
        loaded = load_checkpoint(
            path, base_dir=base_dir, dtype=dtype, device=device, chat_template=chat_template
        )
        return cls(loaded.model, loaded.tokenizer, **kwargs)

    # ------------------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id
        return eos if eos is not None else self.tokenizer.bos_id  # type: ignore[return-value]

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of ``string`` (see ``add_bos_token``); the last ``left_truncate_len``."""
        if add_special_tokens is None:
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            bos = self.tokenizer.special_tokens.get("bos_token")
            if bos and string.startswith(bos):  # a rendered chat template wrote BOS itself
                add_special_tokens = False
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def _loglikelihood_tokens(
        self,
        requests: list[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """Score ``(cache_key, context_ids, continuation_ids)`` requests in batches, longest
        first; results in the order given."""
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1] + requests[i][2]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            rows, conts = [], []
            for i in chunk:
                _, context, continuation = requests[i]
                if not context or not continuation:
                    raise ValueError(
                        f"request {i}: empty context or continuation tokens "
                        f"({len(context)}, {len(continuation)})"
                    )
                rows.append((context + continuation)[-(self.max_length + 1) :][:-1])
                conts.append(continuation)
            width = max(len(r) for r in rows)
            batch = torch.zeros(len(rows), width, dtype=torch.long)  # right padding: unseen
            for b, row in enumerate(rows):
                batch[b, : len(row)] = torch.tensor(row)
            logprobs = F.log_softmax(self.model(batch.to(self._device)).float(), dim=-1)
            for b, i in enumerate(chunk):
                n, cont = len(rows[b]), conts[b]
                scores = logprobs[b, n - len(cont) : n]
                target = torch.tensor(cont, device=scores.device)
                greedy = bool((scores.argmax(-1) == target).all())
                answer = (float(scores.gather(-1, target[:, None]).sum()), greedy)
                results[i] = answer
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each request's whole text (``Instance.args == (text,)``)."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for r, (text,) in enumerate(req.args for req in requests):
            pairs = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, pred in map(make_disjoint_window, pairs):
                windows.append((None, context, pred))
                owner.append(r)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for r, (logprob, _) in zip(owner, scores):
            totals[r] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ------------------------------------------------------------------------- generation

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Complete each ``(context, gen_kwargs)`` request (see the module docs)."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[repr(sorted(req.args[1].items()))].append(i)
        results: list[str | None] = [None] * len(requests)
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        # stop strings are found in tokenizer.decode(ids): special tokens kept, as lm-eval does
        engine = LocalEngine(self.model, self.tokenizer, pad_id=self.tokenizer.pad_id or 0)
        for indices in groups.values():
            kwargs = dict(normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise ValueError(
                    f"max_gen_toks {max_gen_toks} leaves no room for the context "
                    f"in max_length {self.max_length}"
                )
            sampling = {k: kwargs[k] for k in _SAMPLING_KEYS if kwargs.get(k) is not None}
            if not kwargs.get("do_sample"):
                sampling = {}
            config = GenerationConfig(
                **{"temperature": 0.0, **sampling}, max_new_tokens=max_gen_toks, stop_strings=until
            )
            contexts = {
                i: self.tok_encode(requests[i].args[0])[-(self.max_length - max_gen_toks) :]
                for i in indices
            }
            order = sorted(indices, key=lambda i: (-len(contexts[i]), requests[i].args[0]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                prompts = [contexts[i] for i in chunk]
                out = generate_with(engine, prompts, None, config, self.tokenizer.stop_token_ids)
                for i, tokens in zip(chunk, out.sequences):
                    text = postprocess_generated_text(
                        self.tok_decode(tokens), stop=until, think_end_token=None
                    )
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------- chat

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template source lm-eval records: ``None`` when templating is off, the named
        template for a name, else the tokenizer's default."""
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str):
            if chat_template not in self.tokenizer.chat_templates:
                raise ValueError(
                    f"{self.tokenizer.name}: no chat template named "
                    f"{chat_template!r} (it has "
                    f"{sorted(self.tokenizer.chat_templates)})"
                )
            return self.tokenizer.chat_templates[chat_template]
        return self.tokenizer.chat_template

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render lm-eval's few-shot chat with the tokenizer's template: with the generation
        prompt, or (``add_generation_prompt=False``: lm-eval prefilled the assistant's
        answer) ending in the last message's text, its end-of-turn left off. A template that
        refuses a system message gets the chat without it."""
        try:
            return self._render(chat_history, add_generation_prompt)
        except jinja2.TemplateError:
            chat_history = [m for m in chat_history if m.get("role") != "system"]
            return self._render(chat_history, add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if self.tokenizer.chat_template is None:
            raise ValueError(
                f"{self.tokenizer.name}: has no chat template; drop "
                f"--apply-chat-template or give --chat-template"
            )
        if add_generation_prompt or not messages:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **self.chat_template_kwargs
            )
        # Continue the last message: render it with a marker (and a space) after its text and
        # cut there; a template that strips the text's trailing space stripped the marker's too.
        marker = f"<<continue-{uuid.uuid4().hex}>>"
        last = dict(messages[-1])
        last["content"] = f"{last['content']}{marker} "
        text = self.tokenizer.apply_chat_template(
            [*messages[:-1], last], add_generation_prompt=False, **self.chat_template_kwargs
        )
        if marker not in text:
            raise ValueError(
                f"the chat template drops the end of the last {last['role']!r} "
                f"message; it cannot be continued"
            )
        cut = text.rindex(marker)
        return text[:cut] if text.startswith(f"{marker} ", cut) else text[:cut].rstrip()

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records of the model in its results' ``config``."""
        params = list(self.model.parameters())
        return {
            "model_num_parameters": sum(p.numel() for p in params),
            "model_dtype": str(params[0].dtype) if params else "",
            "tokenizer_name": self.tokenizer_name,
        }


def task_manager(tasks: Sequence[str], include_path: str | os.PathLike[str] | None = None) -> Any:
    """An lm-eval ``TaskManager`` that knows ``tasks``: the tasks of ``include_path`` alone
    when they are all there (indexing lm-eval's thousands of built-in tasks takes seconds),
    else those and the built-in ones. Unknown names are an error with close matches.

    Example::

        tm = task_manager(["my_task"], include_path="eval_tasks/")
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path {include_path}: no such folder")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if set(local.match_tasks(list(tasks))) == set(tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = sorted(set(tasks) - set(manager.match_tasks(list(tasks))))
    if unknown:
        hints = [
            f"{name} (did you mean {', '.join(close)}?)" if close else name
            for name in unknown
            for close in [difflib.get_close_matches(name, manager.all_tasks, n=3)]
        ]
        raise ValueError(f"unknown lm-eval task(s): {'; '.join(hints)}")
    return manager


def run_lm_eval(
    loaded: LoadedCheckpoint,
    tasks: Sequence[str],
    *,
    include_path: str | os.PathLike[str] | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 8,
    limit: float | None = None,
    apply_chat_template: bool = False,
    output_path: str | os.PathLike[str] | None = None,
    max_length: int | None = None,
    seed: int = 0,
    print_table: bool = True,
) -> dict[str, Any]:
    """Run ``lm_eval.simple_evaluate`` on a loaded checkpoint (what ``tunesmith eval`` does):
    prints lm-eval's table, writes the results (with every sample's requests and responses)
    to ``output_path`` as JSON, and returns lm-eval's results dict. With
    ``apply_chat_template`` few-shot examples are turns of the chat.

    Example::

        out = run_lm_eval(load_checkpoint("out"), ["my_task"], include_path="tasks/")
        out["results"]["my_task"]["acc,none"]
        # -> 0.75
    """
    import lm_eval
    from lm_eval.utils import make_table

    if not tasks:
        raise ValueError("--tasks: give at least one task name")
    lm = TunesmithLM(loaded.model, loaded.tokenizer, batch_size=batch_size, max_length=max_length)
    if limit is not None and limit >= 1:
        limit = int(limit)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=apply_chat_template,
        task_manager=task_manager(tasks, include_path),
        log_samples=output_path is not None,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if results is None:  # a non-zero rank of a distributed lm-eval run
        return {}
    if print_table:
        print(make_table(results))
        if results.get("groups"):
            print(make_table(results, "groups"))
    if output_path is not None:
        path = Path(output_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
        print(f"results: {path}")
    return results
