#!/usr/bin/env bash
# --batch-invariant on the GPU: the bit-identity tests, then what the mode costs per decode step
# (1B shape at batch 1 and 64, 8B at batch 1; default kernels vs batch-invariant, same call). JSON under $OUT.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_invariant.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_batch_invariance.py 2>&1 | tee "$OUT/invariant_tests.log" | tail -3
for b in 1 64; do
  for mode in "" --batch-invariant; do
    timeout 150 python3 scripts/bench_decode.py --models llama-3.2-1b --batch $b --steps 100 $mode \
        --json "$OUT/decode_1b_b${b}${mode:+_inv}.json" 2>&1 | grep -A2 "^model" | tail -1
  done
done
for mode in "" --batch-invariant; do timeout 150 python3 scripts/bench_decode.py --models llama-3-8b --batch 1 --steps 100 $mode \
    --json "$OUT/decode_8b_b1${mode:+_inv}.json" 2>&1 | grep -A2 "^model" | tail -1; done
