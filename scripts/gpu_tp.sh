#!/usr/bin/env bash
# Tensor parallelism on a machine with two GPUs (nvidia-h200-x2), one part per device call; results under $OUT.
#   T: the TP tests on CUDA: float32 TP=2 vs TP=1 token for token with NCCL all-reduces inside CUDA graphs,
#      a killed rank (NCCL peer gone) restarting the group exactly, and failing every client in 2 s without restarts
#   B: the issue's figures, 8B shape, bf16: batch-1 decode step TP=2 vs TP=1 (target <= 60%), GPU idle at
#      batch 64 depth 1 (target <= 2% at TP=2), 256 x 128/128 throughput through the SDK
#   D: B's decode and idle phases only (no throughput), if B does not fit one call
# NCCL_NVLS_ENABLE=0 (and the other multicast switches) are set by the server in every process it starts;
# they are set here too, for the test process itself.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_tp.sh T|B|D
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c 'import torch; n = torch.cuda.device_count(); print("GPUs:", n); assert n >= 2, "needs two GPUs"' || exit 1
case "${1:-T}" in
  T) timeout 500 python3 -m pytest -q -x -p no:cacheprovider -rs tests/test_tensor_parallel.py -k cuda \
         2>&1 | tee "$OUT/tp_tests.log" | tail -8 ;;
  B) timeout 580 python3 scripts/bench_tp.py --device cuda --model scripts/configs/llama-3-8b --sizes 1 2 \
         --json "$OUT/tp_8b.json" 2>&1 | grep -v "^  server:" | tail -12 ;;
  D) timeout 580 python3 scripts/bench_tp.py --device cuda --model scripts/configs/llama-3-8b --sizes 1 2 \
         --requests 0 --json "$OUT/tp_8b_decode_idle.json" 2>&1 | grep -v "^  server:" | tail -12 ;;
  *) echo "usage: $0 T|B|D" >&2; exit 2 ;;
esac
