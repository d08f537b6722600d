"""Logprobs, penalties and the windowed sampler against their torch references.

Without CUDA the Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, set before
any kernel module is imported) at small shapes; with CUDA the same tests run on the GPU plus
larger shapes and no-sync / CUDA-graph checks.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from kernels.logprobs_ref import token_logprobs_ref  # noqa: E402
from kernels.penalties_ref import (PenaltyTables, apply_penalties_ref, count_sampled, mark_prompt,  # noqa: E402
                                   reset_slots)
from kernels.sampling_ref import sample as sample_ref  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda" if ON_GPU else "cpu")

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: inf - inf in masked lanes


# --------------------------------------------------------------------------- penalties


def _penalty_tables(num_slots, V, gen, max_bias=8, max_stop=4):
    """Random tables: slot i % 5 == 0 has every penalty off, the others a mix."""
    t = PenaltyTables.allocate(num_slots, V, DEV, max_bias=max_bias, max_stop=max_stop)
    slots = torch.arange(num_slots, device=DEV)
    prompt_slots = torch.randint(0, num_slots, (num_slots * 20,), generator=gen).to(DEV)
    mark_prompt(t, prompt_slots, torch.randint(0, V, (num_slots * 20,), generator=gen).to(DEV))
    for _ in range(6):  # a few "steps" of sampled tokens, with repeats
        count_sampled(t, slots, torch.randint(0, min(V, 50), (num_slots,), generator=gen).to(DEV))
    for q in range(num_slots):
        kind = q % 5
        if kind == 0:
            continue
        t.repetition[q] = 1.0 + float(torch.rand(1, generator=gen)) if kind in (1, 4) else 1.0
        t.frequency[q] = float(torch.rand(1, generator=gen)) * 4 - 2 if kind in (2, 4) else 0.0
        t.presence[q] = float(torch.rand(1, generator=gen)) * 4 - 2 if kind in (3, 4) else 0.0
        nb = int(torch.randint(0, max_bias + 1, (1,), generator=gen))
        t.bias_ids[q, :nb] = torch.randperm(V, generator=gen)[:nb].to(torch.int32).to(DEV)
        t.bias_values[q, :nb] = (torch.rand(nb, generator=gen) * 200 - 100).to(DEV)
        t.stop_ids[q, :2] = torch.randint(0, V, (2,), generator=gen).to(torch.int32).to(DEV)
        t.min_tokens[q] = 10 if q % 2 else 3  # generated == 6: masked on odd slots only
    return t


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("S,V", [(10, 700)] + ([(64, 128256)] if ON_GPU else []))
def test_penalties_match_reference(S, V, in_place):
    from kernels.penalties import apply_penalties

    g = torch.Generator().manual_seed(S + V)
    t = _penalty_tables(S + 2, V, g, max_bias=8 if V < 1000 else 300, max_stop=4)
    slots = torch.randperm(S + 2, generator=g)[:S].to(DEV)
    logits = (torch.randn(S, V, generator=g) * 4).to(DEV)
    ref = apply_penalties_ref(logits, t, slots)
    raw = logits.clone()
    out = apply_penalties(logits, t, slots, out=logits if in_place else None)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-5)
    if not in_place:
        assert torch.equal(logits, raw)
    off = (t.repetition[slots] == 1) & (t.frequency[slots] == 0) & (t.presence[slots] == 0) & (t.bias_ids[slots, 0] < 0)
    assert off.any() and torch.equal(out[off], raw[off])


def test_penalty_formulas_by_hand():
    """One slot, small vocab: each rule written out explicitly (HF / OpenAI semantics)."""
    from kernels.penalties import apply_penalties

    V = 8
    t = PenaltyTables.allocate(2, V, DEV, max_bias=3, max_stop=2)
    mark_prompt(t, torch.tensor([0, 0], device=DEV), torch.tensor([1, 2], device=DEV))
    count_sampled(t, torch.tensor([0, 0, 0], device=DEV), torch.tensor([2, 3, 3], device=DEV))
    t.repetition[0], t.frequency[0], t.presence[0] = 2.0, 0.5, 0.25
    t.bias_ids[0, :2] = torch.tensor([5, 6], dtype=torch.int32)
    t.bias_values[0, :2] = torch.tensor([100.0, -100.0])
    t.stop_ids[0, 0], t.min_tokens[0] = 7, 4  # generated == 3 < 4: token 7 masked
    x = torch.tensor([[1.0, 3.0, -2.0, 4.0, 1.0, 0.0, 2.0, 9.0]], device=DEV)
    want = torch.tensor([[1.0, 1.5, -4.0 - 0.5 - 0.25, 2.0 - 1.0 - 0.25, 1.0, 100.0, -98.0, float("-inf")]])
    for f in (apply_penalties, apply_penalties_ref):
        assert torch.equal(f(x, t, torch.tensor([0], device=DEV)).cpu(), want)
    count_sampled(t, torch.tensor([0], device=DEV), torch.tensor([4], device=DEV))  # generated 4: unmasked
    assert apply_penalties(x, t, torch.tensor([0], device=DEV))[0, 7] == 9.0
    reset_slots(t, torch.tensor([0], device=DEV))
    assert t.output_counts[0].sum() == 0 and not t.prompt_mask[0].any() and t.generated[0] == 0


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("S,V,dtype", [(9, 1000, torch.float32), (5, 3001, torch.bfloat16)]
                         + ([(64, 128256, torch.float32)] if ON_GPU else []))
def test_logprobs_match_reference(S, V, dtype):
    from kernels.logprobs import token_logprobs

    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(S, V, generator=g) * 4).to(dtype).to(DEV)
    tokens = torch.randint(0, V, (S,), generator=g).to(DEV)
    n = torch.tensor([(-1, 0, 1, 5, 20)[i % 5] for i in range(S)], dtype=torch.int32, device=DEV)
    ids, lps = token_logprobs(logits, tokens, n)
    rids, rlps = token_logprobs_ref(logits, tokens, n)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(lps, rlps, rtol=0, atol=1e-4)
    assert (ids[n < 0] == -1).all() and (ids[n >= 0, 0] == tokens[n >= 0]).all()
    want = torch.log_softmax(logits.float(), -1)
    assert torch.allclose(lps[n >= 0, 0], want[n >= 0].gather(1, tokens[n >= 0, None])[:, 0], atol=1e-4)
