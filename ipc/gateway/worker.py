"""One gateway worker's state: its SDK client, what the server said about its model, the checks every route
shares, the tokenizer's thread pool, and whether the executor has failed (a 503 for new requests until the server
serves again)."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Union

import msgspec
from starlette.requests import Request

from ipc.client import AsyncClient, ExecutorFailedError, ForerunError, encode_prompt
from ipc.client.prompt import MAX_CHARS_PER_TOKEN
from ipc.gateway import params
from ipc.gateway import schemas as s
from ipc.gateway.body import read_body
from ipc.gateway.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_TOKENIZER_THREADS, INLINE_CHARS
from ipc.gateway.logprobs import TokenTexts
from ipc.gateway.metrics import request_metrics

HEALTH_TIMEOUT_S = 2.0  # a scheduler that cannot answer GetStats in this time is unhealthy
_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def echo(value: Any, limit: int = 64) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: an error never echoes a large input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def decode_body(body: bytes, kind: type) -> Any:
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
        return decode_body(await read_body(request, self.max_request_bytes), kind)

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
