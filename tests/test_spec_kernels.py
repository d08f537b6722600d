"""Speculation's device pieces on small shapes: the n-gram kernel (CPU interpreter, or CUDA when present)
against its torch reference and a plain Python statement of the rule; acceptance, the kernel against its
reference and the reference against the rule."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from kernels.ngram import ngram_drafts  # noqa: E402
from kernels.ngram_ref import ngram_drafts_ref  # noqa: E402
from kernels.spec_accept import accept_drafts  # noqa: E402
from kernels.spec_accept_ref import accept_drafts_ref, accept_prefix  # noqa: E402
from kernels.spec_inputs import graph_inputs  # noqa: E402
from kernels.spec_inputs_ref import graph_inputs_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rule(seq: list[int], k: int, nmin: int, nmax: int) -> list[int]:
    """The longest suffix (nmax down to nmin) that ends earlier, the most recent end, proposes what followed (the
    copy repeating itself past the end)."""
    n = len(seq)
    for m in range(min(nmax, n), nmin - 1, -1):
        for e in range(n - 1, m - 1, -1):
            if seq[e - m:e] == seq[n - m:]:
                return [seq[e + i % (n - e)] for i in range(k)]
    return [0] * k


@pytest.mark.parametrize("nmin,nmax,k", [(1, 4, 4), (2, 3, 8), (1, 1, 3)])
def test_ngram_drafts_match_the_rule(nmin, nmax, k):
    rng = random.Random(nmin * 10 + nmax)
    num_slots, width = 6, 300  # a row longer than the kernel's block of 256 ends
    tokens = torch.tensor([[rng.randrange(5) for _ in range(width)] for _ in range(num_slots)], dtype=torch.int32)
    slots = torch.tensor([3, 0, 5, 1, 2, 4])
    lengths = torch.tensor([1, 2, 7, 40, 299, 257])
    tokens[4, 280:299] = torch.arange(100, 119)  # a fresh tail: no match for nmin > 1
    want = torch.tensor([rule(tokens[s, :n].tolist(), k, nmin, nmax) for s, n in zip(slots.tolist(), lengths.tolist())])
    assert torch.equal(ngram_drafts_ref(tokens, slots, lengths, k, nmin, nmax), want)
    got = ngram_drafts(tokens.to(DEVICE), slots.to(DEVICE), lengths.to(DEVICE), k, nmin, nmax).cpu()
    assert torch.equal(got, want)


def test_accept_prefix_is_the_longest_agreeing_prefix():
    drafts = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [1, 6, 7, 8], [5, 6, 9, 8], [5, 6, 7, 8]])
    target = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9]])
    ks = torch.tensor([4, 2, 4, 4, 0])
    assert accept_prefix(drafts, target, ks).tolist() == [4, 2, 0, 2, 0]


@pytest.mark.parametrize("padded", [False, True])
def test_accept_kernel_matches_reference(padded):
    """Rows of every accepted count 0..k for k = 0..K (``padded``: every row laid out K wide, as the speculative
    graphs do), among rows that sampled without speculating; the output and the three tables equal the
    reference's, and each row's accepted count is the rule's."""
    K, rng = 4, random.Random(7)
    cases = [(k, a) for k in range(K + 1) for a in range(k + 1)]
    rows = len(cases)
    num_slots, width = rows + 2, 64
    slots = torch.tensor(rng.sample(range(num_slots), rows))
    base = torch.tensor([rng.randrange(1, 40) for _ in range(rows)])
    ks = torch.tensor([k for k, _ in cases])
    widths = torch.full((rows,), K) if padded else ks
    gen = torch.Generator().manual_seed(7)
    drafts = torch.randint(1, 50, (rows, K), generator=gen)
    chosen = []
    for r, (k, a) in enumerate(cases):  # the first a drafts chosen, then a different token
        row = drafts[r, :a].tolist() + [int(drafts[r, a]) + 1 if a < K else 99]
        chosen += row + [rng.randrange(1, 50) for _ in range(int(widths[r]) + 1 - len(row))]
    chosen = torch.tensor(chosen)
    first_tok = torch.cumsum(widths + 1, 0) - (widths + 1)
    num_sampled = rows + 3
    sampled_at = torch.tensor(sorted(rng.sample(range(num_sampled), rows)))
    tokens = torch.randint(100, 200, (num_sampled,), generator=gen)
    tables = (torch.zeros(num_slots, dtype=torch.int64),
              torch.randint(0, 9, (num_slots, width), dtype=torch.int32, generator=gen),
              torch.zeros(num_slots, dtype=torch.int64))

    def run(fn, device):
        t = [x.clone().to(device) for x in tables]
        out = fn(*(x.to(device) for x in (chosen, drafts, ks, slots, base, sampled_at, first_tok, tokens)), *t, K)
        return [out.cpu()] + [x.cpu() for x in t]

    want = run(accept_drafts_ref, "cpu")
    assert want[0][-rows:].tolist() == [a for _, a in cases]
    for got, ref in zip(run(accept_drafts, DEVICE), want):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("width", [4, 0])
def test_graph_inputs_kernel_matches_reference(width):
    """A speculative graph's inputs in one launch against the torch ops: rows at the plan's position or the slot's
    device length, 0 to K drafts, a padding row on the padding slot, every row ``width + 1`` positions wide (0: a
    step without drafts); the bases, drafts, ids, positions, context lengths and the token table all equal."""
    K, pad, rng = 4, 6, random.Random(width)
    tokens = torch.tensor([[rng.randrange(4) for _ in range(300)] for _ in range(pad + 1)], dtype=torch.int32)
    last_token = torch.tensor([rng.randrange(4) for _ in range(pad + 1)], dtype=torch.int64)
    lengths = torch.tensor([5, 280, 0, 17, 40, 9, 0], dtype=torch.int64)
    slots = torch.tensor([3, 1, 0, 4, 5, pad])
    ks = torch.tensor([K, 2, 0, K, 1, K]) if width else torch.zeros(6, dtype=torch.int64)
    start = torch.tensor([-1, -1, 3, 12, -1, 0])
    want_tokens = tokens.clone()
    want = graph_inputs_ref(want_tokens, slots, ks, start, last_token, lengths, pad, K, width, 1, 4)
    got_tokens = tokens.to(DEVICE)
    got = graph_inputs(got_tokens, slots.to(DEVICE), ks.to(DEVICE), start.to(DEVICE), last_token.to(DEVICE),
                       lengths.to(DEVICE), pad, K, width, 1, 4)
    for name, g, w in zip(("base", "drafts", "ids", "positions", "lengths"), got, want):
        assert torch.equal(g.cpu(), w), (name, g, w)
    assert torch.equal(got_tokens.cpu(), want_tokens)
    assert want[3].view(6, width + 1)[-1].eq(0).all()  # the padding row: position 0
