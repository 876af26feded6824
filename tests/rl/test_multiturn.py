"""Multi-turn rollouts (tunesmith.rl.envs.trajectory, groups.sample_trajectory_groups): the
rows are the sampled ids and the templated observation ids in the order they happened, masks
1 on the policy's tokens only.

- a scripted policy's 3-turn conversation through each family's shipped template (Qwen2.5,
  Qwen3, Llama 3.1) gives exactly the hand-built row and mask, and each turn continues the row
  the last turn left;
- re-rendering the conversation would give other ids, while the rows keep the sampled ones;
- a one-turn environment samples what single-turn GRPO samples (same keys, same tokens);
- with a real model, the trainer's log-probs of a multi-turn row equal the sampler's (the
  parity check covers observation tokens placed between turns);
- an environment that raises ends that trajectory (reward 0, counted), a token budget ends
  one as ``token_limit`` (``finish == "length"``: the overlong filter drops it);
- the grpo recipe with ``environment:`` logs whole trajectories and the episode metrics.
"""

from __future__ import annotations

import contextlib
import itertools
import json

import pytest
import torch

from tests.data.tokenizer_factory import make_tokenizer_folder
from tests.rl.envs_world import AGAIN_ENV, Again, FailsOnSecondTurn, OneTurn
from tunesmith.data import Tokenizer
from tunesmith.generation.config import GenerationConfig
from tunesmith.generation.engine import LocalEngine, generate_with
from tunesmith.generation.generate import GenerationOutput
from tunesmith.models import llama3
from tunesmith.modules.losses import IGNORE_INDEX
from tunesmith.rl.envs import Calculator, ToolEnv
from tunesmith.rl.envs.trajectory import EpisodeSettings
from tunesmith.rl.groups import episode_failures, sample_groups, sample_trajectory_groups
from tunesmith.rl.prompts import Prompt
from tunesmith.rl.rewards import ExactAnswer
from tunesmith.rl.rollout import completion_logprobs, group_batch

QUESTION = [{"role": "user", "content": "What is 12*12+1?"}]
# family -> (tool-call format, end-of-turn token, call text, text after a tool result)
FAMILIES = {
    "qwen2_5": ("qwen", "<|im_end|>",
                '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n'
                "</tool_call>",
                "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n"),
    "qwen3": ("qwen", "<|im_end|>",
              '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n'
              "</tool_call>",
              "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
              "<|im_start|>assistant\n"),
    "llama3": ("llama3", "<|eot_id|>",
               '{{"name": "calculator", "parameters": {{"expression": "{}"}}}}',
               # the template writes a tool result as JSON: a string gets quotes
               '<|start_header_id|>ipython<|end_header_id|>\n\n"{}"<|eot_id|>'
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {f: Tokenizer.from_pretrained(make_tokenizer_folder(root / f, f)) for f in FAMILIES}


class Scripted:
    """A policy stand-in replying ``replies[t]`` (token ids, the end-of-turn id last) at turn
    ``t`` to every row, with log-probs -1, -2, ...; it keeps the rows it was asked to
    continue."""

    def __init__(self, replies: list[list[int]]) -> None:
        self.replies, self.rows = replies, []

    def __call__(self, rows, keys, limits):
        self.rows.append([list(r) for r in rows])
        reply = self.replies[len(self.rows) - 1]
        return GenerationOutput(
            [list(reply) for _ in rows],
            [[-1.0 - i for i in range(len(reply))] for _ in rows],
            [len(r) for r in rows],
            ["stop"] * len(rows),
        )


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _three_turns(tok, family: str, replies_text: list[str], env=None, **episode):
    fmt, end, _, _ = FAMILIES[family]
    replies = [_ids(tok, r) + [tok.token_to_id(end)] for r in replies_text]
    policy = Scripted(replies)
    env = env or ToolEnv([Calculator()], ExactAnswer(), format=fmt)
    groups = sample_trajectory_groups(
        policy, tok, env, [Prompt(7, QUESTION, answer="145")], round=0, group_size=2, seed=0,
        episode=EpisodeSettings(**episode), max_new_tokens=64,
        stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    return groups[0], replies, policy, env


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_three_turn_conversation_gives_the_hand_built_row_and_mask(tokenizers, family):
    tok = tokenizers[family]
    _, end, call, after = FAMILIES[family]
    texts = [call.format("12*12"), call.format("144+1"), "The answer is 145"]
    group, replies, policy, env = _three_turns(tok, family, texts)
    prompt = tok.apply_chat_template(QUESTION, tools=env.tool_schemas(), add_generation_prompt=True)
    expected_prompt = _ids(tok, prompt)
    observations = [_ids(tok, after.format(result)) for result in ("144", "145")]
    expected = replies[0] + observations[0] + replies[1] + observations[1] + replies[2]
    mask = [1] * len(replies[0]) + [0] * len(observations[0]) + [1] * len(replies[1])
    mask += [0] * len(observations[1]) + [1] * len(replies[2])
    assert group.prompt_ids == expected_prompt
    assert group.completions == [expected, expected] and group.masks == [mask, mask]
    # every turn continued the row the last one left, for both samples
    starts = [0, len(replies[0] + observations[0]), len(expected) - len(replies[2])]
    assert policy.rows == [[expected_prompt + expected[:s]] * 2 for s in starts]
    assert group.rewards.tolist() == [1.0, 1.0] and group.finish == ["stop", "stop"]
    assert [e["turns"] for e in group.episodes] == [3, 3]
    assert group.episodes[0]["counts"]["tool_calls"] == 2
    # the training row: labels and sampling log-probs on the policy's tokens only
    batch = group_batch([group], pad_id=0)
    start = len(expected_prompt) - 1
    labels = batch["labels"][0, start : start + len(expected)].tolist()
    assert labels == [t if m else IGNORE_INDEX for t, m in zip(expected, mask)]
    logprobs = batch["sampling_logprobs"][0, start : start + len(expected)].tolist()
    sampled = [-1.0 - i for r in replies for i in range(len(r))]
    assert [x for x, m in zip(logprobs, mask) if m] == sampled
    assert [x for x, m in zip(logprobs, mask) if not m] == [0.0] * (len(mask) - sum(mask))


def test_rows_keep_the_sampled_ids_where_rendering_again_would_not(tokenizers):
    tok = tokenizers["qwen2_5"]
    _, end, call, _ = FAMILIES["qwen2_5"]
    texts = [call.format("12*12"), "145"]
    policy_ids = [[i for ch in text for i in _ids(tok, ch)] for text in texts]  # one per char
    assert policy_ids[0] != _ids(tok, texts[0])  # the tokenizer would merge them
    replies = [ids + [tok.token_to_id(end)] for ids in policy_ids]
    env = ToolEnv([Calculator()], ExactAnswer(), format="qwen")
    group = sample_trajectory_groups(
        Scripted(replies), tok, env, [Prompt(0, QUESTION, answer="145")], round=0, group_size=1,
        seed=0, episode=EpisodeSettings(), max_new_tokens=64, stop_token_ids=tok.stop_token_ids,
    )[0]  # fmt: skip
    row = group.prompt_ids + group.completions[0]
    rendered = _ids(tok, tok.apply_chat_template(group.episodes[0]["messages"],
                                                  tools=env.tool_schemas()))  # fmt: skip
    assert rendered[: len(row)] != row  # rendering the conversation again drifts ...
    first = group.completions[0][: len(replies[0])]
    assert first == replies[0]  # ... our row holds what was sampled
    assert group.completions[0][-len(replies[1]) :] == replies[1]


@pytest.fixture(scope="module")
def policy(tokenizers):
    tok = tokenizers["qwen2_5"]
    torch.manual_seed(0)
    model = llama3.llama3_tiny(vocab_size=tok.vocab_size, max_position_embeddings=2048)
    for p in model.parameters():  # far from ties: keyed draws land on clear tokens
        torch.nn.init.normal_(p, std=0.1)
    return model, tok, LocalEngine(model, tok, pad_id=0)


def _generate(engine, tok, max_new_tokens=6):
    config = GenerationConfig(max_new_tokens=max_new_tokens)

    def generate(rows, keys, limits=None):
        return generate_with(engine, rows, keys, config, tok.stop_token_ids, max_new_tokens=limits)

    return generate


PROMPTS = [Prompt(3, [{"role": "user", "content": "add 2 and 3"}], answer="5"),
           Prompt(5, [{"role": "user", "content": "add 4 and 4"}], answer="8")]  # fmt: skip


def test_a_one_turn_environment_samples_what_single_turn_grpo_samples(policy):
    _, tok, engine = policy
    generate = _generate(engine, tok)
    single = sample_groups(generate, tok, PROMPTS, round=2, group_size=3, seed=11)
    multi = sample_trajectory_groups(
        generate, tok, OneTurn(), PROMPTS, round=2, group_size=3, seed=11,
        episode=EpisodeSettings(), max_new_tokens=6, stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    for s, m in zip(single, multi):
        assert m.prompt_ids == s.prompt_ids and m.completions == s.completions
        assert m.logprobs == s.logprobs and m.finish == s.finish
        assert m.masks == [[1] * len(c) for c in s.completions]
    assert len({tuple(c) for g in single for c in g.completions}) > 1  # really sampled


def test_the_trainer_s_logprobs_of_multi_turn_rows_equal_the_sampler_s(policy):
    model, tok, engine = policy
    groups = sample_trajectory_groups(
        _generate(engine, tok), tok, Again(), PROMPTS, round=0, group_size=2, seed=1,
        episode=EpisodeSettings(max_turns=5), max_new_tokens=6,
        stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    assert all(e["turns"] == 3 and e["ended"] == "done" for g in groups for e in g.episodes)
    batch = group_batch(groups, pad_id=0)
    observed = sum(len(m) - sum(m) for g in groups for m in g.masks)
    assert observed > 4 * 2 * 10  # two observations of >10 tokens in each of 4 rows
    with torch.no_grad():
        trainer = completion_logprobs(model, batch)
    trained = batch["labels"] != IGNORE_INDEX
    assert int(trained.sum()) == sum(sum(m) for g in groups for m in g.masks)
    assert (trainer - batch["sampling_logprobs"]).abs()[trained].max() < 1e-5
    assert (trainer[~trained] == 0).all()


def test_an_environment_that_raises_ends_its_trajectory_at_reward_0_counted(policy):
    _, tok, engine = policy
    groups = sample_trajectory_groups(
        _generate(engine, tok), tok, FailsOnSecondTurn(), PROMPTS[:1], round=0, group_size=2,
        seed=1, episode=EpisodeSettings(), max_new_tokens=6, stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    group = groups[0]
    assert [e["ended"] for e in group.episodes] == ["error", "error"]
    assert group.rewards.tolist() == [0.0, 0.0]
    assert episode_failures(groups) == {"env: error": 2}
    for ids, mask in zip(group.completions, group.masks):  # two replies, one observation
        assert len(ids) == len(mask) and mask[0] == 1 and mask[-1] == 1 and 0 in mask


def test_a_token_budget_ends_a_trajectory_as_token_limit(policy):
    _, tok, engine = policy
    groups = sample_trajectory_groups(
        _generate(engine, tok), tok, Again(), PROMPTS[:1], round=0, group_size=2, seed=1,
        episode=EpisodeSettings(max_tokens=20), max_new_tokens=6,
        stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    group = groups[0]
    assert [e["ended"] for e in group.episodes] == ["token_limit"] * 2
    assert group.finish == ["length", "length"] and group.rewards.tolist() == [0.0, 0.0]
    assert all(len(ids) <= 20 for ids in group.completions)
    batch = group_batch(groups, pad_id=0, overlong_filter=True)
    assert (batch["labels"] == IGNORE_INDEX).all()  # the overlong filter drops them


def test_grpo_with_an_environment_logs_trajectories_and_episode_metrics(tmp_path):
    from tests.recipes.sft_world import make_model_dir, read_metrics
    from tests.rl.rl_world import grpo_overrides, make_prompts, run_rl

    model_dir, prompts = make_model_dir(tmp_path), make_prompts(tmp_path / "p.jsonl", rows=8)
    out = tmp_path / "out"
    overrides = grpo_overrides(model_dir, prompts, out, "max_steps=2", "generation.max_new_tokens=6",
                               "log_samples_every=1", "episode.max_turns=4")  # fmt: skip
    overrides += [
        f"environment._component_={AGAIN_ENV}",
        "eval_every_n_steps=2",  # held-out: one greedy trajectory per prompt
        f"val_prompts={{_component_: tunesmith.rl.prompts.PromptDataset, source: {prompts}, "
        "prompt_column: prompt, answer_column: answer}",
    ]
    run_rl("grpo", "tiny", overrides)
    first = read_metrics(out)[1]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (evaluated,) = [r for r in records if "val_reward" in r]  # step 2's
    assert evaluated["val_env/turns"] == 3.0 and evaluated["val_env/done"] == 1.0
    assert evaluated["val_reward"] == pytest.approx(
        evaluated["val_reward/digits"] + evaluated["val_reward/last_digits"], abs=1e-6
    )
    # the environment's term and the reward beside it score the same last reply
    assert evaluated["val_reward/digits"] == pytest.approx(evaluated["val_reward/last_digits"])
    assert first["env/turns"] == 3.0 and first["env/ended_done"] == 1.0
    assert first["logprob_mismatch_max"] < 1e-5  # multi-turn rows: trainer == sampler
    record = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    trajectory = record["trajectories"][0]
    roles = [m["role"] for m in trajectory["messages"]]
    assert roles == ["user", "assistant"] * 3 and len(trajectory["messages"]) == 6
    assert trajectory["messages"][2]["content"] == "Again (1)."
    # rewards beside the environment add their score of the last reply
    assert first["reward/digits"] == pytest.approx(first["reward/last_digits"], abs=1e-6)
    assert first["reward"] == pytest.approx(2 * first["reward/digits"], abs=1e-6)


def test_multi_turn_rollouts_refuse_chat_template_false():
    from tunesmith.rl.source import RolloutSettings

    with pytest.raises(ValueError, match="chat_template: false, but an environment"):
        RolloutSettings(group_size=2, chat_template=False, episode=EpisodeSettings())


def test_a_reset_that_raises_ends_its_trajectories_with_no_turn(policy):
    from tests.rl.envs_world import FailsToReset

    _, tok, engine = policy
    groups = sample_trajectory_groups(
        _generate(engine, tok), tok, FailsToReset(), PROMPTS, round=0, group_size=2, seed=1,
        episode=EpisodeSettings(), max_new_tokens=6, stop_token_ids=tok.stop_token_ids,
    )  # fmt: skip
    failed, ran = groups[1], groups[0]  # answers 8 (even: reset raises) and 5
    assert [e["ended"] for e in failed.episodes] == ["error", "error"]
    assert failed.completions == [[], []] and failed.rewards.tolist() == [0.0, 0.0]
    assert failed.prompt_ids == tok.encode(
        tok.apply_chat_template(PROMPTS[1].messages, add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert [e["ended"] for e in ran.episodes] == ["done", "done"]
    assert episode_failures(groups) == {"env: error": 2}
    batch = group_batch(groups, pad_id=0)
    assert (batch["labels"][2:] == IGNORE_INDEX).all()  # nothing of the failed group trains


def test_each_turn_continues_its_conversation_s_kv_cache(policy):
    """Sampled within ``keep_prefixes`` (as the recipes sample), the trajectories are those of
    an engine that prefills every turn from scratch, and the turns after the first prefill
    little more than their new tokens (the observation, a partly filled block)."""
    model, tok, _ = policy
    stats = {}

    def sample(kept: bool):
        engine = LocalEngine(model, tok, pad_id=0)
        generate = _generate(engine, tok)

        def recorded(rows, keys, limits=None):
            out = generate(rows, keys, limits)
            stats.setdefault(kept, []).append((rows, out.stats))
            return out

        with engine.keep_prefixes() if kept else contextlib.nullcontext():
            return sample_trajectory_groups(
                recorded, tok, Again(), PROMPTS, round=0, group_size=2, seed=1,
                episode=EpisodeSettings(max_turns=5), max_new_tokens=6,
                stop_token_ids=tok.stop_token_ids,
            )  # fmt: skip

    cached, fresh = sample(True), sample(False)
    for c, f in zip(cached, fresh, strict=True):
        assert c.completions == f.completions and c.masks == f.masks
        for got, want in zip(c.logprobs, f.logprobs):
            assert got == pytest.approx(want, abs=1e-5, rel=0)
    assert len(stats[True]) == 3  # three turns
    observations = [_zero_runs(m) for g in cached for m in g.masks]  # per row, per turn
    for turn in (1, 2):
        (rows, kept), (_, plain) = stats[True][turn], stats[False][turn]
        assert plain["prefill_tokens"] == sum(map(len, rows))  # 4 distinct rows, all new
        assert kept["prefill_tokens"] + kept["cached_tokens"] == plain["prefill_tokens"]
        # the observation, the last reply's last token (never fed) and the rest of the
        # last partly filled block: each row redoes less than one block of what it had
        observed = sum(runs[turn - 1] for runs in observations)
        assert observed < kept["prefill_tokens"] <= observed + 4 * 16


def _zero_runs(mask: list[int]) -> list[int]:
    """Lengths of the runs of 0 in ``mask`` (the observations), in order."""
    return [len(list(run)) for value, run in itertools.groupby(mask) if value == 0]
