"""Tool calls in a model's answer: parsed from its text, whole (:func:`choice_message`) or streamed
(:class:`ToolCallStream`), in the formats :mod:`ipc.gateway.tools` lists."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Optional

from ipc.gateway import response_bodies as rb
from ipc.gateway.tools import ToolPlan, constrains

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def _call_of(obj: Any, names: list[str]) -> Optional[tuple[str, str]]:
    """(name, arguments JSON) of a parsed call of one of ``names``; None if it is not one (arguments that are
    not a JSON object, or text that does not read as one: the output is then content)."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments as JSON text, as some models write them
        try:
            return (obj["name"], args) if isinstance(json.loads(args), dict) else None
        except ValueError:
            return None
    return (obj["name"], _arguments(args)) if isinstance(args, dict) else None


def _arguments(args: dict[str, Any]) -> str:
    """A call's arguments as JSON text, non-ASCII characters as they are (not ``\\u`` escapes), as vLLM writes
    them."""
    return json.dumps(args, ensure_ascii=False)


def _named_json_calls(text: str, names: list[str]) -> list[tuple[str, str]]:
    """Mistral's ``[TOOL_CALLS]name[ARGS]{...}`` calls (one or more), also as ``name{...}`` once the detokenizer
    has dropped its special tokens; [] if the text is not all calls of the request's functions."""
    text = text.replace("[TOOL_CALLS]", " ").replace("[ARGS]", "")
    decoder, calls, at = json.JSONDecoder(), [], 0
    by_length = sorted(names, key=len, reverse=True)
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return calls
        name = next((n for n in by_length if text.startswith(n, at)), None)
        if name is None:
            return []
        at += len(name)
        while at < len(text) and text[at].isspace():
            at += 1
        try:
            args, at = decoder.raw_decode(text, at)
        except ValueError:
            return []
        if not isinstance(args, dict):
            return []
        calls.append((name, _arguments(args)))


def _may_be_named_call(head: str, names: list[str]) -> bool:
    """Whether an answer that begins with ``head`` may be ``name{...}`` calls (a stream holds it back)."""
    return any(n.startswith(head) or (head.startswith(n) and head[len(n):].lstrip()[:1] in ("", "{")) for n in names)


def _json_calls(text: str, names: list[str]) -> list[tuple[str, str]]:
    """Mistral's list or its ``name[ARGS]`` calls, a Llama JSON call or several ``;``-separated ones;
    [] if the text is not all calls."""
    text = text.strip().removeprefix("<|python_tag|>").strip()
    if "[ARGS]" in text or (text[:1] not in ("[", "{", "") and not text.startswith("[TOOL_CALLS]")):
        return _named_json_calls(text, names)
    text = text.removeprefix("[TOOL_CALLS]").strip()
    if not text or text[0] not in "[{":
        return []
    try:
        objs = json.loads(text)
        objs = objs if isinstance(objs, list) else [objs]
    except ValueError:
        try:
            objs = [json.loads(part) for part in text.split(";") if part.strip()]
        except ValueError:
            return []
    calls = [_call_of(o, names) for o in objs]
    return calls if calls and all(c is not None for c in calls) else []


def parse_calls(text: str, plan: ToolPlan) -> tuple[Optional[str], list[tuple[str, str]]]:
    """(content or None, [(name, arguments JSON)]) of a finished output.  Beside calls, the content is the text
    before the first one as it is, unstripped (vLLM's parsers' content, and what a stream sends before the call
    marker); text after Hermes calls is dropped, as vLLM drops it."""
    if plan.choice == "named":
        try:
            json.loads(text)
        except ValueError:
            return text, []
        return None, [(plan.name, text)]
    if plan.choice == "required":
        return (None, _json_calls(text, plan.names)) if _json_calls(text, plan.names) else (text, [])
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = _call_of(json.loads(body), plan.names)
        except ValueError:
            call = None
        if call is not None:
            calls.append(call)
    if calls:
        return text[:text.find("<tool_call>")] or None, calls
    calls = _json_calls(text, plan.names)
    if calls:
        return None, calls
    cut = min((i for i in (text.find(m) for m in _MARKERS[1:]) if i > 0), default=-1)
    if cut > 0:  # content, then a Mistral or Llama call marker (what the stream holds back and parses)
        calls = _json_calls(text[cut:], plan.names)
        if calls:
            return text[:cut] or None, calls
    return text, []


def _tool_calls(calls: list[tuple[str, str]], plan: ToolPlan) -> list[rb.ToolCall]:
    calls = calls if plan.parallel else calls[:1]
    return [rb.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=rb.ToolCallFunction(name, args))
            for name, args in calls]


def choice_message(text: str, finish: str, plan: Optional[ToolPlan]) -> tuple[Any, str]:
    """(message, finish_reason) of one finished choice: its tool calls when it made any."""
    if plan is None:
        return rb.AssistantMessage(content=text), finish
    content, calls, finish = finished(text, finish, plan)
    if not calls:
        return rb.AssistantMessage(content=content), finish
    return rb.ToolCallsMessage(tool_calls=_tool_calls(calls, plan), content=content), finish


def finished(text: str, finish: str, plan: ToolPlan) -> tuple[Optional[str], list[tuple[str, str]], str]:
    """(content, calls, finish_reason) of one choice's whole output.

    Calls end with ``tool_calls``, but a named function's with ``stop``, as OpenAI's and vLLM's do.  A forced call
    (``required``, a named function) cut short (max_tokens: ``length``; a stop string or token: ``stop``) has null
    content, never its JSON as text: a named function's call with the arguments as far as they came (what a stream
    has sent, and what OpenAI answers), ``required``'s with the calls of its list that are whole and the one cut
    short once its name is out, its arguments as far as they came (no name yet: no ``tool_calls``)."""
    if finish not in ("stop", "length"):
        return text, [], finish
    content, calls = parse_calls(text, plan)
    if calls:
        return content, calls, "stop" if plan.choice == "named" else "tool_calls"
    if constrains(plan):  # cut short: by max_tokens, a stop string or a stop token
        if plan.choice == "named":
            return None, [(plan.name, text)] if text else [], finish
        return None, _whole_calls(text, plan.names), finish
    return text, [], finish


# The head of a ``required`` list's item up to its parameters (the constraint writes its properties in this order)
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"parameters"\s*:\s*')


def _whole_calls(text: str, names: list[str]) -> list[tuple[str, str]]:
    """The calls of a ``required`` list (``[{"name", "parameters"}, ...``) that was cut short: its whole items,
    then the one cut short if its name is out (its parameters as far as they came)."""
    decoder, calls = json.JSONDecoder(), []
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return []
    at += 1
    while True:
        at = _skip_space(text, at)
        try:
            obj, end = decoder.raw_decode(text, at)
        except ValueError:
            head = _CALL_HEAD.match(text, at)
            return calls + [(head[1], text[head.end():])] if head and head[1] in names else calls
        call = _call_of(obj, names)
        if call is None:
            return calls
        calls.append(call)
        at = _skip_space(text, end)
        if not text.startswith(",", at):
            return calls
        at += 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def _held_tail(text: str) -> int:
    """Characters at the end of ``text`` that may begin a call marker (held back until the next delta)."""
    for n in range(min(len(text), max(map(len, _MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in _MARKERS):
            return n
    return 0


class ToolCallStream:
    """One choice of a streamed answer with tools, as ``delta`` objects while its text arrives.

    A named function's arguments stream as they are generated (the output is the arguments).
    ``auto`` streams content while the text cannot be a call; from a call marker (or a first
    character that opens JSON) on, the rest waits for the end and is parsed then, like the
    non-streaming answer. ``required`` output is parsed at the end.
    """

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of ``text`` sent as content
        self.holding = plan.choice == "required"  # the rest is parsed at the end
        self.call_id: Optional[str] = None

    def feed(self, delta: str) -> list[rb.Delta]:
        self.text += delta
        if not delta:
            return []
        if self.plan.choice == "named":
            first, self.call_id = self.call_id is None, self.call_id or f"call_{uuid.uuid4().hex[:24]}"
            fn = {"name": self.plan.name, "arguments": delta} if first else {"arguments": delta}
            return [rb.Delta(tool_calls=[rb.ToolCallDelta(index=0, id=self.call_id if first else None,
                                                        type="function" if first else None, function=fn)])]
        if self.holding:
            return []
        pending = self.text[self.sent:]
        head = pending.lstrip()
        if not self.text[:self.sent].strip() and head:
            if head[0] in "{[":
                self.holding = True  # a JSON call (Llama, Mistral) may be coming
                return []
            if _may_be_named_call(head, self.plan.names):  # Mistral's name{...} (its markers dropped)
                self.holding = any(head.startswith(n) and head[len(n):].lstrip()[:1] == "{" for n in self.plan.names)
                return []
        cut = min((i for i in (pending.find(m) for m in _MARKERS) if i >= 0), default=-1)
        if cut >= 0:
            self.holding = True
        else:
            cut = len(pending) - _held_tail(pending)
        return self._content(pending[:cut])

    def _content(self, text: str) -> list[rb.Delta]:
        self.sent += len(text)
        return [rb.Delta(content=text)] if text else []

    def finish(self, finish_reason: str) -> tuple[list[rb.Delta], str]:
        """The last deltas of the choice and its finish reason (as :func:`finished` gives them)."""
        if self.plan.choice == "named":  # its arguments went out as they came
            return [], finished(self.text, finish_reason, self.plan)[2]
        rest = self.text[self.sent:]
        if not self.holding:
            return self._content(rest), finish_reason
        content, calls, finish_reason = finished(rest, finish_reason, self.plan)
        out = self._content(content or "")
        out += [rb.Delta(tool_calls=[rb.ToolCallDelta(index=i, id=c.id, type="function", function={
                    "name": c.function.name, "arguments": c.function.arguments})])
                for i, c in enumerate(_tool_calls(calls, self.plan))]
        return out, finish_reason
