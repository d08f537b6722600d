"""One gateway worker's state: its SDK client, what the server said about its model, the checks every route
shares, the tokenizer's thread pool, and whether the executor has failed (a 503 for new requests until the server
serves again)."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import msgspec
from starlette.requests import Request

from ipc.client import AsyncClient, ExecutorFailedError, ForerunError, encode_prompt
from ipc.client.prompt import chars_per_token, text_size_problem
from ipc.gateway import params
from ipc.gateway import schemas as s
from ipc.gateway.body import read_body
from ipc.gateway.limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_THREADS,
                                INLINE_CHARS)
from ipc.gateway.logprobs import TokenTexts
from ipc.gateway.metrics import request_metrics

HEALTH_TIMEOUT_S = 2.0  # a scheduler that cannot answer GetStats in this time is unhealthy
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_FLOAT_FOR_INT = re.compile(r"^Expected `int(?: \| null)?`, got `float` - at `\$([^`]*)`$")
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_MAX_INTEGRAL_FIXES = 64  # integral floats made integers in one body (stop_token_ids may hold a few)
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)  # each escape in order, so "\\\\ud800" is not one


def echo(value: Any, limit: int = 64) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: an error never echoes a large input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def decode_body(body: bytes, kind: type) -> Any:
    """The body as a ``kind`` struct; a 400 naming the field (or the JSON problem) otherwise."""
    try:
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as e:
            if not _FLOAT_FOR_INT.search(str(e)):
                raise
            return _with_integral_floats(body, kind, e)  # 8.0 where an integer goes: pydantic (vLLM) takes it
    except msgspec.ValidationError as e:
        raise _validation_error(e) from None
    except msgspec.DecodeError as e:
        where = _non_finite(body)  # Python's json.dumps (the openai client's too) writes NaN and Infinity
        if where is not None:
            raise s.RequestError(400, f"{where[0]} is {where[1]}, which JSON has no number for; give a finite "
                                      f"number", where[0]) from None
        raise s.RequestError(400, f"the body is not valid JSON: {_json_problem(body, e)}") from None
    except UnicodeDecodeError as e:
        raise s.RequestError(400, f"the body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except RecursionError:
        raise s.RequestError(400, "the body nests arrays or objects too deeply: the limit here is about "
                                  f"{_nesting_limit()} levels") from None


def _validation_error(e: msgspec.ValidationError) -> s.RequestError:
    """msgspec's message as a 400 whose param is the field's path (``messages[0].role``)."""
    text = str(e)
    unknown, path = _UNKNOWN.search(text), _PATH.search(text)
    param = unknown.group(1) if unknown else (path.group(1) if path else None)
    if unknown and path and path.group(1):
        param = f"{path.group(1)}.{unknown.group(1)}"
    return s.RequestError(400, text, param)


def _with_integral_floats(body: bytes, kind: type, error: msgspec.ValidationError) -> Any:
    """The body decoded with each float that stands where an integer goes (``max_tokens: 8.0``) made that integer.

    Raises the ValidationError of the first such float that is not integral (8.5), or of any other problem.
    Runs only on this error path: a body of integers costs nothing more."""
    obj = msgspec.json.decode(body)
    for _ in range(_MAX_INTEGRAL_FIXES):
        found = _FLOAT_FOR_INT.search(str(error))
        container, key = _locate(obj, found.group(1)) if found else (None, None)
        value = None if container is None else container[key]
        if not (isinstance(value, float) and value.is_integer()):
            raise error
        container[key] = int(value)
        try:
            return msgspec.convert(obj, kind, strict=True)
        except msgspec.ValidationError as e:
            error = e
    raise error


def _locate(obj: Any, path: str) -> tuple[Any, Any]:
    """(container, key) of the value at msgspec's error path (``.stop_token_ids[2]``); (None, None) if none."""
    steps = _STEP.findall(path)
    if not steps or "".join(f".{name}" if name else f"[{index}]" for name, index in steps) != path:
        return None, None
    keys = [name or int(index) for name, index in steps]
    for key in keys[:-1]:
        if not _has(obj, key):
            return None, None
        obj = obj[key]
    return (obj, keys[-1]) if _has(obj, keys[-1]) else (None, None)


def _has(obj: Any, key: Any) -> bool:
    if isinstance(obj, dict):
        return key in obj
    return isinstance(obj, list) and isinstance(key, int) and key < len(obj)


def _non_finite(body: bytes) -> Optional[tuple[str, str]]:
    """(the field's path, the literal) of the first NaN or Infinity in a body that is JSON but for them, else None
    (on the error path only)."""
    import json
    import math

    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path, "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return None


def _json_problem(body: bytes, e: msgspec.DecodeError) -> str:
    """msgspec's complaint, or what is wrong when it misreads it: a lone UTF-16 surrogate escape (``\\ud800``
    without its pair) is "truncated" to msgspec."""
    lone = _lone_surrogate(body) if "truncated" in str(e) or "surrogate" in str(e) else None
    if lone is None:
        return str(e)
    return f"the escape {lone} is half of a UTF-16 surrogate pair, without its other half: not valid Unicode"


def _lone_surrogate(body: bytes) -> Optional[str]:
    """The first ``\\uXXXX`` escape of ``body`` that is an unpaired surrogate, or None."""
    codes = [(m.start(), m.end(), int(m.group(1), 16) if m.group(1) else None, m.group(0))
             for m in _ESCAPE.finditer(body.decode("utf-8", "replace"))]
    n = 0
    while n < len(codes):
        _, end, code, text = codes[n]
        n += 1
        if code is None or not 0xD800 <= code <= 0xDFFF:
            continue
        low = codes[n] if n < len(codes) else None
        if code >= 0xDC00 or low is None or low[0] != end or low[2] is None or not 0xDC00 <= low[2] <= 0xDFFF:
            return text  # a low half alone, or a high half without its low one
        n += 1  # the pair's low half
    return None


def _nesting_limit() -> int:
    """About how many levels of arrays and objects the caller's decode takes (within a few): msgspec counts each
    against the interpreter's recursion limit, so it depends on the stack below.  Found by decoding nested arrays
    here (a binary search of about ten small decodes, on this error path only), plus one for this frame."""
    lo, hi = 0, sys.getrecursionlimit()
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            msgspec.json.decode(b"[" * mid + b"]" * mid)
            lo = mid
        except RecursionError:
            hi = mid - 1
    return lo + 1


class Gateway:
    """One worker's state: the SDK client, what the server said about its model, metrics."""

    def __init__(self, address: str, api_key: Optional[str] = None, *,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 tokenizer_threads: int = DEFAULT_TOKENIZER_THREADS,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.client = AsyncClient(address, timeout=60.0, client_name="forerun-gateway", api_key=api_key or "")
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.body_timeout_s = body_timeout_s
        self.pool = ThreadPoolExecutor(tokenizer_threads, thread_name_prefix="forerun-tokenize")
        self.failed = False  # the executor failed: every later request gets 503 until the server says it serves
        self._recheck: Optional[asyncio.Task] = None
        self.created = int(time.time())

    async def start(self) -> None:
        info = await self.client.connect()
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.tokenizer = await self.client.get_tokenizer() if info.has_tokenizer else None
        self.chars_per_token = chars_per_token(self.tokenizer)  # found as the tokenizer loaded: no cost here
        self.token_texts = TokenTexts(self.tokenizer)
        self.metrics = request_metrics(self.model_name)

    async def stop(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        await self.client.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def body(self, request: Request, kind: type) -> Any:
        return decode_body(await read_body(request, self.max_request_bytes, self.body_timeout_s), kind)

    # -- checks shared by the generation routes ------------------------------

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise s.RequestError(404, f"The model {echo(model)} does not exist; this server serves "
                                      f"`{self.model_name}`.", "model", code="model_not_found")

    def check_request(self, req: Union[s.CompletionRequest, s.ChatCompletionRequest]) -> None:
        self.check_model(req.model)
        name = s.unsupported_param(req)
        if name is not None:
            raise s.RequestError(400, f"{name}={echo(getattr(req, name))} is not supported by forerun yet"
                                      f"{s.INSTEAD.get(name, '')}", name, code="unsupported_parameter")
        params.check_stream_params(req)
        params.check_counts(req)  # first: the checks after it, and the route, loop over these
        params.check_numbers(req)
        if self.failed:
            raise s.RequestError(503, "the executor failed; no new requests until the server serves again",
                                 err_type="service_unavailable_error", code="executor_failed")

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise s.RequestError(400, "the server has no tokenizer: send token ids", "prompt")
        return self.tokenizer

    def check_token_ids(self, ids: list[int], param: str) -> None:
        """A 400 naming ``param`` for the first id outside the vocabulary, in the scheduler's words: checked here, as
        the client sent them, because one past 64 bits could not even be sent to it.  ``min`` and ``max`` first: a
        long prompt of good ids costs no loop in Python."""
        if ids and not (min(ids) >= 0 and max(ids) < self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise s.RequestError(400, f"token id {echo(bad)} is out of range [0, {self.vocab_size})", param)

    def check_chars(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit in the context before templating or tokenizing it (a length, no parse)."""
        problem = text_size_problem(num_chars, self.max_model_len, self.chars_per_token)
        if problem is not None:
            raise s.RequestError(400, problem, param)

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
