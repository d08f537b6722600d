#!/usr/bin/env bash
# A/B of the decode step on a GPU: this tree against a baseline checkout in .base (make it with
# `git worktree add --detach .base <commit>`; carry ".base" to the device), alternating in one call.
#   MODELS="llama-3.2-1b:2 llama-3-8b:1"  configs under scripts/configs and rounds of each (default)
#   BATCH=1  CONTEXT=512  STEPS=200       passed to scripts/bench_decode.py (BATCH="1 2 4": each in turn)
#   TESTS="..."                           pytest node ids run first on this tree (default none)
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_decode_ab.sh   JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD; SITE=${PYTHONPATH:-}
MODELS=${MODELS:-"llama-3.2-1b:2 llama-3-8b:1"}; BATCH=${BATCH:-1}; CONTEXT=${CONTEXT:-512}; STEPS=${STEPS:-200}
[ -d .base/kernels ] || { echo "no .base checkout: git worktree add --detach .base <commit>" >&2; exit 2; }
if [ -n "${TESTS:-}" ]; then
  PYTHONPATH="$ROOT:$SITE" timeout 300 python3 -m pytest -q -p no:cacheprovider $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -8
fi
for run in $MODELS; do
  model=${run%:*}; rounds=${run#*:}
  for round in $(seq "$rounds"); do
    for batch in $BATCH; do
      for side in base new; do
        tree=$ROOT; [ $side = base ] && tree=$ROOT/.base
        (cd "$tree" && PYTHONPATH="$tree:$SITE" timeout 170 python3 scripts/bench_decode.py --models "$model" \
            --batch "$batch" --context "$CONTEXT" --steps "$STEPS" \
            --json "$OUT/decode_${model}_b${batch}_r${round}_${side}.json" 2>&1 | grep -A2 "^model" | tail -1 \
            | sed "s/^/$side r$round  /")
      done
    done
  done
done
