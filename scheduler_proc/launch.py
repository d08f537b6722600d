"""The ``forerun`` command: ``forerun serve`` and ``forerun chat`` (:mod:`scheduler_proc.chat_cli`).

``serve`` runs the scheduler in this process; the scheduler starts the
executor as a child that dies with it, shows a progress bar while the model
loads, prints the client address, and serves until interrupted.  Its flags
become the ServerConfig in :mod:`scheduler_proc.serve_config`.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import shutil
import signal
import sys
import threading
from typing import Optional

import msgspec

from ipc.models import is_gguf, resolve_model
from scheduler_proc.chat_cli import (ASK_MAX_TOKENS, GGUF_NO_TOKENIZER, NO_TOKENIZER, chat, check_utf8,
                                     stream_answer)
from scheduler_proc.cli_flags import ADDRESS_FILE, API_KEY_ENV, build_parser, gateway_settings, in_flag_names
from scheduler_proc.config import ServerConfig
from scheduler_proc.executor_process import NO_MULTICAST_ENV
from scheduler_proc.outputs import tokenizer_vocab_size
from scheduler_proc.serve_config import chat_template_error, check_tokenizer, has_chat_template, server_config


class _Progress:
    """A tqdm bar per load stage, on stderr."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = None
        self.stage = None

    def __call__(self, msg) -> None:
        if self.quiet:
            return
        from tqdm import tqdm

        if msg.stage != self.stage:
            self.close()
            self.stage = msg.stage
            self.bar = tqdm(total=msg.total, desc=f"forerun: {msg.stage}", unit="", file=sys.stderr, leave=False)
        if msg.total != self.bar.total:  # a stage may learn its size as it goes
            self.bar.total = msg.total
        self.bar.update(msg.done - self.bar.n)  # tqdm throttles redraws (mininterval)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def serve(args) -> int:
    """``forerun serve``: the exit status (1 for every failure to start, each one line on stderr)."""
    try:
        cfg = server_config(args)
        model = resolve_model(cfg.model, cfg.executor.load_format, cfg.tokenizer)
        check_tokenizer(model.tokenizer_path, args.tokenizer, args.model)
        if args.ask is not None:
            check_utf8("--ask", args.ask)
            if not model.tokenizer_path:
                raise ValueError(f"--ask: {GGUF_NO_TOKENIZER if is_gguf(model.path) else NO_TOKENIZER}")
        gpus = _replica_gpus(args, cfg)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"forerun: {in_flag_names(str(e))}")
    except KeyboardInterrupt:  # Ctrl-C before serve_in takes the signals (a tokenizer being parsed)
        raise SystemExit("forerun: interrupted while starting")
    from ipc.sockets import new_run_dir

    # The run directory is made here and removed in serve_in's every exit, whatever fails first (a Server or Router
    # given one never removes it): no /tmp/forerun-* is left behind by a refusal.
    try:
        cfg = msgspec.structs.replace(cfg, run_dir=new_run_dir())
    except OSError as e:  # $FORERUN_RUN_DIR missing or not writable
        raise SystemExit(f"forerun: cannot make a run directory {e.filename or ''}: {e.strerror or e}")
    try:
        return serve_in(args, cfg, model, gpus)
    finally:
        shutil.rmtree(cfg.run_dir, ignore_errors=True)


WATCH_INTERVAL_S = 0.2  # how often the server looks at its gateway workers
MAX_WORKER_RESTARTS = 5  # gateway worker exits within a minute that the server restarts; one more stops it


def serve_in(args, cfg: ServerConfig, model, gpus) -> int:
    """Serve ``cfg`` (its run directory made, and removed by the caller) until a shutdown; the exit status."""
    import uvloop

    from scheduler_proc.frontend import StartupError
    from scheduler_proc.server import Server, say

    os.environ.update(NO_MULTICAST_ENV)  # inherited by every process the server starts
    # Until the event loop handles them, SIGTERM unwinds like Ctrl-C, so the cleanup below runs; each is noted too,
    # for an interrupt that lands where Python drops exceptions (an at-fork hook while a child is spawned).
    stop_asked = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt_noting(stop_asked))
    sys.unraisablehook = _quiet_interrupts
    try:
        if gpus is None:
            server = Server(cfg, model)
        else:  # data-parallel replicas behind a router, which launch runs like a server
            from scheduler_proc.replica_router import Router

            server = Router(cfg, model, gpus)
    except ValueError as e:  # e.g. a run directory whose socket paths are too long
        raise SystemExit(f"forerun: {e}")
    progress = _Progress(args.quiet)
    http_sock = None
    try:
        server.bind()  # address errors before the model loads
        http_sock = _listen_http(args, cfg)
        ready = server.start_executor(progress)
        if stop_asked.is_set():  # interrupted, though the KeyboardInterrupt was lost
            raise KeyboardInterrupt
    except (StartupError, ValueError, RuntimeError, TimeoutError, KeyboardInterrupt) as e:
        progress.close()
        print(f"forerun: {in_flag_names(str(e)) or 'interrupted while starting'}", file=sys.stderr)
        if http_sock is not None:
            http_sock.close()
        server.close()
        return 1
    progress.close()
    # From here a signal asks for the graceful shutdown: noted now, acted on once the event loop runs (a
    # KeyboardInterrupt raised while the loop is being set up or torn down would end in asyncio's tracebacks).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop_asked.set())
    gateways = None
    failed_start = threading.Event()  # a gateway worker did not start: stop, and exit 1
    stopping = threading.Event()  # the gateways are being stopped: a worker that exits now did not fail
    try:
        _announce(server, model, ready, cfg)
        gateways = _start_gateways(args, cfg, server, http_sock)
        if args.ask or gateways:
            threading.Thread(target=_ask, args=(server.client_address, args.ask, gateways, model.name, failed_start,
                                                stopping, cfg.api_key), daemon=True).start()
        if gateways:
            threading.Thread(target=_watch_gateways, args=(gateways, server, stopping, failed_start),
                             daemon=True).start()

        async def run() -> int:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, server.begin_shutdown)
            if stop_asked.is_set():
                server.begin_shutdown()
            return await server.serve()

        gc.freeze()  # start-up objects are never scanned again: shorter GC pauses while serving
        rc = uvloop.run(run())
        return 1 if failed_start.is_set() else rc
    except KeyboardInterrupt:
        return 1
    finally:
        stopping.set()
        if gateways:
            _stop_gateways(gateways)
        elif http_sock is not None:
            http_sock.close()
        server.close()
        if not failed_start.is_set() and server.shutdown_at is not None:
            say("stopped")


def _interrupt_noting(asked: threading.Event):
    """A SIGINT/SIGTERM handler for the start: note the signal in ``asked`` and unwind (KeyboardInterrupt)."""

    def handler(signum, frame) -> None:
        asked.set()
        raise KeyboardInterrupt

    return handler


def _quiet_interrupts(unraisable) -> None:
    """sys.unraisablehook: a KeyboardInterrupt Python could not raise (noted by its handler already) prints no
    traceback; anything else is reported as usual."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _replica_gpus(args, cfg):
    """Each data-parallel replica's CUDA_VISIBLE_DEVICES (None: a single server); ValueError with one line (also
    for more executor ranks than the cpu runs)."""
    from scheduler_proc.replica import check_cpu_ranks, replica_gpus, visible_gpus

    device = cfg.executor.device
    check_cpu_ranks(args.data_parallel_size, cfg.executor.tensor_parallel_size, device)
    if args.data_parallel_size == 1:
        return None
    return replica_gpus(args.data_parallel_size, cfg.executor.tensor_parallel_size, device,
                        visible_gpus() if device.startswith("cuda") else None)


def _announce(server, model, ready, cfg) -> None:
    os.makedirs(os.path.dirname(ADDRESS_FILE), exist_ok=True)
    with open(ADDRESS_FILE, "w") as f:
        f.write(server.client_address)
    if ready is None:  # a router: each replica said what it serves
        print(f"forerun: serving {model.name} on {len(server.replicas)} data-parallel replicas", flush=True)
        _tokenizer_notes(model.tokenizer_path)
        print(f"forerun: ready at {server.client_address}", flush=True)
        return
    tp = cfg.executor.tensor_parallel_size
    layout = "tensor parallel, expert parallel" if cfg.executor.enable_expert_parallel else "tensor parallel"
    device = f"{ready.device} x {tp} ranks ({layout})" if tp > 1 else ready.device
    precision = ", ".join([ready.dtype] + [f"{what} fp8" for what, on in (
        ("weights", ready.fp8_weights), ("KV cache", cfg.executor.kv_cache_dtype == "fp8")) if on])
    blocks = f"{ready.num_kv_blocks:,} KV block{'s' if ready.num_kv_blocks != 1 else ''}"
    print(f"forerun: serving {model.name} on {device} ({precision}), {blocks} of {cfg.executor.block_size}"
          f"{f' (+{ready.num_host_blocks} on the host)' if ready.num_host_blocks else ''}, depth {cfg.pipeline_depth}"
          f"{cfg.executor.speculative.banner()}", flush=True)
    if ready.num_graphs:
        print(f"forerun: {ready.num_graphs} CUDA graphs captured in {ready.graph_capture_s:.1f} s, "
              f"{ready.graph_memory_bytes / 2**20:.0f} MiB", flush=True)
    if ready.memory_plan:
        print(f"forerun: {ready.memory_plan}", flush=True)
    _tokenizer_notes(model.tokenizer_path, ready.vocab_size)
    print(f"forerun: ready at {server.client_address}", flush=True)


def _tokenizer_notes(path: str, vocab_size: Optional[int] = None) -> None:
    """What clients cannot ask of a server without a tokenizer, or of one whose tokenizer has no chat template, and
    a tokenizer that does not match the model's ``vocab_size`` (a --tokenizer of another model): more tokens than
    the model's are refused in prompts; far fewer leave the model's other ids without text."""
    if path and vocab_size:
        known = tokenizer_vocab_size(path)
        if known is not None and (known > vocab_size or known < 0.9 * vocab_size):
            what = ("prompts holding ids past the model's are refused" if known > vocab_size else
                    f"generated ids past {known:,} have no text")
            print(f"forerun: the tokenizer knows {known:,} tokens and the model {vocab_size:,}: {what} (is the "
                  f"tokenizer the model's?)", flush=True)
    if not path:
        print("forerun: no tokenizer: clients send token ids and get token ids back (--tokenizer FILE|DIR gives "
              "the server one)", flush=True)
    elif has_chat_template(path) is False:
        print("forerun: the tokenizer has no chat template: chat requests are refused; completions are served",
              flush=True)
    elif (error := chat_template_error(path)) is not None:
        print(f"forerun: the tokenizer's chat template does not compile ({error}): chat requests are refused; "
              f"completions are served", flush=True)


def _listen_http(args, cfg):
    """The --port socket, bound and listening before the model loads (None without --port); raises StartupError
    when the port is taken (never shared with another server: see ipc.gateway.process.listening_socket)."""
    if args.port is None:
        return None
    from ipc.gateway.process import listening_socket
    from scheduler_proc.frontend import LOOPBACK_HOSTS, StartupError

    host = args.host or ("0.0.0.0" if cfg.api_key else "127.0.0.1")  # no key: reachable from this host only
    if host not in LOOPBACK_HOSTS and not host.startswith("127.") and not cfg.api_key and not cfg.allow_unauthenticated:
        raise StartupError(f"--host {host} makes the HTTP API reachable from other machines and no API key is set: "
                           f"anyone could send requests; set --api-key-file (or {API_KEY_ENV}), or pass "
                           f"--allow-unauthenticated")
    try:
        return listening_socket(host, args.port)
    except OSError as e:
        why = "the port is in use (another server?)" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        raise StartupError(f"cannot listen on http://{host}:{args.port}: {why}") from None


def _start_gateways(args, cfg, server, sock):
    """The HTTP gateway processes for --port (None without it)."""
    if sock is None:
        return None
    from ipc.gateway.process import start_gateways

    try:
        return start_gateways(server.client_address, sock=sock, run_dir=server.run_dir, api_key=cfg.api_key,
                              **gateway_settings(args))
    except ValueError as e:
        raise SystemExit(f"forerun: {e}")


def _stop_gateways(gateways) -> None:
    """Stop the HTTP gateway workers.  Those still starting are killed at once: nothing is in flight there, and a
    starting worker acts on SIGTERM only once it serves (it would first wait out the stopped server's heartbeats,
    then print uvicorn's traceback); the others get SIGTERM and finish their responses.  Then the temporary
    tokenizer folders of killed workers are removed (ipc/client/prompt.py)."""
    from ipc.client.prompt import remove_stale_tokenizer_folders

    for proc, worker in zip(gateways.procs, gateways.configs):
        if proc.poll() is None and not os.path.exists(worker.ready_file):
            proc.kill()
    gateways.stop()
    remove_stale_tokenizer_folders()


def _watch_gateways(gateways, server, stopping: threading.Event, failed: threading.Event) -> None:
    """Once every gateway worker serves (a start that fails is ``_ask``'s to report): a worker that exits (killed,
    out of memory, a crash in native code) is said in one line and started again, counted in the server's
    ``api_worker_restarts``; its port stays open meanwhile (the server holds it), connections wait in its backlog.
    More than :data:`MAX_WORKER_RESTARTS` exits within a minute stop the server, exit 1."""
    import collections
    import time

    while not all(os.path.exists(c.ready_file) for c in gateways.configs):
        if stopping.wait(WATCH_INTERVAL_S) or any(proc.poll() is not None and not os.path.exists(c.ready_file)
                                                  for proc, c in zip(gateways.procs, gateways.configs)):
            return  # stopped, or a worker that exited before it served: not ours to restart
    exits: collections.deque = collections.deque()
    while not stopping.wait(WATCH_INTERVAL_S):
        for i, proc in enumerate(gateways.procs):
            if proc.poll() is None or stopping.is_set():
                continue
            now = time.monotonic()
            exits.append(now)
            while now - exits[0] > 60.0:
                exits.popleft()
            if len(exits) > MAX_WORKER_RESTARTS:
                print(f"forerun: gateway worker {i} exited with status {proc.returncode}, {len(exits)} exits within "
                      f"60 s; stopping", file=sys.stderr, flush=True)
                failed.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            print(f"forerun: gateway worker {i} exited with status {proc.returncode}; starting it again",
                  file=sys.stderr, flush=True)
            gateways.restart(i)
            server.api_worker_restarts += 1


def _ask(address: str, question, gateways, model_name: str, failed_start: threading.Event,
         stopping: threading.Event, api_key: Optional[str] = None) -> None:
    """Answer --ask through the SDK (with the server's key, which a tcp:// address needs); with --port, wait for
    the HTTP gateways and show the curl way."""
    if gateways:
        try:
            gateways.wait_ready()
        except (RuntimeError, TimeoutError) as e:
            if stopping.is_set():  # a worker stopped by the shutdown, not one that failed
                return
            print(f"forerun: {e}; stopping", file=sys.stderr, flush=True)
            failed_start.set()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        workers = len(gateways.procs)
        print(f"forerun: OpenAI-compatible API at {gateways.url}/v1 ({workers} worker{'s' if workers != 1 else ''})",
              flush=True)
    if not question:
        return
    print(f"forerun: asking {question!r}", flush=True)
    try:
        stream_answer(address, question, max_tokens=None, api_key=api_key)
        if gateways:
            curl = curl_line(gateways.url, model_name, question, gateways.requires_key)
            print(f"forerun: the same over HTTP: {curl}", flush=True)
        print("forerun: still serving; press Ctrl-C to stop", flush=True)
    except Exception as e:
        print(f"forerun: the question failed: {e}", file=sys.stderr, flush=True)


def curl_line(url: str, model_name: str, question: str, requires_key: bool) -> str:
    """A curl command that asks ``question`` through the HTTP API."""
    import json
    import shlex

    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": question}],
                       "max_tokens": ASK_MAX_TOKENS, "temperature": 0})  # as --ask asks (at most)
    key = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if requires_key else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d {shlex.quote(body)}"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args) if args.command == "serve" else chat(args)


if __name__ == "__main__":
    sys.exit(main())
