"""Speculative rows on the device: n-gram drafts, one verify pass, acceptance, next inputs.

Design.  The scheduler runs a step ahead, so when it plans a speculative row it does not know how many tokens
the slot's previous row accepted: it sends only an upper bound of the row's position (``StepPlan.positions``)
and the row's draft count ``k`` (``StepPlan.num_drafts``), and reserves KV for the worst case.  Everything that
depends on the accepted counts stays on the device, in two per-slot tables::

    tokens   [num_slots + 1, max_len + K + 2]  int32: the slot's tokens by position (admission: Admit.tokens)
    lengths  [num_slots + 1]                  position of the slot's newest token (the next row's first input)

A speculative row starts at ``lengths[slot]`` (at the plan's position for the slot's first speculative row,
whose position the scheduler knows exactly; the host remembers which slots have run one, ``live``).  Before the
forward the step writes ``last_token`` at that position, proposes ``K`` drafts (by prompt lookup over
``tokens[slot, :length + 1]``, :mod:`kernels.ngram`, or as a draft model's greedy tokens,
:mod:`executor_proc.step.draft`), and makes the row's ``k + 1`` input ids (the last token,
then the drafts), positions and context length from the device length: into the mixed-step runner's static inputs
(its body graph replays them; the rows pack as chunks, and the sampled rows' and every drafted position's hidden
states come out) when the step fits its buckets, else into an eager step's batch; a step whose every row
speculates greedily runs each position as a decode row, the whole step one graph
(:mod:`executor_proc.step.spec_graphs`).  After
the forward, the logits of every position of the row give the target ``g[0..k]``: the token the plain sampler
draws there (the argmax for a greedy row; else :func:`kernels.sampling_ref.sample`'s keyed Gumbel race at the
token's position).  The row accepts the longest prefix of drafts equal to it (``d[j] == g[j - 1]``) and emits
``g[0..a]`` (``a`` accepted drafts, then the model's own token: the correction, or the bonus token when all are
accepted).  For a sampled row this *is* rejection sampling of a point-mass draft (:mod:`kernels.spec_sample_ref`):
a draft is accepted with probability ``p(d) = min(1, p(d) / q(d))``, and at the first rejection the token, given that
it is not ``d``, follows ``norm(max(0, p - q))``; the coupling through the position's keyed random numbers makes the
output that of plain sampling token for token, whatever the depth, the batch mates or the drafts.  Then, on the device:
``last_token = g[a]``, ``lengths += a + 1``, ``tokens[length + 1 ..] = g``.  Positions past the accepted ones
hold rejected drafts' KV, which the next row overwrites (its positions start right after the accepted ones).

The result carries each row's first token in ``token_ids`` and its ``k`` further tokens and accepted count in
``StepResult.spec_tokens`` / ``num_accepted``: one device tensor, cut on the host by :meth:`SpecStep.split`.
Only verifiable slots (``scheduler_proc.speculation.verifiable``: no grammar or prompt logprobs) speculate;
the planner decides that.  The torch backend (the CPU's) attends a row over its host upper bound and masks the
keys past each query's device position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

import dataclasses

from executor_proc.step.batch import ForwardBatch
from executor_proc.step.draft import DraftModel, DraftStep
from executor_proc.step.mixed_step import MixedInputs, MixedShape
from executor_proc.step.plan_rows import PlanRows
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.spec_penalties import penalise_positions, recount
from ipc.config import SpeculativeConfig
from ipc.protocol import StepPlan
from kernels.ngram_ref import ngram_drafts_ref
from kernels.spec_accept_ref import accept_drafts_ref
from kernels.spec_inputs_ref import graph_inputs_ref, row_starts


def build_speculator(sc: SpeculativeConfig, num_slots: int, max_len: int, device: torch.device,
                     draft: Optional[DraftModel] = None) -> Optional["Speculator"]:
    """The executor's speculative state for ``--speculative-method`` (None: off); ``draft``: the draft model of
    method ``draft`` (:mod:`executor_proc.step.draft`)."""
    if sc.method is None:
        return None
    return Speculator(sc, num_slots, max_len, device, draft)


def accept_drafts(chosen: torch.Tensor, *args) -> torch.Tensor:
    """The Triton kernel on CUDA, its torch reference elsewhere."""
    if chosen.is_cuda:
        from kernels.spec_accept import accept_drafts as kernel

        return kernel(chosen, *args)
    return accept_drafts_ref(chosen, *args)


def ngram_drafts(tokens, slots, lengths, k, ngram_min, ngram_max) -> torch.Tensor:
    """The Triton kernel on CUDA, its torch reference elsewhere."""
    if tokens.is_cuda:
        from kernels.ngram import ngram_drafts as kernel

        return kernel(tokens, slots, lengths, k, ngram_min, ngram_max)
    return ngram_drafts_ref(tokens, slots, lengths, k, ngram_min, ngram_max)


def graph_inputs(*args) -> tuple[torch.Tensor, ...]:
    """The Triton kernel on CUDA, its torch reference elsewhere."""
    if args[0].is_cuda:
        from kernels.spec_inputs import graph_inputs as kernel

        return kernel(*args)
    return graph_inputs_ref(*args)


def row_arrays(spec, slots, ks, start, query_start, sampled_at, widths=None) -> list[np.ndarray]:
    """A step's speculative rows as the host arrays its device work reads (in this order, concatenated in the
    upload): the rows' plan indices, slots, draft counts, first positions (-1: the device's length), places among
    the sampled rows; each token's row, place in its row and token index (``query_start``: each row's first);
    the first and further tokens' places among the rows' tokens.
    ``widths``: the further tokens per row laid out (default ``ks``; more: positions past a row's drafts)."""
    widths = ks if widths is None else widths
    lens = widths + 1
    tok_row = np.repeat(np.arange(len(spec)), lens)  # every token of the speculative rows, row by row
    tok_j = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    tok_index = query_start[tok_row] + tok_j
    first_tok, extra_tok = np.flatnonzero(tok_j == 0), np.flatnonzero(tok_j > 0)  # row after row
    return [spec, slots, ks, start, sampled_at, tok_row, tok_j, tok_index, first_tok, extra_tok]


@dataclass
class SpecStep:
    """One step's speculative rows: where their host arrays sit in the upload, and how to cut the result."""

    rows: int = 0  # speculative rows
    extra: int = 0  # their further tokens, flat (sum of k)
    num_sampled: int = 0  # the step's sampled rows (token_ids)
    fill: Optional[int] = None  # upload index of admitted slots' (slot, position, token) triples
    part: Optional[int] = None  # upload index of the rows' and tokens' arrays
    num_tokens: int = 0  # speculative rows' tokens (logits rows at the end of the sample index)
    logits_index: Optional[np.ndarray] = None  # their token indices (host)
    spec_rows: Optional[np.ndarray] = None  # their row indices (host)
    sizes: tuple[int, ...] = ()  # the lengths of the arrays at ``part``
    parts: Optional[list] = None  # those arrays on the device (bind)
    state: Optional[tuple] = None  # slots, drafts per row, first positions, drafts (bind -> verify)
    draft: Optional[DraftStep] = None  # the draft model's passes (method "draft")
    greedy: bool = True  # every speculative row is greedy (host mirrors): the verify is an argmax
    filtered: bool = False  # some sampled speculative row has top-k or top-p
    extra_logprobs: Optional[list[int]] = None  # top-n of each further token's row, when some row asked (else None)
    penalised: bool = False  # some speculative row has penalties, logit_bias or min_tokens
    host: Optional[list[np.ndarray]] = None  # the rows' plan indices, slots, draft counts, first positions, places
    # every row laid out K wide (the speculative graphs): each speculative row's place among them and draft count
    padded: Optional[list[tuple[int, int]]] = None
    bucket: int = 0  # with ``padded``: the rows laid out, padding rows last (their output is cut away)
    width: int = 0  # with ``padded``: further positions a row (K; 0 when no row has drafts)

    def split(self, host: list[int]) -> tuple[list[int], dict]:
        """``token_ids`` and the StepResult's speculative fields from the step's one host list."""
        s, e = self.num_sampled, self.num_sampled + self.extra
        if self.padded is not None:  # ``bucket`` first tokens, ``width`` further tokens a row (its first ``k``)
            n = self.bucket
            width, accepted = self.extra // n, n + self.extra
            spec = [t for r, k in self.padded for t in host[n + r * width:n + r * width + k]]
            return host[:s], {"spec_tokens": spec, "num_accepted": [host[accepted + r] for r, _ in self.padded]}
        return host[:s], {"spec_tokens": host[s:e], "num_accepted": host[e:e + self.rows]}


class Speculator:
    """The per-slot tables and the step's speculative work (module docstring)."""

    def __init__(self, sc: SpeculativeConfig, num_slots: int, max_len: int, device: torch.device,
                 draft: Optional[DraftModel] = None):
        k = self.k = sc.num_tokens
        self.ngram_min, self.ngram_max = sc.ngram_min, sc.ngram_max
        self.values_per_slot = sc.values_per_slot()  # a slot's one-token rows and outputs in a step (K + 2)
        self.draft = draft  # None: drafts by prompt lookup
        rows = num_slots + 1
        self.tokens = torch.zeros(rows, max_len + k + 2, dtype=torch.int32, device=device)  # token ids fit 31 bits
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=device)
        self.live: set[int] = set()

    def stage_admits(self, plan: StepPlan, upload) -> Optional[SpecStep]:
        """Add the admitted slots' tokens to the upload (None: no admission with tokens)."""
        for slot in plan.releases:
            self.live.discard(slot)
        step = None
        admits = [a for a in plan.admits if a.tokens]
        for a in plan.admits:
            self.live.discard(a.slot)
        if self.live:  # a plain row starts where the plan says: the device length is stale after it
            drafts = plan.num_drafts
            self.live.difference_update(s for i, s in enumerate(plan.slots) if not drafts or drafts[i] < 0)
        if admits:
            step = SpecStep()
            n = sum(len(a.tokens) for a in admits)
            fill = np.empty((3, n), dtype=np.int64)
            fill[0] = np.repeat([a.slot for a in admits], [len(a.tokens) for a in admits])
            fill[1] = np.concatenate([np.arange(len(a.tokens)) for a in admits])
            fill[2] = np.concatenate([a.tokens for a in admits])
            step.fill = upload.add(fill.reshape(-1), torch.int64)
        return step

    def stage_rows(self, plan: StepPlan, rows: PlanRows, step: Optional[SpecStep], info=None) -> SpecStep:
        """The plan's speculative rows on the host (``step.host``) and how they sample (``info``: the slot tables'
        host mirrors, for the verify's sampling variant); :meth:`stage_tokens` (or the speculative graphs) then
        add their device arrays to the upload."""
        step = step or SpecStep()
        drafts = np.asarray(plan.num_drafts, dtype=np.int64)
        spec = np.flatnonzero(drafts >= 0)
        slots = rows.slots[spec]
        ks = drafts[spec]
        start = np.where([s in self.live for s in slots.tolist()], -1, rows.starts[spec])  # -1: the device's
        self.live.update(slots.tolist())
        sampled_at = np.searchsorted(rows.sampled, spec)  # each speculative row's place among the sampled rows
        step.host, step.spec_rows = [spec, slots, ks, start, sampled_at], spec
        step.rows, step.num_sampled = len(spec), len(rows.sampled)
        infos = [info[s] for s in slots.tolist()] if info is not None else []
        step.greedy = all(i.greedy for i in infos)
        step.filtered = any(i.filtered for i in infos)
        step.penalised = any(i.penalised for i in infos)
        if any(i.num_logprobs >= 0 for i in infos):  # each further token's row's
            step.extra_logprobs = [infos[r].num_logprobs for r in np.repeat(np.arange(len(spec)), ks).tolist()]
        return step

    def stage_tokens(self, step: SpecStep, rows: PlanRows, upload) -> None:
        """Add the rows' device arrays (:func:`row_arrays`) to the upload; their token indices in
        ``logits_index``."""
        spec, slots, ks, start, sampled_at = step.host
        parts = row_arrays(spec, slots, ks, start, rows.query_start[spec], sampled_at)
        step.part = upload.add(np.concatenate(parts), torch.int64)
        step.extra, step.num_tokens = len(parts[9]), len(parts[5])
        step.sizes, step.logits_index = tuple(len(p) for p in parts), parts[7]

    def apply(self, step: Optional[SpecStep], sent: list[torch.Tensor]) -> None:
        """Admitted slots' tokens into the table (after the slot tables' own admissions); the rows' arrays."""
        if step is not None and step.fill is not None:
            fill = sent[step.fill].view(3, -1)
            self.tokens[fill[0], fill[1]] = fill[2].to(torch.int32)
        if step is not None and step.part is not None:
            step.parts = list(torch.split(sent[step.part], step.sizes))

    def token_inputs(self, step: SpecStep, tables: SlotTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' drafts (kept for the verify), then each token's input id and position and each row's context
        length, from the device lengths."""
        _, slots, ks, start, _, tok_row, tok_j = step.parts[:7]
        last, base = row_starts(self.tokens, slots, start, tables.last_token, self.lengths)
        if self.draft is None:
            drafts = ngram_drafts(self.tokens, slots, base + 1, self.k, self.ngram_min, self.ngram_max)
        else:  # the draft model's passes (the step's prefill chunks ride in its first)
            drafts = self.draft.run(step.draft, tables, self.tokens, (slots, ks, base))
        step.state = (slots, ks, base, drafts)
        inputs = torch.cat([last[:, None], drafts], dim=1)  # [rows, K + 1]
        return inputs[tok_row, tok_j], base[tok_row] + tok_j, base + ks + 1

    def graph_inputs(self, step: SpecStep, tables: SlotTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`token_inputs` for a speculative graph's rows (n-gram drafts), every row ``step.width + 1``
        positions wide: each position's input id, position and context length, the positions past a row's drafts
        and the padding rows' at 0 (:mod:`kernels.spec_inputs`: one launch on CUDA)."""
        _, slots, ks, start = step.parts[:4]
        base, drafts, ids, positions, lens = graph_inputs(self.tokens, slots, ks, start, tables.last_token,
                                                          self.lengths, tables.pad_slot, self.k, step.width,
                                                          self.ngram_min, self.ngram_max)
        step.state = (slots, ks, base, drafts)
        return ids, positions, lens

    def bind(self, step: SpecStep, batch: ForwardBatch, tables: SlotTables) -> None:
        """An eager step's batch: the rows' input ids, positions, KV indices and context lengths."""
        spec, slots, tok_row, tok_index = step.parts[0], step.parts[1], step.parts[5], step.parts[7]
        ids, pos, lens = self.token_inputs(step, tables)
        bs = batch.block_size
        batch.input_ids = batch.input_ids.index_put((tok_index,), ids)
        batch.positions = batch.positions.clone().index_put_((tok_index,), pos)
        blocks = tables.block_table[slots[tok_row], pos // bs].to(torch.int64)
        batch.kv_index = batch.kv_index.clone().index_put_((tok_index,), blocks * bs + pos % bs)
        batch.context_lens = batch.context_lens.clone().index_put_((spec,), lens.to(batch.context_lens.dtype))

    def bind_mixed(self, step: SpecStep, inputs: MixedInputs, tables: SlotTables) -> None:
        """A mixed-runner step: the same, written into the runner's static inputs (its graphs read them)."""
        ids, pos, lens = self.token_inputs(step, tables)
        inputs.ids.index_put_((step.parts[7],), ids)
        inputs.positions.index_put_((step.parts[7],), pos)
        inputs.context_lens.index_put_((step.parts[0],), lens)

    @staticmethod
    def mixed_rows(rows: PlanRows, step: SpecStep) -> PlanRows:
        """``rows`` as the mixed runner packs them: speculative rows as chunks (after the decode rows)."""
        chunk = rows.is_prefill.copy()
        chunk[step.spec_rows] = True
        return dataclasses.replace(rows, is_prefill=chunk)

    @staticmethod
    def mixed_pack(packed: np.ndarray, shape: MixedShape, step: SpecStep) -> np.ndarray:
        """The speculative positions' token indices after the sampled rows' in the packed ``sample_index``."""
        at = 2 * shape.max_rows
        for name, n in shape.lengths().items():  # the buffer's order (mixed_step.pack)
            if name == "sample_index":
                break
            at += n
        packed[at + step.num_sampled:at + step.num_sampled + step.num_tokens] = step.logits_index
        return packed

    def verify(self, step: SpecStep, logits: torch.Tensor, tokens: torch.Tensor, tables: SlotTables,
               backend, outputs=None, counted: bool = False) -> torch.Tensor:
        """Accept each row's drafts from its positions' ``logits [num_tokens, vocab]``; update the tables; the
        step's one output tensor: ``tokens`` (the first token of each speculative row in its place), the rows'
        further tokens, their accepted counts.  With logprobs asked, ``outputs.logprobs`` (the sampled rows') get
        each speculative row's first token's in its row and every further token's after them.  ``counted``: the
        step's sampling counted each sampled row's draw for the penalties; a speculative row's is replaced by the
        tokens it emits (:mod:`executor_proc.step.spec_penalties`)."""
        slots, ks, base, drafts = step.state
        _, _, _, _, sampled_at, tok_row, tok_j, _, first_tok, extra_tok = step.parts[:10]
        pen, slot_tok = tables.penalties, slots[tok_row]
        if counted:
            recount(pen, slots, tokens[sampled_at], torch.full_like(slots, -1))
        x = logits
        if step.penalised:  # each position as if the drafts before it were sampled
            x = penalise_positions(backend.apply_penalties(logits, pen, slot_tok, in_place=False), logits, pen,
                                   slot_tok, drafts[tok_row], tok_j)
        chosen = self._targets(step, x, slot_tok, base[tok_row] + tok_j + 1, tables, backend)
        if step.extra_logprobs is not None and outputs is not None and outputs.logprobs is not None:
            ids, lps = backend.token_logprobs(logits, chosen, tables.num_logprobs[slots[tok_row]])
            row_ids, row_lps = outputs.logprobs
            outputs.logprobs = (torch.cat([row_ids.index_put((sampled_at,), ids[first_tok]), ids[extra_tok]]),
                                torch.cat([row_lps.index_put((sampled_at,), lps[first_tok]), lps[extra_tok]]))
        return self.accept(step, chosen, tokens, tables, counted)

    def accept(self, step: SpecStep, chosen: torch.Tensor, tokens: torch.Tensor, tables: SlotTables,
               counted: bool = False) -> torch.Tensor:
        """Given the token the plain sampler gives at each of the rows' positions (``chosen``): accept the drafts,
        update the tables, and make the step's one output tensor (:meth:`verify`)."""
        slots, ks, base, drafts = step.state
        _, _, _, _, sampled_at, tok_row, tok_j, _, first_tok, _ = step.parts[:10]
        out = accept_drafts(chosen, drafts, ks, slots, base, sampled_at, first_tok, tokens, tables.last_token,
                            self.tokens, self.lengths, self.k)
        if counted:
            accepted = out[out.shape[0] - step.rows:]
            recount(tables.penalties, slots[tok_row], chosen, tok_j <= accepted[tok_row])
        return out

    @staticmethod
    def _targets(step: SpecStep, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                 tables: SlotTables, backend) -> torch.Tensor:
        """The token the plain sampler gives at each position (``positions``: of the token sampled, keying the
        slot's random stream): the argmax when every row is greedy."""
        if step.greedy:
            return logits.argmax(dim=-1)
        return backend.sample(logits, tables.sampling_rows(slots, positions, step.filtered))
