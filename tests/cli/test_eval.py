"""`tunesmith eval` and its lm-eval adapter: per-request numbers equal to lm-eval's own Hugging
Face backend (HFLM) on the same checkpoint, on tasks defined locally (YAML over JSONL: a
multiple-choice task, a generation task with stop strings, a rolling-loglikelihood task), with
and without the chat template; a LoRA run evaluates without export and equals its merged export.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import lm_eval
import pytest
from lm_eval.models.huggingface import HFLM

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.recipes.sft_world import make_counting_data, make_model_dir, run_sft
from tunesmith.cli.checkpoint_loading import load_checkpoint
from tunesmith.cli.lm_eval_adapter import TunesmithLM, run_lm_eval, task_manager
from tunesmith.cli.main import main
from tunesmith.data import Tokenizer
from tunesmith.models import build_model, qwen2_5
from tunesmith.models.export import export_merged

TASKS = ["tiny_mc", "tiny_gen", "tiny_ppl"]

MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 10
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
PREFIX_TASK = """task: tiny_prefix
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}"
doc_to_target: answer
gen_prefix: "Answer:"
generation_kwargs:
  until: ["\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
PPL_TASK = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{question}}}} is {{{{answer}}}}"
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model whose greedy text varies (larger init), a LoRA run on it, its merged
    export, and a folder of local lm-eval tasks."""
    root = tmp_path_factory.mktemp("eval")
    model_dir = make_model_dir(root, initializer_range=0.2)
    data = make_counting_data(root / "count.jsonl")
    lora = run_sft(model_dir, data, root / "lora", "max_steps=3", config="tiny_lora")
    merged = export_merged(lora / "checkpoints" / "step_000003", root / "merged")
    tasks = root / "tasks"
    tasks.mkdir()
    mc, gen = tasks / "mc.jsonl", tasks / "gen.jsonl"
    with open(mc, "w") as f:
        for a, b in [(2, 3), (7, 11), (14, 5), (9, 9), (20, 1)]:
            choices = [str(a + b), str(a + b + 1), str(a * b), f" {abs(a - b)}"]
            f.write(json.dumps({"question": f"add {a} and {b}", "choices": choices, "label": 0}))
            f.write("\n")
    with open(gen, "w") as f:
        for n, start in [(3, 4), (2, 17), (5, 1), (1, 30)]:
            answer = " ".join(str(start + i) for i in range(n))
            f.write(json.dumps({"question": f"count {n} from {start}", "answer": answer}) + "\n")
    (tasks / "tiny_mc.yaml").write_text(MC_TASK.format(data=mc))
    (tasks / "tiny_gen.yaml").write_text(GEN_TASK.format(data=gen))
    (tasks / "tiny_ppl.yaml").write_text(PPL_TASK.format(data=gen))
    (tasks / "tiny_prefix.yaml").write_text(PREFIX_TASK.format(data=gen))
    return {"model": model_dir, "lora": lora, "merged": merged, "tasks": tasks}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _evaluate(lm, tasks_dir: Path, chat: bool = False, tasks=TASKS, fewshot=None) -> dict:
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=task_manager(tasks, tasks_dir),
        apply_chat_template=chat,
        fewshot_as_multiturn=chat,
        num_fewshot=fewshot,
        bootstrap_iters=0,
        log_samples=True,
    )


def _responses(results: dict, task: str) -> list:
    """Every request's raw response of ``task``, in document and request order."""
    return [resp for doc in results["samples"][task] for resp in doc["resps"]]


def _assert_same_requests(ours: dict, reference: dict, tasks=TASKS) -> None:
    for task in tasks:
        mine, theirs = _responses(ours, task), _responses(reference, task)
        assert len(mine) == len(theirs) > 0, task
        prompts = [d["arguments"] for d in ours["samples"][task]]
        assert prompts == [d["arguments"] for d in reference["samples"][task]], task
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if isinstance(b[0], tuple):  # loglikelihood: (log-prob, greedy)
                assert a[0][0] == pytest.approx(b[0][0], abs=1e-4), (task, i)
                assert a[0][1] == b[0][1], (task, i)
            elif isinstance(b[0], float):  # rolling log-likelihood
                assert a[0] == pytest.approx(b[0], abs=1e-4), (task, i)
            else:  # generated text
                assert a == b, (task, i)


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat_template"])
def test_every_request_equals_lm_eval_hf_backend(world, chat):
    """Batches of 3 (ours) vs 2 (HF): sorting, padding and batching do not change a number."""
    ours = _evaluate(
        TunesmithLM.from_checkpoint(world["model"], batch_size=3), world["tasks"], chat
    )
    reference = _evaluate(
        HFLM(pretrained=str(world["model"]), batch_size=2, device="cpu"), world["tasks"], chat
    )
    _assert_same_requests(ours, reference)
    generated = _responses(ours, "tiny_gen")
    assert len({g[0] for g in generated}) > 1, "degenerate generations test little"
    for task, metric in [("tiny_mc", "acc,none"), ("tiny_ppl", "word_perplexity,none")]:
        assert ours["results"][task][metric] == pytest.approx(
            reference["results"][task][metric], rel=1e-4
        )


def test_few_shot_chat_turns_equal_hf_backend(world):
    """Few-shot examples as chat turns; with a task's ``gen_prefix`` lm-eval prefills the
    assistant's turn, which our rendering continues exactly as transformers' does."""
    tasks = ["tiny_mc", "tiny_prefix"]
    ours = _evaluate(
        TunesmithLM.from_checkpoint(world["model"], batch_size=4),
        world["tasks"],
        chat=True,
        tasks=tasks,
        fewshot=2,
    )
    reference = _evaluate(
        HFLM(pretrained=str(world["model"]), batch_size=4, device="cpu"),
        world["tasks"],
        chat=True,
        tasks=tasks,
        fewshot=2,
    )
    _assert_same_requests(ours, reference, tasks)
    prompt = ours["samples"]["tiny_prefix"][0]["arguments"][0][0]
    assert prompt.endswith("<|im_start|>assistant\nAnswer:") and prompt.count("Answer:") == 3


def test_a_rolling_window_shorter_than_the_text_scores_every_token_once(world):
    """max_length 4 splits each text into several windows; their sum equals HFLM's with the
    same max_length, and the one-window score of the full text (to 1e-4 it differs)."""
    ours = _evaluate(
        TunesmithLM.from_checkpoint(world["model"], max_length=4),
        world["tasks"],
        tasks=["tiny_ppl"],
    )
    reference = _evaluate(
        HFLM(pretrained=str(world["model"]), max_length=4, device="cpu"),
        world["tasks"],
        tasks=["tiny_ppl"],
    )
    _assert_same_requests(ours, reference, ["tiny_ppl"])
    whole = _evaluate(
        TunesmithLM.from_checkpoint(world["model"]), world["tasks"], tasks=["tiny_ppl"]
    )
    assert _responses(ours, "tiny_ppl")[0][0] != pytest.approx(
        _responses(whole, "tiny_ppl")[0][0], abs=1e-4
    )


def test_continuing_a_prefilled_assistant_turn(tmp_path):
    """Hand-written expectation of the Qwen2.5 template: the assistant's text ends the prompt,
    with no end-of-turn after it; with the generation prompt, the assistant header ends it."""
    tok = Tokenizer.from_pretrained(make_tokenizer_folder(tmp_path, "qwen2_5"))
    lm = TunesmithLM(build_model(qwen2_5.spec("qwen2_5_tiny", vocab_size=tok.vocab_size)), tok)
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A:"}]  # fmt: skip
    head = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
    assert lm.apply_chat_template(chat, add_generation_prompt=False) == (
        head + "<|im_start|>assistant\nA:"
    )
    assert lm.apply_chat_template(chat[:2]) == head + "<|im_start|>assistant\n"
    assert lm.chat_template(True) == tok.chat_template and lm.chat_template(False) is None


def test_lora_run_folder_evaluates_without_export_like_its_merged_export(world):
    """The run folder (its newest checkpoint: an adapter on the base) scores every request as
    the merged export does, and differently from the base model (the adapter is used)."""
    lora = run_lm_eval(
        load_checkpoint(world["lora"]),
        TASKS,
        include_path=world["tasks"],
        batch_size=4,
        print_table=False,
        output_path=None,
    )
    assert "samples" not in lora  # no samples kept without an output path
    ours = _evaluate(TunesmithLM.from_checkpoint(world["lora"], batch_size=4), world["tasks"])
    merged = _evaluate(TunesmithLM.from_checkpoint(world["merged"], batch_size=2), world["tasks"])
    _assert_same_requests(ours, merged)
    base = _evaluate(
        TunesmithLM.from_checkpoint(world["model"], batch_size=4), world["tasks"], tasks=["tiny_mc"]
    )
    moved = [
        abs(a[0][0] - b[0][0])
        for a, b in zip(_responses(ours, "tiny_mc"), _responses(base, "tiny_mc"))
    ]
    assert max(moved) > 1e-2
    assert lora["results"]["tiny_mc"]["acc,none"] == ours["results"]["tiny_mc"]["acc,none"]


def test_eval_command_prints_the_table_and_writes_results(world, tmp_path, capsys):
    out = tmp_path / "results" / "eval.json"
    code = main(
        [
            "eval",
            str(world["lora"]),
            "--tasks",
            "tiny_mc,tiny_gen",
            "--include-path",
            str(world["tasks"]),
            "--batch-size",
            "2",
            "--limit",
            "3",
            "--output-path",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "|tiny_mc " in printed and "|tiny_gen" in printed and "acc" in printed
    results = json.loads(out.read_text())
    assert len(results["samples"]["tiny_mc"]) == 3  # --limit 3
    acc = results["results"]["tiny_mc"]["acc,none"]
    correct = [d["acc"] for d in results["samples"]["tiny_mc"]]
    assert math.isclose(acc, sum(correct) / 3)


@pytest.mark.slow  # indexes lm-eval's built-in tasks for close matches (~10 s)
def test_eval_command_names_an_unknown_task(world, capsys):
    code = main(
        ["eval", str(world["model"]), "--tasks", "tiny_mcc", "--include-path", str(world["tasks"])]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "unknown lm-eval task(s): tiny_mcc (did you mean tiny_mc" in err
