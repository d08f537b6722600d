"""The exceptions of the client SDK: one per ``Error.code`` the server sends."""

from __future__ import annotations

from typing import Optional

from ipc.protocol import Error


class ForerunError(Exception):
    """The server rejected a request or a frame (an ``Error`` message on the wire)."""

    def __init__(self, code: str, field: Optional[str], message: str,
                 request_id: Optional[str] = None) -> None:
        where = f" (field {field!r})" if field else ""
        super().__init__(f"[{code}]{where} {message}")
        self.code = code
        self.field = field
        self.message = message
        self.request_id = request_id


class InvalidRequestError(ForerunError):
    """A parameter is out of range or malformed; ``field`` names it."""


class ProtocolError(ForerunError):
    """Client and server speak different protocol versions (or no Hello was sent)."""


class UnauthorizedError(ForerunError):
    """The server needs its API key (``api_key=`` or FORERUN_API_KEY) and got none or a wrong one."""


class BadFrameError(ForerunError):
    """The server could not decode a frame."""


class DuplicateRequestIdError(ForerunError):
    """A request id was reused while the first request with it was still running."""


class ExecutorFailedError(ForerunError):
    """The server's executor (the GPU process) died; the request cannot finish."""


class OverloadedError(ForerunError):
    """The server's waiting queue is full: try again later (nothing was started)."""


class ServerShuttingDownError(ForerunError):
    """The server is shutting down: it admits nothing new, or it stopped this request at its deadline."""


class SlowReaderError(ForerunError):
    """This client stopped reading and the server's buffer for it filled up: its requests were aborted."""


class ServerGoneError(ForerunError):
    """No server answers at the address: none was there, it died, or it was restarted (another server_id).

    Raised by the client itself (code ``"server_gone"``): the handshake got no
    answer within the connect timeout, or a connected server fell silent for
    ``HEARTBEAT_MISSES`` heartbeats.  Requests in flight are lost; a later call
    connects again.
    """

    def __init__(self, message: str, request_id: Optional[str] = None) -> None:
        super().__init__("server_gone", None, message, request_id)


_ERROR_TYPES: dict[str, type[ForerunError]] = {
    "invalid_request": InvalidRequestError,
    "protocol": ProtocolError,
    "hello_first": ProtocolError,
    "unauthorized": UnauthorizedError,
    "bad_frame": BadFrameError,
    "duplicate_id": DuplicateRequestIdError,
    "executor_failed": ExecutorFailedError,
    "overloaded": OverloadedError,
    "shutting_down": ServerShuttingDownError,
    "slow_reader": SlowReaderError,
}


def error_from_wire(err: Error) -> ForerunError:
    """The exception for an ``Error`` message (a subclass of ForerunError by code)."""
    cls = _ERROR_TYPES.get(err.code, ForerunError)
    return cls(err.code, err.field, err.message, err.request_id)
