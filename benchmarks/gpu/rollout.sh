#!/usr/bin/env bash
# The rollout benchmark on a lent GPU (an H200), in one command that ends within 8 minutes:
# benchmarks/rollout.py on CUDA with bf16 weights (and so bf16 paged caches), the compiled
# decode step with CUDA graphs (mode "reduce-overhead"), transformers' generate (which compiles
# itself on CUDA with its static cache), the GRPO recipe under bf16 autocast, and the random
# Qwen3-0.6B-shaped model at batch 64 and 256. Writes into $OUT (the device tool's folder;
# benchmarks/results when unset): rollout_cuda.md (rewritten after each section, so a run cut
# short keeps what it measured), rollout_cuda.log and nvidia_smi.txt.
#
# From the repository root:  bash benchmarks/gpu/rollout.sh   (see benchmarks/gpu/README.md)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
# Packages the GPU image lacks (omegaconf, torchdata), carried as wheels in .whl (README.md).
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm \
  --format=csv >"$OUT/nvidia_smi.txt" 2>&1 || true
# 450 s for the benchmark itself: the wheels, the start and the copy back fit in the rest.
timeout "${BUDGET_S:-450}" "${PYTHON:-python3}" benchmarks/rollout.py --device cuda \
  --dtype bfloat16 --qwen-batches 64 256 --keep-going --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/rollout_cuda.log"
status=${PIPESTATUS[0]}
echo "rollout.py exit status $status (124: stopped at the time budget; the report holds the" \
  "sections done before it)"
exit "$status"
