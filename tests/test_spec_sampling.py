"""Rejection sampling of drafts (kernels/spec_sample_ref.py): the emitted token follows the target distribution
(chi-square on a small vocabulary, keyed random numbers), and the test notices a wrong resampling step."""

from __future__ import annotations

import torch

from kernels.sampling_ref import hash_uniform
from kernels.spec_sample_ref import accept_uniform, point_mass_sample_ref, rejection_sample_ref

V, N = 6, 60_000
CHI2_999 = 20.52  # chi-square, 5 degrees of freedom, 99.9% quantile


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    want = p.double() * len(tokens)
    return float(((counts - want) ** 2 / want).sum())


def keyed(position: int):
    seeds = torch.arange(N, dtype=torch.int64) * 7919 + 11
    pos = torch.full((N,), position, dtype=torch.int64)
    return accept_uniform(seeds, pos), -torch.log(-torch.log(hash_uniform(seeds, pos, V)))


def test_rejection_sampling_follows_the_target():
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.40, 0.10, 0.10, 0.20, 0.05, 0.15])  # a draft model's distribution
    u, g = keyed(17)
    drafts = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))
    token, accepted = rejection_sample_ref(p.expand(N, V), q.expand(N, V), drafts, u, g)
    assert chi2(token, p) < CHI2_999
    want_accept = float(torch.minimum(p, q).sum())  # P(accept) = sum min(p, q)
    assert abs(float(accepted.double().mean()) - want_accept) < 0.01
    # A resample from p instead of norm(max(0, p - q)) must fail the same test.
    wrong = torch.where(accepted, drafts, (torch.log(p) + g).argmax(dim=1))
    assert chi2(wrong, p) > 10 * CHI2_999


def test_point_mass_drafts_follow_the_target_and_match_plain_sampling():
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    u, g = keyed(5)
    for d in (0, 1, 3):
        drafts = torch.full((N,), d, dtype=torch.int64)
        q = torch.nn.functional.one_hot(drafts, V).float()
        token, accepted = rejection_sample_ref(p.expand(N, V), q, drafts, u, g)
        assert chi2(token, p) < CHI2_999 and abs(float(accepted.double().mean()) - float(p[d])) < 0.01
        coupled, coupled_accepted = point_mass_sample_ref(torch.log(p).expand(N, V), drafts, g)
        assert chi2(coupled, p) < CHI2_999 and abs(float(coupled_accepted.double().mean()) - float(p[d])) < 0.01
        assert torch.equal(coupled, (torch.log(p) + g).argmax(dim=1))  # the plain sampler's token
        wrong = torch.where(accepted, drafts, (torch.log(p) + g).argmax(dim=1))  # resample from p, d included
        assert chi2(wrong, p) > 10 * CHI2_999
