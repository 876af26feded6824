"""Weight sync from trainer rank 0 to the rollout workers (``rollout.weight_sync``,
:mod:`tunesmith.rl.asynchronous.weight_sync`):

* pack/unpack: mixed dtypes, a non-contiguous tensor, names in order, bitwise;
* the collective group (gloo, each worker rank in a thread of this process): every receiver
  gets every send bitwise, a replaced generation tells its waiting workers to stop, and a
  group that cannot form says where and how long it waited (worker side and trainer side);
* end to end on Ray (``overlap``, two rollout workers): ``collective`` == ``object_store``
  bitwise, full fine-tuning and LoRA adapters. The SIGKILLed rollout worker runs with both
  paths in ``tests/rl/test_grpo_async.py``.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest
import torch
from omegaconf import OmegaConf

from tests.recipes.sft_world import (
    assert_same_weights,
    final_weights,
    make_model_dir,
    read_metrics,
)
from tests.rl.rl_world import grpo_overrides, local_ray, make_prompts, run_rl
from tunesmith.recipes import config_path
from tunesmith.rl.asynchronous.weight_sync import (
    TensorSpec,
    WeightReceiver,
    WeightSender,
    buffer_specs,
    layout_of,
    pack,
    unpack,
)

STEPS = 3


# ----------------------------------------------------------------------------- pack / unpack


def test_pack_and_unpack_keep_names_order_dtypes_and_bits():
    torch.manual_seed(0)
    named = {
        "model.embed_tokens.weight": torch.randn(5, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 6).t(),  # non-contiguous
        "model.layers.0.input_layernorm.weight": torch.randn(4, dtype=torch.bfloat16),
        "model.layers.0.mlp.counter": torch.tensor([3, -1], dtype=torch.int64),
        "model.norm.weight": torch.randn(4),
        "lm_head.scale": torch.tensor(0.5, dtype=torch.bfloat16),  # 0-d
    }
    assert not named["model.layers.0.self_attn.q_proj.weight"].is_contiguous()
    layout = layout_of(named)
    buffers = pack(named, layout)
    # one flat buffer per dtype, dtypes in the order they first appear
    assert (
        [(b.dtype, b.numel()) for b in buffers]
        == buffer_specs(layout)
        == [(torch.float32, 20 + 24 + 4), (torch.bfloat16, 5), (torch.int64, 2)]
    )
    assert all(b.is_contiguous() and b.dim() == 1 for b in buffers)
    floats = [named[k].reshape(-1) for k in named if named[k].dtype == torch.float32]
    assert torch.equal(buffers[0], torch.cat(floats))  # in name order
    out = unpack(buffers, layout)
    assert list(out) == list(named)
    buffer_of = {dtype: buffer for (dtype, _), buffer in zip(buffer_specs(layout), buffers)}
    for name, tensor in named.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape, name
        assert torch.equal(out[name], tensor), name
        storage = buffer_of[tensor.dtype].untyped_storage().data_ptr()
        assert out[name].untyped_storage().data_ptr() == storage, name  # a view: no copy


def test_pack_names_the_tensor_that_does_not_fit_the_layout():
    layout = [TensorSpec("a", (2, 3), torch.float32), TensorSpec("b", (3,), torch.float32)]
    with pytest.raises(KeyError, match="'b' is in the layout"):
        pack({"a": torch.zeros(2, 3)}, layout)
    with pytest.raises(
        ValueError, match=r"'a' is \(3, 2\) torch.float32, the layout says \(2, 3\)"
    ):
        pack({"a": torch.zeros(3, 2), "b": torch.zeros(3)}, layout)


# ----------------------------------------------------------------------------- the group


def _workers(sender, generation, layout, sends, ranks=(1, 2), size=3):
    """Worker ranks in threads: join ``generation``, then receive each of ``sends``."""
    got = {rank: [] for rank in ranks}
    errors = []

    def work(rank):
        try:
            receiver = WeightReceiver()
            receiver.join(
                *sender.address,
                generation,
                rank=rank,
                size=size,
                backend="gloo",
                timeout_s=30,
                layout=layout,
            )
            for seq in sends:
                named = receiver.receive(generation, seq)
                got[rank].append(
                    None if named is None else {k: v.clone() for k, v in named.items()}
                )
        except Exception as error:  # reported by the test
            errors.append(error)

    threads = [threading.Thread(target=work, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    return threads, got, errors


def test_every_worker_receives_every_send_exactly():
    torch.manual_seed(0)
    versions = [
        {
            "w": torch.randn(64, 32),
            "b": torch.randn(7).to(torch.bfloat16),
            "t": torch.randn(8, 8).t(),
        }
        for _ in range(3)
    ]
    layout = layout_of(versions[0])
    sender = WeightSender(timeout_s=30)
    try:
        generation = sender.form(size=3)
        sends = [sender.send(pack(v, layout)) for v in versions]  # queued before any worker
        threads, got, errors = _workers(sender, generation, layout, sends)
        for thread in threads:
            thread.join(60)
        sender.wait(60)
    finally:
        sender.close()
    assert not errors, errors
    for rank in (1, 2):
        assert len(got[rank]) == len(versions)
        for named, sent in zip(got[rank], versions):
            assert list(named) == list(sent)
            assert all(torch.equal(named[k], sent[k]) for k in sent)


def test_a_replaced_generation_tells_its_waiting_workers_to_stop():
    """A worker of generation 1 waiting for a send that will never come (another rank never
    arrived) is told to stop when generation 2 forms: its join returns False, not a hang."""
    named = {"w": torch.ones(3)}
    layout = layout_of(named)
    sender = WeightSender(timeout_s=30)
    try:
        first = sender.form(size=3)
        receiver = WeightReceiver()
        joined = []
        thread = threading.Thread(
            target=lambda: joined.append(
                receiver.join(
                    *sender.address,
                    first,
                    rank=1,
                    size=3,
                    backend="gloo",
                    timeout_s=30,
                    layout=layout,
                )
            )
        )
        thread.start()  # rank 2 never joins: rank 1 waits for the trainer's word
        seq = sender.send(pack(named, layout))
        second = sender.form(size=2)  # rank 2 "died": a new generation without it
        thread.join(10)
        assert joined == [False] and not thread.is_alive()  # told to stop, not hung
        assert receiver.receive(first, seq) is None  # not in generation 1
        threads, got, errors = _workers(
            sender, second, layout, [sender.send(pack(named, layout))], ranks=(1,), size=2
        )
        threads[0].join(60)
        sender.wait(60)
    finally:
        sender.close()
    assert not errors and torch.equal(got[1][0]["w"], named["w"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_that_cannot_reach_the_store_names_the_address_and_timeout():
    port = _closed_port()
    with pytest.raises(RuntimeError) as error:
        WeightReceiver().join(
            "127.0.0.1", port, 1, rank=1, size=2, backend="gloo", timeout_s=1, layout=[]
        )
    message = str(error.value)
    assert f"trainer's store at 127.0.0.1:{port} within 1 s" in message, message
    assert "rollout.weight_sync_timeout_s" in message


def test_the_trainer_names_the_ranks_that_never_joined_and_the_timeout():
    sender = WeightSender(timeout_s=1)
    try:
        generation = sender.form(size=3)
        threads, got, errors = _workers(sender, generation, [], [], ranks=(1,))  # rank 2 absent
        with pytest.raises(RuntimeError) as error:
            sender.wait(30)
        threads[0].join(10)
    finally:
        sender.close()
    host, port = sender.address
    message = str(error.value)
    assert "rank(s) [2] of generation 1 did not join the group within 1 s" in message, message
    assert f"at the trainer's store {host}:{port}" in message
    assert not errors and not threads[0].is_alive()  # rank 1 was told to stop


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("weight_sync")
    return root, make_model_dir(root), make_prompts(root / "prompts.jsonl", rows=24)


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance for the end-to-end tests (the runs join it)."""
    with local_ray():
        yield


def _groups(out):
    lines = (out / "rollouts.jsonl").read_text().splitlines()
    return [json.loads(line)["groups"] for line in lines]


@pytest.mark.parametrize(
    "adapters",
    [
        False,
        # LoRA's adapters through the object store: test_grpo_async (a lora policy sends its adapters)
        pytest.param(True, marks=pytest.mark.slow),
    ],
    ids=["full", "lora"],
)
def test_collective_sync_equals_the_object_store_bitwise(world, ray_instance, adapters):
    """``overlap`` mode, two rollout workers: the same rollouts, metrics and final weights
    whichever path carried the weights, and the same megabytes per sync."""
    root, model_dir, prompts = world
    model = OmegaConf.load(config_path("tiny_lora", "sft")).model if adapters else None
    outs = {}
    for sync in ("object_store", "collective"):
        out = outs[sync] = root / f"{sync}-{'lora' if adapters else 'full'}"
        overrides = grpo_overrides(
            model_dir,
            prompts,
            out,
            f"max_steps={STEPS}",
            "optimizer.lr=1e-2",
            "generation.max_new_tokens=8",
            "async_mode=overlap",
            "rollout.workers=2",
            f"rollout.weight_sync={sync}",
        )
        run_rl("grpo_async", "tiny", overrides, model=model)
    theirs, ours = (read_metrics(outs[s]) for s in ("object_store", "collective"))
    for step in range(1, STEPS + 1):
        for key in ("reward", "completion_length", "loss", "staleness_max"):
            assert ours[step][key] == theirs[step][key], (step, key)
    for step in range(1, STEPS):  # no weights are sent after the last update
        assert ours[step]["weight_sync_mb"] == theirs[step]["weight_sync_mb"] > 0
    assert max(ours[s]["staleness_max"] for s in ours) == 1.0  # sampled by an older policy
    assert _groups(outs["collective"]) == _groups(outs["object_store"])
    assert_same_weights(
        final_weights(outs["collective"]), final_weights(outs["object_store"]), atol=0.0
    )
