"""The ``forerun`` command: ``forerun serve`` and ``forerun chat``.

``serve`` runs the scheduler in this process; the scheduler starts the
executor as a child that dies with it, shows a progress bar while the model
loads, prints the client address, and serves until interrupted.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import os
import re
import shutil
import signal
import sys
import threading
from typing import Optional

import msgspec

from ipc.config import ExecutorConfig, ScriptedOptions, SpeculativeConfig, default_of
from ipc.models import resolve_model
from scheduler_proc.cli_flags import (ADDRESS_FILE, API_KEY_ENV, build_parser, check_chat_flags, check_serve_flags,
                                     in_flag_names)
from scheduler_proc.config import INTERPRETER_HANG_TIMEOUT_S, ServerConfig
from scheduler_proc.executor_process import NO_MULTICAST_ENV


def api_key_of(args) -> Optional[str]:
    """The shared secret: --api-key-file, else --api-key, else $FORERUN_API_KEY (None: no key)."""
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def server_config(args) -> ServerConfig:
    """The one ServerConfig the flags describe; a bad value raises ValueError naming the flag's field."""
    check_serve_flags(args)
    if args.no_prefix_caching:  # the host tier keeps the prefix cache's blocks: a size asked for would do nothing
        given = [f for f, v, d in (("--num-host-kv-blocks", args.num_host_kv_blocks, None),
                                   ("--host-kv-gib", args.host_kv_gib, default_of(ExecutorConfig, "host_kv_gib")))
                 if v != d and v != 0]  # a size of 0: the tier off, as it is
        if given:
            raise ValueError(f"{' and '.join(given)} {'size' if len(given) > 1 else 'sizes'} the host KV tier, which "
                             f"keeps prefix-cache blocks: not with --no-prefix-caching")
    executor = ExecutorConfig(
        load_format=args.load_format, device=args.device, dtype=args.dtype, kernels=args.kernels,
        cuda_graphs=not args.no_cuda_graphs, mixed_graphs=args.mixed_graphs, batch_invariant=args.batch_invariant,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        num_slots=args.max_num_seqs, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=_memory_utilization(args),
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.executor_threads, tensor_parallel_size=args.tensor_parallel_size, all_reduce=args.all_reduce,
        enable_expert_parallel=args.enable_expert_parallel, moe_expert_counts=args.moe_expert_counts,
        # The host tier keys its blocks with the prefix cache's keys: without prefix caching it is off.
        host_kv_gib=0.0 if args.no_prefix_caching else args.host_kv_gib,
        num_host_kv_blocks=None if args.no_prefix_caching else args.num_host_kv_blocks,
        host_kv_backup_stream=not args.host_kv_backup_on_compute_stream,
        scripted=ScriptedOptions(step_latency_s=_or_default(args.scripted_step_ms, 1000, ScriptedOptions,
                                                            "step_latency_s") / 1000,
                                 eos_at=dict(args.scripted_eos_at)),
        speculative=SpeculativeConfig(method=args.speculative_method,
                                      num_tokens=_or_default(args.num_speculative_tokens, 1, SpeculativeConfig,
                                                             "num_tokens"),
                                      ngram_min=_or_default(args.ngram_min, 1, SpeculativeConfig, "ngram_min"),
                                      ngram_max=_or_default(args.ngram_max, 1, SpeculativeConfig, "ngram_max"),
                                      draft_model=_draft_path(args.draft_model),
                                      draft_load_format=args.draft_load_format),
    )
    return ServerConfig(model=args.model, tokenizer=args.tokenizer, pipeline_depth=args.pipeline_depth,
                        prefill_ahead=args.prefill_ahead,
                        client_address=args.address, debug_checks=args.debug_checks, step_log=args.step_log,
                        api_key=api_key_of(args), allow_unauthenticated=args.allow_unauthenticated,
                        enable_prefix_caching=not args.no_prefix_caching,
                        executor=executor, executor_hang_timeout_s=_hang_timeout(args),
                        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                        shutdown_timeout_s=args.shutdown_timeout, max_waiting=args.max_waiting,
                        client_send_hwm=args.client_send_hwm, grammar_compile_timeout_s=args.grammar_compile_timeout)


def _or_default(value, scale, struct: type, name: str):
    """A flag that defaults to None (so that giving it can be told from not: check_serve_flags), or its config
    field's default in the flag's unit (``scale`` flag units per field unit: 1000 for milliseconds of seconds)."""
    return default_of(struct, name) * scale if value is None else value


def _hang_timeout(args) -> float:
    """``--executor-hang-timeout``, or its default: longer where Triton's interpreter runs the kernels (the CPU)."""
    if args.executor_hang_timeout is not None:
        return args.executor_hang_timeout
    if args.kernels == "triton" and args.device == "cpu":
        return INTERPRETER_HANG_TIMEOUT_S
    return default_of(ServerConfig, "executor_hang_timeout_s")


def _draft_path(path: Optional[str]) -> str:
    """--draft-model as an absolute path ("" when not given); ValueError when it does not exist."""
    if not path:
        return ""
    if not os.path.exists(path):
        raise ValueError(f"--draft-model {path!r} does not exist")
    return os.path.abspath(path)


def _memory_utilization(args) -> float:
    """--gpu-memory-utilization, or the deprecated --kv-memory-fraction (with a line saying so)."""
    if args.kv_memory_fraction is not None:
        print("forerun: --kv-memory-fraction is deprecated: it now means --gpu-memory-utilization, the fraction "
              "of the GPU's total memory the server may use", file=sys.stderr, flush=True)
        if args.gpu_memory_utilization is None:
            return args.kv_memory_fraction
    if args.gpu_memory_utilization is not None:
        return args.gpu_memory_utilization
    return default_of(ExecutorConfig, "gpu_memory_utilization")


def stream_answer(address: str, prompt: str, *, system=None, max_tokens=256, temperature=0.0,
                  seed=None, timeout=120.0, api_key=None, out=sys.stdout) -> None:
    """Stream the answer to ``prompt`` to ``out``, ended by a newline; after a failure the newline ends only a partial
    answer (the error line must not run on after it), and nothing is written when nothing was answered."""
    from ipc.client import Client

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    written = False
    try:
        with Client(address, timeout=timeout, api_key=api_key) as client:
            for chunk in client.stream(messages=messages, max_tokens=max_tokens, temperature=temperature,
                                       seed=seed):
                out.write(chunk.text_delta)
                out.flush()
                written = written or bool(chunk.text_delta)
    except BaseException:
        if written:
            out.write("\n")
            out.flush()
        raise
    out.write("\n")
    out.flush()


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
        _check_tokenizer(model.tokenizer_path, args.tokenizer, args.model)
        gpus = _replica_gpus(args, cfg)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"forerun: {in_flag_names(str(e))}")
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


def _check_tokenizer(path: str, tokenizer: Optional[str], model: Optional[str]) -> None:
    """The tokenizer the server detokenizes with loads, and the other JSON files clients build theirs from parse: a
    text file, another format or a malformed file is refused now, in one line naming --tokenizer (or --model, whose
    folder it comes from), not once the model has loaded (a traceback) or in every gateway worker; ValueError."""
    from ipc.models import TOKENIZER_FILES
    from scheduler_proc.outputs import load_detokenizer

    if tokenizer and not (os.path.isfile(path) or any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)):
        # resolve_model checks this for a model's formats; --load-format scripted takes any path
        what = "does not exist" if not os.path.exists(path) else f"has none of {', '.join(TOKENIZER_FILES)}"
        raise ValueError(f"--tokenizer {tokenizer!r} {what}")
    try:
        load_detokenizer(path)
        _check_json_files(path)
    except ValueError as e:
        if tokenizer:  # a file given itself is named once
            why = str(e).removeprefix(os.path.abspath(tokenizer) + ": ")
            raise ValueError(f"--tokenizer {tokenizer}: {why}") from None
        raise ValueError(f"--model {model or '(the default model)'}: {e}") from None


def _check_json_files(folder: str) -> None:
    """Each JSON file besides tokenizer.json that clients fetch with the tokenizer (ipc.models.TOKENIZER_FILE_NAMES)
    is a JSON object; ValueError naming the first that is not."""
    from ipc.models import TOKENIZER_FILE_NAMES

    if not folder or not os.path.isdir(folder):
        return
    for name in TOKENIZER_FILE_NAMES:
        path = os.path.join(folder, name)
        if name == "tokenizer.json" or not name.endswith(".json") or not os.path.isfile(path):
            continue
        try:  # Python's json, as the loader and transformers read these (it takes Infinity and NaN)
            with open(path, "rb") as f:
                value = json.loads(f.read())
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{path}: not a JSON object")


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
    """Each data-parallel replica's CUDA_VISIBLE_DEVICES (None: a single server); ValueError with one line."""
    if args.data_parallel_size == 1:
        return None
    from scheduler_proc.replica import replica_gpus, visible_gpus

    device = cfg.executor.device
    return replica_gpus(args.data_parallel_size, cfg.executor.tensor_parallel_size, device,
                        visible_gpus() if device.startswith("cuda") else None)


def _announce(server, model, ready, cfg) -> None:
    os.makedirs(os.path.dirname(ADDRESS_FILE), exist_ok=True)
    with open(ADDRESS_FILE, "w") as f:
        f.write(server.client_address)
    if ready is None:  # a router: each replica said what it serves
        print(f"forerun: serving {model.name} on {len(server.replicas)} data-parallel replicas", flush=True)
        print(f"forerun: ready at {server.client_address}", flush=True)
        return
    tp = cfg.executor.tensor_parallel_size
    layout = "tensor parallel, expert parallel" if cfg.executor.enable_expert_parallel else "tensor parallel"
    device = f"{ready.device} x {tp} ranks ({layout})" if tp > 1 else ready.device
    print(f"forerun: serving {model.name} on {device} ({ready.dtype}), "
          f"{ready.num_kv_blocks} KV blocks of {cfg.executor.block_size}"
          f"{f' (+{ready.num_host_blocks} on the host)' if ready.num_host_blocks else ''}, depth {cfg.pipeline_depth}",
          flush=True)
    if ready.num_graphs:
        print(f"forerun: {ready.num_graphs} CUDA graphs captured in {ready.graph_capture_s:.1f} s, "
              f"{ready.graph_memory_bytes / 2**20:.0f} MiB", flush=True)
    if ready.memory_plan:
        print(f"forerun: {ready.memory_plan}", flush=True)
    print(f"forerun: ready at {server.client_address}", flush=True)


def _listen_http(args, cfg):
    """The --port socket, bound and listening before the model loads (None without --port); raises StartupError
    when the port is taken (never shared with another server: see ipc.gateway.process.listening_socket)."""
    if args.port is None:
        return None
    from ipc.gateway.process import listening_socket
    from scheduler_proc.frontend import StartupError

    host = args.host or ("0.0.0.0" if cfg.api_key else "127.0.0.1")  # no key: reachable from this host only
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
        return start_gateways(server.client_address, sock=sock, workers=args.api_workers, run_dir=server.run_dir,
                              api_key=cfg.api_key, max_request_bytes=args.max_request_bytes,
                              tokenizer_threads=args.api_tokenizer_threads)
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
        print(f"forerun: OpenAI-compatible API at {gateways.url}/v1 ({len(gateways.procs)} workers)", flush=True)
    if not question:
        return
    print(f"forerun: asking {question!r}", flush=True)
    try:
        stream_answer(address, question, api_key=api_key)
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
                       "max_tokens": 256, "temperature": 0})  # as stream_answer asks
    key = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if requires_key else ""
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{key} -d {shlex.quote(body)}"


# The request fields `forerun chat` fills from its flags: a server's error names the field, the user typed the flag.
CHAT_FLAG_OF_FIELD = {"sampling.max_tokens": "--max-tokens", "sampling.temperature": "--temperature",
                      "sampling.seed": "--seed"}


def chat(args) -> int:
    """``forerun chat``: stream one answer; every expected failure is one line on stderr and exit 1 (130: Ctrl-C)."""
    try:
        check_chat_flags(args)
    except ValueError as e:
        raise SystemExit(f"forerun: {e}")
    address = args.address
    if address is None:
        try:
            with open(ADDRESS_FILE) as f:
                address = f.read().strip()
        except FileNotFoundError:
            raise SystemExit("forerun: no --address given and no server has been started here")
    from ipc.client import ForerunError

    try:
        stream_answer(address, args.prompt, system=args.system, max_tokens=args.max_tokens,
                      temperature=args.temperature, seed=args.seed, timeout=args.timeout, api_key=args.api_key)
    except (ForerunError, TimeoutError, ConnectionError, ValueError) as e:
        # Expected failures (no server, server gone, invalid request, timeout, bad address): one line.
        print(f"forerun: {_chat_error(e)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("forerun: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


def _chat_error(e: Exception) -> str:
    """An error as `forerun chat`'s user reads it: a request field the server names (``sampling.max_tokens``) as the
    flag that set it (``[invalid_request] --max-tokens must be ...``), the SDK's own words otherwise."""
    from ipc.client import ForerunError

    flag = CHAT_FLAG_OF_FIELD.get(e.field or "") if isinstance(e, ForerunError) else None
    if flag is None:
        return str(e)
    name = e.field.rpartition(".")[2]  # the messages say sampling.max_tokens or max_tokens
    message = re.sub(rf"(?<![\w.-]){name}(?!\w)", flag, e.message.replace(e.field, flag))
    return f"[{e.code}] " + (message if message.startswith(flag) else f"{flag}: {message}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return serve(args) if args.command == "serve" else chat(args)


if __name__ == "__main__":
    sys.exit(main())
