"""Client messages at the data-parallel router: Hello, Generate (routed), Abort, stats, tokenizer; a mixin of Router.

The router answers Hello, Ping and GetTokenizer itself (the files a replica sent once), keeps only what a request
needs to be routed and re-sent (``replica_messages.Job``; the replica checks the rest), and asks every replica that
is up for GetStats and ResetPrefixCache, answering with the sums once each has answered or died.
"""

from __future__ import annotations

import random
from typing import Optional

import msgspec

from ipc import protocol as p
from scheduler_proc.client_messages import read_client_message, tokenizer_not_sent
from scheduler_proc.replica_messages import Job, sum_stats
from scheduler_proc.routing import prefix_hashes
from scheduler_proc.validate import InvalidRequest, check_completions, check_request_id, hello_refusal


class StatsAsk:
    """A client's GetStats or ResetPrefixCache, answered once every replica asked has answered (or died)."""

    def __init__(self, client: bytes, waiting: set[int]) -> None:
        self.client = client
        self.waiting = waiting
        self.replies: list[p.ServerStats] = []


class RouterClients:
    """What the router does with each client message (``self`` is the Router)."""

    def read_clients(self) -> None:
        frames = self.frontend.recv_batch()
        for msg in frames:
            try:
                self._on_client_frames(msg[0], msg[1:])
            except Exception as e:  # a bug on one request must not stop the router
                self.frontend.send(msg[0], p.Error(code="internal", message=f"{type(e).__name__}: {e}"))
        self._drop_unreachable_clients()
        if frames or self.frontend.has_input():
            self.wake.set()

    def _on_client_frames(self, client: bytes, frames: list[bytes]) -> None:
        got = read_client_message(self, client, frames)
        if got is None:
            return
        state, msg = got
        if isinstance(msg, p.Generate):
            self._on_generate(client, msg)
        elif isinstance(msg, p.Abort):
            self._on_abort(client, msg)
        elif isinstance(msg, (p.GetStats, p.ResetPrefixCache)):
            self._ask_replicas(client, msg)
        elif isinstance(msg, p.GetTokenizer) and tokenizer_not_sent(self.frontend, client, state):
            self.frontend.send_data(client, self.tokenizer)

    def _on_hello(self, client: bytes, msg: p.Hello) -> None:
        refusal, keyed = hello_refusal(msg, self.cfg.api_key, self.frontend.tcp)
        if refusal is not None:
            self.frontend.send(client, refusal)
            return
        self.frontend.hello(client, msg.heartbeat_s, msg.batch_deltas, admin=keyed or not self.cfg.api_key)
        self.frontend.send(client, msgspec.structs.replace(self.info, batch_deltas=msg.batch_deltas))

    def _on_generate(self, client: bytes, msg: p.Generate) -> None:
        try:  # the rest is the replica's to check: the router keeps only bounded, routable requests
            check_request_id(msg.request_id)
            check_completions(msg)
        except InvalidRequest as e:
            self.frontend.send(client, p.Error(code="invalid_request", message=e.message, field=e.field,
                                               request_id=msg.request_id if e.field != "request_id" else None))
            return
        refusal = self._refusal(client, msg.request_id)
        if refusal is not None:
            self.frontend.send(client, refusal)
            return
        if msg.sampling.seed is None:  # fixed here: a completion re-sent to another replica samples the same
            msg.sampling.seed = random.getrandbits(63)
        job = Job.of(client, msg, prefix_hashes(msg.prompt_token_ids, self.block_size))
        self.jobs[(client, msg.request_id)] = job
        self._place(self._add_leg(job, set(job.outputs), resumed=False))

    def _refusal(self, client: bytes, request_id: str) -> Optional[p.Error]:
        if (client, request_id) in self.jobs:
            return p.Error(code="duplicate_id", field="request_id", request_id=request_id,
                           message=f"request_id {request_id!r} is already in use by this client")
        if self.failure:
            return p.Error(code="executor_failed", message=self.failure, request_id=request_id)
        if self.shutdown_at is not None:
            return p.Error(code="shutting_down", message="the server is shutting down: no new requests",
                           request_id=request_id)
        if len(self.orphans) >= self.cfg.max_waiting:
            return p.Error(code="overloaded", request_id=request_id, message=f"{len(self.orphans)} requests wait "
                           f"for a replica, the limit (--max-waiting) is {self.cfg.max_waiting}: retry later")
        return None

    def _on_abort(self, client: bytes, msg: p.Abort) -> None:
        """Abort every completion: its replica answers each with Finished (abort); one waiting for a replica, here."""
        job = self.jobs.get((client, msg.request_id))
        if job is None:
            return
        job.aborted = True
        for leg in list(job.legs.values()):
            if leg.replica is not None:
                leg.replica.send(p.Abort(leg.leg_id))
            else:
                self.orphans.remove(leg)
                self._end_leg(leg, "abort")

    def _ask_replicas(self, client: bytes, msg) -> None:
        up = [r for r in self.replicas if r.up]
        ask = StatsAsk(client, {r.index for r in up})
        for replica in up:
            replica.asks.append(ask)
            replica.send(msg)
            if isinstance(msg, p.ResetPrefixCache):
                replica.prefixes.clear()
        if not up:
            self._answer(ask)

    def _answer(self, ask: StatsAsk) -> None:
        stats = sum_stats(ask.replies, draining=self.shutdown_at is not None,
                          down=[r.index for r in self.replicas if not r.up],
                          restarts=[r.restarts for r in self.replicas])
        stats.api_worker_restarts = self.api_worker_restarts  # the router's own gateway workers
        self.frontend.send(ask.client, stats)

    def _drop_client(self, client: bytes, code: Optional[str] = None, message: str = "") -> None:
        """Abort every request of a client that left (or stopped reading: each is owed ``code``)."""
        for key in [k for k in self.jobs if k[0] == client]:
            self._end_job(self.jobs[key])
            if code is not None:
                self.frontend.owe(client, p.Error(code=code, message=message, request_id=key[1]))

    def _drop_unreachable_clients(self) -> None:
        if not (self.frontend.slow or self.frontend.gone):
            return
        slow, gone = self.frontend.take_dropped()
        for client in gone:
            self._drop_client(client)
        for client in slow:
            self._drop_client(client, "slow_reader", f"the client stopped reading: {self.cfg.client_send_hwm} "
                                                     "messages were queued to it; its requests were aborted")

