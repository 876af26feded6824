"""The memory plan per rank under tensor parallel, sequence parallel, FSDP2 and HSDP.

Hand-computed expectations for a small Llama (odd vocabulary, GQA): the bytes of every
parameter's shard under tp 2 x dp_shard 2 from the parameter shapes, the activations of a
layer with and without sequence parallel, the vocabulary-parallel loss terms, FSDP2's gathered
weights; the single-device plan unchanged; and one 2-rank run (TP 2 + SP, then FSDP2 over 2)
whose measured per-rank peaks the plan matches within 15%, its weights exactly (the same plan
from the parallelized model's DTensor parameters as from the plain model).
"""

from __future__ import annotations

import pytest
import torch

from tests.gloo_world import run_on_ranks
from tunesmith.models import build_model, llama3
from tunesmith.models.zoo import qwen3_moe
from tunesmith.modules.losses import CrossEntropyLoss, LinearCrossEntropyLoss
from tunesmith.training.memory.planner import (
    activation_bytes_per_token,
    estimate_memory,
    tp_shard_dim,
)
from tunesmith.training.parallel.distributed import ParallelDims

# llama3_tiny: hidden 64, 4 heads / 2 kv heads of 16, MLP 128, 2 layers, untied head
VOCAB = 259  # odd: the vocabulary shards are uneven (130 + 129 over 2 ranks)
H, MLP, KV = 64, 128, 32  # hidden, intermediate, kv width (2 heads x 16)


def _model():
    torch.manual_seed(0)
    return llama3.llama3_tiny(vocab_size=VOCAB)


def _plan(model, **kwargs):
    kwargs.setdefault("batch_size", 2)
    kwargs.setdefault("seq_len", 16)
    return estimate_memory(model, **kwargs)


def _ceil(n, k):
    return -(-n // k)


def test_parameter_shards_per_rank_under_tp2_x_dp_shard2():
    # (rows, cols) of each parameter on rank 0: tp splits rows of q/k/v/gate/up/embedding/head
    # and columns of o/down (uneven: the larger part), then FSDP2 splits rows over 2 (padded)
    tp_rows = {
        "embed": (_ceil(VOCAB, 2), H), "q": (H // 2, H), "k": (KV // 2, H), "v": (KV // 2, H),
        "o": (H, H // 2), "gate": (MLP // 2, H), "up": (MLP // 2, H), "down": (H, MLP // 2),
        "norm": (H, 1), "head": (_ceil(VOCAB, 2), H),
    }  # fmt: skip
    per_layer = ["q", "k", "v", "o", "gate", "up", "down", "norm", "norm"]
    shapes = [tp_rows["embed"], tp_rows["norm"], tp_rows["head"]]
    shapes += [tp_rows[name] for name in per_layer] * 2
    expected = 4 * sum(_ceil(rows, 2) * cols for rows, cols in shapes)
    model = _model()
    plan = _plan(model, parallel=ParallelDims(tp=2, dp_shard=2))
    assert plan.weights == plan.gradients == expected
    assert plan.optimizer_states == 2 * expected  # AdamW: two float32 moments per element
    assert plan.world_size == 4
    # tp alone: whole columns/rows over the tp ranks; norms replicated
    tp_only = _plan(model, parallel=ParallelDims(tp=2))
    assert tp_only.weights == 4 * sum(rows * cols for rows, cols in shapes)
    # 8-bit AdamW: about 2 bytes per element of the shard; in backward: the largest shard only
    eight_bit = _plan(model, parallel=ParallelDims(tp=2, dp_shard=2), optimizer="adamw8bit")
    assert 2 * expected / 4 <= eight_bit.optimizer_states < 2.1 * expected / 4
    in_backward = _plan(model, parallel=ParallelDims(tp=2, dp_shard=2), optimizer_in_backward=True)
    assert in_backward.gradients == 4 * _ceil(_ceil(VOCAB, 2), 2) * H  # an embedding shard


def test_tp_plan_by_parameter_name():
    assert tp_shard_dim("model.layers.3.self_attn.k_proj.weight") == 0
    assert tp_shard_dim("model.layers.3.self_attn.q_proj.bias") == 0
    assert tp_shard_dim("model.layers.3.self_attn.o_proj.weight") == 1
    assert tp_shard_dim("model.layers.3.mlp.up_proj.lora_B.weight") == 0
    assert tp_shard_dim("model.layers.3.mlp.down_proj.lora_A.weight") == 1
    assert tp_shard_dim("model.layers.3.mlp.up_proj.lora_A.weight") is None
    assert tp_shard_dim("model.layers.3.self_attn.v_proj.lora_magnitude_vector") == 0  # DoRA
    assert tp_shard_dim("model.layers.3.self_attn.o_proj.lora_magnitude_vector") is None
    assert tp_shard_dim("lm_head.weight") == tp_shard_dim("model.embed_tokens.weight") == 0
    replicated = [
        "model.norm.weight", "model.layers.0.self_attn.q_norm.weight", "score.weight",
        "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.1.up_proj.weight",
    ]  # fmt: skip
    for name in replicated:
        assert tp_shard_dim(name) is None, name


def test_moe_experts_stay_whole_under_tp():
    model = build_model(qwen3_moe.spec("qwen3_moe_tiny"))  # MoE and dense layers

    def moe(name):  # a router or an expert
        return ".mlp.experts." in name or ".mlp.gate.weight" in name

    experts = sum(p.numel() for n, p in model.named_parameters() if moe(n))
    rest = sum(p.numel() for n, p in model.named_parameters() if not moe(n))
    assert experts > 0
    one = _plan(model)
    tp2 = _plan(model, parallel=ParallelDims(tp=2))
    assert one.weights == 4 * (experts + rest)
    # every other weight of the model is a matrix with an even split dim, or a norm (whole)
    norms = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1)
    assert tp2.weights == 4 * (experts + norms + (rest - norms) // 2)


def test_layer_activations_with_and_without_sequence_parallel():
    spec = _model().spec
    per_token = {  # float32 (a = r = 4), per token of the sequence, hand-computed:
        # norms 2 * (4H + 4H + 4) = 2 * 516 = 1032, divided by tp under SP;
        # layer inputs 2 * 4H = 512 (the whole sequence: gathered under SP);
        # attention 4 * (2*4 + 2*2) * 16 + 4*4 = 784 and MLP 4 * 4 * 128 = 2048, divided by tp
        (1, False): 1032 + 512 + 784 + 2048,
        (2, False): 1032 + 512 + (784 + 2048) // 2,
        (2, True): 1032 // 2 + 512 + (784 + 2048) // 2,
        (4, True): 1032 // 4 + 512 + (784 + 2048) // 4,
    }
    for (tp, sp), expected in per_token.items():
        got = activation_bytes_per_token(
            spec, act_bytes=4, residual_bytes=4, seq_len=16, tp=tp, sequence_parallel=sp
        )
        assert got == expected, (tp, sp, got, expected)
    plans = {
        sp: _plan(_model(), parallel=ParallelDims(tp=2, sequence_parallel=sp))
        for sp in (False, True)
    }
    tokens, layers = 2 * 16, 2
    final_norm = {False: 4 * H + 8 * H, True: (4 * H + 4 * H) // 2 + 4 * H}
    for sp, plan in plans.items():
        shared = 2 * 16 * 4  # RoPE tables
        expected = tokens * (layers * per_token[2, sp] + shared + final_norm[sp])
        assert plan.activations == expected
    # full checkpointing keeps each layer's input, a sequence shard of it under SP
    ckpt = _plan(_model(), parallel=ParallelDims(tp=2), activation_checkpointing="full")
    assert ckpt.activations == tokens * (layers * 4 * H // 2 + 2 * 16 * 4 + final_norm[True])
    assert ckpt.recompute == tokens * per_token[2, True]


def test_loss_terms_are_vocabulary_parallel():
    model = _model()
    rows = 8
    linear = LinearCrossEntropyLoss(chunk_size=rows)
    one = _plan(model, loss=linear)
    tp2 = _plan(model, loss=linear, parallel=ParallelDims(tp=2))
    # one chunk of float32 logits over this rank's 130 vocabulary rows instead of 259
    assert one.logits - tp2.logits == 4 * rows * (VOCAB - _ceil(VOCAB, 2))
    assert tp2.head_gradient == 4 * _ceil(VOCAB, 2) * H
    # full cross-entropy: the head's output is gathered, whole logits on every rank
    full = _plan(model, parallel=ParallelDims(tp=2))
    assert full.logits == _plan(model).logits == 12 * 2 * 16 * VOCAB


def test_fsdp2_gathered_weights():
    model = _model()
    layer = H * H + 2 * KV * H + H * H + 3 * H * MLP + 2 * H
    root = 2 * VOCAB * H + H
    fsdp = _plan(model, parallel=ParallelDims(dp_shard=2))
    assert fsdp.gathered_root == 4 * root and fsdp.gathered_layers == 2 * 4 * layer
    hsdp = _plan(model, parallel=ParallelDims(dp_replicate=2))  # FSDP2 over a mesh of 2 x 1
    assert hsdp.gathered_root == 4 * root and hsdp.weights == _plan(model).weights
    tp_fsdp = _plan(model, parallel=ParallelDims(tp=2, dp_shard=2))
    tp_layer = (H * H + 2 * KV * H + H * H + 3 * H * MLP) // 2 + 2 * H
    assert tp_fsdp.gathered_root == 4 * (2 * _ceil(VOCAB, 2) * H + H)
    assert tp_fsdp.gathered_layers == 2 * 4 * tp_layer
    assert _plan(model, parallel=ParallelDims(tp=2)).gathered_root == 0  # no FSDP2
    assert "per rank of 4 (dp_shard 2 x tp 2, sequence parallel)" in tp_fsdp.table()


def test_one_device_and_world_size_shorthand_are_unchanged():
    model = _model()
    assert _plan(model, parallel=ParallelDims()) == _plan(model)
    assert _plan(model, world_size=2) == _plan(model, parallel=ParallelDims(dp_shard=2))
    assert _plan(model, world_size=2, parallel=ParallelDims(dp_shard=2)).world_size == 2
    with pytest.raises(ValueError, match="world_size 4 and parallel"):
        _plan(model, world_size=4, parallel=ParallelDims(tp=2, dp_shard=2))
    # under context parallel FSDP2 spans dp_shard x cp: world_size may name those ranks
    cp = ParallelDims(dp_shard=2, cp=2)
    assert _plan(model, world_size=4, parallel=cp) == _plan(model, parallel=cp)
    with pytest.raises(ValueError, match=r"world_size 8 and parallel \(dp_shard 2 x cp 2\)"):
        _plan(model, world_size=8, parallel=cp)


def _fsdp_bytes(model, shard, skip=lambda name: False):
    """float32 bytes of every parameter (but ``skip``'s) with dim 0 split over ``shard``."""
    return 4 * sum(
        _ceil(p.shape[0], shard) * p[0].numel() for n, p in model.named_parameters() if not skip(n)
    )


def test_context_parallel_divides_the_sequence_and_fsdp2_spans_dp_shard_x_cp():
    model = _model()
    per_token = 1032 + 512 + 784 + 2048  # a layer, float32 (test above)
    final_norm = 4 * H + 8 * H
    rope = 2 * 16 * 4
    for cp, seq_len, local in ((2, 16, 8), (4, 16, 4), (2, 13, 8), (2, 7, 4)):
        # each rank keeps 2 of the 2cp zigzag chunks of every row, padded: ceil(s / 2cp) * 2
        plan = _plan(model, batch_size=2, seq_len=seq_len, parallel=ParallelDims(cp=cp))
        tokens = 2 * local
        assert plan.tokens == tokens, (cp, seq_len)
        assert plan.activations == tokens * (2 * per_token + rope + final_norm), (cp, seq_len)
        assert plan.logits == 12 * tokens * VOCAB  # full cross-entropy over this rank's rows
        # FSDP2 over the cp ranks (dp_shard 1 x cp): weights, gradients, states split cp ways
        assert plan.weights == plan.gradients == _fsdp_bytes(model, cp)
        assert plan.optimizer_states == 2 * _fsdp_bytes(model, cp)
        root = 2 * VOCAB * H + H
        assert plan.gathered_root == 4 * root
    # packed rows: the mask terms are the rank's share too (per layer a float mask row of
    # s_local = 8 and k, v repeated to 4 heads: 4 * (4 * 4 - 2 * 4 - 2 * 2) * 16 more; a bool
    # mask row of 8 shared by the layers)
    packed = _plan(model, seq_len=16, packed=True, parallel=ParallelDims(cp=2))
    unpacked = _plan(model, seq_len=16, parallel=ParallelDims(cp=2))
    per_layer = 4 * 8 + 4 * (16 - 12) * 16
    assert packed.activations - unpacked.activations == 2 * 8 * (2 * per_layer + 2 * 8)
    # cp x dp_shard: FSDP2 over 4 ranks; the per-rank tokens are those of cp alone
    both = _plan(model, parallel=ParallelDims(dp_shard=2, cp=2))
    assert both.weights == _fsdp_bytes(model, 4) and both.activations == unpacked.activations
    assert "per rank of 4 (dp_shard 2 x cp 2)" in both.table()


def _is_expert(name):
    return name.endswith(("experts.gate_proj", "experts.up_proj", "experts.down_proj"))


def test_expert_parallel_keeps_e_over_ep_experts_per_rank_outside_fsdp2():
    model = build_model(qwen3_moe.spec("qwen3_moe_tiny"))  # layers 0 and 2 MoE, 8 experts
    spec = model.spec
    experts = {n: p for n, p in model.named_parameters() if _is_expert(n)}
    assert len(experts) == 6 and all(p.shape[0] == 8 for p in experts.values())
    # ep 2 over dp_shard 4: 4 of the 8 experts per rank (not split 4 ways by FSDP2), the rest
    # FSDP2-sharded over the 4 ranks
    dims = ParallelDims(dp_shard=4, ep=2)
    plan = _plan(model, parallel=dims)
    local_experts = 4 * sum(p.numel() // 2 for p in experts.values())
    expected = local_experts + _fsdp_bytes(model, 4, skip=_is_expert)
    assert plan.weights == plan.gradients == expected
    assert plan.optimizer_states == 2 * expected
    no_ep = _plan(model, parallel=ParallelDims(dp_shard=4))
    assert no_ep.weights == _fsdp_bytes(model, 4)  # experts split 2 of 8 per rank by FSDP2
    # FSDP2 gathers no expert: two of the largest layer without its experts
    layers = [
        sum(4 * p.numel() for n, p in layer.named_parameters() if not _is_expert(n))
        for layer in model.model.layers
    ]
    assert plan.gathered_layers == 2 * max(layers)
    # the all-to-all buffers: 2 * top_k * a * H per token in each MoE layer (received rows and
    # the rows returned); the dense layer is unchanged
    k, a = spec.num_experts_per_tok, 4
    for layer_idx, extra in ((0, 2 * k * a * H), (1, 0), (2, 2 * k * a * H)):
        per_token = {
            ep: activation_bytes_per_token(
                spec, act_bytes=4, residual_bytes=4, seq_len=16, layer_idx=layer_idx, ep=ep
            )
            for ep in (1, 2)
        }
        assert per_token[2] - per_token[1] == extra, layer_idx
    assert plan.activations - no_ep.activations == 2 * 16 * 2 * (2 * k * a * H)
    assert "per rank of 4 (dp_shard 4 x ep 2)" in plan.table()


# -- measured: 2 gloo ranks ------------------------------------------------------------------------

# activations dominate (as in test_memory_planner.py): 4 layers, 4 x 64 tokens per rank
MEASURED = dict(
    hidden_size=64,
    intermediate_size=176,
    num_attention_heads=4,
    head_dim=16,
    num_key_value_heads=2,
    vocab_size=511,
    num_hidden_layers=4,
)
LAYOUTS = {"tp2_sp": {"tp": 2}, "fsdp2": {"dp_shard": 2}}


def _step(model, opt, ids):
    logits = model(ids[:, :-1])
    loss = CrossEntropyLoss()(logits, ids[:, 1:]) / ids[:, 1:].numel()
    del logits  # as a training loop's objective returns the loss alone
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _measure_worker(rank: int) -> dict:
    from tunesmith.training.memory.usage import AllocatedBytes, storage_bytes
    from tunesmith.training.parallel.distributed import init_distributed
    from tunesmith.training.parallelize import parallelize

    results = {}
    for name, parallelism in LAYOUTS.items():
        ctx = init_distributed(device="cpu", parallelism=parallelism)
        torch.manual_seed(0)
        model = parallelize(llama3.llama3_tiny(**MEASURED), ctx, {})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(ctx.dp_rank)
        ids = torch.randint(0, MEASURED["vocab_size"], (4, 65), generator=gen)
        _step(model, opt, ids)  # warm-up: AdamW's states are created
        states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        params = storage_bytes(list(model.parameters()))
        resident = params + storage_bytes([*model.buffers(), *states])
        with AllocatedBytes() as mem:
            _step(model, opt, ids)
        # the plan of the parallelized model (DTensor parameters), as a recipe makes it
        plan = estimate_memory(model, batch_size=4, seq_len=64, parallel=ctx.dims)
        results[name] = {"params": params, "peak": resident + mem.peak, "plan": plan.total}
    return results


@pytest.fixture(scope="module")
def measured():
    return run_on_ranks(_measure_worker, 2)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_plan_matches_measured_peaks_of_two_ranks(measured, name):
    model = llama3.llama3_tiny(device="meta", **MEASURED)
    plan = estimate_memory(
        model, batch_size=4, seq_len=64, parallel=ParallelDims.resolve(LAYOUTS[name], 2)
    )
    heaviest = max(rank[name]["peak"] for rank in measured)
    assert 0.85 * heaviest <= plan.total <= 1.15 * heaviest, (name, heaviest, plan.total)
    # rank 0 holds the larger vocabulary shard (256 of 511 rows): the plan's, exactly
    assert measured[0][name]["params"] == plan.weights
    assert measured[0][name]["plan"] == plan.total  # the same from the sharded model
