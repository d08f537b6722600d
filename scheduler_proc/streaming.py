"""Output streaming: reconciled tokens (and logprobs, finishes) to clients; a mixin of Server.

A request's extras ride only where it asked: ``logprobs`` parallel to its token ids,
``prompt_logprobs`` once (with the first delta, or the Finished), ``stop_str`` in the
Finished; completion indices of n > 1 requests only when not 0.  A request that asked
for nothing costs exactly what it did before these features.
"""

from __future__ import annotations

from typing import Optional

from ipc import protocol as p
from scheduler_proc.grammar import constraint
from scheduler_proc.request import Request
from scheduler_proc.steps import Output


class _Batch:
    """One client's TokenDeltas under construction; per-request extras are gathered only if someone has them."""

    __slots__ = ("request_ids", "token_ids", "special")

    def __init__(self):
        self.request_ids: list[str] = []
        self.token_ids: list[list[int]] = []
        self.special: list[tuple[int, Output]] = []  # (entry, output) of requests with an index or extras

    def message(self) -> p.TokenDeltas:
        if not self.special:
            return p.TokenDeltas(self.request_ids, self.token_ids)
        n = len(self.request_ids)
        indices, logprobs, prompt_logprobs = [0] * n, [[] for _ in range(n)], [None] * n
        for i, out in self.special:
            indices[i] = out.request.index
            logprobs[i] = out.logprobs or []
            prompt_logprobs[i] = out.prompt_logprobs
        return p.TokenDeltas(
            self.request_ids, self.token_ids, indices=indices if any(indices) else [],
            logprobs=logprobs if any(logprobs) else [],
            prompt_logprobs=prompt_logprobs if any(x is not None for x in prompt_logprobs) else [])


def token_delta(out: Output) -> p.TokenDelta:
    req = out.request
    return p.TokenDelta(req.request_id, out.new_tokens, index=req.index, logprobs=out.logprobs or [],
                        prompt_logprobs=out.prompt_logprobs)


class OutputStream:
    """Sends what reconciles produce and ends requests (``self`` is the Server)."""

    def _emit_step(self, outputs: list[Output]) -> None:
        """One TokenDeltas per client that reads them, else a TokenDelta per request; finishes via ``_emit``."""
        batch_clients = self.frontend.batch_clients
        batches: dict[bytes, _Batch] = {}
        send, encode = self.frontend.send_data, p.encode
        for out in outputs:
            req = out.request
            if out.finish_reason is not None:
                self._emit(out)
                continue
            req.num_sent = len(req.output)
            if req.client in batch_clients:
                batch = batches.get(req.client)
                if batch is None:
                    batch = batches[req.client] = _Batch()
                if req.extras is not None or req.index:
                    batch.special.append((len(batch.request_ids), out))
                batch.request_ids.append(req.request_id)
                batch.token_ids.append(out.new_tokens)
            elif req.extras is None and not req.index:
                send(req.client, encode(p.TokenDelta(req.request_id, out.new_tokens)))
            else:
                send(req.client, encode(token_delta(out)))
        for client, batch in batches.items():
            send(client, encode(batch.message()))

    def _emit(self, out: Output) -> None:
        req = out.request
        if out.finish_reason is None:
            self.frontend.send(req.client, token_delta(out))
            req.num_sent = len(req.output)
            return
        if out.error is not None:  # its constraint failed: the request (every completion of it) ends in an Error
            name = constraint(req.sampling)
            self.fail_request(req, "invalid_request", out.error, field=f"sampling.{name[0]}" if name else "sampling")
            return
        self.requests.pop((req.client, req.request_id, req.index), None)
        prompt_logprobs = out.prompt_logprobs
        if prompt_logprobs is None and req.extras is not None:
            prompt_logprobs = req.extras.take_prompt_logprobs()
        sent = self.frontend.send(req.client, p.Finished(
            request_id=req.request_id, reason=out.finish_reason, prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output), token_ids=req.output[req.num_sent:], logprobs=out.logprobs or [],
            prompt_logprobs=prompt_logprobs, stop_str=out.stop_str, index=req.index,
            draft_tokens=req.spec_drafted, accepted_tokens=req.spec_accepted))
        req.num_sent = len(req.output)
        if not sent and req.client in self.frontend.slow:  # its stream has a hole: say so once it reads again
            self.frontend.owe(req.client, p.Error(code="slow_reader", request_id=req.request_id,
                                                  message="the client stopped reading; the request's tokens were lost"))

    def fail_request(self, req: Request, code: str, message: str, owed: bool = False,
                     field: Optional[str] = None) -> None:
        """End a request, every completion of it, with one Error (owed: queued for a client whose pipe is full;
        ``field``: the request's field at fault)."""
        if (req.client, req.request_id, req.index) not in self.requests:
            return  # a sibling completion's failure already ended it
        for index in range(p.MAX_N):
            sibling = self.requests.pop((req.client, req.request_id, index), None)
            if sibling is not None:
                self.planner.abort(sibling)
        (self.frontend.owe if owed else self.frontend.send)(
            req.client, p.Error(code=code, message=message, request_id=req.request_id, field=field))

    def drop_client(self, client: bytes, code: Optional[str] = None, message: str = "") -> None:
        """Abort every request of one client (KV freed); with a code, each is owed that error (once per id)."""
        owed = set()
        for key in [k for k in self.requests if k[0] == client]:
            req = self.requests.pop(key)
            self.planner.abort(req)
            if code is not None and req.request_id not in owed:
                owed.add(req.request_id)
                self.frontend.owe(client, p.Error(code=code, message=message, request_id=req.request_id))

    def _drop_unreachable_clients(self) -> None:
        if not (self.frontend.slow or self.frontend.gone):
            return
        slow, gone = self.frontend.take_dropped()
        for client in gone:
            self.drop_client(client)
        for client in slow:
            self.drop_client(client, "slow_reader", f"the client stopped reading: {self.cfg.client_send_hwm} "
                                                    "messages were queued to it; its requests were aborted")
