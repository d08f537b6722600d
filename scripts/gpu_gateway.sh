#!/usr/bin/env bash
# HTTP vs SDK streaming throughput through W gateway workers (issue 10's targets). One server
# (Llama-3.2-1B shape, random bf16 weights, --max-num-seqs 256) serves every W: for each W, W
# gateway workers start beside it on their own port (scripts/_gateways.py: the same start_gateways()
# as `forerun serve --port P --api-workers W`), so the executor starts and compiles once.
# For each W, in order, RUNS of bench_serve.py (256 requests x 128 in / 128 out, all at once, greedy,
# 8 warm-up requests) over CLIENT_PROCS client processes; a run is BACKEND[@PROCS]:
#   sdk        the SDK (the reference),
#   openai     HTTP, a new connection per request (as a client without a pool),
#   openai-ka  HTTP on kept-alive connections opened during the warm-up (a pooling client, a proxy).
# WARMUP (default: 4 runs) goes first, on the first W only: it fills the prefix cache, and on a fresh
# machine it meets the kernels' compile stalls (0.3 to 1.4 s, seen up to the fifth run). HTTP / SDK
# divides an HTTP run by the median of the W's sdk runs (at CLIENT_PROCS). Also: the client's CPU over
# its measured run (its busiest process; near 1 the client may be the limit) and the gateway workers'
# CPU seconds per bench process (/proc, warm-up included).
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_gateway.sh [W ...]   (default: 1 2 4);
# DEADLINE_S=N skips the W that would start after N seconds. CPU check:
#   SERVE_ARGS="--load-format scripted --scripted-step-ms 3" OUT=/tmp/gw bash scripts/gpu_gateway.sh 1
# Writes $OUT/gateway_runs.json (every run's figures), $OUT/runs.tgz (logs), $OUT/serve.log,
# $OUT/versions.txt; prints a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/runs"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
SERVE_ARGS=${SERVE_ARGS:---device cuda --load-format dummy --model scripts/configs/llama-3.2-1b}
WARMUP=${WARMUP:-sdk openai-ka sdk openai}
RUNS=${RUNS:-sdk openai openai-ka sdk openai openai-ka sdk openai@1}
CLIENT_PROCS=${CLIENT_PROCS:-4}
PORT=${PORT:-8000}
ADDR=ipc:///tmp/fr-gw-$PORT.sock
ticks() { local t=0 p; for p in "$@"; do set -- $(cut -d' ' -f14,15 "/proc/$p/stat"); t=$((t + $1 + $2)); done; echo $t; }

(python3 -c "import platform, torch, uvicorn, starlette, msgspec, zmq, httptools
print('Python', platform.python_version(), 'torch', torch.__version__, 'uvicorn', uvicorn.__version__, 'starlette',
      starlette.__version__, 'msgspec', msgspec.__version__, 'pyzmq', zmq.__version__, 'httptools', httptools.__version__)"
 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; grep -m1 "model name" /proc/cpuinfo; nproc
) > "$OUT/versions.txt" 2>&1 &
python3 -m scheduler_proc.launch serve $SERVE_ARGS --max-num-seqs 256 --address "$ADDR" --quiet > "$OUT/serve.log" 2>&1 &
SRV=$!
trap 'kill $SRV 2>/dev/null; [ -n "${GW:-}" ] && kill $GW 2>/dev/null' EXIT
for _ in $(seq 1 600); do
  grep -q "ready at" "$OUT/serve.log" && break
  kill -0 $SRV 2>/dev/null || { echo "the server exited:"; tail -5 "$OUT/serve.log"; exit 1; }
  sleep 0.5
done
echo "server ready after ${SECONDS}s"

first=1
for W in ${@:-1 2 4}; do
  if [ -n "${DEADLINE_S:-}" ] && [ "$SECONDS" -gt "$DEADLINE_S" ]; then echo "W=$W skipped: past DEADLINE_S"; continue; fi
  P=$((PORT + W)); rm -f "$OUT/gw$W.pids"
  python3 scripts/_gateways.py "$ADDR" "$P" "$W" "$OUT/gw$W.pids" > "$OUT/runs/gateways_w$W.log" 2>&1 &
  GW=$!
  for _ in $(seq 1 240); do [ -s "$OUT/gw$W.pids" ] && break; kill -0 $GW 2>/dev/null || break; sleep 0.25; done
  [ -s "$OUT/gw$W.pids" ] || { echo "W=$W: the gateways did not start:"; tail -5 "$OUT/runs/gateways_w$W.log"; continue; }
  GWS=$(cat "$OUT/gw$W.pids")
  runs=$RUNS; [ $first = 1 ] && runs="$WARMUP $RUNS"
  nwarm=0; [ $first = 1 ] && nwarm=$(echo $WARMUP | wc -w)
  k=0
  for run in $runs; do
    k=$((k + 1)); name="w${W}_$k"; backend=${run%@*}; procs=$CLIENT_PROCS
    [ "$run" != "$backend" ] && procs=${run#*@}
    extra=""; [ "$backend" = openai-ka ] && extra="--http-keep-alive"
    g0=$(ticks $GWS)
    timeout 40 python3 scripts/bench_serve.py --backend "${backend%-ka}" --address "$ADDR" --base-url "http://127.0.0.1:$P" \
        --num-requests 256 --concurrency 256 --input-len 128 --output-len 128 --warmup 8 --no-progress \
        --client-procs "$procs" $extra --json "$OUT/runs/$name.json" > "$OUT/runs/bench_$name.log" 2>&1
    echo "{\"w\": $W, \"k\": $k, \"run\": \"$run\", \"warmup\": $([ $k -le $nwarm ] && echo true || echo false), " \
         "\"gateway_ticks\": $(( $(ticks $GWS) - g0 ))}" > "$OUT/runs/$name.meta"
  done
  echo "W=$W done at ${SECONDS}s"
  kill $GW; wait $GW 2>/dev/null; GW=""
  first=0
done
kill $SRV; wait $SRV 2>/dev/null

python3 - "$OUT" "$(getconf CLK_TCK)" <<'EOF'
import glob, json, os, statistics, sys
out, hz = sys.argv[1], int(sys.argv[2])
runs = []
for meta in glob.glob(os.path.join(out, "runs", "*.meta")):
    m = json.load(open(meta))
    path = meta[:-len(".meta")] + ".json"
    d = json.load(open(path)) if os.path.exists(path) else {}
    runs.append(dict(m, gateway_cpu_s=m.pop("gateway_ticks") / hz, figures=d))
runs.sort(key=lambda r: (r["w"], r["k"]))
json.dump(runs, open(os.path.join(out, "gateway_runs.json"), "w"), indent=1)
print(f"{'W':>2} {'run':>3} {'backend':12} {'tok/s':>8} {'time':>7} {'TTFT p50':>9} {'TPOT p50':>9} "
      f"{'client cpu':>10} {'gw cpu':>7} {'HTTP/SDK':>8}")
for w in sorted({r["w"] for r in runs}):
    mine = [r for r in runs if r["w"] == w]
    sdk = [r["figures"]["output_throughput"] for r in mine
           if r["run"] == "sdk" and not r["warmup"] and r["figures"].get("failed") == 0]
    ref = statistics.median(sdk) if sdk else float("nan")
    for r in mine:
        d = r["figures"]
        if not d:
            print(f"{w:>2} {r['k']:>3} {r['run']:12} failed: see runs/bench_w{w}_{r['k']}.log")
            continue
        ratio = ""
        if r["run"] != "sdk" and not r["warmup"]:
            r["http_over_sdk"] = d["output_throughput"] / ref
            ratio = f"{r['http_over_sdk']:8.2f}"
        tag = r["run"] + ("*" if r["warmup"] else "") + (f" ({d['failed']} failed)" if d["failed"] else "")
        print(f"{w:>2} {r['k']:>3} {tag:12} {d['output_throughput']:8.0f} {d['duration_s']:6.3f}s "
              f"{d['ttft_ms']['p50']:7.1f}ms {d['tpot_ms']['p50']:7.2f}ms {d['client_cpu_fraction']:10.2f} "
              f"{r['gateway_cpu_s']:6.2f}s {ratio}")
json.dump(runs, open(os.path.join(out, "gateway_runs.json"), "w"), indent=1)
print("* warm-up run (no ratio)")
EOF
tar czf "$OUT/runs.tgz" -C "$OUT" runs && rm -rf "$OUT/runs" "$OUT"/gw*.pids
