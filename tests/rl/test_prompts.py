"""RL prompts: datasets from real JSONL/Parquet files (bad rows reported by row), reasoning-gym
tasks checked against reasoning_gym itself and its scorers, encode_prompt against the chat
template rendered and encoded independently (and transformers), and the prompt stream's
order, data-parallel split and exact resume against a hand-built reference."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import reasoning_gym
import torch
import transformers

from tests.data.tokenizer_factory import make_tokenizer_folder
from tunesmith.data.report import BadRowError, DataError
from tunesmith.data.tokenizer import Tokenizer
from tunesmith.rl.prompts import (
    Prompt,
    PromptDataset,
    PromptStream,
    ReasoningGymPrompts,
    encode_prompt,
)


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


ROWS = [
    {"prompt": "What is 2+3?", "answer": "5", "level": 1},
    {"prompt": "What is 7*6?", "answer": "42", "level": 2},
    {"prompt": "Name a prime above 10.", "answer": "11", "level": 3},
]


# ---------------------------------------------------------------------------------------------
# PromptDataset


def test_jsonl_and_parquet_give_the_same_prompts(tmp_path: Path) -> None:
    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    parquet = tmp_path / "p.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    expected = [
        Prompt(i, [user(r["prompt"])], r["answer"], {"level": r["level"]})
        for i, r in enumerate(ROWS)
    ]
    for source in (jsonl, parquet):
        ds = PromptDataset(str(source), metadata_columns=["level"])
        assert list(ds) == expected
        assert len(ds) == 3 and ds[1].answer == "42"
        assert ds.report.rows == 3 and ds.report.samples == 3 and ds.report.num_skipped == 0


def test_messages_column_and_chat_lists(tmp_path: Path) -> None:
    system = {"role": "system", "content": "Be brief."}
    history = [user("hi"), {"role": "assistant", "content": "hello"}, user("2+2?")]
    rows = [{"messages": [system, user("1+1?")], "answer": "2"}, {"messages": history, "answer": 4}]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    ds = PromptDataset(str(path), messages_column="messages")
    assert ds[0].messages == [system, user("1+1?")] and ds[0].answer == "2"
    assert ds[1].messages == history and ds[1].answer == 4  # answers keep their JSON type
    # Auto-detected column; a row's own system message wins over system_prompt.
    auto = PromptDataset(str(path), system_prompt="S")
    assert auto.prompt_column == "messages"
    assert auto[0].messages == [system, user("1+1?")]
    assert auto[1].messages == [{"role": "system", "content": "S"}, *history]
    # A prompt column may hold chat lists too (TRL's conversational prompts), here in Parquet.
    parquet = tmp_path / "m.parquet"
    pq_rows = [{"prompt": r["messages"], "sol": str(r["answer"])} for r in rows]
    datasets.Dataset.from_list(pq_rows).to_parquet(str(parquet))
    pq = PromptDataset(str(parquet), prompt_column="prompt", answer_column="sol")
    assert [p.messages for p in pq] == [[system, user("1+1?")], history]
    assert [p.answer for p in pq] == ["2", "4"]


def test_system_prompt_and_template(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:2])
    template = "Solve: {prompt}\nAnswer inside <answer></answer> or {{braces}}."
    ds = PromptDataset(str(path), system_prompt="You are a math tutor.", prompt_template=template)
    assert ds[0].messages == [
        {"role": "system", "content": "You are a math tutor."},
        user("Solve: What is 2+3?\nAnswer inside <answer></answer> or {braces}."),
    ]
    # The template applies to the last user message of a chat list only.
    rows = [
        {"messages": [user("a"), {"role": "assistant", "content": "b"}, user("c")], "answer": 1}
    ]
    chat = PromptDataset(str(write_jsonl(tmp_path / "c.jsonl", rows)), prompt_template="<{prompt}>")
    assert [m["content"] for m in chat[0].messages] == ["a", "b", "<c>"]
    for bad in ("Solve {question}", "no field", "Use \\boxed{}: {prompt}", "{prompt"):
        with pytest.raises(ValueError, match="prompt_template"):
            PromptDataset(str(path), prompt_template=bad)


BAD_ROWS = [
    {"prompt": "ok 0", "answer": "0"},
    {"question": "no prompt column", "answer": "1"},  # row 1: missing_field
    {"prompt": 42, "answer": "2"},  # row 2: wrong_type
    {"prompt": [user("q"), {"role": "assistant", "content": "r"}], "answer": "3"},  # row 3
    {"prompt": "no answer"},  # row 4: missing_field
    {"prompt": "ok 5", "answer": "5"},
]


def test_bad_rows_are_reported_by_row_or_skipped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.raises(BadRowError, match=r"bad row at line 2: missing_field.*'prompt'") as e:
        PromptDataset(str(path))
    assert e.value.row == 1 and e.value.reason == "missing_field"
    ds = PromptDataset(str(path), on_bad_row="skip")
    assert [p.index for p in ds] == [0, 5]
    assert [p.messages for p in ds] == [[user("ok 0")], [user("ok 5")]]
    assert ds.report.rows == 6 and ds.report.samples == 2
    assert ds.report.skipped == {"missing_field": 2, "wrong_type": 1, "roles_out_of_order": 1}
    assert ds.report.examples == {  # by line
        "missing_field": [2, 5],
        "wrong_type": [3],
        "roles_out_of_order": [4],
    }
    assert "int" in ds.report.details["wrong_type"]
    assert "must end with a user message" in ds.report.details["roles_out_of_order"]
    # The first bad row after a good one, met with on_bad_row="error", names its row.
    only_type = write_jsonl(tmp_path / "t.jsonl", [BAD_ROWS[0], BAD_ROWS[2]])
    with pytest.raises(BadRowError, match=r"bad row at line 2: wrong_type: column 'prompt' is int"):
        PromptDataset(str(only_type))
    with pytest.raises(DataError, match="every row was skipped"):
        PromptDataset(str(write_jsonl(tmp_path / "all.jsonl", BAD_ROWS[1:3])), on_bad_row="skip")


def test_columns_answers_and_max_samples(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    with pytest.raises(DataError, match="answer_column 'answer' is not in the data.*None"):
        PromptDataset(str(path))
    no_answers = PromptDataset(str(path), answer_column=None)
    assert [p.answer for p in no_answers] == [None, None, None]
    with pytest.raises(DataError, match="metadata column 'level'"):
        PromptDataset(str(path), answer_column=None, metadata_columns=["level"])
    with pytest.raises(DataError, match="neither a 'prompt' nor a 'messages'"):
        PromptDataset(str(write_jsonl(tmp_path / "q.jsonl", [{"q": "x"}])))
    with pytest.raises(ValueError, match="not both"):
        PromptDataset(str(path), prompt_column="prompt", messages_column="messages")
    with pytest.raises(ValueError, match="on_bad_row"):
        PromptDataset(str(path), on_bad_row="ignore")
    first_two = PromptDataset(str(write_jsonl(tmp_path / "r.jsonl", ROWS)), max_samples=2)
    assert [p.answer for p in first_two] == ["5", "42"]


# ---------------------------------------------------------------------------------------------
# ReasoningGymPrompts


def test_reasoning_gym_mixture_is_deterministic_and_scorable() -> None:
    tasks = ["basic_arithmetic", "chain_sum"]
    gym = ReasoningGymPrompts(tasks, size=7, seed=3)
    again = ReasoningGymPrompts(tasks, size=7, seed=3)
    assert list(gym) == list(again)
    other = ReasoningGymPrompts(tasks, size=7, seed=4)
    assert [p.messages for p in gym] != [p.messages for p in other]
    # Round-robin: prompt i is entry i // 2 of task i % 2, generated by reasoning_gym itself.
    reference = {
        "basic_arithmetic": reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=3),
        "chain_sum": reasoning_gym.create_dataset("chain_sum", size=3, seed=3),
    }
    for i, prompt in enumerate(gym):
        task = tasks[i % 2]
        entry = reference[task][i // 2]
        assert prompt.index == i and prompt.metadata["task"] == task
        assert prompt.messages == [user(entry["question"])]
        assert prompt.answer == entry["answer"]
        gym_entry = prompt.metadata["gym_entry"]
        assert json.loads(json.dumps(gym_entry)) == gym_entry  # plain JSON data
        assert gym_entry["metadata"]["source_dataset"] == task
        score = reasoning_gym.get_score_answer_fn(gym_entry["metadata"]["source_dataset"])
        assert score(gym_entry["answer"], gym_entry) == 1.0
        assert score("not a number", gym_entry) < 1.0


def test_reasoning_gym_options_template_and_errors() -> None:
    gym = ReasoningGymPrompts(
        "chain_sum",
        size=4,
        system_prompt="Think.",
        prompt_template="{prompt}\nAnswer inside <answer></answer>.",
        config={"min_terms": 2, "max_terms": 2},
    )
    for prompt in gym:
        entry = prompt.metadata["gym_entry"]
        assert entry["metadata"]["num_terms"] == 2
        assert prompt.messages == [
            {"role": "system", "content": "Think."},
            user(entry["question"] + "\nAnswer inside <answer></answer>."),
        ]
    five_terms = {"chain_sum": {"min_terms": 5, "max_terms": 5}}
    mixed = ReasoningGymPrompts(["basic_arithmetic", "chain_sum"], size=6, config=five_terms)
    terms = [p.metadata["gym_entry"]["metadata"]["num_terms"] for p in mixed]
    assert terms[1::2] == [5, 5, 5]
    two_terms = {"min_terms": 2, "max_terms": 2}
    keyed = ReasoningGymPrompts("chain_sum", size=4, config={"chain_sum": two_terms})
    assert list(keyed) == list(ReasoningGymPrompts("chain_sum", size=4, config=two_terms))
    with pytest.raises(ValueError, match="unknown reasoning_gym task.*'chain_summ'"):
        ReasoningGymPrompts("chain_summ", size=2)
    with pytest.raises(ValueError, match=r"\['leg_counting'\] are not among the tasks"):
        ReasoningGymPrompts(["basic_arithmetic", "chain_sum"], size=2, config={"leg_counting": {}})
    with pytest.raises(ValueError, match="'chain_sum' with options.*no_such_option"):
        ReasoningGymPrompts("chain_sum", size=2, config={"no_such_option": 1})
    with pytest.raises(ValueError, match="size must be >= the number of tasks"):
        ReasoningGymPrompts(["basic_arithmetic", "chain_sum"], size=1)


# ---------------------------------------------------------------------------------------------
# encode_prompt

GENERATION_HEADER = {
    "qwen2_5": "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
}
CHAT = [{"role": "system", "content": "Be exact."}, user("What is 12 plus 30?")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {
        family: make_tokenizer_folder(tmp_path_factory.mktemp(family), family)
        for family in GENERATION_HEADER
    }


@pytest.mark.parametrize("family", sorted(GENERATION_HEADER))
def test_encode_prompt_renders_the_generation_prompt(folders: dict, family: str) -> None:
    tok = Tokenizer.from_pretrained(folders[family])
    ids, text = encode_prompt(tok, Prompt(3, CHAT))
    header = GENERATION_HEADER[family]
    # The rendering is the conversation without a generation prompt plus the assistant header.
    assert text == tok.apply_chat_template(CHAT) + header
    expected = tok.encode(
        tok.apply_chat_template(CHAT, add_generation_prompt=True), add_special_tokens=False
    )
    assert ids == expected
    assert tok.decode(ids) == text
    assert ids[-len(tok.encode(header, add_special_tokens=False)) :] == tok.encode(
        header, add_special_tokens=False
    )
    if tok.bos_id is not None:  # llama3: the template writes BOS, encoding adds no second one
        assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    # transformers renders and tokenises the same folder to the same ids.
    hf = transformers.AutoTokenizer.from_pretrained(folders[family])
    hf_ids = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids if isinstance(hf_ids, list) else hf_ids["input_ids"]
    assert ids == [int(i) for i in hf_ids]


def test_encode_prompt_without_template(folders: dict, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(folders["llama3"])
    ids, text = encode_prompt(tok, Prompt(0, CHAT), chat_template=False)
    assert text == "Be exact.\n\nWhat is 12 plus 30?"
    assert ids == tok.encode(text, add_special_tokens=True) and ids[0] == tok.bos_id
    bare_folder = make_tokenizer_folder(tmp_path / "bare", "llama3", chat_template=None)
    bare = Tokenizer.from_pretrained(bare_folder)
    with pytest.raises(ValueError, match=f"prompt 7: chat_template=True.*{bare_folder}.*has no"):
        encode_prompt(bare, Prompt(7, CHAT))
    assert encode_prompt(bare, Prompt(7, CHAT), chat_template=False) == (ids, text)


# ---------------------------------------------------------------------------------------------
# PromptStream


def prompts(n: int) -> list[Prompt]:
    return [Prompt(i, [user(f"q{i}")], str(i)) for i in range(n)]


def indices(batch: list[Prompt]) -> list[int]:
    return [p.index for p in batch]


def reference_steps(n: int, per_step: int, seed: int, steps: int) -> list[list[int]]:
    """Steps built by hand: each epoch a randperm from seed + epoch, full steps only."""
    out: list[list[int]] = []
    epoch = 0
    while len(out) < steps:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for start in range(0, n - per_step + 1, per_step):
            out.append(order[start : start + per_step])
        epoch += 1
    return out[:steps]


def test_stream_order_epochs_and_dropped_log(capsys) -> None:
    data = prompts(10)
    stream = PromptStream(data, 4, seed=5)
    assert "10 prompts, prompts_per_step 4: 2 prompt(s) left out of each epoch" in (
        capsys.readouterr().out
    )
    got = []
    epochs = []
    for _ in range(7):
        epochs.append(stream.epoch)
        got.append(indices(stream.next_prompts()))
    assert got == reference_steps(10, 4, seed=5, steps=7)
    assert epochs == [0, 0, 1, 1, 2, 2, 3] and stream.steps_per_epoch == 2
    assert capsys.readouterr().out == ""  # logged once, at construction
    PromptStream(data, 4, dp_rank=1, dp_size=2)
    assert capsys.readouterr().out == ""  # only rank 0 logs
    PromptStream(prompts(8), 4)
    assert capsys.readouterr().out == ""  # nothing dropped
    plain = PromptStream(data, 5, shuffle=False)
    first, second = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]
    assert [indices(plain.next_prompts()) for _ in range(3)] == [first, second, first]


@pytest.mark.parametrize("dp_size", [2, 4])
def test_ranks_split_the_single_process_steps(dp_size: int) -> None:
    data = prompts(13)
    single = PromptStream(data, 8, seed=1)
    ranks = [PromptStream(data, 8, dp_rank=r, dp_size=dp_size, seed=1) for r in range(dp_size)]
    for _ in range(5):  # five steps: across four epoch boundaries (one step per epoch)
        whole = indices(single.next_prompts())
        shares = [indices(stream.next_prompts()) for stream in ranks]
        assert all(len(share) == 8 // dp_size for share in shares)
        assert sum(shares, []) == whole  # contiguous shares, in rank order


def test_order_ignores_the_global_rng() -> None:
    torch.manual_seed(0)
    quiet = PromptStream(prompts(9), 3, seed=2)
    expected = [indices(quiet.next_prompts()) for _ in range(6)]
    torch.manual_seed(1234)
    noisy = PromptStream(prompts(9), 3, seed=2)
    got = []
    for _ in range(6):
        torch.rand(17)
        torch.randperm(9)
        got.append(indices(noisy.next_prompts()))
    assert got == expected == reference_steps(9, 3, seed=2, steps=6)


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5])
def test_resume_continues_exactly(k: int) -> None:
    data = prompts(11)  # 3 steps of 3 per epoch, 2 prompts dropped: epochs turn at k = 3
    uninterrupted = PromptStream(data, 3, seed=7)
    expected = [indices(uninterrupted.next_prompts()) for _ in range(k + 5)]
    first = PromptStream(data, 3, seed=7)
    before = [indices(first.next_prompts()) for _ in range(k)]
    state = json.loads(json.dumps(first.state_dict()))  # plain data
    assert all(isinstance(v, int) for v in state.values())
    fresh = PromptStream(data, 3, seed=7)
    fresh.load_state_dict(state)
    assert fresh.epoch == first.epoch
    after = [indices(fresh.next_prompts()) for _ in range(5)]
    assert before + after == expected
    used = PromptStream(data, 3, seed=7)  # a stream already in another epoch loads it too
    for _ in range(4):
        used.next_prompts()
    used.load_state_dict(state)
    assert [indices(used.next_prompts()) for _ in range(5)] == after


def test_resume_with_another_dp_size_and_refusals() -> None:
    data = prompts(12)
    single = PromptStream(data, 4, seed=0)
    single.next_prompts()
    state = single.state_dict()
    whole = indices(single.next_prompts())
    halves = []
    for rank in range(2):
        stream = PromptStream(data, 4, dp_rank=rank, dp_size=2, seed=0)
        stream.load_state_dict(state)
        halves += indices(stream.next_prompts())
    assert halves == whole
    with pytest.raises(ValueError, match="dataset_size=12, this stream has dataset_size=13"):
        PromptStream(prompts(13), 4).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=0, this stream has seed=1"):
        PromptStream(data, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="prompts_per_step=6 .* not divisible by dp_size=4"):
        PromptStream(data, 6, dp_size=4)
    with pytest.raises(ValueError, match="prompts_per_step=13 is more than the 12 prompts"):
        PromptStream(data, 13)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):
        PromptStream(data, 4, dp_rank=2, dp_size=2)
