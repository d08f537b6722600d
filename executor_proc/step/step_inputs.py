"""A plan's rows as the host arrays a step uploads, and an eager step's batch built from what arrived.

A pure-decode step in a graph bucket takes ``[3, bucket]`` slots, positions and context lengths
(:func:`decode_rows`); an eager step takes its token- and row-level arrays (:func:`eager_rows`) and gathers
its input ids and KV write locations on the device from the slot tables (:func:`eager_batch`).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from executor_proc.step.batch import ForwardBatch
from executor_proc.step.plan_rows import PlanRows
from executor_proc.step.prompt_logprobs import PromptLogprobPlan
from executor_proc.step.sample import SamplingMode
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.step_kinds import EagerStep
from ipc.protocol import StepPlan

__all__ = ["decode_rows", "eager_batch", "eager_rows"]


def decode_rows(plan: StepPlan, bucket: int, pad_slot: int) -> np.ndarray:
    """``[3, bucket]`` slots, positions, context lengths; padded rows: padding slot, 0, 1."""
    rows = np.empty((3, bucket), dtype=np.int64)
    rows[0] = pad_slot
    rows[1] = 0
    rows[2] = 1
    n = len(plan.slots)
    rows[0, :n] = plan.slots
    rows[1, :n] = plan.positions
    rows[2, :n] = rows[1, :n] + 1
    return rows.reshape(-1)


def eager_rows(rows: PlanRows, upload, prompt: Optional[PromptLogprobPlan],
               spec_index: Optional[np.ndarray] = None) -> dict[str, int]:
    """Add the token- and row-level inputs of an eager step to the upload; their parts by name.

    The logits computed are the sampled rows' last tokens', then (prompt logprobs) ``prompt.logits_index``,
    then every position of the speculative rows (``spec_index``).
    """
    slots = rows.slots
    logits_index = rows.logits_index
    if prompt is not None:
        logits_index = np.concatenate([logits_index, np.asarray(prompt.logits_index, dtype=np.int64)])
        if prompt.targets:
            prompt.targets_part = upload.add(prompt.targets, torch.int64)
            prompt.nums_part = upload.add(prompt.nums, torch.int32)
    if spec_index is not None:
        logits_index = np.concatenate([logits_index, spec_index])
    return dict(
        ids=upload.add(rows.ids, torch.int64),  # -1: a decode row's token, gathered from last_token
        positions=upload.add(rows.positions, torch.int64),
        token_slots=upload.add(slots[rows.token_rows], torch.int64),
        row_slots=upload.add(slots, torch.int64),
        query_start=upload.add(rows.query_start, torch.int32),
        context_lens=upload.add(rows.context_lens, torch.int32),
        sample_index=upload.add(logits_index, torch.int64),
        sample_slots=upload.add(slots[rows.sampled], torch.int64),
        sample_positions=upload.add(rows.sample_positions, torch.int64),
    )


def eager_batch(tables: SlotTables, block_size: int, plan: StepPlan, sent: list[torch.Tensor],
                parts: dict[str, int], mode: SamplingMode) -> EagerStep:
    """The eager step of the arrays :func:`eager_rows` uploaded (``sent``: the upload on the device)."""
    t, bs = tables, block_size
    ids, pos, token_slots = sent[parts["ids"]], sent[parts["positions"]], sent[parts["token_slots"]]
    block_ids = t.block_table[token_slots, pos // bs].to(torch.int64)
    batch = ForwardBatch(
        input_ids=torch.where(ids < 0, t.last_token[token_slots], ids),
        positions=pos,
        kv_index=block_ids * bs + pos % bs,
        query_start=sent[parts["query_start"]],
        context_lens=sent[parts["context_lens"]],
        block_tables=t.block_table[sent[parts["row_slots"]]],
        sample_index=sent[parts["sample_index"]],
        sample_slots=sent[parts["sample_slots"]],
        host_query_lens=list(plan.num_tokens),
        host_context_lens=[s + n for s, n in zip(plan.positions, plan.num_tokens)],
        block_size=bs,
    )
    return EagerStep(batch, sent[parts["sample_positions"]], mode)
