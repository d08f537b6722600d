"""SlotTables: admissions write every per-slot parameter (grouped by dtype), and the logit_bias /
min_tokens stop-id rows only when a slot gets them or its previous request had them."""

from __future__ import annotations

import msgspec
import pytest
import torch

from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.staging import PinnedStaging
from ipc.protocol import Admit, SlotSampling, StepPlan

PLAIN = SlotSampling(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
FULL = SlotSampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1234, logprobs=3,
                    repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.25, min_tokens=4,
                    min_tokens_stop_ids=[7, 9], logit_bias_ids=[3, 5], logit_bias_values=[-2.0, 1.5])


def _apply(tables: SlotTables, staging: PinnedStaging, admits=(), releases=()):
    upload = staging.upload()
    plan = StepPlan(0, [], [], [], [], [], admits=list(admits), releases=list(releases))
    diff = tables.stage(plan, upload)
    tables.apply(diff, upload.send())
    return diff


def test_admission_writes_every_parameter_and_the_bias_rows_only_when_needed():
    tables = SlotTables(4, 8, torch.device("cpu"), vocab=32)
    staging = PinnedStaging(torch.device("cpu"))
    p = tables.penalties
    assert tables.temperature[tables.pad_slot] == 0.0 and tables.temperature[0] == 1.0  # pad slot: greedy
    assert tables.num_logprobs.tolist() == [-1] * 5 and tables.temperature.is_contiguous()

    _apply(tables, staging, [Admit(1, FULL), Admit(2, PLAIN)])
    want = dict(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=1234, num_logprobs=3, repetition=1.2,
                frequency=0.5, presence=0.25, min_tokens=4)
    for name, value in want.items():
        table = getattr(tables, name) if hasattr(tables, name) else getattr(p, name)
        assert table[1].item() == torch.tensor(value, dtype=table.dtype).item(), name
    assert p.bias_ids[1, :3].tolist() == [3, 5, -1] and p.bias_values[1, :2].tolist() == [-2.0, 1.5]
    assert p.stop_ids[1, :3].tolist() == [7, 9, -1]
    assert tables.temperature[2] == 0.0 and p.repetition[2] == 1.0 and p.bias_ids[2].eq(-1).all()

    # a plain request in a slot that never had extras: the bias and stop-id rows are not sent
    diff = _apply(tables, staging, [Admit(3, PLAIN)])
    assert set(diff.params) == {0, 1, 2}
    # slot 1 again, now plain: its old bias / stop ids are cleared, and then it is clean
    diff = _apply(tables, staging, [Admit(1, PLAIN)], releases=[1])
    assert {"bias_ids", "bias_values", "stop_ids"} <= set(diff.params)
    assert p.bias_ids[1].eq(-1).all() and p.bias_values[1].eq(0).all() and p.stop_ids[1].eq(-1).all()
    assert p.repetition[1] == 1.0 and p.min_tokens[1] == 0 and tables.num_logprobs[1] == -1
    assert set(_apply(tables, staging, [Admit(1, PLAIN)], releases=[1]).params) == {0, 1, 2}


def test_admission_builds_the_penalty_state_from_the_request_tokens():
    """Prompt tokens mark the prompt mask, later ones (a resumed request's outputs) count as sampled, whatever
    the step computes; a re-admission starts from nothing but its own tokens."""
    tables = SlotTables(4, 8, torch.device("cpu"), vocab=32)
    staging = PinnedStaging(torch.device("cpu"))
    p = tables.penalties
    full = msgspec.structs.replace(FULL, num_prompt_tokens=3)
    resumed = SlotSampling(0.0, 0, 1.0, 0.0, 0, frequency_penalty=0.5, num_prompt_tokens=3)
    _apply(tables, staging, [Admit(0, full, [5, 6, 5]), Admit(2, resumed, [1, 2, 3, 9, 9, 4]), Admit(3, PLAIN)])
    assert p.prompt_mask[0].nonzero().flatten().tolist() == [5, 6] and p.output_counts[0].eq(0).all()
    assert p.generated[0] == 0
    assert p.prompt_mask[2].nonzero().flatten().tolist() == [1, 2, 3]
    assert p.output_counts[2, 9] == 2 and p.output_counts[2, 4] == 1 and p.generated[2] == 3
    assert not p.prompt_mask[3].any() and p.output_counts[3].eq(0).all()
    _apply(tables, staging, [Admit(2, msgspec.structs.replace(FULL, num_prompt_tokens=1), [7])], releases=[2])
    assert p.prompt_mask[2].nonzero().flatten().tolist() == [7] and p.output_counts[2].eq(0).all()
    assert p.generated[2] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_admission_with_tokens_does_not_synchronize():
    """Building the penalty state from an admission's tokens is indexed writes only: no host sync."""
    device = torch.device("cuda")
    tables = SlotTables(4, 8, device, vocab=32)
    staging = PinnedStaging(device)
    s = SlotSampling(0.0, 0, 1.0, 0.0, 0, repetition_penalty=1.3, frequency_penalty=0.5, num_prompt_tokens=3)
    _apply(tables, staging, [Admit(1, s, [1, 2, 3, 9, 9, 4])], releases=[1])  # first calls may allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(10):
            _apply(tables, staging, [Admit(1, s, [1, 2, 3, 9, 9, 4 + i % 3]), Admit(2, s, [5, 6, 7])], releases=[1, 2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    p = tables.penalties
    assert p.prompt_mask[1].nonzero().flatten().tolist() == [1, 2, 3] and p.output_counts[1, 9] == 2
    assert p.generated[1] == 3 and p.generated[2] == 0
