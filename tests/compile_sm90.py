"""Compile kernels for Hopper (sm_90) offline, without a GPU: Triton's real compiler and ptxas, not the interpreter.

:func:`variants` lists every variant the batch-1 fused kernels are launched with (:mod:`kernels.gemv`'s row kernel
with each prologue, its 2-8-row form, the "dot" form with and without the SiLU epilogue and the "dotT" form,
:mod:`kernels.gemv_qkv` with the norm and at 1-8 rows without, in both forms) for the tuner's configs, head dims 64
and 128, as the H100 runs them (with programmatic dependent launch, :mod:`kernels.pdl`), the split-KV decode
attention kernel whose last split merges, the tiled matmul, SiLU-mul and rotary/KV-write kernels (PDL, no
weight prefetch), the MoE kernels and the tensor-parallel one-shot all-reduce; :func:`fp8_variants` the same
kernels on FP8 weights and an FP8 KV cache; :func:`w8a8_variants` the FP8 W8A8 matmul above 8 rows, per-thread
loads and TMA tensor descriptors, at the tuner's tiles.  Each compiled variant prints one line: its size and
whether anything spilled to local memory.  Exits 1 if a variant fails to compile,
spills, or breaks PDL's rule in its PTX (a store before ``griddepcontrol.wait``, or no wait), or if the decode
kernel's arrival is not a CTA barrier followed by a GPU-scope acquire-release atomic.

``python -m tests.compile_sm90`` (TRITON_INTERPRET unset) compiles :func:`covering`: every kernel at every config
in its heaviest variant (largest head dim, most rows, every epilogue on), plus one variant of each other flag set
(about a third of them), the CI test's run (``tests/test_gpu_fastpath.py``).  ``--all`` compiles every variant
(``scripts/gpu_suite.sh tests``).
"""

from __future__ import annotations

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import (activation, all_reduce, decode_attention, gemv, gemv_partials, gemv_qkv, gemv_row, kv_write,
                     matmul, matmul_fp8, moe, moe_route)

HOPPER = GPUTarget("cuda", 90, 32)
ROW_SIG = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16",
           "rout_ptr": "*bf16", "N": "i32", "K": "i32", "stride_wn": "i32", "eps": "fp32"}
ROWS_SIG = dict({n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr")}, ss_ptr="*fp32",
                **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_rm")})
DOT_SIG = dict({n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr", "r_ptr")}, ss_ptr="*fp32",
               **{n: "i32" for n in ("M", "N", "K", "P", "stride_xm", "stride_wn", "stride_ym", "stride_rm")},
               eps="fp32")
QKV_ROWS_SIG = dict({n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "qo_ptr", "kc_ptr", "vc_ptr")}, index_ptr="*i64",
                    pos_ptr="*i64", cs_ptr="*fp32", ss_ptr="*fp32", **{n: "i32" for n in (
                        "M", "K", "P", "stride_wn", "stride_kcb", "stride_kct", "stride_kch", "stride_vcb",
                        "stride_vct", "stride_vch", "stride_cs", "H", "HKV")}, eps="fp32")
QKV_SIG = {"x_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16", "rout_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
           "qo_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "index_ptr": "*i64", "pos_ptr": "*i64", "cs_ptr": "*fp32",
           "K": "i32", "stride_wn": "i32", "eps": "fp32", "stride_kcb": "i32", "stride_kct": "i32", "stride_kch": "i32",
           "stride_vcb": "i32", "stride_vct": "i32", "stride_vch": "i32", "stride_cs": "i32", "H": "i32", "HKV": "i32"}

DECODE_SIG = dict({n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")},
                  **{n: "*i32" for n in ("bt_ptr", "cl_ptr", "arrivals_ptr")},
                  **{n: "*fp32" for n in ("po_ptr", "pm_ptr", "pl_ptr")}, qk_scale="fp32",
                  **{f"stride_{n}": "i32" for n in ("qb", "qh", "kb", "kt", "kh", "vb", "vt", "vh", "btb", "ob", "oh",
                                                   "pob", "poh", "pos", "pmb", "pmh", "ab")})

MATMUL_SIG = dict({n: "*bf16" for n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}, ws_ptr="*fp32",
                  **{n: "i32" for n in ("M", "N", "K", "tiles_per_split", "stride_xm", "stride_wn", "stride_ym",
                                        "stride_ws_split")})
SILU_SIG = {"x_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32", "I": "i32"}
MOE_UP_SIG = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", ids_ptr="*i64", inter_ptr="*bf16",
                  **{n: "i32" for n in ("num_experts", "H", "I", "stride_xm", "stride_we", "stride_wn", "stride_se",
                                        "stride_im")})
MOE_DOWN_SIG = dict(inter_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", ids_ptr="*i64", wts_ptr="*fp32",
                    out_ptr="*bf16", **{n: "i32" for n in ("num_experts", "H", "I", "stride_im", "stride_we",
                                                           "stride_wn", "stride_se", "stride_om")})
MOE_GROUPED_UP_SIG = dict(x_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", pairs_ptr="*i32", block_expert_ptr="*i32",
                          inter_ptr="*bf16", **{n: "i32" for n in ("num_pairs", "num_experts", "H", "I", "stride_xm",
                                                                   "stride_we", "stride_wn", "stride_se", "stride_im")})
MOE_GROUPED_DOWN_SIG = dict(inter_ptr="*bf16", w_ptr="*bf16", s_ptr="*bf16", pairs_ptr="*i32",
                            block_expert_ptr="*i32", wts_ptr="*fp32", out_ptr="*fp32",
                            **{n: "i32" for n in ("num_pairs", "num_experts", "H", "I", "stride_im", "stride_we",
                                                  "stride_wn", "stride_se", "stride_om")})
FP8_EXPERTS = dict(w_ptr="*fp8e4nv", s_ptr="*fp32")  # --quantization fp8: e4m3 stacks, float32 scales
ALL_REDUCE_SIG = dict(x_ptr="*bf16", buffers_ptr="*i64", flags_ptr="*i64", state_ptr="*i32", n="i32", chunk="i32",
                      half_elems="i32")
ROUTE_SIG = dict(logits_ptr="*bf16", weights_ptr="*fp32", ids_ptr="*i64",
                 **{n: "i32" for n in ("E", "stride_l", "first", "num_held")})
NORM_ROUTE_SIG = dict({n: "*bf16" for n in ("x_ptr", "r_ptr", "nw_ptr", "gw_ptr", "h_ptr", "rout_ptr")},
                      logits_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", arrivals_ptr="*i32", eps="fp32",
                      **{n: "i32" for n in ("H", "E", "stride_x", "stride_r", "stride_h", "stride_ro", "stride_g",
                                            "first", "num_held")})
ROPE_SIG = dict({n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "kc_ptr", "vc_ptr")}, index_ptr="*i64",
                pos_ptr="*i64", cs_ptr="*fp32",
                **{f"stride_{n}": "i32" for n in ("qt", "qh", "kt", "kh", "vt", "vh", "qot", "qoh", "kcb", "kct", "kch",
                                                 "vcb", "vct", "vch", "cs")})
# The FP8 operands' scales: per-row weight scales (bf16 weights: unused), an FP8 KV cache's inverse scales.
for _sig in (ROW_SIG, ROWS_SIG, DOT_SIG, QKV_SIG, QKV_ROWS_SIG):
    _sig["ws_ptr"] = "*fp32"
for _sig in (QKV_SIG, QKV_ROWS_SIG, ROPE_SIG):
    _sig.update(k_inv="fp32", v_inv="fp32")
ROPE_SIG.update(qw_ptr="*bf16", kw_ptr="*bf16", eps="fp32")  # Qwen3's per-head q and k norm weights
DECODE_SIG["v_scale"] = "fp32"
# Kernels launched with PDL that wait before their first load (no weight prefetch to check).
NO_PREFETCH = (decode_attention._split_kernel, matmul._matmul_kernel, activation._silu_and_mul_kernel,
               kv_write._rope_kv_write_kernel, gemv._gemv_kernel, gemv_qkv._qkv_rope_dot_kernel,
               moe._up_small_kernel, moe._down_small_kernel, moe._down_small_wide_kernel, moe_route._route_kernel,
               all_reduce._one_shot_kernel)


def variants():
    """(name, kernel, signature, constexprs, config) for every launch the fused batch-1 path can make."""
    for config in (c for c in gemv.CONFIGS if c[0] == "row"):
        _, block_n, block_k, _, _ = config
        for prologue, add in ((0, False), (1, True), (1, False), (2, False)):
            consts = dict(HAS_BIAS=prologue == 1, BLOCK_N=block_n, BLOCK_K=block_k, PROLOGUE=prologue, ADD=add,
                          USE_PDL=True)
            yield f"gemv_row prologue={prologue} add={add} {config}", gemv_row._gemv_row_kernel, ROW_SIG, consts, config
        for head_dim in (64, 128):
            pairs = gemv_qkv.rope_pairs(config, head_dim)
            for add in (True, False):
                consts = dict(D=head_dim, BLOCK_SIZE=16, PAIRS=pairs, BLOCK_K=block_k, HAS_BIAS=False, ADD=add,
                              USE_PDL=True)
                yield f"qkv_rope D={head_dim} add={add} {config}", gemv_qkv._qkv_rope_kernel, QKV_SIG, consts, config
            for m_pad in (m for m in (1, 2, 4, 8) if gemv.config_fits(config, m)):
                # the norm from the most partial sums the producer may leave (gemv_partials.sumsq_fits)
                for p_pad in (0, gemv_partials.SUMSQ_MAX // m_pad) if m_pad > 1 else (0,):
                    consts = dict(D=head_dim, BLOCK_SIZE=16, PAIRS=pairs, BLOCK_K=block_k, M_PAD=m_pad, HAS_BIAS=False,
                                  P_PAD=p_pad, USE_PDL=True)
                    yield (f"qkv_rope_rows M_PAD={m_pad} P_PAD={p_pad} D={head_dim} {config}",
                           gemv_qkv._qkv_rope_rows_kernel, QKV_ROWS_SIG, consts, config)
    for config in (c for c in gemv.CONFIGS if c[0] in ("dot", "dotT")):
        # plain, the residual epilogue (o, down), SiLU-mul with and without the norm from partial sums (gate|up)
        for silu, residual, rows in ((False, False, 0), (False, True, 0), (True, False, 0), (True, False, 2),
                                     (True, False, 8)):
            if silu and config[0] not in ("dot", "dotT"):
                continue
            consts = dict(HAS_BIAS=False, M_PAD=16, BLOCK_N=config[1], BLOCK_K=config[2], DOT_PREC="tf32",
                          SWAP=config[0] == "dotT", SILU=silu, RESIDUAL=residual, NORM_ROWS=rows,
                          P_PAD=gemv_partials.SUMSQ_MAX // rows if rows else 1, NORM_FIRST=silu and config[1] >= 64,
                          USE_PDL=True)
            yield (f"gemv_dot silu={silu} residual={residual} norm_rows={rows} {config}", gemv._gemv_kernel, DOT_SIG,
                   consts, config)
        for head_dim in (64, 128):  # q|k|v + rotary + cache write, with and without the norm from partial sums
            pairs = gemv_qkv.rope_pairs(config, head_dim)
            for rows in (0, 2, 8) if pairs else ():
                consts = dict(D=head_dim, BLOCK_SIZE=16, PAIRS=pairs, BLOCK_K=config[2], DOT_PREC="tf32",
                              HAS_BIAS=False, NORM_ROWS=rows, P_PAD=gemv_partials.SUMSQ_MAX // rows if rows else 1,
                              USE_PDL=True)
                yield (f"qkv_rope_dot norm_rows={rows} D={head_dim} {config}", gemv_qkv._qkv_rope_dot_kernel,
                       QKV_ROWS_SIG, consts, config)
    for config in (c for c in gemv.CONFIGS if c[0] in ("row", "rowk")):
        for m_pad in (m for m in (2, 4, 8) if gemv.config_fits(config, m)):
            for residual in (False, True):
                consts = dict(HAS_BIAS=False, M_PAD=m_pad, BLOCK_N=config[1], BLOCK_K=config[2],
                              EACH=config[0] == "rowk", RESIDUAL=residual, USE_PDL=True)
                yield (f"gemv_rows M_PAD={m_pad} residual={residual} {config}", gemv._gemv_rows_kernel, ROWS_SIG,
                       consts, config)
    for head_dim, group, splits in ((64, 4, 16), (128, 4, 16), (128, 8, 2)):
        block_n, warps, stages = decode_attention._default_config(head_dim)
        consts = dict(GROUP=group, G_PAD=16, G_MERGE=group, HEAD_DIM=head_dim, D_PAD=head_dim, BLOCK_SIZE=16,
                      BLOCK_N=block_n, NUM_SPLITS=splits, S_PAD=splits, DOT_PREC="tf32", USE_PDL=True)
        yield (f"decode_split D={head_dim} G={group} splits={splits}", decode_attention._split_kernel, DECODE_SIG,
               consts, (None, None, None, warps, stages))
        for rows in (1, 64) if splits == 16 else ():  # an FP8 cache: its own tiles, float16 products
            block_n, warps, stages = decode_attention._default_config(head_dim, fp8=True, rows=rows)
            yield (f"decode_split fp8 D={head_dim} G={group} splits={splits} rows={rows}",
                   decode_attention._split_kernel, dict(DECODE_SIG, k_ptr="*fp8e4nv", v_ptr="*fp8e4nv"),
                   dict(consts, BLOCK_N=block_n, F16_DOTS=True), (None, None, None, warps, stages))
    for cfg in (matmul.MatmulConfig(128, 128, 4, 3, 1), matmul.MatmulConfig(64, 128, 4, 3, 4)):
        consts = dict(HAS_BIAS=False, SPLIT=cfg.split_k, BLOCK_M=matmul.BLOCK_M, BLOCK_N=cfg.block_n,
                      BLOCK_K=cfg.block_k, DOT_PREC="tf32", USE_PDL=True)
        yield f"matmul {tuple(cfg)}", matmul._matmul_kernel, MATMUL_SIG, consts, (None, None, None, cfg.num_warps,
                                                                                 cfg.num_stages)
    yield "silu_and_mul", activation._silu_and_mul_kernel, SILU_SIG, dict(BLOCK=2048, USE_PDL=True), (None,) * 3 + (4, 1)
    consts = dict(H=32, H_PAD=32, HKV=8, HKV_PAD=8, HALF=64, HALF_PAD=64, BLOCK_SIZE=16, ROPE=True, QK_NORM=True,
                  USE_PDL=True)
    yield "rope_kv_write D=128", kv_write._rope_kv_write_kernel, ROPE_SIG, consts, (None,) * 3 + (4, 1)
    # MoE at one token (Qwen3-MoE's top-8): the per-pair form's default tiles, a down tile streaming the experts
    # side by side, the routing
    up, down = moe.SMALL_CONFIG
    wide = next(c for c in moe.DOWN_CANDIDATES if c.experts_at_once)
    for name, kernel, sig, c in (("moe_up", moe._up_small_kernel, MOE_UP_SIG, up),
                                 ("moe_down", moe._down_small_kernel, MOE_DOWN_SIG, down),
                                 ("moe_down_wide", moe._down_small_wide_kernel, MOE_DOWN_SIG, wide)):
        for fp8 in (False, True):
            consts = dict(TOP_K=8, BLOCK_N=c.block_n, BLOCK_K=c.block_k, W_SCALED=fp8, USE_PDL=True)
            yield (f"{name} fp8={fp8} {tuple(c)}", kernel, dict(sig, **FP8_EXPERTS) if fp8 else sig, consts,
                   ("moe", c.block_n, c.block_k, c.num_warps, c.num_stages))
    # the grouped form (larger batches, prefill) at its default tiles, bf16 and FP8 experts
    c = moe.grouped_config(moe.MoEConfig(), 512, 128)
    for name, kernel, sig in (("moe_grouped_up", moe._up_grouped_kernel, MOE_GROUPED_UP_SIG),
                              ("moe_grouped_down", moe._down_grouped_kernel, MOE_GROUPED_DOWN_SIG)):
        for fp8 in (False, True):
            consts = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, DOT_PREC="tf32", W_SCALED=fp8,
                          **(dict(TOP_K=8) if kernel is moe._up_grouped_kernel else {}))
            yield (f"{name} fp8={fp8} {tuple(c)}", kernel, dict(sig, **FP8_EXPERTS) if fp8 else sig, consts,
                   (None, None, None, c.num_warps, c.num_stages))
    consts = dict(TOP_K=8, BLOCK_E=128, RENORMALIZE=True, USE_PDL=True)
    yield "moe_route E=128", moe_route._route_kernel, ROUTE_SIG, consts, (None,) * 3 + (4, 1)
    for top_k, block_h, block_n, experts, warps in ((8, 2048, 4, 128, 4), (2, 4096, 2, 8, 4), (2, 8192, 1, 64, 8)):
        consts = dict(TOP_K=top_k, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_E=experts, ADD=True, RENORMALIZE=True,
                      USE_PDL=True)
        yield (f"moe_norm_route H={block_h} E={experts}", moe_route._norm_route_kernel, NORM_ROUTE_SIG, consts,
               (None,) * 3 + (warps, 1))
    consts = dict(RANK=1, WORLD=2, BLOCK=all_reduce.BLOCK, USE_PDL=True)  # the tensor-parallel one-shot sum
    config = (None,) * 3 + (all_reduce.NUM_WARPS, 1)
    yield "all_reduce world=2", all_reduce._one_shot_kernel, ALL_REDUCE_SIG, consts, config


FP8_W = {"w_ptr": "*fp8e4nv"}
FP8_KV = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}


def fp8_variants():
    """The fused kernels on FP8 weights (``W_SCALED``) and writing an FP8 KV cache, at the first config of each
    form."""
    row = next(c for c in gemv.CONFIGS if c[0] == "row")
    dot = next(c for c in gemv.CONFIGS if c[0] == "dot")
    for config, forms in ((row, ("gemv_row", "qkv_rope", "qkv_rope_rows", "gemv_rows")), (dot, ("gemv_dot", "qkv_rope_dot"))):
        for name, kernel, sig, consts, cfg in variants():
            if tuple(cfg) == tuple(config) and name.split()[0] in forms and "D=64" not in name:
                fp8 = dict(sig, **FP8_W, **(FP8_KV if "kc_ptr" in sig else {}))
                yield f"fp8 {name}", kernel, fp8, dict(consts, W_SCALED=True), cfg
                forms = tuple(f for f in forms if f != name.split()[0])


def w8a8_variants():
    """The W8A8 matmul's two forms at each of the tuner's tiles: per-thread loads, and its tiles through TMA tensor
    descriptors (Hopper's form)."""
    for config in matmul_fp8.FP8_MATMUL_CONFIGS:
        bm, bn, bk, warps, stages = config
        tile = f"{bm}x{bn}x{bk} {warps}w {stages}s"
        consts = dict(HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, USE_PDL=True)
        scales = dict(xs_ptr="*fp32")
        rest = dict(ws_ptr="*fp32", b_ptr="*bf16", y_ptr="*bf16", M="i32", N="i32", K="i32")
        yield (f"w8a8 {tile}", matmul_fp8._fp8_matmul_kernel,
               dict(x_ptr="*fp8e4nv", **scales, w_ptr="*fp8e4nv", **rest, stride_xm="i32", stride_wn="i32",
                    stride_ym="i32"), consts, config)
        yield (f"w8a8_tma {tile}", matmul_fp8._fp8_matmul_tma_kernel,
               dict(x_desc=f"tensordesc<fp8e4nv[{bm}, {bk}]>", **scales, w_desc=f"tensordesc<fp8e4nv[{bn}, {bk}]>",
                    **rest, stride_ym="i32"), consts, config)


def logits_variants():
    """The LM head's launches, which store float32 logits from bf16 rows (the sums unrounded): the plain kernel of
    each matmul form at its first config."""
    firsts = {}
    for name, kernel, sig, consts, cfg in variants():
        plain = not any(consts.get(k) for k in ("PROLOGUE", "ADD", "SILU", "RESIDUAL", "NORM_ROWS", "HAS_BIAS"))
        form = name.split()[0]
        key = (form, consts.get("SWAP"))
        if plain and form in ("gemv_row", "gemv_dot", "gemv_rows", "matmul") and key not in firsts:
            firsts[key] = (f"logits {name}", kernel, dict(sig, y_ptr="*fp32"), consts, cfg)
    return list(firsts.values())


def _weight(consts: dict) -> tuple:
    """How heavy a variant is for the register allocator: head dim, rows, partial sums, then epilogues on."""
    flags = sum(bool(consts.get(k)) for k in ("ADD", "HAS_BIAS", "SILU", "RESIDUAL", "NORM_FIRST", "PROLOGUE"))
    return (consts.get("D", 0), consts.get("M_PAD", 1), consts.get("NORM_ROWS", 0), consts.get("P_PAD", 0), flags,
            consts.get("PROLOGUE", 0))


def covering() -> list:
    """Every (kernel, config) in its heaviest variant, then variants until each kernel has compiled each of its
    epilogue flag sets and each value of each of its dimensions, then :func:`fp8_variants`."""
    every = list(variants())
    by_config: dict = {}
    for v in every:
        key = (v[1], tuple(v[4]))
        if key not in by_config or _weight(v[3]) > _weight(by_config[key][3]):
            by_config[key] = v
    chosen = list(by_config.values())
    dims = ("D", "M_PAD", "P_PAD", "NORM_ROWS")

    def keys(v):  # the kernel's epilogue flags, and each of its dimensions' values
        flags = tuple(sorted((k, x) for k, x in v[3].items() if k not in dims + ("BLOCK_N", "BLOCK_K", "PAIRS")))
        return {(v[1], flags)} | {(v[1], k, v[3][k]) for k in dims if k in v[3]}

    seen = set().union(*map(keys, chosen))
    for v in every:
        if not keys(v) <= seen:
            seen |= keys(v)
            chosen.append(v)
    first, heaviest = matmul_fp8.FP8_MATMUL_CONFIGS[0], max(matmul_fp8.FP8_MATMUL_CONFIGS,
                                                             key=lambda c: (c.block_m * c.block_n, c.num_stages))
    w8a8 = [v for v in w8a8_variants() if v[4] in (first, heaviest)]
    return chosen + list(fp8_variants()) + logits_variants() + w8a8


def pdl_problem(ptx: str, prefetch: bool = True) -> str:
    """'' if the kernel waits for its predecessor once, before any store, and (``prefetch``) prefetches a weight
    tile before that; else what is wrong."""
    wait = ptx.find("griddepcontrol.wait")
    if wait < 0 or ptx.count("griddepcontrol.wait") != 1:
        return "PDL: not exactly one griddepcontrol.wait"
    store = re.search(r"\bst\.global", ptx)
    if store and store.start() < wait:
        return "PDL: a store before griddepcontrol.wait"
    if prefetch and "ld.global" not in ptx[:wait]:
        return "PDL: no weight prefetch before griddepcontrol.wait"
    return ""


def arrival_problem(ptx: str) -> str:
    """'' if a program's arrival is a CTA barrier and then a GPU-scope acquire-release add (so every thread's
    stores are visible to the last program in, which merges them); else what is wrong."""
    atom = ptx.find("atom.global.gpu.acq_rel.add")
    if atom < 0:
        return "arrival: no GPU-scope acq_rel atomic add"
    if "bar.sync" not in ptx[max(0, ptx.rfind("st.global", 0, atom)):atom]:
        return "arrival: no barrier between the partial stores and the atomic"
    return ""


def main(argv: list[str]) -> int:
    failed = 0
    every = list(variants()) + list(fp8_variants()) + logits_variants() + list(w8a8_variants())
    for name, kernel, sig, consts, config in every if "--all" in argv else covering():
        # a constexpr left at its default (W_SCALED: bf16 weights) is bound like the launches bind it
        consts = dict({p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default
                       and p.name not in consts}, **consts)
        signature = dict(sig, **{k: "constexpr" for k in consts})
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs=consts), target=HOPPER,
                                      options=dict(num_warps=config[3], num_stages=config[4], launch_pdl=True))
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the exit code says so
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}")
            failed += 1
            continue
        ptx = compiled.asm["ptx"]
        spills = len(re.findall(r"\.local\b", ptx))
        arrives = kernel in (decode_attention._split_kernel, moe_route._norm_route_kernel)  # the last one in merges
        pdl = consts.get("USE_PDL", False)  # the grouped MoE launches run without PDL
        problem = "SPILL" if spills else ((pdl and pdl_problem(ptx, prefetch=kernel not in NO_PREFETCH))
                                          or (arrives and arrival_problem(ptx)))
        print(f"{problem or 'ok'} {name}: cubin {len(compiled.asm['cubin'])} B")
        failed += bool(problem)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
