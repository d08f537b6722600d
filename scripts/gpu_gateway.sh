#!/usr/bin/env bash
# HTTP vs SDK streaming throughput through W gateway workers (issue 10's targets), one fresh server
# per W (Llama-3.2-1B shape, random bf16 weights, --max-num-seqs 256). On each server, in order:
# RUNS (default: SDK and HTTP alternating, SDK first and last) of bench_serve.py with 256 requests
# x 128 in / 128 out, all at once, greedy, 8 warm-up requests. The first SKIP runs (default 4) are
# warm-up: they fill the prefix cache, and on the first server of a fresh machine they compile
# kernels for the shapes they meet (stalls of 0.3 to 1.4 s, seen up to the fifth run). HTTP / SDK
# divides an HTTP run by the median of the later SDK runs on the same server. Also: the client's
# CPU over its measured run (client cpu: fraction of the run's wall time; near 1 the client may be
# the limit) and the gateway workers' CPU seconds per bench process (/proc, warm-up included).
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_gateway.sh [W ...]   (default: 1 2);
# DEADLINE_S=N skips the W that would start after N seconds.
# Writes $OUT/serve_<backend>_w<W>_<k>.json, serve and bench logs; prints a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
SERVE_ARGS=${SERVE_ARGS:---device cuda --load-format dummy --model scripts/configs/llama-3.2-1b}  # CPU check:
# SERVE_ARGS="--load-format scripted --scripted-step-ms 3" OUT=/tmp/gw bash scripts/gpu_gateway.sh 1
RUNS=${RUNS:-sdk openai sdk openai sdk openai sdk openai sdk}
PORT=${PORT:-8000}
SKIP=${SKIP:-4}
ticks() { local t=0 p; for p in "$@"; do set -- $(cut -d' ' -f14,15 "/proc/$p/stat"); t=$((t + $1 + $2)); done; echo $t; }

for W in ${@:-1 2}; do
  if [ -n "${DEADLINE_S:-}" ] && [ "$SECONDS" -gt "$DEADLINE_S" ]; then echo "W=$W skipped: past DEADLINE_S"; continue; fi
  ADDR=ipc:///tmp/fr-gw-$PORT-$W.sock
  python3 -m scheduler_proc.launch serve $SERVE_ARGS --max-num-seqs 256 \
      --port "$PORT" --api-workers "$W" --address "$ADDR" --quiet > "$OUT/serve_w$W.log" 2>&1 &
  SRV=$!
  for _ in $(seq 1 300); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null && break
    kill -0 $SRV 2>/dev/null || { echo "W=$W: the server exited:"; tail -5 "$OUT/serve_w$W.log"; continue 2; }
    sleep 0.5
  done
  GWS=$(pgrep -P $SRV -f ipc.gateway.process | tr '\n' ' ')
  k=0
  for backend in $RUNS; do
    k=$((k + 1)); name="w${W}_$k"
    g0=$(ticks $GWS)
    timeout 90 python3 scripts/bench_serve.py --backend "$backend" --address "$ADDR" --base-url "http://127.0.0.1:$PORT" \
        --num-requests 256 --concurrency 256 --input-len 128 --output-len 128 --warmup 8 --no-progress \
        --json "$OUT/serve_${backend}_$name.json" > "$OUT/bench_${backend}_$name.log" 2>&1
    echo "$(( $(ticks $GWS) - g0 ))" > "$OUT/gateway_ticks_$name.txt"
  done
  kill $SRV; wait $SRV 2>/dev/null
done

python3 - "$OUT" "$(getconf CLK_TCK)" "$SKIP" <<'EOF'
import glob, json, os, re, statistics, sys
out, hz, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {}
for path in glob.glob(os.path.join(out, "serve_*_w*_*.json")):
    backend, w, k = re.match(r"serve_(\w+?)_w(\d+)_(\d+)\.json", os.path.basename(path)).groups()
    d = json.load(open(path))
    ticks = open(os.path.join(out, f"gateway_ticks_w{w}_{k}.txt")).read().strip()
    d["gateway_cpu_s"] = int(ticks) / hz
    json.dump(d, open(path, "w"), indent=1)
    rows[(int(w), int(k))] = (backend, d)
print(f"{'W':>2} {'run':>3} {'backend':7} {'tok/s':>8} {'time':>7} {'TTFT p50':>9} {'TPOT p50':>9} {'client cpu':>10} "
      f"{'gw cpu':>7} {'HTTP/SDK':>8}")
for w in sorted({w for w, _ in rows}):
    runs = sorted((k, b, d) for (ww, k), (b, d) in rows.items() if ww == w)
    sdk = [d["output_throughput"] for k, b, d in runs if b == "sdk" and k > skip]
    ref = statistics.median(sdk) if sdk else float("nan")
    for k, b, d in runs:
        ratio = f"{d['output_throughput'] / ref:8.2f}" if b == "openai" and k > skip else ""
        print(f"{w:>2} {k:>3} {b:7} {d['output_throughput']:8.0f} {d['duration_s']:6.3f}s {d['ttft_ms']['p50']:7.1f}ms "
              f"{d['tpot_ms']['p50']:7.2f}ms {d.get('client_cpu_fraction', float('nan')):10.2f} "
              f"{d['gateway_cpu_s']:6.2f}s {ratio}")
EOF
