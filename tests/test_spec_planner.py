"""Speculative rows under run-ahead, against the scripted executor (scheduler_proc/speculation.py).

Each case runs through :func:`tests.planner_harness.run`: the planner's ``check_integrity()`` after every
operation, the harness's own ledger of what each step in flight may write (a speculative row from its slot's
exact length, at most the drafts in flight below its planned position), and the script's oracle for what every
client sees.  The script accepts a chosen number of each row's drafts: every count from 0 to K, and mixtures.
"""

from __future__ import annotations

import itertools

import random

import pytest

from tests.planner_harness import assert_client_view, assert_drained, assert_logprobs, expected, run

K = 3
STOP = 3


def check(trace, planner, ex, aborted=(), max_len=512):
    assert_drained(planner)
    assert_client_view(trace, expected(trace, ex, max_len), set(aborted))
    assert_logprobs(trace)  # each token's own, accepted runs included


def constant(a):
    return lambda seed, pos, k: min(a, k)


def finishes(max_tokens):
    """(run kwargs, request 0's extras) for a finish of request 0 at every generated index."""
    yield {}, {}
    for i in range(max_tokens):
        yield {"eos_at": {0: i}}, {}
        yield {"tokens_at": {0: {i: STOP}}}, {"stop": (STOP,)}
    yield {}, {"stop_strings": ("cd",)}
    yield {"eos_at": {0: 1}}, {"min_tokens": 3, "ignore_eos": True}
    for i in range(5):  # EOS masked while fewer than min_tokens outputs exist, then a stop inside a run
        yield {"eos_at": {0: i}, "tokens_at": {0: {i + 2: STOP}}}, {"min_tokens": 3, "stop": (STOP,)}


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_every_accept_count_every_finish(depth):
    """Every accepted count 0..K with every finish of a speculating request beside a plain and a speculating
    mate: each finish lands inside an accepted run at every offset."""
    for accepted in range(K + 1):
        for kwargs, extra in finishes(7):
            specs = [dict(prompt_len=5, max_tokens=7, **extra), dict(prompt_len=6, max_tokens=9, logprobs=2),
                     dict(prompt_len=3, max_tokens=4, prompt_logprobs=1)]  # prompt logprobs: no speculation
            trace, planner, ex = run(specs, depth=depth, num_speculative_tokens=K, accept=constant(accepted),
                                     **kwargs)
            check(trace, planner, ex)
            if not kwargs and not extra and accepted == K:  # K + 1 tokens a step once past the prompts
                assert trace.steps <= 2 + 9 // (K + 1) + 2, trace.steps


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_preemption_aborts_and_shared_prefixes(depth):
    """A pool too small for every worst case (preemption while drafts are in flight), aborts at every tick,
    shared prompts and the host tier, with mixed accepted counts."""
    rng = random.Random(depth)
    preempted, aborted_running = set(), 0
    for case in range(12):
        n = 4
        specs = [dict(prompt_len=rng.randint(2, 9), max_tokens=rng.randint(1, 12), logprobs=rng.choice((None, 0, 2)))
                 for _ in range(n)]
        aborts = {rng.randrange(n): rng.randint(0, 8) + rng.choice((0, 0.5))}
        prompts = {i: [7] * 8 + [i] for i in range(n) if rng.random() < 0.5}
        trace, planner, ex = run(specs, depth=depth, num_slots=3, num_blocks=12, block_size=2,
                                 num_speculative_tokens=K, accept=lambda s, p, k: (s + p) % (k + 1),
                                 arrivals={i: rng.randint(0, 4) for i in range(n)}, aborts=aborts,
                                 prompts=prompts, num_host_blocks=8 if case % 2 else 0, burst=case % 3 == 0,
                                 prefill_ahead=bool(case % 2), lookup_ngram=case % 4 == 3)  # rows without drafts too
        check(trace, planner, ex, aborted={f"r{i}" for i in aborts})
        preempted |= trace.preempted_inflight
        aborted_running += sum(s[0] == "running" for s in trace.abort_states)
    assert preempted - {0} and aborted_running, (preempted, aborted_running)  # coverage


@pytest.mark.parametrize("depth", [1, 2])
def test_swap_resume_and_siblings(depth):
    """Preempted speculating requests come back by copy from the host tier (their generated blocks published at
    drain, exactly the KV that was written), and n > 1 siblings share the leader's prompt."""
    swapped = 0
    for accepted in (0, 2, K):
        specs = [dict(prompt_len=9, max_tokens=30, ignore_eos=True) for _ in range(4)]
        trace, planner, ex = run(specs, depth=depth, num_slots=3, num_blocks=26, block_size=2, num_host_blocks=64,
                                 backup_lag=1, num_speculative_tokens=K, accept=constant(accepted),
                                 leaders={3: 2}, prompts={3: [5 + (2 * 7 + i) % 90 for i in range(9)]},
                                 arrivals={1: 2, 3: 1})
        check(trace, planner, ex)
        swapped += trace.swapped_in
    assert swapped, "no preempted request came back from the host tier"


def test_length_near_the_context():
    """Drafts are cut to what max_tokens and the context can still take; nothing is planned past either."""
    for accepted in range(K + 1):
        trace, planner, ex = run([dict(prompt_len=10, max_tokens=50), dict(prompt_len=3, max_tokens=2)], depth=2,
                                 max_len=20, num_speculative_tokens=K, accept=constant(accepted))
        check(trace, planner, ex, max_len=20)
        assert len(trace.tokens["r0"]) == 10


@pytest.mark.parametrize("accepted", [0, K])
def test_executor_restart_with_drafts_in_flight(accepted):
    """A restart at every step, with speculative rows two steps ahead: every request is recomputed from its tokens
    (its drafts in flight forgotten), the new executor's slots start over, and every stream is still exact."""
    from executor_proc.testing.scripted import ScriptedRunner, expected_output
    from scheduler_proc.limits import Limits
    from scheduler_proc.planner import Planner
    from tests.planner_harness import make_request

    def runner():
        return ScriptedRunner(3, 40, 2, num_speculative_tokens=K, accept=constant(accepted))

    for restart_at in range(1, 16):
        planner = Planner(Limits(3, 40, 2, 512, 16, frozenset({2}), num_speculative_tokens=K), prefix_cache_id="m")
        reqs = [make_request(i, prompt_len=5 + i, max_tokens=9, ignore_eos=True) for i in range(4)]
        for r in reqs:
            planner.add(r)
        ex, inflight, step = runner(), [], 0
        while planner.has_work or inflight:
            while len(inflight) < 3 and (plan := planner.plan()) is not None:
                inflight.append(plan)
            if step == restart_at:
                planner.restart()
                ex, inflight = runner(), []
            elif inflight:
                planner.reconcile(ex.execute(inflight.pop(0)))
            planner.check_integrity()
            step += 1
        for r in reqs:
            want, _ = expected_output(ex.token_at, seed=r.seed, prompt_len=len(r.prompt), max_tokens=9,
                                      max_model_len=512, eos_token_ids=())
            assert r.output == want and r.status.value == "finished", (restart_at, r.rid)
        assert planner.blocks.num_free == 40 and planner.slots.num_free == 3


def run_rejecting_then_accepting(depth: int, k: int, spec_pauses: bool = True,
                                 accepts=lambda p: p >= 60) -> tuple[list[str], int]:
    """One request whose drafts are all rejected below position 60 and all accepted above (``accepts(position)``:
    whether a row there accepts all), through a planner at ``depth``; its output checked against the script's;
    the kind of each of its decode steps ("spec" or "plain") and the free blocks at the end."""
    from executor_proc.testing.scripted import ScriptedRunner, expected_output
    from scheduler_proc.limits import Limits
    from scheduler_proc.planner import Planner
    from tests.planner_harness import make_request

    ex = ScriptedRunner(2, 80, 4, num_speculative_tokens=k, accept=lambda s, p, n: n if accepts(p) else 0)
    planner = Planner(Limits(2, 80, 4, 512, 16, frozenset({2}), num_speculative_tokens=k, spec_pauses=spec_pauses),
                      prefix_cache_id="m")
    req = make_request(0, prompt_len=6, max_tokens=100, ignore_eos=True)
    planner.add(req)
    kinds, inflight = [], []
    while planner.has_work or inflight:
        while len(inflight) <= depth and (plan := planner.plan()) is not None:
            inflight.append(plan)
            if not plan.is_prefill[0]:
                kinds.append("spec" if plan.num_drafts else "plain")
        planner.reconcile(ex.execute(inflight.pop(0)))
        planner.check_integrity()
    want, _ = expected_output(ex.token_at, seed=req.seed, prompt_len=6, max_tokens=100, max_model_len=512,
                              eos_token_ids=())
    assert req.output == want
    return kinds, planner.blocks.num_free


def runs_of(kinds: list[str]) -> list[tuple[str, int]]:
    return [(k, sum(1 for _ in g)) for k, g in itertools.groupby(kinds)]


@pytest.mark.parametrize("depth", [0, 2])
def test_rows_that_keep_rejecting_pause_then_speculate_again(depth):
    """Nothing accepted for a while: the request runs plain decode rows (from its exact position, once its drafts
    in flight are back), then speculates again, its pauses doubling from PAUSE_MIN steps while nothing is
    accepted; then everything is accepted."""
    from scheduler_proc.speculation import PAUSE_MIN

    kinds, free = run_rejecting_then_accepting(depth, K)
    runs = runs_of(kinds)
    assert runs[0][0] == "spec" and runs[0][1] >= 6, runs  # six rows of none bring the mean below PAUSE_BELOW
    pauses = [n for kind, n in runs if kind == "plain"]
    assert pauses[:3] == [PAUSE_MIN, 2 * PAUSE_MIN, 4 * PAUSE_MIN], runs
    assert runs[-1][0] == "spec" and len(kinds) < 100 - 5  # speculating again, and accepted: fewer steps
    assert free == 80


def test_an_accepted_draft_makes_the_next_pause_short_again():
    """Pauses double while nothing is accepted; rows that accept (positions 30 to 33 here, in its third run of
    speculative rows) set the next pause back to PAUSE_MIN steps; PAUSE_MAX bounds them."""
    from scheduler_proc.speculation import PAUSE_MAX, PAUSE_MIN, pause_steps

    kinds, free = run_rejecting_then_accepting(1, K, accepts=lambda p: 30 <= p < 34)
    pauses = [n for kind, n in runs_of(kinds) if kind == "plain"]
    assert pauses[:3] == [PAUSE_MIN, 2 * PAUSE_MIN, PAUSE_MIN], kinds
    assert pause_steps(0) == PAUSE_MIN and pause_steps(100) == PAUSE_MAX and free == 80


def test_ends_in_repeat_counts_the_tokens_as_they_come():
    """The n-grams counted as tokens arrive, one or several at a time, give a plain scan's answer at every length:
    whether the last ``n`` known tokens occur earlier among them."""
    from scheduler_proc.speculation import ends_in_repeat
    from tests.planner_harness import make_request

    rng = random.Random(5)
    for n in (1, 2, 3):
        req = make_request(0, prompt_len=rng.randint(1, 6), max_tokens=99)
        req.prompt = [rng.randrange(6) for _ in req.prompt]
        req.spec_grams, req.spec_indexed = {}, 0
        while len(req.output) < 60:
            req.output += [rng.randrange(6) for _ in range(rng.choice((0, 1, 1, 3)))]
            seq = req.prompt + req.output
            want = len(seq) >= n and any(seq[e - n:e] == seq[-n:] for e in range(n, len(seq)))
            assert ends_in_repeat(req, n) == want, (n, seq)


@pytest.mark.parametrize("depth", [0, 1])
def test_rows_get_drafts_only_where_the_known_tokens_end_in_a_repeat(depth):
    """n-gram drafts (``Limits.spec_lookup_ngram``): a row gets drafts only where the request's tokens known when it
    is planned end in a token seen earlier among them; before that its rows run without drafts (speculative rows of
    one position, which count as none in the metrics), and the output is the script's all the same."""
    from executor_proc.testing.scripted import ScriptedRunner
    from scheduler_proc.limits import Limits
    from scheduler_proc.planner import Planner
    from tests.planner_harness import make_request

    req = make_request(0, prompt_len=10, max_tokens=30)
    prompt = list(req.prompt)  # ten distinct tokens; the output: new tokens to position 20, then the prompt again
    token = lambda seed, pos: 200 + pos if pos < 20 else prompt[(pos - 20) % 10]  # noqa: E731
    ex = ScriptedRunner(2, 80, 4, num_speculative_tokens=K, accept=lambda s, p, k: k, token_fn=token)
    planner = Planner(Limits(2, 80, 4, 512, 16, frozenset({2}), num_speculative_tokens=K, spec_lookup_ngram=1),
                      prefix_cache_id="m")
    planner.add(req)
    inflight, rows = [], []  # (tokens known when planned, drafts)
    while planner.has_work or inflight:
        while len(inflight) <= depth and (plan := planner.plan()) is not None:
            if plan.num_drafts:
                rows.append((req.num_known, plan.num_drafts[0]))
            inflight.append(plan)
        planner.reconcile(ex.execute(inflight.pop(0)))
        planner.check_integrity()
    assert req.output == [token(0, 10 + i) for i in range(30)]
    assert rows and all(k == 0 for known, k in rows if known <= 20), rows  # positions 0-19: no token twice
    assert all(k > 0 for known, k in rows if 20 < known <= 30), rows  # the copy: each last token seen before
    drafted = sum(k > 0 for _, k in rows)
    assert 0 < planner.spec_drafts.rows <= drafted < len(rows), (planner.spec_drafts.rows, rows)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_a_lone_request_has_a_row_in_every_step(depth):
    """One speculating request, its drafts accepted and rejected in stretches (pauses and resumes), ending by EOS
    inside an accepted run: every plan the pipeline has room for carries its row until its finish is known (the
    executor never waits on the scheduler for it, at pauses or anywhere), and at most ``depth`` rows run past it."""
    from executor_proc.testing.scripted import ScriptedRunner
    from scheduler_proc.limits import Limits
    from scheduler_proc.planner import Planner
    from scheduler_proc.speculation import PAUSE_MIN
    from tests.planner_harness import make_request

    accept = lambda s, p, n: n if p < 30 or p >= 60 else 0  # noqa: E731  (a paused stretch between)
    for eos in range(70, 78):
        ex = ScriptedRunner(2, 80, 4, num_speculative_tokens=K, accept=accept, eos_at={0: eos})
        planner = Planner(Limits(2, 80, 4, 512, 16, frozenset({2}), num_speculative_tokens=K), prefix_cache_id="m")
        req = make_request(0, prompt_len=6, max_tokens=100)
        planner.add(req)
        inflight, rows, plain, wasted = [], 0, 0, None
        while planner.has_work or inflight:
            while len(inflight) <= depth and (plan := planner.plan()) is not None:
                assert plan.slots == [req.slot], plan
                inflight.append(plan)
                rows += 1
                plain += not plan.num_drafts and not plan.is_prefill[0]
            assert len(inflight) == depth + 1 or req.status.value == "finished", (eos, rows, len(inflight))
            planner.reconcile(ex.execute(inflight.pop(0)))
            planner.check_integrity()
            if req.status.value == "finished" and wasted is None:
                wasted = len(inflight)  # its rows planned before its finish came back
        assert req.finish_reason == "stop" and len(req.output) == eos - 6 + 1, (eos, req.output)
        assert wasted <= depth and rows < len(req.output) and plain >= PAUSE_MIN, (eos, wasted, rows, plain)


def test_the_start_up_line_counts_the_tokens_a_step():
    from ipc.config import SpeculativeConfig

    assert SpeculativeConfig().banner() == ""
    assert SpeculativeConfig(method="ngram", num_tokens=1).banner() == (
        ", speculation: 1 token a step from n-grams of 1-4 tokens")
    assert SpeculativeConfig(method="draft", num_tokens=4, draft_model="d").banner() == (
        ", speculation: 4 tokens a step from a draft model")
