"""Check untrusted client input; every problem becomes an Error naming the field and the limit.

Every number of every client message is bounded here, before anything reaches
the executor: ints within what the executor stores (int64 tables, token ids
below the vocabulary), floats finite and still in range once rounded to
float32 (the executor's sampling tables are float32), strings within a length.
"""

from __future__ import annotations

import hmac
import math
import re
import struct
from typing import Optional, Union

import msgspec

from ipc import protocol as p
from scheduler_proc.limits import Limits

# Above this a temperature only flattens the distribution further (1/T is already 1e-4):
# refusing it keeps 1/T a normal float32 instead of sampling noise from an overflowed value.
MAX_TEMPERATURE = 1e4
MAX_CLIENT_NAME_LEN = 256
MAX_API_KEY_LEN = 4096
# Hello.heartbeat_s: 0 (no heartbeat) or within these bounds, in seconds.
MIN_HEARTBEAT_S = 0.05
MAX_HEARTBEAT_S = 60.0


class InvalidRequest(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


_PATH = re.compile(r"at `\$\.?([^`]*)`")
# An unknown field and a missing required one are named by the message, not by its path.
_NAMED = re.compile(r"(?:unknown|missing required) field `([^`]*)`")

ClientMessage = Union[p.Hello, p.Generate, p.Abort, p.GetStats, p.ResetPrefixCache, p.GetTokenizer, p.Ping, p.Error]


def decode_client_frame(data: bytes) -> ClientMessage:
    """Decode and check one client frame; a malformed one becomes an ``Error`` (never an exception).

    Hello and Abort are checked here in full (they need no model limits);
    Generate's ranges depend on the model and are checked by :func:`validate_generate`.
    """
    try:
        msg = p.client_request_decoder.decode(data)
    except msgspec.ValidationError as e:
        text = str(e)
        path = _PATH.search(text)
        field = path.group(1) if path else None
        named = _NAMED.search(text)
        if named:
            field = f"{field}.{named.group(1)}" if field else named.group(1)
        return p.Error(code="invalid_request", message=text, request_id=_guess_request_id(data), field=field or None)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, OverflowError) as e:
        return p.Error(code="bad_frame", message=f"could not decode message: {e}")
    try:
        if isinstance(msg, p.Hello):
            validate_hello(msg)
        elif isinstance(msg, p.Abort):
            check_request_id(msg.request_id)
    except InvalidRequest as e:
        rid = msg.request_id if isinstance(msg, p.Abort) and len(msg.request_id) <= p.MAX_REQUEST_ID_LEN else None
        return p.Error(code="invalid_request", message=e.message, request_id=rid or None, field=e.field)
    return msg


def _guess_request_id(data: bytes) -> Optional[str]:
    """Best effort: the request_id of a frame that failed typed decoding, to route the error."""
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and 0 < len(rid) <= p.MAX_REQUEST_ID_LEN else None


def _float32(field: str, value: float) -> float:
    """``value`` as the executor will store it (float32); not finite or out of float32's range: refused."""
    if not math.isfinite(value):
        raise InvalidRequest(field, f"{field} must be a finite number, got {value}")
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        raise InvalidRequest(field, f"{field} = {value} is outside float32's range (about ±3.4e38)") from None


def check_request_id(request_id: str) -> None:
    if not request_id or len(request_id) > p.MAX_REQUEST_ID_LEN:
        raise InvalidRequest("request_id", f"request_id must be 1 to {p.MAX_REQUEST_ID_LEN} characters, "
                                           f"got {len(request_id)}")


def _check_token_ids(field: str, ids: list[int], vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(field, f"token id {bad} is out of range [0, {vocab_size})")


def validate_hello(msg: p.Hello) -> None:
    """Raise InvalidRequest for a Hello field out of its bounds (the version itself is the server's check)."""
    if len(msg.client_name) > MAX_CLIENT_NAME_LEN:
        raise InvalidRequest("client_name", f"client_name must be at most {MAX_CLIENT_NAME_LEN} characters, "
                                            f"got {len(msg.client_name)}")
    if len(msg.api_key) > MAX_API_KEY_LEN:
        raise InvalidRequest("api_key", f"api_key must be at most {MAX_API_KEY_LEN} characters")
    hb = msg.heartbeat_s
    if not math.isfinite(hb) or not (hb == 0 or MIN_HEARTBEAT_S <= hb <= MAX_HEARTBEAT_S):
        raise InvalidRequest("heartbeat_s", f"heartbeat_s must be 0 (none) or in [{MIN_HEARTBEAT_S}, "
                                            f"{MAX_HEARTBEAT_S}] seconds, got {hb}")


def hello_refusal(msg: p.Hello, api_key: Optional[str], tcp: bool) -> tuple[Optional[p.Error], bool]:
    """Why a server (or a data-parallel router) with ``api_key`` on a tcp:// address or not refuses ``msg``
    (None: it does not), and whether the Hello gave the key (admin messages need it when there is one)."""
    if msg.protocol_version != p.PROTOCOL_VERSION:
        return p.Error(code="protocol", field="protocol_version", message=f"client speaks protocol "
                       f"{msg.protocol_version}, server speaks {p.PROTOCOL_VERSION}"), False
    # Constant time: how much of a guess matches must not show in how long the answer takes.
    keyed = bool(api_key) and hmac.compare_digest(msg.api_key.encode(), api_key.encode())
    if api_key and not keyed and (msg.api_key or tcp):
        return p.Error(code="unauthorized", field="api_key", message="wrong API key" if msg.api_key else
                       "this server needs its API key in Hello (the SDK's api_key=, or FORERUN_API_KEY)"), False
    return None, keyed


def validate_generate(msg: p.Generate, limits: Limits) -> None:
    """Raise InvalidRequest for the first field that breaks a limit."""
    check_request_id(msg.request_id)
    prompt = msg.prompt_token_ids
    if not prompt:
        raise InvalidRequest("prompt_token_ids", "the prompt is empty; it must hold at least 1 token")
    if len(prompt) >= limits.max_model_len:
        raise InvalidRequest(
            "prompt_token_ids",
            f"the prompt has {len(prompt)} tokens; the model's context length is {limits.max_model_len}"
            f"{_cache_bound(limits)}, so a prompt may hold at most {limits.max_model_len - 1}",
        )
    _check_token_ids("prompt_token_ids", prompt, limits.vocab_size)
    _validate_sampling(msg.sampling, len(prompt), limits)
    _validate_resume(msg, limits)


def check_completions(msg: p.Generate) -> None:
    """n, and a resumed request's ``completion_index``: which completions a Generate makes (no model limits)."""
    resumed, index, s = msg.resume_output_ids, msg.completion_index, msg.sampling
    if not 1 <= s.n <= p.MAX_N:
        raise InvalidRequest("sampling.n", f"n must be in [1, {p.MAX_N}], got {s.n}")
    if not 0 <= index < p.MAX_N:
        raise InvalidRequest("completion_index", f"completion_index must be in [0, {p.MAX_N}), got {index}")
    if (resumed or index) and s.n != 1:
        raise InvalidRequest("sampling.n", f"a resumed request (resume_output_ids or completion_index) is one "
                                           f"completion: n must be 1, got {s.n}")


def _validate_resume(msg: p.Generate, limits: Limits) -> None:
    """A resumed request's outputs so far: tokens of the vocabulary, with room left for at least one more."""
    check_completions(msg)
    resumed, s = msg.resume_output_ids, msg.sampling
    if len(resumed) >= s.max_tokens:
        raise InvalidRequest("resume_output_ids", f"resume_output_ids holds {len(resumed)} tokens and max_tokens "
                                                  f"is {s.max_tokens}: nothing is left to generate")
    _check_token_ids("resume_output_ids", resumed, limits.vocab_size)


def _cache_bound(limits: Limits) -> str:
    """Where the KV cache sets the context (the server lowered it to what the cache holds), the flags that do."""
    if limits.max_model_len < limits.num_kv_blocks * limits.block_size:
        return ""
    return (f" (all this server's KV cache holds: {limits.num_kv_blocks:,} blocks of {limits.block_size}; "
            f"--num-kv-blocks, --gpu-memory-utilization)")


def _validate_sampling(s: p.SamplingParams, prompt_len: int, limits: Limits) -> None:
    if s.max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens", f"max_tokens must be at least 1, got {s.max_tokens}")
    if prompt_len + s.max_tokens > limits.max_model_len:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"this model's context length is {limits.max_model_len} tokens{_cache_bound(limits)}; the request asks "
            f"for {prompt_len + s.max_tokens} ({prompt_len} in the prompt, {s.max_tokens} in max_tokens)",
        )
    capacity = limits.num_kv_blocks * limits.block_size
    if prompt_len + s.max_tokens > capacity:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"the prompt plus max_tokens ({prompt_len + s.max_tokens}) exceeds the KV cache "
            f"capacity of {capacity} tokens",
        )
    if not 0 <= _float32("sampling.temperature", s.temperature) <= MAX_TEMPERATURE:
        raise InvalidRequest("sampling.temperature",
                             f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature}")
    # Checked after rounding to float32: a top_p of 1e-50 would reach the executor as 0.
    if not 0 < _float32("sampling.top_p", s.top_p) <= 1:
        raise InvalidRequest("sampling.top_p", f"top_p must be in (0, 1] (as a float32), got {s.top_p}")
    if not 0 <= _float32("sampling.min_p", s.min_p) <= 1:
        raise InvalidRequest("sampling.min_p", f"min_p must be in [0, 1], got {s.min_p}")
    if not -1 <= s.top_k < 2**63:  # the vocabulary or more: every token, as vLLM reads it (scheduler_proc/outputs.py)
        raise InvalidRequest("sampling.top_k", f"top_k must be -1 or 0 (disabled) or in [1, 2^63), got {s.top_k}")
    if s.seed is not None and not 0 <= s.seed <= p.MAX_SEED:
        raise InvalidRequest("sampling.seed", f"seed must be in [0, {p.MAX_SEED}], got {s.seed}")
    problem = p.count_problem(s)  # n and list lengths (the SDK checks the same before it sends), before any loop
    if problem is not None:
        raise InvalidRequest(*problem)
    _check_token_ids("sampling.stop_token_ids", s.stop_token_ids, limits.vocab_size)
    validate_output_features(s, limits)


# vLLM only asks repetition_penalty > 0; above 2 a penalty garbles any text, and a cap keeps logits finite.
MAX_REPETITION_PENALTY = 2.0


def validate_output_features(s: p.SamplingParams, limits: Limits) -> None:
    """Stop strings, logprobs, penalties, logit_bias and min_tokens: raise InvalidRequest (their counts, and n:
    ``ipc.client_protocol.count_problem``, checked before)."""
    for text in s.stop:
        size = len(text.encode("utf-8", "surrogatepass"))
        if not 1 <= size <= p.MAX_STOP_STRING_BYTES:
            raise InvalidRequest("sampling.stop", f"each stop string must be 1 to {p.MAX_STOP_STRING_BYTES} bytes "
                                                  f"of UTF-8, got {size}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and not 0 <= value <= p.MAX_LOGPROBS:
            raise InvalidRequest(f"sampling.{name}", f"{name} must be None or in [0, {p.MAX_LOGPROBS}], got {value}")
    if not 0 < _float32("sampling.repetition_penalty", s.repetition_penalty) <= MAX_REPETITION_PENALTY:
        raise InvalidRequest("sampling.repetition_penalty",
                             f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {s.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _float32(f"sampling.{name}", getattr(s, name))
        if not -2 <= value <= 2:
            raise InvalidRequest(f"sampling.{name}", f"{name} must be in [-2, 2], got {getattr(s, name)}")
    for token, bias in s.logit_bias.items():
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequest("sampling.logit_bias", f"token id {token} is out of range [0, {limits.vocab_size})")
        if not -100 <= _float32("sampling.logit_bias", bias) <= 100:
            raise InvalidRequest("sampling.logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                                        f"for token {token}")
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"min_tokens must be in [0, max_tokens={s.max_tokens}], "
                                                    f"got {s.min_tokens}")
