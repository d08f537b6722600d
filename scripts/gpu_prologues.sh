#!/usr/bin/env bash
# The batch-1 fused kernels (kernels/gemv_row.py gemv_prologue, kernels/gemv_qkv.py qkv_rope) on the GPU.
#   T: the fast-path tests (the kernels against the reference ops; graphs vs eager with the tuner's picks;
#      the sync-debug decode loop)
#   B: the batch-1 decode step with the fusions and without (--no-prologues), alternating in one call:
#      1B shape twice each, 8B once each.  JSON (with the tuner's timings and picks per weight) under $OUT.
#   P: the same with programmatic dependent launch off (FORERUN_PDL=0) and on (the default on Hopper).
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_prologues.sh T|B|P   (each fits one 600 s call)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
case "${1:-}" in
  T) timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fastpath.py 2>&1 | tee "$OUT/fastpath_tests.log" | tail -3 ;;
  B) for run in llama-3.2-1b:1 llama-3.2-1b:2 llama-3-8b:1; do
       model=${run%:*}; round=${run#*:}
       for mode in --no-prologues ""; do
         timeout 150 python3 scripts/bench_decode.py --models $model --batch 1 --steps 200 $mode \
             --json "$OUT/decode_${model}_r${round}${mode:+_unfused}.json" 2>&1 | grep -A2 "^model" | tail -1
       done
     done ;;
  P) for run in llama-3.2-1b:1 llama-3.2-1b:2 llama-3-8b:1; do
       model=${run%:*}; round=${run#*:}
       for pdl in 0 1; do
         FORERUN_PDL=$pdl timeout 150 python3 scripts/bench_decode.py --models $model --batch 1 --steps 200 \
             --json "$OUT/decode_${model}_r${round}_pdl${pdl}.json" 2>&1 | grep -A2 "^model" | tail -1
       done
     done ;;
  *) echo "usage: bash scripts/gpu_prologues.sh T|B|P" >&2; exit 2 ;;
esac
