"""A trivial distributed recipe for CLI tests: every rank contributes rank+1 to an all-reduce."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def main(cfg) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"world": world, "sum": total.item(), "local_rank": int(os.environ["LOCAL_RANK"])}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
