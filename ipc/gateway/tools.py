"""Tool calls on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``role: tool``.

* **Prompt.** The tools go into the chat template's ``tools`` variable. A template that does not
  read it (SmolLM2's) gets them in a system message instead, with the Hermes format to answer in;
  an assistant message's earlier ``tool_calls`` are then written into its content in that format,
  and ``role: tool`` results are rendered as the template renders any role.
* **tool_choice.** ``none``: no tools in the prompt, no parsing. ``auto`` (the default with tools):
  the model decides; its text is parsed for calls. ``required``: the output is constrained (a JSON
  schema, ``scheduler_proc/grammar.py``) to a list of ``{"name", "parameters"}`` calls of the given
  functions, each ``parameters`` matching its function's schema (one call when
  ``parallel_tool_calls`` is false). A named function: the output is constrained to that function's
  ``parameters`` schema, and is the call's arguments.
* **Parsing** (``auto``): Hermes / Qwen ``<tool_call>{"name", "arguments"}</tool_call>`` (several),
  Mistral ``[TOOL_CALLS][{"name", "arguments"}, ...]`` and its newer ``[TOOL_CALLS]name[ARGS]{...}``
  (repeated; ``name{...}`` once the detokenizer has dropped those special tokens), Llama 3.1+ JSON
  ``{"name", "parameters"}`` (``;``-separated, after an optional ``<|python_tag|>``); text before a
  marker is content. Only calls of the request's functions count.
  Calls found: ``message.tool_calls`` (arguments as JSON text), ``content`` the text beside them or
  null, ``finish_reason`` ``tool_calls`` (``stop`` for a named function, as OpenAI and vLLM answer).
  A forced call cut short by max_tokens ends with ``length`` and null content (:func:`finished`).
* **Checks.** Each function's ``parameters`` must be a JSON schema of an object (OpenAI's rule) that the
  grammar engine reads, whatever the tool_choice: a 400 naming ``tools[i].function.parameters``.
* **Mistral's ids.** Mistral's templates refuse a call id that is not 9 characters: in a
  conversation rendered by such a template, ids (``tool_calls[].id``, ``tool_call_id``) become the
  last 9 letters and digits of the id the client sent back.
* **Streaming** (:class:`ToolCallStream`): a named function's arguments stream as generated
  (``delta.tool_calls[0].function.arguments`` pieces); ``auto`` streams content until a call marker
  (or JSON at the start) and parses the rest at the end; ``required`` is parsed at the end. Calls
  found at the end go out as one ``delta.tool_calls`` chunk each (index, id, name, arguments) before
  the finish chunk: the openai client assembles the same calls as the non-streaming answer.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from ipc.client.prompt import check_messages
from ipc.gateway import schemas as s

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FALLBACK_PROMPT = (
    "You may call functions to answer. The functions you can call, as JSON schemas:\n{tools}\n"
    "To call one, answer with one <tool_call></tool_call> block per call, each holding a JSON object "
    'with the function\'s "name" and its "arguments":\n'
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>')


@dataclass
class ToolPlan:
    """What a chat request does with its tools."""

    functions: list[dict[str, Any]]  # each {"name", "description"?, "parameters"?}
    choice: str  # "auto", "required", or "named"
    name: Optional[str] = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise s.RequestError(400, 'each tool must be {"type": "function", "function": {...}}', f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise s.RequestError(400, "a function needs a name", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_parameters(params, f"tools[{i}].function.parameters")
        out.append({**fn, "parameters": params})
    return out


def _check_parameters(params: Any, param: str) -> None:
    """A 400 naming ``param`` unless the function's parameters are a JSON schema of an object (OpenAI's rule; no
    ``type``: any object) that the grammar engine reads: checked for every tool_choice, not only the ones whose
    output it constrains, so that a bad schema is a 400 whichever the request asks for."""
    if not isinstance(params, dict):
        raise s.RequestError(400, "parameters must be a JSON schema object", param)
    if params.get("type", "object") != "object":
        raise s.RequestError(400, f"parameters must be a JSON schema of type object, got type "
                                  f"{json.dumps(params['type'])[:64]}", param)
    try:
        text = json.dumps(params, sort_keys=True)
    except RecursionError:
        raise s.RequestError(400, "parameters nests too deeply", param) from None
    problem = _schema_problem(text) if len(text) <= MAX_CHECKED_SCHEMA_CHARS else ""
    if problem:
        raise s.RequestError(400, f"parameters is not a valid JSON schema: {problem}", param)


# Parameters longer than this are not checked by the grammar engine here (about 15 ms at this size, on the event
# loop): none that long can constrain an output (the scheduler refuses constraints over 64 KiB), and under auto
# the model only reads them.
MAX_CHECKED_SCHEMA_CHARS = 64 * 1024


@functools.lru_cache(maxsize=256)
def _schema_problem(schema: str) -> str:
    """What the grammar engine (llguidance, as the scheduler's constraints) finds wrong in a JSON schema ("": none).
    Cached by the schema's text (at most 256 x 64 KiB): an agent sends the same tools with every request."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(grammar)


def plan_tools(req: s.ChatCompletionRequest) -> Optional[ToolPlan]:
    """The request's tool plan (None: no tools in play); a 400 for malformed tools or choices."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise s.RequestError(400, "tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(req.tools)
    parallel = req.parallel_tool_calls is not False
    if req.echo and choice != "none":
        raise s.RequestError(400, "echo cannot be combined with tools", "echo")
    if choice is None or choice == "auto":
        return ToolPlan(functions, "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolPlan(functions, "required", parallel=parallel)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise s.RequestError(400, 'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                                 "tool_choice")
        if name not in [f["name"] for f in functions]:
            raise s.RequestError(400, f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return ToolPlan(functions, "named", name=name, parallel=parallel)
    raise s.RequestError(400, f"tool_choice must be none, auto, required or a function; got {choice!r}", "tool_choice")


def constrains(plan: Optional[ToolPlan]) -> bool:
    """Whether the tool choice constrains the output (``required``, a named function): not for none or auto."""
    return plan is not None and plan.choice != "auto"


def constraint(plan: Optional[ToolPlan]) -> dict[str, Any]:
    """The SDK constraint keyword that ``required`` and a named function need (empty for auto)."""
    if not constrains(plan):
        return {}
    if plan.choice == "named":
        fn = next(f for f in plan.functions if f["name"] == plan.name)
        return {"json_schema": fn["parameters"]}
    defs: dict[str, Any] = {}
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "parameters": _hoisted(f["parameters"], f"f{i}", defs)},
              "required": ["name", "parameters"], "additionalProperties": False} for i, f in enumerate(plan.functions)]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return {"json_schema": schema}


def _hoisted(params: dict[str, Any], name: str, defs: dict[str, Any]) -> dict[str, Any]:
    """A function's ``parameters`` inside the ``required`` schema: its ``$defs`` / ``definitions`` (pydantic's
    nested models) move to the root's ``$defs`` as ``{name}_{def}``, its local ``$ref``s follow them, and a
    ``#`` (the parameters themselves, recursively) becomes ``#/$defs/{name}``, as any other pointer into them
    (``#/properties/a``) becomes one under it: the parameters are then held there too."""
    local = ("#/$defs/", "#/definitions/")
    recursive = False

    def ref(value: str) -> str:
        nonlocal recursive
        if value == "#" or (value.startswith("#/") and not value.startswith(local)):
            recursive = True
            return f"#/$defs/{name}" + value[1:]
        prefix = next((p for p in local if value.startswith(p)), None)
        return value if prefix is None else f"#/$defs/{name}_{value[len(prefix):]}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: ref(v) if k == "$ref" and isinstance(v, str) else rewrite(v) for k, v in node.items()}
        return [rewrite(v) for v in node] if isinstance(node, list) else node

    for key in ("$defs", "definitions"):
        for def_name, value in (params.get(key) or {}).items():
            defs[f"{name}_{def_name}"] = rewrite(value)
    body = rewrite({k: v for k, v in params.items() if k not in ("$defs", "definitions")})
    if recursive:
        defs[name] = body
        return {"$ref": f"#/$defs/{name}"}
    return body


def with_constraint(kw: dict[str, Any], plan: Optional[ToolPlan]) -> dict[str, Any]:
    """The request's sampling keywords with the constraint its tool_choice needs (a 400 beside another one)."""
    extra = constraint(plan)
    if extra and any(k in kw for k in ("json_schema", "regex", "choice", "grammar")):
        raise s.RequestError(400, f"tool_choice {plan.choice} constrains the output; it cannot be combined with "
                                  "response_format or guided decoding", "tool_choice")
    return {**kw, **extra}


async def encode(gw: Any, req: s.ChatCompletionRequest, plan: Optional[ToolPlan]) -> list[int]:
    """Token ids of a conversation with tools, tool calls or tool results, or with ``chat_template_kwargs``
    (the gateway's checks and threads)."""
    tok = gw.need_tokenizer()
    kwargs = template_kwargs(req, tok)
    messages, tool_defs = template_messages(req, plan, getattr(tok, "chat_template", None) or "")
    check_messages(messages)
    num_chars = sum(len(str(m.get("content", ""))) for m in messages) + len(json.dumps(tool_defs or []))
    gw.check_chars(num_chars, "messages")
    return await gw.off_loop(num_chars, render, tok, messages, tool_defs, kwargs)


def uses_tools(req: s.ChatCompletionRequest) -> bool:
    """Whether the prompt needs the tool path (tools given, or a conversation with calls or results)."""
    return bool(req.tools) or any(m.tool_calls or m.role == "tool" for m in req.messages)


def renders_here(req: s.ChatCompletionRequest) -> bool:
    """Whether the prompt is rendered by :func:`encode` (tools, or template variables) rather than the SDK's
    ``encode_prompt``, which takes neither."""
    return bool(req.chat_template_kwargs) or uses_tools(req)


# What apply_chat_template takes itself (beside its own signature's names): never a template variable of the client's.
_TEMPLATE_OWN = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"))


def template_kwargs(req: s.ChatCompletionRequest, tokenizer: Any) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: variables for the chat template (``enable_thinking``, ...).  A name that
    apply_chat_template takes itself (``tokenize``, ``add_generation_prompt``, ``tools``, ...) is a 400: the
    gateway sets those."""
    kwargs = req.chat_template_kwargs or {}
    taken = _TEMPLATE_OWN | _parameters(type(tokenizer))
    for name, value in kwargs.items():
        if name in taken:
            raise s.RequestError(400, f"chat_template_kwargs cannot set {name[:64]!r}: the server sets it",
                                 f"chat_template_kwargs.{name[:64]}")
        if _nests_past(value, MAX_TEMPLATE_NESTING):  # the template engine recurses through a value it reads
            raise s.RequestError(400, f"chat_template_kwargs.{name[:64]} nests deeper than {MAX_TEMPLATE_NESTING} "
                                      "levels of arrays or objects", f"chat_template_kwargs.{name[:64]}")
    return kwargs


MAX_TEMPLATE_NESTING = 64


def _nests_past(value: Any, limit: int) -> bool:
    """Whether ``value`` holds arrays or objects more than ``limit`` levels deep (no recursion of its own)."""
    level = [value]
    for _ in range(limit + 1):
        level = [v for x in level if isinstance(x, (list, dict)) for v in (x.values() if isinstance(x, dict) else x)]
        if not level:
            return False
    return True


@functools.lru_cache(maxsize=8)
def _parameters(cls: type) -> frozenset:
    """The named parameters of a tokenizer class's apply_chat_template."""
    try:
        params = inspect.signature(cls.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _arguments(call: dict[str, Any]) -> Any:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def template_messages(req: s.ChatCompletionRequest, plan: Optional[ToolPlan],
                      template: str) -> tuple[list[dict[str, Any]], Optional[list[dict[str, Any]]]]:
    """(messages, tools) for ``apply_chat_template``: as the template wants them, or the Hermes fallback."""
    messages = s.chat_messages(req.messages)
    native = "tool" in template  # the template reads tools / tool_calls itself
    call_id = _mistral_id if "[TOOL_CALLS]" in template else (lambda i: i)
    tools = [{"type": "function", "function": f} for f in plan.functions] if plan is not None else None
    for m, src in zip(messages, req.messages):
        if src.tool_calls:
            calls = [{"name": (c.get("function") or {}).get("name", ""), "arguments": _arguments(c)}
                     for c in src.tool_calls]
            if native:
                m["tool_calls"] = [{"type": "function", "id": call_id(c.get("id", "")),
                                    "function": {"name": k["name"], "arguments": k["arguments"]}}
                                   for c, k in zip(src.tool_calls, calls)]
            else:
                text = "\n".join(f"<tool_call>\n{json.dumps(k)}\n</tool_call>" for k in calls)
                m["content"] = (m["content"] + "\n" + text).strip()
        if src.tool_call_id is not None:
            m["tool_call_id"] = call_id(src.tool_call_id)
    if tools and not native:
        listing = "\n".join(json.dumps(f) for f in plan.functions)
        system = _FALLBACK_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = messages[0]["content"] + "\n\n" + system
        else:
            messages.insert(0, {"role": "system", "content": system})
        tools = None
    return messages, tools


def _mistral_id(call_id: Any) -> str:
    """A call id as Mistral's templates require: 9 letters and digits (the id's last ones, zero-padded)."""
    return "".join(ch for ch in str(call_id or "") if ch.isascii() and ch.isalnum())[-9:].rjust(9, "0")


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Optional[list[dict[str, Any]]],
           variables: Optional[dict[str, Any]] = None) -> list[int]:
    """Token ids of the conversation through the chat template, with ``tools`` when it reads them and the
    client's template ``variables`` (:func:`template_kwargs`)."""
    kw = {**(variables or {}), **({"tools": tools} if tools else {})}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    except Exception as exc:  # jinja2 and transformers raise many types
        raise s.RequestError(400, f"the chat template failed: {type(exc).__name__}: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _call_of(obj: Any, names: list[str]) -> Optional[tuple[str, str]]:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)


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
        calls.append((name, json.dumps(args)))


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
    """(content beside the calls or None, [(name, arguments JSON)]) of a finished output."""
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
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    calls = _json_calls(text, plan.names)
    if calls:
        return None, calls
    cut = min((i for i in (text.find(m) for m in _MARKERS[1:]) if i > 0), default=-1)
    if cut > 0:  # content, then a Mistral or Llama call marker (what the stream holds back and parses)
        calls = _json_calls(text[cut:], plan.names)
        if calls:
            return text[:cut].strip() or None, calls
    return text, []


def _tool_calls(calls: list[tuple[str, str]], plan: ToolPlan) -> list[s.ToolCall]:
    calls = calls if plan.parallel else calls[:1]
    return [s.ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=s.ToolCallFunction(name, args))
            for name, args in calls]


def choice_message(text: str, finish: str, plan: Optional[ToolPlan]) -> tuple[Any, str]:
    """(message, finish_reason) of one finished choice: its tool calls when it made any."""
    if plan is None:
        return s.AssistantMessage(content=text), finish
    content, calls, finish = finished(text, finish, plan)
    if not calls:
        return s.AssistantMessage(content=content), finish
    return s.ToolCallsMessage(tool_calls=_tool_calls(calls, plan), content=content), finish


def finished(text: str, finish: str, plan: ToolPlan) -> tuple[Optional[str], list[tuple[str, str]], str]:
    """(content, calls, finish_reason) of one choice's whole output.

    Calls end with ``tool_calls``, but a named function's with ``stop``, as OpenAI's and vLLM's do.  A forced call
    (``required``, a named function) cut short (max_tokens: ``length``; a stop string or token: ``stop``) has null
    content, never its JSON as text: a named function's call with the arguments as far as they came (what a stream
    has sent, and what OpenAI answers), ``required``'s with the calls of its list that are whole (none: no
    ``tool_calls``)."""
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


def _whole_calls(text: str, names: list[str]) -> list[tuple[str, str]]:
    """The calls of a ``required`` list (``[{"name", "parameters"}, ...``) that was cut short: its whole items."""
    decoder, calls = json.JSONDecoder(), []
    at = _skip_space(text, 0)
    if not text.startswith("[", at):
        return []
    at += 1
    while True:
        try:
            obj, at = decoder.raw_decode(text, _skip_space(text, at))
        except ValueError:
            return calls
        call = _call_of(obj, names)
        if call is None:
            return calls
        calls.append(call)
        at = _skip_space(text, at)
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

    def feed(self, delta: str) -> list[s.Delta]:
        self.text += delta
        if not delta:
            return []
        if self.plan.choice == "named":
            first, self.call_id = self.call_id is None, self.call_id or f"call_{uuid.uuid4().hex[:24]}"
            fn = {"name": self.plan.name, "arguments": delta} if first else {"arguments": delta}
            return [s.Delta(tool_calls=[s.ToolCallDelta(index=0, id=self.call_id if first else None,
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

    def _content(self, text: str) -> list[s.Delta]:
        self.sent += len(text)
        return [s.Delta(content=text)] if text else []

    def finish(self, finish_reason: str) -> tuple[list[s.Delta], str]:
        """The last deltas of the choice and its finish reason (as :func:`finished` gives them)."""
        if self.plan.choice == "named":  # its arguments went out as they came
            return [], finished(self.text, finish_reason, self.plan)[2]
        rest = self.text[self.sent:]
        if not self.holding:
            return self._content(rest), finish_reason
        content, calls, finish_reason = finished(rest, finish_reason, self.plan)
        out = self._content(content or "")
        out += [s.Delta(tool_calls=[s.ToolCallDelta(index=i, id=c.id, type="function", function={
                    "name": c.function.name, "arguments": c.function.arguments})])
                for i, c in enumerate(_tool_calls(calls, self.plan))]
        return out, finish_reason
