"""Client messages: Hello, Generate (validated, n completions), Abort, stats; a mixin of Server."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Optional

from ipc import protocol as p
from ipc.sockets import MAX_CLIENT_MESSAGE_BYTES
from scheduler_proc.grammar import CONSTRAINT_FIELDS, admit_constrained
from scheduler_proc.request import Request
from scheduler_proc.validate import InvalidRequest, decode_client_frame, hello_refusal, validate_generate


def read_client_message(owner, client: bytes, payload: list[bytes]):
    """The rules every client message passes first, at a server and at the data-parallel router (``owner``, with
    its ``frontend``, ``server_id``, ``cfg`` and ``_on_hello``): one frame within the size limit; Ping answered here
    (``hello=False`` tells a forgotten client to fail its requests and say Hello again); Hello to ``owner._on_hello``;
    anything else only after a Hello, and ResetPrefixCache only from a client whose Hello gave the API key.
    Returns ``(state, message)`` for the owner to act on, or None once answered here."""
    frontend = owner.frontend
    state = frontend.clients.get(client)
    if state is not None:
        state.last_seen = time.monotonic()
    if len(payload) != 1:
        frontend.send(client, p.Error(code="bad_frame", message=f"expected 1 frame per message, got {len(payload)}"))
        return None
    if len(payload[0]) > MAX_CLIENT_MESSAGE_BYTES:
        frontend.send(client, p.Error(code="bad_frame", message=f"message of {len(payload[0])} bytes exceeds the limit "
                                                                 f"of {MAX_CLIENT_MESSAGE_BYTES} bytes"))
        return None
    msg = decode_client_frame(payload[0])
    if isinstance(msg, p.Error):
        frontend.send(client, msg)
    elif isinstance(msg, p.Ping):
        frontend.send(client, p.Pong(owner.server_id, hello=state is not None))
    elif isinstance(msg, p.Hello):
        owner._on_hello(client, msg)
    elif state is None:
        frontend.send(client, p.Error(code="hello_first", request_id=getattr(msg, "request_id", None),
                                      message="send Hello first (none yet, or silent past its heartbeat)"))
    elif isinstance(msg, p.ResetPrefixCache) and owner.cfg.api_key and not state.admin:
        frontend.send(client, p.Error(code="unauthorized", field="api_key",
                                      message="resetting the prefix cache needs the server's API key in Hello"))
    else:
        return state, msg
    return None


def tokenizer_not_sent(frontend, client: bytes, state) -> bool:
    """True the first time a connection asks for the tokenizer files; after that an error is sent instead (a client
    that asks again and never reads would pile megabytes up in the server)."""
    if state.tokenizer_sent:
        frontend.send(client, p.Error(code="invalid_request", field="get_tokenizer",
                                      message="the tokenizer files were sent on this connection already"))
        return False
    state.tokenizer_sent = True
    return True


class ClientMessages:
    """What the server does with each client message (``self`` is the Server)."""

    def _on_client_frames(self, frames: list[bytes]) -> None:
        client = frames[0]
        got = read_client_message(self, client, frames[1:])
        if got is None:
            return
        state, msg = got
        if isinstance(msg, p.Generate):
            self._on_generate(client, msg)
        elif isinstance(msg, p.Abort):
            self._on_abort(client, msg)
        elif isinstance(msg, p.GetStats):
            self.frontend.send(client, self.server_stats())
        elif isinstance(msg, p.ResetPrefixCache):
            self.planner.reset_prefix_cache()
            self.frontend.send(client, self.server_stats())
        elif isinstance(msg, p.GetTokenizer) and tokenizer_not_sent(self.frontend, client, state):
            self.frontend.send(client, p.TokenizerFiles(self.tokenizer_files))

    def server_stats(self) -> p.ServerStats:
        pl, totals = self.planner, self.step_totals
        return p.ServerStats(
            num_kv_blocks=pl.limits.num_kv_blocks, num_free_kv_blocks=pl.blocks.num_free,
            num_slots=pl.limits.num_slots, num_free_slots=pl.slots.num_free, num_running=len(pl.running),
            num_waiting=len(pl.waiting), num_draining=len(pl.draining), num_inflight_steps=pl.num_inflight,
            steps=self.stats["steps"], requests=self.stats["requests"], preemptions=pl.num_preemptions,
            resumes=pl.resumes.count, resume_s_total=pl.resumes.seconds,
            executor_restarts=self.stats["restarts"], api_worker_restarts=self.api_worker_restarts,
            draining=self.shutdown_at is not None or bool(self.failure),
            step_time_s_total=totals.step_s, gpu_busy_s_total=totals.gpu_busy_s,
            gpu_gap_s_total=totals.gpu_gap_s, executor_idle_s_total=totals.idle_s,
            prefix_cache_query_tokens=pl.prefix.query_tokens if pl.prefix else 0,
            prefix_cache_hit_tokens=pl.prefix.hit_tokens if pl.prefix else 0,
            prefix_cache_host_hit_tokens=pl.host.hit_tokens if pl.host else 0,
            num_host_kv_blocks=pl.limits.num_host_blocks if pl.host else 0,
            num_free_host_kv_blocks=pl.host.blocks.num_free if pl.host else 0,
            device_peak_bytes=totals.device_peak_bytes,
            device_free_min_bytes=totals.device_free_min_bytes, **self.grammars.stats.server_stats(),
            grammar_steps=totals.grammar_steps, grammar_wait_steps=totals.grammar_wait_steps,
            grammar_wait_s_total=totals.grammar_wait_s,
            spec_rows=pl.spec_drafts.rows, spec_draft_tokens=pl.spec_drafts.drafted,
            spec_accepted_tokens=pl.spec_drafts.accepted, replica=self.cfg.replica)

    def _on_hello(self, client: bytes, msg: p.Hello) -> None:
        refusal, keyed = hello_refusal(msg, self.cfg.api_key, self.frontend.tcp)
        if refusal is not None:
            self.frontend.send(client, refusal)
            return
        self.frontend.hello(client, msg.heartbeat_s, msg.batch_deltas, admin=keyed or not self.cfg.api_key)
        r = self.ready
        self.frontend.send(client, p.ServerInfo(
            protocol_version=p.PROTOCOL_VERSION, model_name=self.model.name, max_model_len=r.max_model_len,
            vocab_size=r.vocab_size, has_tokenizer=bool(self.tokenizer_files), eos_token_ids=r.eos_token_ids,
            device=r.device, dtype=r.dtype, pipeline_depth=self.cfg.pipeline_depth, batch_deltas=msg.batch_deltas,
            server_id=self.server_id))

    def _refusal(self) -> Optional[p.Error]:
        """Why no new request is taken now, or None."""
        if self.failure:
            return p.Error(code="executor_failed", message=self.failure)
        if self.shutdown_at is not None:
            return p.Error(code="shutting_down", message="the server is shutting down: no new requests")
        # those the free slots will take at the next plan are not waiting for one (requests that came at once)
        queued = len(self.planner.waiting) - self.planner.slots.num_free
        if queued >= self.cfg.max_waiting:
            return p.Error(code="overloaded", message=f"{queued} requests are waiting for a slot, the limit "
                                                      f"(--max-waiting) is {self.cfg.max_waiting}: retry later")
        return None

    def _on_generate(self, client: bytes, msg: p.Generate) -> None:
        if self.failure and self.cfg.replica is not None:
            return  # this replica is about to exit: its router re-sends the request to another one then
        refusal = self._refusal()
        if refusal is not None:
            refusal.request_id = msg.request_id
            self.frontend.send(client, refusal)
            return
        try:
            validate_generate(msg, self.limits)
        except InvalidRequest as e:
            self.frontend.send(client, p.Error(code="invalid_request", message=e.message, request_id=msg.request_id,
                                               field=e.field))
            return
        if (any((client, msg.request_id, i) in self.requests for i in range(p.MAX_N))
                or (client, msg.request_id) in self.compiling):
            self.frontend.send(client, p.Error(code="duplicate_id", field="request_id", request_id=msg.request_id,
                                               message=f"request_id {msg.request_id!r} is already in use by this client"))
            return
        if any(getattr(msg.sampling, name) is not None for name in CONSTRAINT_FIELDS):
            # Compiled off the loop; admitted (or refused) when done (scheduler_proc/grammar.py).
            task = asyncio.get_running_loop().create_task(admit_constrained(self, client, msg))
            self.compile_tasks.add(task)
            task.add_done_callback(self.compile_tasks.discard)
            return
        self._start_generate(client, msg)

    def _start_generate(self, client: bytes, msg: p.Generate, grammar: str = "") -> None:
        """Admit a validated request's n completions (``grammar``: its compiled constraint)."""
        s = msg.sampling
        base = s.seed if s.seed is not None else random.getrandbits(63)
        leader = None
        first = msg.completion_index  # a resumed completion (n == 1) keeps its index, seed and outputs
        for index in range(first, first + s.n):
            req = Request(
                rid=next(self._rids), client=client, request_id=msg.request_id, prompt=msg.prompt_token_ids,
                sampling=s, seed=(base + index) % 2**63, max_tokens=s.max_tokens, stop_ids=frozenset(s.stop_token_ids),
                index=index, grammar=grammar, output=list(msg.resume_output_ids),
                num_sent=len(msg.resume_output_ids))
            try:
                self.planner.add(req, leader)
            except ValueError as e:  # e.g. stop strings on a server without a tokenizer
                self.frontend.send(client, p.Error(code="invalid_request", message=str(e), request_id=msg.request_id,
                                                   field="sampling.stop"))
                return
            self.requests[(client, msg.request_id, index)] = req
            leader = leader or req
        self.stats["requests"] += 1

    def _on_abort(self, client: bytes, msg: p.Abort) -> None:
        """Abort every completion of the request (already finished ones: nothing to do)."""
        if (client, msg.request_id) in self.compiling:  # answered once its compile is done
            self.compiling[(client, msg.request_id)] = True
        for index in range(p.MAX_N):
            req = self.requests.get((client, msg.request_id, index))
            if req is not None:
                out = self.planner.abort(req)
                if out:
                    self._emit(out)
