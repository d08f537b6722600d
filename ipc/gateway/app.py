"""The OpenAI-compatible HTTP app: Starlette routes over one SDK ``AsyncClient``.

Each gateway worker process runs this app on uvicorn.  Request bodies are
decoded by msgspec into the structs of ``ipc/gateway/schemas.py`` (errors name
the field) and answers are encoded by ``msgspec.json``: no pydantic layer on
the per-token path.  The scheduler only ever sees SDK messages.

Hostile input is bounded before it costs anything (docs/reliability.md,
"Hostile clients"): a body over ``--max-request-bytes`` is a 413 before it is
read in full, text that cannot fit in the context is a 400 before templating
or tokenizing (a character count), and prompts longer than ``INLINE_CHARS``
are templated and tokenized in a thread pool, so the event loop, and every
other request of the worker, never waits for one heavy request.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Optional, Union

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ipc.client import AsyncClient, ExecutorFailedError, ForerunError, InvalidRequestError, encode_prompt
from ipc.client.prompt import MAX_CHARS_PER_TOKEN, check_messages
from ipc.gateway import params, tools
from ipc.gateway import schemas as s
from ipc.gateway.body import read_body
from ipc.gateway.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_THREADS, INLINE_CHARS,
                                MAX_ERROR_MESSAGE_CHARS)
from ipc.gateway.logprobs import TokenTexts
from ipc.gateway.metrics import render, request_metrics
from ipc.gateway.responses import (
    Prompt,
    chat_stream,
    chat_tools_stream,
    completion_stream,
    sdk_error,
    whole_chat,
    whole_completion,
)
from ipc.gateway.streaming import ClientGone, SSEResponse, until_disconnect
from ipc.version import forerun_version

HEALTH_TIMEOUT_S = 2.0  # a scheduler that cannot answer GetStats in this time is unhealthy
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key
RETRY_AFTER_S = "5"  # 503s (draining, executor gone): when a client may try again, maybe on another server


def echo(value: Any, limit: int = 64) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: an error never echoes a large input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_response(status: int, message: str, param: Optional[str] = None,
                   err_type: str = "invalid_request_error", code: Optional[str] = None) -> Response:
    """An OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
    if len(message) > MAX_ERROR_MESSAGE_CHARS:
        message = f"{message[:MAX_ERROR_MESSAGE_CHARS]}... (cut)"
    if param is not None and len(param) > 256:
        param = param[:256]
    body = s.ErrorResponse(s.ErrorInfo(message=message, type=err_type, param=param, code=code))
    headers = {"Retry-After": RETRY_AFTER_S} if status == 503 else None
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json", headers=headers)


def json_response(obj: Any, headers: Optional[dict] = None) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json", headers=headers)


def _decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        unknown, path = _UNKNOWN.search(text), _PATH.search(text)
        param = unknown.group(1) if unknown else (path.group(1) if path else None)
        if unknown and path and path.group(1):
            param = f"{path.group(1)}.{unknown.group(1)}"
        raise s.RequestError(400, text, param) from None
    except msgspec.DecodeError as e:
        raise s.RequestError(400, f"the body is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise s.RequestError(400, f"the body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise s.RequestError(400, "the body nests arrays or objects too deeply") from None


class Gateway:
    """One worker's state: the SDK client, what the server said about its model, metrics."""

    def __init__(self, address: str, api_key: Optional[str] = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS) -> None:
        self.client = AsyncClient(address, timeout=60.0, client_name="forerun-gateway", api_key=api_key or "")
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="forerun-tokenize")
        self.failed = False  # the executor failed: every later request gets 503 until the server says it serves
        self._recheck: Optional[asyncio.Task] = None
        self.created = int(time.time())

    async def start(self) -> None:
        info = await self.client.connect()
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_chars = info.max_model_len * MAX_CHARS_PER_TOKEN
        self.vocab_size = info.vocab_size
        self.tokenizer = await self.client.get_tokenizer() if info.has_tokenizer else None
        self.token_texts = TokenTexts(self.tokenizer)
        self.metrics = request_metrics(self.model_name)

    async def stop(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        await self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def body(self, request: Request, kind: type) -> Any:
        return _decode(await read_body(request, self.max_request_bytes), kind)

    # -- checks shared by the generation routes ------------------------------

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise s.RequestError(404, f"The model {echo(model)} does not exist; this server serves "
                                      f"`{self.model_name}`.", "model", code="model_not_found")

    def check_request(self, req: Union[s.CompletionRequest, s.ChatCompletionRequest]) -> None:
        self.check_model(req.model)
        name = s.unsupported_param(req)
        if name is not None:
            raise s.RequestError(400, f"{name}={echo(getattr(req, name))} is not supported by forerun yet",
                                 name, code="unsupported_parameter")
        params.check_stream_params(req)
        if self.failed:
            raise s.RequestError(503, "the executor failed; no new requests until the server serves again",
                                 err_type="service_unavailable_error", code="executor_failed")

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise s.RequestError(400, "the server has no tokenizer: send token ids", "prompt")
        return self.tokenizer

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit in the context before templating or tokenizing it (a length, no parse)."""
        if num_chars > self.max_chars:
            raise s.RequestError(400, f"the prompt has {num_chars} characters; the model's context is "
                                      f"{self.max_model_len} tokens, and no text over {self.max_chars} characters "
                                      f"({MAX_CHARS_PER_TOKEN} per token) fits in it", param)

    async def off_loop(self, num_chars: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``: here for short text, else in the worker's thread pool (the loop serves on)."""
        if num_chars <= INLINE_CHARS:
            return fn(*args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    async def encode_text(self, prompt: str) -> list[int]:
        self.check_chars(len(prompt), "prompt")
        return await self.off_loop(len(prompt), encode_prompt, self.need_tokenizer(), prompt,
                                   max_model_len=self.max_model_len)

    async def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        num_chars = sum(len(m["content"]) for m in messages)
        self.check_chars(num_chars, "messages")
        return await self.off_loop(num_chars, encode_prompt, self.need_tokenizer(), messages=messages,
                                   max_model_len=self.max_model_len)

    def sampling_kwargs(self, req: Union[s.CompletionRequest, s.ChatCompletionRequest], max_tokens: Optional[int],
                        prompt_len: int) -> dict[str, Any]:
        """The SDK's sampling keywords for one prompt (max_tokens: given, else the rest of the context)."""
        limit = max_tokens if max_tokens is not None else max(self.max_model_len - prompt_len, 1)
        return params.sampling_kwargs(req, limit, self.vocab_size)

    def new_stream(self, ids: list[int], request_id: str, kw: dict[str, Any]) -> Any:
        # No time limit: a client that gives up disconnects, and that aborts the request.
        return self.client.stream(prompt_token_ids=ids, request_id=request_id, timeout=float("inf"),
                                  detokenize=self.tokenizer is not None, **kw)

    def note_error(self, exc: BaseException) -> None:
        """After an executor failure every later request and /health answer 503 at once, until the server answers
        that it is serving: a request given up after two executor failures in a row leaves a server that restarts
        its executor and serves the others; a server whose executor failed for good says it is draining, or is
        gone, and the 503s stay."""
        if isinstance(exc, ExecutorFailedError) and not self.failed:
            self.failed = True
            self._recheck = asyncio.get_running_loop().create_task(self.recheck())

    async def recheck(self) -> None:
        """Clear :attr:`failed` if the server answers that it takes requests."""
        try:
            stats = await self.client.get_stats(timeout=HEALTH_TIMEOUT_S)
        except (TimeoutError, ConnectionError, RuntimeError, ForerunError):
            return
        if not stats.draining:
            self.failed = False

    def observe(self, result: Any) -> None:
        if result is not None:
            self.metrics.observe(result)


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _error_for(gw: Gateway, exc: BaseException, constraint_param: Optional[str] = None) -> Optional[Response]:
    """The OpenAI error response for a RequestError or an SDK error (None: not one of those).  ``constraint_param``:
    the request field a refused constraint came from, where not ``response_format`` (``tools``: tool_choice
    "required" or a named function constrains the output with the functions' parameters)."""
    if isinstance(exc, s.RequestError):
        return error_response(exc.status, exc.message, exc.param, exc.err_type, exc.code)
    if isinstance(exc, ClientGone):
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed"
    if isinstance(exc, (ForerunError, ConnectionError, TimeoutError)):
        gw.note_error(exc)
        err = sdk_error(exc)
        param = constraint_param if constraint_param and _constraint_field(exc) else err.param
        return error_response(err.status, err.message, param, err.err_type, err.code)
    return None


def _constraint_field(exc: BaseException) -> bool:
    """Whether an SDK error refused the request's output constraint."""
    return isinstance(exc, InvalidRequestError) and (exc.field or "") in (
        "sampling.json_schema", "sampling.regex", "sampling.choice", "sampling.grammar")


async def _run(request: Request, handler) -> Response:
    """Call a route's handler; RequestError and SDK errors become OpenAI error responses."""
    gw = _gateway(request)
    try:
        return await handler(gw, request)
    except (s.RequestError, ClientGone, ForerunError, ConnectionError, TimeoutError) as e:
        return _error_for(gw, e)


async def completions(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        req = await gw.body(request, s.CompletionRequest)
        gw.check_request(req)
        prompts = []
        for p in s.prompts(req):
            ids = await gw.encode_text(p) if isinstance(p, str) else p
            text = p if isinstance(p, str) else (gw.tokenizer.decode(p) if req.echo and gw.tokenizer else "")
            prompts.append(Prompt(ids, text))
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default here
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [gw.new_stream(p.ids, f"{rid}-{i}", gw.sampling_kwargs(req, max_tokens, len(p.ids)))
                   for i, p in enumerate(prompts)]
        if req.stream:
            return _stream(gw, streams, lambda firsts: completion_stream(gw, req, rid, prompts, streams, firsts))
        answer = whole_completion(gw, req, rid, prompts, streams)
        return json_response(await until_disconnect(request.receive, answer))
    return await _run(request, handle)


async def chat_completions(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        req = await gw.body(request, s.ChatCompletionRequest)
        gw.check_request(req)
        plan = tools.plan_tools(req)
        ids = await (tools.encode(gw, req, plan) if tools.uses_tools(req)
                     else gw.encode_chat(s.chat_messages(req.messages)))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = [gw.new_stream(ids, rid, tools.with_constraint(gw.sampling_kwargs(req, max_tokens, len(ids)), plan))]
        from_tools = "tools" if tools.constraint(plan) else None  # a refused constraint: the functions' parameters
        if req.stream:
            events = chat_stream if plan is None else chat_tools_stream
            return _stream(gw, streams, lambda firsts: events(gw, req, rid, streams, firsts), from_tools)
        answer = whole_chat(gw, req, rid, Prompt(ids, ""), streams[0], plan)
        try:
            return json_response(await until_disconnect(request.receive, answer))
        except InvalidRequestError as e:
            if from_tools and _constraint_field(e):
                raise s.RequestError(400, e.message, from_tools) from None
            raise
    return await _run(request, handle)


def _stream(gw: Gateway, streams: list[Any], make_events: Any, constraint_param: Optional[str] = None) -> SSEResponse:
    """An SSE response; it waits for every stream's first tokens before the 200, so that errors keep their status."""
    async def close(started: bool) -> None:
        for st in streams:
            if started and st.result is None:  # cut short: the client left or an error ended it
                gw.metrics.request_success.labels(gw.model_name, "abort").inc()
            await st.aclose()

    return SSEResponse(streams, make_events, lambda exc: _error_for(gw, exc, constraint_param), close)


async def models(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        card = s.ModelCard(id=gw.model_name, created=gw.created, max_model_len=gw.max_model_len)
        return json_response(s.ModelList([card]))
    return await _run(request, handle)


async def tokenize(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        req = await gw.body(request, s.TokenizeRequest)
        gw.check_model(req.model)
        tok = gw.need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise s.RequestError(400, "give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            messages = s.chat_messages(req.messages)
            check_messages(messages)
            num_chars = sum(len(m["content"]) for m in messages)
            gw.check_chars(num_chars, "messages")
            ids = await gw.off_loop(num_chars, _tokenize_chat, tok, messages, req.add_generation_prompt)
        else:
            gw.check_chars(len(req.prompt), "prompt")
            ids = await gw.off_loop(len(req.prompt), _tokenize_text, tok, req.prompt, req.add_special_tokens)
        return json_response({"count": len(ids), "max_model_len": gw.max_model_len, "tokens": ids})
    return await _run(request, handle)


def _tokenize_chat(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        return list(tok.encode(text, add_special_tokens=False))
    except Exception as exc:  # jinja2 and transformers raise many types
        raise InvalidRequestError("invalid_request", "messages", f"the chat template or tokenizer failed: "
                                                                 f"{type(exc).__name__}: {exc}") from None


def _tokenize_text(tok: Any, prompt: str, add_special_tokens: bool) -> list[int]:
    try:
        return list(tok.encode(prompt, add_special_tokens=add_special_tokens))
    except Exception as exc:  # e.g. a lone surrogate
        raise InvalidRequestError("invalid_request", "prompt",
                                  f"the text could not be tokenized: {type(exc).__name__}: {exc}") from None


async def detokenize(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        req = await gw.body(request, s.DetokenizeRequest)
        gw.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < gw.vocab_size), None)
        if bad is not None:
            raise s.RequestError(400, f"token id {bad} is out of range [0, {gw.vocab_size})", "tokens")
        return json_response({"prompt": gw.need_tokenizer().decode(req.tokens)})
    return await _run(request, handle)


async def health(request: Request) -> Response:
    gw = _gateway(request)
    if not gw.failed:
        try:
            stats = await gw.client.get_stats(timeout=HEALTH_TIMEOUT_S)
            if not stats.draining:  # a draining server takes no new requests: load balancers look elsewhere
                return Response(status_code=200)
        except (TimeoutError, ConnectionError, RuntimeError, ForerunError):
            pass
    return Response(status_code=503, headers={"Retry-After": RETRY_AFTER_S})


async def metrics(request: Request) -> Response:
    gw = _gateway(request)
    try:
        stats = await gw.client.get_stats(timeout=HEALTH_TIMEOUT_S)
    except (TimeoutError, ConnectionError, RuntimeError, ForerunError):
        stats = None
    return Response(render(stats, gw.model_name), media_type="text/plain; version=0.0.4; charset=utf-8")


async def version(request: Request) -> Response:
    return json_response({"version": forerun_version()})


class _Auth:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every path but OPEN_PATHS, when a key is set.

    The scheme is case-insensitive (RFC 9110); the key is compared in constant time."""

    def __init__(self, app: Any, api_key: Optional[str]) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.expected is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if not (hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"):
                response = error_response(401, "Incorrect API key provided.", code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _HotRoutes:
    """ASGI: the generation routes go straight to their handlers, every other request through Starlette.

    Starlette's router and its two exception middlewares cost a dozen awaits per request
    and two wrappers around every streamed send.  These handlers answer their own errors
    (``_run``); anything else they raise reaches uvicorn, which logs it and answers 500,
    as Starlette's ServerErrorMiddleware would.
    """

    def __init__(self, app: Starlette, routes: dict[str, Any]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        scope["app"] = self.app  # what Starlette sets: Request.app, and so _gateway(), read it
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def create_app(address: str, api_key: Optional[str] = None, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS) -> Any:
    """The ASGI app of one gateway worker, talking to the scheduler at ``address``."""
    gateway = Gateway(address, api_key, max_request_bytes=max_request_bytes, tokenizer_threads=tokenizer_threads)

    async def lifespan(app: Starlette):
        await gateway.start()
        yield
        await gateway.stop()

    hot = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}
    routes = [Route(path, handler, methods=["POST"]) for path, handler in hot.items()] + [
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    served = ", ".join(f"{'/'.join(sorted(r.methods - {'HEAD'}))} {r.path}" for r in routes)

    async def not_served(request: Request, exc: Exception) -> Response:
        """An unknown path or method: an OpenAI error body naming what this server answers (not Starlette's text)."""
        status = getattr(exc, "status_code", 404)
        what = "path" if status == 404 else "method for this path"
        return error_response(status, f"{request.method} {echo(request.url.path)}: no such {what}; forerun serves "
                                      f"{served}", code="not_found" if status == 404 else "method_not_allowed")

    app = Starlette(routes=routes, lifespan=asynccontextmanager(lifespan),
                    exception_handlers={404: not_served, 405: not_served})
    app.state.gateway = gateway
    return _Auth(_HotRoutes(app, hot), api_key)
