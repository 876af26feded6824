"""The shipped SFT LoRA configs of the MoE families (:data:`SHIPPED`): ``tunesmith validate``'s
checks pass on a (tiny) folder of the family and name a missing one; the memory plan on 8 ranks
at the real size (printed) fits a GPU, with expert parallel (ep 8) gathering far fewer layers
than FSDP2 alone (each rank holds its own experts of each layer).

DeepSeek-V2-Lite's config is validated in tests/peft/test_peft_moe_targets.py (with the
adapters peft would drop)."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import make_chat_data, make_model_dir
from tunesmith.cli import catalog
from tunesmith.config import load_config
from tunesmith.models.zoo import gpt_oss, llama4, mixtral
from tunesmith.modules.peft import apply_lora
from tunesmith.recipes.catalog import check_run
from tunesmith.training.memory.planner import estimate_memory, optimizer_kind
from tunesmith.training.parallel.distributed import ParallelDims


@dataclass(frozen=True)
class Shipped:
    """A shipped config, its family and real size, and what its memory plan must meet:
    ``max_gib`` per rank (room to spare on an 80 GB GPU) and ``gathered_ratio`` (FSDP2 alone
    gathers that many times more layer bytes than the shipped ep 8: the experts stay local;
    gpt-oss's experts are a smaller share of a layer)."""

    config: str
    family: ModuleType
    size: str
    max_gib: int
    gathered_ratio: int


SHIPPED = {
    "mixtral": Shipped("mixtral_8x7b_lora", mixtral, "mixtral_8x7b", 20, 10),
    "llama4": Shipped("llama4_scout_lora", llama4, "llama4_scout_17b_16e", 40, 10),
    "gpt_oss": Shipped("gpt_oss_20b_lora", gpt_oss, "gpt_oss_20b", 20, 4),
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_validate_passes_on_a_folder_of_the_family(tmp_path, name):
    shipped = SHIPPED[name]
    config = catalog.config_path(shipped.config, "sft")
    model_dir = make_model_dir(tmp_path, family=shipped.family)
    data = make_chat_data(tmp_path / "chats.jsonl", rows=4)
    cfg = load_config(config, [f"model_dir={model_dir}", f"dataset.source={data}"])
    assert check_run(cfg, catalog.recipe_path("sft")) == []  # raises on any problem
    # (the model is nested under apply_lora: no top-level backend line)
    cfg = load_config(config, [f"model_dir={tmp_path / 'none'}", f"dataset.source={data}"])
    with pytest.raises(Exception, match="model.model.path"):
        check_run(cfg, catalog.recipe_path("sft"))


def _plan(cfg: dict, model: torch.nn.Module, **dims):
    """The memory plan of ``cfg``'s SFT run of ``model`` on a GPU under ``dims``."""
    return estimate_memory(
        model, batch_size=cfg["batch_size"], seq_len=cfg["dataset"]["max_seq_len"],
        optimizer=optimizer_kind(cfg["optimizer"]["_component_"], cfg["optimizer"]),
        mixed_precision=cfg["mixed_precision"], loss="linear", packed=True,
        activation_checkpointing=cfg["activation_checkpointing"],
        parallel=ParallelDims(**dims), device="cuda",
    )  # fmt: skip


@pytest.mark.parametrize("name", list(SHIPPED))
def test_memory_plan_on_eight_ranks_fits_and_splits_the_experts(name):
    shipped = SHIPPED[name]
    config = catalog.config_path(shipped.config, "sft")
    cfg = OmegaConf.to_container(load_config(config, ["dataset.source=x"]), resolve=False)
    lora = {k: v for k, v in cfg["model"].items() if k not in ("_component_", "model")}
    lora["adapter_dtype"] = torch.float32
    build = getattr(shipped.family, shipped.size)
    model = apply_lora(build(device="meta", dtype=torch.bfloat16), **lora)
    plan = _plan(cfg, model, **cfg["parallelism"])
    print(plan.table())
    assert cfg["parallelism"] == {"dp_shard": 8, "ep": 8}
    assert plan.total < shipped.max_gib * 2**30
    gathered_without_ep = _plan(cfg, model, dp_shard=8).gathered_layers
    assert plan.gathered_layers < gathered_without_ep / shipped.gathered_ratio
