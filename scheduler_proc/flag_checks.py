"""What ``forerun serve`` and ``forerun chat`` refuse before anything starts, beyond what the configs check: counts of
processes and threads past what this host starts, ports out of range, a --step-log the server cannot append to, flags
that mean nothing without another, empty keys.  Each refusal is a ValueError of one line naming the flag and its
limit; the parser itself is :mod:`scheduler_proc.cli_flags`."""

from __future__ import annotations

import math
import os

from scheduler_proc.cli_flags import MAX_API_WORKERS, PER_CPU, max_api_workers, usable_cpus

MAX_INT64 = 2**63 - 1  # seeds and positions travel as 64-bit integers


def check_serve_flags(args) -> None:
    """Refuse what the configs cannot see or do not bound, in one line naming the flag and its limit, before anything
    is created (no run directory, no process): counts of processes and threads past what this host starts, a --port
    outside 0-65535 or a tcp:// --address port outside 1-65535, a --step-log the server cannot append to, flags
    that mean nothing without another (ignored silently otherwise), an empty --api-key (which would mean no key).
    ValueError."""
    _check_counts(args)
    _check_needs(args)
    _check_scripted(args)
    if args.port is not None and not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.address:
        _check_address_port(args.address)
    if args.step_log:
        _check_step_log(args.step_log)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is an empty key, which would mean no key (or a blank one, which no HTTP client can "
                         "send: header values are trimmed): leave --api-key out to serve without one")


MAX_TOKENIZER_THREADS = 64  # --api-tokenizer-threads: per gateway worker


def _check_counts(args) -> None:
    """--api-workers and --executor-threads within PER_CPU per CPU, the gateway's other counts at their floors (with
    or without --port: a value that would fail once --port is added is wrong already)."""
    cpus = usable_cpus()
    per_cpu = f"{PER_CPU} per CPU; {cpus} CPU{'s' if cpus > 1 else ''} here"
    for flag, value, low, high, why in (
            ("--api-workers", args.api_workers, 1, max_api_workers(), f"{per_cpu}; at most {MAX_API_WORKERS}"),
            ("--executor-threads", args.executor_threads, 1, PER_CPU * cpus, per_cpu),
            ("--api-tokenizer-threads", args.api_tokenizer_threads, 1, MAX_TOKENIZER_THREADS,
             "each a thread of every gateway worker"),
            ("--max-request-bytes", args.max_request_bytes, 1024, None, "")):
        if value is None:  # not given: the default is computed later
            continue
        if value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
        if high is not None and value > high:
            raise ValueError(f"{flag} must be in [{low}, {high}] ({why}), got {value}")


def _check_needs(args) -> None:
    """A flag given without the one it works with: refused, as it would be ignored (--draft-model's rule, in
    ipc.config, for the speculative and scripted flags that default to None here); an empty --model or --host, which
    would mean the current folder or the loopback address without saying so."""
    for flag, value in (("--model", args.model), ("--host", args.host)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag} is empty")
    if args.host is not None and args.port is None:
        raise ValueError("--host needs --port (the HTTP API's address; the SDK's is --address)")
    for flag, given in (("--api-workers", args.api_workers), ("--max-request-bytes", args.max_request_bytes),
                        ("--api-tokenizer-threads", args.api_tokenizer_threads)):
        if given is not None and args.port is None:
            raise ValueError(f"{flag} needs --port (it sets the HTTP API, which runs only with a --port)")
    if args.host_kv_backup_on_compute_stream and not (args.device or "").startswith("cuda"):
        raise ValueError(f"--host-kv-backup-on-compute-stream needs --device cuda (the host KV tier keeps copies of "
                         f"GPU blocks in host memory; on --device {args.device} there is none)")
    if args.allow_unauthenticated and args.port is None and not (args.address or "").startswith("tcp://"):
        raise ValueError("--allow-unauthenticated has nothing to allow: it lets a tcp:// --address or the HTTP API "
                         "(--port) reach other machines without a key, and this server has neither")
    method, load_format = args.speculative_method, args.load_format
    for flag, given, needed, ok in (
            ("--num-speculative-tokens", args.num_speculative_tokens, "--speculative-method ngram or draft",
             method is not None),
            ("--ngram-min", args.ngram_min, "--speculative-method ngram", method == "ngram"),
            ("--ngram-max", args.ngram_max, "--speculative-method ngram", method == "ngram"),
            ("--scripted-step-ms", args.scripted_step_ms, "--load-format scripted", load_format == "scripted"),
            ("--scripted-eos-at", args.scripted_eos_at or None, "--load-format scripted", load_format == "scripted")):
        if given is not None and not ok:
            got = (f"--load-format {load_format}" if "load-format" in needed
                   else f"--speculative-method {method or 'off'}")
            raise ValueError(f"{flag} needs {needed} (got {got})")


def _check_scripted(args) -> None:
    """--scripted-step-ms a finite number of milliseconds >= 0; each --scripted-eos-at SEED and POS in
    [0, 2^63-1] (a negative position is never reached; larger numbers do not fit the executor's config)."""
    ms = args.scripted_step_ms
    if ms is not None and not (math.isfinite(ms) and ms >= 0):
        raise ValueError(f"--scripted-step-ms must be a finite number of milliseconds >= 0, got {ms:g}")
    for seed, pos in args.scripted_eos_at:
        for name, value in (("SEED", seed), ("POS", pos)):
            if not 0 <= value <= MAX_INT64:
                raise ValueError(f"--scripted-eos-at {seed}:{pos}: {name} must be in [0, 2^63-1], got {value}")


def _check_address_port(address: str) -> None:
    """A tcp:// --address has a port in [1, 65535] (ZeroMQ took 99999 and listened on another port; 0 or * would
    listen on a port the server could not announce)."""
    if not address.startswith("tcp://"):
        return  # ipc:// paths and other schemes: the frontend's checks
    _, sep, port = address[len("tcp://"):].rpartition(":")
    if not (sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"--address {address}: the port must be in [1, 65535], got {port if sep else 'none'}")


def _check_step_log(path: str) -> None:
    """--step-log names a file the server can append to, in a folder that exists; checked without creating it (the
    server opens it once it starts, and a data-parallel replica writes PATH.i)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        why = "Is a directory"
    elif not os.path.exists(folder):
        why = "No such file or directory"
    elif not os.path.isdir(folder):
        why = "Not a directory"
    elif not os.access(path if os.path.exists(path) else folder, os.W_OK):
        why = "Permission denied"
    else:
        return
    raise ValueError(f"--step-log {path}: {why}")


def check_chat_flags(args) -> None:
    """Refuse a --timeout that is not a positive number of seconds, a --seed the wire cannot carry, an empty
    --api-key; ValueError naming the flag."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.seed is not None and not 0 <= args.seed <= MAX_INT64:
        raise ValueError(f"--seed must be in [0, 2^63-1], got {args.seed}")
    if args.api_key == "":
        raise ValueError("--api-key is an empty key: leave --api-key out to connect without one")
