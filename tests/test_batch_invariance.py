"""``--batch-invariant``: a row's logits do not depend on the other rows of its step.

The matmul is checked against float64 and row by row (any subset of rows gives
the same bits as the whole); the model test runs one probe request alone and
then beside 1 to 63 other requests of random lengths and compares its prefill
token and its decode logits bit for bit.  On the CPU the Triton kernels run in
the interpreter on a tiny model (batches up to 5); on a GPU in bfloat16 on a
model with real tile counts (batches up to 64).
"""

from __future__ import annotations

import pytest
import torch

from executor_proc.testing.synthetic import SyntheticPlanner
from ipc.config import ExecutorConfig
from kernels import matmul
from kernels.matmul import MatmulConfig, choose_config, invariant_matmul
from tests.test_gpu_fastpath import built, write_config

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if CUDA else [torch.float32])
def test_invariant_matmul_matches_reference_and_every_row_subset(dtype):
    g = torch.Generator().manual_seed(0)
    for m, n, k, bias, split in ((70, 100, 300, True, None), (5, 130, 1024, False, 2), (65, 64, 960, True, 3)):
        x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
        w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
        b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
        full = invariant_matmul(x, w, b, split_k=split)
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        err = ((full.double() - ref).norm() / ref.norm()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), (m, n, k, split, err)
        picks = [[0], [m - 1], list(range(3, 5)), torch.randperm(m, generator=g)[: m // 2].tolist()]
        for rows in picks:
            assert torch.equal(invariant_matmul(x[rows], w, b, split_k=split), full[rows]), (m, n, k, split, rows)


def test_row_subset_check_notices_an_order_change():
    """The check above can fail: rows summed with another split of K (another order) differ in some bits from
    the same rows of the whole batch (on the CPU the interpreter's dot has one fixed order of its own, so only
    the kernel's own order is left to differ)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g).to(DEVICE)
    w = torch.randn(100, 300, generator=g).to(DEVICE)
    full = invariant_matmul(x, w, split_k=3)
    assert not torch.equal(invariant_matmul(x[:5], w, split_k=2), full[:5])


def h100_configs(monkeypatch) -> list[MatmulConfig]:
    """What :func:`choose_config` picks on a 132-SM GPU for the three kinds of weight (wide, long K, other)."""
    monkeypatch.setattr(matmul, "_num_sms", lambda device: 132)
    configs = [choose_config(n, k, torch.device("cuda")) for n, k in ((16384, 2048), (2048, 8192), (3072, 2048))]
    assert len(set(configs)) == 3 and configs[1].split_k > 1, configs
    return configs


def test_every_chosen_config_is_invariant(monkeypatch):
    """Each config the table can pick (its tile, warps, stages and split of K) gives any subset of rows the
    same bits as the whole batch, and the right result."""
    configs = h100_configs(monkeypatch)
    g = torch.Generator().manual_seed(1)
    dtype = torch.bfloat16 if CUDA else torch.float32
    m, n, k = 66, 200, 1100
    if not CUDA:  # the interpreter ignores warps and stages: configs of one K tile and split of K run one program
        # but for the width of their N tiles (all masked at n = 200), so the widest of them
        widest = {(c.block_k, c.split_k): c for c in sorted(configs, key=lambda c: c.block_n)}
        configs = [c for c in configs if c in widest.values()]
        assert len(configs) == 2, configs
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for config in configs:
        full = invariant_matmul(x, w, b, config=config)
        assert ((full.double() - ref).norm() / ref.norm()).item() < (1e-2 if CUDA else 1e-6), config
        for rows in ([0], [m - 1], list(range(5, 12)), torch.randperm(m, generator=g)[: m // 3].tolist()):
            assert torch.equal(invariant_matmul(x[rows], w, b, config=config), full[rows]), (config, rows)


def test_config_depends_on_the_weight_only(monkeypatch):
    assert choose_config(64, 64, torch.device(DEVICE)).split_k == 1  # one K tile: nothing to split
    wide, long_k, other = h100_configs(monkeypatch)
    assert wide.split_k == other.split_k == 1 and wide.block_n > other.block_n


def test_batch_invariant_needs_triton_kernels():
    with pytest.raises(ValueError, match="batch_invariant needs the Triton kernels"):
        ExecutorConfig(device="cpu", batch_invariant=True)
    ExecutorConfig(device="cpu", kernels="triton", batch_invariant=True)


def probe_outputs(worker, probe: list[int], others: list[list[int]], num_slots: int, decode_steps: int):
    """The probe's prefill token and its decode logits (row 0) with ``others`` in the same steps."""
    planner = SyntheticPlanner(num_slots=num_slots, block_size=16, num_blocks=4096)
    for prompt in [probe] + others:
        planner.add(prompt)
    tokens = worker.launch(worker.prepare(planner.step()))
    first = int(tokens[0])
    logits = []
    with torch.inference_mode():
        for _ in range(decode_steps):
            step = worker.prepare(planner.step())
            logits.append(worker.model(step.batch, worker.kv_cache)[0].clone())
            worker.launch(step)
    return first, logits


@pytest.mark.parametrize("kv_cache_dtype", ["auto", pytest.param("fp8", marks=pytest.mark.skipif(
    not CUDA, reason="an FP8 KV cache needs a GPU"))])
def test_logits_alone_equal_logits_in_batches(tmp_path, kv_cache_dtype):
    if CUDA:
        model_dir = write_config(tmp_path, hidden=1024, layers=2, heads=16, kv_heads=4, vocab=32000,
                                 intermediate=2816)
        sizes, lengths, dtype, steps = (1, 2, 3, 8, 17, 64), (20, 300), "bfloat16", 3
    else:  # the interpreter: 2 decode steps (a third runs the same kernels at the same shapes)
        model_dir = write_config(tmp_path)
        sizes, lengths, dtype, steps = (1, 2, 5), (3, 40), "float32", 2
    num_slots = max(sizes)
    worker = built(model_dir, DEVICE, dtype=dtype, kernels="triton", cuda_graphs=False, num_slots=num_slots,
                   max_batch=num_slots, block_size=16, num_blocks=4096, batch_invariant=True,
                   kv_cache_dtype=kv_cache_dtype).worker
    g = torch.Generator().manual_seed(3)
    vocab = worker.model.config.vocab_size
    prompt = lambda: torch.randint(0, vocab, (int(torch.randint(*lengths, (1,), generator=g)),),  # noqa: E731
                                   generator=g).tolist()
    probe = prompt()
    alone = probe_outputs(worker, probe, [], num_slots, decode_steps=steps)
    for size in sizes[1:]:
        first, logits = probe_outputs(worker, probe, [prompt() for _ in range(size - 1)], num_slots, steps)
        assert first == alone[0], size
        for step, (a, b) in enumerate(zip(alone[1], logits)):
            assert torch.equal(a, b), (size, step, (a - b).abs().max().item())
