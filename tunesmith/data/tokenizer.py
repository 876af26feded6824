"""The tokenizer: a Hugging Face tokenizer folder read with ``tokenizers`` and ``jinja2``.

:class:`Tokenizer` reads ``tokenizer.json`` (the fast-tokenizer file, which holds the whole
pipeline: normalizer, pre-tokenizer, BPE model, added tokens and the post-processor that adds
BOS), ``tokenizer_config.json`` (special tokens, chat template, ``model_max_length``),
``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` (newer layout),
``special_tokens_map.json`` (older layout) and ``generation_config.json`` (extra stop tokens).
It needs no ``transformers`` at run time, and its token ids equal ``transformers``'.

Chat data is rendered with the model's own template and tokenized as one text, like
``tokenizer.apply_chat_template(..., tokenize=True)``; :meth:`Tokenizer.tokenize_conversation`
also says which tokens are the assistant's replies (the loss mask).

Raw prompt/completion text (base models, no chat template) is tokenised as one text too:
:meth:`Tokenizer.encode_split` encodes ``prompt + completion`` and finds the boundary from the
character offsets, so the ids are exactly the concatenated text's, as the model would see that
text anywhere else. Encoding the completion on its own would not be: a SentencePiece-style
tokenizer (Llama 2, Mistral) prepends its "▁" prefix space to the start of every input, and
would train the model on a space the data does not have.

Prefix spaces and ``{{ bos_token }}`` in templates. :attr:`Tokenizer.prefix_space` says which
part of the pipeline adds a prefix space (a ``Metaspace`` pre-tokenizer with
``prepend_scheme="first"`` or ``"always"``, a ``Prepend("▁")`` normalizer, a ``ByteLevel``
pre-tokenizer with ``add_prefix_space``). Special tokens written in the text split it, and the
kinds differ on the text after them: ``"first"`` adds "▁" only at the very start of the input,
so ``"<s>Hello"`` gives ``<s> H ello`` where a text starting with "Hello" gives ``▁Hello``
(the template author must write ``{{ bos_token }} Hello`` to get the usual first word);
``"always"`` adds "▁" after every special token unless the text there starts with a space, so
both ``"<s>Hello"`` and ``"<s> Hello"`` give ``<s> ▁Hello``; a ``Prepend("▁")`` normalizer adds
it after every special token whatever follows, so ``"<s>Hello"`` gives ``<s> ▁Hello`` but
``"<s> Hello"`` gives a doubled ``▁▁``. :meth:`bos_spacing_warning`
renders the chat template once and says when the first word after BOS does not get the
tokens it gets at the start of a text; the datasets warn with it when they build.

Example::

    >>> from tunesmith.demo.assets import build_tokenizer, make_splits
    >>> folder = build_tokenizer("tok", make_splits(50, 0)[0])  # a tiny Qwen2.5-style folder
    >>> tok = Tokenizer.from_pretrained(folder)  # e.g. "path/to/Qwen2.5-0.5B-Instruct"
    >>> ids, mask = tok.tokenize_conversation(
    ...     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    >>> tok.decode([i for i, m in zip(ids, mask) if m])
    'Hello!<|im_end|>'
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Annotated, Any, Literal, overload

import jinja2
import tokenizers

from tunesmith.config import registry
from tunesmith.config.typecheck import Check
from tunesmith.data.chat_template import (
    TEMPLATE_NAMES,
    TemplateBudgetError,
    chat_template_hint,
    compile_template,
    control_tokens,
    load_template,
    render,
    render_chat,
)

__all__ = ["SPECIAL_TOKEN_KEYS", "Tokenizer", "TokenizerFolder", "tokenizer_folder_problem"]

SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""Named special tokens read from ``tokenizer_config.json`` (and passed to chat templates)."""

_REQUIRED_IN_VOCAB = ("bos_token", "eos_token", "pad_token")

# Tokens that end a turn or a document in common model families; each one that the vocabulary
# has joins ``stop_token_ids``.
_END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
)

# transformers writes this when a tokenizer has no length limit.
_NO_LIMIT = int(1e18)


def tokenizer_folder_problem(folder: str | PathLike[str]) -> str | None:
    """Why ``folder`` is not a tokenizer folder tunesmith reads (None: it is one): no such
    folder, or no ``tokenizer.json`` in it.

    Example::

        >>> tokenizer_folder_problem("nowhere")
        'nowhere: no such tokenizer folder'
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder}: no such tokenizer folder"
    if not (folder / "tokenizer.json").is_file() and (remote := _remote_tokenizer(folder)):
        return (
            f"{folder / 'tokenizer.json'}: missing, and the folder's tokenizer is {remote}, "
            "built by the folder's own code (auto_map, trust_remote_code): tunesmith runs no "
            "remote code; give a folder with a tokenizer.json (tokenizer.folder)"
        )
    if not (folder / "tokenizer.json").is_file():
        return (
            f"{folder / 'tokenizer.json'}: missing. tunesmith reads the fast-tokenizer file "
            "tokenizer.json; a folder with only tokenizer.model / vocab.json can be converted "
            "once with transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
        )
    return None


def _remote_tokenizer(folder: Path) -> str | None:
    """The class ``tokenizer_config.json`` names when its ``auto_map`` builds the tokenizer
    with the folder's own code (Kimi K2's tiktoken ``TikTokenTokenizer``), else None."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auto = config.get("auto_map") if isinstance(config, dict) else None
    code = auto.get("AutoTokenizer") if isinstance(auto, dict) else None
    if not code:
        return None
    code = next((c for c in code if c), None) if isinstance(code, list) else code
    return f"{config.get('tokenizer_class') or code} ({code})"


TokenizerFolder = Annotated[str | PathLike[str], Check(tokenizer_folder_problem, on_disk=True)]
"""The folder ``Tokenizer.from_pretrained`` reads: checked by :func:`tokenizer_folder_problem`
in ``tunesmith validate`` and every run before anything is built."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _read_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: Path, key: str) -> str | None:
    """A special token entry: a string, an AddedToken dict ``{"content": ...}``, or null."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    raise ValueError(
        f"{path}: {key} must be a string or an AddedToken object with a 'content' string, got {value!r}"
    )


class Tokenizer:
    """Token ids, special tokens and chat templates of one model.

    Args:
        backend: the ``tokenizers.Tokenizer`` (from ``tokenizer.json``).
        special_tokens: named special tokens, e.g. ``{"bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>"}`` (keys from :data:`SPECIAL_TOKEN_KEYS`).
        chat_template: the default template source, or named templates ``{"default": ...,
            "tool_use": ...}`` (``tool_use`` is picked when tools are given, as in transformers).
        extra_stop_ids: more ids that end generation (e.g. ``generation_config.json``'s
            ``eos_token_id`` list).
        model_max_length: the longest sequence the model takes, if known.
        name: where the tokenizer came from, for error messages.

    Attributes:
        special_tokens: the named special tokens that are set (``{"eos_token": ...}``).
        chat_templates: template sources by name (``"default"``, maybe ``"tool_use"``).
        added_tokens: contents of the added tokens (special or not), by id.
        stop_token_ids: ids that end generation, eos first: eos, the generation config's eos
            ids, and the end-of-turn tokens the vocabulary has (``<|eot_id|>``, ``<|eom_id|>``,
            ``<|end_of_text|>``, ``<|im_end|>``, ``<|endoftext|>``, ``<|end|>``,
            ``<end_of_turn>``). Their strings also end assistant replies in the loss mask.
        model_max_length: from ``tokenizer_config.json``; None when unset or unlimited.

    Most code builds one with :meth:`from_pretrained`.

    Example::

        >>> from tunesmith.demo.assets import build_tokenizer, make_splits
        >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
        >>> tok.decode(tok.encode("Hello world", add_special_tokens=False))
        'Hello world'
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        extra_stop_ids: Sequence[int] = (),
        model_max_length: int | None = None,
        name: str = "tokenizer",
    ) -> None:
        self._backend = backend
        # Encode exactly what we are given: tokenizer.json may carry padding/truncation settings.
        self._backend.no_padding()
        self._backend.no_truncation()
        self.name = name
        self.model_max_length = model_max_length
        self.special_tokens: dict[str, str] = {}
        for key, token in (special_tokens or {}).items():
            if key not in SPECIAL_TOKEN_KEYS:
                raise ValueError(f"{name}: unknown special token key {key!r}")
            if token is None:
                continue
            if key in _REQUIRED_IN_VOCAB and backend.token_to_id(token) is None:
                raise ValueError(f"{name}: {key} {token!r} is not in the vocabulary")
            self.special_tokens[key] = token
        if chat_template is None:
            self.chat_templates: dict[str, str] = {}
        elif isinstance(chat_template, str):
            self.chat_templates = {"default": chat_template}
        else:
            self.chat_templates = dict(chat_template)
        for template_name, source in self.chat_templates.items():
            try:
                compile_template(source)
            except jinja2.TemplateSyntaxError as e:
                raise ValueError(
                    f"{name}: chat template {template_name!r} does not compile: {e} (line {e.lineno})"
                ) from e
        self.added_tokens: list[str] = [
            added.content for _, added in sorted(backend.get_added_tokens_decoder().items())
        ]
        stops = [self.eos_id, *extra_stop_ids, *map(backend.token_to_id, _END_OF_TURN_TOKENS)]
        self.stop_token_ids: list[int] = list(dict.fromkeys(i for i in stops if i is not None))

    # -----------------------------------------------------------------------------------------
    # Loading

    @registry.component
    @classmethod
    def from_pretrained(
        cls, folder: TokenizerFolder, *, chat_template: str | PathLike[str] | None = None
    ) -> Tokenizer:
        """Load a Hugging Face tokenizer folder.

        Args:
            folder: a folder with ``tokenizer.json`` (``tokenizer_config.json``,
                ``chat_template.jinja``, ``special_tokens_map.json`` and
                ``generation_config.json`` are read when present).
            chat_template: use this template instead of the folder's: a shipped one
                (``"llama3"``, ``"qwen2_5"``, ``"qwen3"``), the name of one of the folder's
                named templates, or the path of a ``.jinja`` file (in a config:
                ``tokenizer.chat_template=qwen2_5``). A template whose control tokens
                (:func:`~tunesmith.data.chat_template.control_tokens`) the vocabulary lacks is
                refused, naming them.

        BOS/EOS insertion is the ``tokenizer.json`` post-processor's, as in transformers 5,
        which ignores ``add_bos_token`` / ``add_eos_token`` when that file exists.

        Special tokens follow transformers: ``tokenizer_config.json`` names them (strings or
        AddedToken objects); an older folder whose config has no ``added_tokens_decoder``
        takes them from ``special_tokens_map.json`` instead. Template files
        (``chat_template.jinja``, ``additional_chat_templates/``) win over the config's
        ``chat_template``.

        Example::

            tok = Tokenizer.from_pretrained("Llama-3.2-1B-Instruct")
            tok = Tokenizer.from_pretrained("Llama-3.2-1B", chat_template="llama3")
        """
        if (problem := tokenizer_folder_problem(folder)) is not None:
            raise FileNotFoundError(problem)
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_str(tokenizer_file.read_text(encoding="utf-8"))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ValueError(f"{tokenizer_file}: not a valid tokenizer.json ({e})") from e

        config_file = folder / "tokenizer_config.json"
        config = _read_json_object(config_file)
        special: dict[str, str | None] = {
            key: _token_content(config.get(key), config_file, key) for key in SPECIAL_TOKEN_KEYS
        }
        map_file = folder / "special_tokens_map.json"
        if "added_tokens_decoder" not in config and map_file.is_file():
            for key, value in _read_json_object(map_file).items():
                if key in SPECIAL_TOKEN_KEYS:
                    special[key] = _token_content(value, map_file, key)
        for key, token in special.items():
            if (
                token is not None
                and key in _REQUIRED_IN_VOCAB
                and backend.token_to_id(token) is None
            ):
                raise ValueError(
                    f"{config_file}: {key} {token!r} is not in the vocabulary of {tokenizer_file}"
                )

        templates = own_templates = _folder_templates(folder, config, config_file)
        if chat_template is not None:
            templates = {"default": _chosen_template(chat_template, templates, folder)}
            missing = [
                t for t in control_tokens(templates["default"]) if backend.token_to_id(t) is None
            ]
            if missing:
                raise ValueError(
                    f"chat_template={str(chat_template)!r} does not fit {folder}: its control "
                    f"tokens {', '.join(missing)} are not in the vocabulary of {tokenizer_file} "
                    "(a template of another model family); leave chat_template unset for the "
                    "folder's own template, or name one whose tokens this vocabulary has"
                )

        generation_file = folder / "generation_config.json"
        eos = _read_json_object(generation_file).get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(i, int) for i in eos_ids):
            raise ValueError(f"{generation_file}: eos_token_id must be an int or a list of ints")

        max_length = config.get("model_max_length")
        if not isinstance(max_length, (int, float)) or max_length >= _NO_LIMIT:
            max_length = None
        tokenizer = cls(
            backend,
            special_tokens={k: v for k, v in special.items() if v is not None},
            chat_template=templates or None,
            extra_stop_ids=eos_ids,
            model_max_length=None if max_length is None else int(max_length),
            name=str(folder),
        )
        tokenizer.template_files = _template_files(folder, own_templates, chat_template)
        return tokenizer

    def fingerprint(self) -> str:
        """A sha256 of everything here that decides token ids and loss masks: the whole
        ``tokenizer.json`` pipeline, the special tokens, the chat templates and the stop ids
        (the key of :mod:`~tunesmith.data.token_cache`; the folder's path is not part of it).

        Example::

            >>> from tunesmith.demo.assets import build_tokenizer, make_splits
            >>> folder = build_tokenizer("tok", make_splits(50, 0)[0])
            >>> len(Tokenizer.from_pretrained(folder).fingerprint())
            64
        """
        if getattr(self, "_fingerprint", None) is None:
            digest = hashlib.sha256(self._backend.to_str().encode())
            digest.update(
                json.dumps(
                    [self.special_tokens, self.chat_templates, self.stop_token_ids], sort_keys=True
                ).encode()
            )
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    # -----------------------------------------------------------------------------------------
    # Vocabulary

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (``len(hf_tokenizer)``, not its
        ``vocab_size``, which leaves the added tokens out). Ids run from 0 to ``vocab_size - 1``."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. ``"<|im_end|>"``), or None if it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None if the id is out of range."""
        return self._backend.id_to_token(token_id)

    def _special_id(self, key: str) -> int | None:
        token = self.special_tokens.get(key)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_id(self) -> int | None:
        """Id of the BOS token, or None (Qwen has none)."""
        return self._special_id("bos_token")

    @property
    def eos_id(self) -> int | None:
        """Id of the EOS token named by the tokenizer config, or None."""
        return self._special_id("eos_token")

    @property
    def pad_id(self) -> int | None:
        """Id used for padding: the pad token's; when the tokenizer names none (Llama 3), the
        EOS id. Padded positions are masked out of attention and loss, so the id only has to
        exist. None only when the tokenizer has neither."""
        pad = self._special_id("pad_token")
        return pad if pad is not None else self.eos_id

    @property
    def unk_id(self) -> int | None:
        """Id of the unknown token, or None."""
        return self._special_id("unk_token")

    @property
    def chat_template(self) -> str | None:
        """Source of the default chat template, or None."""
        return self.chat_templates.get("default")

    # -----------------------------------------------------------------------------------------
    # Text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        ``add_special_tokens`` runs the post-processor of ``tokenizer.json``, as transformers
        does: Llama 3 prepends ``<|begin_of_text|>``, Qwen adds nothing.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_split(
        self, prompt: str, completion: str, *, add_special_tokens: bool = True
    ) -> tuple[list[int], int]:
        """Token ids of ``prompt + completion`` as one text, and how many belong to the prompt.

        ``ids`` equals ``encode(prompt + completion)``: the completion is not tokenised on its
        own, so a tokenizer with a prefix space (:attr:`prefix_space`) does not put "▁" before
        it, and tokens that merge across the boundary are those of the whole text. The prompt
        is the first ``n_prompt`` tokens, found from the backend's character offsets:

        - the tokens the post-processor adds before the text (BOS) are the prompt's; those it
          adds after it (an EOS, BERT's ``[SEP]``) are the completion's;
        - a text token is the prompt's when it ends at or before ``len(prompt)``;
        - a token that straddles the boundary (starts in the prompt, ends in the completion,
          e.g. ``" 42"`` after a prompt ending in a space, or a word split by the boundary) is
          the completion's, so it is trained: the model has to produce it for the text to
          read as the data says. The prompt tokens then cover the prompt's text less its last
          characters and differ from ``encode(prompt)`` at the end.

        Example::

            >>> from tunesmith.demo.assets import build_tokenizer, make_splits
            >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
            >>> ids, n = tok.encode_split("Q: 2+2=", "4")
            >>> ids == tok.encode("Q: 2+2=4"), tok.decode(ids[n:])
            (True, '4')
        """
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise TypeError(f"encode_split() {name} must be a str, got {type(value).__name__}")
        encoding = self._backend.encode(prompt + completion, add_special_tokens=add_special_tokens)
        boundary = len(prompt)
        n_prompt = 0
        in_text = False
        for sequence_id, (_, end) in zip(encoding.sequence_ids, encoding.offsets, strict=True):
            if sequence_id is None:  # added by the post-processor: BOS before, EOS/SEP after
                if in_text:
                    break
            elif end > boundary:
                break
            else:
                in_text = True
            n_prompt += 1
        return list(encoding.ids), n_prompt

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of token ids (no clean-up of spaces, like transformers for BPE tokenizers)."""
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def prefix_space(self) -> str | None:
        """The part of the pipeline that puts a space before the input's first word, or None.

        ``"Metaspace(prepend_scheme='first')"`` / ``'always'`` (Llama 2 and Mistral converted
        by recent transformers), ``"Prepend('▁')"`` (a normalizer; older Llama 2 conversions)
        or ``"ByteLevel(add_prefix_space=True)"``; None for Llama 3, Qwen, GPT-2 and BERT.
        See the module docs for what it means for text after special tokens.

        Example (a Mistral tokenizer)::

            tok.prefix_space
            # -> "Metaspace(prepend_scheme='first')"
        """
        data = json.loads(self._backend.to_str())
        for component in (data.get("normalizer"), data.get("pre_tokenizer")):
            found = _prefix_space(component)
            if found is not None:
                return found
        return None

    def bos_spacing_warning(self, **template_kwargs: Any) -> str | None:
        """A warning when the chat template writes BOS right before text whose first word then
        gets other tokens than at the start of a text, or None.

        Only tokenizers with a :attr:`prefix_space` are checked. The template is rendered once
        on a short conversation; the first word after BOS is compared with the same text
        encoded on its own (leading spaces removed). A template that fails to render on that
        conversation is not judged (None).

        Example (a Mistral tokenizer)::

            tok.bos_spacing_warning()
            # -> "...: the chat template writes '<s>' directly before 'Hello'..."
        """
        bos = self.special_tokens.get("bos_token")
        kind = self.prefix_space
        if bos is None or kind is None or not self.chat_templates:
            return None
        probe = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Yes"}]
        try:
            text = self.apply_chat_template(probe, **template_kwargs)
        except Exception:  # a template with its own demands: nothing to judge here
            return None
        at = text.find(bos)
        if at < 0:
            return None
        rest = text[at + len(bos) :]
        word = rest.lstrip(" ")
        if not word or any(word.startswith(t) for t in self.added_tokens if t):
            return None
        first_word = word.split()[0]
        start = at + len(bos)
        end = start + len(rest) - len(word) + len(first_word)
        encoding = self._backend.encode(text, add_special_tokens=False)
        after = [t for t, (a, _) in zip(encoding.tokens, encoding.offsets) if start <= a < end]
        expected = self._backend.encode(first_word, add_special_tokens=False).tokens
        if after == expected:
            return None
        return (
            f"{self.name}: the chat template writes {bos!r} directly before {rest[:12]!r}; with "
            f"this tokenizer's {kind} the first word after it is tokenised as {after[:3]} but "
            f"as {expected[:3]} at the start of a text. Check the template's spacing after "
            "{{ bos_token }} (see tunesmith.data.tokenizer's docs on prefix spaces)"
        )

    # -----------------------------------------------------------------------------------------
    # Chat

    def _template(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        if not self.chat_templates:
            raise ValueError(
                f"{self.name}: the tokenizer has no chat template (tokenizer_config.json has no "
                f"chat_template and there is no chat_template.jinja): {chat_template_hint()}"
            )
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise ValueError(
            f"{self.name}: the tokenizer has named chat templates "
            f"{sorted(self.chat_templates)} but no 'default' one: "
            f"{chat_template_hint('<one of them>')}"
        )

    def _budget_error(self, error: TemplateBudgetError, tools: Any) -> TemplateBudgetError:
        """``error`` naming the file the template came from (a template over its budget)."""
        files = getattr(self, "template_files", {})
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        return TemplateBudgetError(f"{files.get(name, self.name)}: {error}")

    def _template_kwargs(self, template_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        # Like transformers: the named special tokens are template variables, kwargs win.
        return {**self.special_tokens, **template_kwargs}

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to text with the chat template (``tokenize=False`` in HF).

        ``tools`` are JSON function schemas; ``template_kwargs`` become template variables
        (``enable_thinking=False``, ``date_string=...``). The special tokens (``bos_token``,
        ``eos_token``, ...) are template variables too.

        Example::

            >>> from tunesmith.demo.assets import build_tokenizer, make_splits
            >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
            >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}],
            ...                         add_generation_prompt=True)
            '<|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
        """
        try:
            return render(
                self._template(tools),
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self._template_kwargs(template_kwargs),
            )
        except TemplateBudgetError as e:
            raise self._budget_error(e, tools) from None

    @overload
    def tokenize_conversation(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        add_generation_prompt: bool = ...,
        return_spans: Literal[False] = ...,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int]]: ...

    @overload
    def tokenize_conversation(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        add_generation_prompt: bool = ...,
        return_spans: Literal[True],
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int], list[tuple[int, int]]]: ...

    def tokenize_conversation(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        return_spans: bool = False,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[int]] | tuple[list[int], list[int], list[tuple[int, int]]]:
        """Token ids of a conversation and the mask of the assistant's replies.

        The ids equal ``transformers``' ``apply_chat_template(..., tokenize=True)``: the
        rendered text encoded without adding special tokens (the template writes BOS itself).

        ``assistant_mask[t]`` is 1 when token ``t`` belongs to an assistant reply: what the
        model generates after the generation prompt, through the end-of-turn token that closes
        the reply (``<|eot_id|>``, ``<|im_end|>``), but not the assistant header before it nor
        the newline after it. Templates with ``{% generation %}`` tags define the replies
        themselves, as in transformers' ``return_assistant_tokens_mask``; for other templates
        see :func:`tunesmith.data.chat_template.render_chat`. A token is in a reply when its
        characters overlap the reply's text.

        With ``return_spans=True`` a third item lists each reply's token span ``(start, end)``
        (end exclusive), in conversation order; ``mask[start:end]`` is all ones. The last span
        alone gives "train on the last turn".

        Example::

            >>> from tunesmith.demo.assets import build_tokenizer, make_splits
            >>> tok = Tokenizer.from_pretrained(build_tokenizer("tok", make_splits(50, 0)[0]))
            >>> messages = [{"role": role, "content": text} for role, text in [
            ...     ("user", "Hi"), ("assistant", "Hello!"), ("user", "Bye"), ("assistant", "Goodbye!")]]
            >>> ids, mask, spans = tok.tokenize_conversation(messages, return_spans=True)
            >>> start, end = spans[-1]
            >>> tok.decode(ids[start:end]), all(mask[start:end]), len(spans)
            ('Goodbye!<|im_end|>', True, 2)
        """
        try:
            chat = render_chat(
                self._template(tools),
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                control_tokens=self.added_tokens,
                end_tokens=[self._backend.id_to_token(i) for i in self.stop_token_ids],
                **self._template_kwargs(template_kwargs),
            )
        except TemplateBudgetError as e:
            raise self._budget_error(e, tools) from None
        encoding = self._backend.encode(chat.text, add_special_tokens=False)
        mask, spans = _token_spans(encoding.offsets, chat.assistant_spans)
        if return_spans:
            return encoding.ids, mask, spans
        return encoding.ids, mask

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


def _prefix_space(component: Any) -> str | None:
    """The prefix-space step of a normalizer / pre-tokenizer JSON object, or None."""
    if not isinstance(component, dict):
        return None
    for child in component.get("normalizers") or component.get("pretokenizers") or ():
        found = _prefix_space(child)
        if found is not None:
            return found
    kind = component.get("type")
    if kind == "Metaspace":
        scheme = component.get("prepend_scheme")
        if scheme is None:  # tokenizers < 0.14 wrote add_prefix_space
            scheme = "always" if component.get("add_prefix_space", True) else "never"
        return None if scheme == "never" else f"Metaspace(prepend_scheme={scheme!r})"
    if kind == "Prepend" and component.get("prepend"):
        return f"Prepend({component['prepend']!r})"
    if kind == "ByteLevel" and component.get("add_prefix_space"):
        return "ByteLevel(add_prefix_space=True)"
    return None


def _folder_templates(folder: Path, config: dict[str, Any], config_file: Path) -> dict[str, str]:
    """Named chat templates of a folder; files win over ``tokenizer_config.json`` (as in HF)."""
    templates: dict[str, str] = {}
    default_file = folder / "chat_template.jinja"
    if default_file.is_file():
        templates["default"] = default_file.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates
    entry = config.get("chat_template")
    if entry is None:
        return {}
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in entry
    ):
        return {t["name"]: t["template"] for t in entry}
    raise ValueError(
        f"{config_file}: chat_template must be a string or a list of "
        '{"name": ..., "template": ...} objects'
    )


def _template_files(
    folder: Path, templates: Mapping[str, str], choice: str | PathLike[str] | None
) -> dict[str, str]:
    """Where each template came from (for errors): ``chat_template.jinja``,
    ``additional_chat_templates/NAME.jinja``, ``tokenizer_config.json``, or the chosen file."""

    def origin(name: str) -> str:
        for path in (
            folder / "chat_template.jinja",
            folder / f"additional_chat_templates/{name}.jinja",
        ):
            if path.is_file() and (name == "default") == (path.name == "chat_template.jinja"):
                return str(path)
        return str(folder / "tokenizer_config.json")

    if choice is None:
        return {name: origin(name) for name in templates}
    if isinstance(choice, str) and choice in TEMPLATE_NAMES and choice not in templates:
        return {"default": f"the shipped template {choice!r}"}
    return {"default": origin(choice) if choice in templates else str(choice)}


def _chosen_template(
    choice: str | PathLike[str], templates: Mapping[str, str], folder: Path
) -> str:
    if isinstance(choice, str) and choice in templates:
        return templates[choice]
    if isinstance(choice, str) and choice in TEMPLATE_NAMES:
        return load_template(choice)
    path = Path(choice)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    named = f", the folder's templates {sorted(templates)}" if templates else ""
    raise ValueError(
        f"chat_template={str(choice)!r} for {folder}: not a shipped template "
        f"({', '.join(map(repr, TEMPLATE_NAMES))}){named}, nor an existing .jinja file"
    )


def _token_spans(
    offsets: Sequence[tuple[int, int]], char_spans: Sequence[tuple[int, int]]
) -> tuple[list[int], list[tuple[int, int]]]:
    """Mask of the tokens that overlap a character span, and each span's token range.

    Token ``[a, b)`` overlaps span ``[s, e)`` when ``b > s`` and ``a < e``; one pass over tokens
    and spans in order, the same rule and walk as transformers' ``return_assistant_tokens_mask``.
    """
    mask = [0] * len(offsets)
    first: list[int | None] = [None] * len(char_spans)
    last = [0] * len(char_spans)
    j = 0
    for t, (a, b) in enumerate(offsets):
        while j < len(char_spans) and a >= char_spans[j][1]:
            j += 1
        if j == len(char_spans):
            break
        k = j
        while k < len(char_spans) and b > char_spans[k][0]:  # usually one span; more if b is long
            mask[t] = 1
            if first[k] is None:
                first[k] = t
            last[k] = t + 1
            k += 1
    ranges = []
    for (start, _), lo, hi in zip(char_spans, first, last):
        if lo is None:  # an empty reply: an empty range where it would be
            lo = hi = sum(1 for _, b in offsets if b <= start)
        ranges.append((lo, hi))
    return mask, ranges
