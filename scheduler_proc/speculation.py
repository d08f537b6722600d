"""Speculative rows in the plans, and their accepted counts in reconcile: the scheduler's half of speculation.

A request whose sampling a verify step reproduces exactly (:func:`verifiable`: no grammar or prompt logprobs;
penalties see the drafts before each position) speculates once speculative decoding is on.
After its prompt every row of it is a *speculative row* of ``k + 1`` tokens (``k <= K`` drafts): the executor
proposes the drafts on the device (n-gram lookup in the slot's tokens, or a draft model's greedy tokens), runs
the row, keeps the longest prefix of drafts the model's sampler agrees with (its argmax, or its keyed draw:
rejection sampling of a point-mass draft) plus one token of its own, and moves the slot's length on the device.
So a row emits 1 to ``k + 1`` tokens, and the scheduler learns how many one step late, after it has planned the
next rows.

It plans for the worst case and reconciles the outcome::

    num_computed   upper bound of the KV positions written: every draft in flight counted as accepted
    spec_lag       drafts in flight not yet accepted or rejected (num_computed - spec_lag: the lower bound)

A row is planned at the upper bound (``StepPlan.positions`` is only that bound; the executor starts the row at
the slot's device length), with blocks reserved for ``num_computed + k + 1`` tokens, and only while the lower
bound of its tokens is short of ``max_tokens`` (length finishes stay known ahead, at worst one row late).
When the step comes back, each row's ``k - accepted`` rejected drafts leave ``num_computed``; the blocks past the
new bound stay with the request, whose next rows write there again (they are what the next worst case
reserves: a block that held rejected drafts is reused, never leaked), and go back to the pool at its drain
with the rest.  The first token of a row is reconciled with every other row's; the accepted ones
follow through the same finish rules, one token at a time, so a stop token, a stop string, ``max_tokens`` or
``min_tokens`` inside an accepted run ends the request there and the rest of the run is dropped.  Aborts,
preemption and restarts need nothing more: a request that left still has its bounds tightened until its last
step is back, so its drain publishes exactly the KV that was written.

Adaptive (n-gram drafts): each request keeps a running mean of the drafts its rows accept (``spec_rate``, an
exponential average); a speculative row costs more than a plain one (the default model's step about 20% more at
batch 1 on an H200), so it pays while its rows accept more than about 0.2 drafts, and when the mean falls below
``PAUSE_BELOW``, a little above that, the request pauses (``_paused``): once its drafts
in flight are back (its length exact again) it runs plain decode rows, which the executor's graphs run, for a number
of steps, then speculates again from its exact position with the mean at ``RESUME_RATE``.  The pause doubles from
``PAUSE_MIN`` to ``PAUSE_MAX`` steps while the mean stays low and drops back once it rises past the resume value: a
text being edited has short stretches of new words between long copied ones (a long first pause lost them), a chat
answer little to copy at all (its pauses grow until speculation costs almost nothing).  A draft model's requests
never pause (``Limits.spec_pauses``): the draft's KV cache is written by speculative rows and prefill chunks only,
so plain rows would leave it behind.

Where the drafts would come from (n-gram drafts): a row gets drafts only where its request's known tokens end in an
n-gram of ``--ngram-min`` tokens seen earlier among them (:func:`ends_in_repeat`); elsewhere the device's lookup, which
sees one or two steps more, most likely finds nothing, and the row runs without drafts: one position, which a step
of such rows runs in a graph of one position a row (:mod:`executor_proc.step.spec_graphs`), where a row of ``K``
drafts runs ``K + 1``.  With that step and its inputs in one launch, the default model at K = 4 on an H200 went from
1.69x to 1.86x on the edit prompts and from 0.99x to 1.05x on chat (docs/performance.md).  Such rows count as no
speculative row in the metrics.

A mixin of :class:`~scheduler_proc.planner.Planner`, which owns the state (``_speculating``: the speculating
requests past their prompt; ``_paused``: those pausing).
"""

from __future__ import annotations

from ipc.protocol import SlotSampling, StepResult
from scheduler_proc.request import Request, Status
from scheduler_proc.steps import InflightStep, Output, StepDraft

__all__ = ["DraftCounts", "Speculation", "verifiable"]

_RUNNING = Status.RUNNING
_FINISHED = Status.FINISHED

RATE_START = 2.0  # accepted drafts a row, a request's mean before its first row (six rows of none pause it)
RATE_WEIGHT = 0.3  # of each row's accepted count in the mean
PAUSE_BELOW = 0.3  # accepted drafts a row below which the request pauses
# Against 0.5, replaying the default model's greedy outputs of short edit prompts and the chat
# prompts under a cost model of the H200's steps (plain 0.638 ms, speculative 0.764), the edits gain 8% at K = 8
# (4% at K = 4) and chat 3%; outputs with nothing to copy lose 2% more before their first pause.  Served on the
# H200 (medians of five rounds, docs/performance.md): edits +1.5% at K = 4, +2.7% at K = 8; chat within 1%.
RESUME_RATE = 1.0  # the mean a request speculates again with (four rows of none pause it again)
PAUSE_MIN = 4  # plain decode steps of its first pause; each pause with the mean low since doubles it
PAUSE_MAX = 64


def pause_steps(pauses: int) -> int:
    """Plain decode steps of a request's pause after ``pauses`` earlier ones with its mean low since."""
    return min(PAUSE_MIN << min(pauses, 16), PAUSE_MAX)


def ends_in_repeat(req: Request, n: int) -> bool:
    """Whether the request's last ``n`` known tokens (prompt and received output) occur earlier among them.  Where
    they do not, the device's lookup, which matches ``n`` tokens at least, most likely finds no draft for the row
    being planned (its table holds these tokens and the one or two steps' in flight).  The n-grams are counted as
    the tokens come back (``req.spec_grams``: tokens themselves at ``n = 1``), each once, and the answer is kept
    until more come (about 1 us a row a step on the CPU)."""
    known = req.num_known
    if req.spec_indexed < known:
        grams = req.spec_grams
        first = max(req.spec_indexed, n - 1)  # where the first n-gram not counted yet ends
        tokens = req.known_tokens(first - n + 1, known)
        if n == 1:
            for token in tokens:
                grams[token] = grams.get(token, 0) + 1
            last = tokens[-1]
        else:
            for end in range(n, len(tokens) + 1):
                gram = tuple(tokens[end - n:end])
                grams[gram] = grams.get(gram, 0) + 1
            last = tuple(tokens[-n:])
        req.spec_repeats = known >= n and grams.get(last, 0) > 1
        req.spec_indexed = known
    return req.spec_repeats


def verifiable(s: SlotSampling) -> bool:
    """Whether a speculative row verifies this slot's drafts exactly: the plain sampler's token at each drafted
    position, penalised as if the drafts before it were sampled (a grammar's mask would need its matcher there;
    prompt logprobs keep their prefill path)."""
    return s.prompt_logprobs < 0 and not s.grammar


class DraftCounts:
    """Drafts verified and accepted since start-up (the server's stats and metrics)."""

    __slots__ = ("rows", "drafted", "accepted")

    def __init__(self):
        self.rows = self.drafted = self.accepted = 0


class Speculation:
    """Planning speculative rows and applying their accepted counts (the state is the Planner's)."""

    def spec_drafts_for(self, sampling: SlotSampling) -> int:
        """Drafts per row for a request admitted with ``sampling`` (0: it runs without speculation)."""
        return self.limits.num_speculative_tokens if verifiable(sampling) else 0

    def _move_paused(self, step_id: int) -> None:
        """Paused requests whose drafts are all back run plain decode rows; those whose pause is over speculate."""
        for req in list(self._paused.values()):
            rid = req.rid
            if rid in self._speculating and not req.spec_lag:
                del self._speculating[rid]
                req.spec_resume = step_id + pause_steps(req.spec_pauses)
                req.spec_pauses += 1
                if req.num_computed + 1 < req.max_total:
                    self._decoding[rid] = req
            elif rid in self._decoding and step_id >= req.spec_resume:
                del self._decoding[rid], self._paused[rid]
                self._speculating[rid] = req
                req.spec_rate = RESUME_RATE

    def _plan_speculative(self, draft: StepDraft) -> None:
        """One row of ``k + 1`` tokens per speculating request that may still need tokens (module docstring)."""
        max_len = self.limits.max_model_len
        for req in list(self._speculating.values()):
            if draft.budget == 0:
                break
            if req.status is not _RUNNING:
                continue  # preempted by an earlier row of this plan
            low = req.num_computed + 1 - req.spec_lag  # fewest tokens it will have once its steps are back
            k = 0 if req.rid in self._paused else req.spec_k  # paused: no drafts while its last ones come back
            if k and req.spec_grams is not None and not ends_in_repeat(req, self.limits.spec_lookup_ngram):
                k = 0  # the device's lookup would most likely find none: a row of one position
            k = min(k, req.max_total - low - 1, max_len - req.num_computed - 1, draft.budget - 1)
            if low >= req.max_total or k < 0:
                continue  # a length finish in flight, or its bound must come back first
            if not self._reserve(req, req.num_computed + k + 1, draft):
                draft.blocked = True
                continue
            draft.rows.append(req)
            draft.slots.append(req.slot)
            draft.positions.append(req.num_computed)
            draft.spec.append((req, k))
            draft.budget -= k + 1
            req.num_computed += k + 1
            req.spec_lag += k
            req.last_step = draft.step_id

    def _reconcile_spec(self, step: InflightStep, result: StepResult, outputs: list[Output]) -> None:
        """The speculative rows' accepted counts: bounds tightened (the blocks past them stay for the next rows),
        accepted tokens applied (each row's first token was applied with the other rows'), rejecting rows paused."""
        if len(result.num_accepted) != len(step.spec) or len(result.spec_tokens) != sum(k for _, k in step.spec):
            raise RuntimeError(f"step {step.step_id}: {len(result.num_accepted)} accepted counts and "
                               f"{len(result.spec_tokens)} drafted tokens for speculative rows "
                               f"{[k for _, k in step.spec]}")
        by_rid = {out.request.rid: out for out in outputs}
        counts = self.spec_drafts
        logprobs = result.spec_logprobs
        cursor = 0
        for (req, k), accepted in zip(step.spec, result.num_accepted):
            if not 0 <= accepted <= k:
                raise RuntimeError(f"step {step.step_id}: {accepted} of {k} drafts accepted")
            run = result.spec_tokens[cursor:cursor + accepted]
            run_logprobs = logprobs[cursor:cursor + accepted] if logprobs else None
            cursor += k
            req.spec_lag -= k
            req.num_computed -= k - accepted
            if k and self.limits.spec_pauses:
                req.spec_rate += RATE_WEIGHT * (accepted - req.spec_rate)
                if req.spec_rate > RESUME_RATE:  # a stretch that pays: its next pause is short again
                    req.spec_pauses = 0
                if req.spec_rate < PAUSE_BELOW and req.status is _RUNNING and req.rid in self._speculating:
                    self._paused[req.rid] = req
            out = by_rid.get(req.rid)
            if out is not None and out.finish_reason is None and req.status is not _FINISHED:
                emitted = self._spec_tokens(req, run, out, run_logprobs)
                if not k:
                    continue  # a row without drafts is no speculative row in the counts
                # counted for the request and the server: its drafts and those accepted, none past a finish (a
                # finish inside the run: the drafts up to it, all accepted; a row of a request that finished
                # before it or at its first token counts nothing)
                drafted = emitted if out.finish_reason is not None else k
                counts.rows += 1
                counts.drafted += drafted
                counts.accepted += emitted
                req.spec_drafted += drafted
                req.spec_accepted += emitted

    def _spec_tokens(self, req: Request, tokens: list[int], out: Output, logprobs) -> int:
        """Apply an accepted run after the row's first token (and its logprobs when the request asked), stopping at
        the first finish; how many of its tokens were applied."""
        stop_tokens = self._stop_tokens
        extras = req.extras
        wants = extras is not None and extras.logprobs
        if wants and tokens and (logprobs is None or len(logprobs) != len(tokens)):
            raise RuntimeError(f"request {req.rid}: speculative tokens asked for logprobs, none came back")
        for i, token in enumerate(tokens):
            req.output.append(token)
            out.new_tokens.append(token)
            if wants:
                out.logprobs.append(logprobs[i])
            reason = None
            if extras is not None and extras.stop is not None:
                matched = extras.stop.feed(token)
                if matched is not None and len(req.output) >= extras.min_tokens:
                    reason, out.stop_str = "stop", matched
                    extras.stop_str = matched
            if reason is None and (token in stop_tokens or len(req.output) >= req.max_output):
                reason = self._finish_reason(req, token)
            if reason is not None:
                out.finish_reason = reason
                self._finish(req, reason)
                return i + 1
        return len(tokens)
