"""Tool calls without a server: the parsers of each family's format, streaming against non-streaming,
and conversations with earlier calls and ``role: tool`` results through a template that checks them."""

from __future__ import annotations

import json

import jinja2
import jinja2.sandbox
import pytest

from ipc.gateway import schemas as s
from ipc.gateway.chat_template import render, template_messages
from ipc.gateway.tool_calls import ToolCallStream, choice_message, parse_calls
from ipc.gateway.tools import ToolPlan

FUNCTIONS = [{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}]
AUTO = ToolPlan(FUNCTIONS, "auto")
PARIS, UTC = ("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "UTC"}')

# (model output, content, calls) of an "auto" answer: the content is the text before the calls as it is (vLLM's)
OUTPUTS = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Let me look.\n", [PARIS, UTC]),
    ('Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> Done.', "Sure. ", [UTC]),
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"zone": "UTC"}}]', None, [PARIS, UTC]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', None, [PARIS, UTC]),
    ('Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure. ", [UTC]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"zone": "UTC"}}',
     None, [PARIS, UTC]),
    ('{"name": "unknown", "parameters": {}}', '{"name": "unknown", "parameters": {}}', []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),  # cut short
    ('get_weather{"city": "Paris"}get_time {"zone": "UTC"}', None, [PARIS, UTC]),  # Mistral's, special tokens dropped
    ("get the weather first.", "get the weather first.", []),
    ("get_weatherman says sunny", "get_weatherman says sunny", []),
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
]


def _canonical(calls):
    return [(name, json.loads(args)) for name, args in calls]


@pytest.mark.parametrize("text,content,calls", OUTPUTS)
def test_auto_calls_of_each_format(text, content, calls):
    got_content, got = parse_calls(text, AUTO)
    assert got_content == content and _canonical(got) == _canonical(calls)
    message, finish = choice_message(text, "stop", AUTO)
    assert finish == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("text,content,calls", OUTPUTS)
def test_streamed_calls_assemble_to_the_answer(text, content, calls):
    """Fed in small pieces, the stream's content and calls are the non-streaming answer's, to the character."""
    stream, deltas = ToolCallStream(AUTO), []
    for i in range(0, len(text), 3):
        deltas += stream.feed(text[i:i + 3])
    last, finish = stream.finish("stop")
    deltas += last
    streamed_content = "".join(d.content or "" for d in deltas)
    streamed_calls = [(c.function["name"], c.function["arguments"]) for d in deltas for c in d.tool_calls or []]
    assert finish == ("tool_calls" if calls else "stop")
    assert _canonical(streamed_calls) == _canonical(calls)
    assert streamed_content == (content or "")


def test_arguments_keep_non_ascii_characters_streaming_or_not():
    """Arguments are JSON text with non-ASCII characters as they are (vLLM's ``ensure_ascii=False``)."""
    args = {"city": "Z\u00fcrich \u6771\u4eac"}
    for text in (f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(args)}}}</tool_call>',
                 f'[TOOL_CALLS]get_weather[ARGS]{json.dumps(args)}',
                 f'{{"name": "get_weather", "parameters": {json.dumps(args)}}}'):
        message, _ = choice_message(text, "stop", AUTO)
        assert message.tool_calls[0].function.arguments == '{"city": "Z\u00fcrich \u6771\u4eac"}', text
        stream = ToolCallStream(AUTO)
        deltas = stream.feed(text) + stream.finish("stop")[0]
        streamed = [c.function["arguments"] for d in deltas for c in d.tool_calls or []]
        assert streamed == ['{"city": "Z\u00fcrich \u6771\u4eac"}'], text


def test_required_and_named_cut_short_finish_with_length():
    """A constrained call that max_tokens cut finishes "length" with no content (never the raw JSON as text)."""
    for plan, text in ((ToolPlan(FUNCTIONS, "required"), '[{"name": "get_weather", "parameters": {"ci'),
                       (ToolPlan(FUNCTIONS, "named", name="get_time"), '{"zone": "U')):
        message, finish = choice_message(text, "length", plan)
        assert finish == "length" and message.content is None
        stream = ToolCallStream(plan)
        stream.feed(text)
        assert stream.finish("length")[1] == "length"


# A template in the manner of Mistral's: ids of 9 characters, calls and results in its own markers.
MISTRAL_TEMPLATE = """{%- for m in messages -%}
{%- if m.role == 'user' -%}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls -%}[TOOL_CALLS][
{%- for c in m.tool_calls -%}
{%- if c.id|length != 9 -%}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif -%}
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments|tojson }}, "id": "{{ c.id }}"}
{%- endfor -%}]</s>
{%- elif m.role == 'tool' -%}
{%- if m.tool_call_id|length != 9 -%}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif -%}
[TOOL_RESULTS]{"content": {{ m.content|tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif m.role == 'assistant' -%}{{ m.content }}</s>
{%- endif -%}
{%- endfor -%}"""


class _TemplateTokenizer:
    """What ``render`` needs of a tokenizer: a chat template (jinja2, as transformers runs it) and encode."""

    def __init__(self, template: str):
        env = jinja2.sandbox.ImmutableSandboxedEnvironment()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)
        env.globals["raise_exception"] = raise_exception
        self.chat_template = template
        self._template = env.from_string(template)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def encode(self, text, add_special_tokens):
        return [ord(ch) for ch in text]


def test_tool_results_in_a_conversation():
    """An earlier call and its ``role: tool`` result render through the template; Mistral gets 9-char ids."""
    call_id = "call_0123456789abcdef01234567"
    req = s.ChatCompletionRequest(messages=[
        s.ChatMessage(role="user", content="Weather in Paris?"),
        s.ChatMessage(role="assistant", content=None, tool_calls=[{"id": call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
        s.ChatMessage(role="tool", tool_call_id=call_id, content="21 degrees, sunny")], tools=[
        {"type": "function", "function": f} for f in FUNCTIONS])
    messages, tools = template_messages(req, AUTO, MISTRAL_TEMPLATE)
    assert tools and messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == "f01234567"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = "".join(map(chr, render(_TemplateTokenizer(MISTRAL_TEMPLATE), messages, tools)))
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}' in text
    assert '[TOOL_RESULTS]{"content": "21 degrees, sunny", "call_id": "f01234567"}' in text
    # A template that ignores tools: the Hermes fallback writes the call into the assistant's content.
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    messages, tools = template_messages(req, AUTO, plain)
    assert tools is None and messages[0]["role"] == "system" and "get_time" in messages[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in messages[2]["content"]
    assert messages[3] == {"role": "tool", "content": "21 degrees, sunny", "tool_call_id": call_id}


def test_required_schema_keeps_each_functions_definitions(default_model_dir):
    """tool_choice "required" over functions whose parameters hold ``$defs`` (pydantic's nested models, the same
    name in two functions) and a recursive ``#`` ref: the one schema compiles and validates what each function's
    own schema does."""
    import jsonschema

    from ipc.gateway.tools import constraint
    from scheduler_proc.grammar import GrammarCompiler

    user = {"$defs": {"Item": {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"],
                               "additionalProperties": False}},
            "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
            "required": ["items"], "additionalProperties": False}
    order = {"definitions": {"Item": {"type": "object", "properties": {"sku": {"type": "integer"}}, "required": ["sku"],
                                      "additionalProperties": False}},
             "type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/definitions/Item"}},
                                              "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
             "required": ["items"], "additionalProperties": False}
    plan = ToolPlan([{"name": "save_user", "parameters": user}, {"name": "order", "parameters": order}], "required")
    schema = constraint(plan)["json_schema"]
    good = [{"name": "save_user", "parameters": {"items": [{"street": "Main"}]}},
            {"name": "order", "parameters": {"items": [{"sku": 1}], "next": {"items": [], "next": None}}}]
    jsonschema.validate(good, schema)
    for call in good:
        jsonschema.validate(call["parameters"], user if call["name"] == "save_user" else order)
    for bad in ([{"name": "save_user", "parameters": {"items": [{"sku": 1}]}}],
                [{"name": "order", "parameters": {"items": [{"sku": 1}], "next": {"items": [{"street": "x"}]}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert GrammarCompiler(default_model_dir, 49152, [2]).compile_sync("json_schema", schema)


def test_required_schema_follows_pointers_into_a_functions_parameters(default_model_dir):
    """A ``$ref`` into the parameters themselves (``#/properties/a``) keeps pointing at them once they sit inside
    the ``required`` schema (it once pointed at the root's properties: "Pointer '/properties/a' does not exist")."""
    import jsonschema

    from ipc.gateway.tools import constraint
    from scheduler_proc.grammar import GrammarCompiler

    params = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
              "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"$ref": "#/properties/a"}}}
    schema = constraint(ToolPlan([{"name": "w", "parameters": params}], "required"))["json_schema"]
    jsonschema.validate([{"name": "w", "parameters": {"a": "x", "b": "yz"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "w", "parameters": {"a": "x", "b": "too long"}}], schema)
    assert GrammarCompiler(default_model_dir, 49152, [2]).compile_sync("json_schema", schema)
