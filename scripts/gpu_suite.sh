#!/usr/bin/env bash
# The GPU tests and the figures of docs/performance.md, by part; each part fits a 10-minute run.
#
#   bash scripts/gpu_suite.sh PART [PART ...]      (on a machine with the GPUs, from the repository root)
#   bash scripts/gpu_suite.sh --dry-run PART|all   print the commands, run nothing
#
# Parts:
#   tests          GPU tests: fast path against the torch path, CUDA graphs, mixed-step graphs, batch invariance;
#                  every fused kernel variant compiled for sm_90
#   tests-kernels  kernel tests on the GPU (attention, GEMV, sampling, transfer), host KV tier, compile ahead
#   decode         batch-1 decode (1B, 8B), 2 and 4 rows (1B), 16 rows (1B, 8B), batch 64 (8B, default and
#                  --batch-invariant), prefill MFU (8B)
#   serve          1B server: b1, r10, r40 loads through the SDK (512 in / 128 out); 8B batch 1 from the client
#   idle           GPU idle between steps at batch 64 and SDK throughput, depths 0 and 1; the HF baseline
#   gateway        HTTP vs SDK streaming at 1 and 4 gateway workers, 4 client processes
#   prefix         prefix caching off / on, 1B and 8B
#   swap           host KV tier: swap resume vs recompute and device-only caching (8B, 64 requests)
#   chat           host KV tier: multi-turn chat, 512-token openings (8B); backups' cost on decode (tpot)
#   startup        8B start-up from an empty Triton cache and warm; executor restart (1B)
#   memory         the memory plan's GPU test (1B, 256 slots, every step kind), then bench_memory.py's matrix
#                  (--quick; the cells past its deadline are skipped)
#   kernels        kernel benchmarks: transfer, sampling, sampling step, prefill attention, the default model's
#                  shape's speculative verify step (K = 8), the FP8 W8A8 tiles with and without TMA (8B shapes)
#   tp             tensor and data parallelism on the GPUs present: the tests on CUDA, then bench_tp.py with its
#                  defaults (two GPUs: 8B at TP 1 and 2, 1B replicas at DP 1 and 2 and shared prefixes at DP 2;
#                  four: also 8B at TP 4 and the 70B shape at TP 4, which with the tests may pass 10 minutes)
#   allreduce      (two GPUs or more) the one-shot all-reduce: its tests (against NCCL, in replayed graphs, a
#                  TP=2 server), then one all-reduce of 1 KiB .. 1 MiB both ways and the TP=2 8B step with each
#   moe            the MoE kernels' GPU tests and tiles (bench_kernels.py moe), the Qwen3-30B-A3B shape at batch 1
#                  and 64, bf16 and FP8 experts; on two GPUs tensor against expert parallelism (TP=2 and EP=2)
#   fp8            FP8 weights and KV cache: their GPU tests, then bf16 against FP8 decode (1B, 8B batch 1 with a
#                  2,048-token prefill; 8B batch 64 with FP8 KV; 1B, 8 rows of 16k context, bf16 against FP8 KV;
#                  the 8B shape's decode attention alone at 16k, bf16 against FP8 KV)
#   spec           speculative decoding: bench_spec.py (verification's cost, the default model with n-gram drafts,
#                  the 8B shape with draft models, GPU idle at batch 64)
#
# Results (JSON, logs) go to $OUT (default /tmp/out).  Environment: PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
PY=${PYTHON:-python3}
DRY=0
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
PARTS="tests tests-kernels decode serve idle gateway prefix swap chat startup memory kernels tp allreduce moe fp8 spec"
CFG=scripts/configs

run() {  # echo a command, then run it unless --dry-run; a failure is reported, the part goes on
  echo "+ $*"
  [ "$DRY" = 1 ] && return 0
  "$@" || echo "FAILED ($?): $*"
}

wait_ready() {  # LOG PID: until the server logs "ready at" (or exits)
  [ "$DRY" = 1 ] && return 0
  for _ in $(seq 1 1200); do
    grep -q "ready at" "$1" && return 0
    kill -0 "$2" 2>/dev/null || { echo "the server exited:"; tail -20 "$1"; return 1; }
    sleep 0.5
  done
  return 1
}

SERVER=""
serve() {  # NAME FLAGS...: start forerun serve on ipc:///tmp/fr-NAME.sock and wait until it is ready
  local name=$1; shift
  echo "+ forerun serve --address ipc:///tmp/fr-$name.sock $* &"
  [ "$DRY" = 1 ] && return 0
  $PY -m scheduler_proc.launch serve --address "ipc:///tmp/fr-$name.sock" --quiet "$@" > "$OUT/serve_$name.log" 2>&1 &
  SERVER=$!
  wait_ready "$OUT/serve_$name.log" $SERVER
}

stop() { [ -n "$SERVER" ] && kill -TERM $SERVER && wait $SERVER 2>/dev/null; SERVER=""; }

versions() {
  [ "$DRY" = 1 ] && return 0
  $PY -c "import platform, torch, triton; print('Python', platform.python_version(), 'torch', torch.__version__,
'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" \
    | tee "$OUT/versions.txt"
}

part_tests() {
  run timeout 560 $PY -m pytest -q -p no:cacheprovider tests/test_gpu_fastpath.py tests/test_mixed_graphs.py \
      tests/test_batch_invariance.py
  run timeout 300 $PY -m tests.compile_sm90 --all  # every launch variant for sm_90 (CI compiles a covering quarter)
}

part_tests_kernels() {
  run timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_kernels_decode.py \
      tests/test_kernels_prefill.py tests/test_sampling_features.py tests/test_precompile.py
  run timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_transfer.py tests/test_host_kv_gpu.py
}

part_decode() {
  run timeout 150 $PY scripts/bench_decode.py --models llama-3.2-1b,llama-3-8b --batch 1 --json "$OUT/decode_b1.json"
  for b in 2 4; do
    run timeout 90 $PY scripts/bench_decode.py --models llama-3.2-1b --batch $b --json "$OUT/decode_1b_b$b.json"
  done
  run timeout 120 $PY scripts/bench_decode.py --models llama-3.2-1b,llama-3-8b --batch 16 --steps 100 \
      --json "$OUT/decode_b16.json"
  run timeout 120 $PY scripts/bench_decode.py --models llama-3-8b --batch 64 --context 512 --json "$OUT/decode_b64.json"
  run timeout 120 $PY scripts/bench_decode.py --models llama-3-8b --batch 64 --context 512 --batch-invariant \
      --json "$OUT/decode_b64_inv.json"
  run timeout 120 $PY scripts/bench_kernels.py mixed-step --model llama-3-8b --cases 0x2048,16x1024 \
      --json "$OUT/prefill_mfu.json"
}

bench_serve() {  # NAME TAG FLAGS...
  local name=$1 tag=$2; shift 2
  run $PY scripts/bench_serve.py --address "ipc:///tmp/fr-$name.sock" --input-len 512 --output-len 128 --seed 1 \
      --no-progress --json "$OUT/serve_${name}_$tag.json" "$@"
}

part_serve() {
  serve 1b --device cuda --load-format dummy --model $CFG/llama-3.2-1b --step-log "$OUT/steps_1b.jsonl" || return
  bench_serve 1b b1 --concurrency 1 --num-requests 8 --warmup 1
  bench_serve 1b r40 --request-rate 40 --num-requests 400 --warmup 4
  bench_serve 1b r10 --request-rate 10 --num-requests 120 --warmup 2
  stop
  serve 8b --device cuda --load-format dummy --model $CFG/llama-3-8b || return
  bench_serve 8b b1 --concurrency 1 --num-requests 8 --warmup 1
  stop
}

part_idle() {
  run timeout 400 $PY scripts/bench_overlap.py --executor cuda --depths 0 1 --throughput --json "$OUT/idle.json"
  run timeout 180 $PY scripts/bench_hf_baseline.py --engines forerun,hf --json "$OUT/hf_baseline.json"
}

part_gateway() {
  for w in 1 4; do
    serve gw$w --device cuda --load-format dummy --model $CFG/llama-3.2-1b --max-num-seqs 256 \
        --port $((8000 + w)) --api-workers $w || continue
    local k=0
    for run in sdk openai openai-ka sdk openai openai-ka sdk; do
      local extra=""; [ $run = openai-ka ] && extra="--http-keep-alive"; k=$((k + 1))
      run timeout 60 $PY scripts/bench_serve.py --backend "${run%-ka}" --address "ipc:///tmp/fr-gw$w.sock" \
          --base-url "http://127.0.0.1:$((8000 + w))" --num-requests 256 --concurrency 256 --input-len 128 \
          --output-len 128 --warmup 8 --client-procs 4 --no-progress $extra --json "$OUT/gateway_w${w}_${k}_$run.json"
    done
    stop
  done
}

part_prefix() {
  for m in llama-3.2-1b llama-3-8b; do
    run timeout 280 $PY scripts/bench_host_kv.py --mode prefix --model $CFG/$m --json "$OUT/prefix_$m.json"
  done
}

part_swap() {
  run timeout 560 $PY scripts/bench_host_kv.py --mode swap --swap-requests 64 --json "$OUT/host_kv_swap64.json"
}

part_chat() {
  run timeout 380 $PY scripts/bench_host_kv.py --mode chat --first-len 512 --json "$OUT/host_kv_chat512.json"
  run timeout 180 $PY scripts/bench_host_kv.py --mode tpot --json "$OUT/host_kv_tpot.json"
}

part_startup() {
  run timeout 400 $PY scripts/bench_startup.py --model $CFG/llama-3-8b --warm --json "$OUT/startup_8b.json"
  run timeout 150 $PY scripts/bench_reliability.py restart --kills 2 --json "$OUT/restart_1b.json" -- \
      --device cuda --load-format dummy --model $CFG/llama-3.2-1b
}

part_memory() {
  run timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_memory_plan_gpu.py
  run timeout 380 $PY scripts/bench_memory.py --quick --deadline-s 200 --json "$OUT/memory.json"
}

part_kernels() {
  run timeout 150 $PY scripts/bench_kernels.py transfer --json "$OUT/transfer.json"
  run timeout 120 $PY scripts/bench_kernels.py sampling --json "$OUT/sampling.json"
  run timeout 150 $PY scripts/bench_kernels.py sampling-step --json "$OUT/sampling_step.json"
  run timeout 120 $PY scripts/bench_kernels.py prefill-attention --json "$OUT/prefill_attention.json"
  run timeout 120 $PY scripts/bench_kernels.py spec --model smollm2-135m --batches 1,2,16 --k 8 \
      --json "$OUT/spec_verify_default_shape.json"
  for tma in 1 0; do  # the W8A8 tiles through TMA descriptors, then with per-thread loads
    run env FORERUN_FP8_TMA=$tma timeout 90 $PY scripts/bench_kernels.py w8a8 --ms 64,128,256,2048 \
        --json "$OUT/w8a8_tma$tma.json"
  done
}

part_tp() {
  run timeout 300 $PY -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py
  run timeout 540 $PY scripts/bench_tp.py --json "$OUT/tp.json"
}

part_allreduce() {
  run timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_one_shot_all_reduce.py
  run timeout 330 $PY scripts/bench_tp.py --parts allreduce,tp --sizes 2 --all-reduce nccl one-shot --requests 0 \
      --json "$OUT/allreduce.json"
}

part_moe() {
  run timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_moe.py
  run timeout 150 $PY scripts/bench_kernels.py moe --json "$OUT/moe_kernels.json"
  for b in 1 64; do
    run timeout 150 $PY scripts/bench_decode.py --models qwen3-30b-a3b --batch $b --quantization none,fp8 \
        --json "$OUT/moe_b$b.json"
  done
  if [ "$DRY" = 1 ] || [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    run timeout 150 $PY scripts/bench_tp.py --parts tp --model $CFG/qwen3-30b-a3b --sizes 2 --requests 0 \
        --json "$OUT/moe_tp2.json"
    run timeout 150 $PY scripts/bench_tp.py --parts tp --model $CFG/qwen3-30b-a3b --sizes 2 --requests 0 \
        --server-flag=--enable-expert-parallel --json "$OUT/moe_ep2.json"
  fi
}

part_fp8() {
  run timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_fp8_kv.py tests/test_fp8_checkpoint.py
  run timeout 150 $PY scripts/bench_decode.py --models llama-3.2-1b,llama-3-8b --batch 1 --quantization none,fp8 \
      --steps 100 --prefill 2048 --json "$OUT/fp8_b1.json"
  run timeout 90 $PY scripts/bench_decode.py --models llama-3-8b --batch 64 --steps 50 --json "$OUT/fp8_b64_bf16.json"
  run timeout 90 $PY scripts/bench_decode.py --models llama-3-8b --batch 64 --quantization fp8 --kv-cache-dtype fp8 \
      --steps 50 --json "$OUT/fp8_b64_fp8.json"
  for kv in auto fp8; do
    run timeout 90 $PY scripts/bench_decode.py --models llama-3.2-1b --batch 8 --context 16384 --steps 50 \
        --kv-cache-dtype $kv --json "$OUT/fp8_16k_kv_$kv.json"
  done
  run timeout 90 $PY scripts/bench_kernels.py decode-attention --cases 8b:1:16384,8b:8:16384,8b:32:16384,8b:64:512 \
      --kv-dtypes bf16,fp8 --splits 16 --block-n 64 --warps-stages 4x3 --json "$OUT/fp8_attention_16k.json"
}

part_spec() {
  run timeout 560 $PY scripts/bench_spec.py --json "$OUT/spec.json"
}

if [ $# = 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit 0
fi
if [ "$1" = --dry-run ]; then DRY=1; shift; fi
[ "${1:-}" = all ] && set -- $PARTS
mkdir -p "$OUT"
trap stop EXIT
versions
for part in "$@"; do
  case " $PARTS " in *" $part "*) ;; *) echo "unknown part: $part (one of: $PARTS)" >&2; exit 2 ;; esac
  echo "== $part"
  start=$SECONDS
  "part_${part//-/_}"
  echo "== $part took $((SECONDS - start)) s"
done
