#!/bin/bash
# On the GPU machine, from the repository root (PYTHONPATH set to it): the prefill kernel tests (bf16 and
# fp32), then the new kernel against main's copy under kernels_main/ (if present), optional sweep.
#   scripts/gpu_prefill_attention.sh OUT_DIR [--sweep]
set -u
out=${1:?out dir}; shift
mkdir -p "$out"
python3 -m pytest -q -x tests/test_kernels_prefill.py -p no:cacheprovider 2>&1 | tail -15 | tee "$out/tests.log"
old=""
[ -f kernels_main/prefill_attention.py ] && old="--old kernels_main.prefill_attention"
python3 scripts/bench_prefill_attention.py $old --ttgir "$out/ttgir" --json "$out/bench_prefill.json" "$@" \
  2>&1 | tee "$out/bench.log" | tail -40
