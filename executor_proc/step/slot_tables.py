"""Per-slot state on the device, indexed by slot for a request's whole life.

    last_token   [num_slots + 1]              the slot's newest sampled token (next decode input)
    block_table  [num_slots + 1, max_blocks]  KV block ids, appended as the request grows
    temperature, top_k, top_p, min_p, seed [num_slots + 1]  sampling parameters
    num_logprobs [num_slots + 1]              top-n logprobs per sampled token (-1: none)
    penalties    :class:`kernels.penalties_ref.PenaltyTables`: token counts, prompt mask,
                 repetition / frequency / presence, logit_bias, min_tokens and its stop ids

The extra last row is the *padding slot*: the rows a CUDA-graph bucket has
beyond the step's real rows point at it.  It is greedy, asks for nothing, its
block table stays all zeros, and the step never writes KV for it, so whatever a
padded row computes is harmless and ignored.

Plans change these tables by diffs (admits, releases, block appends).  The
diffs ride in the step's one pinned host->device upload (:class:`TableDiff`
holds their place in it) and become indexed writes on the device, so applying a
plan never waits for the GPU.  An admission builds the slot's whole state,
the penalty tables' prompt mask and output counts from the request's tokens
(``Admit.tokens``) included: what the slot's KV came from (a prefill, a prefix
hit, a host onload, a recompute after preemption or restart) never shows.  Host mirrors of a few per-slot facts (greedy,
filtered, penalised, logprobs wanted) let the worker pick each step's sampling
variant without reading the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from executor_proc.backends.base import SamplingRows
from executor_proc.step.staging import HostUpload
from ipc.protocol import MAX_STOP_TOKEN_IDS, SlotSampling, StepPlan
from kernels.penalties_ref import MAX_BIAS, PenaltyTables, count_sampled, mark_prompt, reset_slots
from kernels.sampling_ref import is_greedy

# min_tokens masks the request's stop token ids and its EOS ids (a model has at most a few).
MAX_STOP = MAX_STOP_TOKEN_IDS + 8


@dataclass
class SlotInfo:
    """Host mirror of one slot's sampling facts (set at admission, never read from the device)."""

    greedy: bool = True
    filtered: bool = False  # top-k or top-p on
    penalised: bool = False  # repetition / frequency / presence / logit_bias / min_tokens
    num_logprobs: int = -1
    prompt_logprobs: int = -1
    num_prompt_tokens: int = 0


def slot_info(s: SlotSampling) -> SlotInfo:
    """What the worker needs on the host to choose a step's variant for a slot with sampling ``s``."""
    greedy = is_greedy(s.temperature)
    return SlotInfo(
        greedy=greedy,
        filtered=not greedy and (s.top_k > 0 or s.top_p < 1.0),
        penalised=(s.repetition_penalty != 1.0 or s.frequency_penalty != 0.0 or s.presence_penalty != 0.0
                   or bool(s.logit_bias_ids) or (s.min_tokens > 0 and bool(s.min_tokens_stop_ids))),
        num_logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs, num_prompt_tokens=s.num_prompt_tokens)


@dataclass
class TableDiff:
    """Where a plan's table changes sit in the step's upload (indices into ``HostUpload.send()``)."""

    releases: Optional[int] = None
    admit_slots: Optional[int] = None
    appends: Optional[int] = None
    # admitted slots' parameters -> upload index: a group of SlotTables._ADMIT_GROUPS by its index, a
    # table of SlotTables._ADMIT_ROWS by its name (only when some admitted slot needs it written)
    params: dict[object, int] = field(default_factory=dict)
    # admitted requests' tokens: (slots, tokens) of prompts, then (slots, tokens) of outputs if any
    tokens: tuple[int, ...] = ()


def _padded(rows: list[list], width: int, fill, dtype) -> np.ndarray:
    """``[len(rows) * width]`` flat, each row cut to ``width`` and padded with ``fill``."""
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        r = r[:width]
        out[i, :len(r)] = r
    return out.reshape(-1)


class SlotTables:
    def __init__(self, num_slots: int, max_blocks: int, device: torch.device, vocab: int = 0):
        """``vocab``: the logits' width, for the penalty tables (0: a table-only test, no penalties)."""
        self.num_slots = num_slots
        self.max_blocks = max_blocks
        self.device = device
        self.pad_slot = num_slots
        rows = num_slots + 1
        z = dict(device=device)
        self.last_token = torch.zeros(rows, dtype=torch.int64, **z)
        self.block_table = torch.zeros(rows, max_blocks, dtype=torch.int32, **z)
        self.penalties = PenaltyTables.allocate(num_slots, max(vocab, 1), device, max_bias=MAX_BIAS,
                                                max_stop=MAX_STOP)
        # The per-slot scalars, one [fields, rows] tensor per dtype: each table (temperature, ...,
        # penalties.min_tokens) is a contiguous row of its group, and an admission writes a group in one
        # indexed write (three launches rather than ten: a mixed step's host time, docs/performance.md).
        self._groups = []
        for dtype, fields in self._ADMIT_GROUPS:
            group = torch.empty(len(fields), rows, dtype=dtype, **z)
            for i, (name, default, _) in enumerate(fields):
                group[i].fill_(default)
                owner, attr = self._owner(name)
                setattr(owner, attr, group[i])
            self._groups.append(group)
        self.temperature[self.pad_slot] = 0.0  # padded rows take the sampler's cheapest (greedy) path
        # Slots whose logit_bias / min_tokens stop-id rows may hold a request's values (not -1 / 0): an
        # admission rewrites those rows only when it sets them or when the slot's last request did.
        self._extras_set: set[int] = set()
        self.info = [SlotInfo() for _ in range(rows)]
        # [rows, ceil(vocab / 32)] int32 bitmasks of the constrained slots (executor_proc/step/grammar.py owns it;
        # None without structured outputs).
        self.grammar_mask: Optional[torch.Tensor] = None
        # Live slots with a penalty or a logprobs request: while empty, a step needs no look at them.
        self.featured: set[int] = set()

    def sampling_rows(self, slots: torch.Tensor, positions: torch.Tensor, filtered: bool = True) -> SamplingRows:
        """The sampling parameters of ``slots``, gathered on the device, for tokens at ``positions``."""
        return SamplingRows(slots, self.temperature[slots], self.top_k[slots], self.top_p[slots],
                            self.min_p[slots], self.seed[slots], positions, filtered)

    # Every per-slot scalar written at admission, by dtype: (table, its value before any admission, its
    # value from SlotSampling).
    _ADMIT_GROUPS = (
        (torch.float32, (("temperature", 1.0, lambda s: s.temperature), ("top_p", 1.0, lambda s: s.top_p),
                         ("min_p", 0.0, lambda s: s.min_p),
                         ("penalties.repetition", 1.0, lambda s: s.repetition_penalty),
                         ("penalties.frequency", 0.0, lambda s: s.frequency_penalty),
                         ("penalties.presence", 0.0, lambda s: s.presence_penalty))),
        (torch.int64, (("top_k", 0, lambda s: s.top_k), ("seed", 0, lambda s: s.seed))),
        (torch.int32, (("num_logprobs", -1, lambda s: s.logprobs), ("penalties.min_tokens", 0, lambda s: s.min_tokens))),
    )
    # The [rows, width] tables of token ids and values written at admission (neutral: -1 ids, 0 values).
    _ADMIT_ROWS = (("bias_ids", -1, np.int32, torch.int32, lambda s: s.logit_bias_ids),
                   ("bias_values", 0.0, np.float32, torch.float32, lambda s: s.logit_bias_values),
                   ("stop_ids", -1, np.int32, torch.int32, lambda s: s.min_tokens_stop_ids))

    def _owner(self, name: str) -> tuple[object, str]:
        """(object, attribute) of a table named like ``"penalties.min_tokens"``."""
        *path, attr = name.split(".")
        obj = self
        for part in path:
            obj = getattr(obj, part)
        return obj, attr

    def stage(self, plan: StepPlan, upload: HostUpload) -> TableDiff:
        """Add the plan's table changes to the step's upload."""
        diff = TableDiff()
        if plan.releases:
            diff.releases = upload.add(plan.releases, torch.int64)
            for slot in plan.releases:
                self.info[slot] = SlotInfo()
                self.featured.discard(slot)
        if plan.admits:
            s = [a.sampling for a in plan.admits]
            diff.admit_slots = upload.add([a.slot for a in plan.admits], torch.int64)
            for g, (dtype, fields) in enumerate(self._ADMIT_GROUPS):  # [fields, admits], field-major
                diff.params[g] = upload.add([value(x) for _, _, value in fields for x in s], dtype)
            extras = [bool(x.logit_bias_ids or x.min_tokens_stop_ids) for x in s]
            if any(extras) or any(a.slot in self._extras_set for a in plan.admits):
                p = self.penalties
                for name, fill, np_dtype, dtype, value in self._ADMIT_ROWS:
                    table = getattr(p, name)
                    diff.params[name] = upload.add(_padded([value(x) for x in s], table.shape[1], fill, np_dtype), dtype)
                for a, has in zip(plan.admits, extras):
                    (self._extras_set.add if has else self._extras_set.discard)(a.slot)
            diff.tokens = self._stage_tokens(plan, upload)
            for a in plan.admits:
                info = self.info[a.slot] = slot_info(a.sampling)
                if info.penalised or info.num_logprobs >= 0 or info.prompt_logprobs >= 0:
                    self.featured.add(a.slot)
                else:
                    self.featured.discard(a.slot)
        if plan.block_appends:
            diff.appends = upload.add(plan.block_appends, torch.int64)
        return diff

    @staticmethod
    def _stage_tokens(plan: StepPlan, upload: HostUpload) -> tuple[int, ...]:
        """Admitted requests' tokens, split where their outputs start (a resumed request has some): the
        prompt's mark the penalty prompt mask, the outputs count as sampled."""
        prompt_slots, prompt_tokens, out_slots, out_tokens = [], [], [], []
        for a in plan.admits:
            if a.tokens:
                p = a.sampling.num_prompt_tokens
                prompt_slots += [a.slot] * min(p, len(a.tokens))
                prompt_tokens += a.tokens[:p]
                out_slots += [a.slot] * max(len(a.tokens) - p, 0)
                out_tokens += a.tokens[p:]
        parts = (prompt_slots, prompt_tokens) + ((out_slots, out_tokens) if out_slots else ())
        return tuple(upload.add(x, torch.int64) for x in parts) if prompt_slots else ()

    def apply(self, diff: TableDiff, sent: list[torch.Tensor]) -> None:
        """Releases, then admissions, then block-table appends (a plan may reuse a freed slot)."""
        # index_fill_, not `t[idx] = 0`: a Python scalar there is copied host->device synchronously.
        if diff.releases is not None:
            self.block_table.index_fill_(0, sent[diff.releases], 0)
        if diff.admit_slots is not None:
            slots = sent[diff.admit_slots]
            for key, part in diff.params.items():
                if isinstance(key, int):
                    group = self._groups[key]
                    group[:, slots] = sent[part].view(group.shape[0], -1)
                else:
                    table = getattr(self.penalties, key)
                    table[slots] = sent[part].view(-1, table.shape[1])
            self.block_table.index_fill_(0, slots, 0)
            reset_slots(self.penalties, slots)
            if diff.tokens:
                mark_prompt(self.penalties, sent[diff.tokens[0]], sent[diff.tokens[1]])
                if len(diff.tokens) == 4:
                    count_sampled(self.penalties, sent[diff.tokens[2]], sent[diff.tokens[3]])
        if diff.appends is not None:
            a = sent[diff.appends].view(-1, 3)
            self.block_table[a[:, 0], a[:, 1]] = a[:, 2].to(torch.int32)
