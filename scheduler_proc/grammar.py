"""Structured outputs, the scheduler's half: a request's constraint -> one compiled, validated grammar.

A request names at most one constraint (``SamplingParams.json_schema``, ``regex``, ``choice`` or
``grammar``).  Before it is admitted the scheduler turns it into an llguidance grammar and proves
that it compiles against the model's tokenizer, off the event loop (a worker thread): a bad schema
is an ``invalid_request`` naming the field, and a grammar whose compile (the matcher and its first
mask) takes longer than ``--grammar-compile-timeout`` is refused the same way.  Results are cached
by the constraint's text, errors too, so a repeated schema costs a dict lookup.

The compiled grammar travels in ``SlotSampling.grammar``; the executor keeps the matcher
(``executor_proc/step/grammar.py``).  llguidance is torch-free: this module never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from ipc import protocol as p
from ipc.structured import load_tokenizer, matcher_error

CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "grammar")
CACHE_SIZE = 512
MAX_CONSTRAINT_BYTES = 64 * 1024
# Upper bounds (seconds) of the compile-time histogram's buckets (the last, +Inf, is implicit).
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# JSON is generated compactly (", " and ": " separators, no free whitespace): a small model given free
# whitespace may spend its whole budget on newlines.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(Exception):
    """A constraint that cannot be served: ``field`` (``sampling.json_schema``, ...) and why."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def constraint(sampling: p.SamplingParams) -> Optional[tuple[str, Any]]:
    """The request's one constraint as (field name, value), or None; GrammarError when several are set."""
    set_ = [(name, getattr(sampling, name)) for name in CONSTRAINT_FIELDS if getattr(sampling, name) is not None]
    if len(set_) > 1:
        raise GrammarError(f"sampling.{set_[1][0]}", "at most one of json_schema, regex, choice and grammar may be "
                                                      f"set; got {', '.join(n for n, _ in set_)}")
    return set_[0] if set_ else None


def check_sampling(sampling: p.SamplingParams) -> None:
    """Sampling options that contradict a constraint (GrammarError): the grammar decides when output may end."""
    if sampling.ignore_eos:
        raise GrammarError("sampling.ignore_eos", "ignore_eos cannot be combined with a structured output: the "
                                                  "constraint ends the output with EOS once it is complete")
    if sampling.min_tokens:
        raise GrammarError("sampling.min_tokens", "min_tokens cannot be combined with a structured output: it "
                                                  "would mask the EOS that a complete output must end with")


def cache_key(name: str, value: Any) -> str:
    """The constraint's identity: its field and its text (a schema object as sorted, compact JSON)."""
    if name == "json_schema":
        if isinstance(value, str):  # a schema's text and its object are one schema
            try:
                value = json.loads(value)
            except ValueError:
                return f"{name}\0{value}"
        value = json.dumps(value, sort_keys=True, separators=(",", ":"))
    elif name == "choice":
        value = json.dumps(value)
    return f"{name}\0{value}"


def to_grammar(name: str, value: Any) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer); GrammarError if malformed."""
    import llguidance

    field = f"sampling.{name}"
    if name == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise GrammarError(field, f"json_schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError(field, f"json_schema must be a JSON object, got {type(value).__name__}")
        try:
            _check_integer_bounds(field, value)
        except RecursionError:
            raise GrammarError(field, "json_schema nests too deeply") from None
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(field, f"invalid JSON schema: {e}") from None
    if name == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if name == "choice":
        if not value:
            raise GrammarError(field, "choice must list at least one string")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    try:  # Lark, or GBNF (llama.cpp's grammars), which llguidance converts
        return llguidance.grammar_from("grammar", value)
    except ValueError as e:
        raise GrammarError(field, str(e)) from None


INT64 = (-(1 << 63), (1 << 63) - 1)  # the integers llguidance's integer ranges take


def _check_integer_bounds(field: str, schema: Any, at: str = "") -> None:
    """GrammarError for an integer schema's bound past the signed 64-bit range: llguidance clamps it to the range
    (``minimum`` 10**19 allowed 9223372036854775807, an output the schema rejects)."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            _check_integer_bounds(field, item, f"{at}/{i}")
        return
    if not isinstance(schema, dict):
        return
    types = schema.get("type")
    if types == "integer" or (isinstance(types, list) and "integer" in types):
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            bound = schema.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not INT64[0] <= bound <= INT64[1]:
                raise GrammarError(field, f"json_schema: {key} {bound} at {at or '/'} is outside the signed 64-bit "
                                          f"integers that integer schemas can be held to")
    for key, value in schema.items():
        if isinstance(value, (dict, list)) and key not in ("enum", "const", "default", "examples"):
            _check_integer_bounds(field, value, f"{at}/{key}")


class GrammarStats:
    """Counters for ServerStats (and the gateway's metrics)."""

    def __init__(self):
        self.constrained_requests = 0
        self.compiles = 0
        self.cache_hits = 0
        self.compile_s_total = 0.0
        self.compile_buckets = [0] * (len(COMPILE_BUCKETS) + 1)

    def server_stats(self) -> dict:
        """ServerStats fields."""
        return dict(structured_requests=self.constrained_requests, grammar_compiles=self.compiles,
                    grammar_compile_s_total=self.compile_s_total, grammar_compile_buckets=list(self.compile_buckets),
                    grammar_cache_hits=self.cache_hits)

    def observe_compile(self, seconds: float) -> None:
        self.compiles += 1
        self.compile_s_total += seconds
        i = next((i for i, b in enumerate(COMPILE_BUCKETS) if seconds <= b), len(COMPILE_BUCKETS))
        self.compile_buckets[i] += 1


class GrammarCompiler:
    """Compiles constraints in worker threads against the model's tokenizer; caches grammars and errors."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], timeout_s: float = 10.0,
                 unavailable: str = ""):
        """``unavailable``: why this server takes no constraint at all ("" : it takes them)."""
        self.unavailable = unavailable
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.timeout_s = timeout_s
        self.stats = GrammarStats()
        self._cache: OrderedDict[str, tuple[str, Optional[GrammarError]]] = OrderedDict()
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="forerun-grammar")
        self._lock = threading.Lock()
        self._tokenizer = None

    def tokenizer(self):
        """The llguidance tokenizer (built once, about a second, in a worker thread)."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self.tokenizer_path, self.vocab_size, self.eos_token_ids)
            return self._tokenizer

    def compile_sync(self, name: str, value: Any) -> str:
        """Build and check the grammar, its matcher and its first mask (a worker thread); GrammarError if bad."""
        field = f"sampling.{name}"
        if len(cache_key(name, value)) > MAX_CONSTRAINT_BYTES:
            raise GrammarError(field, f"the constraint is longer than {MAX_CONSTRAINT_BYTES} bytes")
        tokenizer = self.tokenizer()
        if tokenizer is None:
            raise GrammarError(field, "structured outputs need the model's tokenizer; this server has none")
        import llguidance

        grammar = to_grammar(name, value)
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(field, matcher_error(matcher.get_error()))
        matcher.compute_bitmask()  # the first mask compiles the lexer: a slow grammar shows here
        if matcher.is_error():
            raise GrammarError(field, matcher_error(matcher.get_error()))
        self.stats.observe_compile(time.perf_counter() - t0)
        return grammar

    async def compile(self, sampling: p.SamplingParams) -> str:
        """The compiled grammar of the request's constraint ("" for none); GrammarError if it cannot be served."""
        found = constraint(sampling)
        if found is None:
            return ""
        if self.unavailable:
            raise GrammarError(f"sampling.{found[0]}", self.unavailable)
        check_sampling(sampling)
        self.stats.constrained_requests += 1
        try:
            key = cache_key(*found)
        except RecursionError:  # an SDK client's schema past Python's recursion (the HTTP front refuses it sooner)
            raise GrammarError(f"sampling.{found[0]}", f"{found[0]} nests too deeply") from None
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            grammar, error = cached
            if error is not None:
                raise error
            return grammar
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.compile_sync, *found)
        try:
            grammar = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            error = None
        except asyncio.TimeoutError:
            grammar, error = "", GrammarError(f"sampling.{found[0]}", f"compiling the constraint took longer than "
                                                                    f"{self.timeout_s:g} s (--grammar-compile-timeout)")
        except GrammarError as e:
            grammar, error = "", e
        self._cache[key] = (grammar, error)
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        if error is not None:
            raise error
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


async def admit_constrained(server, client: bytes, msg: p.Generate) -> None:
    """Compile ``msg``'s constraint off the loop, then hand it to the server's admission (or send the error)."""
    key = (client, msg.request_id)
    server.compiling[key] = False
    try:
        grammar = await server.grammars.compile(msg.sampling)
    except GrammarError as e:
        server.frontend.send(client, p.Error(code="invalid_request", message=e.message, request_id=msg.request_id,
                                             field=e.field))
        return
    except Exception as e:  # a compiler failure must not take the server down
        server.frontend.send(client, p.Error(code="invalid_request", message=f"the constraint failed to compile: "
                             f"{type(e).__name__}: {e}", request_id=msg.request_id, field="sampling"))
        return
    finally:
        aborted = server.compiling.pop(key, False)
    if client not in server.frontend.clients:
        return  # forgotten while compiling: nobody to answer
    if aborted:
        for index in range(msg.sampling.n):
            server.frontend.send(client, p.Finished(msg.request_id, "abort", len(msg.prompt_token_ids), 0, index=index))
        return
    refusal = server._refusal()
    if refusal is not None:
        refusal.request_id = msg.request_id
        server.frontend.send(client, refusal)
        return
    server._start_generate(client, msg, grammar)
    server.wake.set()
