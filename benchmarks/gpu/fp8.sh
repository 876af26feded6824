#!/usr/bin/env bash
# FP8 training against bf16 on a lent GPU (an H200), in one command that ends within 5 minutes:
# benchmarks/fp8.py on CUDA: a random Qwen3-0.6B-shaped model, 50 AdamW steps of 8 x 1024
# generated tokens with bf16 weights and fp32 masters, plain bf16 then precision.matmuls
# fp8_rowwise and fp8_tensorwise (torchao float8), each decoder layer compiled; the loss of
# each against bf16's (mean relative difference over the last 10 steps within 2%) and the
# tokens/s of each. Writes into $OUT (the device tool's folder; benchmarks/results when unset):
# fp8_cuda.md (rewritten after each mode, so a run cut short keeps what it measured),
# fp8_cuda.log and nvidia_smi.txt. Exit status: 0 all within tolerance, 1 a mode failed or
# drifted, 2 the GPU is older than compute capability 8.9, 124 the time budget.
#
# From the repository root:  bash benchmarks/gpu/fp8.sh   (see benchmarks/gpu/README.md)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
# Packages the GPU image lacks (omegaconf, torchdata, torchao), carried as wheels in .whl.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm \
  --format=csv >"$OUT/nvidia_smi.txt" 2>&1 || true
# 270 s for the benchmark itself: the wheels, the start and the copy back fit in the rest.
timeout "${BUDGET_S:-270}" "${PYTHON:-python3}" benchmarks/fp8.py --device cuda \
  --out "$OUT/fp8_cuda.md" "$@" 2>&1 | tee "$OUT/fp8_cuda.log"
status=${PIPESTATUS[0]}
echo "fp8.py exit status $status (124: stopped at the time budget; the report holds the" \
  "modes done before it)"
exit "$status"
