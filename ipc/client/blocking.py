"""The blocking client: an AsyncClient run on a private event-loop thread.

One ``Client`` may be used from several threads at once: every call is a
coroutine handed to that loop, so all of them share one connection.

The loop thread is a daemon and an exit hook closes the client, so a process
that ends with a client open or a stream half read exits at once: a call made
after the loop has stopped (a generator finalized at interpreter exit) raises
RuntimeError instead of waiting for a loop that will never run it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import weakref
from typing import Any, Iterator, Optional, Sequence

from ipc.client.async_client import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_TIMEOUT,
    AsyncClient,
    AsyncStream,
)
from ipc.client.results import GenerateResult, StreamChunk
from ipc.protocol import SamplingParams, ServerInfo, ServerStats


# Seconds the exit hook gives close() to send the Aborts of requests still in flight.
EXIT_CLOSE_TIMEOUT = 1.0
# How often a waiting call checks that the loop thread is still alive (seconds).
LOOP_CHECK_INTERVAL = 0.5


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread, aclient: AsyncClient) -> None:
    """Close the async client (best effort, bounded) and stop its loop thread: at close, drop, or exit."""
    if loop.is_closed() or not thread.is_alive():
        return
    try:
        asyncio.run_coroutine_threadsafe(aclient.close(), loop).result(EXIT_CLOSE_TIMEOUT)
    except BaseException:  # noqa: BLE001 (exiting: a failed close must not stop the exit)
        pass
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=1.0)


class Client:
    """A blocking client with the same API as AsyncClient.

    It runs an AsyncClient on a private event-loop thread, so calls from
    several threads may be in flight at once on one connection.
    """

    def __init__(self, address: str, *, timeout: Optional[float] = DEFAULT_TIMEOUT,
                 tokenizer: Any = None, client_name: str = "forerun-python",
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, api_key: Optional[str] = None) -> None:
        self._async = AsyncClient(address, timeout=timeout, tokenizer=tokenizer, client_name=client_name,
                                  connect_timeout=connect_timeout, heartbeat_s=heartbeat_s, api_key=api_key)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="forerun-client", daemon=True)
        self._thread.start()
        self._closed = False
        self._pid = os.getpid()  # its loop thread does not survive a fork
        # A client dropped without close(), or still open at interpreter exit (finalize runs
        # at exit), closes and stops its loop thread.
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, self._async)

    def _run(self, coro: Any) -> Any:
        if self._pid != os.getpid():
            coro.close()
            raise RuntimeError("this Client was made in another process (before a fork): its loop thread did not "
                               "come along; make a Client in each process")
        if self._closed or not self._finalizer.alive:
            coro.close()
            raise RuntimeError("the client is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # Not fut.result(timeout): a request's own TimeoutError would look like the wait's.
            while not concurrent.futures.wait([fut], LOOP_CHECK_INTERVAL).done:
                if not self._thread.is_alive() or not self._loop.is_running():
                    raise RuntimeError("the client's event loop has stopped (interpreter exit?)")
            return fut.result()
        except BaseException:
            # KeyboardInterrupt while waiting: cancel the coroutine so it aborts its request.
            fut.cancel()
            raise

    @property
    def address(self) -> str:
        return self._async.address

    @property
    def timeout(self) -> Optional[float]:
        return self._async.timeout

    @property
    def server_info(self) -> ServerInfo:
        """What the server said in its handshake (connects on first use)."""
        return self._run(self._async.connect())

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (loaded once, on first use)."""
        return self._run(self._async.get_tokenizer())

    def connect(self) -> ServerInfo:
        """Open the socket and do the Hello handshake (once)."""
        return self._run(self._async.connect())

    def encode(self, prompt: Optional[str] = None, *,
               messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
        """Token ids that generate() would send for this prompt or these messages."""
        return self._run(self._async.encode(prompt, messages=messages))

    def generate(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        sampling: Optional[SamplingParams] = None,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
        **overrides: Any,
    ) -> GenerateResult:
        """Run one request to its end; see AsyncClient.generate (``**overrides``: SamplingParams fields)."""
        return self._run(self._async.generate(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, sampling=sampling, timeout=timeout,
            request_id=request_id, detokenize=detokenize, **overrides))

    def stream(
        self,
        prompt: Optional[str] = None,
        *,
        messages: Optional[list[dict[str, Any]]] = None,
        prompt_token_ids: Optional[Sequence[int]] = None,
        sampling: Optional[SamplingParams] = None,
        timeout: Optional[float] = None,
        request_id: Optional[str] = None,
        detokenize: bool = True,
        **overrides: Any,
    ) -> "Stream":
        """A streaming request: ``for chunk in client.stream(...)``; see AsyncClient.stream."""
        self._check_open()
        return Stream(self, self._async.stream(
            prompt, messages=messages, prompt_token_ids=prompt_token_ids, sampling=sampling, timeout=timeout,
            request_id=request_id, detokenize=detokenize, **overrides))

    def abort(self, request_id: str) -> None:
        """Ask the server to stop a request (safe to call from any thread)."""
        self._run(self._async.abort(request_id))

    def get_stats(self, timeout: float = 10.0) -> ServerStats:
        """The server's pool occupancy and counters; see AsyncClient.get_stats."""
        return self._run(self._async.get_stats(timeout))

    def reset_prefix_cache(self, timeout: float = 10.0) -> ServerStats:
        """Make the server forget its unused cached KV blocks; see AsyncClient.reset_prefix_cache."""
        return self._run(self._async.reset_prefix_cache(timeout))

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the client is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Abort in-flight requests, close the socket and stop the loop thread (idempotent)."""
        if self._closed:
            return
        try:
            if self._finalizer.alive:
                self._run(self._async.close())
        finally:
            self._closed = True
            self._finalizer()
            if not self._thread.is_alive():
                self._loop.close()

    def __enter__(self) -> "Client":
        self.connect()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stream:
    """A blocking streaming request: ``for chunk in stream`` yields StreamChunk items.

    Leaving the loop early aborts the request on the server; ``abort()`` (from
    any thread) makes the stream end with ``result.finish_reason == "abort"``.
    """

    def __init__(self, client: Client, inner: AsyncStream) -> None:
        self.request_id = inner.request_id
        self._client = client
        self._inner = inner

    @property
    def result(self) -> Optional[GenerateResult]:
        """The finished request (None until the stream has ended)."""
        return self._inner.result

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while (chunk := self._client._run(self._inner.next_chunk())) is not None:
                yield chunk
        finally:
            self.close()

    def abort(self) -> None:
        """Ask the server to stop this request."""
        self._client.abort(self.request_id)

    def close(self) -> None:
        """Stop reading; aborts the request on the server if it has not ended."""
        if not self._client.closed and self._client._finalizer.alive:
            self._client._run(self._inner.aclose())

    def __enter__(self) -> "Stream":
        self._client._run(self._inner.start())
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
