"""OpenAI request parameters -> the SDK's sampling keywords (SamplingParams fields).

Ranges are left to the scheduler, whose errors name the field and its limit
(``sampling.logprobs`` becomes the ``logprobs`` param of the 400); only what
the JSON shape cannot say is checked here (logit_bias keys are strings in JSON),
what the scheduler cannot check as the client sent it (:func:`check_numbers`), and the counts that the gateway
and the SDK loop over before the scheduler sees the request (:func:`check_counts`).
"""

from __future__ import annotations

import struct
from typing import Any, Optional, Union

from ipc.gateway import schemas as s
from ipc.gateway.structured import constraint_kwargs
from ipc.protocol import MAX_LOGPROBS, MAX_SEED, SamplingParams, count_problem

# Integer fields: the scheduler checks their ranges, but one past 64 bits cannot even be sent to it.
_INTEGERS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens", "prompt_logprobs", "logprobs",
             "top_logprobs", "best_of")
_INT64 = (-2**63, 2**63 - 1)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty: OpenAI's [-2, 2]

# Passed through unchanged when given (vLLM's extra parameters included).
_PLAIN = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "stop_token_ids", "n",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs",
          "include_stop_str_in_output")


def stop_strings(stop: Union[str, list[str], None]) -> list[str]:
    """``stop`` as a list (OpenAI allows one string or a list)."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def logit_bias(bias: Optional[dict[str, float]], vocab_size: int) -> dict[int, float]:
    """JSON's string keys as token ids; a key that is not a token id is a 400 naming logit_bias.

    Only plain ASCII decimals are token ids: ``int()`` would also take " 5 ", "1_0" and other scripts' digits."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit() and len(key) <= 12):
            shown = key if len(key) <= 32 else key[:32] + "..."
            raise s.RequestError(400, f"logit_bias key {shown!r} is not a token id (a decimal number)",
                                 "logit_bias")
        token_id = int(key)
        if not token_id < vocab_size:
            raise s.RequestError(400, f"logit_bias key {key!r} is out of the vocabulary [0, {vocab_size})",
                                 "logit_bias")
        out[token_id] = value
    return out


def output_logprobs(req: Union[s.CompletionRequest, s.ChatCompletionRequest]) -> Optional[int]:
    """How many top alternatives per output token the request wants (None: no logprobs)."""
    if isinstance(req, s.ChatCompletionRequest):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:  # the SDK calls it logprobs
            raise s.RequestError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                                 "top_logprobs")
        if req.logprobs:
            return req.top_logprobs or 0
        if req.top_logprobs:
            raise s.RequestError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return None
    return req.logprobs


def check_stream_params(req: Union[s.CompletionRequest, s.ChatCompletionRequest]) -> None:
    """What vLLM refuses with and without ``stream=true``, refused the same way."""
    if req.stream and req.prompt_logprobs is not None:
        raise s.RequestError(400, "prompt_logprobs is not available when stream=true", "prompt_logprobs")
    if req.stream_options is not None and not req.stream:
        raise s.RequestError(400, "stream_options can only be given when stream=true", "stream_options")


def check_counts(req: Union[s.CompletionRequest, s.ChatCompletionRequest]) -> None:
    """``n`` and the lengths of ``stop``, ``stop_token_ids`` and ``logit_bias``, with the scheduler's limits and
    words (a 400 naming the field), before anything loops over them: n times the prompts, each completion's
    detokenizer, every stop token id and logit_bias key."""
    sizes = SamplingParams(n=1 if req.n is None else req.n, stop=stop_strings(req.stop),  # only sizes are read
                           stop_token_ids=req.stop_token_ids or [], logit_bias=req.logit_bias or {})
    problem = count_problem(sizes)
    if problem is not None:
        field, message = problem
        raise s.RequestError(400, message, field.removeprefix("sampling."))


def check_numbers(req: Union[s.CompletionRequest, s.ChatCompletionRequest]) -> None:
    """What the scheduler cannot check as the client sent it: integers past 64 bits (they cannot be sent; a seed
    gets the scheduler's own message), and penalties, which it checks as float32s (2.1 would read 2.0999999...)."""
    for name in _INTEGERS:
        value = getattr(req, name, None)
        if name == "seed" and value is not None and not 0 <= value <= MAX_SEED:
            raise s.RequestError(400, f"seed must be in [0, {MAX_SEED}], got {value}", "seed")
        if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
            raise s.RequestError(400, f"{name} must be a 64-bit integer, got {value}", name)
    if req.stop_token_ids and not all(_INT64[0] <= t <= _INT64[1] for t in req.stop_token_ids):
        raise s.RequestError(400, "stop_token_ids must be 64-bit integers (token ids)", "stop_token_ids")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and not -MAX_PENALTY <= _float32(value) <= MAX_PENALTY:
            raise s.RequestError(400, f"{name} must be in [-2, 2], got {value:.7g}", name)


def _float32(value: float) -> float:
    """``value`` as the engine holds it (float32), so that what passes here passes there; inf past its range."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def sampling_kwargs(req: Union[s.CompletionRequest, s.ChatCompletionRequest], max_tokens: int,
                    vocab_size: int) -> dict[str, Any]:
    """The SDK's sampling keywords for one prompt of ``req``."""
    kw: dict[str, Any] = {"max_tokens": max_tokens}
    for name in _PLAIN:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.stop is not None:
        kw["stop"] = stop_strings(req.stop)
    if req.logit_bias:
        kw["logit_bias"] = logit_bias(req.logit_bias, vocab_size)
    kw.update(constraint_kwargs(req))
    top_n = output_logprobs(req)
    if top_n is not None:
        kw["logprobs"] = top_n
        if isinstance(req, s.CompletionRequest) and req.echo:  # echoed prompt tokens come with their logprobs too
            kw["prompt_logprobs"] = max(top_n, req.prompt_logprobs or 0)
    return kw
