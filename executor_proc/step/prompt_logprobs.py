"""Prompt logprobs on the eager prefill path: which logits a chunk needs, and their logprobs.

For a prefill row of a slot that asked (``prompt_logprobs >= 0``) covering positions
``[p, p + n)`` of a prompt of ``P`` tokens, the logprob of the prompt token at position
``t`` (``1 <= t < P``) is ``log_softmax(logits at t - 1)[token t]``, with the top-n of
the same distribution (float32, the model's raw logits, like sampled-token logprobs).
So the chunk needs the logits of its positions ``p .. min(p + n, P) - 2`` (the model
then computes the LM head for those tokens too, not only for the sampled ones), and
the token at ``p`` needs the *previous* chunk's last logits: that chunk's last final
hidden state is kept per slot, on the device (one ``[hidden]`` row, not the ``[vocab]``
float32 logits: 64 times smaller for Llama-3, so slots mid-prompt hold next to nothing
between steps), and the LM head runs on it again in the next chunk's step (only for
slots that asked; dropped at release or re-admission).  Position 0 has no logprob.  A chunk that starts
where no previous row was kept (a prefix-cache hit; a chunk of a request admitted
past its start) reports from ``p + 1``: the ``first`` position in the result says so.
Positions ``>= P`` (outputs re-prefilled after a preemption) are never reported.

:func:`plan_prompt_logprobs` is the host part (from the plan and the slot mirrors, no
device reads); :func:`compute_prompt_logprobs` the device part, ``token_logprobs`` over every reported
position of the step, the LM head and the logprobs :data:`LOGITS_ROWS` positions at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ipc.protocol import StepPlan

LOGITS_ROWS = 1024  # prompt positions whose logits are computed (and held) at once


@dataclass
class PromptRow:
    """One prefill row's share: ``count`` positions from ``first``, top-``n`` each."""

    row: int
    first: int
    count: int
    n: int


@dataclass
class PromptLogprobPlan:
    """Host layout of one step's prompt logprobs (see the module docstring).

    ``logits_index``: token indices whose logits the step computes after its sampled rows' ones (the "extra"
    block).  The input rows of ``token_logprobs`` are the kept rows' logits of the ``saved`` slots, then every row of
    the extra block in order, so that the block is read in slices straight from the LM head (no copy joining
    rows' pieces); ``targets``/``nums`` give each input row's prompt token and top-n (0 and 0 for the rows
    that only predict a next chunk's first token: computed, not reported).  ``order``: the input row of each
    reported position, in ``rows`` order (None: the same rows).  ``saves``: ``(slot, position, extra index)``
    hidden rows kept for the slot's next chunk.
    """

    rows: list[PromptRow] = field(default_factory=list)
    logits_index: list[int] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    nums: list[int] = field(default_factory=list)
    order: Optional[list[int]] = None
    saves: list[tuple[int, int, int]] = field(default_factory=list)
    targets_part: Optional[int] = None  # indices into the step's upload
    nums_part: Optional[int] = None
    # while planning: the saved and extra rows' targets and top-n, and each reported position's input row
    # (``~k``: the k-th saved row; ``e``: extra row e)
    _saved: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _extra: list[tuple[int, int]] = field(default_factory=list, repr=False)
    _reported: list[int] = field(default_factory=list, repr=False)

    def finish(self) -> "PromptLogprobPlan":
        """Lay the input rows out: saved rows first, then the extra block."""
        k = len(self.saved)
        inputs = self._saved + self._extra
        self.targets, self.nums = [t for t, _ in inputs], [n for _, n in inputs]
        order = [~r if r < 0 else k + r for r in self._reported]
        self.order = None if order == list(range(len(inputs))) else order
        return self


class SavedHidden:
    """Per slot: the last final hidden state of its previous prompt chunk and the position its logits predict."""

    def __init__(self):
        self.by_slot: dict[int, tuple[int, torch.Tensor]] = {}

    def forget(self, slots) -> None:
        if not self.by_slot:  # the common case (no prompt-logprob request in flight): every step calls this
            return
        for s in slots:
            self.by_slot.pop(s, None)

    def position(self, slot: int) -> int:
        entry = self.by_slot.get(slot)
        return -1 if entry is None else entry[0]


def plan_prompt_logprobs(plan: StepPlan, info, saved: SavedHidden) -> Optional[PromptLogprobPlan]:
    """The step's prompt-logprob layout, or None when no prefill row asks (``info``: the slot mirrors)."""
    out: Optional[PromptLogprobPlan] = None
    token_start = 0  # first token index of the row
    cursor = 0  # first prefill token of the row
    for i, (slot, n, p, prefill) in enumerate(zip(plan.slots, plan.num_tokens, plan.positions, plan.is_prefill)):
        si = info[slot]
        if prefill and si.prompt_logprobs >= 0 and p < si.num_prompt_tokens:
            out = out or PromptLogprobPlan()
            _plan_row(out, i, slot, p, n, si, plan.prefill_tokens[cursor:cursor + n], token_start, saved)
        token_start += n
        cursor += n if prefill else 0
    return out.finish() if out is not None else None


def _plan_row(out: PromptLogprobPlan, row: int, slot: int, p: int, n: int, si, chunk: list[int],
              token_start: int, saved: SavedHidden) -> None:
    end = min(p + n, si.num_prompt_tokens)  # prompt positions of the chunk: [p, end)
    keep = p + n < si.num_prompt_tokens  # the last logits predict the next chunk's first token
    extra = len(out.logits_index)
    inside = end - 1 - p  # positions p + 1 .. end - 1, predicted by the chunk's own logits
    out.logits_index += range(token_start, token_start + inside + keep)
    top = si.prompt_logprobs
    first = p if p >= 1 and saved.position(slot) == p else p + 1
    if first == p:
        out.saved.append(slot)
        out._saved.append((chunk[0], top))
        out._reported.append(~(len(out.saved) - 1))
    out._extra += [(t, top) for t in chunk[1:end - p]] + [(0, 0)] * keep
    out._reported += range(extra, extra + inside)
    if end > first:
        out.rows.append(PromptRow(row, first, end - first, top))
    if keep:
        out.saves.append((slot, p + n, extra + inside))


def compute_prompt_logprobs(backend, extra_hidden: Callable[[int, int], torch.Tensor],
                            head: Callable[[torch.Tensor], torch.Tensor], pl: PromptLogprobPlan, saved: SavedHidden,
                            targets: torch.Tensor, nums: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, logprobs) [M, 21]`` for the step's input rows (``pl.order`` picks the reported ones); keeps the
    chunks' last hidden rows.

    ``extra_hidden(a, b)``: the final hidden states of rows ``a .. b - 1`` of the step's extra block; ``head``:
    the LM head (float32 logits).  Logits are computed and consumed :data:`LOGITS_ROWS` rows at a time, one
    slice alive at once whatever the rows' lengths, so a step's peak memory does not grow with its prompt tokens
    (a full token budget's logits are gigabytes) and the start-up profile's one long row is its largest case.
    """
    saves = [(slot, position, extra_hidden(index, index + 1)[0].clone()) for slot, position, index in pl.saves]
    result = None
    if pl.rows:
        ids, values = [], []

        def logprobs(x: torch.Tensor, a: int) -> None:  # x: the logits of input rows a .. a + len(x) - 1
            out = backend.token_logprobs(x, targets[a:a + len(x)], nums[a:a + len(x)])
            ids.append(out[0])
            values.append(out[1])

        k, rows = len(pl.saved), len(pl.logits_index)
        for a in range(0, k, LOGITS_ROWS):
            logprobs(head(torch.stack([saved.by_slot[s][1] for s in pl.saved[a:a + LOGITS_ROWS]])), a)
        for a in range(0, rows, LOGITS_ROWS):
            logprobs(head(extra_hidden(a, min(a + LOGITS_ROWS, rows))), k + a)
        result = (ids[0], values[0]) if len(ids) == 1 else (torch.cat(ids), torch.cat(values))
    for slot, position, row in saves:
        saved.by_slot[slot] = (position, row)
    return result
