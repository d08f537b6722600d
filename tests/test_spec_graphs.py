"""A pure speculative step as decode rows in one graph (executor_proc/step/spec_graphs.py) against the mixed runner.

One worker on a tiny random model (captured on a GPU, called on the same static buffers on the CPU), the same
hand-built plans with the path switched off (every speculative step then runs its rows as prefill chunks through the
mixed-step runner), then on: three requests prefilled, then n-gram speculative rows at the planner's upper-bound
positions (a plain row, and the first speculative row after it, where the slot is: the planner knows it there, and
each test's result then does not depend on what an earlier one left in the tables). Every step's result is the same
token for token, and each step that should takes the path, rows of fewer than ``K`` drafts (a paused request's 0)
and a plain greedy row beside them included; a sampled row beside them does not. Three rows run padded to a bucket
of four; with four slots that is more decode rows (16) than the attention workspace's batch (5), which Triton's
attention then runs in fewer splits (on the GPU).
"""

from __future__ import annotations

import pytest
import torch

from executor_proc.build import build_worker
from executor_proc.step.step_kinds import SpecDecodeStep
from ipc.config import ExecutorConfig, SpeculativeConfig
from ipc.protocol import Admit, SlotSampling, StepPlan
from tests.test_gpu_fastpath import write_config

K = 3
BLOCK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    folder = write_config(tmp_path_factory.mktemp("spec_graphs"))
    cfg = ExecutorConfig(model=folder, load_format="dummy", plan_addr="", result_addr="", device=DEVICE,
                         dtype="float32", num_slots=4, num_kv_blocks=64, block_size=BLOCK, mixed_graphs="on",
                         max_num_batched_tokens=64, speculative=SpeculativeConfig(method="ngram", num_tokens=K))
    return build_worker(cfg).worker


def greedy(**kw) -> SlotSampling:
    return SlotSampling(**{"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 3, **kw})


PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9], [20, 21, 22, 23, 24, 20, 21]]


def run(worker, schedule: list[tuple[list[int], list[int]]]) -> tuple[list[list[int]], list[bool]]:
    """Admit :data:`PROMPTS` (slots 0-2: greedy, greedy, sampled), prefill them, then run ``schedule``: per step,
    the rows' slots and their draft counts (-1: a plain row).  Each step's host tokens, and whether it took the
    graphs' path."""
    samplings = [greedy(), greedy(), greedy(temperature=0.7)]
    appends = [x for slot in range(3) for i in range(5) for x in (slot, i, slot * 5 + i)]
    admits = [Admit(slot, s, PROMPTS[slot]) for slot, s in enumerate(samplings)]
    lens = [len(p) for p in PROMPTS]
    plan = StepPlan(0, [0, 1, 2], lens, [0, 0, 0], [True] * 3, [True] * 3,
                    prefill_tokens=[t for p in PROMPTS for t in p], block_appends=appends, admits=admits,
                    releases=[0, 1, 2])
    outs, paths = [], []
    bound = list(lens)  # each slot's position upper bound: its next row's first
    exact = list(lens)  # and where it is (from the last step's accepted counts): a plain row's position
    for step_id, (slots, drafts) in enumerate([([], [])] + schedule):
        if step_id:
            qlens = [k + 1 if k >= 0 else 1 for k in drafts]
            positions = [bound[s] if k >= 0 else exact[s] for s, k in zip(slots, drafts)]
            plan = StepPlan(step_id, slots, qlens, positions, [False] * len(slots), [True] * len(slots),
                            num_drafts=drafts)
            for s, n, p in zip(slots, qlens, positions):
                bound[s] = p + n
        step = worker.prepare(plan)
        paths.append(isinstance(step, SpecDecodeStep))
        host, copy = worker.copy_out(worker.launch(step), step)
        if copy is not None:  # the CUDA ring's pinned buffer
            copy.synchronize()
        out = host if isinstance(host, list) else host.tolist()
        if step.outputs.spec is not None:  # as the StepResult carries them
            tokens, fields = step.outputs.spec.split(out)
            out = tokens + fields["spec_tokens"] + fields["num_accepted"]
            accepted = iter(fields["num_accepted"])
            for s, k in zip(slots, drafts):
                exact[s] += 1 + (next(accepted) if k >= 0 else 0)
        elif step_id:
            for s in slots:
                exact[s] += 1
        outs.append(out)
        if copy is not None:
            copy.release()
    return outs, paths


def test_graphs_give_the_eager_steps_tokens(worker):
    assert worker.spec_graphs is not None
    schedule = [([0, 1], [K, K])] * 4 + [([0], [K])] * 2 + [([0, 1], [K, K - 1])] + [([0, 1], [K, K])] * 2 \
        + [([2, 0, 1], [-1, K, K])] + [([0, 1, 2], [K, K, K])] + [([0, 1], [0, K]), ([0], [0])] \
        + [([0, 1], [K, K])] * 3 + [([1, 0], [K, -1])]
    graphs, worker.spec_graphs = worker.spec_graphs, None
    want, eager_paths = run(worker, schedule)
    worker.spec_graphs = graphs
    got, paths = run(worker, schedule)
    assert got == want
    assert not any(eager_paths)
    taken = [True] * 9 + [False, False] + [True] * 6  # rows of K - 1 and 0 drafts, a plain one; not a sampled row
    assert paths == [False] + taken
    accepted = sum(sum(out[-sum(k >= 0 for k in ks):]) for out, (_, ks), t in zip(want[1:], schedule, taken) if t)
    assert accepted > 0  # the random model's loops are found in its own tokens: acceptance is exercised


def test_positions_past_a_rows_drafts_write_no_kv(worker):
    """A row of 0 drafts beside a drafting one runs ``K + 1`` positions: the ``K`` past its own write no KV (they may
    lie past the blocks the planner reserved for the row).  (A step whose every row has 0 drafts runs one position a
    row.)"""
    run(worker, [([0, 1], [K, K])] * 2 + [([1], [0])])
    base = int(worker.spec.lengths[1])  # slot 1's next row starts here; blocks 5.. are slot 1's
    def kv(first: int, last: int) -> torch.Tensor:  # [layers, k|v, positions of slot 1, heads, dim]
        return worker.kv_cache.storage[:, :, 5:10].flatten(2, 3)[:, :, first:last].cpu().clone()

    worker.kv_cache.storage[:, :, 5 + base // BLOCK, base % BLOCK] = 0
    own, before = kv(base, base + 1), kv(base + 1, base + K + 1)
    base0 = int(worker.spec.lengths[0])
    step = worker.prepare(StepPlan(99, [1, 0], [1, K + 1], [base, base0], [False] * 2, [True] * 2, num_drafts=[0, K]))
    assert isinstance(step, SpecDecodeStep) and step.outputs.spec.width == K
    worker.launch(step)
    assert not torch.equal(kv(base, base + 1), own)  # its own position is written
    assert torch.equal(kv(base + 1, base + K + 1), before)
    length = int(worker.spec.lengths[1])
    step = worker.prepare(StepPlan(100, [1], [1], [length], [False], [True], num_drafts=[0]))
    assert isinstance(step, SpecDecodeStep) and step.outputs.spec.width == 0  # one position a row
    worker.launch(step)
    assert int(worker.spec.lengths[1]) == length + 1


def test_a_step_of_the_last_rows_stages_nothing(worker):
    """A step of the same slots and draft counts as the last one staged, every row at its device length, finds its
    arrays on the device (no upload, no copy: a lone request speculating pays a plain step's host work); rows
    that start at the plan's position (a slot's first speculative row, a plain row) or other rows stage theirs.
    Every step's tokens are the eager ones."""
    schedule = [([0, 1], [K, K])] * 3 + [([0], [K])] * 2 + [([0, 1], [K, K])] * 2 + [([1, 0], [K, -1])] \
        + [([1, 0], [K, K])] * 2
    graphs, worker.spec_graphs = worker.spec_graphs, None
    want, _ = run(worker, schedule)
    worker.spec_graphs = graphs
    staged = []
    stage = graphs.stage
    graphs.stage = lambda step, rows, upload: staged.append(rows.slots.tolist()) or stage(step, rows, upload)
    try:
        got, paths = run(worker, schedule)
    finally:
        del graphs.stage
    assert got == want and all(paths[1:])
    # each first step of new rows (or of rows at plan positions: first rows, a plain row, slot 0's next) stages
    assert staged == [[0, 1], [0, 1], [0], [0, 1], [1, 0], [1, 0], [1, 0]], staged


@pytest.mark.parametrize("method,invariant", [("ngram", False), ("draft", False), ("ngram", True)])
def test_attention_workspace_holds_every_mixed_step_row(tmp_path, monkeypatch, method, invariant):
    """Triton's decode attention keeps partials for every row count a step may run as one-token rows: the
    mixed-step body's hidden rows (K + 2 a slot under either method) past the decode steps' batch, a speculative
    graph's K + 1 a row, batch-invariant ones at the one split count; with the split counts of the CPU and of a
    132-SM GPU (16 slots and K = 4: 96 rows, more than 17 slots of K + 1 positions, overran the GPU's)."""
    import kernels.decode_attention as attention

    folder = write_config(tmp_path)
    spec = SpeculativeConfig(method=method, num_tokens=4, draft_model=folder if method == "draft" else "")
    cfg = ExecutorConfig(model=folder, load_format="dummy", plan_addr="", result_addr="", device="cpu",
                         dtype="float32", kernels="triton", batch_invariant=invariant, num_slots=16, num_kv_blocks=64,
                         block_size=BLOCK, mixed_graphs="on", max_num_batched_tokens=64, speculative=spec)
    worker = build_worker(cfg).worker
    backend = worker.model.backend
    assert worker.mixed.max_rows == 96
    rows = list(worker.mixed.row_buckets)
    if worker.spec_graphs is not None:
        rows += [bucket * 5 for bucket in worker.spec_graphs.buckets]
    for sms in (8, 132):
        monkeypatch.setattr(attention, "_num_sms", lambda device, sms=sms: sms)
        for r in rows:
            splits = backend._num_splits(r)
            assert splits == 8 if invariant else splits >= 1
            backend.workspace.partials(r, splits)  # asserts that the rows and their splits fit


@pytest.mark.parametrize("num_kv_heads, head_dim", [(3, 64), (8, 128), (1, 64)])
def test_a_few_slots_speculative_rows_keep_the_default_attention_splits(monkeypatch, num_kv_heads, head_dim):
    """A speculative step's rows past the decode batch get the split count the default rule gives their row
    count, not fewer for want of room: one slot at K = 8 is 9 rows, on a 132-SM GPU 16 splits at the default
    model's shape (the workspace had room for 2: its verify step 0.97 ms on an H200 against 0.71)."""
    import kernels.decode_attention as attention
    from executor_proc.backends.triton_backend import TritonBackend

    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    heads = 3 * num_kv_heads
    for slots, values in ((1, 10), (2, 6), (16, 10), (64, 5)):
        max_rows = (slots + 1) * values
        backend = TritonBackend(torch.ones(head_dim // 2), 64, heads, num_kv_heads, head_dim, slots + 1,
                                torch.device("cpu"), max_decode_rows=max_rows)
        for rows in range(1, max_rows + 1):
            want = attention.default_num_splits(rows, num_kv_heads, "cpu", head_dim=head_dim)
            assert backend._num_splits(rows) == want, (slots, rows)
            backend.workspace.partials(rows, want)
        held = backend.workspace.capacity * heads * head_dim * 4
        assert held <= max(4 << 20, (slots + 1) * 16 * heads * head_dim * 4), held  # a few MiB at most


WIDE_256 = [16, 32, 64, 128, 256]


@pytest.mark.parametrize("slots, k, small, wide", [(1, 0, [1], []), (1, 4, [1, 2, 4, 8], []),
                                                   (1, 8, [1, 2, 4, 8, 16], []), (5, 0, [1, 2, 4, 8], []),
                                                   (256, 0, [1, 2, 4, 8, 16], WIDE_256),
                                                   (256, 4, [1, 2, 4, 8, 16], WIDE_256)])
def test_the_start_up_tunes_the_rows_a_speculative_step_runs(slots, k, small, wide):
    """A speculative step runs each row's K + 1 positions as decode rows: with few slots the skinny kernels are
    tuned up to that many rows' bucket (one slot at K = 8: the "dot" forms of 16), not only the slots'; the tiled
    matmul's sizes stay the decode graphs' buckets."""
    from executor_proc.backends.select import tuned_sizes
    from executor_proc.backends.triton_backend import TritonBackend

    spec = SpeculativeConfig(method="ngram", num_tokens=k) if k else SpeculativeConfig()
    cfg = ExecutorConfig(model="", plan_addr="", result_addr="", device="cuda", num_slots=slots, speculative=spec)
    assert tuned_sizes(cfg, TritonBackend, torch.device("cuda")) == (small, wide)
    assert tuned_sizes(cfg, TritonBackend, torch.device("cpu")) == ([], [])  # the tuner runs on CUDA only
