#!/usr/bin/env bash
# The host KV tier's GPU checks, one part per device call; results under $OUT.
#   T: GPU tests (bit-exact copies, 200 pipelined steps under sync debug mode, greedy parity with swaps and host hits)
#   A: TPOT at batch 64, 8B shape: tier off / backups on their stream / backups on the compute stream
#   S: swap vs recompute, 2,048-token contexts, small device pool
#   C: multi-turn chat, 200 conversations x 4 turns, device pool a quarter of the working set
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_host_kv.sh T|A|S|C
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
case "${1:-T}" in
  T) timeout 500 python3 -m pytest -q -x -p no:cacheprovider tests/test_host_kv_gpu.py tests/test_host_kv_model.py \
         -k "cuda or round_trip or synchronize" 2>&1 | tee "$OUT/host_kv_tests.log" | tail -5 ;;
  A) timeout 500 python3 scripts/bench_host_kv.py --mode tpot --json "$OUT/host_kv_tpot.json" 2>&1 | tail -16 ;;
  S) timeout 500 python3 scripts/bench_host_kv.py --mode swap --json "$OUT/host_kv_swap.json" 2>&1 | tail -20 ;;
  C) timeout 500 python3 scripts/bench_host_kv.py --mode chat --json "$OUT/host_kv_chat.json" 2>&1 | tail -20 ;;
  *) echo "usage: $0 T|A|S|C" >&2; exit 2 ;;
esac
