"""OpenAI answers built from SDK streams: whole responses and SSE events.

Every request is an SDK stream (one per prompt); a non-streaming answer reads
its streams to the end.  Metrics are observed here, when each request ends.
"""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Optional

import msgspec

from ipc.client import ExecutorFailedError, ForerunError, InvalidRequestError
from ipc.gateway import schemas as s
from ipc.gateway.streaming import DONE, gather_or_cancel, merge

# SDK field names -> the OpenAI parameter they came from (others: "sampling." dropped).
_PARAM_OF_FIELD = {"prompt_token_ids": "prompt", "request_id": None}
_encode = msgspec.json.encode


def sdk_error(exc: BaseException) -> s.RequestError:
    """The HTTP status and OpenAI error for an SDK exception."""
    if isinstance(exc, InvalidRequestError):
        field = exc.field or ""
        param = _PARAM_OF_FIELD.get(field, field.removeprefix("sampling.") or None)
        return s.RequestError(400, exc.message, param)
    if isinstance(exc, (ExecutorFailedError, ConnectionError)):
        return s.RequestError(503, str(exc), err_type="service_unavailable_error", code="executor_failed")
    if isinstance(exc, ForerunError) and exc.code == "overloaded":
        return s.RequestError(429, exc.message, err_type="rate_limit_error", code="overloaded")
    return s.RequestError(500, str(exc), err_type="server_error", code=getattr(exc, "code", None))


def _sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _usage(results: list[Any]) -> s.Usage:
    prompt = sum(r.prompt_tokens for r in results)
    completion = sum(r.completion_tokens for r in results)
    return s.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


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


async def whole_completion(gw: Any, rid: str, streams: list[Any]) -> s.CompletionResponse:
    """The non-streaming /v1/completions answer: one choice per prompt."""
    results = await _results(gw, streams)
    choices = [s.CompletionChoice(index=i, text=r.text, finish_reason=r.finish_reason) for i, r in enumerate(results)]
    return s.CompletionResponse(id=rid, created=int(time.time()), model=gw.model_name, choices=choices,
                                usage=_usage(results))


async def whole_chat(gw: Any, rid: str, stream: Any) -> s.ChatCompletionResponse:
    """The non-streaming /v1/chat/completions answer."""
    (r,) = await _results(gw, [stream])
    choice = s.ChatChoice(index=0, message=s.AssistantMessage(content=r.text), finish_reason=r.finish_reason)
    return s.ChatCompletionResponse(id=rid, created=int(time.time()), model=gw.model_name, choices=[choice],
                                    usage=_usage([r]))


def _include_usage(req: Any) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def _chunks(gw: Any, streams: list[Any], firsts: list[Any]) -> AsyncIterator[tuple[int, str, Optional[str]]]:
    """``(index, text, finish_reason)`` of every choice: the first chunks, then the rest as they come.

    One event per SDK chunk, i.e. per step that brought tokens, even when they
    complete no character yet: the stream's timing is the engine's.
    """
    for i, chunk in enumerate(firsts):
        if chunk is not None:
            yield i, chunk.text_delta, None
    async for i, chunk in merge(streams):
        if chunk is None:
            result = streams[i].result
            gw.observe(result)
            yield i, "", result.finish_reason
        else:
            yield i, chunk.text_delta, None


async def completion_stream(gw: Any, req: s.CompletionRequest, rid: str, streams: list[Any],
                            firsts: list[Any]) -> AsyncIterator[bytes]:
    """SSE events of a streaming /v1/completions answer."""
    created, model = int(time.time()), gw.model_name
    try:
        async for i, text, finish in _chunks(gw, streams, firsts):
            choice = s.CompletionChoice(index=i, text=text, finish_reason=finish)
            yield _sse(s.CompletionResponse(id=rid, created=created, model=model, choices=[choice]))
        if _include_usage(req):
            usage = _usage([st.result for st in streams])
            yield _sse(s.CompletionResponse(id=rid, created=created, model=model, choices=[], usage=usage))
    except (ForerunError, ConnectionError) as exc:
        gw.note_error(exc)
        yield _error_event(exc)
    yield DONE


async def chat_stream(gw: Any, req: s.ChatCompletionRequest, rid: str, streams: list[Any],
                      firsts: list[Any]) -> AsyncIterator[bytes]:
    """SSE events of a streaming /v1/chat/completions answer; the first carries the role."""
    created, model = int(time.time()), gw.model_name

    def chunk(delta: s.Delta, finish: Optional[str] = None) -> bytes:
        choice = s.ChatChunkChoice(index=0, delta=delta, finish_reason=finish)
        return _sse(s.ChatCompletionChunk(id=rid, created=created, model=model, choices=[choice]))

    yield chunk(s.Delta(role="assistant", content=""))
    try:
        async for _, text, finish in _chunks(gw, streams, firsts):
            yield chunk(s.Delta(content=text) if text or finish is None else s.Delta(), finish)
        if _include_usage(req):
            usage = _usage([streams[0].result])
            yield _sse(s.ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage))
    except (ForerunError, ConnectionError) as exc:
        gw.note_error(exc)
        yield _error_event(exc)
    yield DONE


def _error_event(exc: BaseException) -> bytes:
    """An error after the 200 header went out: an SSE event with the OpenAI error body."""
    err = sdk_error(exc)
    return _sse(s.ErrorResponse(s.ErrorInfo(message=err.message, type=err.err_type, param=err.param,
                                            code=err.code)))
