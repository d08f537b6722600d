"""Structured outputs and tool calls over HTTP, through the official openai client.

One real-model server for the module; its requests run concurrently.  Outputs that end with
"stop" satisfy their schema (``jsonschema``), regex or choice; ``tool_choice="required"`` and a named
function give calls whose arguments validate against the function's parameters, and a streamed
answer assembles to the same calls; bad constraints and tool choices are 400s naming the parameter.
"""

from __future__ import annotations

import asyncio
import json
import re

import urllib.request

import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_openai_server import free_port, wait_for_line

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer as JSON."}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                           "parameters": TIME}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FORECAST = {"type": "object", "properties": {  # a nested object, an array with bounds, an optional field
    "city": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
             "additionalProperties": False},
    "highs": {"type": "array", "items": {"type": "integer", "minimum": -30, "maximum": 50}, "minItems": 1, "maxItems": 3},
    "note": {"type": "string", "maxLength": 8}}, "required": ["city", "highs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def api(module_servers, default_model_dir):
    port = free_port()
    srv = module_servers("--port", str(port), "--host", "127.0.0.1", "--max-num-seqs", "16", "--num-kv-blocks", "256")
    wait_for_line(srv, "OpenAI-compatible API at")
    return f"http://127.0.0.1:{port}/v1"


def _client(url: str) -> openai.AsyncOpenAI:
    """A client per test: its connections belong to that test's event loop."""
    return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)


def _chat(api, **kw):
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0)
    return api.chat.completions.create(model=MODEL, messages=kw.pop("messages", ASK), **kw)


async def _assembled(stream) -> tuple[dict[int, dict], str]:
    """Tool calls and finish reason of a stream, assembled the way the openai client's users do."""
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


async def _content(stream) -> tuple[str, str]:
    text, finish = "", None
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_structured_and_tools(api):
    api = _client(api)

    async def go():
        named = {"type": "function", "function": {"name": "get_time"}}
        jobs = {
            "schema": _chat(api, response_format={"type": "json_schema", "json_schema": {
                "name": "weather", "schema": WEATHER, "strict": True}}),
            "object": _chat(api, response_format={"type": "json_object"}, max_tokens=24),
            "nested": _chat(api, response_format={"type": "json_schema", "json_schema": {
                "name": "forecast", "schema": FORECAST, "strict": True}}, max_tokens=40),
            "guided_json": _chat(api, extra_body={"guided_json": TIME}, temperature=0.8, seed=4),
            "regex": _chat(api, extra_body={"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{1,2}C"}, temperature=0.7, seed=1),
            "choice": _chat(api, extra_body={"structured_outputs": {"choice": ["sunny", "rainy", "cloudy"]}}),
            "required": _chat(api, tools=TOOLS, tool_choice="required", max_tokens=64),
            "named": _chat(api, tools=TOOLS, tool_choice=named),
            "auto": _chat(api, tools=TOOLS, max_tokens=16),
            "required_stream": _chat(api, tools=TOOLS, tool_choice="required", max_tokens=64, stream=True),
            "named_stream": _chat(api, tools=TOOLS, tool_choice=named, stream=True),
            "auto_stream": _chat(api, tools=TOOLS, max_tokens=16, stream=True),
            "completion": api.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                                 temperature=0, extra_body={"guided_choice": ["Paris", "Lyon"]}),
            "tool_result": _chat(api, tools=TOOLS, max_tokens=16, messages=ASK + [
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]),
        }
        r = dict(zip(jobs, await asyncio.gather(*jobs.values())))
        for name, schema in (("schema", WEATHER), ("object", {"type": "object"}), ("guided_json", TIME),
                             ("nested", FORECAST)):
            c = r[name].choices[0]
            if c.finish_reason == "stop":
                jsonschema.validate(json.loads(c.message.content), schema)
        assert r["schema"].choices[0].finish_reason == "stop"
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,2}C", r["regex"].choices[0].message.content)
        assert r["choice"].choices[0].message.content in ("sunny", "rainy", "cloudy")
        assert r["completion"].choices[0].text in ("Paris", "Lyon")
        for name, reason in (("required", "tool_calls"), ("named", "stop")):  # a named function's call: "stop"
            c = r[name].choices[0]
            assert c.finish_reason == reason and c.message.tool_calls, c
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        assert r["named"].choices[0].message.tool_calls[0].function.name == "get_time"
        streamed, finish = await _assembled(r["required_stream"])
        assert finish == "tool_calls"
        whole = r["required"].choices[0].message.tool_calls
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in whole]
        streamed, finish = await _assembled(r["named_stream"])
        assert finish == "stop"
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [
            (c.function.name, c.function.arguments) for c in r["named"].choices[0].message.tool_calls]
        content, finish = await _content(r["auto_stream"])
        assert finish == r["auto"].choices[0].finish_reason
        if finish != "tool_calls":
            assert content == r["auto"].choices[0].message.content
        assert r["tool_result"].choices[0].message.content
    asyncio.run(go())


BAD = [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
     "response_format"),
    (dict(extra_body={"guided_regex": "a(b"}), "guided_regex"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
    # a grammar that allows no token after its first ("a", then a terminal that matches nothing)
    (dict(extra_body={"guided_grammar": 'start: "a" /[^\\x00-\\U0010FFFF]/\n'}), "guided_grammar"),
    (dict(response_format={"type": "xml"}), "response_format.type"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0].function.name"),
    # a function's parameters the grammar engine refuses, under "required" and named (streamed too): the tool's
    # parameters, not the response_format the request does not have
    (dict(tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "strin"}}}],
          tool_choice="required"), "tools[0].function.parameters"),
    (dict(tools=[{"type": "function", "function": {"name": "w", "parameters": {"type": "strin"}}}],
          tool_choice={"type": "function", "function": {"name": "w"}}, stream=True), "tools[0].function.parameters"),
]


def test_constraint_refusals_say_what_is_wrong_in_the_requests_terms(api):
    """An integer past 64 bits in a schema, a oneOf the grammar engine cannot enforce (no advice about its own
    options) and a regex that does not parse (no Lark rule around it): 400s naming the field, in words about it."""
    api = _client(api)
    huge = {"type": "integer", "minimum": 1180591620717411303424}
    overlapping = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                             {"type": "integer", "minimum": 3, "maximum": 9}]}
    schema_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": overlapping}}
    cases = [(dict(extra_body={"guided_json": huge}), "guided_json", "guided_json holds an integer outside the 64-bit "
                                                                      "range: 1180591620717411303424 at /minimum"),
             (dict(extra_body={"guided_json": overlapping}), "guided_json", None),
             (dict(response_format=schema_format, stream=True), "response_format", None),
             (dict(extra_body={"guided_regex": "(("}), "guided_regex", 'invalid regex "((": unclosed group')]

    async def go():
        for kw, param, message in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await _chat(api, max_tokens=1, **kw)
            body = e.value.body
            assert body["param"] == param and "serialize" not in body["message"], body
            assert body["message"] == message if message else ("coerce_one_of" not in body["message"]
                                                                and "use anyOf" in body["message"]), body
    asyncio.run(go())


def test_bad_constraints_and_tools_are_400s(api):
    url, api = api, _client(api)

    async def go():
        for kw, param in BAD:
            with pytest.raises(openai.BadRequestError) as e:
                await _chat(api, max_tokens=4, **kw)
            assert e.value.body["param"] == param, (kw, e.value.body)
        ok = await _chat(api, max_tokens=2)  # still serving
        assert ok.choices[0].finish_reason == "length"
        # one constrained answer here too, so the metrics below do not depend on the other test having run
        yes_no = await _chat(api, max_tokens=4, extra_body={"guided_choice": ["yes", "no"]})
        assert any(word.startswith(yes_no.choices[0].message.content) for word in ("yes", "no"))
    asyncio.run(go())
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    assert families["forerun:structured_requests"].samples[0].value > 0
    assert families["forerun:grammar_steps"].samples[0].value > 0  # steps with a constrained row
    compiles = {s.name: s.value for s in families["forerun:grammar_compile_seconds"].samples}
    assert compiles["forerun:grammar_compile_seconds_count"] > 0
