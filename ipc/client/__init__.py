"""The client SDK: send prompts to a forerun scheduler and read back tokens and text.

    with Client("ipc:///tmp/forerun/client.sock") as client:
        print(client.generate("The capital of France is", max_tokens=16).text)

    async with AsyncClient(address) as client:
        async for chunk in client.stream(messages=[{"role": "user", "content": "hi"}]):
            print(chunk.text_delta, end="")

One ZeroMQ DEALER socket per client.  :class:`AsyncClient` multiplexes any
number of concurrent requests on it; :class:`Client` is a blocking facade that
runs an AsyncClient on a private event-loop thread.  Sampling is a
:class:`SamplingParams` and/or its fields as keyword arguments.

Parameters are sent as given (NaN included): the server validates them and
answers an ``Error`` that this package raises as :class:`ForerunError`.  What
fails locally fails the same way, before anything is sent: a value msgpack
cannot carry, a frame over the server's size limit, malformed chat messages, a
text too long for the context.  A server that does not answer the handshake,
falls silent or is restarted raises :class:`ServerGoneError` (see ``liveness``).

Modules: ``errors`` (exceptions), ``results`` (what a request returns),
``request`` (one request's state, sampling arguments), ``outputs`` (one
completion's tokens, logprobs and stop-string text), ``async_client``,
``blocking``, ``prompt`` (tokenizer and prompt encoding), ``detokenizer``,
``reader`` (the reader task), ``inflight`` (requests by id),
``liveness`` (heartbeats), ``wire`` (checked encoding), ``stream``,
``raw`` (a bare protocol connection for tests and benchmarks).
"""

from ipc.client.async_client import DEFAULT_TIMEOUT, AsyncClient, AsyncStream
from ipc.client.blocking import Client, Stream
from ipc.client.errors import (
    BadFrameError,
    DuplicateRequestIdError,
    ExecutorFailedError,
    ForerunError,
    InvalidRequestError,
    OverloadedError,
    ProtocolError,
    ServerGoneError,
    ServerShuttingDownError,
    SlowReaderError,
    UnauthorizedError,
    error_from_wire,
)
from ipc.client.prompt import encode_prompt
from ipc.client.request import sampling_params
from ipc.client.results import GenerateResult, StreamChunk, Timings
from ipc.protocol import SamplingParams, ServerInfo

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncClient",
    "AsyncStream",
    "BadFrameError",
    "Client",
    "DuplicateRequestIdError",
    "ExecutorFailedError",
    "ForerunError",
    "GenerateResult",
    "InvalidRequestError",
    "OverloadedError",
    "ProtocolError",
    "SamplingParams",
    "ServerGoneError",
    "ServerInfo",
    "ServerShuttingDownError",
    "SlowReaderError",
    "UnauthorizedError",
    "Stream",
    "StreamChunk",
    "Timings",
    "encode_prompt",
    "error_from_wire",
    "sampling_params",
]
