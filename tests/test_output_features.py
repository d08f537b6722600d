"""Stop strings, min_tokens, logprobs, prompt logprobs and n > 1 completions, at pipeline depths 0, 1 and 2.

The planner runs against the scripted executor (tests/planner_harness.py) with a fake
tokenizer (token t is one letter), so a stop string can be placed to complete in any
generated token, spanning one, two or three tokens: the client must see the oracle's
stream at every depth, and nothing past the stop (the tokens already in flight are
dropped).  The scripted executor returns fake logprobs that depend on the token and its
position, so a logprob lost, duplicated or attached to another token shows.
"""

from __future__ import annotations

import itertools

import pytest

from executor_proc.testing.scripted import default_token
from tests.planner_harness import EOS, VOCAB, assert_drained, distinct_runs, fake_detokenize, run
from tests.test_lifecycle_exhaustive import STOP, blocks_for, bursts, check_case

DEPTHS = [0, 1, 2]


def natural_output(seed: int, prompt_len: int, max_tokens: int) -> list[int]:
    """What the script samples for a request with no EOS placed."""
    return [default_token(seed, prompt_len + k, VOCAB) for k in range(max_tokens)]


@pytest.mark.parametrize("depth", DEPTHS)
def test_stop_string_completing_in_every_token(depth):
    """A stop string spanning 1, 2 or 3 tokens completes in generated token k, for every k; with and without
    min_tokens and logprobs; the stream ends at the token that completes it, whatever is in flight.  (Token k
    has k + 1 tokens up to it: a longer span is the same stop string; budget 2 holds a 1-token prompt as 64
    does.)"""
    stop_drops = set()
    for block_size, prompt_len, max_tokens, budget, burst, span, (min_tokens, logprobs) in itertools.product(
            (1, 4), (1, 3, 6), range(1, 6), (2, 64), bursts(depth), (1, 2, 3), ((0, None), (2, 2))):
        if prompt_len <= budget < 64:
            continue
        text = fake_detokenize(natural_output(0, prompt_len, max_tokens))
        for k in range(span - 1, max_tokens):
            stop = text[max(0, k - span + 1): k + 1]
            spec = dict(prompt_len=prompt_len, max_tokens=max_tokens, stop_strings=("zz", stop),
                        min_tokens=min(min_tokens, max_tokens), logprobs=logprobs, prompt_logprobs=logprobs)
            trace, planner, ex = run([spec], depth=depth, block_size=block_size, budget=budget, burst=burst,
                                     num_blocks=blocks_for(prompt_len + max_tokens, block_size))
            check_case(trace, planner, ex)
            got = trace.tokens["r0"]
            if trace.finishes["r0"] == ["stop"]:
                assert trace.stop_strs["r0"] == stop and fake_detokenize(got).endswith(stop)
                assert stop not in fake_detokenize(got[:-1])  # the first completion ends the stream
                assert trace.dropped["r0"] <= depth
                stop_drops.add(trace.dropped["r0"])
            else:
                assert trace.stop_strs["r0"] is None and len(got) == max_tokens
    assert stop_drops == set(range(depth + 1)), "stop strings did not land at every in-flight offset"


@pytest.mark.parametrize("depth", DEPTHS)
def test_stop_string_only_in_the_prompt_does_not_stop(depth):
    prompt_len, max_tokens = 8, 6
    trace, _, _ = run([dict(prompt_len=prompt_len, max_tokens=max_tokens)], depth=depth)
    prompt_text = fake_detokenize(trace.requests["r0"].prompt)
    out_text = fake_detokenize(natural_output(0, prompt_len, max_tokens))
    stop = next(prompt_text[i:i + 3] for i in range(len(prompt_text) - 2) if prompt_text[i:i + 3] not in out_text)
    trace, planner, ex = run([dict(prompt_len=prompt_len, max_tokens=max_tokens, stop_strings=(stop,))], depth=depth)
    check_case(trace, planner, ex)
    assert trace.finishes["r0"] == ["length"] and len(trace.tokens["r0"]) == max_tokens


@pytest.mark.parametrize("depth", DEPTHS)
def test_min_tokens_holds_back_eos_and_stop_tokens(depth):
    """EOS or a stop token sampled at k < min_tokens does not end the request (the executor masks it)."""
    for k, min_tokens, burst in itertools.product(range(5), range(6), bursts(depth)):
        for script in ({"eos_at": {0: k}}, {"tokens_at": {0: {k: STOP}}}):
            spec = dict(prompt_len=3, max_tokens=6, stop=(STOP,), min_tokens=min_tokens)
            trace, planner, ex = run([spec], depth=depth, burst=burst, **script)
            check_case(trace, planner, ex)
            got = trace.tokens["r0"]
            assert not set(got[:min_tokens]) & {EOS, STOP}, (k, min_tokens, got)
            assert trace.finishes["r0"] == (["stop"] if k >= min_tokens else ["length"])


@pytest.mark.parametrize("depth", DEPTHS)
def test_logprobs_through_preemption_and_shared_prompts(depth):
    """Two requests asking for logprobs and prompt logprobs in tight pools (preempted and recomputed, their
    prompts shared or not): every token's logprobs once, in order; the prompt's once, whole.  Pools from the
    smallest legal size up to one that never runs short, budgets 3 and 64, the second arrival at every tick
    (the runs left out plan exactly what one made: distinct_runs)."""
    bs, preempted = 2, set()
    for p0, p1, shared, num_slots, burst in itertools.product((3, 5), (2, 5), (False, True), (1, 2), bursts(depth)):
        specs = [dict(prompt_len=p0, max_tokens=4, logprobs=1, prompt_logprobs=2),
                 dict(prompt_len=p1, max_tokens=3, logprobs=0, prompt_logprobs=0, stop=(STOP,))]
        prompts = {1: [7] * p1, 0: [7] * p0} if shared else None
        need = [blocks_for(p0 + 4, bs), blocks_for(p1 + 3, bs)]
        for trace, planner, ex in distinct_runs(
                specs, range(max(need), sum(need) + 1), (3, 64), num_slots, [{1: t} for t in range(4)], depth=depth,
                block_size=bs, burst=burst, prompts=prompts, eos_at={1: 2}):
            check_case(trace, planner, ex)
            preempted |= trace.preempted_inflight
    assert set(range(min(depth, 1), depth + 1)) <= preempted, f"preemptions covered: {preempted}"


@pytest.mark.parametrize("depth", DEPTHS)
def test_n_completions_prefill_the_prompt_once(depth):
    """n = 3: completions 1 and 2 wait for completion 0's first token, then find the prompt's blocks cached;
    each streams what an n = 1 request with its own seed would."""
    prompt = [11 + i for i in range(9)]  # two full blocks of 4, and one token
    for num_slots, burst, budget in itertools.product((1, 3), bursts(depth), (4, 64)):
        specs = [dict(prompt_len=9, max_tokens=5, seed=100 + i, logprobs=1) for i in range(3)]
        trace, planner, ex = run(specs, depth=depth, num_slots=num_slots, num_blocks=16, block_size=4,
                                 budget=budget, prompts={i: prompt for i in range(3)}, leaders={1: 0, 2: 0},
                                 burst=burst)
        check_case(trace, planner, ex)
        assert planner.prefix.hit_tokens == 2 * 8, planner.prefix.hit_tokens
        assert len({tuple(t) for t in trace.tokens.values()}) == 3


@pytest.mark.parametrize("depth", DEPTHS)
def test_n_completions_aborted_while_held_or_running(depth):
    """A completion aborted at every half tick, while held for its leader or running; the leader aborted too."""
    prompt = [11 + i for i in range(6)]
    specs = [dict(prompt_len=6, max_tokens=4, seed=100 + i) for i in range(3)]
    common = dict(depth=depth, num_blocks=16, block_size=2, prompts={i: prompt for i in range(3)},
                  leaders={1: 0, 2: 0})
    for victim, half in itertools.product((0, 1), range(16)):
        trace, planner, ex = run(specs, aborts={victim: half / 2}, **common)
        check_case(trace, planner, ex, aborted={f"r{victim}"})
        assert not planner.followers
    assert_drained(planner)


def test_stop_matcher_finds_long_and_overlapping_stop_strings_across_tokens():
    """The incremental matcher against a plain search of the whole text, for every prefix of random outputs."""
    import random

    from scheduler_proc.outputs import StopMatcher

    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(40) for _ in range(30)]
        text = fake_detokenize(tokens)
        stops = [text[i:i + n] for i, n in ((rng.randrange(25), rng.randint(1, 12)) for _ in range(3))] + ["zzz"]
        matcher, found = StopMatcher(stops, fake_detokenize), None
        for k, t in enumerate(tokens):
            found = matcher.feed(t)
            if found is not None:
                break
        ends = {s: text.find(s) + len(s) for s in stops if s in text}
        first = min(ends.values())
        assert k + 1 == first and ends[found] == first, (stops, k, found)


@pytest.mark.parametrize("field,value,limit", [
    ("stop", ["x"] * 17, "at most 16"), ("stop", [""], "1 to 256 bytes"), ("stop", ["\u00e9" * 129], "1 to 256"),
    ("logprobs", 21, "[0, 20]"), ("prompt_logprobs", -1, "[0, 20]"),
    ("repetition_penalty", 0.0, "(0, 2]"), ("repetition_penalty", 2.5, "(0, 2]"),
    ("repetition_penalty", float("nan"), "finite"), ("frequency_penalty", -2.5, "[-2, 2]"),
    ("presence_penalty", float("inf"), "finite"), ("logit_bias", {5: 101.0}, "[-100, 100]"),
    ("logit_bias", {1000: 1.0}, "out of range"), ("logit_bias", {i: 1.0 for i in range(301)}, "at most 300"),
    ("min_tokens", 9, "[0, max_tokens=8]"), ("min_tokens", -1, "[0, max_tokens"), ("n", 0, "[1, 16]"),
    ("n", 17, "[1, 16]"), ("temperature", 1e39, "[0, 10000]"),
])
def test_validation_names_field_and_limit(field, value, limit):
    from ipc import protocol as p
    from scheduler_proc.limits import Limits
    from scheduler_proc.validate import InvalidRequest, validate_generate

    limits = Limits(4, 64, 4, 512, 64, frozenset({EOS}), vocab_size=VOCAB)
    msg = p.Generate("r", [5, 6], p.SamplingParams(max_tokens=8, **{field: value}))
    with pytest.raises(InvalidRequest) as e:
        validate_generate(msg, limits)
    assert e.value.field == f"sampling.{field}" and limit in e.value.message, e.value.message
    ok = p.SamplingParams(max_tokens=8, stop=["ab", "\u00e9" * 128], logprobs=20, prompt_logprobs=0, n=16,
                          repetition_penalty=2.0, frequency_penalty=-2, presence_penalty=2, min_tokens=8,
                          logit_bias={i: -100.0 for i in range(300)})
    validate_generate(p.Generate("r", [5, 6], ok), limits)


def test_a_context_the_kv_cache_sets_is_named_with_its_flags():
    """The server lowers the context to what its KV cache holds: a request past it is told so, with the flags."""
    from ipc import protocol as p
    from scheduler_proc.limits import Limits
    from scheduler_proc.validate import InvalidRequest, validate_generate

    for blocks, bound in ((64, "--num-kv-blocks"), (200, None)):  # 64 x 4 = 256 tokens: the cache sets it
        limits = Limits(4, blocks, 4, 256, 64, frozenset({EOS}), vocab_size=VOCAB)
        for prompt, max_tokens in (([5] * 256, 1), ([5] * 200, 100)):
            with pytest.raises(InvalidRequest) as e:
                validate_generate(p.Generate("r", prompt, p.SamplingParams(max_tokens=max_tokens)), limits)
            assert "context length is 256" in e.value.message and (bound in e.value.message if bound else
                                                                    "KV cache" not in e.value.message)
