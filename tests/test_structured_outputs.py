"""Structured outputs through the SDK on the default model: JSON schemas, regexes, choices, grammars.

One batch of concurrent constrained requests runs at pipeline depths 0, 1 and 2 (the shared
real-model servers): every output that ends with "stop" must satisfy its constraint, and each
request's output (greedy or seeded) must be the same at every depth, whatever else is in the batch.
Bad constraints are refused naming the field, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from ipc.client import AsyncClient
from ipc.client.errors import InvalidRequestError
from tests.server_proc import assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Describe a user of a web shop as JSON."}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum_range": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["color", "count"], "additionalProperties": False},
    "pattern_optional": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "note": {"type": "string", "maxLength": 12}},
        "required": ["code"], "additionalProperties": False},
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                      "minItems": 2, "maxItems": 4},
}
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/\n'


def _requests():
    """(name, keywords) of the batch: each constraint kind, greedy and seeded, with other sampling features."""
    out = [(f"json:{name}", dict(json_schema=schema, temperature=0)) for name, schema in SCHEMAS.items()]
    out += [
        ("json:seeded", dict(json_schema=SCHEMAS["enum_range"], temperature=1.0, top_p=0.9, seed=7)),
        ("json:penalised", dict(json_schema=json.dumps(SCHEMAS["pattern_optional"]), temperature=0.7, top_k=20,
                                seed=3, repetition_penalty=1.2, presence_penalty=0.5, logprobs=2)),
        ("regex", dict(regex=REGEX, temperature=0.9, seed=11)),
        ("choice", dict(choice=CHOICES, temperature=0)),
        ("choice:n2", dict(choice=CHOICES, temperature=1.0, seed=5, n=2)),
        ("grammar", dict(grammar=GRAMMAR, temperature=0.8, seed=2)),
        ("plain", dict(temperature=0, max_tokens=8)),
    ]
    return out


def _check(name: str, text: str, finish: str) -> None:
    if finish != "stop":
        assert finish == "length", (name, finish)
        return
    kind = name.split(":")[0]
    if kind == "json":
        schema = SCHEMAS.get(name.split(":")[1]) or (SCHEMAS["enum_range"] if "seeded" in name
                                                      else SCHEMAS["pattern_optional"])
        jsonschema.validate(json.loads(text), schema)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(r"The answer is [1-9][0-9]?\.", text), text


async def _run_batch(address: str) -> dict[str, list[tuple[str, str]]]:
    async with AsyncClient(address) as c:
        async def one(name, kw):
            kw.setdefault("max_tokens", 40)
            r = await c.generate(messages=PROMPT, **kw)
            outs = r.choices
            if kw.get("logprobs") is not None:
                assert len(r.logprobs) == len(r.token_ids)
            return name, [(o.text, o.finish_reason) for o in outs]

        return dict(await asyncio.gather(*(one(n, dict(kw)) for n, kw in _requests())))


@pytest.fixture(scope="module")
def outputs_by_depth(model_server):
    with ThreadPoolExecutor(3) as pool:  # those not running yet start together
        addresses = [srv.address for srv in pool.map(model_server, (0, 1, 2))]

    async def all_depths():  # the three servers at once: each batch's outputs do not depend on timing
        return dict(zip((0, 1, 2), await asyncio.gather(*(_run_batch(a) for a in addresses))))
    return asyncio.run(all_depths())


def test_constrained_outputs_are_valid(outputs_by_depth):
    stops = 0
    for name, outs in outputs_by_depth[1].items():
        if name == "plain":
            continue
        for text, finish in outs:
            _check(name, text, finish)
            stops += finish == "stop"
    assert stops >= len(outputs_by_depth[1]) - 3  # most bounded schemas end inside max_tokens


def test_constrained_outputs_equal_at_every_depth(outputs_by_depth):
    assert outputs_by_depth[0] == outputs_by_depth[1] == outputs_by_depth[2]


BAD = [
    (dict(json_schema={"type": "strin"}), "sampling.json_schema", "strin"),
    (dict(json_schema="{not json"), "sampling.json_schema", "not valid JSON"),
    (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 2}), "sampling.json_schema", "minimum"),
    (dict(regex="a(b"), "sampling.regex", "unclosed group"),
    (dict(grammar="start: foo\n"), "sampling.grammar", "foo"),
    (dict(choice=[]), "sampling.choice", "at least one"),
    (dict(regex="a", choice=["a"]), "sampling.choice", "at most one"),
    (dict(regex="a", ignore_eos=True), "sampling.ignore_eos", "ignore_eos"),
]


def test_bad_constraints_are_refused(model_server):
    """Each bad constraint is refused naming its field, twice (a cached error is the same error); the server
    serves a request after all of them (one that any of them broke would not refuse the next as asked, nor
    serve it)."""
    async def go():
        async with AsyncClient(model_server(1).address) as c:
            for kw, field, words in BAD:
                for _ in range(2):
                    with pytest.raises(InvalidRequestError) as e:
                        await c.generate("hi", max_tokens=4, **kw)
                    assert e.value.field == field and words in str(e.value), (kw, e.value)
            assert (await c.generate("hi", max_tokens=2, temperature=0)).finish_reason == "length"
    asyncio.run(go())


def test_unfinished_constraint_ends_with_length(model_server):
    """A grammar that max_tokens cuts short finishes with "length" (its text a prefix of a valid output), and
    one that ends inside max_tokens with "stop"."""
    async def go():
        async with AsyncClient(model_server(1).address) as c:
            long = await c.generate(messages=PROMPT, json_schema={"type": "string", "minLength": 40}, max_tokens=5,
                                    temperature=0)
            assert long.finish_reason == "length" and long.text.startswith('"') and len(long.token_ids) == 5
            bounded = await c.generate(messages=PROMPT, regex="[0-9]{2}", max_tokens=8, temperature=0)
            assert bounded.finish_reason == "stop" and re.fullmatch("[0-9]{2}", bounded.text)
    asyncio.run(go())


def test_a_literal_holding_a_special_tokens_string_comes_out_as_text(model_server):
    """A choice or regex whose text holds a special token's string (``<|im_end|>``, the model's EOS, or
    ``<|im_start|>``) is written with ordinary tokens: it was the special token, which ended the output short of
    its constraint (EOS) or failed the request (a token the grammar refuses).  A special token is never text."""
    async def go():
        async with AsyncClient(model_server(1).address) as c:
            for kw, text in ((dict(choice=["<|im_end|>"]), "<|im_end|>"),
                             (dict(choice=["<|im_start|>x"]), "<|im_start|>x"),
                             (dict(regex="a<\\|im_end\\|>b"), "a<|im_end|>b")):
                r = await c.generate("Say it.", max_tokens=16, temperature=0, **kw)
                # the tokens of the text, then EOS where the constraint ends
                assert (r.text, r.finish_reason) == (text, "stop") and 1 not in r.token_ids, r
                assert 2 not in r.token_ids[:-1], r.token_ids
    asyncio.run(go())


# A language that ends after its first token: "a", then a terminal that matches nothing (checked lazily by
# llguidance, so the compile's first mask allows "a")
DEAD_END = 'start: "a" /[^\\x00-\\U0010FFFF]/\n'


def test_a_constraint_with_no_continuation_fails_the_request(model_server):
    """A constraint that allows no token after the output so far fails its request with an error naming the
    field (never "stop" with an output the constraint does not match), at every depth, its n completions and
    a stream alike; its batch mates finish as they would alone, and the server serves the next request.  The three
    servers run it at the same time (each executor serves on one thread)."""
    async def go(depth):
        async with AsyncClient(model_server(depth).address) as c:
            async def dead(**kw):
                with pytest.raises(InvalidRequestError) as e:
                    await c.generate("Say a.", grammar=DEAD_END, max_tokens=8, **{"temperature": 0, **kw})
                assert e.value.field == "sampling.grammar", e.value
                assert "no continuation of the output's first 1 tokens" in str(e.value), e.value

            async def streamed():
                with pytest.raises(InvalidRequestError) as e:
                    async for _ in c.stream("Say a.", grammar=DEAD_END, max_tokens=8, temperature=0):
                        pass
                assert e.value.field == "sampling.grammar"

            mate = c.generate(messages=PROMPT, regex="[0-9]{2}", max_tokens=8, temperature=0)
            *_, bounded = await asyncio.gather(dead(), dead(n=2, seed=1, temperature=1.0), streamed(), mate)
            assert bounded.finish_reason == "stop" and re.fullmatch("[0-9]{2}", bounded.text)
            assert (await c.generate("hi", max_tokens=2, temperature=0)).finish_reason == "length"
    async def every_depth():
        await asyncio.gather(*(go(depth) for depth in (0, 1, 2)))
    asyncio.run(every_depth())


def test_no_leak_after_constrained_requests(model_server, outputs_by_depth):
    for depth in (0, 1, 2):
        stats = asyncio.run(wait_idle(model_server(depth).address))
        assert_no_leak(stats)


def test_matcher_rebuilt_from_tokens_matches_advanced_one(default_model_dir):
    """A slot admitted with outputs (a resume) gets the mask of a matcher that sampled them itself."""
    import torch

    from executor_proc.step.grammar import build_grammar_slots
    from ipc.protocol import Admit, SlotSampling, StepPlan
    from scheduler_proc.grammar import to_grammar

    tok_path = f"{default_model_dir}/tokenizer.json"
    slots = build_grammar_slots(tok_path, 49152, [2], 4, torch.device("cpu"))
    grammar = to_grammar("json_schema", SCHEMAS["enum_range"])
    prompt = [1, 2, 3]
    text_ids = slots.tokenizer.tokenize_str('{"color":"gr')  # compact JSON: no free whitespace

    def plan(step, admits=(), sample=()):
        return StepPlan(step, list(sample), [1] * len(sample), [0] * len(sample), [False] * len(sample),
                        [True] * len(sample), admits=list(admits))

    sampling = SlotSampling(1.0, 0, 1.0, 0.0, 0, num_prompt_tokens=len(prompt), grammar=grammar)
    # slot 0 samples the tokens one step at a time; slot 1 is admitted with them as its outputs
    rows = slots.stage(plan(0, [Admit(0, sampling, prompt)], [0]), [0])
    for step, t in enumerate(text_ids, start=1):
        slots.bind(rows)
        slots.advance(rows, [t])
        rows = slots.stage(plan(step, sample=[0]), [0])
    resumed = slots.stage(plan(99, [Admit(1, sampling, prompt + text_ids)], [1]), [1])
    slots.bind(rows)
    slots.bind(resumed)
    assert torch.equal(slots.table[0], slots.table[1])
    allowed = [i for i in range(49152) if (int(slots.table[1, i // 32]) >> (i % 32)) & 1]
    want = '{"color":"green",'
    texts = [slots.tokenizer.decode_str(text_ids + [i]) for i in allowed]
    assert allowed and 2 not in allowed
    assert all(want.startswith(t) or t.startswith(want) for t in texts), texts[:5]


def test_compiler_timeout_cache_and_refusals(default_model_dir):
    """The scheduler's compiler: a compile over the time limit is refused, results and errors are cached."""
    from ipc.protocol import SamplingParams
    from scheduler_proc.grammar import GrammarCompiler, GrammarError

    async def go():
        slow = GrammarCompiler(default_model_dir, 49152, [2], timeout_s=1e-6)
        with pytest.raises(GrammarError) as e:
            await slow.compile(SamplingParams(regex="[a-z]+"))
        assert e.value.field == "sampling.regex" and "longer than" in e.value.message
        c = GrammarCompiler(default_model_dir, 49152, [2])
        assert await c.compile(SamplingParams()) == ""
        g = await c.compile(SamplingParams(json_schema={"type": "object"}))
        assert g and await c.compile(SamplingParams(json_schema='{"type": "object"}')) == g
        assert c.stats.cache_hits == 1 and c.stats.compiles == 1 and sum(c.stats.compile_buckets) == 1
        bad = SamplingParams(json_schema={"type": "string", "format": "no-such-format"})
        for _ in range(2):
            with pytest.raises(GrammarError, match="format"):
                await c.compile(bad)
        assert c.stats.cache_hits == 2
        none = GrammarCompiler("", 49152, [2])
        with pytest.raises(GrammarError, match="tokenizer"):
            await none.compile(SamplingParams(choice=["a"]))
        tp = GrammarCompiler(default_model_dir, 49152, [2], unavailable="not with tensor parallelism")
        with pytest.raises(GrammarError, match="tensor parallelism"):
            await tp.compile(SamplingParams(regex="a"))
    asyncio.run(go())


def test_bench_masks_only(tmp_path):
    """scripts/bench_structured.py --masks-only (no server): the executor's grammar work per step."""
    import subprocess
    import sys

    out = tmp_path / "masks.json"
    subprocess.run([sys.executable, "scripts/bench_structured.py", "--masks-only", "--batches", "2",
                    "--new-tokens", "3", "--json", str(out)], check=True, capture_output=True, timeout=120,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (row,) = json.loads(out.read_text())["masks"]
    assert row["batch"] == 2 and row["advance_ms"]["p50"] > 0


def test_bind_waits_for_the_previous_steps_token(default_model_dir):
    """Step N+1's masks bind only once the output thread has advanced the matcher over step N's token."""
    import threading
    import time

    import torch

    from executor_proc.step.grammar import build_grammar_slots
    from ipc.protocol import Admit, SlotSampling, StepPlan
    from scheduler_proc.grammar import to_grammar

    slots = build_grammar_slots(f"{default_model_dir}/tokenizer.json", 49152, [2], 2, torch.device("cpu"))
    sampling = SlotSampling(1.0, 0, 1.0, 0.0, 0, num_prompt_tokens=1, grammar=to_grammar("choice", ["yes", "no"]))

    def plan(step, admits=()):
        return StepPlan(step, [0], [1], [0], [False], [True], admits=list(admits))

    first = slots.stage(plan(0, [Admit(0, sampling, [1])]), [0])
    slots.bind(first)
    start_mask = slots.table[0].clone()
    second = slots.stage(plan(1), [0])  # launched before step 0's token is known
    yes = slots.tokenizer.tokenize_str("yes")
    threading.Timer(0.2, lambda: slots.advance(first, yes[:1])).start()  # the output thread, later
    t0 = time.perf_counter()
    slots.bind(second)
    assert time.perf_counter() - t0 >= 0.15 and second.wait_s >= 0.15
    assert not torch.equal(slots.table[0], start_mask)  # the mask after "yes"'s first token
    allowed = [i for i in range(49152) if (int(slots.table[0, i // 32]) >> (i % 32)) & 1]
    assert all("yes".startswith(slots.tokenizer.decode_str(yes[:1] + [i])) or i == 2 for i in allowed)


def test_constraints_no_output_can_meet_are_refused_in_words(default_model_dir):
    """An integer schema bounded past the signed 64-bit range (the grammar engine clamped it: ``minimum`` 10**19
    let 9223372036854775807 through) and a regex no text matches: refused naming the keyword or saying why."""
    from ipc.protocol import SamplingParams
    from scheduler_proc.grammar import GrammarCompiler, GrammarError

    async def go():
        c = GrammarCompiler(default_model_dir, 49152, [2])
        nested = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10**19, "maximum": 10**19 + 5}}}
        with pytest.raises(GrammarError) as e:
            await c.compile(SamplingParams(json_schema=nested))
        assert e.value.field == "sampling.json_schema"
        assert e.value.message.startswith("json_schema: minimum 10000000000000000000 at /properties/n is outside")
        assert await c.compile(SamplingParams(json_schema={"type": "integer", "minimum": -(2**40), "maximum": 5}))
        deep: dict = {}
        inner = deep
        for _ in range(5000):  # past Python's recursion: a refusal, not a RecursionError out of the compile thread
            inner["items"] = inner = {}
        with pytest.raises(GrammarError, match="nests too deeply"):
            await c.compile(SamplingParams(json_schema=deep))
        with pytest.raises(GrammarError) as e:
            await c.compile(SamplingParams(regex="[^\\d\\D]"))
        assert e.value.message.startswith("the constraint matches no text")
    asyncio.run(go())
