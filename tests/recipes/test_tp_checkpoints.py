"""Checkpoints across meshes under tensor parallel (issue #15): a run stopped on 4 ranks of
``tp 2 x dp_shard 2`` resumes on 2 ranks of ``dp_shard 2`` and on one process, and continues
as the resume on its own mesh does; the HF folder a checkpoint exports is the same files
whatever mesh writes it.

Why the continuation is the same run: the weights come back from the checkpoint's full HF
export, dcp reshards the optimizer state (AdamW's moments, saved as 2-D DTensors) onto the new
mesh, and the data position is mapped: each of the 2 data-parallel ranks had taken 4 samples of
the epoch's order, which is the first 8 of the global order (step ``k`` of any split of a
global batch of 4 is ``perm[4k : 4k + 4]``, see ``test_sft_distributed``), so one process with
``batch_size: 4`` goes on at its third batch. The samples train different numbers of tokens,
so a wrong position shows in the logged token counts and losses.

The export test loads the 4-rank checkpoint on 2 ranks of ``tp 2`` (1-D DTensors, vocabulary
shards of 329 + 328 rows) and on one process, and saves it again at once: the model files are
byte-identical to the 4-rank ones, and the optimizer state each mesh loaded, gathered whole,
equals the state dcp saved.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.gloo_world import run_on_ranks
from tests.recipes.sft_world import (
    assert_same_weights,
    checkpoint_weights,
    checkpoints,
    final_weights,
    largest_change,
    launch_ranks,
    make_counting_data,
    make_model_dir,
    noise_tolerance,
    read_metrics,
    recipe_overrides,
    run_sft,
)
from tunesmith.config import ConfigError
from tunesmith.models import from_hf
from tunesmith.models.manifest import MARKER
from tunesmith.models.safetensors_io import CheckpointError
from tunesmith.training.checkpoint.checkpointer import Checkpointer, saved_layout
from tunesmith.training.loop_config import RunRecord, check_resume
from tunesmith.training.parallel.distributed import close_distributed, init_distributed
from tunesmith.training.parallelize import parallelize
from tunesmith.training.sources import DatasetSource

ROWS, GLOBAL_BATCH, STOP, STEPS = 16, 4, 2, 4  # one epoch of 4 steps, stopped after 2
VOCAB = 657  # odd: the vocabulary shards are uneven (329 + 328)
TP2_DP2 = ("parallelism.tp=2", "parallelism.dp_shard=2")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """(model_dir, data, output dir) of a run of 4 ranks (tp 2 x dp_shard 2, batch_size 2 per
    data-parallel rank) stopped with a checkpoint at step :data:`STOP` of :data:`STEPS`."""
    root = tmp_path_factory.mktemp("tp_ckpt")
    model_dir = make_model_dir(root, vocab_size=VOCAB)
    data = make_counting_data(root / "count.jsonl", rows=ROWS)
    out, logs = root / "tp2_dp2", root / "logs"
    logs.mkdir()
    overrides = recipe_overrides(
        model_dir,
        data,
        out,
        "batch_size=2",
        f"max_steps={STEPS}",
        f"stop_after_steps={STOP}",
        *TP2_DP2,
    )
    launch_ranks(overrides, logs, world_size=4, timeout=300)
    assert [p.name for p in checkpoints(out)] == [f"step_{STOP:06d}"]
    return model_dir, data, out


def _resume(stopped, out: Path, world: int, *extra: str) -> Path:
    """A copy of the stopped run resumed to step :data:`STEPS` on ``world`` ranks."""
    model_dir, data, stopped_out = stopped
    shutil.copytree(stopped_out, out)
    extra = (f"max_steps={STEPS}", "resume=true", *extra)
    if world == 1:
        return run_sft(model_dir, data, out, *extra)
    overrides = recipe_overrides(model_dir, data, out, *extra)
    logs = out.parent / f"{out.name}-logs"
    logs.mkdir()
    launch_ranks(overrides, logs, world_size=world, timeout=300)
    return out


def test_resume_on_2_ranks_and_on_1_continues_like_the_same_mesh(stopped, tmp_path):
    """tp2 x dp2 (4 ranks) -> dp2 (2 ranks) -> 1 process, the global batch kept at 4: the same
    samples, losses (rel 1e-6) and final weights (atol 1e-6; a key bias 5e-5, see
    ``noise_tolerance``) as resuming on the 4 ranks; grad
    norms rel 1e-5 (one process norms its gradients in one fp32 sum, a mesh per layout)."""
    _, _, stopped_out = stopped
    assert saved_layout(checkpoints(stopped_out)[-1]) == {
        "world_size": 4,
        "dp_size": 2,
        "dp_ranks": [0, 0, 1, 1],
        "mesh": {"dp_shard": 2, "tp": 2},
    }
    same = _resume(stopped, tmp_path / "tp2_dp2", 4, "batch_size=2", *TP2_DP2)
    dp2 = _resume(stopped, tmp_path / "dp2", 2, "batch_size=2")
    one = _resume(stopped, tmp_path / "one", 1, f"batch_size={GLOBAL_BATCH}")
    log = (tmp_path / "dp2-logs" / "rank0.log").read_text()
    assert (
        "resuming step_000002, written by 4 rank(s) (dp_shard 2 x tp 2), on 2 rank(s) (dp_shard 2)"
    ) in log

    reference = read_metrics(same)
    assert sorted(reference) == list(range(1, STEPS + 1))
    for run in (dp2, one):
        logged = read_metrics(run)
        for step in range(STOP + 1, STEPS + 1):
            for key in ("trained_tokens_in_window", "tokens_seen"):  # the same samples
                assert logged[step][key] == reference[step][key], f"{run.name}: {key}, {step}"
            for key, rel in (("loss", 1e-6), ("lr", 1e-6), ("grad_norm", 1e-5)):
                assert logged[step][key] == pytest.approx(reference[step][key], rel=rel), (
                    f"{run.name}: {key} at step {step}"
                )
        assert_same_weights(final_weights(run), final_weights(same), noise_tolerance(1e-6))
    at_stop = checkpoint_weights(checkpoints(stopped_out)[-1])
    assert largest_change(final_weights(same), at_stop) > 1e-3  # the resumed steps train


def test_a_changed_global_batch_is_refused_before_anything_loads(stopped, tmp_path):
    """One process with the per-rank batch_size of 2: the global batch would halve."""
    model_dir, data, stopped_out = stopped
    out = tmp_path / "half"
    shutil.copytree(stopped_out, out)
    with pytest.raises(
        Exception,
        match=r"data_parallel: 2 -> 1 ranks changes the global batch "
        r"\(batch_size x gradient_accumulation_steps x data-parallel ranks\) "
        r"from 2 x 1 x 2 = 4 to 2 x 1 x 1 = 2: keep it 4 with batch_size=4",
    ):
        run_sft(model_dir, data, out, "batch_size=2", f"max_steps={STEPS}", "resume=true")
    assert [p.name for p in checkpoints(out)] == [f"step_{STOP:06d}"]


# ----------------------------------------------------------------------------- export


def _reexport(rank: int, step_dir: str, model_dir: str, out: str, parallelism: dict) -> dict:
    """Load ``step_dir`` on this mesh and checkpoint it again at once; the optimizer state
    this rank loaded, gathered whole."""
    ctx = init_distributed("cpu", parallelism=parallelism)
    model = parallelize(from_hf(model_dir), ctx)  # the initial weights, then the checkpoint's
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    checkpointer = Checkpointer(Path(out) / "checkpoints", ctx, source_dir=model_dir)
    progress = checkpointer.load(step_dir, model, optimizer, {})
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    loaded = get_optimizer_state_dict(model, optimizer, options=options)
    checkpointer.save(progress["step"], model, optimizer, {}, progress)
    return loaded


def _model_files(step_dir: Path) -> dict[str, bytes]:
    """The HF folder's files (not the training state or the manifest), by relative path."""
    return {
        str(p.relative_to(step_dir)): p.read_bytes()
        for p in sorted(step_dir.rglob("*"))
        if p.is_file() and p.name != MARKER and "training_state" not in p.parts
    }


def _assert_same_tree(got, expected, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert sorted(got) == sorted(expected), where
        for key in expected:
            _assert_same_tree(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            _assert_same_tree(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where


def test_the_export_is_the_same_files_whatever_the_mesh(stopped, tmp_path):
    """The 4-rank (tp 2 x dp_shard 2) checkpoint, loaded and saved again on 2 ranks of tp 2
    and on one process: byte-identical model files; the optimizer state each loaded is the
    one dcp saved, element for element."""
    model_dir, _, stopped_out = stopped
    step_dir = checkpoints(stopped_out)[-1]
    saved_optimizer = tmp_path / "saved_optimizer.pt"
    dcp_to_torch_save(step_dir / "training_state" / "optimizer", saved_optimizer)
    saved = torch.load(saved_optimizer, weights_only=False)["optimizer"]  # our own file
    expected = _model_files(step_dir)
    assert {"model.safetensors", "config.json"} <= set(expected)
    for name, world, parallelism in (("tp2", 2, {"tp": 2}), ("one", 1, None)):
        out = tmp_path / name
        args = (str(step_dir), str(model_dir), str(out), parallelism)
        loaded = run_on_ranks(_reexport, world, *args)[0]
        written = checkpoints(out)
        assert [p.name for p in written] == [step_dir.name]
        got = _model_files(written[0])
        assert sorted(got) == sorted(expected), name
        for file in expected:
            assert got[file] == expected[file], f"{name}: {file} differs"
        _assert_same_tree(loaded["state"], saved["state"], f"{name}: optimizer state")
        assert len(loaded["state"]) == len(dict(from_hf(model_dir).named_parameters()))


# ----------------------------------------------------------------------------- units


def _source(dp: int, rank: int, batch: int, accum: int = 1, rows: int = 24) -> DatasetSource:
    """Data-parallel rank ``rank`` of ``dp`` reading ``range(rows)`` as the recipes do."""
    data = list(range(rows))
    sampler = DistributedSampler(
        data, num_replicas=dp, rank=rank, shuffle=True, seed=3, drop_last=True
    )
    loader = StatefulDataLoader(data, batch_size=batch, sampler=sampler, drop_last=True)
    return DatasetSource(loader, sampler, accum)


def _next_step(ranks: list[DatasetSource]) -> list[int]:
    """The samples of the next optimizer step over all data-parallel ranks (sorted)."""
    return sorted(int(i) for source in ranks for mb in source.next_step() for i in mb)


def test_the_data_position_maps_onto_another_split_of_the_global_batch():
    """Two ranks of batch 2 stopped after 2 steps: every other split of the global batch of 4
    (one rank of 4, four of 1, one of 2 x 2 accumulated, the same 2 x 2) goes on with the
    samples the two ranks would have taken next."""
    saved = [_source(2, r, batch=2) for r in range(2)]
    for _ in range(2):
        _next_step(saved)
    states = [source.state_dict() for source in saved]
    expected = [_next_step(saved) for _ in range(3)]  # steps 3-5 of the saved mesh
    assert len({i for step in expected for i in step}) == 12  # 12 samples, none seen twice
    for dp, batch, accum in ((1, 4, 1), (4, 1, 1), (1, 2, 2), (2, 2, 1)):
        ranks = [_source(dp, r, batch, accum) for r in range(dp)]
        for r, source in enumerate(ranks):
            source.load_state_dict(source.reshard_state_dict(states[r % 2], saved_dp_size=2))
        assert [_next_step(ranks) for _ in range(3)] == expected, (dp, batch, accum)
    odd = _source(1, 0, batch=3)
    words = (
        "the checkpoint is 8 samples into its epoch (2 data-parallel rank(s)), not a "
        "whole number of this run's steps of 3 samples"
    )
    with pytest.raises(ValueError, match=re.escape(words)):
        odd.reshard_state_dict(states[0], saved_dp_size=2)


def test_the_mesh_and_the_batch_split_may_change_with_the_same_global_batch():
    mesh = {"batch_size": 2, "seed": 0, "parallelism": {"tp": 2, "dp_shard": 2}}
    saved = RunRecord(mesh, 4, 16, step=2, data_parallel=2)
    one = RunRecord({"batch_size": 4, "seed": 0}, 4, 16, data_parallel=1)
    assert check_resume(Path("c"), saved, one) == [
        "resume: batch_size 2 -> 4",
        "resume: parallelism.tp 2 -> (absent)",
        "resume: parallelism.dp_shard 2 -> (absent)",
    ]
    accumulated = RunRecord(
        {**mesh, "batch_size": 1, "gradient_accumulation_steps": 2}, 4, 16, data_parallel=2
    )
    assert check_resume(Path("c"), saved, accumulated) == [
        "resume: batch_size 2 -> 1",
        "resume: gradient_accumulation_steps (absent) -> 2",
    ]
    halved = RunRecord({"batch_size": 2, "seed": 1}, 4, 16, data_parallel=1)
    with pytest.raises(ConfigError) as error:
        check_resume(Path("c"), saved, halved)
    assert str(error.value).splitlines()[1:] == [
        "seed: 0 -> 1",
        "parallelism.tp: 2 -> (absent)",
        "parallelism.dp_shard: 2 -> (absent)",
        "data_parallel: 2 -> 1 ranks changes the global batch (batch_size x "
        "gradient_accumulation_steps x data-parallel ranks) from 2 x 1 x 2 = 4 to 2 x 1 x 1 = 2: "
        "keep it 4 with batch_size=4",
    ]
    fewer_ranks = RunRecord(mesh, 4, 16, data_parallel=1)  # the same config on half the world
    with pytest.raises(ConfigError, match="data_parallel: 2 -> 1 ranks changes the global"):
        check_resume(Path("c"), saved, fewer_ranks)
    unknown = RunRecord(mesh, 4, 16)  # a checkpoint from before the record kept its dp size
    with pytest.raises(ConfigError, match="batch_size: 2 -> 4"):
        check_resume(Path("c"), unknown, one)


class _Held:
    """A stateful object without ``reshard_state_dict`` (e.g. a batch held per rank)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("refused before anything loads")


def test_a_per_rank_state_that_cannot_be_mapped_is_refused(tmp_path):
    """A 2-rank checkpoint whose 'held' state differs between the ranks, resumed on one
    process: refused before any weight is read (an equal 'scheduler' state would load)."""
    step = tmp_path / "step_000002"
    (step / "training_state").mkdir(parents=True)
    layout = {"world_size": 2, "dp_size": 2, "dp_ranks": [0, 1], "mesh": {"dp_shard": 2}}
    for rank in range(2):
        state = {"held": {"batch": torch.full((2,), rank)}, "scheduler": {"last_epoch": 2},
                 "layout": layout}  # fmt: skip
        torch.save(state, step / "training_state" / f"rank{rank}.pt")
    ctx = init_distributed("cpu")
    try:
        checkpointer = Checkpointer(tmp_path / "checkpoints", ctx)
        with pytest.raises(
            CheckpointError,
            match="the 'held' state differs between the saved "
            "ranks and _Held cannot map it from 2 to 1 data-parallel ranks",
        ):
            checkpointer.load(
                step, None, None, {"held": _Held(), "scheduler": _Held()}, verify=False
            )
    finally:
        close_distributed()
