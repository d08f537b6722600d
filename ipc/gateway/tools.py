"""Tool calls on /v1/chat/completions: ``tools``, ``tool_choice``, ``parallel_tool_calls``, ``role: tool``.

This module reads the request (the tools, the choice, the constraint a forced call needs);
:mod:`ipc.gateway.chat_template` renders the prompt, :mod:`ipc.gateway.tool_calls` reads the answer.

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
  Calls found: ``message.tool_calls`` (arguments as JSON text, non-ASCII characters unescaped), ``content``
  the text before them as it is or null (text after Hermes calls is dropped, as vLLM's parser drops it),
  ``finish_reason`` ``tool_calls`` (``stop`` for a named function, as OpenAI and vLLM answer).
  A forced call cut short by max_tokens ends with ``length``, null content and the call as far as it came
  (:func:`ipc.gateway.tool_calls.finished`).
* **Checks.** Each function's ``parameters`` must be a JSON schema of an object (OpenAI's rule) that the
  grammar engine reads, whatever the tool_choice: a 400 naming ``tools[i].function.parameters``; none given:
  no parameters (a forced call is ``{}``); no ``type``: an object's (the grammar is told so too). Names follow OpenAI's rule (``[a-zA-Z0-9_-]{1,64}``), no two alike.
* **Mistral's ids.** Mistral's templates refuse a call id that is not 9 characters: in a
  conversation rendered by such a template, ids (``tool_calls[].id``, ``tool_call_id``) become the
  last 9 letters and digits of the id the client sent back.
* **Streaming** (:class:`ipc.gateway.tool_calls.ToolCallStream`): a named function's arguments stream as generated
  (``delta.tool_calls[0].function.arguments`` pieces); ``auto`` streams content until a call marker
  (or JSON at the start) and parses the rest at the end; ``required`` is parsed at the end. Calls
  found at the end go out as one ``delta.tool_calls`` chunk each (index, id, name, arguments) before
  the finish chunk: the openai client assembles the same calls as the non-streaming answer.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any, Optional

from ipc.gateway import schemas as s
from ipc.gateway.structured import check_integers, schema_message


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


# OpenAI's rule for a function's name
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
def no_parameters() -> dict[str, Any]:
    """A function without parameters takes none (OpenAI's reading): a forced call of it is {} (a new schema
    each time: the request's tools are its own to render)."""
    return {"type": "object", "properties": {}, "additionalProperties": False}


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise s.RequestError(400, 'each tool must be {"type": "function", "function": {...}}', f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise s.RequestError(400, "a function needs a name", f"tools[{i}].function.name")
        if not _NAME.fullmatch(name):
            raise s.RequestError(400, f"a function's name is 1 to 64 letters, digits, underscores and dashes; got "
                                      f"{json.dumps(name)[:80]}", f"tools[{i}].function.name")
        if any(f["name"] == name for f in out):
            raise s.RequestError(400, f"two tools are named {name!r}", f"tools[{i}].function.name")
        params = fn["parameters"] if "parameters" in fn else no_parameters()
        _check_parameters(params, f"tools[{i}].function.parameters")
        if "type" not in params:  # any object, as OpenAI reads it: said to the grammar too (else any JSON value)
            params = {"type": "object", **params}
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
        return schema_message(str(e))
    return schema_message(llguidance.LLMatcher.validate_grammar(grammar))


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
    """The SDK constraint keyword that ``required`` and a named function need (empty for auto); a 400 naming a
    constraining function's parameters that hold an integer past 64 bits (:func:`check_integers`)."""
    if not constrains(plan):
        return {}
    for i, f in enumerate(plan.functions):  # the functions in the order of the request's tools
        if plan.choice == "required" or f["name"] == plan.name:
            check_integers(f["parameters"], f"tools[{i}].function.parameters")
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
