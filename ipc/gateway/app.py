"""The OpenAI-compatible HTTP app: Starlette routes over one SDK ``AsyncClient``.

Each gateway worker process runs this app on uvicorn.  Request bodies are
decoded by msgspec into the structs of ``ipc/gateway/schemas.py`` (errors name
the field) and answers are encoded by ``msgspec.json``: no pydantic layer on
the per-token path.  The scheduler only ever sees SDK messages.

Hostile input is bounded before it costs anything (docs/reliability.md,
"Hostile clients"): a body over ``--max-request-bytes`` is a 413 before it is
read in full, a body that stops coming for ``body_timeout_s`` (30 s) is a 408
and its bytes are dropped, text that cannot fit in the context is a 400 before templating
or tokenizing (a character count), and prompts longer than ``INLINE_CHARS``
are templated and tokenized in a thread pool, so the event loop, and every
other request of the worker, never waits for one heavy request.
"""

from __future__ import annotations

import hmac
import os
import sys
import uuid
from contextlib import asynccontextmanager
from typing import Any, Optional, Union

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ipc.client import InvalidRequestError
from ipc.gateway import schemas as s
from ipc.gateway import chat_template, structured, tools
from ipc.gateway.handling import error_for, error_response, run, stream, whole
from ipc.gateway.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_THREADS
from ipc.gateway.responses import (
    Prompt,
    chat_stream,
    chat_tools_stream,
    completion_stream,
    whole_chat,
    whole_completion,
)
from ipc.gateway.service_routes import detokenize, health, metrics, model, models, tokenize, version
from ipc.gateway.worker import Gateway, echo

OPEN_PATHS = ("/health", "/metrics", "/version")  # answered without the API key
NO_KEY = ("You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer "
          "auth (i.e. Authorization: Bearer YOUR_KEY).")  # OpenAI's words


async def completions(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        req = await gw.body(request, s.CompletionRequest)
        gw.check_request(req)
        # max_tokens 0 with echo scores the prompt (its logprobs, as lm-eval-harness asks): one token is generated
        # and left out of the answer
        score = req.max_tokens == 0 and bool(req.echo)
        if score and req.stream:
            raise s.RequestError(400, "max_tokens 0 with echo (scoring the prompt) is answered whole, not streamed",
                                 "max_tokens")
        prompts = await _prompts(gw, req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = [gw.new_stream(p.ids, f"{rid}-{i}", gw.sampling_kwargs(
            req, _completion_max_tokens(req, score, gw.max_model_len - len(p.ids)), len(p.ids)))
            for i, p in enumerate(prompts)]
        param = structured.constraint_param(req)  # what a refused constraint's 400 names
        names = dict(constraint_value=structured.constraint_value(req), prompt_names=_prompt_names(rid, len(prompts)))
        if req.stream:
            return stream(gw, streams, lambda firsts: completion_stream(gw, req, rid, prompts, streams, firsts), param,
                          **names)
        try:
            return await whole(gw, request, streams, whole_completion(gw, req, rid, prompts, streams, score))
        except InvalidRequestError as e:
            return error_for(gw, e, param, **names)
    return await run(request, handle)


def _prompt_names(rid: str, count: int) -> Optional[dict[str, str]]:
    """The name of each prompt by its request id (``prompt[2]``), when there are several: an error names the one
    refused (None: one prompt, which ``prompt`` names)."""
    return {f"{rid}-{i}": f"prompt[{i}]" for i in range(count)} if count > 1 else None


def _completion_max_tokens(req: s.CompletionRequest, score: bool, room: int) -> int:
    """A completion's max_tokens: one when it scores the prompt (the token is left out of the answer); unset,
    OpenAI's 16 within the ``room`` the prompt leaves in the context (a long prompt is not refused for a value its
    client never sent: vLLM's reading)."""
    if score:
        return 1
    return max(1, min(16, room)) if req.max_tokens is None else req.max_tokens


async def _prompts(gw: Gateway, req: s.CompletionRequest) -> list[Prompt]:
    """The request's prompts as token ids, with their text for ``echo``; of several, a refused one is named at the
    start of the 400's message (``prompt[2]: ...``)."""
    given = s.prompts(req)
    prompts = []
    for i, p in enumerate(given):
        try:
            prompts.append(await _prompt(gw, req, p))
        except (s.RequestError, InvalidRequestError) as e:
            if len(given) == 1:
                raise
            if isinstance(e, s.RequestError):
                raise s.RequestError(e.status, f"prompt[{i}]: {e.message}", e.param, e.err_type, e.code) from None
            raise s.RequestError(400, f"prompt[{i}]: {e.message}", "prompt") from None  # the tokenizer's
    return prompts


async def _prompt(gw: Gateway, req: s.CompletionRequest, p: Union[str, list[int]]) -> Prompt:
    """One prompt: text tokenized, or token ids checked against the vocabulary."""
    if isinstance(p, str):
        return Prompt(await gw.encode_text(p), p)
    gw.check_token_ids(p, "prompt")
    return Prompt(p, gw.tokenizer.decode(p) if req.echo and gw.tokenizer else "")


async def chat_completions(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        req = await gw.body(request, s.ChatCompletionRequest)
        gw.check_request(req)
        plan = tools.plan_tools(req)
        ids = await (chat_template.encode(gw, req, plan) if chat_template.renders_here(req)
                     else gw.encode_chat(s.chat_messages(req.messages)))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = [gw.new_stream(ids, rid, tools.with_constraint(gw.sampling_kwargs(req, max_tokens, len(ids)), plan))]
        # what a refused constraint's 400 names: "required" or a named function constrains the output with the
        # functions' parameters
        param = "tools" if tools.constrains(plan) else structured.constraint_param(req)
        value = None if tools.constrains(plan) else structured.constraint_value(req)
        if req.stream:  # chat has no prompt field: a prompt the scheduler refuses is the messages' fault
            events = chat_stream if plan is None else chat_tools_stream
            return stream(gw, streams, lambda firsts: events(gw, req, rid, streams, firsts, len(ids)), param,
                          "messages", constraint_value=value)
        answer = whole_chat(gw, req, rid, Prompt(ids, ""), streams[0], plan)
        try:
            return await whole(gw, request, streams, answer)
        except InvalidRequestError as e:
            return error_for(gw, e, param, "messages", constraint_value=value)
    return await run(request, handle)


class _Auth:
    """ASGI middleware: ``Authorization: Bearer KEY`` on every path but OPEN_PATHS, when a key is set.

    The scheme is case-insensitive (RFC 9110); the key is compared in constant time."""

    def __init__(self, app: Any, api_key: Optional[str]) -> None:
        self.app = app
        self.expected = api_key.encode() if api_key else None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.expected is not None and scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"").strip()
            scheme, _, token = header.partition(b" ")
            if not (hmac.compare_digest(token.strip(), self.expected) and scheme.lower() == b"bearer"):
                message = "Incorrect API key provided." if header else NO_KEY
                response = error_response(401, message, code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class _HotRoutes:
    """ASGI: the generation routes go straight to their handlers, every other request through Starlette.

    Starlette's router and its two exception middlewares cost a dozen awaits per request
    and two wrappers around every streamed send.  These handlers answer their own errors
    (``handling.run``); anything else they raise reaches uvicorn, which logs it and answers 500,
    as Starlette's ServerErrorMiddleware would.
    """

    def __init__(self, app: Starlette, routes: dict[str, Any]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        handler = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            return await self.app(scope, receive, send)
        scope["app"] = self.app  # what Starlette sets: Request.app, and so gateway_of(), read it
        response = await handler(Request(scope, receive))
        await response(scope, receive, send)


def create_app(address: str, api_key: Optional[str] = None, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, exit_on_start_failure: bool = False) -> Any:
    """The ASGI app of one gateway worker, talking to the scheduler at ``address`` (``body_timeout_s``: a request
    body of which no byte came for this long is a 408, ``ipc/gateway/body.py``).  ``exit_on_start_failure`` (a
    worker process): a start that fails (the server gone, a tokenizer transformers cannot build) is one line on
    stderr and exit status 3, not uvicorn's traceback; the server process then says which worker failed."""
    gateway = Gateway(address, api_key, max_request_bytes=max_request_bytes, tokenizer_threads=tokenizer_threads,
                      body_timeout_s=body_timeout_s)

    async def lifespan(app: Starlette):
        try:
            await gateway.start()
        except Exception as e:
            if not exit_on_start_failure:
                raise
            print(f"forerun: gateway worker {os.getpid()}: cannot start: {type(e).__name__}: {e}".splitlines()[0],
                  file=sys.stderr, flush=True)
            os._exit(3)
        yield
        await gateway.stop()

    hot = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}
    routes = [Route(path, handler, methods=["POST"]) for path, handler in hot.items()] + [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
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
