#!/usr/bin/env bash
# The host KV tier's GPU checks; results under $OUT (at most 8 files come back from a device call: one log,
# one JSON per benchmark, the step logs in one tarball). Several parts run in sequence in one call, each
# under its own timeout and all inside BUDGET_S seconds (a part with less than its MIN_S left is skipped).
#   D: the onload alone (scripts/bench_onload.py): 12 GiB vs 256 MiB pool, launch shapes, beside a backup burst
#      or matmuls, HostKV.stage's host time; pinned allocations idle/busy; kernel variants per index alignment
#   T: GPU tests (bit-exact copies and a bf16 swap, 200 pipelined steps under sync debug mode,
#      greedy parity of swapped / host-hit requests, fp32) and the transfer kernel's tests
#   G: backup granularity in one worker, 8B shape, batch 64: per block (burst, spread) vs per token row,
#      backup stream (few programs, every program) vs compute stream; each launch alone
#   A: TPOT at batch 64, 8B shape, through the server: tier off / backups on their stream / on the compute stream
#   S: swap vs recompute, 2,048-token contexts, small device pool
#   C: multi-turn chat, 200 conversations x 4 turns, device pool a quarter of the working set (CHAT_ARGS: extra
#      bench flags, e.g. "--arrival lockstep"; default: independent conversations, think time 2.5 s)
# Usage (on the GPU machine, from the repo root): BUDGET_S=570 bash scripts/gpu_host_kv.sh T G S C A
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/scripts:${PYTHONPATH:-}"
LOG="$OUT/host_kv.log"
T0=$SECONDS; BUDGET_S=${BUDGET_S:-570}
STEPS=/tmp/host_kv_steps; rm -rf "$STEPS"
bench() {  # $1: limit, $2: mode, $3: JSON name, then extra flags
  timeout "$1" python3 scripts/bench_host_kv.py --mode "$2" --json "$OUT/$3" --step-log-dir "$STEPS" "${@:4}" \
    >> "$LOG" 2>&1
}
run_part() {  # $1: part, $2: its own limit in seconds
  local left=$(( BUDGET_S - (SECONDS - T0) )) limit=$2 t=$SECONDS
  (( left < limit )) && limit=$left
  if (( left < ${MIN_S[$1]:-45} )); then echo "== $1 skipped: ${left}s left" | tee -a "$LOG"; return; fi
  echo "== $1 (limit ${limit}s)" >> "$LOG"
  case $1 in
    D) timeout "$limit" python3 scripts/bench_onload.py --json "$OUT/host_kv_onload.json" >> "$LOG" 2>&1
       tail -5 "$LOG" ;;
    T) timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/test_host_kv_gpu.py tests/test_transfer.py \
           >> "$LOG" 2>&1
       timeout $(( limit - (SECONDS - t) )) python3 -m pytest -q -p no:cacheprovider tests/test_host_kv_model.py \
           -k cuda >> "$LOG" 2>&1
       grep -E "^(FAILED|ERROR)|passed|failed" "$LOG" | tail -6 ;;
    G) timeout "$limit" python3 scripts/bench_backup_granularity.py --json "$OUT/host_kv_granularity.json" \
           >> "$LOG" 2>&1; tail -21 "$LOG" ;;
    A) bench "$limit" tpot host_kv_tpot.json; tail -12 "$LOG" ;;
    S) bench "$limit" swap host_kv_swap.json; tail -27 "$LOG" ;;
    C) bench "$limit" chat host_kv_chat.json ${CHAT_ARGS:-}; tail -19 "$LOG" ;;
    *) echo "unknown part $1 (D T G A S C)" >&2 ;;
  esac
  echo "== $1 took $(( SECONDS - t ))s" | tee -a "$LOG"
}
declare -A LIMIT=([D]=90 [T]=200 [G]=120 [A]=120 [S]=180 [C]=300)
declare -A MIN_S=([D]=45 [S]=90 [C]=110)  # a part that cannot finish is not started
for part in "$@"; do run_part "$part" "${LIMIT[$part]:-200}"; done
[ -d "$STEPS" ] && tar czf "$OUT/host_kv_steps.tar.gz" -C "$STEPS" .
