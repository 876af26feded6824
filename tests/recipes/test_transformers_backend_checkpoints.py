"""The transformers backend's runs checkpoint, resume, shard and export like native ones.

The architectures of :data:`~tests.models.transformers_world.ARCHITECTURES` (StarCoder 2:
biases, a GELU MLP; Cohere 2: a logit scale, sliding and full attention; LFM2: convolution
layers beside attention) have no native family: ``from_hf`` wraps transformers' own model
(:class:`~tunesmith.models.transformers_backend.TransformersLM`). Through the SFT recipe:

- FSDP2 on two gloo ranks == one process, full fine-tuning and LoRA (same logged losses, grad
  norms and token counts, same final weights within the distributed tests' tolerance), also
  across a stop and resume on the two ranks (a tied head, stored once, loaded back into both
  of its names).
- Activation checkpointing (full, selective) and compiled layers (``eager``, ``aot_eager``
  backends) give the plain run's step-1 loss, grad norm and gradients (one SGD step: the weights
  moved by ``lr x grad``).
- A run stopped at step k and resumed ends with bitwise the weights of the uninterrupted run
  and logs its metrics from step k+1 on.
- A LoRA checkpoint is a PEFT folder that ``peft`` loads onto transformers' own model with the
  logits of our trained model; ``tunesmith export`` merges it into a plain HF folder that
  transformers loads with those logits too; a full fine-tune's checkpoint loads in
  transformers as is, with our model's logits.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch import nn

from tests import forked
from tests.models.transformers_world import make_transformers_model_dir
from tests.recipes.sft_world import (
    assert_resumed_as_uninterrupted,
    assert_same_as_single,
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    final_weights,
    largest_change,
    launch_ranks,
    make_counting_data,
    read_metrics,
    run_sft,
    run_sft_keeping_model,
    sft_overrides,
)
from tunesmith.data import SFTDataset, Tokenizer, collate_padded
from tunesmith.models import from_hf
from tunesmith.models.base_record import BASE_RECORD
from tunesmith.models.peft_io import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, load_peft_adapter
from tunesmith.models.transformers_backend import TransformersLM
from tunesmith.modules.decoder import decoder_layers
from tunesmith.modules.peft import adapter_modules, disable_adapters
from tunesmith.training.checkpoint.directory import MARKER
from tunesmith.training.memory.activations import is_checkpointed
from tunesmith.training.memory.compile import is_compiled

ROWS, BATCH, PER_RANK, STEPS = 24, 4, 2, 3  # the single process's batch: 2 ranks x PER_RANK
TOTAL = 10  # resumed runs: 6 steps an epoch, so two epochs
TARGETS = ("q_proj", "v_proj")  # what tiny_lora.yaml adapts
# One plain SGD step at the full learning rate, no clipping (a bound no norm reaches: the norm
# is logged, the gradients are left as they are): the weights move by lr x grad, so equal
# weights after it are equal step-1 gradients (Adam would magnify rounding noise).
ONE_SGD_STEP = ["max_steps=1", "max_grad_norm=1.0e9", "lr_scheduler.num_warmup_steps=0",
                "optimizer=torch.optim.SGD", "optimizer.lr=0.5",
                "loss._component_=tunesmith.modules.losses.CrossEntropyLoss"]  # fmt: skip
ATOL = 1e-5  # fp32 logits of two implementations, as in test_sft_lora / test_sft_export


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> tuple[Path, Path, Callable[[str], Path]]:
    """(root, the counting data, model type -> its HF folder, made once)."""
    root = tmp_path_factory.mktemp("transformers_ckpt")
    data = make_counting_data(root / "count.jsonl", rows=ROWS)
    folders: dict[str, Path] = {}

    def model_dir(model_type: str) -> Path:
        if model_type not in folders:
            folders[model_type] = make_transformers_model_dir(root / model_type, model_type)
        return folders[model_type]

    return root, data, model_dir


@pytest.fixture(scope="module")
def trained(world) -> Callable[[str, str], tuple[Path, nn.Module]]:
    """(model type, config) -> (output folder, the model it trained, in eval mode): one
    process, batch BATCH, STEPS steps, run once each."""
    root, data, model_dir = world
    runs: dict[tuple[str, str], tuple[Path, nn.Module]] = {}

    def get(model_type: str, config: str) -> tuple[Path, nn.Module]:
        if (model_type, config) not in runs:
            out, model = run_sft_keeping_model(
                model_dir(model_type),
                data,
                root / model_type / f"single-{config}",
                f"batch_size={BATCH}",
                f"max_steps={STEPS}",
                config=config,
            )
            assert isinstance(model, TransformersLM)  # built by the backend (LoRA: in place)
            runs[model_type, config] = (out, model.eval())
        return runs[model_type, config]

    return get


def _probe_ids(model_dir: Path, data: Path) -> torch.Tensor:
    """Three real conversations (right-padded) and two rows of random tokens."""
    tokenizer = Tokenizer.from_pretrained(model_dir)
    samples = SFTDataset(tokenizer, source=str(data)).samples[:3]
    ids = collate_padded(samples, pad_id=tokenizer.pad_id)["input_ids"]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    noise = torch.randint(0, vocab, (2, ids.shape[1]), generator=torch.Generator().manual_seed(0))
    return torch.cat([ids, noise])


def _hf(folder: Path) -> transformers.PreTrainedModel:
    """transformers' own model of ``folder`` (eval mode), loaded with no missing, unexpected or
    mismatched weights."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not any(info.values()), info
    return model.eval()


def _assert_same_logits(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=ATOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


# -- FSDP2 on two gloo ranks == one process ---------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        pytest.param("starcoder2", "tiny", id="starcoder2-full"),
        pytest.param("cohere2", "tiny_lora", id="cohere2-lora", marks=pytest.mark.slow),
        pytest.param("starcoder2", "tiny_lora", id="starcoder2-lora", marks=pytest.mark.slow),
        pytest.param("cohere2", "tiny", id="cohere2-full", marks=pytest.mark.slow),
        pytest.param("lfm2", "tiny", id="lfm2-full", marks=pytest.mark.slow),
    ],
)
def test_two_gloo_ranks_equal_one_process(world, trained, tmp_path, model_type, config):
    _, data, model_dir = world
    single, _ = trained(model_type, config)
    fsdp = tmp_path / "fsdp"
    overrides = sft_overrides(
        model_dir(model_type), data, fsdp, f"batch_size={PER_RANK}", f"max_steps={STEPS}"
    )
    launch_ranks(overrides, tmp_path, config=config)
    assert "transformers backend" in (tmp_path / "rank0.log").read_text()
    lora = config == "tiny_lora"
    assert_same_as_single(model_dir(model_type), single, fsdp, steps=STEPS, lora=lora)


@pytest.mark.slow  # two launches of two ranks
@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        pytest.param("lfm2", "tiny", id="lfm2-full"),
        pytest.param("cohere2", "tiny_lora", id="cohere2-lora"),
    ],
)
def test_two_gloo_ranks_stop_and_resume_equal_one_process(
    world, trained, tmp_path, model_type, config
):
    """Each rank reloads its shard of the weights (a tied head: stored once, both names
    loaded) or adapters, and of the optimizer state."""
    _, data, model_dir = world
    single, _ = trained(model_type, config)
    fsdp = tmp_path / "fsdp"
    common = (f"batch_size={PER_RANK}", f"max_steps={STEPS}")
    for extra in ("stop_after_steps=2", "resume=true"):
        overrides = sft_overrides(model_dir(model_type), data, fsdp, *common, extra)
        launch_ranks(overrides, tmp_path, config=config)
        if extra.startswith("stop"):
            assert [p.name for p in checkpoints(fsdp)] == ["step_000002"]
    assert "resumed from" in (tmp_path / "rank0.log").read_text()
    lora = config == "tiny_lora"
    assert_same_as_single(model_dir(model_type), single, fsdp, steps=STEPS, resumed=True, lora=lora)


# -- activation checkpointing and compiled layers == the plain run ------------------------------

SWITCHES = {
    "checkpoint_full": ["activation_checkpointing={mode: full}"],
    "checkpoint_selective": ["activation_checkpointing={mode: selective, every_k: 1}"],
    "compile_eager": ["compile={backend: eager}"],  # dynamo's graphs of each layer, run eagerly
    "compile_aot_eager": ["compile={backend: aot_eager}"],  # + AOTAutograd's joint graph
    "optimizer_in_backward": ["optimizer_in_backward=true", "max_grad_norm=null"],
}


@pytest.fixture(scope="module")
def plain_step(world) -> Callable[[str], Path]:
    """Model type -> the output of its plain ONE_SGD_STEP run (run once each)."""
    root, data, model_dir = world
    runs: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in runs:
            out = root / model_type / "plain-step"
            runs[model_type] = run_sft(model_dir(model_type), data, out, *ONE_SGD_STEP)
        return runs[model_type]

    return get


@pytest.mark.parametrize(
    ("model_type", "switch"),
    [
        pytest.param("cohere2", "checkpoint_full", id="cohere2-checkpoint_full"),
        pytest.param("starcoder2", "checkpoint_selective", id="starcoder2-checkpoint_selective"),
        pytest.param("starcoder2", "compile_aot_eager", id="starcoder2-compile_aot_eager"),
        pytest.param("cohere2", "optimizer_in_backward", id="cohere2-optimizer_in_backward"),
        pytest.param("starcoder2", "checkpoint_full", id="starcoder2-checkpoint_full",
                     marks=pytest.mark.slow),
        pytest.param("lfm2", "checkpoint_full", id="lfm2-checkpoint_full", marks=pytest.mark.slow),
        pytest.param("starcoder2", "compile_eager", id="starcoder2-compile_eager",
                     marks=pytest.mark.slow),
        pytest.param("cohere2", "compile_aot_eager", id="cohere2-compile_aot_eager",
                     marks=pytest.mark.slow),
        pytest.param("lfm2", "compile_aot_eager", id="lfm2-compile_aot_eager",
                     marks=pytest.mark.slow),
    ],
)  # fmt: skip
def test_switch_gives_the_plain_step(world, plain_step, tmp_path, model_type, switch):
    _, data, model_dir = world
    plain = plain_step(model_type)
    out, model = run_sft_keeping_model(
        model_dir(model_type), data, tmp_path / switch, *ONE_SGD_STEP, *SWITCHES[switch]
    )
    layers = decoder_layers(model)
    assert len(layers) == model.spec.num_hidden_layers
    if switch.startswith(("checkpoint", "compile")):
        applied = is_checkpointed if switch.startswith("checkpoint") else is_compiled
        assert all(applied(layer) for layer in layers), f"{switch} is not on every layer"

    expected, got = read_metrics(plain)[1], read_metrics(out)[1]
    assert got["trained_tokens_in_window"] == expected["trained_tokens_in_window"]
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    if "grad_norm" in got:  # the optimizer in backward frees each gradient as it steps
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    weights, plain_weights = final_weights(out), final_weights(plain)
    assert largest_change(plain_weights, checkpoint_weights(model_dir(model_type))) > 1e-3
    assert_same_weights(weights, plain_weights, 2e-6)  # w - lr x grad: the same gradients


# -- stop and resume == uninterrupted, bitwise -------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "config", "stop_at"),
    [
        pytest.param("cohere2", "tiny", 4, id="cohere2-full-mid-epoch"),
        pytest.param("starcoder2", "tiny_lora", 6, id="starcoder2-lora-epoch-boundary"),
        # checkpoints hold per-expert tensors, the model fused ones: converted back on resume
        pytest.param("mixtral", "tiny", 4, id="mixtral-full-mid-epoch"),
        pytest.param("lfm2", "tiny", 4, id="lfm2-full-mid-epoch", marks=pytest.mark.slow),
        pytest.param("starcoder2", "tiny", 7, id="starcoder2-full", marks=pytest.mark.slow),
    ],
)
def test_stop_and_resume_equals_uninterrupted(world, tmp_path, model_type, config, stop_at):
    _, data, model_dir = world
    folder = model_dir(model_type)
    common = (f"batch_size={BATCH}", f"max_steps={TOTAL}")
    reference = run_sft(folder, data, tmp_path / "uninterrupted", *common, config=config)
    out = tmp_path / "run"
    run_sft(folder, data, out, *common, f"stop_after_steps={stop_at}", config=config)
    assert [p.name for p in checkpoints(out)] == [f"step_{stop_at:06d}"]
    assert sorted(read_metrics(out)) == list(range(1, stop_at + 1))
    run_sft(folder, data, out, *common, "resume=true", config=config)
    assert checkpoints(out)[-1].name == f"step_{TOTAL:06d}"
    assert_resumed_as_uninterrupted(out, reference, steps=TOTAL, from_step=stop_at + 1)
    if config == "tiny":
        assert largest_change(final_weights(reference), checkpoint_weights(folder)) > 1e-3


# -- what transformers and peft load -----------------------------------------------------------

ARCHS = ["starcoder2", "cohere2", "lfm2"]


def _trained_checkpoint(
    world, trained, model_type: str, config: str
) -> tuple[Path, nn.Module, Path, torch.Tensor]:
    """(the base folder of ``model_type``, the model ``trained`` trained on ``config``, its
    last checkpoint, the probe ids)."""
    _, data, model_dir = world
    folder = model_dir(model_type)
    out, model = trained(model_type, config)
    return folder, model, checkpoints(out)[-1], _probe_ids(folder, data)


@pytest.mark.parametrize("model_type", ARCHS)
def test_lora_checkpoint_is_a_peft_adapter_peft_loads_with_our_logits(world, trained, model_type):
    folder, model, step_dir, ids = _trained_checkpoint(world, trained, model_type, "tiny_lora")
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, BASE_RECORD, MARKER, "training_state"]
    )
    config = json.loads((step_dir / ADAPTER_CONFIG_NAME).read_text())
    assert config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted(TARGETS)
    assert config["base_model_name_or_path"] == str(folder)
    tensors = load_file(step_dir / ADAPTER_WEIGHTS_NAME)
    assert len(tensors) == 2 * len(adapter_modules(model)) > 0
    assert all(n.startswith("base_model.model.") for n in tensors)

    theirs_model = peft.PeftModel.from_pretrained(_hf(folder), step_dir).eval()
    with torch.no_grad():
        ours = model(ids)
        with disable_adapters(model):
            base = model(ids)
        theirs = theirs_model(ids).logits
        reloaded = load_peft_adapter(from_hf(folder), step_dir).eval()(ids)
    assert (ours - base).abs().max() > 1e-4, "the adapter must change the logits"
    _assert_same_logits(theirs, ours, "peft: transformers' model + adapter vs ours")
    _assert_same_logits(reloaded, ours, "from_hf + load_peft_adapter vs the trained model")


@pytest.mark.parametrize(
    "model_type",
    [  # ~3 s each: the CLI in a child process
        pytest.param("cohere2"),
        pytest.param("starcoder2", marks=pytest.mark.slow),
        pytest.param("lfm2", marks=pytest.mark.slow),
    ],
)
def test_cli_export_merges_the_lora_checkpoint_into_a_folder_transformers_loads(
    world, trained, tmp_path, model_type
):
    folder, model, step_dir, ids = _trained_checkpoint(world, trained, model_type, "tiny_lora")
    merged_dir = tmp_path / "merged"
    result = forked.run_cli(["export", step_dir, "--output-dir", merged_dir])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert not (merged_dir / ADAPTER_CONFIG_NAME).exists()
    assert json.loads((merged_dir / "config.json").read_text())["model_type"] == model_type

    merged = _hf(merged_dir)  # no missing, unexpected or mismatched weights
    with torch.no_grad():
        _assert_same_logits(merged(ids).logits, model(ids), "merged export vs base + adapter")
    merged_weights, base = checkpoint_weights(merged_dir), checkpoint_weights(folder)
    assert merged_weights.keys() == base.keys()
    assert largest_change(merged_weights, base) > 1e-4  # the adapter was merged in


@pytest.mark.parametrize("model_type", ARCHS)
def test_full_checkpoint_loads_in_transformers_with_our_logits(world, trained, model_type):
    folder, model, step_dir, ids = _trained_checkpoint(world, trained, model_type, "tiny")
    hf = _hf(step_dir)
    with torch.no_grad():
        expected = hf(ids).logits
        _assert_same_logits(model(ids), expected, "the trained model vs transformers")
        _assert_same_logits(from_hf(step_dir).eval()(ids), expected, "from_hf vs transformers")
    saved, initial = checkpoint_weights(step_dir), checkpoint_weights(folder)
    assert saved.keys() == initial.keys()
    assert largest_change(saved, initial) > 1e-3
    for name, tensor in hf.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
