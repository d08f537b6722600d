"""Legs at the data-parallel router: where each goes, and a replica's answers relayed to clients; a mixin of Router.

A leg (``replica_messages.Leg``) is placed on the replica the policy picks (``routing.choose``), or waits until one
is up.  A replica's TokenDeltas is split per client under the clients' request ids, each completion's tokens
recorded; its Finished and Error go to their client likewise.  A lost leg's unfinished completions are placed again,
each resumed after the tokens its client has.
"""

from __future__ import annotations

from ipc import protocol as p
from scheduler_proc.replica_messages import ClientDeltas, Job, Leg, first_generate, resume_generate
from scheduler_proc.routing import choose, prefix_hashes


class RouterRelay:
    """Placing legs and relaying what replicas answer (``self`` is the Router)."""

    def _relay_deltas(self, msg: p.TokenDeltas) -> None:
        """One replica's step, as one TokenDeltas per client (renamed), each completion's tokens recorded."""
        by_client: dict[bytes, ClientDeltas] = {}
        legs, indices, logprobs, prompt_logprobs = self.legs, msg.indices, msg.logprobs, msg.prompt_logprobs
        for i, leg_id in enumerate(msg.request_ids):
            leg = legs.get(leg_id)
            if leg is None:
                continue  # it left (aborted, failed, or re-sent elsewhere)
            job, tokens = leg.job, msg.token_ids[i]
            index = indices[i] if indices else 0
            job.outputs[index] += tokens
            first = prompt_logprobs[i] if prompt_logprobs else None
            if first is not None and not job.first_prompt_logprobs(index):
                first = None
            out = by_client.get(job.client)
            if out is None:
                out = by_client[job.client] = ClientDeltas()
            out.add(job.request_id, tokens, index, logprobs[i] if logprobs else [], first)
        batch_clients = self.frontend.batch_clients
        for client, out in by_client.items():
            if client in batch_clients:
                self.frontend.send(client, out.batch())
            else:
                for delta in out.singles():
                    self.frontend.send(client, delta)

    def _relay_finished(self, msg: p.Finished) -> None:
        leg = self.legs.get(msg.request_id)
        if leg is None:
            return
        job = leg.job
        job.outputs[msg.index] += msg.token_ids
        if msg.prompt_logprobs is not None and not job.first_prompt_logprobs(msg.index):
            msg.prompt_logprobs = None
        msg.request_id = job.request_id
        self.frontend.send(job.client, msg)
        if msg.reason != "abort":  # a chat's next turn starts with this prompt and its answer
            leg.replica.prefixes.add(prefix_hashes(job.generate.prompt_token_ids + job.outputs[msg.index],
                                                   self.block_size))
        self._leg_done(leg, msg.index)

    def _relay_error(self, msg: p.Error) -> None:
        """A replica refused or failed one leg: the client's request ends with that error (its other legs too)."""
        leg = self.legs.get(msg.request_id)
        if leg is None:
            return
        job = leg.job
        msg.request_id = job.request_id
        self.frontend.send(job.client, msg)
        self._forget_leg(leg)  # the replica has ended it
        self._end_job(job)

    def _add_leg(self, job: Job, indices: set[int], resumed: bool) -> Leg:
        """A new Generate for ``job``: the client's, or (resumed) one completion after its relayed tokens."""
        leg_id = format(next(self._leg_ids), "x")
        generate = resume_generate(job, min(indices), leg_id) if resumed else first_generate(job.generate, leg_id)
        leg = Leg(leg_id, job, generate, indices)
        job.legs[leg_id] = leg
        self.legs[leg_id] = leg
        return leg

    def _place(self, leg: Leg) -> None:
        """Send a leg to the replica the policy picks, or keep it until one is up."""
        up = [r for r in self.replicas if r.up]
        if not up:
            self.orphans.append(leg)
            return
        hashes = leg.job.hashes
        replica = up[choose([r.prefixes.matched(hashes) for r in up], [r.load for r in up], self.slack, len(hashes),
                            self.block_size)]
        leg.replica = replica
        replica.load += len(leg.indices)
        replica.prefixes.add(hashes)
        replica.send(leg.generate)

    def _leg_done(self, leg: Leg, index: int) -> None:
        """One completion of a leg finished (its Finished was relayed)."""
        if index in leg.indices:
            leg.indices.discard(index)
            if leg.replica is not None:
                leg.replica.load -= 1
        if not leg.indices:
            self._forget_leg(leg)
        self._forget_if_done(leg.job)

    def _forget_if_done(self, job: Job) -> None:
        if not job.legs:
            self.jobs.pop((job.client, job.request_id), None)

    def _end_leg(self, leg: Leg, reason: str) -> None:
        """Finish a leg no replica holds, here (an abort, or a shutdown)."""
        for index in sorted(leg.indices):
            self.frontend.send(leg.job.client, leg.job.finished(index, reason))
            self._leg_done(leg, index)

    def _forget_leg(self, leg: Leg) -> None:
        self.legs.pop(leg.leg_id, None)
        leg.job.legs.pop(leg.leg_id, None)
        if leg.replica is not None:
            leg.replica.load -= len(leg.indices)

    def _end_job(self, job: Job) -> None:
        """Drop a request: its legs still on replicas are aborted there (their answers are dropped)."""
        for leg in list(job.legs.values()):
            if leg.replica is not None and leg.replica.up:
                leg.replica.send(p.Abort(leg.leg_id))
            elif leg.replica is None:
                self.orphans.remove(leg)
            self._forget_leg(leg)
        self.jobs.pop((job.client, job.request_id), None)

    def _resend(self, leg: Leg, why: str) -> None:
        """Each unfinished completion of a lost leg goes to another replica (or ends: aborted, shutting down)."""
        job = leg.job
        if self.shutdown_at is not None:
            if (job.client, job.request_id) in self.jobs:
                self.frontend.send(job.client, p.Error(code="shutting_down", request_id=job.request_id,
                                                       message=f"{why} while the server was shutting down"))
                self._end_job(job)
            return
        for index in sorted(leg.indices):
            if job.aborted:
                self.frontend.send(job.client, job.finished(index, "abort"))
            else:
                self._place(self._add_leg(job, {index}, resumed=True))
        self._forget_if_done(job)

