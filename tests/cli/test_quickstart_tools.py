"""``tunesmith grpo MODEL PROMPTS --tool NAME``: multi-turn GRPO in a ``ToolEnv`` of built-in
tools, its format that of the model's chat template, the rewards scoring the final answer
(moved into the environment, none beside it); the run samples trajectories with the tools in
the prompt and logs them."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.recipes.sft_world import make_model_dir, read_metrics
from tests.rl.rl_world import make_prompts
from tunesmith.cli import main, quickstart
from tunesmith.config.components import resolve_component
from tunesmith.data.chat_template import load_template
from tunesmith.rl.envs.toolcalls import template_tool_format

SMALL_RL = ["prompts_per_step=2", "group_size=2", "batch_size=4",
            "generation.max_new_tokens=4", "progress_bar=false"]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("quickstart_tools")
    return {  # the tools' descriptions make the prompt longer than the tiny model's default
        "model": make_model_dir(root, max_position_embeddings=4096),
        "prompts": make_prompts(root / "prompts.jsonl", rows=4),
    }


def test_grpo_with_a_tool_runs_multi_turn_in_the_template_s_format(world, tmp_path, capsys):
    out = tmp_path / "tools"
    argv = ["grpo", str(world["model"]), str(world["prompts"]), "--output-dir", str(out),
            "--max-steps", "1", "--reward", "exact_answer", "--tool", "calculator",
            "log_samples_every=1", *SMALL_RL]  # fmt: skip
    assert main.main(argv) == 0, capsys.readouterr().err
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["rewards"] is None
    assert cfg["environment"] == {
        "_component_": "tunesmith.rl.envs.ToolEnv",
        "format": "qwen",  # the tiny model's tokenizer has the Qwen2.5 template
        "tools": [{"_component_": "tunesmith.rl.envs.Calculator"}],
        "rewards": {
            "_component_": "tunesmith.rl.rewards.RewardSet",
            "rewards": {"exact_answer": {"_component_": "tunesmith.rl.rewards.ExactAnswer"}},
        },
    }
    logged = read_metrics(out)[1]
    assert logged["env/turns"] >= 1.0 and "reward/exact_answer" in logged
    record = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    assert '"name": "calculator"' in record["prompt"]  # the tool described in the prompt
    assert record["trajectories"][0]["messages"][-1]["role"] == "assistant"


def test_plain_format_describes_the_call_syntax_in_the_system_prompt(world, capsys):
    argv = ["grpo", str(world["model"]), str(world["prompts"]), "--tool", "calculator",
            "--tool", "python", "--tool-format", "plain", "--print-config"]  # fmt: skip
    assert main.main(argv) == 0, capsys.readouterr().err
    environment = yaml.safe_load(capsys.readouterr().out)["environment"]
    assert environment["format"] == "plain"
    assert environment["system_prompt"] == quickstart.PLAIN_TOOLS_PROMPT.format(
        tools="calculator, python"
    )


@pytest.mark.parametrize(
    ("template", "expected"), [("qwen2_5", "qwen"), ("qwen3", "qwen"), ("llama3", "llama3"),
                               ("gemma", "plain"), ("phi4", "plain"), ("olmo2", "plain")]
)  # fmt: skip
def test_the_tool_format_is_the_shipped_template_s(template, expected):
    assert template_tool_format(load_template(template)) == expected


@pytest.mark.parametrize("name", sorted(quickstart.TOOLS))
def test_every_tool_choice_is_the_built_in_tool_of_that_name(name):
    tool = resolve_component(quickstart.TOOLS[name])()  # no argument needed
    assert tool.name == name
