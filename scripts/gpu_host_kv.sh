#!/usr/bin/env bash
# The host KV tier's GPU checks; results under $OUT. Several parts run in sequence in one device call, each
# under its own timeout and all inside BUDGET_S seconds (a part with under 45 s left is skipped).
#   T: GPU tests (bit-exact copies and a bf16 swap, 200 pipelined steps under sync debug mode,
#      greedy parity of swapped / host-hit requests, fp32) and the transfer kernel's tests
#   G: backup granularity in one worker, 8B shape, batch 64: per block (burst, spread) vs per token row,
#      own stream vs compute stream
#   A: TPOT at batch 64, 8B shape, through the server: tier off / backups on their stream / on the compute stream
#   S: swap vs recompute, 2,048-token contexts, small device pool
#   C: multi-turn chat, 200 conversations x 4 turns, device pool a quarter of the working set
# Usage (on the GPU machine, from the repo root): BUDGET_S=570 bash scripts/gpu_host_kv.sh T G A
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/scripts:${PYTHONPATH:-}"
T0=$SECONDS; BUDGET_S=${BUDGET_S:-570}
run_part() {  # $1: part, $2: its own limit in seconds
  local left=$(( BUDGET_S - (SECONDS - T0) )) limit=$2
  (( left < limit )) && limit=$left
  if (( limit < 45 )); then echo "== $1 skipped: ${left}s left"; return; fi
  local t=$SECONDS
  case $1 in
    T) timeout $limit python3 -m pytest -q -p no:cacheprovider tests/test_host_kv_gpu.py tests/test_transfer.py \
           > "$OUT/host_kv_tests.log" 2>&1
       timeout $(( limit - (SECONDS - t) )) python3 -m pytest -q -p no:cacheprovider tests/test_host_kv_model.py \
           -k cuda >> "$OUT/host_kv_tests.log" 2>&1
       grep -E "passed|failed|error" "$OUT/host_kv_tests.log" | tail -4 ;;
    G) timeout $limit python3 scripts/bench_backup_granularity.py --json "$OUT/host_kv_granularity.json" \
           > "$OUT/host_kv_granularity.log" 2>&1; tail -9 "$OUT/host_kv_granularity.log" ;;
    A) timeout $limit python3 scripts/bench_host_kv.py --mode tpot --json "$OUT/host_kv_tpot.json" \
           > "$OUT/host_kv_tpot.log" 2>&1; tail -13 "$OUT/host_kv_tpot.log" ;;
    S) timeout $limit python3 scripts/bench_host_kv.py --mode swap --json "$OUT/host_kv_swap.json" \
           > "$OUT/host_kv_swap.log" 2>&1; tail -22 "$OUT/host_kv_swap.log" ;;
    C) timeout $limit python3 scripts/bench_host_kv.py --mode chat --json "$OUT/host_kv_chat.json" \
           > "$OUT/host_kv_chat.log" 2>&1; tail -18 "$OUT/host_kv_chat.log" ;;
    *) echo "unknown part $1 (T G A S C)" >&2 ;;
  esac
  echo "== $1 took $(( SECONDS - t ))s"
}
declare -A LIMIT=([T]=200 [G]=150 [A]=260 [S]=220 [C]=240)
for part in "$@"; do run_part "$part" "${LIMIT[$part]:-200}"; done
