"""Structured-output parameters of the HTTP API -> the SDK's one constraint keyword.

Accepted (at most one per request; a second is a 400 naming it):

* OpenAI's ``response_format``: ``{"type": "json_object"}`` (any JSON object) or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (``strict`` or not, the
  schema is enforced: the output is masked to it token by token); ``{"type": "text"}`` is no constraint;
* vLLM's ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and
  ``structured_outputs: {json | regex | choice | grammar | json_object}`` (``extra_body``).

The scheduler compiles the constraint and refuses a bad one with the SDK field (``sampling.json_schema``, ...); the
400 names the request's field it came from (:func:`constraint_param`), else :data:`PARAM_OF_FIELD`'s, and says
what is wrong in terms of the request (:func:`refusal_message`).  A JSON schema holding an integer past 64 bits is
refused here (:func:`check_integers`): no message to the scheduler can hold it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional

import msgspec
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from ipc.gateway import schemas as s
from ipc.protocol import ServerStats

# The scheduler's compile-time buckets (scheduler_proc/grammar.py's COMPILE_BUCKETS; the gateway does not import
# the scheduler); ServerStats.grammar_compile_buckets counts per bucket, +Inf last.
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

ANY_OBJECT = {"type": "object"}
# The SDK's constraint fields -> the parameter a 400 names.
PARAM_OF_FIELD = {"sampling.json_schema": "response_format", "sampling.regex": "guided_regex",
                  "sampling.choice": "guided_choice", "sampling.grammar": "guided_grammar"}


def _response_format(rf: s.ResponseFormat) -> Optional[tuple[str, Any]]:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return "json_schema", ANY_OBJECT
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise s.RequestError(400, "response_format of type json_schema needs a json_schema object",
                                 "response_format.json_schema")
        schema = rf.json_schema.schema
        return "json_schema", schema if schema is not None else ANY_OBJECT
    raise s.RequestError(400, f"response_format.type must be text, json_object or json_schema; got {rf.type!r}",
                         "response_format.type")


def _structured_outputs(so: s.StructuredOutputsParams) -> list[tuple[str, str, Any]]:
    out = []
    for name, sdk in (("json", "json_schema"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
        value = getattr(so, name)
        if value is not None:
            out.append((f"structured_outputs.{name}", sdk, value))
    if so.json_object:
        out.append(("structured_outputs.json_object", "json_schema", ANY_OBJECT))
    return out


# Choices of a guided_choice list: the grammar engine refuses a rule of more than 2,000 alternatives
MAX_CHOICES = 1000


def constraint_param(req: Any) -> Optional[str]:
    """The request field its constraint came from (None: it has none): what a 400 for a refused one names."""
    found = _constraints(req)
    return found[0][0] if found else None


def constraint_value(req: Any) -> Any:
    """The request's constraint as sent (None: it has none): what a 400 for a refused regex quotes."""
    found = _constraints(req)
    return found[0][2] if found else None


def constraint_kwargs(req: Any) -> dict[str, Any]:
    """``{sdk_field: value}`` of the request's one constraint (empty: none); a 400 when several are given."""
    found = _constraints(req)
    if len(found) > 1:
        raise s.RequestError(400, f"give at most one structured-output constraint; got {found[0][0]} and "
                                  f"{found[1][0]}", found[1][0])
    if found and isinstance(req, s.ChatCompletionRequest) and s.chat_echo(req):
        raise s.RequestError(400, f"echo cannot be combined with {found[0][0]}: the answer would start with the "
                                  "echoed text, which the constraint does not hold", "echo")
    if found and found[0][1] == "choice" and isinstance(found[0][2], list) and len(found[0][2]) > MAX_CHOICES:
        raise s.RequestError(400, f"{found[0][0]} allows at most {MAX_CHOICES} choices, got {len(found[0][2])}",
                             found[0][0])
    if found and found[0][1] == "json_schema":
        check_integers(found[0][2], found[0][0])
    return {found[0][1]: found[0][2]} if found else {}


# The integers a message to the scheduler (msgpack) can hold.
_SENDABLE_INTS = (-(2**63), 2**64 - 1)


def check_integers(schema: Any, param: str) -> None:
    """A 400 naming ``param`` for an integer of a JSON schema that no message to the scheduler can hold (past 64
    bits), where msgpack's own words would name neither.  Encoding first (C): a schema without one costs no walk."""
    try:
        msgspec.msgpack.encode(schema)
        return
    except OverflowError:
        pass
    found = _wide_integer(schema)
    if found is not None:
        at, value = found
        digits = str(value)
        shown = digits if len(digits) <= 40 else f"{digits[:40]}... ({len(digits)} digits)"
        raise s.RequestError(400, f"{param} holds an integer outside the 64-bit range: {shown} at {at or '/'}", param)


def _wide_integer(schema: Any) -> Optional[tuple[str, int]]:
    """(JSON pointer, value) of the first integer of ``schema`` outside :data:`_SENDABLE_INTS`, or None (a loop, not
    recursion: a schema nested as deep as a body may be)."""
    todo = [("", schema)]
    while todo:
        at, node = todo.pop()
        if isinstance(node, dict):
            todo += [(f"{at}/{key}", value) for key, value in reversed(node.items())]
        elif isinstance(node, list):
            todo += [(f"{at}/{i}", value) for i, value in reversed(list(enumerate(node)))]
        elif type(node) is int and not _SENDABLE_INTS[0] <= node <= _SENDABLE_INTS[1]:
            return at, node
    return None


# llguidance's advice for a oneOf it cannot enforce names an option of its own, which the API does not have.
_ONE_OF = "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf"
_ONE_OF_HERE = ("this oneOf is not supported: its branches may match the same value, so exactly one of them cannot "
                "be enforced; use anyOf instead")
# llguidance's error for a regex that does not parse: wrapped in the Lark grammar it builds around it
# (``start: /.../``, a rule the client never wrote); the reason is the regex parser's ``error:`` line.
_REGEX_ERROR = re.compile(r'at \d+\(\d+\): invalid regex ".*" \(in regex\): regex parse error:\n.*?^error: (.+?)$',
                          re.DOTALL | re.MULTILINE)
_QUOTED_CHARS = 120  # of a refused regex, at most this many characters quoted


def refusal_message(field: Optional[str], message: str, value: Any = None) -> str:
    """The grammar engine's words for a refused constraint (SDK ``field``), as they concern the request: no advice
    about options the API does not have, and a regex that does not parse as ``invalid regex "((": <why>`` (its
    ``value`` as sent, without the grammar the engine wraps around it).  Otherwise ``message`` as it is."""
    message = schema_message(message)
    found = _REGEX_ERROR.match(message) if field == "sampling.regex" and isinstance(value, str) else None
    if found is None:
        return message
    quoted = json.dumps(value, ensure_ascii=False)
    if len(quoted) > _QUOTED_CHARS:
        quoted = f"{quoted[:_QUOTED_CHARS]}...\" ({len(value)} characters)"
    return f"invalid regex {quoted}: {found.group(1)}"


def schema_message(message: str) -> str:
    """The grammar engine's words for a JSON schema it refuses, without its advice to set an option of its own."""
    return message.replace(_ONE_OF, _ONE_OF_HERE)


def _constraints(req: Any) -> list[tuple[str, str, Any]]:
    """(request field, SDK field, value) of each constraint the request gives."""
    found: list[tuple[str, str, Any]] = []
    if req.response_format is not None:
        c = _response_format(req.response_format)
        if c is not None:
            found.append(("response_format", *c))
    for param, sdk in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, param)
        if value is not None:
            found.append((param, sdk, value))
    if req.structured_outputs is not None:
        found += _structured_outputs(req.structured_outputs)
    return found


def grammar_metrics(samples: list[tuple[list[str], ServerStats]], label_names: list[str]) -> Iterator[Metric]:
    """``forerun:structured_requests_total``, ``forerun:grammar_cache_hits_total``, the mask waits
    (``grammar_steps_total``, ``grammar_wait_steps_total``, ``grammar_wait_seconds_total``) and the
    ``forerun:grammar_compile_seconds`` histogram, one sample per (label values, the scheduler's ServerStats)."""
    for name, doc, field in (
            ("forerun:structured_requests", "Requests with a structured-output constraint.", "structured_requests"),
            ("forerun:grammar_cache_hits", "Constraints found compiled in the scheduler's cache.",
             "grammar_cache_hits"),
            ("forerun:grammar_steps", "Steps with a constrained row.", "grammar_steps"),
            ("forerun:grammar_wait_steps", "Steps whose sampling waited for the grammar masks.", "grammar_wait_steps"),
            ("forerun:grammar_wait_seconds", "Seconds the executor waited for grammar masks before sampling.",
             "grammar_wait_s_total")):
        c = CounterMetricFamily(name, doc, labels=label_names)
        for labels, st in samples:
            c.add_metric(labels, getattr(st, field))
        yield c
    h = HistogramMetricFamily("forerun:grammar_compile_seconds", "Seconds to compile a constraint (cache misses).",
                              labels=label_names)
    for labels, st in samples:
        counts = st.grammar_compile_buckets or [0] * (len(COMPILE_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for bound, n in zip([str(b) for b in COMPILE_BUCKETS] + ["+Inf"], counts):
            cumulative += n
            buckets.append((bound, cumulative))
        h.add_metric(labels, buckets, st.grammar_compile_s_total)
    yield h
