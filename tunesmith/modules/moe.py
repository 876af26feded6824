"""Token-choice mixture of experts (Qwen3-MoE): stacked experts, grouped matmuls, and the
load-balancing loss.

The experts of a layer live in three stacked tensors (:class:`GroupedExperts`) and run as
grouped matrix products over tokens sorted by expert, with no loop over experts and no
host sync (the per-expert token counts stay a tensor). On disk the Hugging Face names are
kept: a state-dict hook pair splits the stacked tensors into ``experts.{i}.gate_proj.weight``
etc. when saving and stacks them again when loading, the one exception to identity
conversion between our parameter names and a checkpoint's.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ExpertLoRA",
    "GroupedExperts",
    "MoE",
    "grouped_mm_supported",
    "load_balancing_loss",
    "file_expert_keys",
    "model_expert_keys",
    "split_expert_keys",
    "stack_expert_keys",
    "stacked_state",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: this torch has it, every row stride
    is a multiple of 16 bytes, and the dtype is bfloat16 (any device, also under
    ``torch.compile``) or, in eager mode on CPU, float32/float16 too.

    Example::

        >>> grouped_mm_supported(torch.zeros(3, 64), torch.zeros(2, 32, 64))
        True
        >>> grouped_mm_supported(torch.zeros(3, 6, dtype=torch.float64))
        False
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    eager_cpu = not torch.compiler.is_compiling() and all(t.device.type == "cpu" for t in tensors)
    dtypes = _GROUPED_DTYPES if eager_cpu else (torch.bfloat16,)
    return all(t.dtype in dtypes and (t.shape[-1] * t.element_size()) % 16 == 0 for t in tensors)


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stacked in ``[E, ...]`` tensors.

    Parameters: ``gate_proj`` and ``up_proj`` ``[E, intermediate, hidden]``, ``down_proj``
    ``[E, hidden, intermediate]`` (expert ``i``'s ``nn.Linear`` weights stacked on dim 0).
    :meth:`forward` takes tokens already sorted by expert and the number of tokens of each
    expert, and computes ``down(silu(gate(x)) * up(x))`` per expert on its contiguous slice
    with ``torch._grouped_mm`` (one kernel per projection, no host sync). Where the grouped
    kernel does not take the operands (see :func:`grouped_mm_supported`: e.g. float32 on
    CUDA, float64, a row not a multiple of 16 bytes) it loops over experts instead, which
    reads ``counts`` on the host.

    ``state_dict()`` holds the Hugging Face keys ``{i}.gate_proj.weight`` ... (views of the
    stacked tensors); ``load_state_dict`` takes those keys (stacked back, also when a
    streaming loader passes an expert's tensors over several calls) or the stacked names.

    Options (gpt-oss): ``bias`` adds ``gate_proj_bias``/``up_proj_bias`` ``[E, I]`` and
    ``down_proj_bias`` ``[E, H]``; ``activation(gate, up)`` replaces ``silu(gate) * up``;
    ``checkpoint_layout`` (an object with ``split(module, state_dict, prefix)`` and
    ``stack(module, state_dict, prefix, error_msgs)``) replaces the per-expert keys on disk
    (see :mod:`~tunesmith.modules.gpt_oss_experts`).

    Example::

        >>> experts = GroupedExperts(4, hidden_size=32, intermediate_size=16)
        >>> tokens = torch.randn(5, 32)               # sorted by expert: 2, 0, 3, 0 tokens
        >>> experts(tokens, torch.tensor([2, 0, 3, 0])).shape
        torch.Size([5, 32])
        >>> sorted(experts.state_dict())[:2]
        ['0.down_proj.weight', '0.gate_proj.weight']
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if num_experts <= 0:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        for name, width in zip(PROJECTIONS, (intermediate_size, intermediate_size, hidden_size)):
            bias_param = nn.Parameter(torch.zeros(num_experts, width)) if bias else None
            self.register_parameter(f"{name}_bias", bias_param)
        self.activation = activation  # None: silu(gate) * up
        self.checkpoint_layout: Any = None  # None: per-expert HF keys (see the class docs)
        self._pending: dict[str, dict[int, torch.Tensor]] = {}  # see _stack_experts
        self._prefix = ""
        self.split_state_dict = True  # state_dict() with HF per-expert keys (see stacked_state)
        self.register_state_dict_post_hook(_split_experts)
        self.register_load_state_dict_pre_hook(_stack_experts)
        self.register_load_state_dict_post_hook(_report_missing_experts)
        # Per-projection stacked LoRA adapters (see ExpertLoRA / add_lora); empty = none.
        self.lora = nn.ModuleDict()
        self.reset_parameters()

    def add_lora(
        self,
        projection: str,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        dtype: torch.dtype | None = None,
    ) -> ExpertLoRA:
        """Give ``projection`` (``gate_proj``/``up_proj``/``down_proj``) one LoRA adapter per
        expert (:class:`ExpertLoRA`, an exact no-op at first); returns it."""
        if projection not in PROJECTIONS:
            raise ValueError(f"projection {projection!r} is not one of {PROJECTIONS}")
        if projection in self.lora:
            raise ValueError(f"{projection} already has an adapter; apply LoRA once")
        weight = getattr(self, projection)
        adapter = ExpertLoRA(
            self.num_experts,
            weight.shape[2],
            weight.shape[1],
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            use_rslora=use_rslora,
            device=weight.device,
            dtype=dtype or weight.dtype,
        )
        self.lora[projection] = adapter
        return adapter

    def reset_parameters(self) -> None:
        """``nn.Linear``'s default: uniform in ``+-1/sqrt(fan_in)`` for every expert."""
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)
        self._zero_biases()

    def init_weights(self, std: float) -> None:
        """Every expert weight ~ ``N(0, std)``, as transformers initialises its linears."""
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, mean=0.0, std=std)
        self._zero_biases()

    @torch.no_grad()
    def _zero_biases(self) -> None:
        for name in PROJECTIONS:
            bias = getattr(self, f"{name}_bias")
            if bias is not None:
                bias.zero_()

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up if self.activation is None else self.activation(gate, up)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}"
        )

    def forward(self, tokens_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Tokens ``[n, hidden]`` sorted by expert, ``counts`` ``[E]`` (sum ``n``) -> ``[n, hidden]``."""
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        adapters = {name: a for name, a in self.lora.items() if not a.adapters_disabled}
        operands = [t for a in adapters.values() for t in (a.lora_A, a.lora_B)]
        if operands and operands[0].shape[0] != gate.shape[0]:
            raise ValueError(
                f"expert LoRA adapters hold {operands[0].shape[0]} experts but this rank runs "
                f"{gate.shape[0]}: add expert LoRA (apply_lora) before expert parallel splits "
                f"the experts (apply_expert_parallel), which splits the adapters with them"
            )
        biases = {name: getattr(self, f"{name}_bias") for name in PROJECTIONS}
        if grouped_mm_supported(tokens_sorted, gate, down, *operands):
            offs = counts.cumsum(0).to(torch.int32)
            if biases["gate_proj"] is not None:  # each row's expert, without a host sync
                experts = torch.arange(len(counts), device=counts.device)
                rows = experts.repeat_interleave(counts, output_size=tokens_sorted.shape[0])

            def project(x: torch.Tensor, name: str, weight: torch.Tensor) -> torch.Tensor:
                y = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offs)
                if name in adapters:
                    y = y + adapters[name].grouped(x, offs).to(y.dtype)
                if biases[name] is not None:
                    y = y + biases[name][rows]
                return y

            g = project(tokens_sorted, "gate_proj", gate)
            u = project(tokens_sorted, "up_proj", up)
            return project(self._glu(g, u), "down_proj", down)
        # unbind, not gate[e]: the backward of one select per expert would build E full-size
        # gradients; unbind's is one stack.
        outputs = []
        chunks = tokens_sorted.split(counts.tolist())
        per_expert = {
            name: list(zip(a.lora_A.unbind(), a.lora_B.unbind(), strict=True))
            for name, a in adapters.items()
        }

        def one(x: torch.Tensor, name: str, weight: torch.Tensor, e: int) -> torch.Tensor:
            y = x @ weight.T
            if name in adapters:
                a, b = per_expert[name][e]
                lora = adapters[name]
                h = lora.dropout_layer(x).to(a.dtype)
                y = y + ((h @ a.T) @ b.T * lora.scaling).to(y.dtype)
            if biases[name] is not None:
                y = y + biases[name][e]
            return y

        weights = zip(gate.unbind(), up.unbind(), down.unbind(), strict=True)
        for e, (chunk, (g, u, d)) in enumerate(zip(chunks, weights, strict=True)):
            if chunk.shape[0]:
                hidden = self._glu(one(chunk, "gate_proj", g, e), one(chunk, "up_proj", u, e))
                outputs.append(one(hidden, "down_proj", d, e))
        if not outputs:
            return tokens_sorted.new_zeros(tokens_sorted.shape)
        return torch.cat(outputs)

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold every adapter into its stacked weight (``W_e += scaling * B_e @ A_e``, computed in
        float32) and drop the adapters."""
        for name, adapter in list(self.lora.items()):
            weight = getattr(self, name)
            delta = torch.bmm(adapter.lora_B.float(), adapter.lora_A.float()) * adapter.scaling
            weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
            del self.lora[name]


class ExpertLoRA(nn.Module):
    """LoRA on one stacked expert projection: per expert ``e`` the update
    ``scaling * B_e @ A_e`` with ``lora_A`` ``[E, rank, in]`` and ``lora_B`` ``[E, out, rank]``.

    Lives in ``GroupedExperts.lora[projection]``; :meth:`GroupedExperts.forward` adds
    ``dropout(x) @ A_e^T @ B_e^T * scaling`` to the projection of expert ``e``'s tokens with
    two more grouped matmuls. ``A`` starts Kaiming-uniform per expert (``a=sqrt(5)``, as
    ``nn.Linear`` and PEFT), ``B`` at zero. Has the attributes the adapter tools read
    (``rank``, ``alpha``, ``use_rslora``, ``dropout``, ``adapters_disabled``).

    Example::

        >>> experts = GroupedExperts(4, hidden_size=32, intermediate_size=16)
        >>> adapter = experts.add_lora("down_proj", rank=4, alpha=8)
        >>> adapter.lora_A.shape, adapter.lora_B.shape
        (torch.Size([4, 4, 16]), torch.Size([4, 32, 4]))
    """

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_rslora: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"rank must be positive, got {rank}")
        self.num_experts = num_experts
        self.in_features, self.out_features = in_features, out_features
        self.rank, self.alpha, self.use_rslora, self.dropout = rank, alpha, use_rslora, dropout
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        self.adapters_disabled = False
        self.dropout_layer = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        factory = {"device": device, "dtype": dtype}
        self.lora_A = nn.Parameter(torch.empty(num_experts, rank, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(num_experts, out_features, rank, **factory))
        self.reset_adapter_parameters()

    def adapter_parameter_names(self) -> list[str]:
        return ["lora_A", "lora_B"]

    @torch.no_grad()
    def reset_adapter_parameters(self) -> None:
        """``A`` Kaiming-uniform (``a=sqrt(5)``) per expert, ``B`` zero."""
        for a in self.lora_A.unbind():
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B)

    def grouped(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """The update for tokens ``x`` sorted by expert (group ends ``offs``)."""
        h = self.dropout_layer(x).to(self.lora_A.dtype)
        h = torch._grouped_mm(h, self.lora_A.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(h, self.lora_B.transpose(-2, -1), offs=offs) * self.scaling

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, in={self.in_features}, out={self.out_features}, "
            f"rank={self.rank}, alpha={self.alpha}"
        )


def _split_experts(
    module: GroupedExperts, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict post-hook: stacked ``gate_proj`` -> ``{i}.gate_proj.weight`` (HF keys)."""
    if not module.split_state_dict:
        return
    if module.checkpoint_layout is not None:
        module.checkpoint_layout.split(module, state_dict, prefix)
        return
    stacked = {name: state_dict.pop(prefix + name) for name in PROJECTIONS}
    for i in range(module.num_experts):
        for name in PROJECTIONS:
            state_dict[f"{prefix}{i}.{name}.weight"] = stacked[name][i]


def _stack_experts(
    module: GroupedExperts,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load pre-hook: ``{i}.gate_proj.weight`` keys -> one stacked ``gate_proj``.

    A streaming loader (``load_state_dict(..., strict=False)`` once per file) may pass an
    expert's tensors in several calls: the pieces wait on the module until all
    ``num_experts`` have come, then load as one tensor (:func:`_report_missing_experts` names
    the absent ones meanwhile).
    """
    module._prefix = prefix
    if module.checkpoint_layout is not None:
        if module.split_state_dict:
            module.checkpoint_layout.stack(module, state_dict, prefix, error_msgs)
        return
    for name in PROJECTIONS:
        pending = module._pending.setdefault(name, {})
        for i in range(module.num_experts):
            key = f"{prefix}{i}.{name}.weight"
            if key in state_dict:
                pending[i] = state_dict.pop(key)
        if not pending:
            del module._pending[name]
        elif prefix + name in state_dict:
            error_msgs.append(
                f"{prefix}{name}: the state dict holds both the stacked tensor and per-expert "
                f"keys {prefix}{{i}}.{name}.weight"
            )
            del module._pending[name]
        elif len(pending) == module.num_experts:
            state_dict[prefix + name] = torch.stack([pending[i] for i in range(len(pending))])
            del module._pending[name]


def _report_missing_experts(module: GroupedExperts, incompatible_keys: Any) -> None:
    """Load post-hook: a stacked tensor still waiting for experts is reported missing by the
    Hugging Face keys of the absent experts (``{i}.gate_proj.weight``), not by its own name."""
    prefix = module._prefix
    for name, pending in module._pending.items():
        if prefix + name in incompatible_keys.missing_keys:
            incompatible_keys.missing_keys.remove(prefix + name)
            incompatible_keys.missing_keys.extend(
                f"{prefix}{i}.{name}.weight" for i in range(module.num_experts) if i not in pending
            )


_EXPERT_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<i>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_STACKED_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<proj>gate_proj|up_proj|down_proj)$")


def stack_expert_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict with HF per-expert keys (``...experts.{i}.gate_proj.weight``) stacked into
    the in-memory names (``...experts.gate_proj`` ``[E, ...]``); other keys pass through.

    For loaders that bypass ``load_state_dict``'s hooks, e.g.
    ``torch.distributed.checkpoint.state_dict.set_model_state_dict``. A ``ValueError`` names
    a stacked tensor whose experts are not numbered ``0..E-1``.

    Example::

        >>> state = {f"mlp.experts.{i}.up_proj.weight": torch.zeros(3, 4) for i in range(2)}
        >>> {k: list(v.shape) for k, v in stack_expert_keys(state).items()}
        {'mlp.experts.up_proj': [2, 3, 4]}
    """
    out: dict[str, Any] = {}
    groups: dict[str, dict[int, Any]] = {}
    for key, value in state.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = value
            continue
        stacked = match["prefix"] + match["proj"]
        if stacked not in groups:
            groups[stacked] = {}
            out[stacked] = None  # keeps the first expert's position in the order
        groups[stacked][int(match["i"])] = value
    for stacked, pieces in groups.items():
        if sorted(pieces) != list(range(len(pieces))):
            absent = sorted(set(range(max(pieces) + 1)) - set(pieces))
            raise ValueError(f"{stacked}: experts {absent[:20]} are missing from the state dict")
        out[stacked] = torch.stack([pieces[i] for i in range(len(pieces))])
    return out


def split_expert_keys(state: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`stack_expert_keys`: stacked ``...experts.gate_proj`` ``[E, ...]``
    -> ``...experts.{i}.gate_proj.weight`` (views), in expert-major order like a checkpoint.

    Example::

        >>> list(split_expert_keys({"experts.down_proj": torch.zeros(2, 4, 3)}))
        ['experts.0.down_proj.weight', 'experts.1.down_proj.weight']
    """
    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        match = _STACKED_KEY.match(key)
        if match is None or not isinstance(value, torch.Tensor) or value.dim() != 3:
            out[key] = value
            continue
        if match["prefix"] not in groups:
            groups[match["prefix"]] = {}
            out[match["prefix"]] = None  # placeholder for the group's position
        groups[match["prefix"]][match["proj"]] = value
    result: dict[str, Any] = {}
    for key, value in out.items():
        if key not in groups:
            result[key] = value
            continue
        tensors = groups[key]
        for i in range(next(iter(tensors.values())).shape[0]):
            for proj in PROJECTIONS:
                if proj in tensors:
                    result[f"{key}{i}.{proj}.weight"] = tensors[proj][i]
    return result


def _layouts(model: nn.Module) -> dict[str, GroupedExperts]:
    """``model``'s experts modules that have a ``checkpoint_layout``, by state-dict prefix."""
    return {
        f"{name}.": m
        for name, m in model.named_modules()
        if isinstance(m, GroupedExperts) and m.checkpoint_layout is not None
    }


def file_expert_keys(model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """A stacked state dict of ``model`` (:func:`stacked_state`) with its experts as the files
    store them: each experts module's ``checkpoint_layout`` (Llama 4's fused tensors), else
    per-expert keys (:func:`split_expert_keys`).

    Example::

        >>> moe = MoE(8, 4, num_experts=2, top_k=1)
        >>> with stacked_state(moe):
        ...     sorted(file_expert_keys(moe, moe.state_dict()))[:2]
        ['experts.0.down_proj.weight', 'experts.0.gate_proj.weight']
    """
    layouts = _layouts(model)
    own = {k: v for k, v in state.items() if not k.startswith(tuple(layouts))}
    out = split_expert_keys(own)
    for prefix, module in layouts.items():
        part = {k: v for k, v in state.items() if k.startswith(prefix)}
        if prefix + "gate_proj" in part:
            module.checkpoint_layout.split(module, part, prefix)
        out.update(part)
    return out


def model_expert_keys(model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`file_expert_keys`: the files' expert keys of ``model`` as its
    stacked parameter names (a ``checkpoint_layout``'s refusals raise ``ValueError``).

    Example::

        >>> moe = MoE(8, 4, num_experts=2, top_k=1)
        >>> sorted(model_expert_keys(moe, moe.state_dict()))
        ['experts.down_proj', 'experts.gate_proj', 'experts.up_proj', 'gate.weight']
    """
    state = stack_expert_keys(state)
    errors: list[str] = []
    for prefix, module in _layouts(model).items():
        module.checkpoint_layout.stack(module, state, prefix, errors)
    if errors:
        raise ValueError("; ".join(errors))
    return state


@contextlib.contextmanager
def stacked_state(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, ``model.state_dict()`` keeps the stacked expert tensors under their
    parameter names (``...experts.gate_proj``) instead of the HF per-expert keys, as
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` needs (its names must be
    the parameters'); convert with :func:`split_expert_keys` afterwards.

    Example::

        >>> moe = MoE(8, 4, num_experts=2, top_k=1)
        >>> with stacked_state(moe):
        ...     sorted(moe.state_dict())
        ['experts.down_proj', 'experts.gate_proj', 'experts.up_proj', 'gate.weight']
    """
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    saved = [m.split_state_dict for m in experts]
    for m in experts:
        m.split_state_dict = False
    try:
        yield model
    finally:
        for m, flag in zip(experts, saved, strict=True):
            m.split_state_dict = flag


class MoE(nn.Module):
    """Softmax top-k routing over SwiGLU experts.

    The router is ``gate`` (a bias-free linear); the experts are a :class:`GroupedExperts`
    ``experts`` whose state dict carries the Hugging Face names ``experts.{i}.gate_proj.weight``
    / ``up_proj`` / ``down_proj``. Routing follows Qwen3-MoE: probabilities are a float32
    softmax of the router logits, the top ``top_k`` experts are kept and, with
    ``norm_topk_prob``, their weights are renormalised to sum to one. The ``(token, slot)``
    assignments are sorted by expert, run through the experts in one grouped call, weighted
    and added back to their tokens.

    ``forward`` returns the output and the router logits ``[b * s, num_experts]``
    (for :func:`load_balancing_loss` and parity checks).

    gpt-oss: ``router_bias`` gives ``gate`` a bias; ``softmax_after_topk`` picks the top
    ``top_k`` logits first and softmaxes those (in the logits' dtype, as transformers' gpt-oss
    router); ``expert_bias`` and ``activation`` are :class:`GroupedExperts`' ``bias`` and
    ``activation``.

    Example::

        >>> moe = MoE(32, 16, num_experts=4, top_k=2, norm_topk_prob=True)
        >>> out, router_logits = moe(torch.randn(2, 3, 32))
        >>> out.shape, router_logits.shape
        (torch.Size([2, 3, 32]), torch.Size([6, 4]))
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool = False,
        router_bias: bool = False,
        softmax_after_topk: bool = False,
        expert_bias: bool = False,
        activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.softmax_after_topk = softmax_after_topk
        self.gate = nn.Linear(hidden_size, num_experts, bias=router_bias)
        self.experts = GroupedExperts(
            num_experts, hidden_size, intermediate_size, bias=expert_bias, activation=activation
        )

    scale_inputs = False  # weights scale each expert's output (Llama 4's MoE: its input)
    # The expert load counted since the last read (tunesmith.training.router_stats): ``[E + 1]``,
    # the real tokens each expert got as routed, then the assignments no expert got.
    routed_counts: torch.Tensor | None = None
    # ``[n]`` bool, which of the next forward's tokens are real (set by the decoder body's
    # hook, router_stats.track_routing); a counting forward consumes it.
    real_tokens: torch.Tensor | None = None

    def _record_routing(self, experts: torch.Tensor) -> None:
        """In train mode, add the (token, slot) assignments ``experts`` ``[n, k]`` of the real
        tokens (:attr:`real_tokens`) to :attr:`routed_counts`, per expert (the routing decision
        itself, whatever the router), then those that reached no expert. Only a forward whose
        tokens were marked counts, and it consumes the mark: activation checkpointing's
        recomputation in backward finds none and counts nothing again. Static shapes, no host
        sync (torch.compile guards on the mark being set)."""
        real = self.real_tokens
        if not self.training or real is None:
            return
        self.real_tokens = None
        if real.shape[0] != experts.shape[0]:  # a forward of other tokens than the body's
            real = torch.ones(experts.shape[0], dtype=torch.bool)
        weights = real.to(experts.device, torch.long)[:, None].expand_as(experts).flatten()
        flat = experts.detach().flatten()
        counts = flat.new_zeros(self.num_experts).scatter_add_(0, flat, weights)
        routed = torch.cat([counts, (weights.sum() - counts.sum())[None]])
        total = self.routed_counts
        self.routed_counts = routed if total is None else total + routed

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens ``[n, hidden]`` -> (router logits ``[n, E]``, weights ``[n, k]``, experts ``[n, k]``)."""
        logits = self.gate(x)
        if self.softmax_after_topk:
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return logits, F.softmax(top, dim=-1, dtype=top.dtype).to(x.dtype), experts
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits, weights, experts = self.route(tokens)
        # No early return for zero tokens: the empty path is exact and cheap, and an
        # expert-parallel experts module must join its all-to-alls on every rank.
        # Sort the (token, slot) assignments by expert so each expert sees one contiguous slice.
        flat_experts = experts.flatten()
        order = flat_experts.argsort(stable=True)
        token_idx = order // self.top_k
        # Tokens per expert as a tensor of static shape (no host sync, traceable).
        counts = flat_experts.new_zeros(self.num_experts).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts)
        )
        self._record_routing(experts)
        slot_weights = weights.flatten()[order, None]
        if self.scale_inputs:  # Llama 4: the weight scales what the expert sees
            expert_out = self.experts(tokens[token_idx] * slot_weights, counts)
        else:
            expert_out = self.experts(tokens[token_idx], counts) * slot_weights
        out = torch.zeros_like(tokens).index_add_(0, token_idx, expert_out)
        return out.reshape(shape), logits


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Switch-Transformer auxiliary loss over all MoE layers, as transformers computes it.

    ``num_experts * sum_e f_e * P_e`` where ``f_e`` is the fraction of top-k
    assignments that went to expert ``e`` and ``P_e`` its mean router probability,
    both pooled over layers and over the real (``attention_mask == 1``) tokens.
    ``router_logits`` holds one ``[b * s, num_experts]`` tensor per MoE layer.
    ``reduce`` (optional) gets this process's token sums (``[2 * E + 1]``: assignments and
    probabilities per expert, the token count) before the means are taken: a differentiable
    sum over the ranks that split the rows (context parallel) makes the loss that of the whole
    rows on every rank, the same as one process's.

    Example::

        >>> logits = [torch.zeros(6, 4)]          # a perfectly uniform router
        >>> float(load_balancing_loss(logits, top_k=2))
        2.0
    """
    if not router_logits:
        raise ValueError("router_logits is empty: the model has no MoE layers")
    num_experts = router_logits[0].shape[-1]
    logits = torch.cat([layer.float() for layer in router_logits])
    probs = F.softmax(logits, dim=-1)
    chosen = torch.topk(probs, top_k, dim=-1).indices
    assignments = F.one_hot(chosen, num_experts).sum(dim=1).float()  # [rows, E]
    if attention_mask is None:
        weight = torch.ones(logits.shape[0], device=logits.device)
    else:
        weight = attention_mask.reshape(-1).float().to(logits.device).repeat(len(router_logits))
    sums = torch.cat(
        [
            (assignments * weight[:, None]).sum(0),
            (probs * weight[:, None]).sum(0),
            weight.sum()[None],
        ]
    )
    if reduce is not None:
        sums = reduce(sums)
    tokens, prob, total = sums.split([num_experts, num_experts, 1])
    return num_experts * ((tokens / total) * (prob / total)).sum()
