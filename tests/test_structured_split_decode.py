"""Pure-decode steps with grammar masks run the split decode graphs (body, the masks bound, head): the tokens of the
whole-step decode graph under the same masks (captured on CUDA; on the CPU the same Triton kernels, called eagerly)."""

from __future__ import annotations

import pytest
import torch

from executor_proc.step.step_kinds import GraphStep
from executor_proc.testing.synthetic import GREEDY, SyntheticPlanner
from tests.test_gpu_fastpath import TOP_K_P, built, write_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: padded lanes
VOCAB = 97


def test_split_decode_equals_whole_step_graph(tmp_path):
    worker = built(write_config(tmp_path, layers=1, vocab=VOCAB), DEVICE, kernels="triton", max_batch=4).worker
    tables = worker.tables
    table = torch.full((tables.num_slots + 1, -(-VOCAB // 32)), -1, dtype=torch.int32, device=DEVICE)
    tables.grammar_mask = table
    planner = SyntheticPlanner(num_slots=6, block_size=4, num_blocks=256)
    planner.add([3, 4, 5, 6, 7])
    planner.add([9, 8, 7], TOP_K_P)
    planner.add([11, 12, 13, 14], GREEDY)
    gen = torch.Generator().manual_seed(0)
    compared = 0
    for i in range(4):
        step = worker.prepare(planner.step())
        if not isinstance(step, GraphStep):  # the prefill step
            worker.launch(step)
            continue
        slots = worker.graphs.inputs[0, :step.rows].tolist()
        allowed = {}
        for slot in slots[:2]:  # two constrained rows, one free
            words = torch.randint(-2**31, 2**31 - 1, (table.shape[1],), generator=gen, dtype=torch.int64)
            table[slot] = words.to(torch.int32).to(DEVICE)
            allowed[slot] = {t for t in range(VOCAB) if (int(words[t // 32]) >> (t % 32)) & 1}
        table[slots[2]] = -1
        mode = step.mode._replace(masked=True)
        last = tables.last_token.clone()
        whole = worker.graphs.run(step.bucket, mode).head(step.rows).tokens.clone()
        tables.last_token.copy_(last)  # the same step again: the same KV written, the same input tokens
        bound = []
        split = worker.split.run(step.bucket, step.rows, mode, lambda: bound.append(True)).tokens
        assert bound == [True]
        assert split.tolist() == whole.tolist(), i
        for slot, token in zip(slots, split.tolist()):
            assert slot not in allowed or token in allowed[slot]
        compared += 1
    assert compared == 3
    assert (worker.split.bodies and worker.split.heads) if DEVICE == "cuda" else not worker.split.bodies


def test_constrained_requests_through_the_worker(tmp_path, default_model_dir):
    """Through prepare / launch / the output thread's advance, as the executor runs them: a regex-constrained
    request among free ones decodes through the split graphs and its text follows the regex."""
    import re

    from ipc.protocol import SlotSampling
    from scheduler_proc.grammar import to_grammar

    regex = "[0-9]{3}-[A-F]{2}=[a-p]{8}"  # single-character tokens, all below the tiny vocabulary's 97
    worker = built(write_config(tmp_path, layers=1, vocab=VOCAB), DEVICE, kernels="triton", max_batch=4,
                   tokenizer=f"{default_model_dir}/tokenizer.json").worker
    runs = []
    run = worker.split.run
    worker.split.run = lambda *a: runs.append(a[0]) or run(*a)
    planner = SyntheticPlanner(num_slots=6, block_size=4, num_blocks=256)
    planner.add([3, 4, 5], GREEDY)
    prompt = [6, 7, 8, 9]
    planner.add(prompt, SlotSampling(0.9, 0, 1.0, 0.0, 5, num_prompt_tokens=len(prompt),
                                     grammar=to_grammar("regex", regex)))
    planner.add([10, 11], TOP_K_P)
    out = []
    for _ in range(6):
        step = worker.prepare(planner.step())
        host, copy = worker.copy_out(worker.launch(step))
        if copy is not None:
            copy.synchronize()
        tokens = list(host) if isinstance(host, list) else host.tolist()
        if copy is not None:
            copy.release()
        if step.outputs.grammar is not None:
            j = next(j for j, st, _ in step.outputs.grammar.rows)
            out.append(tokens[j])
            worker.grammar.advance(step.outputs.grammar, tokens)
    text = worker.grammar.tokenizer.decode_str(out)
    assert re.fullmatch("[0-9]{3}-[A-F]{2}", text), text  # 6 one-character tokens of the regex
    assert len(runs) == 5  # every step after the prefill

