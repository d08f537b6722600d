"""Client messages to bytes, with every local failure turned into a ForerunError before anything is sent.

A value msgpack cannot carry (an int beyond 64 bits, a string with a lone
surrogate) or a frame larger than the server accepts is refused here, naming
the field, so that the caller learns at once and no request is left half
registered (see AsyncClient._start).
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from ipc.client.errors import InvalidRequestError
from ipc.protocol import Abort, Generate, SamplingParams, encode
from ipc.sockets import MAX_CLIENT_MESSAGE_BYTES

_ENCODE_ERRORS = (OverflowError, UnicodeEncodeError, TypeError, ValueError)


def _unencodable_field(gen: Generate) -> Optional[str]:
    fields: list[tuple[str, Any]] = [("request_id", gen.request_id), ("prompt_token_ids", gen.prompt_token_ids)]
    fields += [(f"sampling.{name}", getattr(gen.sampling, name)) for name in SamplingParams.__struct_fields__]
    for name, value in fields:
        try:
            msgspec.msgpack.encode(value)
        except _ENCODE_ERRORS:
            return name
    return None


def encode_generate(gen: Generate) -> bytes:
    """The Generate frame; raises InvalidRequestError for an unencodable value or an oversized frame."""
    try:
        frame = encode(gen)
    except _ENCODE_ERRORS as exc:
        raise InvalidRequestError("invalid_request", _unencodable_field(gen),
                                  f"a value cannot be sent: {exc}", gen.request_id) from None
    if len(frame) > MAX_CLIENT_MESSAGE_BYTES:
        biggest = max(("prompt_token_ids", "sampling.stop_token_ids", "request_id"),
                      key=lambda f: len(msgspec.msgpack.encode(_field_value(gen, f))))
        raise InvalidRequestError(
            "invalid_request", biggest,
            f"the request is {len(frame)} bytes encoded; the server accepts at most "
            f"{MAX_CLIENT_MESSAGE_BYTES} bytes per message", gen.request_id)
    return frame


def _field_value(gen: Generate, field: str) -> Any:
    obj: Any = gen
    for part in field.split("."):
        obj = getattr(obj, part)
    return obj


def encode_abort(request_id: str) -> bytes:
    """The Abort frame; raises InvalidRequestError for an unencodable request id."""
    try:
        return encode(Abort(request_id=request_id))
    except _ENCODE_ERRORS as exc:
        raise InvalidRequestError("invalid_request", "request_id", f"the request id cannot be sent: {exc}",
                                  request_id) from None
