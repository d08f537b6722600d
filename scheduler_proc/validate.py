"""Check untrusted client input; every problem becomes an Error naming the field and the limit."""

from __future__ import annotations

import math
import re
from typing import Optional, Union

import msgspec

from ipc import protocol as p
from scheduler_proc.limits import Limits


class InvalidRequest(Exception):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode_client_frame(data: bytes) -> Union[p.Hello, p.Generate, p.Abort, p.GetStats, p.ResetPrefixCache, p.Error]:
    """Decode one client frame; a malformed one becomes an ``Error`` (never an exception)."""
    try:
        return p.client_request_decoder.decode(data)
    except msgspec.ValidationError as e:
        text = str(e)
        path = _PATH.search(text)
        field = path.group(1) if path else None
        unknown = _UNKNOWN.search(text)
        if unknown:
            field = f"{field}.{unknown.group(1)}" if field else unknown.group(1)
        return p.Error(code="invalid_request", message=text, request_id=_guess_request_id(data), field=field or None)
    except (msgspec.DecodeError, UnicodeDecodeError, ValueError, OverflowError) as e:
        return p.Error(code="bad_frame", message=f"could not decode message: {e}")


def _guess_request_id(data: bytes) -> Optional[str]:
    """Best effort: the request_id of a frame that failed typed decoding, to route the error."""
    try:
        obj = msgspec.msgpack.decode(data)
    except Exception:
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and len(rid) <= p.MAX_REQUEST_ID_LEN else None


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise InvalidRequest(field, f"{field} must be a finite number, got {value}")
    return value


def validate_generate(msg: p.Generate, limits: Limits) -> None:
    """Raise InvalidRequest for the first field that breaks a limit."""
    if not msg.request_id or len(msg.request_id) > p.MAX_REQUEST_ID_LEN:
        raise InvalidRequest("request_id", f"request_id must be 1 to {p.MAX_REQUEST_ID_LEN} characters")
    prompt = msg.prompt_token_ids
    if not prompt:
        raise InvalidRequest("prompt_token_ids", "the prompt is empty; it must hold at least 1 token")
    if len(prompt) >= limits.max_model_len:
        raise InvalidRequest(
            "prompt_token_ids",
            f"the prompt has {len(prompt)} tokens; the model's context length is {limits.max_model_len}, "
            f"so a prompt may hold at most {limits.max_model_len - 1}",
        )
    bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest("prompt_token_ids", f"token id {bad} is out of range [0, {limits.vocab_size})")
    s = msg.sampling
    if s.max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens", f"max_tokens must be at least 1, got {s.max_tokens}")
    if len(prompt) + s.max_tokens > limits.max_model_len:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"this model's context length is {limits.max_model_len} tokens; the request asks for "
            f"{len(prompt) + s.max_tokens} ({len(prompt)} in the prompt, {s.max_tokens} in max_tokens)",
        )
    capacity = limits.num_kv_blocks * limits.block_size
    if len(prompt) + s.max_tokens > capacity:
        raise InvalidRequest(
            "sampling.max_tokens",
            f"the prompt plus max_tokens ({len(prompt) + s.max_tokens}) exceeds the KV cache "
            f"capacity of {capacity} tokens",
        )
    if _finite("sampling.temperature", s.temperature) < 0:
        raise InvalidRequest("sampling.temperature", f"temperature must be >= 0, got {s.temperature}")
    if not 0 < _finite("sampling.top_p", s.top_p) <= 1:
        raise InvalidRequest("sampling.top_p", f"top_p must be in (0, 1], got {s.top_p}")
    if not 0 <= _finite("sampling.min_p", s.min_p) <= 1:
        raise InvalidRequest("sampling.min_p", f"min_p must be in [0, 1], got {s.min_p}")
    if s.top_k < -1:
        raise InvalidRequest("sampling.top_k", f"top_k must be -1 or 0 (disabled) or at least 1, got {s.top_k}")
    if s.seed is not None and not -(2**63) <= s.seed < 2**63:
        raise InvalidRequest("sampling.seed", f"seed must fit in a signed 64-bit integer, got {s.seed}")
    if len(s.stop_token_ids) > p.MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("sampling.stop_token_ids", f"at most {p.MAX_STOP_TOKEN_IDS} stop token ids are allowed")
    bad = next((t for t in s.stop_token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise InvalidRequest("sampling.stop_token_ids", f"token id {bad} is out of range [0, {limits.vocab_size})")
    validate_output_features(s, limits)


# float32's largest finite value: every float sent to the executor must fit.
_FLOAT32_MAX = 3.4028234663852886e38
# vLLM only asks repetition_penalty > 0; above 2 a penalty garbles any text, and a cap keeps logits finite.
MAX_REPETITION_PENALTY = 2.0


def validate_output_features(s: p.SamplingParams, limits: Limits) -> None:
    """Stop strings, logprobs, penalties, logit_bias, min_tokens and n (issue 9): raise InvalidRequest."""
    if len(s.stop) > p.MAX_STOP_STRINGS:
        raise InvalidRequest("sampling.stop", f"at most {p.MAX_STOP_STRINGS} stop strings are allowed, got {len(s.stop)}")
    for text in s.stop:
        size = len(text.encode("utf-8", "surrogatepass"))
        if not 1 <= size <= p.MAX_STOP_STRING_BYTES:
            raise InvalidRequest("sampling.stop", f"each stop string must be 1 to {p.MAX_STOP_STRING_BYTES} bytes "
                                                  f"of UTF-8, got {size}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and not 0 <= value <= p.MAX_LOGPROBS:
            raise InvalidRequest(f"sampling.{name}", f"{name} must be None or in [0, {p.MAX_LOGPROBS}], got {value}")
    if not 0 < _finite("sampling.repetition_penalty", s.repetition_penalty) <= MAX_REPETITION_PENALTY:
        raise InvalidRequest("sampling.repetition_penalty",
                             f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {s.repetition_penalty}")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _finite(f"sampling.{name}", getattr(s, name))
        if not -2 <= value <= 2:
            raise InvalidRequest(f"sampling.{name}", f"{name} must be in [-2, 2], got {value}")
    if len(s.logit_bias) > p.MAX_LOGIT_BIAS:
        raise InvalidRequest("sampling.logit_bias", f"at most {p.MAX_LOGIT_BIAS} logit_bias entries are allowed, "
                                                    f"got {len(s.logit_bias)}")
    for token, bias in s.logit_bias.items():
        if not 0 <= token < limits.vocab_size:
            raise InvalidRequest("sampling.logit_bias", f"token id {token} is out of range [0, {limits.vocab_size})")
        if not -100 <= _finite("sampling.logit_bias", bias) <= 100:
            raise InvalidRequest("sampling.logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                                        f"for token {token}")
    for name in ("temperature", "top_p", "min_p"):
        if abs(getattr(s, name)) > _FLOAT32_MAX:
            raise InvalidRequest(f"sampling.{name}", f"{name} must fit in float32 (at most {_FLOAT32_MAX:g})")
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise InvalidRequest("sampling.min_tokens", f"min_tokens must be in [0, max_tokens={s.max_tokens}], "
                                                    f"got {s.min_tokens}")
    if not 1 <= s.n <= p.MAX_N:
        raise InvalidRequest("sampling.n", f"n must be in [1, {p.MAX_N}], got {s.n}")
