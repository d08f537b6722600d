"""A plan's rows and tokens as host arrays: the one layout both eager and graph-shaped steps start from.

For a :class:`ipc.protocol.StepPlan` of ``R`` rows and ``T`` tokens (rows in plan
order, a row's tokens consecutive)::

    query_start   [R+1]  cumulative query lengths
    context_lens  [R]    start position + query length (the row's KV after the step)
    token_rows    [T]    the row of each token
    positions     [T]    absolute position of each token
    ids           [T]    prompt token ids; -1 for a decode row's token (gathered on the device)
    sampled       [S]    indices of the rows that sample
    logits_index  [S]    token index of each sampled row's last token
    sample_positions [S] position of each sampled token (its row's context length)

Nothing here touches the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ipc.protocol import StepPlan


@dataclass
class PlanRows:
    slots: np.ndarray
    qlens: np.ndarray
    starts: np.ndarray
    is_prefill: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    token_rows: np.ndarray
    positions: np.ndarray
    ids: np.ndarray
    sampled: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.qlens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start[-1])

    @property
    def logits_index(self) -> np.ndarray:
        return self.query_start[self.sampled + 1] - 1

    @property
    def sample_positions(self) -> np.ndarray:
        return self.context_lens[self.sampled]

    @property
    def num_decode(self) -> int:
        """Rows before the first prefill row (the planner puts every decode row first)."""
        prefill = np.flatnonzero(self.is_prefill)
        return int(prefill[0]) if len(prefill) else self.num_rows

    def decode_rows_first(self) -> bool:
        """Every decode row (one token, no prompt) comes before every prefill row."""
        d = self.num_decode
        return bool(self.is_prefill[d:].all() and (self.qlens[:d] == 1).all())


def plan_rows(plan: StepPlan) -> PlanRows:
    """The host arrays of ``plan`` (module docstring)."""
    qlens = np.asarray(plan.num_tokens, dtype=np.int64)
    starts = np.asarray(plan.positions, dtype=np.int64)
    is_prefill = np.asarray(plan.is_prefill, dtype=bool)
    query_start = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int64)
    token_rows = np.repeat(np.arange(len(qlens)), qlens)
    positions = starts[token_rows] + np.arange(int(query_start[-1])) - query_start[token_rows]
    ids = np.full(len(positions), -1, dtype=np.int64)
    ids[is_prefill[token_rows]] = plan.prefill_tokens
    return PlanRows(
        slots=np.asarray(plan.slots, dtype=np.int64), qlens=qlens, starts=starts, is_prefill=is_prefill,
        query_start=query_start, context_lens=starts + qlens, token_rows=token_rows, positions=positions,
        ids=ids, sampled=np.flatnonzero(np.asarray(plan.sample, dtype=bool)))
