"""A chat prompt rendered by the gateway itself: with tools, tool calls and results (as the template takes them, or
the Hermes fallback in a system message), or with the client's ``chat_template_kwargs`` (:mod:`ipc.gateway.tools`
says which format each model's template gets)."""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Optional

from ipc.client.prompt import check_messages
from ipc.gateway import schemas as s
from ipc.gateway.tools import ToolPlan

_FALLBACK_PROMPT = (
    "You may call functions to answer. The functions you can call, as JSON schemas:\n{tools}\n"
    "To call one, answer with one <tool_call></tool_call> block per call, each holding a JSON object "
    'with the function\'s "name" and its "arguments":\n'
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>')


async def encode(gw: Any, req: s.ChatCompletionRequest, plan: Optional[ToolPlan]) -> list[int]:
    """Token ids of a conversation with tools, tool calls or tool results, with ``chat_template_kwargs``, or with
    the template's own switches (``add_generation_prompt``, ``continue_final_message``) set; the gateway's checks
    and threads."""
    tok = gw.need_tokenizer()
    kwargs = {**template_kwargs(req, tok), **turn_kwargs(req)}
    messages, tool_defs = template_messages(req, plan, getattr(tok, "chat_template", None) or "")
    check_messages(messages)
    num_chars = sum(len(str(m.get("content", ""))) for m in messages) + len(json.dumps(tool_defs or []))
    gw.check_chars(num_chars, "messages")
    return await gw.off_loop(num_chars, render, tok, messages, tool_defs, kwargs)


def uses_tools(req: s.ChatCompletionRequest) -> bool:
    """Whether the prompt needs the tool path (tools given, or a conversation with calls or results)."""
    return bool(req.tools) or any(m.tool_calls or m.role == "tool" for m in req.messages)


def renders_here(req: s.ChatCompletionRequest) -> bool:
    """Whether the prompt is rendered by :func:`encode` (tools, template variables, or the switches of
    :func:`turn_kwargs`) rather than the SDK's ``encode_prompt``, which takes none of them."""
    return (bool(req.chat_template_kwargs) or uses_tools(req) or not req.add_generation_prompt
            or req.continue_final_message)


def turn_kwargs(req: s.ChatCompletionRequest) -> dict[str, bool]:
    """vLLM's ``add_generation_prompt`` and ``continue_final_message`` for ``apply_chat_template``: the answer in a
    new assistant turn (the default), or none opened, or the last message (the assistant's) left open to continue;
    a 400 for the combinations that cannot be rendered."""
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise s.RequestError(400, "continue_final_message continues the last message: set add_generation_prompt "
                                      "to false", "continue_final_message")
        if not req.messages or req.messages[-1].role != "assistant":
            raise s.RequestError(400, "continue_final_message needs the last message to be the assistant's",
                                 "continue_final_message")
    return {"add_generation_prompt": req.add_generation_prompt,
            **({"continue_final_message": True} if req.continue_final_message else {})}


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
    client's template ``variables`` (:func:`template_kwargs`, and :func:`turn_kwargs`'s switches)."""
    kw = {"add_generation_prompt": True, **(variables or {}), **({"tools": tools} if tools else {})}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    except Exception as exc:  # jinja2 and transformers raise many types
        raise s.RequestError(400, f"the chat template failed: {type(exc).__name__}: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
