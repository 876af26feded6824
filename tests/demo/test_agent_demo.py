"""``tunesmith demo agent``: its traces train exactly the tokens GRPO trains, the pieces it adds
(``ToolEnv(describe_tools=False)``, ``Unavailable``), a shortened run end to end and the CLI;
the slow test runs the full demo on seeds 0-2 and holds GRPO's gain over the warm-up and over
the control to a margin (benchmarks/results/agent_demo.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.demo.test_demo import TOY_MODEL
from tunesmith.cli.main import main as cli_main
from tunesmith.config import instantiate, load_config
from tunesmith.data import SFTDataset, Tokenizer
from tunesmith.demo.agent import (
    NO_TOOL,
    SYSTEM_PROMPT,
    AgentDemoSettings,
    Product,
    make_products,
    run_agent_demo,
    write_agent_data,
)
from tunesmith.generation.generate import GenerationOutput
from tunesmith.recipes import config_path
from tunesmith.rl.envs import Calculator, EpisodeSettings, ToolEnv, Unavailable
from tunesmith.rl.envs.trajectory import sample_trajectories
from tunesmith.rl.prompts import Prompt
from tunesmith.rl.rewards.strings import StringMatch

TOY = AgentDemoSettings(
    seed=3,
    digits=3,
    num_traces=16,
    num_prompts=32,
    num_held_out=6,
    direct_from=0.5,
    direct_fraction=0.25,
    model=TOY_MODEL,
)


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return write_agent_data(tmp_path_factory.mktemp("agent"), TOY)


def _scripted(tokenizer: Tokenizer, replies: list[str]):
    """A turn generator that samples ``replies`` in order, each as the tokenizer encodes it,
    then the end-of-turn token (what a model that learned the traces would sample)."""
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)

    def generate(rows, keys, limits):
        ids = [tokenizer.encode(replies.pop(0), add_special_tokens=False) + end for _ in rows]
        return GenerationOutput(ids, [[0.0] * len(s) for s in ids], [len(r) for r in rows],
                                ["stop"] * len(rows), seconds=0.0)  # fmt: skip

    return generate


def _demo_environment(**changes) -> ToolEnv:
    cfg = load_config(config_path("demo_agent", "grpo"))
    return instantiate(cfg.environment, **changes)


# ----------------------------------------------------------------------------- the task


def test_products_are_distinct_and_the_traces_answer_them():
    products = make_products(50, 4, seed=1)
    assert len(set(products)) == 50 and make_products(50, 4, seed=1) == products
    assert all(1000 <= p.a <= 9999 and 1000 <= p.b <= 9999 for p in products)
    assert {len(p.answer) for p in products} == {7, 8}
    full = make_products(200, 3, seed=1, full_length=True)
    assert len(set(full)) == 200 and {len(p.answer) for p in full} == {6}
    p = Product(1234, 5678)
    tool, direct = p.messages(), p.direct_messages()
    assert tool[0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert tool[2]["content"] == 'CALL calculator {"expression": "1234*5678"}'
    assert tool[3] == {"role": "tool", "name": "calculator", "content": "7006652"}
    assert tool[4]["content"] == direct[2]["content"] == "Answer: 7006652"
    with pytest.raises(
        ValueError, match="82 distinct products of 1-digit numbers requested, only 81"
    ):
        make_products(82, 1, seed=0)
    with pytest.raises(ValueError, match="59 distinct 2-digit products of 1-digit numbers"):
        make_products(59, 1, seed=0, full_length=True)  # 81 pairs less the 23 below 10


def test_the_data_files_hold_both_kinds_of_trace_and_the_prompts(toy_data):
    rows = [json.loads(line) for line in toy_data.traces_file.read_text().splitlines()]
    calls = [len(r["messages"]) == 5 for r in rows]
    assert len(rows) == 16 and sum(calls) == 14  # direct_fraction 0.25 of the last 8
    assert calls[:8] == [True] * 8 and calls[8:] == [True, True, True, False] * 2  # evenly
    prompts = [json.loads(line) for line in toy_data.prompts_file.read_text().splitlines()]
    held_out = [json.loads(line) for line in toy_data.held_out_file.read_text().splitlines()]
    assert (len(prompts), len(held_out)) == (32, 6)
    questions = [r["messages"][1]["content"] for r in rows]
    questions += [r["prompt"][1]["content"] for r in prompts]
    assert not set(questions) & {r["prompt"][1]["content"] for r in held_out}
    with pytest.raises(ValueError, match=r"direct_from must be in \[0, 1\], got 1.5"):
        write_agent_data(toy_data.root / "bad", replace(TOY, direct_from=1.5))


def test_an_sft_trace_trains_exactly_the_tokens_a_grpo_trajectory_trains(toy_data):
    """The SFT row of a tool-use trace and the GRPO row of the same conversation (replies
    sampled as the tokenizer encodes them) hold the same ids and train the same positions;
    the SFT row has one more token, the template's newline after the last turn (not trained)."""
    tok = Tokenizer.from_pretrained(toy_data.model_dir)
    dataset = SFTDataset(tok, source=str(toy_data.traces_file), format="messages",
                         train_on="assistant", max_seq_len=128)  # fmt: skip
    rows = [json.loads(line)["messages"] for line in toy_data.traces_file.read_text().splitlines()]
    index = next(i for i, messages in enumerate(rows) if len(messages) == 5)
    messages, sft = rows[index], dataset[index]
    prompt = Prompt(0, messages[:2], messages[3]["content"])  # the product
    generate = _scripted(tok, [messages[2]["content"], messages[4]["content"]])
    [(prompt_ids, _, [trajectory])] = sample_trajectories(
        generate, tok, _demo_environment(), [prompt], round=0, group_size=1, seed=0,
        settings=EpisodeSettings(max_turns=3), max_new_tokens=32,
        stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    assert trajectory.episode.ended == "done" and trajectory.episode.terms["correct"] == 1.0
    rl_ids = prompt_ids + trajectory.ids
    rl_trained = {len(prompt_ids) + i for i, m in enumerate(trajectory.mask) if m}
    ids, labels = sft["input_ids"], sft["labels"]
    assert ids[: len(rl_ids)] == rl_ids and tok.decode(ids[len(rl_ids) :]) == "\n"
    sft_trained = {i + 1 for i, label in enumerate(labels) if label != -100}  # shifted labels
    assert sft_trained == rl_trained
    assert len(rl_trained) == len(tok.encode(messages[2]["content"] + messages[4]["content"],
                                             add_special_tokens=False)) + 2  # fmt: skip


# ----------------------------------------------------------------------------- tools


def test_describe_tools_false_leaves_the_tools_block_out_of_the_prompt(toy_data):
    tok = Tokenizer.from_pretrained(toy_data.model_dir)
    described = ToolEnv([Calculator()], StringMatch(), format="plain")
    quiet = ToolEnv([Calculator()], StringMatch(), format="plain", describe_tools=False)
    assert described.tool_schemas() == [Calculator.schema] and quiet.tool_schemas() is None
    messages = Product(12, 34).prompt_messages()
    with_tools = tok.apply_chat_template(messages, tools=described.tool_schemas())
    without = tok.apply_chat_template(messages, tools=quiet.tool_schemas())
    assert "<tools>" in with_tools and "<tools>" not in without
    assert without == tok.apply_chat_template(messages)
    assert _demo_environment().tool_schemas() is None  # the demo's config


def test_unavailable_answers_every_call_with_an_error_and_counts_it():
    env = ToolEnv([Unavailable()], StringMatch(), format="plain")
    env.reset(Prompt(0, Product(12, 34).prompt_messages(), "408"))
    result = env.step({"role": "assistant", "content": Product(12, 34).call})
    assert result.observations == [
        {"role": "tool", "name": "calculator", "content": "Error: calculator: not available"}
    ]
    assert result.counts == {"malformed_calls": 0, "tool_calls": 1, "tool_errors": 1}
    assert not result.done and env.step({"role": "assistant", "content": "408"}).terms == {
        "string_match": 1.0
    }
    assert Unavailable().schema == Calculator.schema
    with pytest.raises(ValueError, match="no function name"):
        Unavailable({"type": "function"})


def test_the_control_differs_from_the_demo_run_by_the_tool_alone():
    cfg = load_config(config_path("demo_agent", "grpo"))
    key, value = NO_TOOL.split("=")
    assert key == "environment.tools.0._component_" and len(cfg.environment.tools) == 1
    control = _demo_environment(tools=[Unavailable()])
    assert value == "tunesmith.rl.envs.Unavailable"
    assert list(control.tools) == ["calculator"] and control.tool_schemas() is None


# ----------------------------------------------------------------------------- end to end

SHORT = [
    "sft.max_steps=60",
    "sft.epochs=30",
    "sft.batch_size=8",
    "sft.optimizer.lr=1e-2",
    "sft.lr_scheduler.num_warmup_steps=1",
    "sft.log_every_n_steps=60",
    "max_steps=2",
    "group_size=4",
    "prompts_per_step=2",
    "log_every_n_steps=1",
    "log_samples_every=1",
    "lr_scheduler.num_warmup_steps=1",
]


def test_a_short_demo_runs_end_to_end_and_records_trajectories(tmp_path, capsys):
    """Tiny sizes, a few steps: the three accuracies, both runs' files and metrics, and whole
    trajectories (the replies, the tool's answers to their calls) in samples.jsonl (a full
    call-and-result trajectory: test_an_sft_trace_trains_exactly_the_tokens...)."""
    result = run_agent_demo(tmp_path, settings=TOY, overrides=SHORT, threads=1)
    out = capsys.readouterr().out
    assert "after GRPO without it (the control)" in out
    for accuracy in (result.accuracy_before, result.accuracy_after, result.accuracy_without_tool):
        assert 0.0 <= accuracy <= 1.0
    assert len(result.trajectories_after) == len(result.held_out) == 6
    assert result.checkpoint == tmp_path / "grpo" / "checkpoints" / "step_000002"
    assert result.control_checkpoint == tmp_path / "grpo_no_tool" / "checkpoints" / "step_000002"
    assert "Unavailable" in (tmp_path / "grpo_no_tool" / "config.yaml").read_text()
    for run in ("grpo", "grpo_no_tool"):
        metrics = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()]
        assert {"reward", "reward/correct", "env/tool_calls", "env/turns"} <= set(metrics[0])
    control = [json.loads(line) for line in (tmp_path / "grpo_no_tool" / "metrics.jsonl").open()]
    assert all(m["env/tool_errors"] == m["env/tool_calls"] for m in control)
    records = [json.loads(line) for line in (tmp_path / "grpo" / "samples.jsonl").open()]
    messages = [m for r in records for t in r["trajectories"] for m in t["messages"]]
    tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    assert tools  # the toy warm-up's attempted calls, answered (a result or an error)
    assert all(messages[i - 1]["role"] in ("assistant", "tool") for i in tools)
    trajectories = [t for r in records for t in r["trajectories"]]
    assert {"messages", "ended", "terms", "counts"} <= set(trajectories[0])


def test_cli_demo_agent_refuses_the_keys_it_sets(tmp_path, capsys):
    assert cli_main(["demo", "agent", "--output-dir", str(tmp_path), "output_dir=x"]) == 1
    assert "of its GRPO run itself" in capsys.readouterr().err
    assert cli_main(["demo", "agent", "--output-dir", str(tmp_path), "--async"]) == 1
    assert "--async is an option of `tunesmith demo rl`" in capsys.readouterr().err


MARGIN = 0.5
"""The least gain asserted, in accuracy: measured on seeds 0-2 (2 x AMD EPYC, torch 2.13), the
warm-up and the control answered 0% of the held-out products, GRPO 98-100%."""


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_agent_demo_gains_by_learning_to_call_the_tool(tmp_path, seed):
    """The real demo (about 4 minutes a seed on one core): GRPO with the calculator beats
    the warm-up and the control (the same run, the calculator answering errors) by MARGIN,
    because it calls the tool for more questions than the warm-up did."""
    result = run_agent_demo(tmp_path, settings=AgentDemoSettings(seed=seed), threads=1,
                            verbose=False)  # fmt: skip
    assert result.accuracy_after - result.accuracy_before >= MARGIN
    assert result.accuracy_after - result.accuracy_without_tool >= MARGIN
    assert result.calls_after >= result.calls_before + MARGIN
