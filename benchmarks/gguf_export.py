"""GGUF export: logits of the file (read back by transformers' GGUF loader) against ours, file
sizes and export time, for every exported family and out type.

Each family is a random model of ``--hidden`` (4 layers, Gemma 3 6; 8 heads, 4 KV heads) with a
byte-level BPE tokenizer of the family's kind (the test suite's tokenizer factory), written
with :func:`tunesmith.models.gguf_export.export_gguf` and loaded by
``transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)`` in float32.
Logits: 4 rows of 64 random ids; the max and the mean |difference| against our float32 model,
and their ratio to the logits' own standard deviation (families transformers' reader does not
read, :data:`LLAMA_CPP_ONLY`, leave those columns empty). With ``--llama-cpp`` (the ``llama-cpp``
extra installed) llama.cpp itself loads each file too (``llama_cpp.Llama``, CPU) and its logits
on the same rows get the same three columns. Writes ``results/gguf_export.md``.

Usage::

    PYTHONPATH=. python benchmarks/gguf_export.py --llama-cpp
    PYTHONPATH=. python benchmarks/gguf_export.py --hidden 256 --out /tmp/gguf_export.md
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import transformers  # noqa: E402
from machine_info import command_line, machine  # noqa: E402

from tests.data.tokenizer_factory import make_tokenizer_folder  # noqa: E402
from tunesmith.data import Tokenizer  # noqa: E402
from tunesmith.models import build_model  # noqa: E402
from tunesmith.models.gguf_export import OUTTYPES, export_gguf  # noqa: E402
from tunesmith.models.hf import from_hf, save_hf_checkpoint  # noqa: E402
from tunesmith.models.zoo import (  # noqa: E402
    deepseek_v2,
    deepseek_v3,
    gemma2,
    gemma3,
    glm4,
    glm4_moe,
    gpt_oss,
    granite,
    llama3,
    llama4,
    mixtral,
    olmo2,
    olmo3,
    phi3,
    qwen2_5,
    qwen3,
    qwen3_moe,
    smollm3,
)
from tunesmith.modules.mla import MLAConfig  # noqa: E402
from tunesmith.modules.routers import DeepSeekRouting  # noqa: E402

# family -> (zoo module, tokenizer family, spec overrides): transformers' GGUF reader takes
# Qwen3's head_dim from its config class (128) and reads no RoPE scaling
FAMILIES = {
    "llama": (llama3, "llama3", {"rope_scaling": None}),
    "qwen2": (qwen2_5, "qwen2_5", {}),
    "qwen3": (qwen3, "qwen3", {"head_dim": 128}),
    "qwen3_moe": (qwen3_moe, "qwen3", {"head_dim": 128, "moe_intermediate_size": 768,
                                       "mlp_only_layers": (), "norm_topk_prob": True}),
    "phi3": (phi3, "phi4", {"rope_scaling": None, "partial_rotary_factor": 1.0}),
    # the reader scales attention by query_pre_attn_scalar's default (256), llama.cpp by
    # 1/sqrt(head_dim): a head of 256; Gemma 3 in llama.cpp's pattern (5 window layers, 1 global)
    "gemma2": (gemma2, "llama3", {"head_dim": 256, "attention_multiplier": 1 / 16}),
    "gemma3": (gemma3, "llama3", {"head_dim": 256, "attention_multiplier": 1 / 16,
                                  "num_hidden_layers": 6, "layer_types":
                                  ("sliding_attention",) * 5 + ("full_attention",)}),
    "mixtral": (mixtral, "llama3", {"sliding_window": None}),
    "olmo2": (olmo2, "olmo2", {}),
    "olmo3": (olmo3, "olmo2", {}),
    "granite": (granite, "llama3", {}),
    "smollm3": (smollm3, "llama3", {"nope_layers": (3,)}),
    "glm4": (glm4, "llama3", {}),
    # OLMo 3's YaRN (factor 8 past 16 positions) on its global layer only
    "olmo3_yarn": (olmo3, "olmo2", {"rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16},
        "rope_local_theta": olmo3.spec("olmo3_tiny").rope_theta}),
    # llama.cpp's deepseek2: latent attention (kv_lora_rank 128, 64 + 32 features per query
    # head, values of 64; V3 with a low-rank query of 192), 8 experts of 384, 2 shared,
    # layer 0 dense; V2 softmax top-2 unnormalised, V3 sigmoid top-2 within the best 2 of 4
    # groups, renormalised
    "deepseek_v2": (deepseek_v2, "llama3", {
        "num_key_value_heads": 8, "head_dim": 32, "mla": MLAConfig(None, 128, 64, 32, 64),
        "mlp_only_layers": (0,),
        "num_experts": 8, "moe_intermediate_size": 384,
        "moe_routing": DeepSeekRouting("greedy", 1, 1, 1.5, 2)}),
    "deepseek_v3": (deepseek_v3, "llama3", {
        "num_key_value_heads": 8, "head_dim": 32, "mla": MLAConfig(192, 128, 64, 32, 64),
        "mlp_only_layers": (0,),
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384,
        "moe_routing": DeepSeekRouting("noaux_tc", 4, 2, 2.5, 2)}),
    # GLM-4.5: 6 experts of 384 (top 2 within the best of 2 groups), 2 shared, layer 0 dense,
    # RoPE on half of each head
    "glm4_moe": (glm4_moe, "llama3", {"moe_intermediate_size": 384, "mlp_only_layers": (0,),
                                      "partial_rotary_factor": 0.5}),
    # gpt-oss: sinks, a window of 4 on every other layer, 5 experts of 384 (top 3) with
    # biases, YaRN truncated as llama.cpp computes it (gpt-oss's own, truncate false, is refused)
    "gpt_oss": (gpt_oss, "llama3", {
        "intermediate_size": 384, "moe_intermediate_size": 384,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 128},
        "layer_types": ("sliding_attention", "full_attention") * 2}),
    # Llama 4 as llama.cpp's llama4 fixes it: chunks of 8192 on layers 0-2, layer 3 without RoPE
    # (its temperature), Scout's llama3 RoPE scaling, 4 experts of 384 (top 1) and a shared one
    # on layers 1 and 3
    "llama4_text": (llama4, "llama3", {
        "nope_layers": (3,), "layer_types": ("chunked_attention",) * 3 + ("full_attention",),
        "attention_chunk_size": 8192, "floor_scale": 8192.0, "attn_scale": 0.1,
        "max_position_embeddings": 16384, "mlp_only_layers": (0, 2), "num_experts": 4,
        "moe_intermediate_size": 384,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
}  # fmt: skip
LLAMA_CPP_ONLY = ("mixtral", "olmo2", "olmo3", "granite", "smollm3", "glm4", "olmo3_yarn",
                  "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4_text")  # fmt: skip
"""Families transformers' GGUF reader does not read (gpt-oss: not compared by it here):
llama.cpp's columns only."""
DEFAULTS = {
    "hidden": 512,
    "llama_cpp": False,
    "families": list(FAMILIES),
    "out": str(REPO / "benchmarks" / "results" / "gguf_export.md"),
}


def model_folder(root: Path, family: str, hidden: int) -> Path:
    zoo, tokenizer_family, overrides = FAMILIES[family]
    tokenizer_dir = make_tokenizer_folder(root / "tokenizer", tokenizer_family)
    sizes = {
        "vocab_size": Tokenizer.from_pretrained(tokenizer_dir).vocab_size,
        "hidden_size": hidden, "intermediate_size": hidden * 3, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": hidden // 8,
    }  # fmt: skip
    if zoo in (gemma2, gemma3):  # Gemma scales its embeddings by sqrt(hidden)
        sizes["embedding_multiplier"] = hidden**0.5
    if zoo is mixtral:  # its experts are intermediate_size wide
        sizes["moe_intermediate_size"] = sizes["intermediate_size"]
    torch.manual_seed(0)
    name = f"{zoo.__name__.rsplit('.', 1)[-1]}_tiny"
    model = build_model(zoo.spec(name, **{**sizes, **overrides}))
    return save_hf_checkpoint(model, root / "model", source_dir=tokenizer_dir)


def gaps(theirs: torch.Tensor, ours: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """The max and mean |difference| of two logit tensors, and the max over ours' std."""
    gap = (theirs - ours).abs()
    return {f"{prefix}max": gap.max().item(), f"{prefix}mean": gap.mean().item(),
            f"{prefix}max_rel": gap.max().item() / ours.std().item()}  # fmt: skip


def llama_cpp_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """llama.cpp's logits of the GGUF file ``path`` on each row of ``ids`` (a fresh context
    per row), ``[rows, length, vocab]``."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), logits_all=True, n_ctx=ids.shape[1], verbose=False, seed=0
    )
    rows = []
    for row in ids.tolist():
        llm.reset()
        llm.eval(row)
        rows.append(torch.tensor(llm.scores[: len(row)]))
    llm.close()
    return torch.stack(rows)


def measure(
    folder: Path, outtype: str, ids: torch.Tensor, llama_cpp: bool, transformers_reads: bool
) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = export_gguf(folder, Path(tmp) / "model.gguf", outtype=outtype)
        seconds = time.perf_counter() - start
        size = path.stat().st_size
        with torch.no_grad():
            b = from_hf(folder, dtype=torch.float32)(ids)
        result = {"size_mb": size / 2**20, "export_s": seconds}
        if transformers_reads:
            theirs = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, gguf_file=path.name, dtype=torch.float32
            )
            with torch.no_grad():
                result.update(gaps(theirs(ids).logits, b))
        if llama_cpp:
            result.update(gaps(llama_cpp_logits(path, ids), b, prefix="cpp_"))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    parser.add_argument("--llama-cpp", action="store_true", help="llama.cpp's logits too")
    parser.add_argument("--out", default=DEFAULTS["out"])
    parser.add_argument(
        "--families", nargs="+", default=DEFAULTS["families"], choices=list(FAMILIES),
        help="measure these; the other families' rows of --out are kept as they are",
    )  # fmt: skip
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            folder = model_folder(Path(tmp) / family, family, args.hidden)
            vocab = from_hf(folder).spec.vocab_size
            ids = torch.randint(0, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
            params = sum(p.numel() for p in from_hf(folder).parameters())
            for outtype in OUTTYPES:
                reads = family not in LLAMA_CPP_ONLY
                result = measure(folder, outtype, ids, args.llama_cpp, reads)
                rows.append((family, params, outtype, result))
                print(family, outtype, result, flush=True)
    lines = [
        "# GGUF export: read back by transformers (and llama.cpp) against ours",
        "",
        f"`{command_line('benchmarks/gguf_export.py', args, DEFAULTS, skip=['out'])}`",
        "",
        f"- Machine: {machine()}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, gguf {importlib.metadata.version('gguf')}"
        f"{_llama_cpp_version(args)}; run {time.strftime('%Y-%m-%d')}.",
        f"- Models: random, hidden {args.hidden}, 4 layers, 8 heads / 4 KV heads, the family's "
        "byte-level BPE tokenizer of the test suite (vocabulary ~640; Llama 3's for Gemma, "
        "GLM-4, Granite, SmolLM3 and Mixtral); Qwen3 at head_dim 128 "
        "(transformers' GGUF reader takes it from its config class), Llama without RoPE "
        "scaling (the reader ignores `rope_freqs`); Qwen3-MoE: 8 experts of 768 (the reader's "
        "default width), top 2 renormalised, every layer sparse; Phi-3 rotating whole heads "
        "without LongRoPE; Gemma 2 and 3 at head_dim 256 (the reader's attention scale), "
        "their tiny window of 4, Gemma 3 with 6 layers (llama.cpp's fixed pattern: 5 window "
        "layers, 1 global); SmolLM3 without RoPE on its 4th layer; Mixtral (5 experts, top 3) "
        "without its window; OLMo 3 with its tiny window of 4 on 3 layers of 4. transformers' "
        "reader reads no "
        f"{', '.join(LLAMA_CPP_ONLY)}: their transformers columns are empty. "
        "OLMo 3 with YaRN (factor 8 past 16 positions) on its global layer; DeepSeek-V2/V3 as "
        "llama.cpp's deepseek2 (latent attention: kv_lora_rank 128, 64 + 32 features per "
        "query head, values of 64, V3 with a low-rank query of 192; 8 experts of 384, 2 shared, "
        "layer 0 dense; V2 softmax top-2 unnormalised, V3 sigmoid top-2 within the best 2 of 4 "
        "groups); GLM-4.5 (6 experts of 384, top 2 of the best of 2 groups, RoPE on half of "
        "each head); gpt-oss (sinks, a window of 4 on every other layer, 5 experts of 384, "
        "top 3, YaRN truncated as llama.cpp computes it); Llama 4 text as llama.cpp's llama4 "
        "(chunks of 8192 on layers 0-2, layer 3 without RoPE, Scout's llama3 RoPE scaling, 4 "
        "experts of 384, top 1, and a shared one on layers 1 and 3; these 64-token rows stay "
        "in the first chunk: `tests/models/test_gguf_llama_cpp.py` runs 8300 tokens).",
        "- Logits: 4 rows of 64 random ids, our float32 model against transformers' model of "
        "the file (dequantised to float32); `max / std`: the max difference over the "
        "standard deviation of our logits. In the mixture of experts a rounding that moves a "
        "token's router scores across a top-k tie sends it to another expert: its logits then "
        "differ by a whole expert's contribution (the max), while the mean stays near the dense "
        "families'.",
        *_llama_cpp_note(args),
        *_kept_note(args),
        "",
        "| family | parameters | outtype | file MiB | export s | max \\|Δ logit\\| "
        "| mean \\|Δ logit\\| | max / std |" + _LLAMA_CPP_HEAD * args.llama_cpp,
        "|---|---:|---|---:|---:|---:|---:|---:|" + "---:|---:|---:|" * args.llama_cpp,
    ]
    kept = kept_rows(Path(args.out), set(FAMILIES) - set(args.families))
    for family, params, outtype, r in rows:
        read = (
            f"{r['max']:.2e} | {r['mean']:.2e} | {r['max_rel']:.2e}" if "max" in r else "— | — | —"
        )
        cpp = (
            f" {r['cpp_max']:.2e} | {r['cpp_mean']:.2e} | {r['cpp_max_rel']:.2e} |"
            if args.llama_cpp
            else ""
        )
        kept[family].append(
            f"| {family} | {params:,} | {outtype} | {r['size_mb']:.2f} | {r['export_s']:.2f} "
            f"| {read} |" + cpp
        )
    lines += [row for family in FAMILIES for row in kept[family]]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


def _kept_note(args: argparse.Namespace) -> list[str]:
    if list(args.families) == list(FAMILIES):
        return []
    return [
        f"- This run measured {', '.join(args.families)}; the other families' rows are those of "
        "the file's earlier run (the same shapes and machine, without `--families`)."
    ]


def kept_rows(path: Path, families: set[str]) -> dict[str, list[str]]:
    """The table rows of ``families`` in the results file ``path`` (a run of some families
    keeps the others' rows), per family of :data:`FAMILIES`.

    Example::

        kept_rows(Path("results/gguf_export.md"), {"llama"})["llama"][0]  # '| llama | ...'
    """
    kept: dict[str, list[str]] = {family: [] for family in FAMILIES}
    if not path.is_file():
        return kept
    for line in path.read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[1].strip() in families:
            kept[cells[1].strip()].append(line)
    return kept


_LLAMA_CPP_HEAD = " llama.cpp max \\|Δ\\| | llama.cpp mean \\|Δ\\| | llama.cpp max / std |"


def _llama_cpp_version(args: argparse.Namespace) -> str:
    if not args.llama_cpp:
        return ""
    return f", llama-cpp-python {importlib.metadata.version('llama-cpp-python')}"


def _llama_cpp_note(args: argparse.Namespace) -> list[str]:
    if not args.llama_cpp:
        return []
    return [
        "- llama.cpp columns: the same rows through llama.cpp itself (`llama_cpp.Llama` with "
        "its defaults, CPU backend, a fresh context per row) against our float32 model. Its "
        "f32 row is not 0: llama.cpp keeps the KV cache in f16 by default (with an f32 cache "
        "a tiny Qwen2's f32 file gave 3e-6); its CPU matmuls with f16 and q8_0 weights also "
        "round the activations (to f16; to 8-bit blocks), which transformers' reader does not "
        "(it dequantises to float32). The Qwen3-MoE bf16 and q8_0 maxima are the top-k ties "
        "above, and so are Mixtral's (5 experts, top 3; its f32 file too: llama.cpp's f16 KV "
        "cache rounds the router's input: with an f32 cache the f32 file gave 3e-6 / std; its "
        "f16 row happens to keep every choice), and so are the maxima of DeepSeek-V2/V3, "
        "GLM-4.5, gpt-oss and Llama 4 above 0.05 / std (their means stay near the dense families'; "
        "gpt-oss's f32 file too, through the f16 KV cache: `tests/models/test_gguf_llama_cpp.py` "
        "compares them from f32 files with an f32 cache, below 1e-4 / std). "
        "`tests/models/test_gguf_llama_cpp.py` (`make "
        "test-llama-cpp`) checks f16 and q8_0 logits, the tokenizer and the chat template on "
        "tiny models."
    ]


if __name__ == "__main__":
    main()
