#!/usr/bin/env bash
# One device call of the GPU checks for this wave. Part A: GPU tests and decode step times.
# Part B: executor restart time, prefix-cache TTFT, HTTP vs SDK throughput. Part C: HTTP vs SDK
# throughput, the GPU tests of the sampling features, the batch-64 feature step. Results under $OUT.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_wave.sh A|B|C
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
CFG=scripts/configs
part=${1:-A}
if [ "$part" = A ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fastpath.py tests/test_kernels.py \
      tests/test_sampling_features.py 2>&1 | tee "$OUT/tests.log" | tail -4
  timeout 200 python3 scripts/bench_decode.py --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | grep -A3 "^model"
  exit 0
fi
http_vs_sdk() {  # $1: gateway workers (scripts/gpu_gateway.sh: SDK and HTTP alternating on one server)
  bash scripts/gpu_gateway.sh "$1" 2>&1 | tail -10
}
if [ "$part" = C ]; then
  http_vs_sdk 1; http_vs_sdk 4
  timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fastpath.py 2>&1 | tee "$OUT/tests.log" | tail -3
  timeout 80 python3 scripts/bench_sampling_step.py --json "$OUT/sampling_step.json" 2>&1 | tail -12
  exit 0
fi
timeout 150 python3 scripts/bench_restart.py --kills 2 --json "$OUT/restart_1b.json" -- --device cuda \
    --load-format dummy --model $CFG/llama-3.2-1b 2>&1 | tail -6
for m in llama-3.2-1b llama-3-8b; do
  timeout 200 python3 scripts/bench_prefix.py --device cuda --load-format dummy --model $CFG/$m \
      --json "$OUT/prefix_$m.json" 2>&1 | tail -6
done
http_vs_sdk 1; http_vs_sdk 4
