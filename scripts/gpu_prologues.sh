#!/usr/bin/env bash
# The batch-1 fused norm / SiLU-mul matmuls (kernels/gemv.py gemv_prologue) on the GPU: the fast-path
# tests (the kernel against the reference ops, graphs vs eager with the tuner's picks), then the batch-1
# decode step with the fusions and without (--no-prologues), 1B and 8B shapes, alternating, same call.
# JSON (with what the tuner timed and chose per weight) under $OUT.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_prologues.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fastpath.py 2>&1 | tee "$OUT/fastpath_tests.log" | tail -3
for model in llama-3.2-1b llama-3-8b; do
  for round in 1 2; do
    for mode in --no-prologues ""; do
      timeout 150 python3 scripts/bench_decode.py --models $model --batch 1 --steps 200 $mode \
          --json "$OUT/decode_${model}_r${round}${mode:+_unfused}.json" 2>&1 | grep -A2 "^model" | tail -1
    done
  done
done
