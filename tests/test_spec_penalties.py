"""Penalties at speculative positions (executor_proc/step/spec_penalties.py) against the reference applied to a
copy of the tables where the drafts before each position were sampled."""

from __future__ import annotations

import copy

import torch

from executor_proc.step.spec_penalties import penalise_positions, recount
from kernels.penalties_ref import PenaltyTables, apply_penalties_ref, count_sampled


def _tables(gen: torch.Generator, slots: int, vocab: int) -> PenaltyTables:
    t = PenaltyTables.allocate(slots, vocab, "cpu", max_bias=4, max_stop=3)
    t.output_counts[:] = torch.randint(0, 3, t.output_counts.shape, generator=gen, dtype=torch.int32) * \
        (torch.rand(t.output_counts.shape, generator=gen) < 0.3)
    t.prompt_mask[:] = torch.rand(t.prompt_mask.shape, generator=gen) < 0.3
    t.generated[:] = torch.tensor([0, 1, 2, 5])[:slots + 1]
    t.repetition[:] = torch.tensor([1.3, 1.0, 0.8, 1.0])[:slots + 1]
    t.frequency[:] = torch.tensor([0.5, 0.0, -0.3, 0.0])[:slots + 1]
    t.presence[:] = torch.tensor([0.2, 0.7, 0.0, 0.0])[:slots + 1]
    t.bias_ids[0, :2] = torch.tensor([3, 5], dtype=torch.int32)
    t.bias_values[0, :2] = torch.tensor([2.0, -1.5])
    t.stop_ids[:, 0] = 2
    t.stop_ids[1, 1] = 6
    t.min_tokens[:] = torch.tensor([3, 4, 0, 0])[:slots + 1]
    return t


def test_positions_see_the_drafts_before_them():
    gen = torch.Generator().manual_seed(0)
    vocab, K = 8, 4
    t = _tables(gen, 3, vocab)
    slots = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2])
    j = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1])
    row_drafts = {0: [5, 2, 5, 3], 1: [6, 2, 1, 0], 2: [4, 4, 0, 0]}
    drafts = torch.tensor([row_drafts[s] for s in slots.tolist()])
    raw = torch.randn(len(slots), vocab, generator=gen) * 3
    got = penalise_positions(apply_penalties_ref(raw, t, slots), raw, t, slots, drafts, j)
    for n, (s, jj) in enumerate(zip(slots.tolist(), j.tolist())):
        state = copy.deepcopy(t)
        before = torch.tensor(row_drafts[s][:jj], dtype=torch.int64)
        count_sampled(state, torch.full_like(before, s), before)
        want = apply_penalties_ref(raw[n:n + 1], state, torch.tensor([s]))[0]
        assert torch.equal(got[n], want), (n, got[n], want)


def test_recount_adds_and_undoes():
    t = PenaltyTables.allocate(2, 5, "cpu")
    recount(t, torch.tensor([0, 0, 1]), torch.tensor([3, 3, 1]), torch.tensor([1, 1, 0]))
    recount(t, torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]))
    assert t.output_counts[0, 3] == 1 and t.output_counts[1].sum() == 0 and t.generated.tolist() == [1, 0, 0]
