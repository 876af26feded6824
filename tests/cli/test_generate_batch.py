"""`tunesmith generate --input/--output`: batched completions equal one-prompt-at-a-time
decoding, keep each row's extra keys and order, sample repeatably per row whatever the batch
size, and work on a LoRA run folder (adapter on its base, no export) like its merged export."""

from __future__ import annotations

import json

import pytest

from tests.recipes.sft_world import make_counting_data, make_model_dir, run_sft
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.cli.generate_batch import generate_rows, read_prompt_rows
from tunesmith.cli.main import main
from tunesmith.generation import generate
from tunesmith.models.export import export_merged

ROWS = [
    "count 3 from 4",
    {"prompt": "add 2 and 3", "id": 7},
    {"messages": [{"role": "user", "content": "count 2 from 9"}], "answer": "9 10"},
    {"prompt": "a much longer prompt than the others, to sort the batch", "id": 9},
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model_dir = make_model_dir(root, initializer_range=0.2)
    lora = run_sft(
        model_dir,
        make_counting_data(root / "d.jsonl"),
        root / "lora",
        "max_steps=3",
        config="tiny_lora",
    )
    merged = export_merged(lora / "checkpoints" / "step_000003", root / "merged")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    return {"model": model_dir, "lora": lora, "merged": merged, "prompts": prompts}


def _alone(loaded, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of one prompt decoded by itself, end-of-turn token dropped."""
    tokens = generate(
        loaded.model, [ids], max_new_tokens=n, stop_token_ids=loaded.tokenizer.stop_token_ids
    ).sequences[0]
    return tokens[:-1] if tokens and tokens[-1] in loaded.tokenizer.stop_token_ids else tokens


def test_batched_greedy_rows_equal_each_prompt_alone(world):
    loaded = load_checkpoint(world["model"])
    tok = loaded.tokenizer
    rows = read_prompt_rows(world["prompts"])
    out = generate_rows(loaded.model, tok, rows, max_new_tokens=8, batch_size=3)
    # the chat template by default: a string is one user message
    expected_ids = [
        tok.tokenize_conversation([{"role": "user", "content": "count 3 from 4"}],
                                  add_generation_prompt=True)[0],
        tok.tokenize_conversation([{"role": "user", "content": "add 2 and 3"}],
                                  add_generation_prompt=True)[0],
        tok.tokenize_conversation(ROWS[2]["messages"], add_generation_prompt=True)[0],
        tok.tokenize_conversation([{"role": "user", "content": ROWS[3]["prompt"]}],
                                  add_generation_prompt=True)[0],
    ]  # fmt: skip
    for row, ids, source in zip(out, expected_ids, rows):
        assert row["completion"] == tok.decode(_alone(loaded, ids, 8), skip_special_tokens=True)
        assert {k: row[k] for k in source} == source  # extra keys kept, in input order
        assert row["finish_reason"] in ("stop", "length") and 0 < row["new_tokens"] <= 8
    assert len({r["completion"] for r in out}) > 1, "degenerate completions test little"
    raw = generate_rows(loaded.model, tok, rows[:1], max_new_tokens=8, chat_template=False)
    ids = tok.encode("count 3 from 4")
    assert raw[0]["completion"] == tok.decode(_alone(loaded, ids, 8), skip_special_tokens=True)


def test_seeded_sampling_does_not_depend_on_the_batch_size(world):
    loaded = load_checkpoint(world["model"])
    rows = read_prompt_rows(world["prompts"])
    kwargs = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 50}
    one = generate_rows(loaded.model, loaded.tokenizer, rows, batch_size=1, seed=3, **kwargs)
    four = generate_rows(loaded.model, loaded.tokenizer, rows, batch_size=4, seed=3, **kwargs)
    other = generate_rows(loaded.model, loaded.tokenizer, rows, batch_size=4, seed=4, **kwargs)
    assert [r["completion"] for r in one] == [r["completion"] for r in four]
    assert [r["completion"] for r in one] != [r["completion"] for r in other]


def test_generate_command_on_a_lora_run_folder_equals_its_merged_export(world, tmp_path, capsys):
    outputs = {}
    for name in ("lora", "merged"):
        out = tmp_path / f"{name}.jsonl"
        assert (
            main(
                [
                    "generate",
                    str(world[name]),
                    "--input",
                    str(world["prompts"]),
                    "--output",
                    str(out),
                    "--max-new-tokens",
                    "6",
                    "--batch-size",
                    "2",
                ]
            )
            == 0
        )
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert "wrote 4 completions to" in capsys.readouterr().out
    assert outputs["lora"] == outputs["merged"]
    base = generate_rows(
        load_checkpoint(world["model"]).model,
        load_checkpoint(world["model"]).tokenizer,
        read_prompt_rows(world["prompts"]),
        max_new_tokens=6,
    )
    assert [r["completion"] for r in base] != [r["completion"] for r in outputs["lora"]]
    # the single-prompt mode gives the first row's completion
    assert (
        main(
            ["generate", str(world["lora"]), "--prompt", "count 3 from 4", "--max-new-tokens", "6"]
        )
        == 0
    )
    assert capsys.readouterr().out == outputs["lora"][0]["completion"] + "\n"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "prompts.jsonl:2: not valid JSON"),
        ('{"prompt": "a", "messages": []}', "prompts.jsonl:2: expected a JSON string, or an"),
        ('{"prompt": 3}', "prompts.jsonl:2: 'prompt' must be a string, got int"),
        ('{"messages": [{"role": "user"}]}', "prompts.jsonl:2: 'messages' must be a list of"),
    ],
)
def test_a_bad_prompt_line_is_named(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text('"fine"\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_prompt_rows(path)


def test_input_needs_an_output(world, capsys):
    assert main(["generate", str(world["model"]), "--input", str(world["prompts"])]) == 1
    assert "--input needs --output FILE.jsonl" in capsys.readouterr().err
