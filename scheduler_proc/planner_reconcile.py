"""The planner's second half: apply a returned step, and the one path by which a request leaves.

A step's result comes back late (one or two steps behind the plans):
:meth:`Reconciler.reconcile` hands its tokens to live requests (dropping those
of requests that have left), finishes requests by stop token or length,
publishes the prefix-cache blocks the step completed, and releases the slots
and blocks of requests that left and have no step in flight any more.  A
request leaves through ``_finish`` (stop, length, abort) or ``_preempt``, then
``_leave``; its resources return in ``_drained``, once the newest step with a
row of it (``Request.last_step``) is back: steps come back in order.

A mixin of :class:`~scheduler_proc.planner.Planner`, which owns the state.
"""

from __future__ import annotations

from typing import Optional

from ipc.protocol import StepResult
from ipc.structured import matcher_error
from scheduler_proc.request import Request, Status
from scheduler_proc.steps import InflightStep, Output

_RUNNING = Status.RUNNING
_FINISHED = Status.FINISHED


class Reconciler:
    """Applying returned steps and releasing requests (the state is the Planner's)."""

    def reconcile(self, result: StepResult) -> list[Output]:
        """Apply one returned step: tokens to live requests, finishes, releases."""
        if not self.inflight or self.inflight[0].step_id != result.step_id:
            expected = self.inflight[0].step_id if self.inflight else None
            raise RuntimeError(f"step {result.step_id} returned, expected {expected}")
        step = self.inflight.popleft()
        tokens = result.token_ids
        if len(tokens) != len(step.samplers):
            raise RuntimeError(
                f"step {step.step_id}: {len(tokens)} tokens for {len(step.samplers)} sampled rows"
            )
        failed = self._grammar_failures(step, result) if result.grammar_failed_rows else None
        if self.num_with_extras or result.logprob_rows or result.prompt_logprob_rows:
            outputs = self._reconcile_extras(step, result)
        else:
            outputs = self._reconcile_tokens(step.samplers, tokens)
        if step.spec:
            self._reconcile_spec(step, result, outputs)  # their accepted runs (scheduler_proc/speculation.py)
        if failed:
            outputs.extend(failed)
        if self.followers:
            for out in outputs:
                if out.request.rid in self.followers:
                    self.release_followers(out.request)
        self._step_back(step)
        if step.resumed:
            self.resumes.record(step.resumed)
        if self.host is not None:
            self.host.step_back(step.onloaded, result.backups_done_step_id)
        return outputs

    def _grammar_failures(self, step: InflightStep, result: StepResult) -> list[Output]:
        """Requests whose constraint allows no continuation of their output: finished with reason "error" before
        their row's token (the EOS of a failed matcher's mask) is reconciled, so that they never finish "stop"
        with an output the constraint does not match."""
        failed = []
        for row, error in zip(result.grammar_failed_rows, result.grammar_errors):
            req = step.samplers[row]
            if req.status is not _FINISHED:
                self._finish(req, "error")
                failed.append(Output(req, [], "error", error=matcher_error(error, len(req.output))))
        return failed

    def _reconcile_extras(self, step: InflightStep, result: StepResult) -> list[Output]:
        """Reconcile's path while some live request has extras: the fast path's rules plus stop strings,
        min_tokens, and logprobs routed to the token (or prompt position) they belong to."""
        finished = Status.FINISHED
        for (row, first), values in zip(result.prompt_logprob_rows, result.prompt_logprobs):
            req = step.requests[row]
            if req.status is not finished and req.extras is not None and req.extras.prompt is not None:
                req.extras.prompt.add(first, values)
        by_row = dict(zip(result.logprob_rows, result.logprobs))
        stop_tokens = self._stop_tokens
        outputs: list[Output] = []
        for row, (req, token) in enumerate(zip(step.samplers, result.token_ids)):
            if req.status is finished:
                continue  # the ledger: a request that has left gets nothing more
            req.output.append(token)
            out = Output(req, [token])
            extras = req.extras
            if extras is not None:
                if extras.logprobs:
                    if row not in by_row:
                        raise RuntimeError(f"step {step.step_id}: sampled row {row} asked for logprobs, none came back")
                    out.logprobs = [by_row[row]]
                out.prompt_logprobs = extras.take_prompt_logprobs()
                if extras.stop is not None:
                    matched = extras.stop.feed(token)
                    if matched is not None and len(req.output) >= extras.min_tokens:
                        out.finish_reason = "stop"
                        out.stop_str = extras.stop_str = matched
            if out.finish_reason is None and (token in stop_tokens or len(req.output) >= req.max_output):
                out.finish_reason = self._finish_reason(req, token)
            if out.finish_reason is not None:
                self._finish(req, out.finish_reason)
            outputs.append(out)
        return outputs

    def _reconcile_tokens(self, samplers: list[Request], tokens: list[int]) -> list[Output]:
        """The fast path: no live request asked for stop strings, logprobs or min_tokens."""
        outputs: list[Output] = []
        add_output = outputs.append
        stop_tokens = self._stop_tokens
        for req, token in zip(samplers, tokens):
            if req.status is _FINISHED:
                continue  # the ledger: a request that has left gets nothing more
            output = req.output
            output.append(token)
            if token in stop_tokens or len(output) >= req.max_output:
                reason = self._finish_reason(req, token)
                if reason is not None:
                    self._finish(req, reason)
                    add_output(Output(req, [token], reason))
                    continue
            add_output(Output(req, [token]))
        return outputs

    def _step_back(self, step: InflightStep) -> None:
        """Publish what the step wrote; requests that left and were in no later step release."""
        if step.written:  # publish blocks whose last write was in this step (never earlier)
            publish = self.prefix.publish
            for req, num_written in step.written:
                publish(req, num_written)
        self._returned = step.step_id  # steps come back in order: so have all earlier ones
        if self.draining:
            for req in [r for r in self.draining.values() if r.last_step <= step.step_id]:
                self._drained(req)

    def _finish_reason(self, req: Request, token: int) -> Optional[str]:
        if req.extras is not None and len(req.output) <= req.extras.min_tokens:
            pass  # min_tokens: EOS and stop tokens do not end it yet (the executor masks them too)
        elif token in req.stop_ids or (not req.sampling.ignore_eos and token in self.limits.eos_token_ids):
            return "stop"
        if len(req.output) >= req.max_output:
            return "length"
        return None

    def _finish(self, req: Request, reason: str) -> None:
        was = req.status
        req.status = _FINISHED
        req.finish_reason = reason
        self.num_with_extras -= req.extras is not None
        if req.rid in self.followers:
            self.release_followers(req)
        for t in req.stop_ids:
            self._stop_refs[t] -= 1
            if not self._stop_refs[t]:
                del self._stop_refs[t]
                if t not in self.limits.eos_token_ids:
                    self._stop_tokens.discard(t)
        if was is _RUNNING:
            self._stop_running(req)
        if was is _RUNNING or was is Status.PREEMPTED:
            self._leave(req)

    def _preempt(self, req: Request) -> None:
        self._stop_running(req)
        req.status = Status.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._leave(req)

    def _stop_running(self, req: Request) -> None:
        del self._running[req.rid]
        self._prefilling.pop(req.rid, None)
        self._decoding.pop(req.rid, None)
        self._speculating.pop(req.rid, None)
        self._paused.pop(req.rid, None)

    def _leave(self, req: Request) -> None:
        """Out of future plans; resources return now or when the last in-flight step does."""
        if req.rid not in self.draining:
            self.draining[req.rid] = req
            self._draining_blocks += len(req.blocks)
        if req.last_step <= self._returned:  # no step of it in flight
            self._drained(req)

    def _drained(self, req: Request) -> None:
        del self.draining[req.rid]
        self._draining_blocks -= len(req.blocks)
        if req.slot is not None:
            self.slots.free(req.rid, [req.slot])
            self._releases.append(req.slot)
            req.slot = None
        if self.prefix is not None:
            self.prefix.publish(req, req.num_computed)  # all its steps are back: every write is done
        self.blocks.release(req.blocks)
        req.blocks = []
        req.num_published = 0
        req.num_computed = 0
        if req.status is Status.PREEMPTED:
            # Recompute from scratch: prompt + received tokens are prefilled again.
            req.status = Status.WAITING
            self.waiting.appendleft(req)
