#!/usr/bin/env bash
# One device call for the GPU fast path: its GPU tests, the decode benchmark (with per-kernel profile),
# greedy parity with the eager path, and (SKIP_HF unset) throughput vs HF transformers. Results under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
LOG="$OUT/all.log"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
timeout ${T_TEST:-170} python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fastpath.py 2>&1 | tee -a "$LOG" | tail -25
timeout ${T_DECODE:-150} python3 scripts/bench_decode.py --json "$OUT/decode.json" --profile "$OUT/profile" 2>&1 | tee -a "$LOG"
timeout ${T_PARITY:-90} python3 scripts/bench_gpu_parity.py --json "$OUT/parity.json" 2>&1 | tee -a "$LOG"
[ -z "${SKIP_HF:-}" ] && timeout ${T_HF:-150} python3 scripts/bench_hf_baseline.py --engines "${HF_ENGINES:-forerun,hf}" --json "$OUT/throughput.json" 2>&1 | tee -a "$LOG"
echo "=== summary ==="
grep -E "passed|failed|error" "$LOG" | tail -3
grep -A4 "^model " "$LOG" | tail -5
grep -A3 "^dtype " "$LOG" | tail -3
grep -A4 "^engine " "$LOG" | tail -4
