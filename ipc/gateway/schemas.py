"""OpenAI request bodies as msgspec structs (the responses': :mod:`ipc.gateway.response_bodies`).

Requests are decoded straight from the HTTP body into these structs: a wrong
type or an unknown field is a 400 naming the field (``forbid_unknown_fields``:
a parameter is never ignored silently).

Parameters the engine does not implement are listed in :data:`UNSUPPORTED`,
with the values that mean "off" (those are accepted).  OpenAI fields that do not
change what is generated are accepted and ignored (:class:`ChatCompletionRequest`
lists them); a field no struct declares (a typo) is still a 400.  Everything
else maps to SDK sampling keywords in ``ipc/gateway/params.py``.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from ipc.client_protocol import MAX_N
from ipc.gateway.limits import MAX_PROMPTS


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    pass


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class ContentPart(_Body):
    """A part of a message's content.  Only text is read, and an assistant's ``refusal`` part (what OpenAI answers
    with and clients send back) as its text, as vLLM reads it.  The payloads of the other parts OpenAI and vLLM
    define are declared so that such a part is refused for its type, not for an unknown field."""

    type: str
    text: Optional[str] = None
    refusal: Optional[str] = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    audio_url: Any = None
    video_url: Any = None
    image_embeds: Any = None


# The payload field of each part type a message's text is read from.
_TEXT_PARTS = {"text": "text", "refusal": "refusal"}
_PAYLOADS = tuple(name for name in ContentPart.__struct_fields__ if name != "type")


class ChatMessage(_Body):
    """A message of the conversation.  ``role: developer`` is OpenAI's newer name for ``system`` (rendered as
    system, as vLLM does).  An assistant message as OpenAI returned it may carry ``refusal`` (its text stands in
    for a missing content), ``annotations`` (citations: ignored), and ``audio`` / ``function_call`` when null."""

    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # an assistant's earlier calls (ipc/gateway/chat_template.py)
    tool_call_id: Optional[str] = None  # a tool result's call
    refusal: Optional[str] = None
    annotations: Optional[list[dict[str, Any]]] = None
    audio: Optional[dict[str, Any]] = None  # an earlier audio answer: not supported (null only)
    function_call: Optional[dict[str, Any]] = None  # the deprecated form of tool_calls: not supported (null only)


class JsonSchemaFormat(_Body):
    name: str = ""
    schema: Optional[dict[str, Any]] = None
    description: Optional[str] = None
    strict: Optional[bool] = None


class ResponseFormat(_Body):
    type: str  # "text", "json_object" or "json_schema"
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsParams(_Body):
    """vLLM's ``structured_outputs`` (one of its fields)."""

    json: Union[dict[str, Any], str, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None


class _Sampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's extras included)."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None  # an end-user identifier: accepted and ignored
    # vLLM's extra parameters (``extra_body`` in the openai client)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: Optional[bool] = None
    # vLLM's detokenizing options: accepted at their defaults (UNSUPPORTED), the text forerun writes
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    # Structured outputs (ipc/gateway/structured.py): OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: Optional[ResponseFormat] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    structured_outputs: Optional[StructuredOutputsParams] = None


class CompletionRequest(_Sampling):
    # str, list[str], list[int] or list[list[int]]: msgspec takes one array type per
    # union, so the list is checked by ``prompts()``.
    prompt: Union[str, list[Any], None] = None
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    metadata: Optional[dict[str, str]] = None  # accepted and ignored, as chat's


class ChatCompletionRequest(_Sampling):
    """/v1/chat/completions.  Besides the sampling fields:

    * accepted and ignored, as they do not change what is generated here: ``store`` (OpenAI keeps nothing of
      a forerun answer), ``metadata``, ``service_tier``, ``prompt_cache_key`` (the prefix cache needs no key),
      ``safety_identifier``, and the hints of OpenAI's own models ``reasoning_effort`` and ``verbosity``;
    * accepted only with the values that ask for nothing (:data:`UNSUPPORTED`; others are a 400 naming the
      field): ``modalities`` (``["text"]``), ``audio``, ``prediction`` and ``web_search_options`` (null),
      the deprecated ``functions`` (empty) and ``function_call`` (``none``, ``auto``);
    * vLLM's ``chat_template_kwargs`` (extra variables for the chat template), ``echo`` (the answer starts
      with the last message's content when that message is the assistant's), and ``add_generation_prompt`` /
      ``continue_final_message`` (the template's: no assistant turn opened, or the last assistant message left open
      for the answer to continue).
    """

    messages: list[ChatMessage] = []
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    # Tool calls (ipc/gateway/tools.py).
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    # Accepted and ignored (see above).
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    # Accepted when off (UNSUPPORTED).
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    prediction: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Union[str, dict[str, Any], None] = None
    # vLLM's.
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: Optional[bool] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(_Body):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int]
    model: Optional[str] = None


# Parameters the engine cannot honour yet -> the values that mean "off" (accepted, as is null).
# Types are compared too: completions' ``logprobs=0`` asks for logprobs, chat's ``false`` does not.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "modalities": (["text"], []),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
}
# What a client may use instead of an unsupported parameter (the end of its 400's message).
INSTEAD: dict[str, str] = {
    "best_of": "; only 1 is (each completion is its own sample: use n)",
    "modalities": '; only ["text"] is',
    "functions": "; use tools",
    "function_call": "; use tool_choice",
    "skip_special_tokens": "; special tokens are left out of the text",
    "spaces_between_special_tokens": "",
}


def unsupported_param(req: _Sampling) -> Optional[str]:
    """The first parameter set to a value the engine does not support yet, or None."""
    for name, off in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is not None and not any(type(value) is type(v) and value == v for v in off):
            return name
    return None


class RequestError(Exception):
    """A request the gateway rejects before it reaches the scheduler: an OpenAI error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 err_type: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type
        self.code = code


def _token_ids(p: Any) -> Optional[list[int]]:
    """``p`` as token ids, or None when it is not a non-empty list of ints (bools are not ids).

    Checked in C: a 128-token prompt costs about 1 us here against 6 us item by item in Python.
    """
    try:
        ids = msgspec.convert(p, list[int], strict=True)
    except msgspec.ValidationError:  # integral floats (1.0) are ids too, as integers elsewhere in the body
        if not isinstance(p, list) or not all(type(x) is int or (type(x) is float and x.is_integer()) for x in p):
            return None
        ids = [int(x) for x in p]
    return ids or None


def prompts(req: CompletionRequest) -> list[Union[str, list[int]]]:
    """The prompt as a list of single prompts (text or token ids): one choice each."""
    p = req.prompt
    if p is None:
        raise RequestError(400, "the prompt is missing", "prompt")
    if isinstance(p, str):
        return [p]
    n = req.n or 1  # an n out of range is refused as such, later
    if p and isinstance(p[0], (str, list)) and 1 <= n <= MAX_N and len(p) * n > MAX_PROMPTS:
        raise RequestError(400, f"prompt holds {len(p)} prompts of n={n} completions; at most "
                                f"{MAX_PROMPTS} completions a request", "prompt")
    if p and isinstance(p[0], (int, float)) and (ids := _token_ids(p)) is not None:
        return [ids]
    if p and all(isinstance(s, str) for s in p):
        return list(p)
    if p and all(isinstance(s, list) for s in p):
        lists = [_token_ids(s) for s in p]
        if all(ids is not None for ids in lists):
            return lists
    raise RequestError(400, "prompt must be a string, a list of strings, a list of token ids, "
                            "or a list of lists of token ids (none empty)", "prompt")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template wants them: text parts joined a part a line (other parts refused), ``developer`` as
    ``system``, an assistant's ``refusal`` as its content when it has none."""
    if not messages:
        raise RequestError(400, "messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        for name in ("audio", "function_call"):
            if getattr(m, name) is not None:
                raise RequestError(400, f"a message's {name} is not supported by forerun"
                                        f"{'; use tool_calls' if name == 'function_call' else ''}",
                                   f"messages[{i}].{name}", code="unsupported_parameter")
        if m.refusal is not None and m.role != "assistant":
            raise RequestError(400, f"refusal is an assistant message's field, not a {m.role!r} one",
                               f"messages[{i}].refusal")
        # OpenAI's rule: only an assistant's message may lack content (its tool_calls, or a refusal, stand for it)
        if m.content is None and m.role in ("system", "developer", "user", "tool"):
            raise RequestError(400, f"a {m.role} message needs content", f"messages[{i}].content")
        content = _text(m.content, i, m.role) if isinstance(m.content, list) else m.content
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content or m.refusal or ""})
    return out


def _text(parts: list[ContentPart], i: int, role: str) -> str:
    """The text of message ``i``'s content parts, a part a line; a 400 naming the first part that is not text (a refusal
    part is text in an assistant's message only, as the message's ``refusal`` is)."""
    texts = []
    for j, part in enumerate(parts):
        where = f"messages[{i}].content[{j}]"
        field = _TEXT_PARTS.get(part.type)
        if field is None:
            raise RequestError(400, f"content part of type {part.type!r} is not supported; only text parts are",
                               f"{where}.type")
        if field == "refusal" and role != "assistant":
            raise RequestError(400, f"a refusal part belongs to an assistant message, not a {role!r} one",
                               f"{where}.type")
        other = next((name for name in _PAYLOADS if name != field and getattr(part, name) is not None), None)
        if other is not None:
            raise RequestError(400, f"a content part of type {part.type!r} holds only {field}; got {other} too",
                               f"{where}.{other}")
        text = getattr(part, field)
        if text is None:
            raise RequestError(400, f"missing required field `{field}`", f"{where}.{field}")
        texts.append(text)
    return "\n".join(texts)  # as vLLM joins them


def chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the text the answer starts with (the last message's, when it is the assistant's)."""
    last = req.messages[-1] if req.echo and req.messages else None
    if last is None or last.role != "assistant":
        return ""
    content = _text(last.content, len(req.messages) - 1, last.role) if isinstance(last.content, list) else last.content
    return content or last.refusal or ""  # as chat_messages renders it
