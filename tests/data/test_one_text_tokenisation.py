"""Raw prompt/completion (and raw preference) text is tokenised as one text (issue #21).

Each tokenizer kind is trained here with ``tokenizers``: SentencePiece-style (Metaspace with
``prepend_scheme="first"`` and ``"always"``, and the older ``Prepend("▁")`` normalizer),
byte-level BPE (the Llama 3 / Qwen factories) and WordPiece (BERT-like). The reference for
every sample is computed without offsets: the ids are ``encode(prompt + completion)`` plus EOS,
and the prompt is the longest common prefix of ``encode(prompt)`` and those ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from tests.data.tokenizer_factory import corpus, make_tokenizer_folder
from tunesmith.data.labels import IGNORE_INDEX
from tunesmith.data.preference_dataset import PreferenceDataset
from tunesmith.data.report import PROMPT_MISMATCH
from tunesmith.data.sft_dataset import SFTDataset
from tunesmith.data.tokenizer import Tokenizer

SPECIALS = ["<unk>", "<s>", "</s>"]

# Prompts ending in a space or a newline, completions starting with punctuation or a space,
# unicode, and a boundary in the middle of a word.
SAMPLES = [
    ("two plus two is", " four"),
    ("2+2=", "4"),
    ("Q: what is the weather in paris?\n", "It is hot."),
    ("Answer: ", "yes"),
    ("Hello", ", world!"),
    ("The city is", ".  Rome, oslo"),
    ("café au", " lait — très bien ✓"),
    ("line one\n\n", "- item\n- two"),
    ('{"name": ', '"paris", "n": 3}'),
    ("think step by st", "ep, then answer"),
]


def _sentencepiece_style(kind: str) -> Backend:
    if kind == "unigram_always":
        backend = Backend(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=400, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False
        )
    else:
        backend = Backend(models.BPE(unk_token="<unk>", byte_fallback=True))
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    if kind == "prepend_normalizer":  # older Llama 2 tokenizer.json: no pre-tokenizer
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0)]
        )
        texts = ["▁" + line.replace(" ", "▁") for line in corpus()]
    else:
        scheme = "always" if kind == "unigram_always" else "first"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
        backend.decoder = decoders.Metaspace(prepend_scheme=scheme)
        texts = corpus()
    backend.train_from_iterator(texts, trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    return backend


def _wordpiece() -> Backend:
    backend = Backend(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        special_tokens=[(t, backend.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
    )
    return backend


KINDS = (
    "metaspace_first",
    "unigram_always",
    "prepend_normalizer",
    "llama3",
    "qwen2_5",
    "wordpiece",
)
SENTENCEPIECE_KINDS = KINDS[:3]


@pytest.fixture(scope="module", params=KINDS)
def tok(request, tmp_path_factory) -> Tokenizer:
    kind = request.param
    if kind in ("llama3", "qwen2_5"):
        folder = tmp_path_factory.mktemp(kind)
        return Tokenizer.from_pretrained(make_tokenizer_folder(folder, kind, chat_template=None))
    if kind == "wordpiece":
        special = {"bos_token": "[CLS]", "eos_token": "[SEP]", "pad_token": "[PAD]"}
        return Tokenizer(_wordpiece(), special_tokens=special, name=kind)
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return Tokenizer(_sentencepiece_style(kind), special_tokens=special, name=kind)


def _reference(tok: Tokenizer, prompt: str, completion: str) -> tuple[list[int], int]:
    """(ids, n_prompt) without offsets: the whole text's ids + EOS; the prompt is the common
    prefix with ``encode(prompt)`` (a token that differs there straddles the boundary)."""
    ids = tok.backend.encode(prompt + completion).ids
    if ids[-1] != tok.eos_id:
        ids = [*ids, tok.eos_id]
    alone = tok.backend.encode(prompt).ids
    n = next((i for i, (a, b) in enumerate(zip(alone, ids)) if a != b), min(len(alone), len(ids)))
    return ids, n


def _shifted(ids: list[int], n_prompt: int) -> list[int]:
    return [ids[i + 1] if i + 1 >= n_prompt else IGNORE_INDEX for i in range(len(ids) - 1)] + [
        IGNORE_INDEX
    ]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_sft_raw_prompt_completion_is_the_text_tokenised_once(tok, tmp_path):
    rows = [{"prompt": p, "completion": c} for p, c in SAMPLES]
    ds = SFTDataset(
        tok,
        source=_jsonl(tmp_path / "pc.jsonl", rows),
        format="prompt_completion",
        use_chat_template=False,
    )
    assert len(ds) == len(SAMPLES)
    for (prompt, completion), sample in zip(SAMPLES, ds, strict=True):
        ids, n_prompt = _reference(tok, prompt, completion)
        assert sample["input_ids"] == ids, (tok.name, prompt, completion)
        assert sample["labels"] == _shifted(ids, n_prompt), (tok.name, prompt, completion)
        if tok.bos_id is not None:  # BOS once, from the post-processor
            assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


def test_encode_split_boundary(tok):
    for prompt, completion in SAMPLES:
        ids, n = tok.encode_split(prompt, completion)
        assert ids == tok.encode(prompt + completion)
        encoding = tok.backend.encode(prompt + completion)
        assert all(end <= len(prompt) for _, end in encoding.offsets[:n])
        assert encoding.sequence_ids[n] is not None and encoding.offsets[n][1] > len(prompt)
    # An empty prompt: only BOS (if any) is the prompt's.
    _, n = tok.encode_split("", "hello there")
    assert n == (1 if tok.bos_id is not None else 0)


def test_straddling_token_is_the_completions(tok):
    # "st" + "ep": the boundary cuts a word; whatever token holds both sides is trained.
    prompt, completion = "think step by st", "ep, then answer"
    ids, n = tok.encode_split(prompt, completion)
    encoding = tok.backend.encode(prompt + completion)
    covered = "".join(prompt + completion)[encoding.offsets[n][0] :]
    assert covered.endswith(completion) and len(covered) > len(completion)
    assert all(end <= len(prompt) for _, end in encoding.offsets[:n])


@pytest.mark.parametrize("kind", SENTENCEPIECE_KINDS)
def test_sentencepiece_completion_gets_no_prefix_space(kind):
    """The "▁" case: encoding the completion alone (the old rule) adds a space the data lacks."""
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tok = Tokenizer(_sentencepiece_style(kind), special_tokens=special, name=kind)
    ids, n = tok.encode_split("2+2=", "4")
    assert tok.id_to_token(ids[n]) == "4"  # no "▁4": the text has no space there
    alone = tok.encode("4", add_special_tokens=False)
    assert tok.id_to_token(alone[0]).startswith("▁")  # what the old rule trained on
    assert tok.encode("2+2=") + alone != ids


def test_prefix_space_detection(tok):
    expected = {
        "metaspace_first": "Metaspace(prepend_scheme='first')",
        "unigram_always": "Metaspace(prepend_scheme='always')",
        "prepend_normalizer": "Prepend('▁')",
    }
    assert tok.prefix_space == expected.get(tok.name)


@pytest.mark.parametrize(
    ("kind", "template", "warns"),
    [
        ("metaspace_first", "{{ bos_token }}{{ messages[0]['content'] }}", True),
        ("metaspace_first", "{{ bos_token }} {{ messages[0]['content'] }}", False),
        ("unigram_always", "{{ bos_token }}{{ messages[0]['content'] }}", False),
        ("unigram_always", "{{ bos_token }} {{ messages[0]['content'] }}", False),
        ("prepend_normalizer", "{{ bos_token }}{{ messages[0]['content'] }}", False),
        ("prepend_normalizer", "{{ bos_token }} {{ messages[0]['content'] }}", True),
    ],
)
def test_bos_spacing_warning(kind, template, warns):
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tok = Tokenizer(
        _sentencepiece_style(kind), special_tokens=special, chat_template=template, name=kind
    )
    warning = tok.bos_spacing_warning()
    assert (warning is not None) == warns, warning
    if warns:
        assert "'<s>'" in warning and tok.prefix_space in warning


def test_bos_spacing_warning_none_without_prefix_space(tmp_path):
    folder = make_tokenizer_folder(tmp_path / "l3", "llama3")
    assert Tokenizer.from_pretrained(folder).bos_spacing_warning() is None


PAIRS = [
    ("two plus two is", " four", " five"),
    ("Q: what is the weather in paris?\n", "It is hot.", "- cold"),
    ("2+2=", "4", "5!"),
    ("café au", " lait", ", no"),
]


def test_preference_raw_text_is_each_side_tokenised_once(tok, tmp_path):
    rows = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    ds = PreferenceDataset(
        tok,
        source=_jsonl(tmp_path / "prefs.jsonl", rows),
        format="prompt_chosen_rejected",
        use_chat_template=False,
    )
    assert len(ds) == len(PAIRS)
    for (prompt, chosen, rejected), sample in zip(PAIRS, ds, strict=True):
        prompt_lens = set()
        for side, reply in (("chosen", chosen), ("rejected", rejected)):
            ids, n_prompt = _reference(tok, prompt, reply)
            assert sample[f"{side}_input_ids"] == ids, (tok.name, prompt, reply)
            assert sample[f"{side}_labels"] == _shifted(ids, n_prompt), (tok.name, prompt, reply)
            prompt_lens.add(n_prompt)
        assert prompt_lens == {sample["prompt_len"]}


def test_preference_raw_prompt_mismatch_and_arguments(tmp_path):
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    tok = Tokenizer(_sentencepiece_style("metaspace_first"), special_tokens=special)
    ok = {"prompt": "two plus", "chosen": " two", "rejected": " four"}
    # "wo" + "rd" merges across the boundary, "wo" + " x" does not: the prompts differ.
    bad = {"prompt": "the wo", "chosen": "rd", "rejected": " x"}
    ids_c, n_c = tok.encode_split("the wo", "rd")
    ids_r, n_r = tok.encode_split("the wo", " x")
    assert ids_c[:n_c] != ids_r[:n_r]  # the premise of the row
    path = _jsonl(tmp_path / "p.jsonl", [ok, bad])
    ds = PreferenceDataset(
        tok,
        source=path,
        format="prompt_chosen_rejected",
        use_chat_template=False,
        on_bad_row="skip",
    )
    assert len(ds) == 1 and ds.report.skipped == {PROMPT_MISMATCH: 1}
    with pytest.raises(ValueError, match="prompt_chosen_rejected"):
        PreferenceDataset(tok, source=path, format="messages", use_chat_template=False)
    with pytest.raises(ValueError, match="system_prompt"):
        PreferenceDataset(
            tok,
            source=path,
            format="prompt_chosen_rejected",
            use_chat_template=False,
            system_prompt="be kind",
        )
