#!/usr/bin/env bash
# The paper's table on a lent GPU (an H200), tunesmith beside torchtune, in one command that
# ends within 9 minutes: benchmarks/gpu/paper_table.py prints its plan (rows, estimates, the
# total) and runs it within BUDGET_S (default 450 s), rewriting its report after every row.
# Writes into $OUT (the device tool's folder; benchmarks/results when unset):
# gpu_paper_table.md, gpu_paper_table.log (everything printed), gpu_paper_table_stderr.txt
# (the rows' processes) and nvidia_smi.txt.
#
# From the repository root:            bash benchmarks/gpu/run.sh [paper_table.py flags]
# Once, on a machine with PyPI, first:  bash benchmarks/gpu/run.sh --fetch-wheels
# (see benchmarks/gpu/README.md)
set -uo pipefail
cd "$(dirname "$0")/../.."
WHEELS=benchmarks/gpu/wheels  # git-ignored; carried to the GPU machine
PY="${PYTHON:-python3}"

if [ "${1:-}" = "--fetch-wheels" ]; then
  # pure-Python wheels for the GPU image's Python (3.12): tunesmith's missing imports and
  # torchao in tunesmith/, torchtune 0.6.1 and the torchao it was released with in torchtune/
  fetch() {
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$@" || exit 1
  }
  fetch "$WHEELS/tunesmith" omegaconf==2.4.0 torchdata==0.11.0 torchao==0.18.0
  fetch "$WHEELS/torchtune" torchtune==0.6.1 torchao==0.10.0
  du -sh "$WHEELS"
  exit 0
fi

OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
install() {  # $1: wheel folder, $2: target site
  if compgen -G "$1/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$2" "$1"/*.whl || return 1
  fi
}
install "$WHEELS/tunesmith" /tmp/site && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
TORCHTUNE_SITE=()
install "$WHEELS/torchtune" /tmp/torchtune_site && TORCHTUNE_SITE=(--torchtune-site /tmp/torchtune_site)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm \
  --format=csv >"$OUT/nvidia_smi.txt" 2>&1 || true
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'available', torch.cuda.is_available())" 2>&1 | tee "$OUT/gpu_paper_table.log"
# the script keeps to BUDGET_S by itself; the timeout is the backstop (report already written)
timeout "$(( ${BUDGET_S:-450} + 40 ))" "$PY" benchmarks/gpu/paper_table.py \
  --budget-s "${BUDGET_S:-450}" --out "$OUT/gpu_paper_table.md" "${TORCHTUNE_SITE[@]}" "$@" 2>&1 \
  | tee -a "$OUT/gpu_paper_table.log"
status=${PIPESTATUS[0]}
echo "paper_table.py exit status $status (124: stopped by the backstop timeout; the report" \
  "holds the rows done before it; 2: no CUDA device)"
exit "$status"
