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
