"""Speculative decoding with a draft model (executor_proc/step/draft.py): its passes' inputs, its KV cache after
every accepted count, the flags, and a start-up that refuses another vocabulary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor_proc.model.kv_cache import KVCache
from executor_proc.model.loader import load_model
from executor_proc.step.batch import ForwardBatch
from executor_proc.step.draft import DraftModel, chunk_context_lens, chunk_inputs, decode_inputs
from executor_proc.step.plan_rows import plan_rows
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.staging import PinnedStaging
from ipc.protocol import StepPlan
from tests.test_gpu_fastpath import write_config

K = 3
BS = 4  # tokens per block
CPU = torch.device("cpu")


def test_chunk_positions_and_tokens_at_the_start_of_a_context():
    """The chunk covers base - K .. base; below position 0 it repeats position 0's token and writes the scratch
    block; the decode passes go on from base + 1, and past a row's k drafts repeat base + k into the scratch."""
    tokens = torch.arange(100, 140, dtype=torch.int32)[None].repeat(2, 1)  # position p holds token 100 + p
    block_table = torch.tensor([[5, 2, 7, 1, 0, 0, 0, 0, 0, 0], [0] * 10], dtype=torch.int32)
    scratch = 64 * BS
    slots = torch.zeros(6, dtype=torch.int64)
    base = torch.arange(6)  # 0 .. K + 2: every short context, then a full chunk
    ks = torch.tensor([0, 1, 2, 3, 3, 3])
    ids, pos, kv = chunk_inputs(tokens, block_table, slots, ks, base, K, BS, scratch)
    for b in range(6):
        want = [p for p in range(b - K, b + 1)]
        assert pos[b].tolist() == [max(0, p) for p in want]
        assert ids[b].tolist() == [100 + max(0, p) for p in want]
        blocks = block_table[0].tolist()
        assert kv[b].tolist() == [blocks[p // BS] * BS + p % BS if p >= 0 else scratch for p in want]
    for j in range(1, K):
        p, kv_j = decode_inputs(block_table, slots, ks, base, j, BS, scratch)
        assert p.tolist() == [b + min(j, k) for b, k in zip(range(6), ks.tolist())]
        assert kv_j.tolist() == [block_table[0, q // BS].item() * BS + q % BS if j <= k else scratch
                                 for q, k in zip(p.tolist(), ks.tolist())]
    # a graph bucket's padded row (k = -1): position 0 everywhere, every KV write to the scratch block
    pad = torch.tensor([1]), torch.tensor([-1]), torch.tensor([0])
    ids, pos, kv = chunk_inputs(tokens, block_table, *pad, K, BS, scratch)
    assert pos.tolist() == [[0] * (K + 1)] and kv.tolist() == [[scratch] * (K + 1)]
    assert all(decode_inputs(block_table, *pad, j, BS, scratch)[1].tolist() == [scratch] for j in range(1, K))
    # a context as long as the chunk gets a host bound one larger (the torch backend then masks by position)
    assert chunk_context_lens(np.array([0, K - 1, K, K + 1]), K, 40).tolist() == [1, K, K + 2, K + 2]
    assert chunk_context_lens(np.array([K]), K, K + 1).tolist() == [K + 1]  # no room in the block table


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    """A 2-layer random model (vocabulary 97) as the draft, on the torch backend, with a KV cache of 32 blocks."""
    model, _ = load_model(write_config(tmp_path_factory.mktemp("draft")), "dummy", CPU, torch.float32)
    draft = DraftModel(model, K, BS, torch.float32, CPU)
    draft.allocate(32)
    return draft


def prefill_batch(tables: SlotTables, slot: int, prompt: list[int]) -> ForwardBatch:
    """The model's eager batch of one prefill row (what the draft's first pass reads a prompt chunk from)."""
    n = len(prompt)
    pos = torch.arange(n)
    return ForwardBatch(
        input_ids=torch.tensor(prompt), positions=pos,
        kv_index=tables.block_table[slot, pos // BS].to(torch.int64) * BS + pos % BS,
        query_start=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=tables.block_table[[slot]], sample_index=None, sample_slots=torch.tensor([slot]),
        host_query_lens=[n], host_context_lens=[n], block_size=BS)


def draft_step(draft: DraftModel, tables: SlotTables, token_table: torch.Tensor, spec: list[tuple[int, int, int]],
               prefill: tuple[int, list[int]] | None = None):
    """One step's draft passes: speculative rows ``(slot, base, k)`` (the plan's position is the exact base here),
    then a prompt chunk ``(slot, tokens)``; the drafts ``[R, K]`` (None without speculative rows)."""
    slots = [s for s, _, _ in spec] + ([prefill[0]] if prefill else [])
    qlens = [k + 1 for _, _, k in spec] + ([len(prefill[1])] if prefill else [])
    plan = StepPlan(0, slots, qlens, [b for _, b, _ in spec] + ([0] if prefill else []),
                    [False] * len(spec) + [True] * bool(prefill), [True] * len(slots),
                    prefill_tokens=prefill[1] if prefill else [],
                    num_drafts=[k for _, _, k in spec] + [-1] * bool(prefill))
    upload = PinnedStaging(CPU).upload()
    step = draft.stage(plan_rows(plan), np.arange(len(spec)), tables.max_blocks * BS, upload)
    batch = prefill_batch(tables, *prefill) if prefill else None
    if batch is not None:  # the model's batch: its prefill row after the speculative rows' tokens
        n = sum(qlens[:len(spec)])
        batch.input_ids = torch.cat([torch.zeros(n, dtype=torch.int64), batch.input_ids])
        batch.positions = torch.cat([torch.zeros(n, dtype=torch.int64), batch.positions])
        batch.kv_index = torch.cat([torch.zeros(n, dtype=torch.int64), batch.kv_index])
        batch.context_lens = torch.cat([torch.ones(len(spec), dtype=torch.int32), batch.context_lens])
        batch.block_tables = torch.cat([tables.block_table[[s for s, _, _ in spec]], batch.block_tables])
    draft.apply(step, upload.send(), batch)
    rows = tuple(torch.tensor(x) for x in zip(*spec)) if spec else None
    return draft.run(step, tables, token_table, rows and (rows[0], rows[2], rows[1]))


def reference(model, tokens: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Each layer's K of ``tokens`` from one prefill in a fresh cache, and the greedy continuation of ``steps``
    tokens (a whole prefill per token: no cache reused)."""
    out = []
    for i in range(steps + 1):
        seq = tokens + out
        n = len(seq)
        kv = KVCache(model.config, -(-n // BS), BS, CPU, torch.float32)
        pos = torch.arange(n)
        batch = ForwardBatch(torch.tensor(seq), pos, pos, torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.arange(-(-n // BS), dtype=torch.int32)[None],
                             torch.tensor([n - 1]), torch.tensor([0]), [n], [n], BS)
        logits = model(batch, kv)
        if i == 0:
            keys = [k.view(-1, *k.shape[2:])[:n] for k in kv.k]
        if i < steps:
            out.append(int(logits[0].argmax()))
    return keys, out


def draft_keys(draft: DraftModel, tables: SlotTables, slot: int, n: int) -> list[torch.Tensor]:
    """Each layer's K of the slot's first ``n`` positions in the draft's cache."""
    pos = torch.arange(n)
    index = tables.block_table[slot, pos // BS].to(torch.int64) * BS + pos % BS
    return [k.view(-1, *k.shape[2:])[index] for k in draft.kv.k]


def test_drafts_and_draft_kv_after_every_accepted_count(tiny_draft):
    """From a one-token prompt (short contexts: padded chunks) through rows accepting K, 0, 1, .., K drafts and a
    row of fewer drafts: each row's drafts are the draft model's greedy continuation of the accepted tokens, and
    its cache holds their KV as one prefill computes it, whatever the earlier rows left there (rejected drafts' KV).
    A second prompt's chunk rides in the same first pass."""
    draft, model = tiny_draft, tiny_draft.model
    tables = SlotTables(2, 16, CPU, 97)
    tables.block_table[0, :16] = torch.arange(16)
    tables.block_table[1, :8] = torch.arange(16, 24)
    table = torch.zeros(3, 64 + K + 2, dtype=torch.int32)  # the speculator's token table
    accepted = [11]  # the slot's tokens: a one-token prompt
    table[0, 0] = accepted[0]
    draft_step(draft, tables, table, [], (0, accepted))
    other = [7, 3, 9, 41, 5, 2]
    gen = torch.Generator().manual_seed(0)
    for i, (k, a) in enumerate([(K, K), (K, 0), (K, 1), (K, 2), (K, K), (1, 1), (2, 0), (K, 3), (K, 0)]):
        base = len(accepted) - 1
        drafts = draft_step(draft, tables, table, [(0, base, k)], (1, other) if i == 2 else None)
        keys, want = reference(model, accepted, k)
        assert drafts[0, :k].tolist() == want, i
        for got, ref in zip(draft_keys(draft, tables, 0, len(accepted)), keys):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # the verify: a drafts accepted, then a token of the model's (another than the next draft, or the bonus)
        nxt = int(torch.randint(0, 97, (1,), generator=gen))
        if a < k and nxt == want[a]:
            nxt = (nxt + 1) % 97
        accepted += want[:a] + [nxt]
        table[0, :len(accepted)] = torch.tensor(accepted, dtype=torch.int32)
    keys, _ = reference(model, other, 0)  # the prompt that rode along
    for got, ref in zip(draft_keys(draft, tables, 1, len(other)), keys):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_flags_name_each_other():
    from scheduler_proc.launch import build_parser, server_config

    def config(*flags):
        return server_config(build_parser().parse_args(["serve", *flags])).executor

    with pytest.raises(ValueError, match=r"^--speculative-method draft needs --draft-model PATH"):
        config("--speculative-method", "draft")
    with pytest.raises(ValueError, match=r"^--draft-model needs --speculative-method draft \(got --speculative-method "
                                         r"ngram\)"):
        config("--speculative-method", "ngram", "--draft-model", "/")
    with pytest.raises(ValueError, match=r"^--draft-model needs --speculative-method draft \(got --speculative-method "
                                         r"off\)"):
        config("--draft-model", "/")
    with pytest.raises(ValueError, match=r"^--draft-load-format needs --speculative-method draft"):
        config("--draft-load-format", "dummy")
    with pytest.raises(ValueError, match=r"^--draft-model '/no/such/model' does not exist"):
        config("--speculative-method", "draft", "--draft-model", "/no/such/model")
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 1, got 2"):
        config("--speculative-method", "draft", "--draft-model", "/", "-tp", "2")
    sc = config("--speculative-method", "draft", "--draft-model", ".", "--num-speculative-tokens", "2").speculative
    assert (sc.method, sc.num_tokens, sc.draft_load_format) == ("draft", 2, None) and sc.draft_model.startswith("/")
    helps = {a.dest: a.help for a in build_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    assert helps["draft_model"] and helps["draft_load_format"] and "draft" in helps["speculative_method"]


def test_a_draft_of_another_vocabulary_is_refused_in_one_line(tmp_path):
    """A real `forerun serve` with a random model (vocabulary 97) and a random draft of vocabulary 101."""
    import os
    import subprocess
    import sys

    from tests.server_proc import ROOT, python_path

    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    model, draft = write_config(tmp_path / "m"), write_config(tmp_path / "d", vocab=101)
    path = python_path()  # packages carried there too
    env = dict(os.environ, PYTHONPATH=path, FORERUN_RUN_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "serve", "--quiet", "--load-format", "dummy",
                          "--model", model, "--speculative-method", "draft", "--draft-model", draft,
                          "--max-num-seqs", "1", "--address", f"ipc://{tmp_path}/s.sock"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    assert lines[0] == (f"forerun: --draft-model {draft} has a vocabulary of 101 tokens, the model 97: the draft must "
                        f"share the model's tokenizer and vocabulary"), out


@pytest.mark.parametrize("depth", [0, 2])
def test_a_draft_models_rows_never_pause(depth):
    """Nothing accepted for 60 positions: with a draft model (``Limits.spec_pauses`` off: its KV cache follows the
    speculative rows only) the request keeps running speculative rows, and its output is the script's."""
    from tests.test_spec_planner import run_rejecting_then_accepting

    kinds, free = run_rejecting_then_accepting(depth, K, spec_pauses=False)
    assert set(kinds) == {"spec"} and free == 80


def test_graph_buckets_pad_rows_into_the_scratch_block(tiny_draft):
    """The graphs' function on a bucket of 4 for 3 rows (run uncaptured, as on the CPU): the real rows' drafts are
    those of the rows alone, and the padded row (the padding slot, whose block table is all block 0) writes nothing
    but the scratch block."""
    from executor_proc.step.draft import DraftStep
    from executor_proc.step.draft_graphs import DraftGraphs

    draft = tiny_draft
    tables = SlotTables(4, 16, CPU, 97)
    for slot in range(3):
        tables.block_table[slot, :10] = torch.arange(1 + 10 * slot, 11 + 10 * slot)  # never block 0
    table = torch.randint(0, 97, (5, 64 + K + 2), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    draft.kv.storage.normal_(generator=torch.Generator().manual_seed(2))
    slots, ks, base = torch.tensor([2, 0, 1]), torch.tensor([K, 1, 2]), torch.tensor([9, 1, 30])
    step = DraftStep(3, 0, [K + 1] * 3, (base + 2).tolist(),
                     [(base + 1 + ks.clamp(max=j)).tolist() for j in range(1, K)])
    want = draft.spec_passes(tables, table, slots, ks, base, step.context_lens, step.decode_context_lens)
    block0, kept = draft.kv.storage[:, :, 0].clone(), draft.kv.storage[:, :, :32].clone()
    graphs = DraftGraphs(draft, tables, table, 4, CPU, capture=False, capturer=None)
    assert graphs.buckets == [1, 2, 4] and graphs.bucket_for(3) == 4
    got = graphs.run(step, slots, ks, base)
    assert torch.equal(got, want)
    assert torch.equal(draft.kv.storage[:, :, 0], block0)  # the padded row's block
    torch.testing.assert_close(draft.kv.storage[:, :, :32], kept)  # the real rows rewrote what they wrote before
    assert graphs.rows[:, 3].tolist() == [4, -1, 0]


def test_a_draft_made_for_fewer_positions_is_named_at_start_up(tmp_path):
    """A draft of 64 positions under a model of 512 starts (its drafts are verified like any), and the start-up
    line says past which position they are seldom accepted; a draft of the model's positions adds nothing."""
    import json

    from ipc.config import SpeculativeConfig
    from tests.test_gpu_fastpath import built

    (tmp_path / "m").mkdir()
    (tmp_path / "d").mkdir()
    model, draft = write_config(tmp_path / "m"), write_config(tmp_path / "d", layers=1)
    short = json.loads((tmp_path / "d" / "config.json").read_text()) | {"max_position_embeddings": 64}
    (tmp_path / "d" / "config.json").write_text(json.dumps(short))
    spec = SpeculativeConfig(method="draft", num_tokens=2, draft_model=draft)
    note = built(model, "cpu", num_slots=2, num_blocks=128, speculative=spec).plan_note
    assert note == (f"; --draft-model {draft} was made for 64 positions, fewer than the 512 a request may hold: "
                    f"past them its drafts are seldom accepted"), note
    spec = SpeculativeConfig(method="draft", num_tokens=2, draft_model=model)
    assert built(model, "cpu", num_slots=2, num_blocks=128, speculative=spec).plan_note == ""
