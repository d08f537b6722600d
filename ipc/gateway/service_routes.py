"""The routes around generation: the model list, tokenize and detokenize, health, metrics, version."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ipc.client import ForerunError, InvalidRequestError
from ipc.client.prompt import check_messages
from ipc.gateway import response_bodies as rb
from ipc.gateway import schemas as s
from ipc.gateway.handling import RETRY_AFTER_S, gateway_of, json_response, run
from ipc.gateway.metrics import render
from ipc.gateway.worker import HEALTH_TIMEOUT_S, Gateway
from ipc.version import forerun_version


async def models(request: Request) -> Response:
    async def handle(gw: Gateway, request: Request) -> Any:
        return json_response(rb.ModelList([_card(gw)]))
    return await run(request, handle)


async def model(request: Request) -> Response:
    """``GET /v1/models/{id}`` (the openai client's ``models.retrieve``): the card, or OpenAI's 404 for another id."""
    async def handle(gw: Gateway, request: Request) -> Any:
        gw.check_model(request.path_params["model"])
        return json_response(_card(gw))
    return await run(request, handle)


def _card(gw: Gateway) -> rb.ModelCard:
    return rb.ModelCard(id=gw.model_name, created=gw.created, max_model_len=gw.max_model_len)


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
    return await run(request, handle)


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
        gw.check_token_ids(req.tokens, "tokens")
        return json_response({"prompt": gw.need_tokenizer().decode(req.tokens)})
    return await run(request, handle)


async def health(request: Request) -> Response:
    gw = gateway_of(request)
    if not gw.failed:
        try:
            stats = await gw.client.get_stats(timeout=HEALTH_TIMEOUT_S)
            if not stats.draining:  # a draining server takes no new requests: load balancers look elsewhere
                return Response(status_code=200)
        except (TimeoutError, ConnectionError, RuntimeError, ForerunError):
            pass
    return Response(status_code=503, headers={"Retry-After": RETRY_AFTER_S})


async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    try:
        stats = await gw.client.get_stats(timeout=HEALTH_TIMEOUT_S)
    except (TimeoutError, ConnectionError, RuntimeError, ForerunError):
        stats = None
    return Response(render(stats, gw.model_name), media_type="text/plain; version=0.0.4; charset=utf-8")


async def version(request: Request) -> Response:
    return json_response({"version": forerun_version()})
