"""Steps with prefill chunks through the bucketed mixed-step runner (graphs on CUDA, eager calls on the CPU).

On the CPU the Triton kernels run in the interpreter and the runner calls its body and
head eagerly on its static buffers, so everything but the capture is checked against
today's eager path (the same kernels, no padding) and the torch path: chunked prompts,
admissions mid-decode, a release, greedy / top-k / min-p rows, penalties and logprobs,
prompt logprobs (which stay eager).  On CUDA the same scenario runs through captured
graphs in float32, and a pipelined loop of mixed and prefill-only steps runs under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch

from executor_proc.step.mixed_step import MixedShape, pack, row_buckets, token_buckets
from executor_proc.step.plan_rows import plan_rows
from executor_proc.step.sample import SamplingMode
from executor_proc.step.step_kinds import EagerStep, GraphStep, MixedStep
from executor_proc.testing.synthetic import GREEDY, SyntheticPlanner
from ipc.protocol import SlotSampling, StepPlan
from tests.test_gpu_fastpath import (MIN_P, TOP_K_P, built, features, run_feature_plans, uncaptured,
                                     write_config)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: padded lanes


def test_buckets():
    assert token_buckets(16) == [8, 16]
    assert token_buckets(100) == [8, 16, 32, 48, 64, 96, 100]
    t = token_buckets(2048)
    assert t[:9] == [8, 16, 32, 48, 64, 96, 128, 192, 256] and t[-3:] == [1792, 1920, 2048]
    assert all(b - a <= 128 for a, b in zip(t, t[1:]))
    assert row_buckets(6) == [6] and row_buckets(64) == [8, 32, 64] and row_buckets(256) == [8, 32, 128, 256]


def test_a_step_reading_more_hidden_rows_than_tokens_takes_a_larger_bucket():
    """16 speculative rows of 5 tokens read 96 hidden rows (each row's sampled position and its 5 drafted ones):
    more than the 80-token bucket's rows, so the step runs in the 96-token bucket rather than eagerly."""
    from executor_proc.step.mixed_graphs import MixedGraphs

    graphs = MixedGraphs(None, None, max_tokens=2048, max_rows=256, pad_slot=256, hidden_size=8,
                         dtype=torch.float32, device=torch.device("cpu"), capture=False)
    rows = plan_rows(StepPlan(0, list(range(16)), [5] * 16, [40] * 16, [True] * 16, [True] * 16,
                              prefill_tokens=[1] * 80))
    assert graphs.shape_for(rows) == MixedShape(96, 32, 256, 1)
    assert graphs.shape_for(rows, min_rows=96) == MixedShape(96, 96, 256, 1)
    assert graphs.shape_for(rows, min_rows=257) is None


def test_pack_layout():
    """Decode rows first, padding after the real tokens and rows, tiles only for prefill rows."""
    plan = StepPlan(0, slots=[3, 1, 4], num_tokens=[1, 20, 5], positions=[9, 0, 30], is_prefill=[False, True, True],
                    sample=[True, False, True], prefill_tokens=list(range(100, 125)))
    shape = MixedShape(tokens=32, rows=8, max_rows=8)
    rows = plan_rows(plan)
    buf = pack(rows, shape, pad_slot=6)
    r = shape.max_rows
    assert buf[:r].tolist() == [3, 4] + [6] * 6  # sampled rows' slots, then the pad slot
    assert buf[r:2 * r].tolist() == [10, 35] + [0] * 6
    at, parts = 2 * r, {}
    for name, n in shape.lengths().items():
        parts[name], at = buf[at:at + n], at + n
    assert parts["ids"][:26].tolist() == [-1] + list(range(100, 125)) and not parts["ids"][26:].any()
    assert parts["token_slots"].tolist() == [3] + [1] * 20 + [4] * 5 + [6] * 6
    assert parts["positions"][:26].tolist() == [9] + list(range(20)) + list(range(30, 35))
    assert parts["query_start"].tolist() == [0, 1, 21, 26] + [26] * 5
    assert parts["context_lens"][:3].tolist() == [10, 20, 35] and parts["decode_lens"].tolist() == [10] + [0] * 7
    assert parts["sample_index"][:2].tolist() == [0, 25]
    assert shape.tile_m == 32  # one tile per prefill row; the one with more keys (row 2: 35) first
    assert parts["tiles"][:5].tolist() == [2, 2, 0, 1, 0]
    grouped = MixedShape(tokens=32, rows=8, max_rows=8, group=8)  # 8 heads x 16 tokens: 128 score rows
    tiles = pack(rows, grouped, pad_slot=6)[-grouped.lengths()["tiles"]:]
    assert grouped.tile_m == 16 and tiles[:7].tolist() == [3, 2, 0, 1, 1, 1, 0]  # keys 35, 20, 16


def scenario(vocab: int, chunk: int = 6, steps: int = 12, events: tuple[int, ...] = (2, 4, 6, 8)):
    """Chunked prompts, decode rows beside them, admissions mid-decode (at the first three ``events``), a release
    (at the last one); every sampling kind."""
    planner = SyntheticPlanner(num_slots=6, block_size=4, num_blocks=256, chunk_size=chunk)
    g = torch.Generator().manual_seed(3)
    prompt = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    planner.add(prompt(5))
    planner.add(prompt(15), TOP_K_P)
    planner.add(prompt(9), features(1))  # penalties, logit_bias, min_tokens, logprobs
    plans = []
    for i in range(steps):
        if i == events[0]:
            planner.add(prompt(13), MIN_P)
        if i == events[1]:
            planner.add(prompt(8), features(2))
        if i == events[2]:
            planner.add(prompt(7), SlotSampling(0.0, 0, 1.0, 0.0, 0, prompt_logprobs=2, num_prompt_tokens=7))
        if i == events[3]:
            planner.release(0)
        plans.append(planner.step())
    return plans


def test_mixed_runner_matches_eager_path(tmp_path):
    """The runner (captured on CUDA, called eagerly on the CPU) vs today's eager path vs torch, float32."""
    model_dir = write_config(tmp_path)
    # on the CPU the admissions at steps 1-3 and the release at 5: every kind of step (chunks beside decode rows,
    # prompt logprobs, pure decode after the release) once or twice, not repeated for 12 steps
    plans = scenario(vocab=97) if CUDA else scenario(vocab=97, steps=6, events=(1, 2, 3, 5))
    runs = {name: run_feature_plans(built(model_dir, DEVICE, max_batch=6, **kw).worker, plans, kinds=True)
            for name, kw in (("torch", dict(kernels="torch")), ("eager", dict(kernels="triton", mixed_graphs="off")),
                             ("mixed", dict(kernels="triton")))}
    for name in ("eager", "mixed"):
        assert [t for _, t, _ in runs[name]] == [t for _, t, _ in runs["torch"]], name
        for (_, _, fa), (_, _, fb) in zip(runs[name], runs["torch"]):
            assert fa.get("logprob_rows") == fb.get("logprob_rows")
            assert fa.get("prompt_logprob_rows") == fb.get("prompt_logprob_rows")
            for la, lb in zip(fa.get("logprobs", []), fb.get("logprobs", [])):
                assert la.top_ids == lb.top_ids and abs(la.logprob - lb.logprob) < 1e-4
    kinds = [k for k, _, _ in runs["mixed"]]
    with_prefill = [any(p.is_prefill) for p in plans]
    lp_slot = next(a.slot for p in plans for a in p.admits if a.sampling.prompt_logprobs >= 0)
    prompt_lp = [any(s == lp_slot and pre for s, pre in zip(p.slots, p.is_prefill)) for p in plans]
    assert any(prompt_lp) and any(not p for p in prompt_lp)
    for kind, prefill, lp in zip(kinds, with_prefill, prompt_lp):
        assert kind == (EagerStep if lp else MixedStep if prefill else GraphStep).__name__, kinds
    assert any(f.get("logprobs") for _, _, f in runs["mixed"])


def test_mixed_runner_prefill_only_and_no_sample(tmp_path):
    """Prefill-only steps, a step whose chunks sample nothing, 1 to 6 rows: the runner equals the eager path."""
    model_dir = write_config(tmp_path)
    # on the CPU half the tokens: the same steps (3 chunks, 2 chunks then the last token, ...), rows and samples
    chunk, lengths = (11, (30, 12, 23, 16)) if CUDA else (5, (14, 6, 11, 8))
    planner = SyntheticPlanner(num_slots=6, block_size=4, num_blocks=256, chunk_size=chunk)
    g = torch.Generator().manual_seed(5)
    prompt = lambda n: torch.randint(0, 97, (n,), generator=g).tolist()  # noqa: E731
    for n in lengths:
        planner.add(prompt(n), GREEDY, max_new_tokens=3)
    plans = [planner.step()]
    assert len(plans[0].slots) == 4 and not any(plans[0].sample)
    planner.add(prompt(1), GREEDY, max_new_tokens=3)
    planner.add(prompt(5), TOP_K_P, max_new_tokens=3)
    plans += [planner.step() for _ in range(8)]
    eager = run_feature_plans(built(model_dir, DEVICE, kernels="triton", mixed_graphs="off").worker, plans)
    mixed = run_feature_plans(built(model_dir, DEVICE, kernels="triton").worker, plans, kinds=True)
    assert [t for _, t, _ in mixed] == [t for t, _ in eager]
    assert mixed[0][0] == MixedStep.__name__ and mixed[0][1] == []


@needs_cuda
def test_mixed_graphs_equal_uncaptured_runner(tmp_path):
    """Captured bodies and heads give bit-identical tokens and logprobs (bf16) to the same runner called eagerly."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    plans = scenario(vocab=1000)
    shape = dict(dtype="bfloat16", num_slots=6, max_batch=6, block_size=4, num_blocks=256)
    graphed = built(model_dir, "cuda", kernels="triton", **shape).worker
    eager = uncaptured(built(model_dir, "cuda", kernels="triton", **shape).worker)
    eager.model.backend.use_choices_of(graphed.model.backend)
    a, b = run_feature_plans(graphed, plans), run_feature_plans(eager, plans)
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, fa), (_, fb) in zip(a, b):
        for la, lb in zip(fa.get("logprobs", []), fb.get("logprobs", [])):
            assert la.top_ids == lb.top_ids and la.logprob == lb.logprob


@needs_cuda
def test_mixed_loop_does_not_synchronize(tmp_path):
    """Pipelined mixed, prefill-only and decode steps (chunked prompts, penalties, logprobs) under sync debug."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    worker = built(model_dir, "cuda", "bfloat16", num_slots=16, max_batch=16, num_blocks=2048,
                   max_num_batched_tokens=256).worker
    planner = SyntheticPlanner(num_slots=16, block_size=4, num_blocks=2048, chunk_size=40)
    sampling = features(1)  # greedy with penalties and logprobs: one sampling mode for every row
    worker.capture_graphs(modes=[SamplingMode(True, penalised=True, logprobs=True)])  # no lazy capture below
    in_flight: deque = deque()
    kinds: list[tuple[str, bool]] = []  # (kind of step, prefill only)

    def step(plan):
        s = worker.prepare(plan)
        if plan.slots:  # a plan without rows (nobody running) is a table diff, eager
            kinds.append((type(s).__name__, all(plan.is_prefill)))
        host, copy = worker.copy_out(worker.launch(s), s)
        in_flight.append((host, copy))
        while len(in_flight) > 2:
            old_host, old_copy = in_flight.popleft()
            if old_copy is not None:
                old_copy.synchronize()
                old_host.tolist()
                old_copy.release()

    def add(k: int, n: int) -> None:
        for r in range(k):
            planner.add(list(range(r, r + n + 7 * r)), sampling, max_new_tokens=12)

    add(3, 20)
    for _ in range(3):
        step(planner.step())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(150):
            if i in (5, 40):
                add(4, 50)  # chunks of 40 beside decode rows
            if i == 100:
                add(6, 60)  # nobody is running by then: prefill-only steps
            step(planner.step())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    mixed = MixedStep.__name__
    assert (mixed, False) in kinds and (mixed, True) in kinds, kinds  # decode rows beside chunks; chunks alone
    assert sum(k == GraphStep.__name__ for k, _ in kinds) >= 30 and all(k != EagerStep.__name__ for k, _ in kinds)
