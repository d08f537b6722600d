#!/usr/bin/env bash
# On a GPU machine (issue 13, graphs for every step), one call: the mixed-step graph tests, then
# Poisson serving of 512-token prompts (1B shape, random weights) with mixed graphs on and off,
# the 8B shape's start-up with every graph, and the batch-1 decode step. Results go to $OUT.
#   TESTS="..."   pytest node ids (default: the mixed-step and fast-path GPU tests; "none" skips them)
#   CASES="..."   servers as NAME:FLAG,FLAG,... (default "on: off:--mixed-graphs,off"; "none": no server)
#   LOADS="..."   b1 r10 r40 (default all);  SKIP_8B=1 / SKIP_DECODE=1  skip the 8B start-up / bench_decode
#   MIXED_STEP=MODEL  also time one mixed step graph vs eager (scripts/bench_mixed_step.py), with its kernels
# Everything lands in $OUT/results.tgz (one file: the device tool brings back only a few).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-/tmp/out}; OUT="$FINAL/results"; mkdir -p "$OUT"
TESTS=${TESTS:-"tests/test_mixed_graphs.py tests/test_gpu_fastpath.py tests/test_kernels.py::test_prefill_attention_work_tiles"}
CASES=${CASES:-"on: off:--mixed-graphs,off"}
LOADS=${LOADS:-"b1 r40 r10"}
[ "$CASES" = none ] && CASES=""
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

if [ "$TESTS" != none ]; then
  stamp "GPU tests"
  timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short $TESTS > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -5
fi

if [ -n "${MIXED_STEP:-}" ]; then  # e.g. MIXED_STEP=llama-3.2-1b: one mixed step, graph vs eager, and its kernels
  stamp "bench_mixed_step $MIXED_STEP"
  timeout 200 python3 scripts/bench_mixed_step.py --model "$MIXED_STEP" --json "$OUT/mixed_step_$MIXED_STEP.json" \
      --profile "$OUT/mixed_step_$MIXED_STEP.kernels" > "$OUT/mixed_step_$MIXED_STEP.log" 2>&1
  tail -6 "$OUT/mixed_step_$MIXED_STEP.log"
fi

SERVER=""
serve() {  # NAME CONFIG FLAGS...: start a server, wait until it is ready, print its start-up lines
  local name=$1 model=$2; shift 2
  local t=$(date +%s.%N)
  FORERUN_TUNER_LOG="$OUT/tuner_$name.json" \
  python3 -m scheduler_proc.launch serve --device cuda --load-format dummy --model "scripts/configs/$model" \
      --address "ipc:///tmp/fr-$name.sock" --quiet --step-log "$OUT/steps_$name.jsonl" "$@" > "$OUT/serve_$name.log" 2>&1 &
  SERVER=$!
  until grep -q "ready at" "$OUT/serve_$name.log"; do
    kill -0 $SERVER 2>/dev/null || { echo "$name: server exited"; tail -20 "$OUT/serve_$name.log"; SERVER=""; return 1; }
    sleep 0.2
  done
  stamp "$name ready after $(python3 -c "print(round($(date +%s.%N) - $t, 1))") s"
  grep -E "serving|CUDA graphs" "$OUT/serve_$name.log"
}
stop() { [ -n "$SERVER" ] && kill -TERM $SERVER && wait $SERVER 2>/dev/null; SERVER=""; }
bench() {  # NAME TAG FLAGS...
  local name=$1 tag=$2; shift 2
  python3 scripts/bench_serve.py --address "ipc:///tmp/fr-$name.sock" --input-len 512 --output-len 128 \
      --no-progress --seed 1 --json "$OUT/serve_${name}_$tag.json" "$@" > "$OUT/bench_${name}_$tag.log" 2>&1 \
    || { echo "$name $tag failed"; tail -5 "$OUT/bench_${name}_$tag.log"; }
}

declare -A LOAD_FLAGS=([b1]="--concurrency 1 --num-requests 8 --warmup 1"
                        [r40]="--request-rate 40 --num-requests 400 --warmup 4"
                        [r10]="--request-rate 10 --num-requests 120 --warmup 2")
for case in $CASES; do
  name=${case%%:*}; IFS=, read -ra flags <<< "${case#*:}"
  if serve $name llama-3.2-1b "${flags[@]}"; then
    for load in $LOADS; do bench $name $load ${LOAD_FLAGS[$load]}; done
    stop
  fi
  stamp "$name done"
done

if [ -z "${SKIP_8B:-}" ]; then
  serve 8b llama-3-8b && stop
fi

if [ -z "${SKIP_DECODE:-}" ]; then
  stamp "bench_decode 1B"
  timeout 120 python3 scripts/bench_decode.py --models llama-3.2-1b --json "$OUT/decode_b1.json" > "$OUT/decode.log" 2>&1
  tail -3 "$OUT/decode.log" | head -2
fi

python3 - "$OUT" "$CASES" <<'EOF'
import json, os, sys
out, names = sys.argv[1], [c.split(":")[0] for c in sys.argv[2].split()]
print(f"{'server':<6}{'load':<5}{'ok':>5}{'TPOT p50':>10}{'p99':>7}{'ITL p50':>9}{'p90':>7}{'p99':>7}{'TTFT p50':>10}{'p99':>8}")
for name in names:
    for tag in ("b1", "r10", "r40"):
        path = os.path.join(out, f"serve_{name}_{tag}.json")
        if not os.path.exists(path):
            continue
        m = json.load(open(path))
        t, i, f = m["tpot_ms"], m["itl_ms"], m["ttft_ms"]
        print(f"{name:<6}{tag:<5}{m['completed']:>5}{t['p50']:>10.3f}{t['p99']:>7.2f}{i['p50']:>9.3f}{i['p90']:>7.2f}"
              f"{i['p99']:>7.2f}{f['p50']:>10.1f}{f['p99']:>8.1f}")
for name in names:
    path = os.path.join(out, f"steps_{name}.jsonl")
    if not os.path.exists(path):
        continue
    steps = [json.loads(line) for line in open(path)]
    kinds = {"all": steps, "decode": [s for s in steps if not s["num_prefill"]],
             "decode+backup": [s for s in steps if not s["num_prefill"] and s["num_backups"]],
             "prefill<=512": [s for s in steps if 0 < s["num_prefill"] <= 512],
             "prefill>512": [s for s in steps if s["num_prefill"] > 512]}
    for kind, group in kinds.items():
        busy = sorted(s["gpu_busy_s"] * 1e3 for s in group)
        if not busy:
            continue
        q = lambda p: busy[min(len(busy) - 1, int(p * len(busy)))]  # noqa: E731
        host = {k: sorted(s[k] * 1e3 for s in group) for k in ("prepare_s", "launch_s")}
        h = lambda k, p: host[k][min(len(group) - 1, int(p * len(group)))]  # noqa: E731
        print(f"steps {name} {kind:<14}{len(busy):>6}  GPU ms p50 {q(.5):.3f} p90 {q(.9):.3f} p99 {q(.99):.3f} "
              f"max {busy[-1]:.2f}; {sum(b > 4.0 for b in busy)} over 4 ms; host ms prepare p50 "
              f"{h('prepare_s', .5):.3f} p90 {h('prepare_s', .9):.3f}, launch p50 {h('launch_s', .5):.3f} "
              f"p90 {h('launch_s', .9):.3f}; gc in {sum(s.get('gc_s', 0) > 0 for s in group)} steps")
    # The host's relay between GPU steps, decode steps: result sent -> scheduler has it; planning; plan sent ->
    # executor has it (idle_s is the executor's wait for it).
    relay = [s for s in kinds["decode"] if s.get("t_recv")]
    if relay:
        parts = {"result": sorted((s["t_recv"] - s["t_end"]) * 1e3 for s in relay),
                 "plan": sorted(s["plan_s"] * 1e3 for s in relay),
                 "to executor": sorted((s["t_start"] - s["t_sent"]) * 1e3 for s in relay)}
        print(f"relay {name} " + "; ".join(
            f"{k} ms p50 {v[len(v) // 2]:.3f} p90 {v[int(.9 * len(v))]:.3f}" for k, v in parts.items()))
EOF
tar czf "$FINAL/results.tgz" -C "$OUT" . && rm -rf "$OUT"
stamp "all done"
