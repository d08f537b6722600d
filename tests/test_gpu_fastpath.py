"""The fast path: Triton kernels in the model, whole decode steps as CUDA graphs, no hidden syncs.

On the CPU the Triton kernels run in the interpreter and the graph runner calls
the decode-step function eagerly on its static buffers, so the first test
checks the whole step logic (bucket padding, table diffs, sampling parameters,
last-token feedback) against the torch path everywhere.  The CUDA tests check
captured graphs against eager steps, the start-up progress, and a 200-step
decode loop under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque

import pytest
import torch

from ipc.config import ExecutorConfig
from executor_proc.step.graphs import graph_buckets
from executor_proc.build import COMPILE_STAGE, GRAPH_STAGE, build_worker
from executor_proc.testing.synthetic import GREEDY, SyntheticPlanner
from executor_proc.step.step_kinds import EagerStep, GraphStep
from ipc.protocol import SlotSampling

CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

TOP_K_P = SlotSampling(temperature=0.8, top_k=5, top_p=0.9, min_p=0.0, seed=1234)
MIN_P = SlotSampling(temperature=1.0, top_k=0, top_p=1.0, min_p=0.05, seed=77)


def write_config(folder, hidden=64, layers=2, heads=4, kv_heads=2, vocab=97, intermediate=96, experts=0) -> str:
    """A Llama config; ``experts``: a Qwen3-MoE one of that many experts (top-2, of ``intermediate`` each)."""
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    if experts:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
                      num_experts_per_tok=2, moe_intermediate_size=intermediate, norm_topk_prob=True,
                      head_dim=hidden // heads)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# Every fused kernel forced on (test_fast_path_matches_torch_path): the one-token ones and the 2-8-token epilogues.
FORCED_FUSIONS = {"qkv": ("row", 16, 256, 4, 4), "norm": ("row", 16, 256, 4, 4), "silu": ("row", 16, 256, 4, 4),
                  "rope": ("row", 4, 256, 4, 6), "gate_silu": ("dot", 16, 256, 4, 4)}


def interpreted_kinds(configs, n: int, k: int, keep=()) -> list:
    """On the CPU, of matmul ``configs`` for an ``[n, k]`` weight, the widest of each kind (and those in ``keep``):
    the interpreter ignores num_warps and num_stages, so configs of one form with as many K steps (the last one
    masked or not) and N tiles masked or not run one program but for their tile widths.  On a GPU, all of them."""
    if CUDA:
        return list(configs)
    kind = {c: interpreted_program(c, n, k) for c in configs}
    widest = {}
    for c in configs:
        if kind[c] not in widest or c[1] > widest[kind[c]][1]:
            widest[kind[c]] = c
    return [c for c in configs if c in widest.values() or c in keep]


def interpreted_program(config, n: int, k: int) -> tuple:
    """What the interpreter runs for a matmul ``config`` on an ``[n, k]`` weight, but for its tile widths: its
    form, its K steps, whether the last K step is masked and whether the N tiles are."""
    return config[0], -(-k // config[2]), k % config[2] == 0, n % config[1] == 0


def fewer_attention_splits(monkeypatch) -> None:
    """On the CPU, decode attention splits its keys for a device of 4 SMs, not the 8 the CPU is taken for: half
    the programs, nearly all of them empty splits at these tests' contexts (up to a 32-key tile: only the first
    split has keys).  Rows still run with several splits (and their merge) up to batch 4, and with one at 8."""
    if not CUDA:
        from kernels import decode_attention

        monkeypatch.setattr(decode_attention, "_num_sms", lambda device: 4)


def built(model_dir, device, dtype="float32", num_slots=6, max_batch=4, block_size=4, num_blocks=256,
           progress=None, **kw):
    cfg = ExecutorConfig(model=model_dir, plan_addr="", result_addr="", load_format="dummy", device=device,
                         dtype=dtype, num_slots=num_slots, num_kv_blocks=num_blocks, block_size=block_size,
                         cuda_graph_max_batch=max_batch, **kw)
    return build_worker(cfg, progress or (lambda stage, done, total: None))


def uncaptured(worker):
    """The worker with its graph runners calling their step functions eagerly (the same buckets and kernels)."""
    for runner in (worker.graphs, worker.mixed):
        if runner is not None:
            runner.capture = False
    worker.graphs.graphs.clear()
    worker.mixed.bodies.clear()
    worker.mixed.heads.clear()
    return worker


def run_plans(worker, plans) -> list[tuple[str, list[int]]]:
    """Run plans one after another; (kind of step, tokens) per step."""
    out = []
    for plan in plans:
        step = worker.prepare(plan)
        host, copy = worker.copy_out(worker.launch(step))
        if copy is not None:
            copy.synchronize()
        out.append((type(step).__name__, list(host) if isinstance(host, list) else host.tolist()))
        if copy is not None:
            copy.release()
    return out


def scenario(vocab: int, steps: int = 12, seed: int = 1, alone_from: int = 0, admit_at: int = 3, release_at: int = 6):
    """Plans with greedy, top-k/top-p and min-p rows, an admission mid-decode (step ``admit_at``) and a release
    (step ``release_at``) (and from step ``alone_from`` on, if given, the top-k/top-p row decoding alone: batch 1)."""
    planner = SyntheticPlanner(num_slots=6, block_size=4, num_blocks=256)
    g = torch.Generator().manual_seed(seed)
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    planner.add(prompt(5))
    planner.add(prompt(9), TOP_K_P)
    plans = []
    for i in range(steps):
        if i == admit_at:
            planner.add(prompt(3), MIN_P)
        if i == release_at:
            planner.release(0)
        if i == alone_from and alone_from:
            planner.release(2)
        plans.append(planner.step())
    return plans


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_argmax_rows_first_index():
    """The Triton backend's greedy argmax (kernels/argmax.py) at a real vocabulary."""
    from kernels.argmax import argmax_rows

    x = torch.randn(5, 128256)
    x[1, 7] = x[1, 200000 % 128256] = x[1].max() + 1  # a tie: the first index wins
    x[2] = 0.0
    x = x.to("cuda" if CUDA else "cpu")
    assert argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()
    assert argmax_rows(x[:, :97]).tolist() == torch.argmax(x[:, :97], dim=-1).tolist()  # prime width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_linear(dtype):
    from kernels.gemv import CONFIGS, config_fits, gemv

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(0)
    for m, n, k, bias in ((1, 48, 200, False), (1, 20, 1100, True), (3, 64, 512, True), (8, 40, 96, False),
                          (2, 37, 1100, True), (5, 9, 600, False)):
        x = torch.randn(m, k, generator=g).to(device, dtype)
        w = torch.randn(n, k, generator=g).to(device, dtype)
        b = torch.randn(n, generator=g).to(device, dtype) if bias else None
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        rows = [c for c in CONFIGS if c[0] in ("row", "rowk") and config_fits(c, m)]
        assert m > 8 or rows, m  # the "row" form serves 1 to 8 rows
        for config in interpreted_kinds(CONFIGS[:4:3] + tuple(rows if m > 1 else rows[::3]), n, k):
            out = gemv(x, w, b, config=config).double()
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < (1e-6 if dtype == torch.float32 else 1e-2), (m, n, k, config, err)


def test_lm_head_float32_logits_are_not_rounded_to_bf16():
    """bf16 rows and weight, float32 logits (the LM head at the default model's shapes, with the kernels the H200's
    tuner picked for it): the skinny matmul and the tiled one (K unsplit and split) store the float32 sums, as cuBLAS
    with a float32 output does, not sums rounded to bf16 and widened: rounding turns near-ties into ties, which the
    greedy pick gives to the lower id (the default model's first token for "What is the capital of France?": "The"
    25.33 against "L" 25.24 in float32, under bf16's step of 0.125 there)."""
    from kernels.gemv import gemv
    from kernels.matmul import MatmulConfig, invariant_matmul

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    k = 576
    vocab = 49152 if CUDA else 1024  # the interpreter: the same program, fewer of them
    for form, m, n, config in (("skinny", 8, vocab, ("dotT", 64, 64, 4, 6)),
                               ("skinny", 1, 960, ("row", 4, 1024, 4, 4)),
                               ("skinny", 16, 960, ("dot", 16, 512, 4, 3)),
                               ("tiled", 48, 960, MatmulConfig(32, 128, 4, 6, 1)),
                               ("tiled", 48, 960, MatmulConfig(64, 128, 4, 4, 2))):
        x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / 4).to(device, torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.float32, device=device)
        if form == "skinny":
            gemv(x, w, config=config, out=out)
        else:
            invariant_matmul(x, w, config=config, out=out)
        ref = x.double() @ w.double().T
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (form, m, n, config, err)  # bf16 rounding: up to 2 ** -9 of the largest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_prologue_matches_two_ops(dtype):
    """The fused one-token matmul (norm with and without the residual add, SiLU-mul) against the
    reference ops then a float64 linear; the residual sum it returns is the norm kernel's, bit for bit."""
    from kernels import reference as R
    from kernels.gemv import CONFIGS
    from kernels.gemv_row import gemv_prologue

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(1)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for n, k, bias in ((48, 200, False), (20, 1100, True), (64, 64, True)):
        w, b = rnd(n, k) / k**0.5, (rnd(n) if bias else None)
        x, res, nw, gu = rnd(1, k), rnd(1, k), 1.0 + 0.1 * rnd(k), rnd(1, 2 * k)
        h, res_sum = R.fused_add_rms_norm_ref(x, res, nw, 1e-5)
        cases = [(dict(norm=(nw, 1e-5), residual=res), h, res_sum), (dict(norm=(nw, 1e-5)), R.rms_norm_ref(x, nw, 1e-5), x),
                 (dict(silu=True), R.silu_and_mul_ref(gu), None)]
        for config in interpreted_kinds([c for c in CONFIGS if c[0] == "row"][::2], n, k):
            for kw, h_ref, res_ref in cases:
                y, res_out = gemv_prologue(gu if kw.get("silu") else x, w, b, config=config, **kw)
                ref = torch.nn.functional.linear(h_ref.double(), w.double(), None if b is None else b.double())
                err = ((y.double() - ref).norm() / ref.norm()).item()
                assert err < tol, (n, k, config, kw.keys(), err)
                assert (res_out is None) == (res_ref is None) and (res_ref is None or torch.equal(res_out, res_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_silu_matches_two_ops(dtype):
    """gate|up with SiLU-mul as its epilogue equals ``silu_and_mul(gemv(...))`` of the same "dot" or "dotT" config
    bit for bit (the same sums, the same roundings), at 1-8 rows, with and without a bias."""
    from triton.runtime.errors import OutOfResources

    from kernels.activation import silu_and_mul
    from kernels.gemv import CONFIGS, gemv, gemv_silu

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    for m, i, k, bias in ((1, 40, 96, False), (3, 70, 300, True), (8, 64, 128, False), (5, 33, 1100, True)):
        x, w, b = rnd(m, k), rnd(2 * i, k) / k**0.5, (rnd(2 * i) if bias else None)
        checked = 0
        for config in interpreted_kinds([c for c in CONFIGS if c[0] in ("dot", "dotT")], i, k):  # i: features
            try:
                fused = gemv_silu(x, w, b, config=config)
            except OutOfResources:  # float32's two weight tiles overflow an H100's shared memory in the deeper
                assert dtype == torch.float32 and CUDA  # pipelines; the tuner skips what fails to build
                continue
            assert torch.equal(fused, silu_and_mul(gemv(x, w, b, config=config))), config
            checked += 1
        assert checked >= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_matches_unfused(dtype):
    """(Norm ->) q|k|v -> rotary -> cache write in one launch, with the norm for one token and without it for
    1-8 tokens (each at its own position and cache slot), against the reference chain (the same roundings; the
    matmul's sum order is the only difference); a negative kv_index writes nothing."""
    from kernels import reference as R
    from kernels.gemv_qkv import qkv_rope

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(2)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    heads, hidden, block_size = (4, 2, 16), 96, 4
    h, hkv, d = heads
    cs = R.rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 128).to(device)
    for bias, norm, index, config in ((True, "add", [13], ("row", 8, 32, 4, 1)), (False, "norm", [5], ("row", 4, 64, 4, 1)),
                                      (True, "add", [-1], ("row", 16, 256, 4, 4)), (True, None, [7, -1, 30], ("row", 4, 64, 4, 1)),
                                      (False, None, [2, 3], ("row", 2, 128, 4, 2)), (True, None, [9], ("row", 4, 64, 4, 1))):
        m = len(index)
        w, b = rnd((h + 2 * hkv) * d, hidden) / hidden**0.5, (rnd((h + 2 * hkv) * d) if bias else None)
        x, res, nw = rnd(m, hidden), (rnd(m, hidden) if norm == "add" else None), 1.0 + 0.1 * rnd(hidden)
        pos, idx = torch.tensor([77, 3, 120][:m], device=device), torch.tensor(index, device=device)
        kc, vc = rnd(8, block_size, hkv, d), rnd(8, block_size, hkv, d)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q, res_sum = qkv_rope(x, w, b, config=config, norm=(nw, 1e-5) if norm else None, residual=res, positions=pos,
                              cos_sin_cache=cs, k_cache=kc, v_cache=vc, kv_index=idx)
        if norm == "add":
            normed, res_ref = R.fused_add_rms_norm_ref(x, res, nw, 1e-5)
        else:
            normed, res_ref = (R.rms_norm_ref(x, nw, 1e-5), x) if norm else (x, None)
        qr, kr, vr = torch.nn.functional.linear(normed, w, b).split([h * d, hkv * d, hkv * d], dim=-1)
        q_ref = R.rope_kv_write_ref(qr.reshape(m, h, d), kr.reshape(m, hkv, d), vr.reshape(m, hkv, d), pos, cs,
                                    kc_ref, vc_ref, idx)
        assert (res_sum is None) == (res_ref is None) and (res_ref is None or torch.equal(res_sum, res_ref))
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        for ours, ref in ((q, q_ref), (kc, kc_ref), (vc, vc_ref)):
            assert (ours.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.abs().max().item())
        assert max(index) >= 0 or (torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_rope_dot_form_matches_unfused(dtype):
    """The tensor-core form of q|k|v + rotary + cache write (2-16 normed tokens, 16 rotary pairs per program)
    against the reference chain, with and without bias, a skipped cache slot, K not a multiple of the chunk."""
    from kernels import reference as R
    from kernels.gemv_qkv import qkv_rope, rope_pairs

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(3)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    (h, hkv, d), hidden, block_size = (4, 2, 32), 80, 4
    assert rope_pairs(("dot", 16, 32, 4, 1), d) == 16 and rope_pairs(("dot", 32, 32, 4, 1), d) is None
    cs = R.rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 128).to(device)
    for bias, index in ((True, [7, -1]), (False, [2, 3, 9, 11, 12]), (True, [4, 5, 6, 7, 8, 9, 10, 30]),
                        (False, list(range(16)))):
        m = len(index)
        w, b = rnd((h + 2 * hkv) * d, hidden) / hidden**0.5, (rnd((h + 2 * hkv) * d) if bias else None)
        x = rnd(m, hidden)
        pos, idx = torch.arange(100, 100 - m, -1, device=device), torch.tensor(index, device=device)
        kc, vc = rnd(8, block_size, hkv, d), rnd(8, block_size, hkv, d)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        q, none = qkv_rope(x, w, b, config=("dot", 16, 32, 4, 1), norm=None, residual=None, positions=pos,
                           cos_sin_cache=cs, k_cache=kc, v_cache=vc, kv_index=idx)
        qr, kr, vr = torch.nn.functional.linear(x, w, b).split([h * d, hkv * d, hkv * d], dim=-1)
        q_ref = R.rope_kv_write_ref(qr.reshape(m, h, d), kr.reshape(m, hkv, d), vr.reshape(m, hkv, d), pos, cs,
                                    kc_ref, vc_ref, idx)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert none is None
        for ours, ref in ((q, q_ref), (kc, kc_ref), (vc, vc_ref)):
            assert (ours.float() - ref.float()).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_epilogue_and_norm_from_partial_sums(dtype):
    """At 2-16 tokens: the output projection with the residual add in its epilogue (the configs of every form
    that fits, half of them per size; past 8 rows the "dot" forms) stores exactly the unfused matmul then add,
    and partial sums of squares whose total is each row's; q|k|v (with rotary and cache write) and gate|up (with
    SiLU-mul) that apply the norm from those sums, its weight folded into theirs, match norm-then-matmul on the
    unfolded weight (float32 tightly; bf16 within the roundings the fused form skips or adds, checked against
    float64 math)."""
    from kernels import reference as R
    from kernels.gemv import CONFIGS, config_fits, gemv, gemv_residual, gemv_silu
    from kernels.gemv_partials import sumsq_fits, sumsq_programs
    from kernels.gemv_qkv import qkv_rope

    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(5)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    hidden, inner, eps = 96, 40, 1e-5
    h_, hkv, d = 4, 2, 32
    cs = R.rope_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), 128).to(device)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for m, k, bias in ((2, 64, True), (5, 200, False), (8, 128, True), (13, 64, False)):
        x, w, r = rnd(m, k), rnd(hidden, k) / k**0.5, 3 * rnd(m, hidden)
        b = rnd(hidden) if bias else None
        producers = [c for c in CONFIGS if config_fits(c, m) and sumsq_fits(c, hidden, m)]
        assert {c[0] for c in producers} == {"row", "rowk", "dot", "dotT"} or m == 8 or (
            m > 8 and {c[0] for c in producers} == {"dot", "dotT"})
        chosen = producers[m % 2::2]  # every other config, a different half per size
        # (on the CPU one of each kind, and the last config, whose partial sums the checks below take)
        for config in interpreted_kinds(chosen, hidden, k, keep=chosen[-1:]):
            h, sumsq = gemv_residual(x, w, b, r, config=config)
            assert torch.equal(h, (gemv(x, w, b, config=config).float() + r.float()).to(dtype)), config
            assert sumsq.shape == (sumsq_programs(config, hidden), m)
            torch.testing.assert_close(sumsq.sum(0), h.float().pow(2).sum(1), rtol=1e-5, atol=0)
        nw = 1.0 + 0.3 * rnd(hidden)
        normed = R.rms_norm_ref(h, nw, eps)
        fold = lambda weight: (weight.float() * nw.float()[None, :]).to(dtype)  # noqa: E731
        # gate|up + SiLU-mul from the partial sums of the last producer (P not a power of two where it can be)
        gate_up = rnd(2 * inner, hidden) / hidden**0.5
        hd = h.double()
        gu = (hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + eps) * nw.double()) @ gate_up.double().T
        exact = torch.nn.functional.silu(gu[:, :inner]) * gu[:, inner:]
        for silu_config in (("dot", 16, 64, 4, 3), ("dotT", 64, 64, 4, 3)):  # gate and up rows as the MMA's N or M
            got = gemv_silu(h, fold(gate_up), config=silu_config, sumsq=(sumsq, eps))
            want = gemv_silu(normed, gate_up, config=silu_config)
            torch.testing.assert_close(got.float(), want.float(), **tol)
            assert (got.double() - exact).abs().max() <= 3 * (want.double() - exact).abs().max() + 1e-5
        # q|k|v + rotary + cache write, likewise
        qkv_w = rnd((h_ + 2 * hkv) * d, hidden) / hidden**0.5
        pos, idx = torch.arange(7, 7 + m, device=device), torch.arange(3, 3 + m, device=device)
        caches = [rnd(4, 16, hkv, d) for _ in range(2)]
        caches += [c.clone() for c in caches]
        # the rows and the tensor-core form; in the interpreter the rows' program with 8 rotary pairs rather than 2,
        # the same program in a quarter of the programs (test_qkv_rope_matches_unfused takes the widths)
        for config in (("row", 4 if CUDA else 16, 64, 4, 1), ("dot", 16, 64, 4, 2))[m > 8:]:
            rope = dict(config=config, norm=None, residual=None, positions=pos, cos_sin_cache=cs, kv_index=idx)
            q, _ = qkv_rope(h, fold(qkv_w), None, k_cache=caches[0], v_cache=caches[1], sumsq=(sumsq, eps), **rope)
            q_ref, _ = qkv_rope(normed, qkv_w, None, k_cache=caches[2], v_cache=caches[3], **rope)
            for ours, ref in ((q, q_ref), (caches[0], caches[2]), (caches[1], caches[3])):
                torch.testing.assert_close(ours.float(), ref.float(), **tol)


def test_fused_kernels_compile_for_hopper_without_spills():
    """The batch-1 fused kernels, the split-KV decode attention and the W8A8 matmul (both forms) go through Triton's
    real compiler and ptxas for sm_90 (offline: no GPU needed), on bf16 and FP8 operands, and none spills to local
    memory or breaks its ordering rules (``tests/compile_sm90.py``: every kernel at every config in its heaviest
    variant and every flag set once; ``--all``, every variant, runs in ``scripts/gpu_suite.sh tests``)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    # the real compiler, without the line tables nothing here reads (10% of its time)
    env = dict({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, TRITON_DISABLE_LINE_INFO="1")
    run = subprocess.run([sys.executable, "-m", "tests.compile_sm90"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    from tests.compile_sm90 import covering

    assert sum(line.startswith("ok ") for line in run.stdout.splitlines()) == len(covering()), run.stdout


def test_tuners_keep_only_faster_kernels(tmp_path, monkeypatch):
    """The tuner runs every candidate (unfused chain, each "row" config of each one-token fused kernel; the
    few fastest configs of each epilogue at 2-8 tokens) on the model's weights and keeps a fused config only
    where its (here: scripted) time beats the unfused one by the margin; the real timing is CUDA graphs on a
    GPU (bash scripts/gpu_suite.sh tests)."""
    from executor_proc.backends import gemv_tuning

    # on the CPU one layer: every candidate still runs on each weight shape (q|k|v, o, gate|up, down, LM head)
    layers = 2 if CUDA else 1
    model_dir = write_config(tmp_path, layers=layers)
    backend_model = built(model_dir, "cuda" if CUDA else "cpu", kernels="triton").worker.model
    backend = backend_model.backend
    calls, ran = [], set()
    fused_runs = gemv_tuning._fused_runs

    def tagged_runs(backend, kind, n, k, m, *args):
        """The tuner's runs, each fn tagged with what it runs: (fused kind, tokens), config (None: unfused)."""
        (name, unfused), candidates = fused_runs(backend, kind, n, k, m, *args)
        unfused.what = (kind, m), None
        for config, fn in candidates:
            fn.what = (kind, m), config
        return (name, unfused), candidates

    monkeypatch.setattr(gemv_tuning, "_fused_runs", tagged_runs)

    def run(fn, weights, what, config):
        """Every candidate really runs on its weights: on a GPU each one; in the interpreter each unfused chain
        and, per kind (and tokens) and weight shape, the first config of each interpreted program (those after
        it run the same program at other tile widths: interpreted_kinds)."""
        n, k = weights[0].shape
        program = (what, n, k, None if config is None else interpreted_program(config, n, k))
        if CUDA or config is None or program not in ran:
            ran.add(program)
            for w in weights:
                fn(w)

    def scripted_time(fn, weights, reps):
        run(fn, weights, *fn.what)
        calls.append(fn.what[1])
        return {None: 1.0, ("row", 8, 512, 4, 4): 0.5, ("row", 16, 512, 8, 3): 0.99}.get(calls[-1], 2.0)

    monkeypatch.setattr(gemv_tuning, "_time_pass", scripted_time)
    choice, timings = gemv_tuning.tune_prologues(backend, backend_model)
    # tiny model: q|k|v 128x64 (head_dim 16: 8 pairs tile it), gate|up 192x64, down 64x96
    shapes = (("qkv", (128, 64)), ("norm", (192, 64)), ("silu", (64, 96)))
    assert choice == {(kind, *shape, 1): ("row", 8, 512, 4, 4) for kind, shape in shapes}  # 0.99: within the margin
    from kernels.gemv import CONFIGS
    from kernels.gemv_qkv import rope_pairs

    rows = [c for c in CONFIGS if c[0] == "row"]
    tried = 2 * len(rows) + sum(rope_pairs(c, 16) is not None for c in rows)  # norm, silu: every row config
    assert calls.count(None) == 3 and len(calls) == 3 + tried and backend.prologue_everywhere is None
    assert timings[("silu", 64, 96, 1, "unfused")] == 1.0
    # at 2 and 4 tokens, the epilogues: q|k|v + rotary takes the 3 "row" configs with rotary pairs that streamed
    # the weight fastest as a plain linear, gate|up + SiLU-mul the 3 fastest "dot" ones (scripted: the slowest
    # fitting "row" / "dot" config is the fastest linear and the fastest fused kernel)
    calls.clear()
    from kernels.gemv import config_fits

    pick = {}
    backend.gemv_timings = {}
    for m in (2, 4):
        for (n, k), form in (((128, 64), "row"), ((192, 64), "dot")):
            configs = [c for c in CONFIGS if c[0] == form and config_fits(c, m) and (form == "dot" or rope_pairs(c, 16))]
            backend.gemv_timings.update({(n, k, m, c): float(i) for i, c in enumerate(configs)})
            backend.gemv_timings[(n, k, m, configs[-1])] = -1.0
            pick[(n, k, m)] = configs[-1]
    monkeypatch.setattr(gemv_tuning, "_time_pass", lambda fn, weights, reps: run(fn, weights, *fn.what) or (
        calls.append(fn.what[1]) or (0.5 if calls[-1] in pick.values() else 1.0)))
    choice, _ = gemv_tuning.tune_prologues(backend, backend_model, (2, 4))
    kinds = {(128, 64): "rope", (192, 64): "gate_silu"}
    assert choice == {(kinds[(n, k)], n, k, m): c for (n, k, m), c in pick.items()}, choice
    assert len(calls) == 2 * 2 * 4 and calls.count(None) == 4  # per kind and size: unfused + 3 candidates
    assert [c[0] for c in calls if c] == ["row"] * 6 + ["dot"] * 6

    # tune_linears picks the same way: cuBLAS first (1.0), then every fitting config (0.5: the first wins)
    timed = iter([None, *(c for c in CONFIGS if config_fits(c, 1))] * 5)  # 5 weight shapes: cuBLAS, the configs

    def linear_time(fn, weights, reps):
        config = next(timed)
        run(fn, weights, "linear", config)
        return 1.0 if config is None else 0.5

    monkeypatch.setattr(gemv_tuning, "_time_pass", linear_time)
    linears, _ = gemv_tuning.tune_linears(backend_model, [1])
    from kernels.matmul import invariant_matmul

    assert linears and set(linears.values()) == {CONFIGS[0]} and next(timed, "all timed") == "all timed", linears
    # tune_matmuls (batches above 8): cuBLAS against the tiled matmul's candidates; linear then routes to it
    times = iter([1.0, 2.0, 2.0, 0.5, 2.0, 2.0, 2.0, 2.0, 2.0] * 5)  # cuBLAS, then the 8 candidates
    monkeypatch.setattr(gemv_tuning, "_time_pass", lambda fn, weights, reps: [fn(w) for w in weights] and next(times))
    tiled, _ = gemv_tuning.tune_matmuls(backend_model, [16])
    assert len(tiled) == 5 and set(tiled.values()) == {gemv_tuning.MATMUL_CANDIDATES[2]}, tiled
    backend.matmul_choice = tiled
    w = backend_model.model.layers[0].mlp.gate_up.weight
    x = torch.randn(12, w.shape[1], dtype=w.dtype, device=w.device)
    assert torch.equal(backend.linear(x, w, None), invariant_matmul(x, w, config=gemv_tuning.MATMUL_CANDIDATES[2]))
    split = next(c for c in gemv_tuning.MATMUL_CANDIDATES if c.split_k > 1)  # the LM head's float logits too
    backend.matmul_choice = {key: split for key in tiled}
    lm, xb = backend_model.lm_head.weight.bfloat16(), x.bfloat16()  # bf16: the float32 sums, unrounded
    logits = torch.empty(xb.shape[0], lm.shape[0], dtype=torch.float32, device=xb.device)
    assert torch.equal(backend.logits(xb, lm), invariant_matmul(xb, lm, config=split, out=logits))
    backend.matmul_choice = backend.gemv_choice = {}  # cuBLAS: on CUDA it writes the float32 logits itself
    want = torch.mm(xb, lm.t(), out_dtype=torch.float32) if CUDA else torch.nn.functional.linear(xb, lm).float()
    assert torch.equal(backend.logits(xb, lm), want)


def test_skinny_kernels_serve_up_to_16_rows_where_tuned():
    """9-16 rows (a speculative row of 8 drafts, 9-16 slots) take a tuned "dot" skinny matmul and its epilogues
    as 2-8 rows do ("row" forms stop at 8); an FP8 weight stays W8A16 to 8 rows only; where the tiled matmul was
    also picked at 16 rows the faster of the two is kept (a tie within the margin goes to the skinny one)."""
    from executor_proc.backends import gemv_tuning
    from executor_proc.backends.triton_backend import TritonBackend
    from kernels.fp8 import quantize_weight
    from kernels.matmul import MatmulConfig

    backend = TritonBackend(torch.ones(8), 64, 4, 2, 16, 5, torch.device("cpu"))
    w = torch.randn(96, 64)
    dot, row = ("dot", 16, 256, 4, 4), ("row", 8, 512, 4, 4)
    backend.gemv_choice = {(96, 64, 16): dot}
    backend.prologue_choice = {("gate_silu", 96, 64, 16): dot, ("rope", 96, 64, 16): row}
    for m, want in ((8, None), (9, dot), (16, dot), (17, None)):
        assert backend._gemv_config(torch.randn(m, 64), w) == want, m
    assert backend._fused_config("gate_silu", torch.randn(12, 64), w) == dot
    assert backend._fused_config("rope", torch.randn(12, 64), w) is None  # a "row" config does not fit 12 rows
    fp8 = quantize_weight(w)
    backend.gemv_choice[(96, 64, 8)] = dot
    assert backend._gemv_config(torch.randn(8, 64), fp8) == dot
    assert backend._gemv_config(torch.randn(9, 64), fp8) is None
    assert backend._fused_config("gate_silu", torch.randn(12, 64), fp8) is None
    tiled = MatmulConfig(64, 128, 4, 5, 1)
    skinny_choice = {(96, 64, 16): dot, (64, 64, 16): dot, (32, 64, 16): dot}
    tiled_choice = {(96, 64, 16): tiled, (64, 64, 16): tiled, (128, 64, 16): tiled}
    timings = {(96, 64, 16, dot): 1.0, (64, 64, 16, dot): 1.0, (32, 64, 16, dot): 1.0}
    tiled_timings = {(96, 64, 16, tiled): 0.99, (64, 64, 16, tiled): 0.9, (128, 64, 16, tiled): 0.5}
    gemv_tuning._keep_faster(skinny_choice, timings, tiled_choice, tiled_timings)
    assert skinny_choice == {(96, 64, 16): dot, (32, 64, 16): dot}
    assert tiled_choice == {(64, 64, 16): tiled, (128, 64, 16): tiled}


@needs_cuda
def test_tuner_times_inside_the_graph_while_kernels_compile():
    """The tuner's pass is timed by events captured in its graph (the host's pace does not count), and its
    captures leave other threads free to load kernels (the compile pool runs beside them)."""
    from executor_proc.backends import gemv_tuning
    from kernels.precompile import compiled_ahead

    skinny = gemv_tuning.skinny
    weights = [torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    start, end = gemv_tuning._timing_events()
    assert start.external and end.external  # torch >= 2.8

    def job(m):  # the second job's kernels still compile while the first one is timed
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        configs = [c for c in skinny.CONFIGS if skinny.config_fits(c, m)][:6]
        return gemv_tuning.TuneJob(("w", 1024, 1024, m), ("cublas", lambda w: x @ w.T),
                                   [(c, lambda w, c=c: skinny.gemv(x, w, config=c)) for c in configs], weights, 1.0)

    with compiled_ahead() as ahead:
        choice, timings = gemv_tuning.TunePhase([job(1), job(4)], ahead).pick("tuning")
    assert len(timings) == 14 and all(0 < t < 10 for t in timings.values()), timings


def test_tuner_log_names_the_picks(tmp_path, monkeypatch):
    """``FORERUN_TUNER_LOG=path``: the executor writes what its start-up tuner measured and picked (nothing on
    the CPU, where it does not tune); the report gives per shape and batch the baseline's time, the best
    candidate's and the pick."""
    from executor_proc.backends.gemv_tuning import tuner_report
    from kernels.gemv import CONFIGS

    log = tmp_path / "tuner.json"
    monkeypatch.setenv("FORERUN_TUNER_LOG", str(log))
    backend = built(write_config(tmp_path), "cuda" if CUDA else "cpu", kernels="triton").worker.model.backend
    assert json.loads(log.read_text()) == tuner_report(backend) and (CUDA or tuner_report(backend) == {})
    fused = ("dot", 16, 256, 4, 4)
    backend.gemv_choice, backend.gemv_timings = {(64, 96, 2): CONFIGS[1]}, {
        (64, 96, 2, "cublas"): 1.0, (64, 96, 2, CONFIGS[0]): 0.7, (64, 96, 2, CONFIGS[1]): 0.5}
    backend.prologue_choice = {("gate_silu", 192, 64, 2): fused}
    backend.prologue_timings = {("gate_silu", 192, 64, 2, "unfused"): 1.0, ("gate_silu", 192, 64, 2, fused): 0.9}
    backend.matmul_choice = {}
    assert tuner_report(backend) == {
        "64x96 m=2": {"cublas_ms": 1.0, "best_gemv_ms": 0.5, "best_gemv": list(CONFIGS[1]), "chosen": list(CONFIGS[1])},
        "gate_silu+192x64 m=2": {"unfused_ms": 1.0, "best_fused_ms": 0.9, "best_fused": list(fused),
                                 "chosen": list(fused)}}


@pytest.mark.parametrize("force_gemv", [False, True, "prologue"])
def test_fast_path_matches_torch_path(tmp_path, force_gemv, monkeypatch):
    """Torch path vs Triton eager vs Triton + decode-graph runner: the same tokens, step by step
    (forcing the skinny matmul everywhere, or every fused kernel: the norm / SiLU prologues and the fused
    attention input at batch 1, the rotary and SiLU epilogues at 2-8 tokens, and there the output
    projections' residual add with q|k|v's and gate|up's own norm)."""
    from kernels.gemv import CONFIGS

    from kernels import gemv as skinny

    # in the interpreter one layer unless every fusion is forced: a second layer runs the same kernels at the same
    # shapes, but for q|k|v taking its norm from the partial sums of the layer before ("norm_rope")
    model_dir = write_config(tmp_path, layers=2 if CUDA or force_gemv == "prologue" else 1)
    device = "cuda" if CUDA else "cpu"
    fewer_attention_splits(monkeypatch)
    if CUDA:
        plans = scenario(vocab=97, steps=14 if force_gemv == "prologue" else 12, alone_from=9)
    else:  # the interpreter: the prefill, the admission's mixed step, 3 rows in bucket 4, batch 2 after the
        # release, then batch 1 (the fused one-token kernels where forced) for 2 steps; more steps of a phase
        # repeat the same kernels at the same shapes
        plans = scenario(vocab=97, steps=6, alone_from=4, admit_at=1, release_at=3)
    import executor_proc.backends.triton_linears as tb

    fused = []
    # the fused kernels, by the calls below; at 2-8 tokens "residual": an output projection adds the residual
    # (the norms folded: CausalLM.fold_norms), "norm_rope" / "norm_gate_silu": q|k|v / gate|up then apply the
    # norm from its partial sums
    ids = {"norm": 1, "silu": 2, "qkv": 3, "rope": 4, "gate_silu": 5, "residual": 6, "norm_rope": 7,
           "norm_gate_silu": 8}
    monkeypatch.setattr(tb, "gemv_prologue", lambda *a, _f=tb.gemv_prologue, **k: fused.append(
        ids["silu" if k.get("silu") else "norm"]) or _f(*a, **k))
    monkeypatch.setattr(tb, "qkv_rope", lambda *a, _f=tb.qkv_rope, **k: fused.append(
        ids["qkv" if k["norm"] else "norm_rope" if k.get("sumsq") else "rope"]) or _f(*a, **k))
    monkeypatch.setattr(skinny, "gemv_silu", lambda *a, _f=skinny.gemv_silu, **k: fused.append(
        ids["norm_gate_silu" if k.get("sumsq") else "gate_silu"]) or _f(*a, **k))
    monkeypatch.setattr(skinny, "gemv_residual", lambda *a, _f=skinny.gemv_residual, **k: fused.append(
        ids["residual"]) or _f(*a, **k))
    ref = run_plans(built(model_dir, device, kernels="torch").worker, plans)
    fast = [built(model_dir, device, kernels="triton", cuda_graphs=False).worker,
            built(model_dir, device, kernels="triton").worker]
    fused.clear()  # on a GPU the start-up tuner ran every fused candidate once; count the steps' calls only
    # on the CPU ("dot", 32, 256) runs the program of CONFIGS[0] ("dot", 16, 256) at every weight here (the same
    # K steps and masks: interpreted_kinds; the interpreter ignores warps and stages) in half the programs
    skinny_config = CONFIGS[0] if CUDA else CONFIGS[2]
    assert CUDA or all(interpreted_kinds([CONFIGS[0], skinny_config], n, k) == [skinny_config]
                       for n, k in ((128, 64), (64, 64), (192, 64), (64, 96), (97, 64)))
    for worker in fast:
        worker.model.backend.gemv_everywhere = skinny_config if force_gemv in (True, "prologue") else None
        worker.model.backend.prologue_everywhere = FORCED_FUSIONS if force_gemv == "prologue" else None
    eager, graphs = run_plans(fast[0], plans), run_plans(fast[1], plans)
    assert [t for _, t in eager] == [t for _, t in ref]
    assert [t for _, t in graphs] == [t for _, t in ref]
    assert all(kind == EagerStep.__name__ for kind, _ in eager)
    # Pure-decode steps go through the graph runner (3 rows run padded to bucket 4); prefill steps do not.
    kinds = [kind for kind, _ in graphs]
    assert kinds.count(GraphStep.__name__) == len(plans) - 2, kinds
    # steps of 1-8 tokens took the fused kernels where forced, and
    # otherwise exactly where the tuner picked them (on a GPU it times them; on the CPU it never picks)
    # (the graph worker's calls happened at capture, before the count; the eager worker calls per step)
    def launches(worker_list):
        return {ids[kind] for worker in worker_list for kind, _, _, _ in worker.model.backend.prologue_choice}

    if force_gemv == "prologue":  # every output projection adds the residual: gate|up always takes the norm itself
        assert set(fused) == set(ids.values()) - {ids["gate_silu"]}
    else:
        # the residual epilogue wherever a skinny matmul serves o or down at 2-8 tokens (forced; on a GPU the tuner's)
        assert CUDA or (ids["residual"] in fused) == (force_gemv is True)
        plain = {ids["norm_rope"]: ids["rope"], ids["norm_gate_silu"]: ids["gate_silu"]}
        kinds = {plain.get(i, i) for i in fused} - {ids["residual"]}
        assert launches(fast[:1]) <= kinds <= launches(fast), (set(fused), launches(fast[:1]), launches(fast))
    assert CUDA or not launches(fast)


def test_qk_norm_models_fold_the_input_norm_into_qkv(tmp_path, monkeypatch):
    """Qwen3's q/k norms sit between q|k|v and the rotary, so its attention input cannot be the one-token
    norm -> q|k|v -> rotary kernel; the input norm still folds into the q|k|v matmul (the "norm" kind, tuned for
    q|k|v's shape too), and with it forced a decode step at batch 1 gives the torch path's tokens."""
    from executor_proc.backends import gemv_tuning

    import executor_proc.backends.triton_linears as tb

    write_config(tmp_path, layers=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    device = "cuda" if CUDA else "cpu"
    model = built(str(tmp_path), device, kernels="triton", cuda_graphs=False).worker.model
    keys = {job.key for job in gemv_tuning.prologue_jobs(model.backend, model)}
    assert {("norm", 128, 64, 1), ("norm", 192, 64, 1)} <= keys  # q|k|v (4 heads + 2 + 2 of 16), gate|up
    assert not any(kind in ("qkv", "rope") for kind, *_ in keys)
    fewer_attention_splits(monkeypatch)
    plans = scenario(vocab=97, steps=4, alone_from=2, admit_at=1, release_at=2)  # batch 1 from step 2
    ref = run_plans(built(str(tmp_path), device, kernels="torch").worker, plans)
    normed = []
    monkeypatch.setattr(tb, "gemv_prologue", lambda x, w, *a, _f=tb.gemv_prologue, **k: normed.append(w.shape[0])
                        or _f(x, w, *a, **k))
    worker = built(str(tmp_path), device, kernels="triton", cuda_graphs=False).worker
    worker.model.backend.prologue_everywhere = {"norm": ("row", 16, 256, 4, 4)}
    assert [t for _, t in run_plans(worker, plans)] == [t for _, t in ref]
    assert 128 in normed  # q|k|v took the fused norm at batch 1


@needs_cuda
@pytest.mark.parametrize("experts", [0, 16])
def test_graphs_equal_eager_bf16(tmp_path, experts):
    """Captured graphs give bit-identical greedy and sampled tokens to eager runs of the same buckets (a dense
    model, and an MoE one: its one-launch norm and routing at 1-4 rows, the unfused front at 8)."""
    model_dir = write_config(tmp_path, hidden=256, layers=3, heads=8, kv_heads=2, vocab=1000, intermediate=512,
                             experts=experts)
    stages = []
    shape = dict(dtype="bfloat16", num_slots=8, max_batch=8, block_size=16, num_blocks=512)
    graphed = built(model_dir, "cuda", progress=lambda *a: stages.append(a), **shape).worker
    eager = uncaptured(built(model_dir, "cuda", **shape).worker)
    eager.model.backend.use_choices_of(graphed.model.backend)  # the same kernels, with and without graphs
    n = graphed.num_graphs  # decode graphs: 2 modes per bucket; the mixed runner's bodies and heads
    assert n > 2 * len(graph_buckets(8)) and (GRAPH_STAGE, n, n) in stages
    # the start-up also showed its kernels compiling ahead and each tuning phase to its end
    assert {COMPILE_STAGE, "tuning skinny matmuls", "tuning fused kernels"} <= {s for s, _, _ in stages}
    assert all((s, t, t) in stages for s, _, t in stages if s.startswith("tuning"))
    for batch in (1, 2, 4, 8):
        planner = SyntheticPlanner(num_slots=8, block_size=16, num_blocks=512)
        g = torch.Generator().manual_seed(batch)
        for r in range(batch):
            sampling = GREEDY if r % 2 == 0 else SlotSampling(0.9, 20 * r, 0.95, 0.0, 1000 + r)
            planner.add(torch.randint(0, 1000, (17 + 5 * r,), generator=g).tolist(), sampling)
        plans = [planner.step() for _ in range(40)]
        a, b = run_plans(graphed, plans), run_plans(eager, plans)
        assert [k for k, _ in a[1:]] == [GraphStep.__name__] * 39
        assert a == [(ka, tb) for (ka, _), (_, tb) in zip(a, b)], f"batch {batch}"


@needs_cuda
def test_decode_loop_does_not_synchronize(tmp_path):
    """200 pipelined decode steps (with block appends and one admission) under sync debug mode "error"."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    worker = built(model_dir, "cuda", "bfloat16", num_slots=16, max_batch=16, num_blocks=1024).worker
    planner = SyntheticPlanner(num_slots=16, block_size=4, num_blocks=1024)
    for r in range(12):
        planner.add(list(range(r, r + 8)), GREEDY if r % 3 else SlotSampling(1.0, 0, 0.9, 0.0, r))
    in_flight: deque = deque()

    def step(plan):
        host, copy = worker.copy_out(worker.launch(worker.prepare(plan)))
        in_flight.append((host, copy))
        while len(in_flight) > 2:  # the output thread's part: wait for the oldest copy, read, release
            old_host, old_copy = in_flight.popleft()
            old_copy.synchronize()
            assert len(old_host.tolist()) > 0
            old_copy.release()

    for _ in range(5):
        step(planner.step())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(200):
            if i == 100:
                planner.add(list(range(50, 70)), GREEDY)  # one mixed prefill + decode step
            step(planner.step())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def features(r: int) -> SlotSampling:
    """Request r's sampling: every third plain greedy, the others with logprobs, penalties, bias, min_tokens."""
    if r % 3 == 0:
        return GREEDY
    return SlotSampling(0.0 if r % 3 == 1 else 0.9, 20 if r % 2 else 0, 1.0, 0.0, 500 + r, logprobs=r % 6,
                        repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2 * (r % 2),
                        min_tokens=4, num_prompt_tokens=8 + r, min_tokens_stop_ids=[7, 8],
                        logit_bias_ids=[11, 12], logit_bias_values=[3.0, -5.0])


def run_feature_plans(worker, plans, kinds: bool = False) -> list[tuple]:
    """Tokens and logprob fields per step (copy_out with the step, as the executor process does);
    with ``kinds``, the kind of step first."""
    out = []
    for plan in plans:
        step = worker.prepare(plan)
        host, copy = worker.copy_out(worker.launch(step), step)
        if copy is not None:
            copy.synchronize()
        row = (list(host) if isinstance(host, list) else host.tolist(), step.outputs.result_fields())
        out.append((type(step).__name__, *row) if kinds else row)
        if copy is not None:
            copy.release()
    return out


@needs_cuda
def test_feature_graphs_equal_eager_f32(tmp_path):
    """Penalties, logit_bias, min_tokens and logprobs in captured graphs: the same tokens and logprobs as eager."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    shape = dict(num_slots=8, max_batch=8, block_size=16, num_blocks=512)
    graphed = built(model_dir, "cuda", **shape).worker
    eager = uncaptured(built(model_dir, "cuda", **shape).worker)
    eager.model.backend.use_choices_of(graphed.model.backend)
    planner = SyntheticPlanner(num_slots=8, block_size=16, num_blocks=512)
    for r in range(8):
        planner.add(list(range(r, r + 8 + r)), features(r))
    plans = [planner.step() for _ in range(30)]
    a, b = run_feature_plans(graphed, plans), run_feature_plans(eager, plans)
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, fa), (_, fb) in zip(a, b):
        assert fa.get("logprob_rows") == fb.get("logprob_rows")
        for la, lb in zip(fa.get("logprobs", []), fb.get("logprobs", [])):
            assert la.top_ids == lb.top_ids
            assert abs(la.logprob - lb.logprob) < 1e-5
    assert any(f.get("logprobs") for _, f in a)


@needs_cuda
def test_feature_decode_loop_does_not_synchronize(tmp_path):
    """200 pipelined decode steps with logprobs and penalties (one mixed prefill step) under sync debug "error"."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    worker = built(model_dir, "cuda", "bfloat16", num_slots=16, max_batch=16, num_blocks=1024).worker
    planner = SyntheticPlanner(num_slots=16, block_size=4, num_blocks=1024)
    for r in range(12):
        planner.add(list(range(r, r + 8 + r)), features(r))
    in_flight: deque = deque()

    def step(plan):
        s = worker.prepare(plan)
        host, copy = worker.copy_out(worker.launch(s), s)
        in_flight.append((host, copy, s))
        while len(in_flight) > 2:
            old_host, old_copy, old = in_flight.popleft()
            old_copy.synchronize()
            assert len(old_host.tolist()) > 0 and old.outputs.result_fields()["logprobs"]
            old_copy.release()

    for _ in range(5):  # the first decode steps capture this mix's graph (a one-time sync)
        step(planner.step())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(200):
            if i == 100:  # one mixed prefill + decode step, with prompt logprobs
                planner.add(list(range(50, 70)), SlotSampling(0.0, 0, 1.0, 0.0, 0, prompt_logprobs=2,
                                                              num_prompt_tokens=20))
            step(planner.step())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_feature_fast_path_matches_torch_path(tmp_path, monkeypatch):
    """Penalties, bias, min_tokens, logprobs: torch path vs Triton eager vs the graph runner, step by step."""
    model_dir = write_config(tmp_path)
    fewer_attention_splits(monkeypatch)
    device = "cuda" if CUDA else "cpu"
    planner = SyntheticPlanner(num_slots=6, block_size=4, num_blocks=256)
    for r in range(5):
        planner.add([(7 * r + 3 * j) % 97 for j in range(8 + r)], features(r))
    # on the CPU 5 steps: the prefill and 3 decode steps under min_tokens' mask (4 tokens), one step after it lifts
    plans = [planner.step() for _ in range(8 if CUDA else 5)]
    runs = [run_feature_plans(built(model_dir, device, kernels="torch").worker, plans),
            run_feature_plans(built(model_dir, device, kernels="triton", cuda_graphs=False).worker, plans),
            run_feature_plans(built(model_dir, device, kernels="triton").worker, plans)]
    for run in runs[1:]:
        assert [t for t, _ in run] == [t for t, _ in runs[0]]
        for (_, fa), (_, fb) in zip(run, runs[0]):
            assert fa.get("logprob_rows") == fb.get("logprob_rows")
            for la, lb in zip(fa.get("logprobs", []), fb.get("logprobs", [])):
                assert la.top_ids == lb.top_ids and abs(la.logprob - lb.logprob) < 1e-4
