#!/usr/bin/env bash
# One device call of the GPU checks for this wave. Part A: GPU tests and decode step times.
# Part B: executor restart time, prefix-cache TTFT, HTTP vs SDK throughput. Results under $OUT.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_wave.sh A|B
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
timeout 150 python3 scripts/bench_restart.py --kills 2 --json "$OUT/restart_1b.json" -- --device cuda \
    --load-format dummy --model $CFG/llama-3.2-1b 2>&1 | tail -6
for m in llama-3.2-1b llama-3-8b; do
  timeout 200 python3 scripts/bench_prefix.py --device cuda --load-format dummy --model $CFG/$m \
      --json "$OUT/prefix_$m.json" 2>&1 | tail -6
done
for W in 1 4; do
  ADDR=ipc:///tmp/fr-gw-$W.sock
  python3 -m scheduler_proc.launch serve --device cuda --load-format dummy --model $CFG/llama-3.2-1b \
      --max-num-seqs 256 --port 8000 --api-workers $W --address $ADDR --quiet > "$OUT/serve_w$W.log" 2>&1 &
  SRV=$!
  for _ in $(seq 1 240); do python3 - <<'PY' 2>/dev/null && break; sleep 0.5; done
import urllib.request; urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=1)
PY
  for backend in sdk openai; do
    timeout 120 python3 scripts/bench_serve.py --backend $backend --address $ADDR --base-url http://127.0.0.1:8000 \
        --num-requests 256 --concurrency 256 --input-len 128 --output-len 128 --warmup 8 --no-progress \
        --json "$OUT/serve_${backend}_w$W.json" 2>&1 | grep -iE "throughput|tok/s" | head -3
  done
  kill $SRV; wait $SRV 2>/dev/null
done
