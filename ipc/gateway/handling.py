"""How a route answers: its JSON, its errors as OpenAI error bodies (a RequestError, or an SDK error with the status
it maps to), and a streamed answer as SSE that keeps an error's status until the first tokens are in."""

from __future__ import annotations

from typing import Any, Optional

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from ipc.client import ForerunError, InvalidRequestError
from ipc.gateway import response_bodies as rb
from ipc.gateway import schemas as s
from ipc.gateway import structured
from ipc.gateway.limits import MAX_ERROR_MESSAGE_CHARS
from ipc.gateway.responses import sdk_error
from ipc.gateway.streaming import ClientGone, SSEResponse, until_disconnect
from ipc.gateway.worker import Gateway

RETRY_AFTER_S = "5"  # 503s (draining, executor gone): when a client may try again, maybe on another server


def error_response(status: int, message: str, param: Optional[str] = None,
                   err_type: str = "invalid_request_error", code: Optional[str] = None) -> Response:
    """An OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = f"{message[:MAX_ERROR_MESSAGE_CHARS]}... (cut)"
    if param is not None and len(param) > 256:
        param = param[:256]
    body = rb.ErrorResponse(rb.ErrorInfo(message=message, type=err_type, param=param, code=code))
    headers = _ERROR_HEADERS.get(status)
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


# 503: when to try again; 408: the body was not read to its end, so the connection cannot carry another request
# (uvicorn closes it once the answer is out).
_ERROR_HEADERS = {503: {"Retry-After": RETRY_AFTER_S}, 408: {"Connection": "close"}}


def json_response(obj: Any, headers: Optional[dict] = None) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json", headers=headers)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


def error_for(gw: Gateway, exc: BaseException, constraint_param: Optional[str] = None,
              prompt_param: str = "prompt", *, constraint_value: Any = None,
              prompt_names: Optional[dict[str, str]] = None) -> Optional[Response]:
    """The OpenAI error response for a RequestError or an SDK error (None: not one of those).  ``constraint_param``:
    the request field a refused constraint came from (``guided_json``, ...; ``tools``: tool_choice "required" or a
    named function constrains the output with the functions' parameters), ``constraint_value`` the constraint as
    sent (a refused regex is quoted from it); ``prompt_param``: the field the prompt came from (``messages`` for
    chat), ``prompt_names`` the name of each prompt of a request that has several, by request id (``prompt[2]``):
    the message of a refused one starts with it."""
    if isinstance(exc, s.RequestError):
        return error_response(exc.status, exc.message, exc.param, exc.err_type, exc.code)
    if isinstance(exc, ClientGone):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
    if isinstance(exc, (ForerunError, ConnectionError, TimeoutError)):
        gw.note_error(exc)
        err = sdk_error(exc, prompt_param)
        param, message = err.param, err.message
        name = (prompt_names or {}).get(getattr(exc, "request_id", None))
        if constraint_field(exc):
            param = constraint_param or param
            message = structured.refusal_message(exc.field, message, constraint_value)
        elif name is not None and param == prompt_param:
            message = f"{name}: {message}"
        return error_response(err.status, message, param, err.err_type, err.code)
    return None


def constraint_field(exc: BaseException) -> bool:
    """Whether an SDK error refused the request's output constraint."""
    return isinstance(exc, InvalidRequestError) and (exc.field or "") in (
        "sampling.json_schema", "sampling.regex", "sampling.choice", "sampling.grammar")


async def run(request: Request, handler) -> Response:
    """Call a route's handler; RequestError and SDK errors become OpenAI error responses."""
    gw = gateway_of(request)
    try:
        return await handler(gw, request)
    except (s.RequestError, ClientGone, ForerunError, ConnectionError, TimeoutError) as e:
        return error_for(gw, e)


async def whole(gw: Gateway, request: Request, streams: list[Any], answer: Any) -> Response:
    """A whole (non-streaming) answer as JSON, unless the client leaves first: then its requests are aborted and
    counted as ``abort`` in the metrics, as a stream's are (ClientGone: the 499 nobody reads)."""
    try:
        return json_response(await until_disconnect(request.receive, answer))
    except ClientGone:
        count_aborts(gw, streams)
        raise


def count_aborts(gw: Gateway, streams: list[Any]) -> None:
    """``request_success_total{finished_reason="abort"}`` for each stream that did not finish."""
    for st in streams:
        if st.result is None:
            gw.metrics.request_success.labels(gw.model_name, "abort").inc()


def stream(gw: Gateway, streams: list[Any], make_events: Any, constraint_param: Optional[str] = None,
           prompt_param: str = "prompt", *, constraint_value: Any = None,
           prompt_names: Optional[dict[str, str]] = None) -> SSEResponse:
    """An SSE response; it waits for every stream's first tokens before the 200, so that errors keep their status
    (their params and names: :func:`error_for`'s)."""
    async def close(cut: bool) -> None:
        if cut:  # after the 200, or the client left before it: the streams that did not finish were aborted
            count_aborts(gw, streams)
        for st in streams:
            await st.aclose()

    return SSEResponse(streams, make_events, lambda exc: error_for(
        gw, exc, constraint_param, prompt_param, constraint_value=constraint_value, prompt_names=prompt_names), close)
