"""OpenAI and vLLM compatibility of the gateway: the fields clients send, tool calls cut short, error messages,
abort metrics, /v1/models/{id}, the API key's messages and stalled request bodies.

Most checks run without a server (the gateway's functions, fake SDK streams); the last ones drive one
scripted-executor server through a gateway of its own, started with a 1 s body timeout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import msgspec
import openai
import pytest
from starlette.requests import Request

from ipc.gateway import handling, params, responses
from ipc.gateway import schemas as s
from ipc.gateway.body import read_body
from ipc.gateway.process import start_gateways
from ipc.gateway.streaming import ClientGone
from ipc.gateway.chat_template import render, template_kwargs
from ipc.gateway.tool_calls import ToolCallStream, choice_message
from ipc.gateway.tools import ToolPlan, plan_tools, with_constraint
from ipc.gateway.worker import decode_body
from tests.server_proc import run_dir
from tests.test_gateway_params import FakeGateway, FakeStream, choice, request_result
from tests.test_client_unit import tokenizer, tokenizer_dir  # noqa: F401 (fixtures)
from tests.test_openai_server import free_port, http, metric_values

USER = [{"role": "user", "content": "x"}]
FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}]


def chat(body: dict) -> s.ChatCompletionRequest:
    """The request as the gateway decodes it (RequestError as the route answers it)."""
    return decode_body(json.dumps({"messages": USER, **body}).encode(), s.ChatCompletionRequest)


def refused(fn, *args) -> s.RequestError:
    with pytest.raises(s.RequestError) as e:
        fn(*args)
    return e.value


# ---------------------------------------------------------------------------
# 1. the fields OpenAI's and vLLM's clients send
# ---------------------------------------------------------------------------

IGNORED = {"store": True, "metadata": {"k": "v"}, "service_tier": "auto", "reasoning_effort": "low",
           "verbosity": "low", "prompt_cache_key": "p", "safety_identifier": "u", "modalities": ["text"],
           "audio": None, "prediction": None, "web_search_options": None, "functions": [], "function_call": "auto",
           "chat_template_kwargs": {}, "echo": False, "skip_special_tokens": True,
           "spaces_between_special_tokens": True}


def test_standard_fields_are_accepted_and_saved_answers_replay():
    """What OpenAI's own answers hold (refusal, annotations, audio and function_call as null) goes back in as
    history; ``developer`` is rendered as system; fields that change nothing here are ignored."""
    saved = {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}
    req = chat({**IGNORED, "messages": [{"role": "developer", "content": "Be brief."}, USER[0], saved,
                                        {"role": "assistant", "content": None, "refusal": "I can't."}]})
    assert s.unsupported_param(req) is None
    assert s.chat_messages(req.messages) == [{"role": "system", "content": "Be brief."}, USER[0],
                                             {"role": "assistant", "content": "Paris."},
                                             {"role": "assistant", "content": "I can't."}]
    completion = decode_body(json.dumps({"prompt": "x", "metadata": {"k": "v"}, "skip_special_tokens": True}).encode(),
                             s.CompletionRequest)  # completions take vLLM's fields and OpenAI's metadata too
    assert s.unsupported_param(completion) is None
    assert refused(chat, {"temperatur": 1}).param == "temperatur"  # a typo is still a 400 naming it
    assert refused(chat, {"messages": [{**saved, "refusl": None}]}).param == "messages[0].refusl"


@pytest.mark.parametrize("field,value", [("modalities", ["text", "audio"]), ("audio", {"voice": "alloy"}),
                                         ("prediction", {"type": "content", "content": "x"}),
                                         ("web_search_options", {}), ("functions", [{"name": "f"}]),
                                         ("function_call", {"name": "f"}), ("skip_special_tokens", False),
                                         ("spaces_between_special_tokens", False)])
def test_fields_that_would_change_the_answer_are_400_naming_them(field, value):
    assert s.unsupported_param(chat({field: value})) == field
    with pytest.raises(s.RequestError) as e:
        s.chat_messages(chat({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}).messages)
    assert e.value.param == "messages[0].audio" and "not supported" in e.value.message


def test_chat_template_kwargs_reach_the_template_and_cannot_set_its_own_arguments(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # its own: the session's is shared
    tokenizer.chat_template = ("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
                               "{% if enable_thinking %}<think>{% endif %}")
    req = chat({"chat_template_kwargs": {"enable_thinking": True}})
    ids = render(tokenizer, s.chat_messages(req.messages), None, template_kwargs(req, tokenizer))
    assert tokenizer.decode(ids) == "user:x;<think>"
    for name in ("tokenize", "add_generation_prompt", "messages", "tools"):
        e = refused(template_kwargs, chat({"chat_template_kwargs": {name: True}}), tokenizer)
        assert e.param == f"chat_template_kwargs.{name}"


async def test_chat_echo_leads_the_answer(tokenizer):
    """vLLM's echo: the last message's content leads the answer when it is the assistant's (role event too)."""
    req = chat({"messages": [USER[0], {"role": "assistant", "content": "Once upon"}], "echo": True})
    assert s.chat_echo(req) == "Once upon" and s.chat_echo(chat({"echo": True})) == ""
    r = request_result([choice(0, " a time", [5], None)])
    whole = await responses.whole_chat(FakeGateway(tokenizer), req, "c", responses.Prompt([1], ""), FakeStream([], r))
    assert whole.choices[0].message.content == "Once upon a time"
    events = [e async for e in responses.chat_stream(FakeGateway(tokenizer), msgspec.structs.replace(req, stream=True),
                                                     "c", [FakeStream([], r)], [None])]
    assert b'"role":"assistant","content":"Once upon"' in events[0]
    assert refused(plan_tools, chat({"echo": True, "tools": [{"type": "function", "function": FUNCTIONS[0]}]})
                   ).param == "echo"
    from ipc.gateway.structured import constraint_kwargs

    assert refused(constraint_kwargs, msgspec.structs.replace(req, response_format=s.ResponseFormat("json_object"))
                   ).param == "echo"  # the echoed text would not be JSON
    refusal = chat({"messages": [USER[0], {"role": "assistant", "content": None, "refusal": "No."}], "echo": True})
    assert s.chat_echo(refusal) == "No."  # the text the prompt holds for that message
    assert refused(s.chat_messages, [s.ChatMessage("user", None, refusal="hi")]).param == "messages[0].refusal"


# ---------------------------------------------------------------------------
# 2. tools
# ---------------------------------------------------------------------------

REQUIRED, NAMED = ToolPlan(FUNCTIONS, "required"), ToolPlan(FUNCTIONS, "named", name="get_time")


def test_forced_calls_cut_short_are_never_content():
    """``required`` cut short: its whole calls and the one cut short once its name is out (as far as it came),
    null content; named: the call as far as it came."""
    message, finish = choice_message('[{"name": "get_weather", "parameters": {"ci', "length", REQUIRED)
    assert (message.content, finish) == (None, "length")
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", '{"ci')]
    message, finish = choice_message('[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"na', "length", REQUIRED)
    assert finish == "length" and message.content is None
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_time", '{"zone": "UTC"}')]
    message, finish = choice_message('[{"name": "get_wea', "length", REQUIRED)  # no name yet: no call
    assert (message.content, finish) == (None, "length") and not hasattr(message, "tool_calls")
    message, finish = choice_message('{"zone": "U', "length", NAMED)
    assert finish == "length" and message.content is None and message.tool_calls[0].function.arguments == '{"zone": "U'
    stream = ToolCallStream(REQUIRED)
    stream.feed('[{"name": "get_weather", "par')
    deltas, finish = stream.finish("length")
    assert finish == "length" and not any(d.content for d in deltas) and not any(d.tool_calls for d in deltas)


def test_forced_calls_cut_by_a_stop_string_are_never_content_either():
    """A stop string or stop token that ends a forced call mid-JSON (finish "stop"): as a cut by max_tokens."""
    message, finish = choice_message('[{"name": "get_weather", "parameters": {"', "stop", REQUIRED)
    assert (message.content, finish) == (None, "stop") and message.tool_calls[0].function.arguments == '{"'
    message, finish = choice_message('{"', "stop", NAMED)
    assert message.content is None and message.tool_calls[0].function.arguments == '{"'
    stream = ToolCallStream(REQUIRED)
    stream.feed('[{"name": "get_weather", "parameters": {"')
    deltas, finish = stream.finish("stop")
    assert finish == "stop" and not any(d.content for d in deltas)


def test_continue_final_message_and_no_generation_prompt(tokenizer):
    """vLLM's template switches: the last assistant message left open, or no assistant turn opened; the
    combinations that cannot be rendered are 400s naming continue_final_message."""
    from ipc.gateway.chat_template import renders_here, turn_kwargs

    turns = [USER[0], {"role": "assistant", "content": "The capital of France is"}]
    plain = chat({"messages": turns})
    assert not renders_here(plain) and turn_kwargs(plain) == {"add_generation_prompt": True}
    go_on = chat({"messages": turns, "continue_final_message": True, "add_generation_prompt": False})
    assert renders_here(go_on)
    text = tokenizer.decode(render(tokenizer, s.chat_messages(go_on.messages), None, turn_kwargs(go_on)))
    assert text.endswith("The capital of France is"), text
    closed = chat({"messages": USER, "add_generation_prompt": False})
    assert renders_here(closed)
    text = tokenizer.decode(render(tokenizer, s.chat_messages(closed.messages), None, turn_kwargs(closed)))
    opened = tokenizer.decode(render(tokenizer, s.chat_messages(closed.messages), None, None))
    assert opened.startswith(text) and len(opened) > len(text) and "assistant" in opened[len(text):]
    assert refused(turn_kwargs, chat({"messages": turns, "continue_final_message": True})
                   ).param == "continue_final_message"  # add_generation_prompt left true
    assert refused(turn_kwargs, chat({"continue_final_message": True, "add_generation_prompt": False})
                   ).param == "continue_final_message"  # the last message is the user's


def test_tools_follow_openai_naming_and_a_function_without_parameters_takes_none():
    def tools(*fns):
        return chat({"tools": [{"type": "function", "function": f} for f in fns]})

    assert refused(plan_tools, tools({"name": "bad name!"})).param == "tools[0].function.name"
    assert refused(plan_tools, tools({"name": "x" * 65})).param == "tools[0].function.name"
    assert refused(plan_tools, tools(FUNCTIONS[0], FUNCTIONS[1], FUNCTIONS[0])).param == "tools[2].function.name"
    plan = plan_tools(msgspec.structs.replace(tools({"name": "no_args-1"}),
                                              tool_choice={"type": "function", "function": {"name": "no_args-1"}}))
    from ipc.gateway.tools import constraint

    assert constraint(plan) == {"json_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    # parameters without a type are an object's (OpenAI's reading), for the grammar too: with {} or an anyOf of
    # non-objects a forced call's arguments were a bare number
    for params in ({}, {"description": "anything"}, {"anyOf": [{"type": "object"}, {"type": "integer"}]}):
        named = msgspec.structs.replace(tools({"name": "f", "parameters": params}),
                                        tool_choice={"type": "function", "function": {"name": "f"}})
        assert constraint(plan_tools(named)) == {"json_schema": {"type": "object", **params}}


def test_auto_calls_whose_arguments_are_not_a_json_object_are_content():
    auto = ToolPlan(FUNCTIONS, "auto")
    for args in ('"{not json"', '"[1, 2]"', "[1]"):
        text = f'<tool_call>{{"name": "get_time", "arguments": {args}}}</tool_call>'
        message, finish = choice_message(text, "stop", auto)
        assert (message.content, finish) == (text, "stop") and not hasattr(message, "tool_calls"), args
    message, _ = choice_message('<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>',
                                "stop", auto)  # JSON text of an object: the arguments as they are
    assert message.tool_calls[0].function.arguments == '{"zone": "UTC"}'


def test_constraint_errors_name_the_field_sent_and_choices_have_a_limit():
    from ipc.client import InvalidRequestError
    from ipc.gateway.structured import MAX_CHOICES, constraint_kwargs, constraint_param

    bad = InvalidRequestError("invalid_request", "sampling.json_schema", "not a schema")
    for body, param in (({"guided_json": {"type": "nope"}}, "guided_json"),
                        ({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json")):
        assert constraint_param(chat(body)) == param
        response = handling.error_for(FakeGateway(None), bad, constraint_param(chat(body)))
        assert json.loads(response.body)["error"]["param"] == param
    assert constraint_param(chat({})) is None
    assert constraint_kwargs(chat({"guided_choice": ["a"] * MAX_CHOICES})) == {"choice": ["a"] * MAX_CHOICES}
    error = refused(constraint_kwargs, chat({"guided_choice": ["a"] * (MAX_CHOICES + 1)}))
    assert error.param == "guided_choice" and str(MAX_CHOICES) in error.message


def test_messages_other_than_an_assistants_need_content():
    for role in ("user", "system", "tool"):
        assert refused(s.chat_messages, [s.ChatMessage(role, None)]).param == "messages[0].content"
    assert s.chat_messages([s.ChatMessage("user", "hi"), s.ChatMessage("assistant", None, tool_calls=[])])[1] == {
        "role": "assistant", "content": ""}


def test_named_call_finishes_with_stop_and_required_with_tool_calls():
    assert choice_message('{"zone": "UTC"}', "stop", NAMED)[1] == "stop"
    assert choice_message('[{"name": "get_time", "parameters": {}}]', "stop", REQUIRED)[1] == "tool_calls"
    stream = ToolCallStream(NAMED)
    stream.feed('{"zone": "UTC"}')
    assert stream.finish("stop")[1] == "stop"


@pytest.mark.parametrize("parameters,word", [({"type": "array"}, "type object"), ({"type": "nope"}, "type object"),
                                             ({"type": "object", "properties": {"a": {"type": "nope"}}}, "nope"),
                                             ([1], "JSON schema object")])
@pytest.mark.parametrize("tool_choice", [None, "auto", "required", "none"])
def test_function_parameters_must_be_an_object_schema_whatever_the_choice(parameters, word, tool_choice):
    tools = [{"type": "function", "function": FUNCTIONS[0]},
             {"type": "function", "function": {"name": "f", "parameters": parameters}}]
    e = refused(plan_tools, chat({"tools": tools, "tool_choice": tool_choice}))
    assert e.param == "tools[1].function.parameters" and word in e.message, e.message


OVERLAPPING = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5},  # 3 to 5 match both
                         {"type": "integer", "minimum": 3, "maximum": 9}]}
ENGINE_ONE_OF = "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate oneOf with anyOf"
ENGINE_REGEX = ('at 1(8): invalid regex "((" (in regex): regex parse error:\n    ((\n     ^\nerror: unclosed group\n'
                '   1 | start: /((/\n              ^')


def test_constraint_refusals_give_no_advice_the_api_cannot_follow_and_quote_the_regex_sent():
    """The grammar engine's words for a oneOf it cannot enforce name an option of its own, and a regex that does not
    parse comes wrapped in a Lark rule the client never wrote: the 400 says what the client can do, and quotes the
    regex as sent; other messages pass as they are."""
    from ipc.client import InvalidRequestError

    def error(field, message, param, value):
        exc = InvalidRequestError("invalid_request", field, message)
        body = json.loads(handling.error_for(FakeGateway(None), exc, param, constraint_value=value).body)["error"]
        return body["message"], body["param"]

    message, param = error("sampling.json_schema", ENGINE_ONE_OF, "guided_json", OVERLAPPING)
    assert param == "guided_json" and "coerce_one_of" not in message and "use anyOf" in message, message
    assert error("sampling.regex", ENGINE_REGEX, "guided_regex", "((") == ('invalid regex "((": unclosed group',
                                                                          "guided_regex")
    lark = ENGINE_REGEX.replace('"(("', '"a\\\\/(("').replace("/((/", "/a\\/((/")  # "/" escaped for Lark
    message, param = error("sampling.regex", lark, "structured_outputs.regex", "a/((")
    assert (message, param) == ('invalid regex "a/((": unclosed group', "structured_outputs.regex")
    assert error("sampling.grammar", ENGINE_REGEX, "guided_grammar", "start: /((/")[0] == ENGINE_REGEX  # its own rule
    assert error("sampling.regex", "the constraint is longer than 65536 bytes", "guided_regex", "x")[0] == \
        "the constraint is longer than 65536 bytes"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                           "properties": {"a": OVERLAPPING}}}}]
    e = refused(plan_tools, chat({"tools": tools}))  # checked by the gateway itself, whatever the choice
    assert e.param == "tools[0].function.parameters" and "coerce_one_of" not in e.message, e.message
    assert "use anyOf" in e.message


@pytest.mark.parametrize("body,param", [
    ({"guided_json": {"type": "integer", "minimum": 1180591620717411303424}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"enum": [1, -2**64]}}}}}}, "response_format"),
    ({"structured_outputs": {"json": {"type": "integer", "maximum": 10**300}}}, "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"enum": [2**70]}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
])
def test_a_json_schema_integer_past_64_bits_is_a_400_naming_the_field(body, param):
    """No message to the scheduler can hold such an integer: msgpack's words ("can't serialize ints ...") named
    neither the field nor the value."""
    req = chat(body)
    e = refused(lambda: with_constraint(params.sampling_kwargs(req, 4, 100), plan_tools(req)))
    assert e.param == param and e.message.startswith(f"{param} holds an integer outside the 64-bit range: "), e.message
    assert "serialize" not in e.message
    bounded = chat({"guided_json": {"type": "integer", "minimum": 2**64 - 1}})  # it can be sent: the scheduler judges
    assert params.sampling_kwargs(bounded, 4, 100)["json_schema"] == {"type": "integer", "minimum": 2**64 - 1}
    auto = chat({**body, "tool_choice": "auto"}) if "tools" in body else None  # a schema only the model reads: fine
    assert auto is None or with_constraint({}, plan_tools(auto)) == {}


# ---------------------------------------------------------------------------
# 3 and 5. messages of malformed requests
# ---------------------------------------------------------------------------


def test_content_part_without_text_names_the_missing_field():
    e = refused(s.chat_messages, chat({"messages": [{"role": "user", "content": [{"type": "text"}]}]}).messages)
    assert (e.message, e.param) == ("missing required field `text`", "messages[0].content[0].text")
    e = refused(s.chat_messages, chat({"messages": [{"role": "user", "content": [{"type": "image"}]}]}).messages)
    assert e.param == "messages[0].content[0].type" and "'image'" in e.message


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}},
                                  {"type": "video_url", "video_url": {"url": "http://x/y.mp4"}},
                                  {"type": "image_url"}])
def test_a_content_part_other_than_text_is_refused_for_its_type_with_its_payload_or_not(part):
    e = refused(s.chat_messages, chat({"messages": [{"role": "user", "content": [part]}]}).messages)
    assert e.message == f"content part of type {part['type']!r} is not supported; only text parts are", e.message
    assert e.param == "messages[0].content[0].type"


def test_an_assistants_refusal_part_is_its_text_as_vllm_reads_it():
    """What OpenAI answers with (and clients send back): a refusal part renders as text; other roles have none, as
    they have no ``refusal`` field; a text part holds only text."""
    saved = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    req = chat({"messages": [USER[0], saved, USER[0]]})
    assert s.chat_messages(req.messages)[1] == {"role": "assistant", "content": "I can't."}
    mixed = {"role": "assistant", "content": [{"type": "text", "text": "No: "}, {"type": "refusal", "refusal": "x"}]}
    assert s.chat_messages(chat({"messages": [mixed]}).messages) == [{"role": "assistant", "content": "No: \nx"}]
    e = refused(s.chat_messages, chat({"messages": [{"role": "user", "content": saved["content"]}]}).messages)
    assert e.param == "messages[0].content[0].type" and "assistant" in e.message
    e = refused(s.chat_messages, chat({"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]}).messages)
    assert (e.message, e.param) == ("missing required field `refusal`", "messages[0].content[0].refusal")
    both = [{"type": "text", "text": "x", "image_url": {"url": "http://x/y.png"}}]
    e = refused(s.chat_messages, chat({"messages": [{"role": "user", "content": both}]}).messages)
    assert e.param == "messages[0].content[0].image_url", e.message


@pytest.mark.parametrize("body,word", [
    (rb'{"prompt": "x", "logit_bias": {"\ud800": 1}}', rb"\ud800"),  # in a key: msgspec says "truncated"
    (rb'{"prompt": "x", "user": "\ud800"}', rb"\ud800"),
    (rb'{"prompt": "x", "user": "a\udc00b"}', rb"\udc00"),
    (rb'{"prompt": "x", "user": "\ud800\ud800\udc00"}', rb"\ud800"),
])
def test_lone_surrogates_are_named(body, word):
    e = refused(decode_body, body, s.CompletionRequest)
    assert word.decode() in e.message and "surrogate" in e.message and "truncated" not in e.message, e.message


@pytest.mark.parametrize("body,param,literal", [
    ({"prompt": "x", "temperature": float("nan")}, "temperature", "NaN"),
    ({"prompt": "x", "logit_bias": {"13": float("inf")}}, "logit_bias.13", "Infinity"),
    ({"prompt": "x", "stop": ["a"], "top_p": -float("inf")}, "top_p", "-Infinity"),
])
def test_a_nan_or_infinity_is_named_by_its_field(body, param, literal):
    """Python's json.dumps (and so the openai client) writes NaN and Infinity, which JSON has no number for: the 400
    names the field (it said only that the body was not JSON)."""
    e = refused(decode_body, json.dumps(body).encode(), s.CompletionRequest)
    assert e.param == param and e.message.startswith(f"{param} is {literal},"), (e.param, e.message)


def test_json_that_is_fine_or_truncated_keeps_its_answer():
    """A pair, and an escaped backslash before "ud800", are no lone surrogates."""
    assert decode_body(rb'{"prompt": "\ud83d\ude00 \\ud800"}', s.CompletionRequest).prompt == "\U0001F600 \\ud800"
    e = refused(decode_body, rb'{"prompt": "\ud83d\ude00 \\ud800 ab', s.CompletionRequest)
    assert "truncated" in e.message and "surrogate" not in e.message, e.message


def test_nesting_error_states_the_limit():
    """The limit stated is the one that holds, within a few levels (it is the interpreter's recursion limit less
    the stack below the decode): a body a few levels less deep decodes, a few levels deeper does not."""
    def nested(levels: int) -> bytes:  # the object around the prompt is one level
        return b'{"prompt": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"

    def decoded(body: bytes):  # called as deep in the stack as refused() calls decode_body
        return decode_body(body, s.CompletionRequest)

    e = refused(decoded, nested(5000))
    limit = int(e.message.rsplit("limit here is about ", 1)[1].split()[0])
    assert 500 < limit < 1000, e.message
    assert "nests" in refused(decoded, nested(limit + 3)).message
    assert decoded(nested(limit - 3)).prompt is not None


def test_integral_floats_are_integers_and_others_still_refused():
    req = chat({"max_tokens": 8.0, "n": 2.0, "seed": 1e3, "stop_token_ids": [1.0, 2, 3e0], "temperature": 1})
    assert (req.max_tokens, req.n, req.seed, req.stop_token_ids) == (8, 2, 1000, [1, 2, 3])
    assert type(req.max_tokens) is int
    for bad, param in (({"max_tokens": 8.5}, "max_tokens"), ({"max_tokens": 8.0, "n": "2"}, "n"),
                       ({"stop_token_ids": [1.0, 2.5]}, "stop_token_ids[1]"), ({"max_tokens": True}, "max_tokens")):
        assert refused(chat, bad).param == param, bad
    assert "not valid JSON" in refused(decode_body, b'{"max_tokens": 8.0, "x": ]', s.ChatCompletionRequest).message


@pytest.mark.parametrize("body,param,message", [
    ({"seed": 2**64}, "seed", "seed must be in [0, 9223372036854775807], got 18446744073709551616"),
    ({"seed": -1}, "seed", "seed must be in [0, 9223372036854775807], got -1"),
    ({"max_tokens": 2**64}, "max_tokens", "max_tokens must be a 64-bit integer, got 18446744073709551616"),
    ({"max_tokens": 1e30}, "max_tokens", None),
    ({"stop_token_ids": [2**64]}, "stop_token_ids", None),
    ({"presence_penalty": 2.1}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.1"),
    ({"frequency_penalty": -2.000001}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -2.000001"),
    ({"stream_options": {"include_usage": True}}, "stream_options", None),
])
def test_numbers_and_stream_options_are_checked_as_sent(body, param, message):
    req = chat(body)
    e = refused(lambda: (params.check_stream_params(req), params.check_numbers(req)))
    assert e.param == param and (message is None or e.message == message), e.message


def test_values_at_the_limits_pass():
    req = chat({"seed": 2**63 - 1, "presence_penalty": 2.0, "frequency_penalty": -2, "stream": True,
                "stream_options": {"include_usage": True}})
    params.check_stream_params(req)
    params.check_numbers(req)


# ---------------------------------------------------------------------------
# 4 and 6. aborts counted, stalled bodies (no server)
# ---------------------------------------------------------------------------


class Counted:
    """The gateway's ``request_success`` counter, counting in a dict."""

    def __init__(self):
        self.counts: dict[tuple, int] = {}

    def labels(self, *labels):
        counts = self.counts

        class One:
            def inc(self, n=1):
                counts[labels] = counts.get(labels, 0) + n
        return One()


class Unfinished:
    """An SDK stream that never brings anything (its request runs on)."""

    result = None

    async def next_chunk(self):
        await asyncio.sleep(30)

    async def aclose(self):
        pass


def gateway_with_counter():
    gw = FakeGateway.__new__(FakeGateway)
    gw.metrics = type("M", (), {"request_success": Counted()})()
    return gw


def leaving_client(after: float):
    async def receive():
        await asyncio.sleep(after)
        return {"type": "http.disconnect"}
    return receive


async def test_a_client_that_leaves_a_whole_answer_counts_as_abort():
    gw = gateway_with_counter()
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, leaving_client(0.05))
    with pytest.raises(ClientGone):
        await handling.whole(gw, request, [Unfinished()], asyncio.sleep(30))
    assert gw.metrics.request_success.counts == {("fake", "abort"): 1}


async def test_a_stream_left_before_its_first_tokens_counts_as_abort():
    gw = gateway_with_counter()
    response = handling.stream(gw, [Unfinished()], lambda firsts: None)
    await response({"type": "http"}, leaving_client(0.05), None)
    assert gw.metrics.request_success.counts == {("fake", "abort"): 1}


def body_request(chunks: list[tuple[float, bytes]], declared: int):
    """A Request whose body comes as ``(delay, bytes)`` chunks, then stalls."""
    async def receive():
        if not chunks:
            await asyncio.sleep(30)
        delay, data = chunks.pop(0)
        await asyncio.sleep(delay)
        return {"type": "http.request", "body": data, "more_body": bool(chunks) or data != b"end"}
    headers = [(b"content-length", str(declared).encode())]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


async def test_a_stalled_body_is_408_and_a_slow_one_is_read():
    t0 = time.monotonic()
    with pytest.raises(s.RequestError) as e:
        await read_body(body_request([(0, b"x" * 1000)], 2000), 4096, timeout_s=0.2)
    assert e.value.status == 408 and "0.2 s" in e.value.message and time.monotonic() - t0 < 2
    assert asyncio.current_task().cancelling() == 0  # the task goes on as if nothing had been cancelled
    slow = [(0.1, b"a")] * 5 + [(0.1, b"end")]  # 0.6 s in all, never 0.2 s without a byte
    assert await read_body(body_request(slow, 8), 4096, timeout_s=0.2) == b"aaaaaend"


# ---------------------------------------------------------------------------
# one scripted server: the API key, /v1/models/{id}, aborts and stalled bodies over HTTP
# ---------------------------------------------------------------------------

KEY = "compat-key"


@pytest.fixture(scope="module")
def gateway(module_servers, default_model_dir):
    srv = module_servers("--load-format", "scripted", "--scripted-step-ms", "10", "--tokenizer", default_model_dir,
                         "--max-num-seqs", "8")
    port = free_port()
    gateways = start_gateways(srv.address, host="127.0.0.1", port=port, workers=1, run_dir=run_dir("gwc"),
                              api_key=KEY, body_timeout_s=1.0)
    try:
        gateways.wait_ready(120)
        yield f"http://127.0.0.1:{port}"
    finally:
        gateways.stop()


def test_api_key_messages_and_model_retrieve(gateway):
    status, body = http("GET", f"{gateway}/v1/models")
    assert status == 401 and json.loads(body)["error"]["message"].startswith("You didn't provide an API key.")
    status, body = http("GET", f"{gateway}/v1/models", key="wrong")
    assert status == 401 and json.loads(body)["error"]["message"] == "Incorrect API key provided."
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=KEY, max_retries=0)
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    # (the scripted executor's vocabulary is 1000 tokens: token ids, not chat, reach it)
    assert client.completions.create(model=name, prompt=[5, 6], max_tokens=2.0).usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=[5, 6], max_tokens=2, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    # no max_tokens: OpenAI's 16 within the rest of the context (a prompt 6 tokens short of it gets 6, not a 400
    # naming a max_tokens the client never sent)
    context = client.models.retrieve(name).model_extra["max_model_len"]
    long = client.completions.create(model=name, prompt=[5 + i % 900 for i in range(context - 6)],
                                     extra_body={"ignore_eos": True})
    assert long.usage.completion_tokens == 6 and long.choices[0].finish_reason == "length"


def test_an_abandoned_whole_answer_counts_as_abort(gateway):
    name = json.loads(http("GET", f"{gateway}/v1/models", key=KEY)[1])["data"][0]["id"]
    abort = (("finished_reason", "abort"), ("model_name", name))
    before = metric_values(gateway).get(("forerun:request_success_total", abort), 0)
    with socket.create_connection(("127.0.0.1", int(gateway.rsplit(":", 1)[1]))) as sock:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        time.sleep(0.5)
    deadline = time.monotonic() + 10
    while metric_values(gateway).get(("forerun:request_success_total", abort), 0) == before:
        assert time.monotonic() < deadline, "no abort counted"
        time.sleep(0.1)


def test_a_stalled_body_is_408_and_its_connection_closed(gateway):
    with socket.create_connection(("127.0.0.1", int(gateway.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                     b"\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n" + b"[" * 50_000)
        t0 = time.monotonic()
        answer = b""
        while chunk := sock.recv(65536):  # the server closes the connection after the answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:300]
    assert 0.5 < time.monotonic() - t0 < 5


def test_connections_that_stall_before_or_inside_their_head_are_closed(gateway):
    """Slow-loris: a connection that sends nothing, one that stops inside its headers, and a kept-alive one that
    stops inside its second request's headers are closed after the timeout (1 s here); a request meanwhile is
    answered."""
    port = int(gateway.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    socks[1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    socks[2].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert socks[2].recv(65536).startswith(b"HTTP/1.1 200")
    socks[2].sendall(b"GET /health HTTP/1.1\r\nHo")
    t0 = time.monotonic()
    assert http("GET", f"{gateway}/health")[0] == 200
    for sock in socks:
        with sock:
            assert sock.recv(65536) == b""  # closed by the server
    assert 0.5 < time.monotonic() - t0 < 5


def test_sentencepiece_byte_tokens_give_their_byte():
    """A SentencePiece byte-fallback token (``<0xE6>``, spelt in characters the byte-level alphabet also has) is
    its one byte; a ``▁`` piece is a space."""
    from ipc.gateway.logprobs import TokenTexts

    class SentencePieceLike:
        pieces = {1: "<0xE6>", 2: "<0x97>", 3: "<0xA5>", 4: "▁hi\ufffd"}

        def decode(self, ids, skip_special_tokens=False):
            return "\ufffd"

        def convert_ids_to_tokens(self, token_id):
            return self.pieces[token_id]

    texts = TokenTexts(SentencePieceLike())
    assert b"".join(bytes(texts.bytes_of(t)) for t in (1, 2, 3)) == "日".encode()
    assert bytes(texts.bytes_of(4)) == " hi\ufffd".encode()


def test_the_prompt_cap_leaves_an_n_out_of_range_to_its_own_error():
    req = msgspec.convert({"model": "m", "prompt": ["a", "b"], "n": 2000}, s.CompletionRequest)
    assert s.prompts(req) == ["a", "b"]  # the n check names n


async def test_streamed_forced_tool_calls_carry_their_tokens_logprobs(tokenizer):
    """With tools and logprobs, every streamed chunk's tokens' logprobs go out, held text or not (``required``
    holds its JSON to the end): joined, they are the whole answer's."""
    from ipc.client import StreamChunk
    from ipc.protocol import TokenLogprobs

    tools = [{"type": "function", "function": FUNCTIONS[0]}]
    req = chat({"messages": USER, "tools": tools, "tool_choice": "required", "logprobs": True, "stream": True})
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    ids = tokenizer.encode(text, add_special_tokens=False)
    lps = [TokenLogprobs(-0.25, [t], [-0.25]) for t in ids]
    half = len(ids) // 2
    chunks = [StreamChunk(tokenizer.decode(ids[:half]), ids[:half], lps[:half]),
              StreamChunk(tokenizer.decode(ids[half:]), ids[half:], lps[half:], finish_reason="stop")]
    r = request_result([choice(0, text, ids, lps, reason="stop")])
    events = [e async for e in responses.chat_tools_stream(FakeGateway(tokenizer), req, "c", [FakeStream(chunks, r)],
                                                           [None])]
    datas = [json.loads(line[6:]) for e in events for line in e.decode().split("\n\n")
             if line.startswith("data: {")]
    content = [t for d in datas for c in d["choices"] for t in ((c.get("logprobs") or {}).get("content") or [])]
    assert [t["token"] for t in content] == [tokenizer.decode([t]) for t in ids]
    assert any(c.get("delta", {}).get("tool_calls") for d in datas for c in d["choices"])


def test_a_worker_whose_start_fails_says_it_in_one_line_and_exits_3():
    """A gateway worker's failed start (here a Gateway.start that raises) is one line on stderr and status 3 (the
    server then names the worker), not uvicorn's traceback."""
    import subprocess
    import sys

    from tests.server_proc import ROOT, python_path

    script = """if True:
        import asyncio
        import ipc.gateway.app as a
        async def boom(self):
            raise RuntimeError("no tokenizer here\\\\nits details")
        a.Gateway.start = boom
        app = a.create_app("ipc:///nowhere.sock", exit_on_start_failure=True)
        async def receive():
            return {"type": "lifespan.startup"}
        async def send(message):
            pass
        asyncio.run(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    """
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(__import__("os").environ, PYTHONPATH=python_path()))
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "Traceback" not in done.stderr
    assert done.stderr.startswith("forerun: gateway worker ") and "cannot start: RuntimeError: no tokenizer here" \
        in done.stderr, done.stderr


def test_chat_template_kwargs_nested_past_the_limit_name_their_key(tokenizer):
    from ipc.gateway.chat_template import MAX_TEMPLATE_NESTING

    deep: list = []
    inner = deep
    for _ in range(MAX_TEMPLATE_NESTING + 1):
        inner.append([])
        inner = inner[0]
    assert refused(template_kwargs, chat({"chat_template_kwargs": {"x": deep}}), tokenizer).param == \
        "chat_template_kwargs.x"
    shallow = {"x": [[{"a": [1]}]], "enable_thinking": False}
    assert template_kwargs(chat({"chat_template_kwargs": shallow}), tokenizer) == shallow
