"""One request on the async client: what a call asked for, and the replies it has received.

:func:`sampling_params` is the one place where a call's sampling arguments become
a :class:`~ipc.protocol.SamplingParams`: the fields are declared only there, so a
new sampling field needs no edit in the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import msgspec

from ipc.client.detokenizer import IncrementalDetokenizer
from ipc.client.errors import InvalidRequestError, error_from_wire
from ipc.client.outputs import CompletionOutput
from ipc.client.results import GenerateResult, StreamChunk
from ipc.protocol import Error, Finished, SamplingParams, TokenDelta, TokenDeltas, TokenLogprobs, count_problem

SAMPLING_FIELDS = SamplingParams.__struct_fields__


def sampling_params(sampling: Optional[SamplingParams] = None, /, **overrides: Any) -> SamplingParams:
    """``sampling`` (default: ``SamplingParams()``) with the fields named in ``overrides`` replaced.

    Each override goes through msgspec with the struct's own types (``temperature=0``
    becomes ``0.0``, a tuple of stop ids a list).  An unknown name raises TypeError,
    as an unknown keyword argument would; a value of the wrong type raises
    InvalidRequestError naming ``sampling.<field>``, as the server would.  Ranges
    are left to the server, which names the field and its limit.
    """
    base = sampling if sampling is not None else SamplingParams()
    if not isinstance(base, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, not {type(base).__name__}")
    for name in overrides:
        if name not in SAMPLING_FIELDS:
            raise TypeError(f"unexpected keyword argument {name!r} "
                            f"(sampling fields: {', '.join(SAMPLING_FIELDS)})")
    if not overrides:
        return base
    try:
        # All fields in one conversion (the common case); fields not overridden keep base's values.
        converted = msgspec.convert(overrides, SamplingParams)
        if sampling is None:
            return converted  # the other fields are SamplingParams()'s defaults already
        return msgspec.structs.replace(base, **{name: getattr(converted, name) for name in overrides})
    except msgspec.ValidationError as exc:
        error = exc
    for name, value in overrides.items():
        try:
            # One field at a time, so that the type error names its field.
            msgspec.convert({name: value}, SamplingParams)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError("invalid_request", f"sampling.{name}", str(exc)) from None
    raise InvalidRequestError("invalid_request", "sampling", str(error))


def check_counts(sampling: SamplingParams) -> None:
    """Refuse ``n`` or a list (stop strings, stop token ids, logit_bias) past the server's limit, with the server's
    field and message: a request sets up each of its n completions (a detokenizer and a stop-string matcher each)
    before the server has seen it, so an n of a million would hold the caller's event loop for seconds."""
    try:
        problem = count_problem(sampling)
    except TypeError:  # a list field of another type (a struct built by hand): the server names it
        return
    if problem is not None:
        raise InvalidRequestError("invalid_request", *problem)


def new_request_id() -> str:
    """A fresh request id (random, 32 hex digits)."""
    return uuid.uuid4().hex


def split_deltas(msg: TokenDeltas, pending: dict[str, Any]) -> list[TokenDelta]:
    """A batched TokenDeltas as one TokenDelta per entry whose request is in ``pending``."""
    out = []
    for i, (request_id, token_ids) in enumerate(zip(msg.request_ids, msg.token_ids)):
        if request_id not in pending:
            continue
        out.append(TokenDelta(request_id, token_ids,
                              logprobs=msg.logprobs[i] if msg.logprobs else [],
                              prompt_logprobs=msg.prompt_logprobs[i] if msg.prompt_logprobs else None,
                              index=msg.indices[i] if msg.indices else 0))
    return out


class Stop:
    """Queue sentinel: no reply will ever come (deadline passed, client closed)."""

    def __init__(self, exc_type: type[BaseException], message: str) -> None:
        self.exc_type = exc_type
        self.message = message


@dataclass(frozen=True)
class Call:
    """What a generate/stream call asked for, before it is sent."""

    request_id: str
    prompt: Optional[str]
    messages: Optional[list[dict[str, Any]]]
    prompt_token_ids: Optional[list[int]]
    sampling: SamplingParams
    timeout: Optional[float]
    detokenize: bool

    @classmethod
    def make(cls, prompt: Optional[str], messages: Optional[list[dict[str, Any]]],
             prompt_token_ids: Optional[Sequence[int]], *, request_id: Optional[str],
             timeout: Optional[float], detokenize: bool, sampling: SamplingParams) -> "Call":
        """Check that exactly one prompt form is given, the request id (a string), the timeout (None, or a number
        of seconds >= 0: inf for none) and the sampling's counts (:func:`check_counts`), and fill in a request id.
        Checked here, before anything is built or sent: the server could not route its error for a request id that
        is not a string to this request alone."""
        given = sum(x is not None for x in (prompt, messages, prompt_token_ids))
        if given != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidRequestError("invalid_request", "request_id",
                                      f"request_id must be a string, got {type(request_id).__name__}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout >= 0):  # NaN fails >= too
            raise InvalidRequestError("invalid_request", "timeout",
                                      f"timeout must be None or a number of seconds >= 0 (inf: none), got {timeout!r}")
        check_counts(sampling)
        return cls(
            request_id=request_id if request_id is not None else new_request_id(),
            prompt=prompt,
            messages=messages,
            prompt_token_ids=list(prompt_token_ids) if prompt_token_ids is not None else None,
            sampling=sampling,
            timeout=timeout,
            detokenize=detokenize,
        )


class PendingRequest:
    """One in-flight Generate: its reply queue and its n completions (see ipc/client/outputs.py).

    With a ``tokenizer`` (None: no text) each completion detokenizes its own
    tokens (the prompt's last ones as context).  The request is done once every
    completion has its Finished; an ``abort`` or ``error`` finish ends all of
    them (they are aborted together).
    """

    def __init__(self, request_id: str, tokenizer: Any = None, sampling: Optional[SamplingParams] = None,
                 prompt_token_ids: Sequence[int] = ()) -> None:
        sampling = sampling if sampling is not None else SamplingParams()
        self.request_id = request_id
        # Replies not yet taken, and the future a reader of them waits on: a plain deque is
        # lighter than asyncio.Queue, and lets next_chunks() see what is ready without waiting.
        self._items: deque = deque()
        self._waiter: Optional[asyncio.Future] = None
        self.answered = False  # any reply at all (see AsyncClient._on_connection_error)
        self.finished_seen: set[int] = set()  # completions whose Finished arrived (consumed or queued)
        self.done = False  # Finished or Error received, or nothing more can come
        self.t_send = 0.0
        self.timer: Optional[asyncio.TimerHandle] = None
        self.outputs = [CompletionOutput(i, None if tokenizer is None else
                                         IncrementalDetokenizer(tokenizer, prompt_token_ids),
                                         sampling.stop, sampling.include_stop_str_in_output, sampling.min_tokens)
                        for i in range(max(sampling.n, 1))]
        self.prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
        self._prompt_logprobs_sent = False
        self._ready: list[StreamChunk] = []  # chunks of siblings ended with this one, still to hand out
        self.result: Optional[GenerateResult] = None

    def deliver(self, t: float, msg: Any) -> None:
        """Called by the reader task with a reply and its arrival time."""
        self.answered = True
        if isinstance(msg, Finished):
            self.finished_seen.add(msg.index)
        self._put((t, msg))

    def unfinished(self) -> set[int]:
        """The completions whose Finished has not arrived: each will still send one (the server answers an Abort
        with a Finished per live completion), unless the request errs or the connection goes."""
        return set(range(len(self.outputs))) - self.finished_seen

    def stop(self, stop: Stop) -> None:
        """No reply will come (deadline, closed client, lost server): the reader raises ``stop``'s error."""
        self._put(stop)

    def _put(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_chunk(self) -> Optional[StreamChunk]:
        """The next tokens and text; None once every completion finished; raises on Error or timeout."""
        if self._ready:
            return self._ready.pop(0)
        while not self.done:
            while not self._items:
                if self._waiter is not None:  # a second reader would take the first one's wake-up: it would hang
                    raise RuntimeError(f"request {self.request_id} is already being read by another task or thread: "
                                       f"read a stream from one")
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            item = self._items.popleft()
            if isinstance(item, Stop):
                self.done = item.exc_type is not TimeoutError  # a timed-out request still needs an Abort
                raise item.exc_type(item.message)
            t, msg = item
            if isinstance(msg, Error):
                self.done = True
                raise error_from_wire(msg)
            chunk = self._take(t - self.t_send, msg)
            if chunk is not None:
                return chunk
        return None

    async def next_chunks(self) -> list[StreamChunk]:
        """Every chunk ready now, waiting for the first; [] once every completion finished.

        A reader that falls behind the steps gets several chunks per wake-up (and can
        write them at once); an Error or a stop behind them is raised by the next call.
        """
        chunk = await self.next_chunk()
        if chunk is None:
            return []
        chunks = [chunk]
        while True:
            if self._ready:
                chunks.append(self._ready.pop(0))
                continue
            items = self._items
            if self.done or not items or isinstance(items[0], Stop) or isinstance(items[0][1], Error):
                return chunks
            t, msg = items.popleft()
            chunk = self._take(t - self.t_send, msg)
            if chunk is not None:
                chunks.append(chunk)

    def _take(self, since_send: float, msg: Any) -> Optional[StreamChunk]:
        if not isinstance(msg, (TokenDelta, Finished)) or not 0 <= msg.index < len(self.outputs):
            return None
        if msg.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = msg.prompt_logprobs
        out = self.outputs[msg.index]
        if isinstance(msg, TokenDelta):
            if out.finished is not None or not msg.token_ids:
                return None
            return self._with_prompt_logprobs(out.add(since_send, msg.token_ids, msg.logprobs))
        if out.finished is not None:
            return None
        chunk = out.add(since_send, msg.token_ids, msg.logprobs, msg)
        if msg.reason in ("abort", "error"):
            self._ready = [other.end_with(since_send, msg) for other in self.outputs if other.finished is None]
        if all(o.finished is not None for o in self.outputs):
            self.done = True
            self.result = self._result()
            if len(self.outputs) == 1 and not chunk.token_ids and not chunk.text_delta and not self._ready:
                return None  # one completion: its end is the end of the stream
        return self._with_prompt_logprobs(chunk)

    def _with_prompt_logprobs(self, chunk: Optional[StreamChunk]) -> Optional[StreamChunk]:
        if chunk is not None and self.prompt_logprobs is not None and not self._prompt_logprobs_sent:
            chunk.prompt_logprobs = self.prompt_logprobs
            self._prompt_logprobs_sent = True
        return chunk

    def _result(self) -> GenerateResult:
        choices = [o.result(self.request_id) for o in self.outputs]
        for c in choices:
            c.prompt_logprobs = self.prompt_logprobs
        return dataclasses.replace(choices[0], choices=choices)


class RequestOwner(Protocol):
    """What a stream needs of the client that owns its request (``AsyncClient`` is one): the stream
    depends on this, not on the client's module, which imports the stream."""

    async def _start(self, call: Call) -> PendingRequest: ...

    async def abort(self, request_id: str) -> None: ...

    async def _release(self, req: PendingRequest) -> None: ...
