"""OpenAI's response bodies as msgspec structs (the requests': :mod:`ipc.gateway.schemas`).

Encoded with ``msgspec.json``; fields that OpenAI sends as ``null`` are kept (no ``omit_defaults``, but for the
streamed deltas) because some clients read them.
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec

from ipc.gateway.logprobs import ChatLogprobs, CompletionLogprobs


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# vLLM's ``stop_reason``: the stop string, or the token of ``stop_token_ids``, that ended a choice (else null)
StopReason = Optional[Union[int, str]]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: Optional[str] = None
    logprobs: Optional[CompletionLogprobs] = None
    prompt_logprobs: Optional[list] = None  # vLLM's shape, see ipc/gateway/logprobs.py
    stop_reason: StopReason = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    object: str = "text_completion"


class AssistantMessage(msgspec.Struct):
    content: Optional[str]  # null: a forced tool call cut short (ipc/gateway/tool_calls.py)
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: Union[AssistantMessage, ToolCallsMessage]
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None
    stop_reason: StopReason = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: Optional[list] = None  # vLLM's shape, see ipc/gateway/logprobs.py


class ToolCallFunction(msgspec.Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct):
    id: str
    function: ToolCallFunction
    type: str = "function"


class ToolCallsMessage(msgspec.Struct):
    """An assistant message that calls tools (``content``: any text beside the calls, else null)."""

    tool_calls: list[ToolCall]
    content: Optional[str] = None
    role: str = "assistant"


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: Optional[str] = None
    type: Optional[str] = None
    function: Optional[dict[str, str]] = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: Optional[str] = None
    logprobs: Optional[ChatLogprobs] = None
    stop_reason: StopReason = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    object: str = "chat.completion.chunk"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "forerun"
    max_model_len: Optional[int] = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
