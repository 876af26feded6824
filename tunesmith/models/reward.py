"""Reward models: a decoder body with a ``score`` head, read at the last real token.

A :class:`RewardModel` is the tunesmith twin of transformers' ``*ForSequenceClassification``
(``LlamaForSequenceClassification``, ``Qwen3ForSequenceClassification``, ...): the same
``model.*`` body as :class:`~tunesmith.modules.decoder.TransformerLM`, and ``score.weight``
``[num_labels, hidden]`` instead of ``lm_head``. Checkpoints go both ways with no key map:
:func:`reward_model_from_hf` reads a sequence-classification folder, or a causal LM folder
(whose ``lm_head`` is dropped and whose ``score`` head starts fresh), and
:func:`~tunesmith.models.hf.save_hf_checkpoint` writes a folder that
``AutoModelForSequenceClassification.from_pretrained`` loads.

Example::

    >>> import json
    >>> from tunesmith.models import build_model, qwen3
    >>> from tunesmith.models.hf import save_hf_checkpoint
    >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")  # a causal LM
    >>> rm = reward_model_from_hf("Qwen3-tiny", pad_token_id=0)  # warns: a new score head
    >>> input_ids, attention_mask = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[1, 1, 1, 0]])
    >>> rewards = rm(input_ids, attention_mask=attention_mask)[:, 0]
    >>> rewards.shape
    torch.Size([1])
    >>> save_hf_checkpoint(rm, "out/rm", source_dir="Qwen3-tiny")
    PosixPath('out/rm')
    >>> json.loads(Path("out/rm/config.json").read_text())["architectures"]
    ['Qwen3ForSequenceClassification']
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tunesmith.config.registry import component
from tunesmith.models.builder import build_model
from tunesmith.models.family import UnsupportedModelError, families
from tunesmith.models.hf import (
    CONFIG_NAME,
    SCORE_WEIGHT,
    DTypeSetting,
    HFFolder,
    from_hf,
    hf_folder_spec,
    load_hf_weights,
    read_hf_config,
    score_num_labels,
)
from tunesmith.models.safetensors_io import CheckpointError, read_tensor_index
from tunesmith.models.spec import ModelSpec
from tunesmith.modules.decoder import DecoderModel
from tunesmith.modules.moe import GroupedExperts
from tunesmith.modules.norms import RMSNorm
from tunesmith.modules.rope import RotaryEmbedding

__all__ = [
    "RewardModel",
    "build_reward_model",
    "last_token_positions",
    "reward_model_from_hf",
]

logger = logging.getLogger(__name__)


def _check_num_labels(num_labels: Any) -> None:
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"num_labels must be a positive int, got {num_labels!r}")


def last_token_positions(
    attention_mask: torch.Tensor | None, input_ids: torch.Tensor
) -> torch.Tensor:
    """Index ``[b]`` of the last real token of each row: the last position where the 2-D 0/1
    ``attention_mask`` is 1 (right or left padding), or the last position without a mask.

    Example::

        >>> last_token_positions(torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.zeros(2, 3))
        tensor([1, 2])
    """
    b, s = input_ids.shape
    if attention_mask is None:
        return torch.full((b,), s - 1, dtype=torch.long, device=input_ids.device)
    if attention_mask.shape != (b, s):
        raise ValueError(
            f"a reward model needs a 2-D 0/1 attention_mask shaped like input_ids {[b, s]}, "
            f"got {list(attention_mask.shape)} (4-D masks and KV caches are not supported)"
        )
    positions = torch.arange(s, device=attention_mask.device)
    last = torch.where(attention_mask.bool(), positions, -1).amax(dim=-1)
    empty = (last < 0).nonzero().flatten()
    if empty.numel():
        raise ValueError(f"attention_mask rows {empty.tolist()} have no real token to score")
    return last


class RewardModel(nn.Module):
    """Decoder body (``.model``) plus ``.score = Linear(hidden, num_labels, bias=False)``.

    The head lives on the body's device and dtype; for a materialised body it is drawn at
    construction by :meth:`init_score`, for a meta body it stays on meta.

    ``forward`` runs the body and applies ``score`` to the hidden state of the last real token
    of each row only, in float32. Parameter names are those of transformers'
    ``*ForSequenceClassification`` (``model.*``, ``score.weight``). ``spec`` is the
    :class:`~tunesmith.models.spec.ModelSpec` of the body; its ``pad_token_id`` goes into a
    saved ``config.json``.

    transformers picks the scored token differently: the last token whose id is not
    ``pad_token_id``. Both agree when the pad id never occurs inside real tokens; if it does
    (e.g. pad == eos and rows end with eos), transformers scores an earlier token than this
    model, so pick a pad id that the data never contains.

    Example::

        >>> from tunesmith.models import llama3
        >>> rm = build_reward_model(llama3.spec("llama3_tiny", pad_token_id=0))
        >>> ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
        >>> rm(ids, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])).shape
        torch.Size([2, 1])
    """

    def __init__(
        self,
        model: DecoderModel,
        *,
        num_labels: int = 1,
        initializer_range: float = 0.02,
        spec: Any = None,
    ) -> None:
        super().__init__()
        _check_num_labels(num_labels)
        embed = model.embed_tokens.weight
        self.model = model
        self.num_labels = num_labels
        self.initializer_range = initializer_range
        self.spec = spec
        # Built on meta (no default init), then on the body's device and dtype drawn by
        # init_score; a meta body keeps a meta head, to be loaded or initialised later.
        self.score = nn.Linear(
            embed.shape[1], num_labels, bias=False, device="meta", dtype=embed.dtype
        )
        if not embed.is_meta:
            self.score.to_empty(device=embed.device)
            self.init_score()
        self.register_load_state_dict_post_hook(_after_load)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        output_router_logits: bool = False,
        every_position: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Scores ``[b, num_labels]`` (float32) at the last real token of each row.

        Args:
            input_ids: ``[b, s]`` token ids.
            position_ids: ``[b, s]`` or ``[1, s]``; default ``arange(s)`` (right padding).
            attention_mask: a 2-D ``[b, s]`` 0/1 padding mask; the score is read at the last
                position where it is 1. Without it, at the last position of every row.
            output_router_logits: also return the body's per-MoE-layer router logits (for
                the load-balancing loss; empty for a dense body): ``(scores, router_logits)``.
            every_position: scores at every position instead, ``[b, s, num_labels]`` (a
                critic's values, :mod:`tunesmith.rl.ppo.critic`); ``attention_mask`` is optional.
        """
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                f"a reward model takes a 2-D 0/1 attention_mask, got {attention_mask.dim()}-D "
                f"shape {list(attention_mask.shape)}"
            )
        hidden = self.model(
            input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            output_router_logits=output_router_logits,
        )
        hidden, router_logits = hidden if output_router_logits else (hidden, ())
        if every_position:
            scores = F.linear(hidden.float(), self.score.weight.float())
            return (scores, router_logits) if output_router_logits else scores
        last = last_token_positions(attention_mask, input_ids).to(hidden.device)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
        scores = F.linear(pooled.float(), self.score.weight.float())
        return (scores, router_logits) if output_router_logits else scores

    # -- weights -----------------------------------------------------------------------------

    @torch.no_grad()
    def init_score(self, std: float | None = None) -> None:
        """Draw ``score.weight`` from N(0, ``std``) (default ``initializer_range``).

        Drawn in float32 on the CPU from torch's default generator, then cast and moved, so
        ``torch.manual_seed`` fixes the head whatever the device and dtype.
        """
        std = self.initializer_range if std is None else std
        weight = self.score.weight
        draw = torch.randn(weight.shape, dtype=torch.float32) * std
        self.score.weight.copy_(draw.to(device=weight.device, dtype=weight.dtype))

    @torch.no_grad()
    def init_weights(self, std: float | None = None) -> None:
        """Initialise like transformers: body linears and embeddings ~ N(0, std), biases 0,
        norms 1; the head by :meth:`init_score`; then RoPE buffers."""
        std = self.initializer_range if std is None else std
        for module in self.model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):
                module.init_weights(std)
        self.init_score(std)
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute RoPE ``inv_freq`` on ``device`` (default: the embedding's device)."""
        device = self.model.embed_tokens.weight.device if device is None else device
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters(device)


def _after_load(module: RewardModel, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: build RoPE buffers once weights arrived on a meta model."""
    if module.model.rotary_emb.inv_freq.is_meta and not module.model.embed_tokens.weight.is_meta:
        module.init_buffers()


def build_reward_model(
    spec: ModelSpec,
    num_labels: int = 1,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> RewardModel:
    """A randomly initialised :class:`RewardModel` with the body of ``spec``.

    Like :func:`~tunesmith.models.builder.build_model`: built on the meta device, returned
    as is for ``device="meta"``, else materialised on ``device`` (default CPU) and
    initialised N(0, ``spec.initializer_range``).

    Example::

        >>> from tunesmith.models import qwen3
        >>> build_reward_model(qwen3.spec("qwen3_tiny"), num_labels=2).score.weight.shape
        torch.Size([2, 64])
    """
    body = build_model(spec, device="meta", dtype=dtype).model
    model = RewardModel(
        body, num_labels=num_labels, initializer_range=spec.initializer_range, spec=spec
    )
    target = torch.device("cpu" if device is None else device)
    if target.type != "meta":
        model.to_empty(device=target)
        model.init_weights()
    return model


def _stored_num_labels(folder: Path, num_labels: int) -> int | None:
    """``score.weight`` rows in the checkpoint (None: a causal LM), checked against
    ``num_labels`` and against an ``architectures`` entry that promises a score head."""
    infos = read_tensor_index(folder)
    stored = score_num_labels(infos)
    if stored is None:
        architectures = read_hf_config(folder).get("architectures") or []
        if any(str(a).endswith("ForSequenceClassification") for a in architectures):
            files = sorted({info.file.name for info in infos.values()})
            raise CheckpointError(
                f"{folder / CONFIG_NAME} names {architectures} but no tensor "
                f"'{SCORE_WEIGHT}' is stored in {', '.join(files)}"
            )
    elif stored != num_labels:
        info = infos[SCORE_WEIGHT]
        raise CheckpointError(
            f"{info.file}: tensor '{SCORE_WEIGHT}' has shape {list(info.shape)} "
            f"({stored} label(s)), but num_labels={num_labels} was asked"
        )
    return stored


@component
def reward_model_from_hf(
    path: HFFolder,
    *,
    num_labels: int = 1,
    dtype: torch.dtype | DTypeSetting | None = None,
    device: torch.device | str | None = None,
    pad_token_id: int | None = None,
) -> RewardModel:
    """A :class:`RewardModel` from a HF folder.

    A ``*ForSequenceClassification`` folder (one holding ``score.weight``) loads whole; its
    ``score`` must have ``num_labels`` rows. A causal LM folder gives its body; ``lm_head`` is
    dropped and a new ``score`` head is drawn by :meth:`RewardModel.init_score` (seeded by
    ``torch.manual_seed``), which is logged as a warning. ``dtype`` defaults to the config's,
    else float32; ``device`` to CPU. ``pad_token_id`` replaces the config's in ``model.spec``
    (what a saved ``config.json`` will say); a reward checkpoint cannot be saved without one.

    Example::

        >>> from tunesmith.models import build_model, qwen3
        >>> from tunesmith.models.hf import save_hf_checkpoint
        >>> _ = save_hf_checkpoint(build_model(qwen3.spec("qwen3_tiny")), "Qwen3-tiny")
        >>> rm = reward_model_from_hf("Qwen3-tiny", dtype="bf16", device="cpu")  # or "cuda"
        >>> rm.score.weight.shape, rm.score.weight.dtype
        (torch.Size([1, 64]), torch.bfloat16)
    """
    _check_num_labels(num_labels)
    folder = Path(path)
    model_type = read_hf_config(folder).get("model_type")
    if not any(model_type in (f.model_type, *f.aliases) for f in families()):
        raise UnsupportedModelError(
            f"{folder / CONFIG_NAME}: model_type {model_type!r} has no native family, and "
            "reward models need one: the transformers backend (which trains such models with "
            f"every other recipe) has no score head; native families: "
            f"{', '.join(sorted(f.model_type for f in families()))}"
        )
    spec, resolved = hf_folder_spec(folder, dtype)
    if pad_token_id is not None:
        spec = spec.replace(pad_token_id=pad_token_id)
    device = "cpu" if device is None else device
    if _stored_num_labels(folder, num_labels) is not None:
        model = build_reward_model(spec, num_labels, device="meta", dtype=resolved)
        load_hf_weights(model, folder, dtype=resolved, device=device)
        return model
    body = from_hf(folder, dtype=resolved, device=device).model  # lm_head goes with the LM
    model = RewardModel(  # draws the new head
        body, num_labels=num_labels, initializer_range=spec.initializer_range, spec=spec
    )
    logger.warning(
        "%s is a causal LM checkpoint: lm_head dropped, new '%s' head [%d, %d] drawn from "
        "N(0, %g); train it before use",
        folder,
        SCORE_WEIGHT,
        num_labels,
        spec.hidden_size,
        spec.initializer_range,
    )
    return model
