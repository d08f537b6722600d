"""Compile kernels for Hopper (sm_90) offline, without a GPU: Triton's real compiler and ptxas, not the interpreter.

``python -m tests.compile_sm90`` (TRITON_INTERPRET unset) compiles every variant the batch-1 fused kernels are
launched with (:mod:`kernels.gemv`'s row kernel with each prologue, :mod:`kernels.gemv_qkv`) for the tuner's "row"
configs, head dims 64 and 128, and prints one line per variant: its registers and whether anything spilled to
local memory.  Exits 1 if a variant fails to compile or spills.  ``tests/test_gpu_fastpath.py`` runs it in CI.
"""

from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import gemv, gemv_qkv

HOPPER = GPUTarget("cuda", 90, 32)
ROW_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16",
           "rout_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32", "eps": "fp32"}
QKV_SIG = {"x_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16", "rout_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
           "qo_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "index_ptr": "*i64", "pos_ptr": "*i64", "cs_ptr": "*fp32",
           "K": "i32", "stride_wn": "i32", "eps": "fp32", "stride_kcb": "i32", "stride_kct": "i32", "stride_kch": "i32",
           "stride_vcb": "i32", "stride_vct": "i32", "stride_vch": "i32", "stride_cs": "i32", "H": "i32", "HKV": "i32"}


def variants():
    """(name, kernel, signature, constexprs, config) for every launch the fused batch-1 path can make."""
    for config in (c for c in gemv.CONFIGS if c[0] == "row"):
        _, block_n, block_k, _, _ = config
        for prologue, add in ((0, False), (1, True), (1, False), (2, False)):
            consts = dict(HAS_BIAS=prologue == 1, BLOCK_N=block_n, BLOCK_K=block_k, PROLOGUE=prologue, ADD=add)
            yield f"gemv_row prologue={prologue} add={add} {config}", gemv._gemv_row_kernel, ROW_SIG, consts, config
        for head_dim in (64, 128):
            pairs = gemv_qkv.rope_pairs(config, head_dim)
            for add in (True, False):
                consts = dict(D=head_dim, BLOCK_SIZE=16, PAIRS=pairs, BLOCK_K=block_k, HAS_BIAS=False, ADD=add)
                yield f"qkv_rope D={head_dim} add={add} {config}", gemv_qkv._qkv_rope_kernel, QKV_SIG, consts, config


def main() -> int:
    failed = 0
    for name, kernel, sig, consts, config in variants():
        signature = dict(sig, **{k: "constexpr" for k in consts})
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts), target=HOPPER,
                                      options=dict(num_warps=config[3], num_stages=config[4]))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the exit code says so
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
            failed += 1
            continue
        ptx = compiled.asm["ptx"]
        spills = len(re.findall(r"\.local\b", ptx))
        print(f"{'SPILL' if spills else 'ok'} {name}: cubin {len(compiled.asm['cubin'])} B")
        failed += bool(spills)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
