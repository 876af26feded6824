"""The shipped ``sft/mixtral_8x7b_lora`` config: ``tunesmith validate``'s checks pass on a
(tiny) Mixtral folder, and its memory plan on 8 ranks at the real size (printed) fits a GPU,
with expert parallel holding one expert of each layer per rank."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import make_chat_data, make_model_dir
from tunesmith.cli import catalog
from tunesmith.config import load_config
from tunesmith.models import mixtral
from tunesmith.modules.peft import apply_lora
from tunesmith.recipes.catalog import check_run
from tunesmith.training.memory.planner import estimate_memory, optimizer_kind
from tunesmith.training.parallel.distributed import ParallelDims

CONFIG = catalog.config_path("mixtral_8x7b_lora", "sft")


def test_validate_passes_on_a_mixtral_folder(tmp_path):
    model_dir = make_model_dir(tmp_path, family=mixtral)
    data = make_chat_data(tmp_path / "chats.jsonl", rows=4)
    cfg = load_config(CONFIG, [f"model_dir={model_dir}", f"dataset.source={data}"])
    assert check_run(cfg, catalog.recipe_path("sft")) == []  # raises on any problem
    # (the model is nested under apply_lora: no top-level backend line)
    cfg = load_config(CONFIG, [f"model_dir={tmp_path / 'none'}", f"dataset.source={data}"])
    with pytest.raises(Exception, match="model.model.path"):
        check_run(cfg, catalog.recipe_path("sft"))


def test_memory_plan_on_eight_ranks_fits_and_splits_the_experts():
    cfg = OmegaConf.to_container(load_config(CONFIG, ["dataset.source=x"]), resolve=False)
    lora = {k: v for k, v in cfg["model"].items() if k not in ("_component_", "model")}
    lora["adapter_dtype"] = torch.float32
    model = apply_lora(mixtral.mixtral_8x7b(device="meta", dtype=torch.bfloat16), **lora)

    def plan(**dims):
        return estimate_memory(
            model, batch_size=cfg["batch_size"], seq_len=cfg["dataset"]["max_seq_len"],
            optimizer=optimizer_kind(cfg["optimizer"]["_component_"], cfg["optimizer"]),
            mixed_precision=cfg["mixed_precision"], loss="linear", packed=True,
            activation_checkpointing=cfg["activation_checkpointing"],
            parallel=ParallelDims(**dims), device="cuda",
        )  # fmt: skip

    shipped = plan(**cfg["parallelism"])
    print(shipped.table())
    assert cfg["parallelism"] == {"dp_shard": 8, "ep": 8}
    assert shipped.total < 20 * 2**30  # per rank: room to spare on an 80 GB GPU
    assert shipped.gathered_layers < plan(dp_shard=8).gathered_layers / 10  # no expert gathered
