"""OpenAI answers built from SDK streams: whole responses and SSE events.

Every request is an SDK stream (one per prompt, each with the request's n
completions); a non-streaming answer reads its streams to the end.  Choice
``p * n + i`` is completion i of prompt p.  Metrics are observed here, when
each request ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Optional

import msgspec

from ipc.client import (ExecutorFailedError, ForerunError, InvalidRequestError, ServerGoneError,
                        ServerShuttingDownError, StreamChunk)
from ipc.gateway import params
from ipc.gateway import response_bodies as rb
from ipc.gateway import schemas as s
from ipc.gateway.logprobs import (
    CompletionLogprobs,
    chat_logprobs,
    completion_logprobs,
    join_completion_logprobs,
    prompt_logprobs,
)
from ipc.gateway.streaming import DONE, gather_or_cancel, merge
from ipc.gateway.structured import PARAM_OF_FIELD
from ipc.gateway.tool_calls import ToolCallStream, choice_message
from ipc.gateway.tools import plan_tools

# SDK field names -> the OpenAI parameter they came from (others: "sampling." dropped; the prompt's: sdk_error's).
_PARAM_OF_FIELD = {"request_id": None, **PARAM_OF_FIELD}
_encode = msgspec.json.encode


def sdk_error(exc: BaseException, prompt_param: str = "prompt") -> s.RequestError:
    """The HTTP status and OpenAI error for an SDK exception; ``prompt_param`` is the request field the prompt's
    tokens came from (``messages`` for chat, which has no ``prompt``)."""
    if isinstance(exc, InvalidRequestError):
        field = exc.field or ""
        if field == "prompt_token_ids":
            return s.RequestError(400, exc.message, prompt_param)
        param = _PARAM_OF_FIELD.get(field, field.removeprefix("sampling.") or None)
        return s.RequestError(400, exc.message, param)
    if isinstance(exc, (ExecutorFailedError, ConnectionError)):
        return s.RequestError(503, str(exc), err_type="service_unavailable_error", code="executor_failed")
    if isinstance(exc, (ServerShuttingDownError, ServerGoneError, TimeoutError)):
        return s.RequestError(503, getattr(exc, "message", str(exc)), err_type="service_unavailable_error",
                              code=getattr(exc, "code", "timeout"))
    if isinstance(exc, ForerunError) and exc.code == "overloaded":
        return s.RequestError(429, exc.message, err_type="rate_limit_error", code="overloaded")
    return s.RequestError(500, str(exc), err_type="server_error", code=getattr(exc, "code", None))


@dataclass
class Prompt:
    """One prompt as sent: its token ids, and its text for ``echo``."""

    ids: list[int]
    text: str


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _usage(results: list[Any]) -> rb.Usage:
    """OpenAI's rule: each prompt counted once, every completion's tokens summed."""
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(c.completion_tokens for r in results for c in (r.choices or [r]))
    return rb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _drain(stream: Any) -> Any:
    try:
        while await stream.next_chunk() is not None:
            pass
    finally:
        await stream.aclose()
    return stream.result


async def _results(gw: Any, streams: list[Any]) -> list[Any]:
    results = await gather_or_cancel([_drain(st) for st in streams])
    for r in results:
        gw.observe(r)
    return results


def _echo_logprobs(gw: Any, req: s.CompletionRequest, prompt: Prompt, plps: Optional[list]) -> CompletionLogprobs:
    lps = plps if plps is not None else [None] * len(prompt.ids)
    return completion_logprobs(gw.token_texts, prompt.ids, lps, req.logprobs)


def stop_reason(req: Any, finish_reason: Optional[str], stop_str: Optional[str],
                last_token: Optional[int]) -> rb.StopReason:
    """vLLM's ``stop_reason``: the stop string, or the token of the request's ``stop_token_ids``, that ended a
    choice; None for EOS, ``length`` and the rest."""
    if finish_reason != "stop":
        return None
    if stop_str is not None:
        return stop_str
    return last_token if last_token is not None and last_token in (req.stop_token_ids or ()) else None


def _echo_end(gw: Any, prompt: Prompt) -> int:
    """The text offset of the first output token after an echoed prompt: one running sum of the token texts over
    prompt and output, as vLLM counts them (a character split over tokens counts once a part, its U+FFFD each)."""
    return sum(len(gw.token_texts(t)) for t in prompt.ids)


def _completion_choice(gw: Any, req: s.CompletionRequest, prompt: Prompt, index: int, c: Any,
                       plps: Optional[list]) -> rb.CompletionChoice:
    text, lps = c.text, None
    if req.echo:
        text = prompt.text + text
    if req.logprobs is not None:
        lps = completion_logprobs(gw.token_texts, c.token_ids, c.logprobs, req.logprobs,
                                  _echo_end(gw, prompt) if req.echo else 0)
        if req.echo:
            lps = join_completion_logprobs(_echo_logprobs(gw, req, prompt, plps), lps)
    vllm_plps = prompt_logprobs(gw.token_texts, prompt.ids, plps, req.prompt_logprobs) \
        if req.prompt_logprobs is not None else None
    return rb.CompletionChoice(index=index, text=text, finish_reason=c.finish_reason, logprobs=lps,
                              prompt_logprobs=vllm_plps,
                              stop_reason=stop_reason(req, c.finish_reason, c.stop_str, _last(c.token_ids)))


def _prompt_only(r: Any) -> Any:
    """A result without its one generated token (max_tokens 0 with echo: the prompt scored, nothing generated)."""
    none = dict(text="", token_ids=[], logprobs=[], completion_tokens=0, finish_reason="length", stop_str=None)
    return replace(r, choices=[replace(c, **none) for c in r.choices], **none)


async def whole_completion(gw: Any, req: s.CompletionRequest, rid: str, prompts: list[Prompt],
                           streams: list[Any], score: bool = False) -> rb.CompletionResponse:
    """The non-streaming /v1/completions answer: n choices per prompt (``score``: the prompts only)."""
    results = await _results(gw, streams)
    if score:
        results = [_prompt_only(r) for r in results]
    n = req.n or 1
    choices = [_completion_choice(gw, req, prompt, p * n + c.index, c, r.prompt_logprobs)
               for p, (prompt, r) in enumerate(zip(prompts, results)) for c in r.choices]
    return rb.CompletionResponse(id=rid, created=int(time.time()), model=gw.model_name, choices=choices,
                                usage=_usage(results))


async def whole_chat(gw: Any, req: s.ChatCompletionRequest, rid: str, prompt: Prompt,
                     stream: Any, plan: Any = None) -> rb.ChatCompletionResponse:
    """The non-streaming /v1/chat/completions answer: n choices (``plan``: tools, ipc/gateway/tools.py)."""
    (r,) = await _results(gw, [stream])
    top_n = params.output_logprobs(req)
    echoed = s.chat_echo(req)  # vLLM's echo (never with tools: plan_tools refuses it)
    choices = [rb.ChatChoice(index=c.index, message=message, finish_reason=finish,
                            logprobs=None if top_n is None else chat_logprobs(gw.token_texts, c.token_ids,
                                                                               c.logprobs, top_n),
                            stop_reason=stop_reason(req, c.finish_reason, c.stop_str, _last(c.token_ids)))
               for c in r.choices for message, finish in [choice_message(echoed + c.text, c.finish_reason, plan)]]
    vllm_plps = prompt_logprobs(gw.token_texts, prompt.ids, r.prompt_logprobs, req.prompt_logprobs) \
        if req.prompt_logprobs is not None else None
    return rb.ChatCompletionResponse(id=rid, created=int(time.time()), model=gw.model_name, choices=choices,
                                    usage=_usage([r]), prompt_logprobs=vllm_plps)


def _include_usage(req: Any) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


class RunningUsage:
    """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): each chunk's usage so far, its
    prompt's tokens and its choice's."""

    def __init__(self, req: Any) -> None:
        self.on = _include_usage(req) and req.stream_options.continuous_usage_stats
        self.tokens: dict[int, int] = {}  # choice -> tokens sent

    def add(self, index: int, new_tokens: int) -> None:
        if self.on:
            self.tokens[index] = self.tokens.get(index, 0) + new_tokens

    def of(self, index: int, prompt_tokens: int) -> Optional[rb.Usage]:
        if not self.on:
            return None
        n = self.tokens.get(index, 0)
        return rb.Usage(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n)


def _last(token_ids: list[int]) -> Optional[int]:
    return token_ids[-1] if token_ids else None


class LastTokens:
    """Each streamed choice's last token so far, for its finish chunk's :func:`stop_reason` (that chunk may bring
    no token of its own)."""

    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}

    def stop_reason(self, req: Any, index: int, chunk: StreamChunk) -> rb.StopReason:
        if chunk.token_ids:
            self.tokens[index] = chunk.token_ids[-1]
        if chunk.finish_reason is None:
            return None
        return stop_reason(req, chunk.finish_reason, chunk.stop_str, self.tokens.get(index))


async def _chunks(gw: Any, streams: list[Any], firsts: list[Any]
                  ) -> AsyncIterator[tuple[list[tuple[int, StreamChunk]], bool]]:
    """``(batch, last)``: batches of ``(prompt, chunk)``, the first chunks, then what is ready at each wake-up.

    A finish_reason comes on each choice's last chunk; ``last`` is set on the batch
    after which nothing comes (so that the end of the answer can share its write).
    One event per SDK chunk, i.e. per step that brought tokens, even when they
    complete no character yet: the stream's timing is the engine's; a batch holds
    several only when the worker fell behind.
    """
    finished: set[tuple[int, int]] = set()
    left = len(streams)
    batch = []
    for p, chunk in enumerate(firsts):
        if chunk is not None:
            if chunk.finish_reason is not None:
                finished.add((p, chunk.index))
            batch.append((p, chunk))
    if batch:
        yield batch, False
    async for items in merge(streams):
        batch = []
        for p, chunk in items:
            if chunk is not None:
                if chunk.finish_reason is not None:
                    finished.add((p, chunk.index))
                batch.append((p, chunk))
                continue
            left -= 1
            result = streams[p].result
            gw.observe(result)
            for c in result.choices:
                if (p, c.index) not in finished:
                    batch.append((p, StreamChunk("", [], index=c.index, finish_reason=c.finish_reason,
                                                 stop_str=c.stop_str)))
        if batch or not left:
            yield batch, not left


async def completion_stream(gw: Any, req: s.CompletionRequest, rid: str, prompts: list[Prompt], streams: list[Any],
                            firsts: list[Any]) -> AsyncIterator[bytes]:
    """SSE events of a streaming /v1/completions answer (an echoed prompt leads each choice's first event)."""
    created, model, n = int(time.time()), gw.model_name, req.n or 1
    # choice -> the next token's text offset: the token texts so far (as the answer without streaming counts them; the
    # text sent may lag behind them while a possible stop string's start is held back)
    sent: dict[int, int] = {}
    plps: dict[int, list] = {}  # prompt -> its prompt logprobs, once they came
    running = RunningUsage(req)
    finals = LastTokens()

    def event(p: int, chunk: StreamChunk) -> bytes:
        if chunk.prompt_logprobs is not None:
            plps[p] = chunk.prompt_logprobs
        index, text, lps = p * n + chunk.index, chunk.text_delta, None
        first = index not in sent
        offset = sent[index] if not first else _echo_end(gw, prompts[p]) if req.echo else 0
        sent[index] = offset
        if req.logprobs is not None:
            lps = completion_logprobs(gw.token_texts, chunk.token_ids, chunk.logprobs, req.logprobs, offset)
            sent[index] += sum(len(token) for token in lps.tokens)
            if first and req.echo:
                lps = join_completion_logprobs(_echo_logprobs(gw, req, prompts[p], plps.get(p)), lps)
        if first and req.echo:
            text = prompts[p].text + text
        choice = rb.CompletionChoice(index=index, text=text, finish_reason=chunk.finish_reason, logprobs=lps,
                                     stop_reason=finals.stop_reason(req, index, chunk))
        running.add(index, len(chunk.token_ids))
        usage = running.of(index, len(prompts[p].ids))
        return _sse(rb.CompletionResponse(id=rid, created=created, model=model, choices=[choice], usage=usage))

    def end() -> bytes:
        if not _include_usage(req):
            return DONE
        usage = _usage([st.result for st in streams])
        return _sse(rb.CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage)) + DONE

    try:
        async for batch, last in _chunks(gw, streams, firsts):
            data = b"".join([event(p, chunk) for p, chunk in batch])
            yield data + end() if last else data
    except (ForerunError, ConnectionError) as exc:
        gw.note_error(exc)
        yield _error_event(exc) + DONE


async def chat_stream(gw: Any, req: s.ChatCompletionRequest, rid: str, streams: list[Any],
                      firsts: list[Any], prompt_tokens: int = 0) -> AsyncIterator[bytes]:
    """SSE events of a streaming /v1/chat/completions answer; each choice's first carries the role."""
    created, model = int(time.time()), gw.model_name
    top_n = params.output_logprobs(req)
    running = RunningUsage(req)
    finals = LastTokens()

    def event(index: int, delta: rb.Delta, finish: Optional[str] = None, lps: Any = None,
              reason: rb.StopReason = None) -> bytes:
        choice = rb.ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lps, stop_reason=reason)
        return _sse(rb.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice],
                                          usage=running.of(index, prompt_tokens)))

    def chunk_event(c: StreamChunk) -> bytes:
        running.add(c.index, len(c.token_ids))
        lps = chat_logprobs(gw.token_texts, c.token_ids, c.logprobs, top_n) if top_n is not None else None
        delta = rb.Delta(content=c.text_delta) if c.text_delta or c.finish_reason is None else rb.Delta()
        return event(c.index, delta, c.finish_reason, lps, finals.stop_reason(req, c.index, c))

    def end() -> bytes:
        return _chat_stream_end(req, streams, rid, created, model)

    # The role events go out with the first tokens (they are there before the 200 is sent), with vLLM's echo.
    echoed = s.chat_echo(req)
    head = b"".join([event(index, rb.Delta(role="assistant", content=echoed)) for index in range(req.n or 1)])
    try:
        async for batch, last in _chunks(gw, streams, firsts):
            data = head + b"".join([chunk_event(c) for _, c in batch])
            head = b""
            yield data + end() if last else data
    except (ForerunError, ConnectionError) as exc:
        gw.note_error(exc)
        yield head + _error_event(exc) + DONE


def _chat_stream_end(req: s.ChatCompletionRequest, streams: list[Any], rid: str, created: int, model: str) -> bytes:
    """The end of a streamed chat answer: the usage chunk when the request asks for it, then [DONE]."""
    if not _include_usage(req):
        return DONE
    usage = _usage([streams[0].result])
    return _sse(rb.ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage)) + DONE


def _error_event(exc: BaseException) -> bytes:
    """An error after the 200 header went out: an SSE event with the OpenAI error body."""
    err = sdk_error(exc)
    return _sse(rb.ErrorResponse(rb.ErrorInfo(message=err.message, type=err.err_type, param=err.param,
                                            code=err.code)))


async def chat_tools_stream(gw: Any, req: s.ChatCompletionRequest, rid: str, streams: list[Any],
                            firsts: list[Any], prompt_tokens: int = 0) -> AsyncIterator[bytes]:
    """SSE events of a streaming answer with tools: content and calls as they can be told apart
    (:class:`ipc.gateway.tool_calls.ToolCallStream`), the calls of each choice before its finish chunk."""
    plan = plan_tools(req)
    created, model = int(time.time()), gw.model_name
    parsers: dict[int, ToolCallStream] = {}
    top_n = params.output_logprobs(req)
    running = RunningUsage(req)
    finals = LastTokens()

    def event(index: int, delta: rb.Delta, finish: Optional[str] = None, lps: Any = None,
              reason: rb.StopReason = None) -> bytes:
        choice = rb.ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lps, stop_reason=reason)
        return _sse(rb.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice],
                                          usage=running.of(index, prompt_tokens)))

    def chunk_events(c: StreamChunk) -> list[bytes]:
        running.add(c.index, len(c.token_ids))
        reason = finals.stop_reason(req, c.index, c)
        parser = parsers.setdefault(c.index, ToolCallStream(plan))
        deltas = parser.feed(c.text_delta)
        if c.finish_reason is not None:
            ends, finish = parser.finish(c.finish_reason)
            deltas += ends
        # the chunk's tokens' logprobs ride on its first event (held text or calls: an event of its own)
        lps = chat_logprobs(gw.token_texts, c.token_ids, c.logprobs, top_n) if top_n is not None and c.token_ids \
            else None
        if lps is not None and not deltas:
            deltas = [rb.Delta()]
        out = [event(c.index, d, None, lps if i == 0 else None) for i, d in enumerate(deltas)]
        if c.finish_reason is not None:
            out.append(event(c.index, rb.Delta(), finish, reason=reason))
        return out

    def end() -> bytes:
        return _chat_stream_end(req, streams, rid, created, model)

    head = b"".join([event(index, rb.Delta(role="assistant", content="")) for index in range(req.n or 1)])
    try:
        async for batch, last in _chunks(gw, streams, firsts):
            data = head + b"".join([e for _, c in batch for e in chunk_events(c)])
            head = b""
            yield data + end() if last else data
    except (ForerunError, ConnectionError) as exc:
        gw.note_error(exc)
        yield head + _error_event(exc) + DONE
