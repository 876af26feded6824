"""Run a function on several gloo ranks and get back what each rank returned.

Every multi-rank unit test goes through :func:`run_on_ranks`: the processes are forked from the
suite's fork server (:mod:`tests.forked`: torch and tunesmith already imported, one intra-op
thread), the process group is formed over a file rendezvous in a temporary folder, and it is
closed with :func:`tunesmith.training.parallel.distributed.close_distributed` (garbage collected
first: gloo work left unread and freed after the group, at interpreter exit, aborts the process with
"terminate called without an active exception", about one run in thirty without it).

Example::

    def _sum(rank: int, value: int) -> int:  # module level: the ranks import it
        t = torch.tensor(rank + value)
        dist.all_reduce(t)
        return t.item()

    assert run_on_ranks(_sum, 2, 10) == [21, 21]
"""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.forked import start, wait_all
from tunesmith.training.parallel.distributed import close_distributed


def run_on_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120) -> list:
    """``[fn(0, *args), ..., fn(world - 1, *args)]``, each called in its own process with a gloo
    group of ``world`` ranks initialised (one intra-op thread). A rank that raises fails the
    call with its traceback (the other ranks are killed); a collective left waiting fails after
    ``timeout_s``. What ``fn`` returns must load with ``torch.load(weights_only=True)``
    (tensors, numbers, strings, tuples, lists, dicts)."""
    with tempfile.TemporaryDirectory(prefix="gloo_world_") as tmp:
        ranks = [start(_rank_main, r, world, tmp, fn, args, timeout_s) for r in range(world)]
        codes = wait_all(ranks, timeout=timeout_s + 60)
        if any(codes):  # the rank that raised first, else (killed or crashed) the exit codes
            errors = sorted(Path(tmp).glob("rank*.error"), key=lambda p: p.stat().st_mtime)
            if not errors:
                raise RuntimeError(f"ranks of {world} ended with codes {codes}")
            raise RuntimeError(f"{errors[0].stem} of {world} failed:\n{errors[0].read_text()}")
        return [torch.load(f"{tmp}/rank{r}.pt", weights_only=True) for r in range(world)]


def _rank_main(
    rank: int, world: int, tmp: str, fn: Callable[..., Any], args: tuple, timeout_s: float
) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/rendezvous",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        torch.save(fn(rank, *args), f"{tmp}/rank{rank}.pt")
    except BaseException:
        Path(tmp, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        close_distributed()
