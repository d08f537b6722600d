"""One request on the async client: what a call asked for, and the replies it has received.

:func:`sampling_params` is the one place where a call's sampling arguments become
a :class:`~ipc.protocol.SamplingParams`: the fields are declared only there, so a
new sampling field needs no edit in the client.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import msgspec

from ipc.client.detokenizer import IncrementalDetokenizer
from ipc.client.errors import InvalidRequestError, error_from_wire
from ipc.client.results import GenerateResult, StreamChunk, Timings
from ipc.protocol import Error, Finished, SamplingParams, TokenDelta

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
    converted = {}
    for name, value in overrides.items():
        try:
            # One field at a time, so that a type error names its field.
            converted[name] = getattr(msgspec.convert({name: value}, SamplingParams), name)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError("invalid_request", f"sampling.{name}", str(exc)) from None
    return msgspec.structs.replace(base, **converted)


def new_request_id() -> str:
    """A fresh request id (random, 32 hex digits)."""
    return uuid.uuid4().hex


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
        """Check that exactly one prompt form is given and fill in a request id."""
        given = sum(x is not None for x in (prompt, messages, prompt_token_ids))
        if given != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
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
    """One in-flight Generate: its reply queue, received tokens, text and timings."""

    def __init__(self, request_id: str, detokenizer: Optional[IncrementalDetokenizer]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.detokenizer = detokenizer
        self.answered = False  # any reply at all (see AsyncClient._on_connection_error)
        self.done = False  # Finished or Error received, or nothing more can come
        self.t_send = 0.0
        self.timer: Optional[asyncio.TimerHandle] = None
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.chunk_times: list[float] = []
        self.text_parts: list[str] = []
        self.result: Optional[GenerateResult] = None

    def deliver(self, t: float, msg: Any) -> None:
        """Called by the reader task with a reply and its arrival time."""
        self.answered = True
        self.queue.put_nowait((t, msg))

    async def next_chunk(self) -> Optional[StreamChunk]:
        """The next tokens and text; None once Finished; raises on Error or timeout."""
        while not self.done:
            item = await self.queue.get()
            if isinstance(item, Stop):
                self.done = item.exc_type is not TimeoutError  # a timed-out request still needs an Abort
                raise item.exc_type(item.message)
            t, msg = item
            if isinstance(msg, TokenDelta):
                if msg.token_ids:
                    return self._take(t, msg.token_ids, final=False)
            elif isinstance(msg, Finished):
                self.done = True
                chunk = self._take(t, msg.token_ids, final=True)
                self.result = self._result(t, msg)
                return chunk
            elif isinstance(msg, Error):
                self.done = True
                raise error_from_wire(msg)
        return None

    def _take(self, t: float, token_ids: list[int], *, final: bool) -> Optional[StreamChunk]:
        since_send = t - self.t_send
        if token_ids:
            self.token_ids.extend(token_ids)
            self.token_times.extend([since_send] * len(token_ids))
            self.chunk_times.append(since_send)
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.add(token_ids)
            if final:
                text += self.detokenizer.flush()
        self.text_parts.append(text)
        if not token_ids and not text:
            return None
        return StreamChunk(text, list(token_ids))

    def _result(self, t: float, fin: Finished) -> GenerateResult:
        times = self.chunk_times
        timings = Timings(
            ttft=times[0] if times else None,
            e2e=t - self.t_send,
            token_times=self.token_times,
            itl=[b - a for a, b in zip(times, times[1:])],
        )
        return GenerateResult(
            request_id=self.request_id,
            text="".join(self.text_parts),
            token_ids=self.token_ids,
            finish_reason=fin.reason,
            prompt_tokens=fin.prompt_tokens,
            completion_tokens=fin.completion_tokens,
            timings=timings,
            message=fin.message,
        )
