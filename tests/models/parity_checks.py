"""Checks of "ours == transformers" that several family test files make the same way.

- :func:`assert_greedy_matches_transformers`: greedy tokens from left-padded prompts, with our
  KV cache, equal to ``hf.generate``'s (no eos: ``min_new_tokens`` would mask it there only);
- :func:`assert_logits_and_router_logits_match` / :func:`assert_gradients_match`: fp32 logits,
  router logits and the gradients of a summed loss, under our parameter names (transformers'
  fused ``experts.gate_up_proj`` split into gate and up);
- :func:`zero_correction_biases`: a copy's DeepSeek ``e_score_correction_bias`` zeroed, to show
  the bias picks the experts.

Example::

    assert_greedy_matches_transformers(hf, ours, [[5, 17, 99], [8, 61]])
"""

from __future__ import annotations

import torch
import transformers

from tunesmith.generation import generate, left_pad

ATOL = 1e-4


def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list:
    """transformers' greedy continuation of each left-padded prompt (``max_new_tokens`` each)."""
    ids, mask, _ = left_pad(prompts, pad_id=0)
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        eos_token_id=None, pad_token_id=0, bos_token_id=1,
    )  # fmt: skip
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return out[:, ids.shape[1] :].tolist()


def assert_greedy_matches_transformers(
    hf: torch.nn.Module, ours: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int = 20
) -> None:
    """Our KV-cache greedy tokens == transformers'; the rows differ (not one trivial answer)."""
    expected = hf_greedy(hf, prompts, max_new_tokens)
    assert generate(ours, prompts, max_new_tokens=max_new_tokens).sequences == expected
    assert len({tuple(row) for row in expected}) == len(prompts)


def left_padded_batch(vocab: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 12 random ids (``[1, vocab)``), the second left-padded by 3, and the mask."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (2, 12), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def assert_logits_and_router_logits_match(
    hf: torch.nn.Module, ours: torch.nn.Module, vocab: int
) -> None:
    """fp32 logits and every MoE layer's router logits within :data:`ATOL` on real tokens."""
    ids, mask = left_padded_batch(vocab)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        logits, router_logits = ours(
            ids, attention_mask=mask, position_ids=pos, output_router_logits=True
        )
    real = mask.bool()
    assert (logits - theirs.logits)[real].abs().max() < ATOL
    assert len(router_logits) == len(theirs.router_logits) > 0
    for mine, hf_logits in zip(router_logits, theirs.router_logits, strict=True):
        assert (mine - hf_logits)[real.flatten()].abs().max() < ATOL


def hf_grads(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' gradients under our names (fused experts split per projection)."""
    out = {}
    for name, p in hf.named_parameters():
        if name.endswith("experts.gate_up_proj"):
            gate, up = p.grad.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = p.grad
    return out


def assert_gradients_match(hf: torch.nn.Module, ours: torch.nn.Module, vocab: int) -> None:
    """Gradients of ``(logits * w).sum()`` (random ``w``) within rel 1e-4, every parameter."""
    ids, _ = left_padded_batch(vocab, seed=4)
    weights = torch.randn(2, 12, vocab, generator=torch.Generator().manual_seed(5))
    hf.zero_grad()
    ours.zero_grad()
    (hf(ids).logits * weights).sum().backward()
    (ours(ids) * weights).sum().backward()
    theirs = hf_grads(hf)
    mine = dict(ours.named_parameters())
    assert set(mine) == set(theirs)
    for name, p in mine.items():
        scale = theirs[name].abs().max().clamp(min=1e-6)
        assert (p.grad - theirs[name]).abs().max() / scale < 1e-4, name


@torch.no_grad()
def zero_correction_biases(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every ``e_score_correction_bias`` set to 0 (in place), returned."""
    for name, bias in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            bias.zero_()
    return model
