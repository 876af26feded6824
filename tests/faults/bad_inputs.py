"""The bad-input catalogue: broken configs, datasets, checkpoints and tokenizers, each given to
``tunesmith run sft --config tiny`` (see ``test_bad_inputs.py``).

Each :class:`BadInput` has a builder that makes the broken thing inside the case's own folder
and returns a :class:`Setup`: the CLI overrides, and the words the one-line error must hold
(the file, and the row, key or tensor). A case with ``skipped`` is one where the user asked for
skipping (the shipped config's ``on_bad_row: skip``): the run must succeed and report the row
as a counted skip instead. The builders need nothing heavy at import time, so the report script
can list the catalogue cheaply.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from tests.faults.kit import (
    BAD_LINE,
    REFUSED,
    BadInput,
    Setup,
    World,
)
from tests.faults.kit import edit_json as _edit_json
from tests.faults.kit import json_bytes as _json
from tests.faults.kit import model_copy as _model_copy
from tests.faults.kit import reseal as _reseal
from tests.faults.kit import resume_copy as _resume_copy
from tests.faults.kit import rows_with as _rows_with

__all__ = ["BAD_INPUTS", "BadInput", "Setup", "World"]


# ----------------------------------------------------------------------------- configs


def _override(override: str, *words: str) -> Callable[[World], Setup]:
    return lambda world: Setup([override], list(words))


def _yaml_syntax_error(world: World) -> Setup:
    from tunesmith.cli import catalog

    text = catalog.config_path("tiny", "sft").read_text()
    path = world.tmp / "broken.yaml"
    path.write_text(text.replace("batch_size: 4", "batch_size: [4"))
    return Setup([], [f"{path}:", "YAML syntax error"], config=str(path))


def _model_dir_missing(world: World) -> Setup:
    return Setup([f"model_dir={world.tmp / 'nowhere'}"], [str(world.tmp / "nowhere")])


def _resume_folder_missing(world: World) -> Setup:
    where = world.tmp / "nowhere"
    return Setup([f"resume={where}"], [f"resume={where}", "no such checkpoint folder"])


def _output_dir_has_checkpoints(world: World) -> Setup:
    shutil.copytree(world.finished, world.out)
    words = [str(world.out / "checkpoints"), "already holds checkpoints", "step_000001",
             "resume=true", "overwrite=true"]  # fmt: skip
    return Setup([], words)


# ----------------------------------------------------------------------------- datasets

_ROW_CASES = {  # id suffix -> (what, the bad line, the reason reported)
    "malformed-json-line": ("a JSONL line cut short", b'{"messages": [', "malformed_json"),
    "wrong-column-type": (
        "an assistant turn whose content is a number",
        _json({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": 4}]}),
        "wrong_type",
    ),
    "missing-column": ("a row without the 'messages' column", _json({"other": 1}), "missing_field"),
    "non-utf8-bytes": ("a line with bytes that are not UTF-8", b'{"messages": "\xff\xfe"}', "invalid_utf8"),
    "huge-line": (
        "a 120 kB user turn (truncation leaves no assistant token)",
        _json({"messages": [{"role": "user", "content": "hot " * 30_000},
                            {"role": "assistant", "content": "yes"}]}),
        "no_trained_tokens",
    ),
    "no-assistant-turn": (
        "a conversation without an assistant turn",
        _json({"messages": [{"role": "user", "content": "a"}]}),
        "no_assistant_turn",
    ),
    "roles-out-of-order": (
        "a conversation that starts with the assistant",
        _json({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]}),
        "roles_out_of_order",
    ),
    "unknown-role": (
        "a turn with role 'bot'",
        _json({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}),
        "unknown_role",
    ),
    "row-not-an-object": ("a line holding a JSON list", b"[1, 2]", "wrong_type"),
}  # fmt: skip


def _bad_row(line: bytes, reason: str, skip: bool) -> Callable[[World], Setup]:
    def build(world: World) -> Setup:
        path = _rows_with(world, line)
        if skip:  # the shipped config skips bad rows; the report must count this one
            words = [f"{path}: 17 rows -> 16 samples", f"skipped 1 x {reason} (lines {BAD_LINE};"]
            return Setup([f"dataset.source={path}"], words, skipped=reason)
        words = [f"{path}: bad row at line {BAD_LINE}: {reason}"]
        return Setup([f"dataset.source={path}", "dataset.on_bad_row=error"], words)

    return build


def _empty_file(world: World) -> Setup:
    path = world.tmp / "empty.jsonl"
    path.write_bytes(b"")
    return Setup([f"dataset.source={path}"], [f"{path}: file is empty"])


def _missing_file(world: World) -> Setup:
    path = world.tmp / "nope.jsonl"
    return Setup([f"dataset.source={path}"], [f"{path}: no such file"])


def _all_rows_bad(world: World) -> Setup:
    path = world.tmp / "bad.jsonl"
    path.write_bytes(_json({"messages": [{"role": "user", "content": "a"}]}) + b"\n")
    return Setup([f"dataset.source={path}"], [f"{path}: no usable samples", "no_assistant_turn"])


def _columns_of_another_format(world: World) -> Setup:
    return Setup(["dataset.format=alpaca"], [f"{world.data}:", "needs column 'instruction'"])


# ----------------------------------------------------------------------------- checkpoints


def _truncated_safetensors(world: World) -> Setup:
    model = _model_copy(world)
    path = model / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    return Setup([f"model_dir={model}"], [str(path), "not a valid safetensors file"])


def _rewrite_tensors(world: World, change: Callable[[dict], None]) -> Path:
    from safetensors.torch import load_file, save_file

    model = _model_copy(world)
    tensors = load_file(model / "model.safetensors")
    change(tensors)
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model


def _wrong_shape(world: World) -> Setup:
    name = "model.layers.0.self_attn.q_proj.weight"
    model = _rewrite_tensors(world, lambda t: t.__setitem__(name, t[name][:32].clone()))
    return Setup(
        [f"model_dir={model}"], [f"{model / 'model.safetensors'}", name, "[32, 64]", "[64, 64]"]
    )


def _missing_tensor(world: World) -> Setup:
    model = _rewrite_tensors(world, lambda t: t.pop("model.norm.weight"))
    return Setup([f"model_dir={model}"], [str(model), "missing", "model.norm.weight"])


def _missing_shard(world: World) -> Setup:
    from tunesmith.models.hf import from_hf, save_hf_checkpoint

    model = save_hf_checkpoint(
        from_hf(world.model_dir),
        world.tmp / "sharded",
        max_shard_size="100KB",
        source_dir=world.model_dir,
    )
    victim = sorted(model.glob("model-*.safetensors"))[1]
    victim.unlink()
    return Setup([f"model_dir={model}"], [str(model / "model.safetensors.index.json"), victim.name])


def _unknown_model_type(world: World) -> Setup:
    model = _model_copy(world)
    _edit_json(model / "config.json", model_type="no_such_arch")
    return Setup(
        [f"model_dir={model}"],
        [str(model / "config.json"), "'no_such_arch' is neither a native family nor"],
    )


def _weights_of_another_type(world: World) -> Setup:
    """A type transformers builds (the transformers backend) over another type's weights:
    transformers would draw the missing tensors at random; refused naming them."""
    model = _model_copy(world)
    _edit_json(model / "config.json", model_type="gpt2")
    return Setup(
        [f"model_dir={model}"],
        [
            str(model),
            "do not match its config's gpt2 model: missing_keys [",
            "'transformer.h.0.attn.c_attn.bias'",
            "unexpected_keys ['model.embed_tokens.weight'",
        ],
    )


def _missing_config(world: World) -> Setup:
    model = _model_copy(world)
    (model / "config.json").unlink()
    return Setup([f"model_dir={model}"], [f"{model / 'config.json'} not found"])


def _config_not_json(world: World) -> Setup:
    model = _model_copy(world)
    (model / "config.json").write_text("{model_type: qwen2")
    return Setup([f"model_dir={model}"], [str(model / "config.json"), "cannot parse"])


def _resume_truncated_weights(world: World) -> Setup:
    step = _resume_copy(world)
    path = step / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-500])
    _reseal(step)
    return Setup([f"resume={step}"], [str(path), "not a valid safetensors file"])


def _resume_corrupt_optimizer_metadata(world: World) -> Setup:
    step = _resume_copy(world)
    path = step / "training_state" / "optimizer" / ".metadata"
    size = path.stat().st_size
    path.write_bytes((b"\x80\x04junk" * size)[:size])
    _reseal(step)
    return Setup([f"resume={step}"], [str(path), "not a readable checkpoint metadata file"])


def _resume_missing_rank_state(world: World) -> Setup:
    step = _resume_copy(world)
    path = step / "training_state" / "rank0.pt"
    path.unlink()
    _reseal(step)
    return Setup([f"resume={step}"], [f"{path} is missing", "1-rank run"])


def _resume_truncated_rank_state(world: World) -> Setup:
    step = _resume_copy(world)
    path = step / "training_state" / "rank0.pt"
    path.write_bytes(path.read_bytes()[:100])
    _reseal(step)
    return Setup([f"resume={step}"], [str(path), "truncated or corrupt"])


def _resume_other_model_size(world: World) -> Setup:
    from tunesmith.data import Tokenizer
    from tunesmith.models import build_model, qwen2_5
    from tunesmith.models.hf import save_hf_checkpoint

    vocab = Tokenizer.from_pretrained(world.model_dir).vocab_size
    spec = qwen2_5.spec("qwen2_5_tiny", vocab_size=vocab, intermediate_size=96)
    model = save_hf_checkpoint(build_model(spec), world.tmp / "wider", source_dir=world.model_dir)
    step = world.finished / "checkpoints" / "step_000001"
    # the checkpoint records its run's config: the other model_dir is refused before any weight
    # is read (a checkpoint without a record reaches the shape check of the loader instead)
    words = [f"resume from {step}", f"model_dir: '{world.model_dir}' -> '{model}'"]
    return Setup([f"model_dir={model}", f"resume={step}"], words)


def _resume_only_checkpoint_damaged(world: World) -> Setup:
    step = _resume_copy(world)
    (step / "model.safetensors").write_bytes(b"")  # no longer matches its manifest
    root = world.out / "checkpoints"
    return Setup(["resume=true"], [f"no usable checkpoint in {root}", "step_000001"])


# ----------------------------------------------------------------------------- tokenizers


def _no_chat_template(world: World) -> Setup:
    model = _model_copy(world)
    _edit_json(model / "tokenizer_config.json", chat_template=None)
    for template in model.glob("*.jinja"):
        template.unlink()
    return Setup([f"model_dir={model}"], [str(model), "no chat_template"])


def _no_tokenizer_json(world: World) -> Setup:
    model = _model_copy(world)
    (model / "tokenizer.json").unlink()
    return Setup([f"model_dir={model}"], [f"{model / 'tokenizer.json'}: missing"])


def _tokenizer_config_not_json(world: World) -> Setup:
    model = _model_copy(world)
    (model / "tokenizer_config.json").write_text("{")
    return Setup([f"model_dir={model}"], [f"{model / 'tokenizer_config.json'}: not valid JSON"])


def _special_token_not_in_vocab(world: World) -> Setup:
    model = _model_copy(world)
    _edit_json(model / "tokenizer_config.json", eos_token="<|nope|>")
    path = model / "tokenizer_config.json"
    return Setup(
        [f"model_dir={model}"], [str(path), "eos_token '<|nope|>' is not in the vocabulary"]
    )


def _tokenizer_of_another_model(world: World) -> Setup:
    from tunesmith.data import Tokenizer
    from tunesmith.models import build_model, qwen2_5
    from tunesmith.models.hf import save_hf_checkpoint

    vocab = Tokenizer.from_pretrained(world.model_dir).vocab_size
    spec = qwen2_5.spec("qwen2_5_tiny", vocab_size=300)
    model = save_hf_checkpoint(build_model(spec), world.tmp / "small", source_dir=world.model_dir)
    words = [f"tokenizer {model} has {vocab} token ids", "embeds only 300"]
    return Setup([f"model_dir={model}"], words)


# ----------------------------------------------------------------------------- the catalogue

_REFUSED = REFUSED

BAD_INPUTS: list[BadInput] = [
    # configs
    BadInput(
        "config-misspelt-key",
        "config",
        "`bach_size=4`",
        _REFUSED.format("the key and 'batch_size'"),
        _override("bach_size=4", "bach_size", "did you mean 'batch_size'"),
    ),
    BadInput(
        "config-misspelt-argument",
        "config",
        "`optimizer.lrr=0.1`",
        _REFUSED.format("optimizer.lrr and 'lr'"),
        _override("optimizer.lrr=0.1", "optimizer.lrr", "did you mean 'lr'"),
    ),
    BadInput(
        "config-wrong-type",
        "config",
        "`optimizer.lr=fast`",
        _REFUSED.format("optimizer.lr and the type"),
        _override("optimizer.lr=fast", "optimizer.lr", "expected float", "'fast'"),
    ),
    BadInput(
        "config-missing-value",
        "config",
        "`model_dir=???` (required value left out)",
        _REFUSED.format("model_dir"),
        _override("model_dir=???", "model_dir: value is missing"),
    ),
    BadInput(
        "config-unknown-component",
        "config",
        "`optimizer._component_=torch.optim.Adamw`",
        _REFUSED.format("the key and 'torch.optim.AdamW'"),
        _override(
            "optimizer._component_=torch.optim.Adamw",
            "optimizer._component_",
            "did you mean 'torch.optim.AdamW'",
        ),
    ),
    BadInput(
        "config-unresolvable-interpolation",
        "config",
        "`output_dir=${nowhere}`",
        _REFUSED.format("output_dir and ${nowhere}"),
        _override("output_dir=${nowhere}", "output_dir", "${nowhere}"),
    ),
    BadInput(
        "config-yaml-syntax-error",
        "config",
        "a config file with an unclosed `[`",
        _REFUSED.format("the file and line"),
        _yaml_syntax_error,
    ),
    BadInput(
        "config-bad-choice",
        "config",
        "`dataset.train_on=user`",
        _REFUSED.format("dataset and train_on"),
        _override("dataset.train_on=user", "dataset.train_on: expected one of", "'user'"),
    ),
    BadInput(
        "config-bad-timeout",
        "config",
        "`distributed_timeout_s=-1`",
        _REFUSED.format("distributed_timeout_s"),
        _override(
            "distributed_timeout_s=-1",
            "distributed_timeout_s: expected a number of seconds > 0",
            "got -1",
        ),
    ),
    BadInput(
        "config-model-dir-missing",
        "config",
        "`model_dir` that does not exist",
        _REFUSED.format("the folder"),
        _model_dir_missing,
    ),
    BadInput(
        "config-resume-folder-missing",
        "config",
        "`resume=<folder that does not exist>`",
        _REFUSED.format("the folder"),
        _resume_folder_missing,
    ),
    BadInput(
        "config-batch-larger-than-data",
        "config",
        "`batch_size=1000` for 16 samples",
        _REFUSED.format("batch_size"),
        _override("batch_size=1000", "16 samples make no optimizer step", "batch_size 1000"),
    ),
    BadInput(
        "config-output-dir-holds-checkpoints",
        "config",
        "a new run into an output_dir that holds another run's checkpoints",
        _REFUSED.format(
            "the folder, resume=true and overwrite=true; the old checkpoints untouched"
        ),
        _output_dir_has_checkpoints,
    ),
    # datasets: each bad row refused with on_bad_row=error ...
    *(
        BadInput(
            f"dataset-{name}",
            "dataset",
            f"{what} (row 8), `on_bad_row=error`",
            _REFUSED.format(f"the file, row 8, line 9 and '{reason}'"),
            _bad_row(line, reason, skip=False),
        )
        for name, (what, line, reason) in _ROW_CASES.items()
    ),
    # ... and counted when the user asked for skipping
    *(
        BadInput(
            f"dataset-{name}-skipped",
            "dataset",
            f"{what} (row 8), `on_bad_row=skip`",
            f"trains on the 16 good rows; the log counts 'skipped 1 x {reason} (lines 9'",
            _bad_row(line, reason, skip=True),
        )
        for name, (what, line, reason) in _ROW_CASES.items()
    ),
    BadInput(
        "dataset-empty-file",
        "dataset",
        "an empty JSONL file",
        _REFUSED.format("the file"),
        _empty_file,
    ),
    BadInput(
        "dataset-missing-file",
        "dataset",
        "`dataset.source` that does not exist",
        _REFUSED.format("the file"),
        _missing_file,
    ),
    BadInput(
        "dataset-all-rows-bad",
        "dataset",
        "every row bad, `on_bad_row=skip`",
        _REFUSED.format("the file and the reason"),
        _all_rows_bad,
    ),
    BadInput(
        "dataset-columns-of-another-format",
        "dataset",
        "chat data read as `format=alpaca`",
        _REFUSED.format("the file and the missing column"),
        _columns_of_another_format,
    ),
    # checkpoints
    BadInput(
        "checkpoint-truncated-safetensors",
        "checkpoint",
        "model.safetensors cut short by 1000 bytes",
        _REFUSED.format("the file"),
        _truncated_safetensors,
    ),
    BadInput(
        "checkpoint-wrong-shape",
        "checkpoint",
        "q_proj of layer 0 with half its rows",
        _REFUSED.format("the file, the tensor and both shapes"),
        _wrong_shape,
    ),
    BadInput(
        "checkpoint-missing-tensor",
        "checkpoint",
        "model.norm.weight left out of the file",
        _REFUSED.format("the folder and the tensor"),
        _missing_tensor,
    ),
    BadInput(
        "checkpoint-missing-shard",
        "checkpoint",
        "a sharded folder with shard 2 of 5 deleted",
        _REFUSED.format("the index and the shard"),
        _missing_shard,
    ),
    BadInput(
        "checkpoint-unknown-model-type",
        "checkpoint",
        "config.json with a model_type neither native nor transformers'",
        _REFUSED.format("config.json and the type"),
        _unknown_model_type,
    ),
    BadInput(
        "checkpoint-weights-of-another-type",
        "checkpoint",
        "config.json with model_type 'gpt2' over Qwen2.5 weights (the transformers backend)",
        _REFUSED.format("the folder and the missing tensors"),
        _weights_of_another_type,
    ),
    BadInput(
        "checkpoint-missing-config",
        "checkpoint",
        "a model folder without config.json",
        _REFUSED.format("config.json"),
        _missing_config,
    ),
    BadInput(
        "checkpoint-config-not-json",
        "checkpoint",
        "config.json that is not JSON",
        _REFUSED.format("config.json"),
        _config_not_json,
    ),
    BadInput(
        "checkpoint-resume-truncated-weights",
        "checkpoint",
        "resume from a checkpoint whose model.safetensors is cut short (its manifest rewritten to match: the loader's own check)",
        _REFUSED.format("the file"),
        _resume_truncated_weights,
    ),
    BadInput(
        "checkpoint-resume-corrupt-optimizer-metadata",
        "checkpoint",
        "resume from a checkpoint whose optimizer .metadata is junk (its manifest rewritten to match: the loader's own check)",
        _REFUSED.format("the file"),
        _resume_corrupt_optimizer_metadata,
    ),
    BadInput(
        "checkpoint-resume-missing-rank-state",
        "checkpoint",
        "resume from a checkpoint without training_state/rank0.pt (its manifest rewritten to match: the loader's own check)",
        _REFUSED.format("the file"),
        _resume_missing_rank_state,
    ),
    BadInput(
        "checkpoint-resume-truncated-rank-state",
        "checkpoint",
        "resume from a checkpoint whose rank0.pt is cut short (its manifest rewritten to match: the loader's own check)",
        _REFUSED.format("the file"),
        _resume_truncated_rank_state,
    ),
    BadInput(
        "checkpoint-resume-other-model-size",
        "checkpoint",
        "resume a wider model from a checkpoint of the tiny one",
        _REFUSED.format("the checkpoint and the changed model_dir, before any weight is read"),
        _resume_other_model_size,
    ),
    BadInput(
        "checkpoint-resume-only-checkpoint-damaged",
        "checkpoint",
        "`resume=true` when the only checkpoint no longer matches its manifest",
        _REFUSED.format("the folder (instead of silently restarting from step 0)"),
        _resume_only_checkpoint_damaged,
    ),
    # tokenizers
    BadInput(
        "tokenizer-missing-chat-template",
        "tokenizer",
        "chat data, tokenizer without a chat template",
        _REFUSED.format("the tokenizer folder"),
        _no_chat_template,
    ),
    BadInput(
        "tokenizer-missing-tokenizer-json",
        "tokenizer",
        "a model folder without tokenizer.json",
        _REFUSED.format("the file"),
        _no_tokenizer_json,
    ),
    BadInput(
        "tokenizer-config-not-json",
        "tokenizer",
        "tokenizer_config.json that is not JSON",
        _REFUSED.format("the file"),
        _tokenizer_config_not_json,
    ),
    BadInput(
        "tokenizer-special-token-not-in-vocab",
        "tokenizer",
        "eos_token `<|nope|>` that the vocabulary lacks",
        _REFUSED.format("the file and the key"),
        _special_token_not_in_vocab,
    ),
    BadInput(
        "tokenizer-of-another-model",
        "tokenizer",
        "a 651-id tokenizer with a model that embeds 300 ids",
        _REFUSED.format("both sizes (no index error mid-training)"),
        _tokenizer_of_another_model,
    ),
]

# Cases that live in their own modules (each area of the suite keeps its builders together).
from tests.faults import (  # noqa: E402
    bad_inputs_checkpoints,
    bad_inputs_errors,
    bad_inputs_loop,
    file_cases,
)

BAD_INPUTS += [*bad_inputs_loop.CASES, *bad_inputs_checkpoints.CASES, *bad_inputs_errors.CASES]
BAD_INPUTS += file_cases.BAD_INPUTS
