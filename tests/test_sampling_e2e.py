"""The executor's sampling features on the default model (float32, CPU torch backend) against HF.

Executor-level: a worker from ``build_worker`` and hand-built StepPlans (no processes).
Logprobs and prompt logprobs (a prompt in chunks) against ``log_softmax`` of HF
transformers' logits on the same GGUF; repetition penalty against HF ``generate``;
frequency / presence against the OpenAI formula on HF's logits; logit_bias forcing and
banning; min_tokens holding back an EOS; seeded sampling with penalties the same alone
and in a batch of 8.
"""

from __future__ import annotations


import pytest
import torch

from executor_proc.build import build_worker
from ipc.config import ExecutorConfig
from ipc.protocol import Admit, SlotSampling, StepPlan

BLOCK = 16
TOL = 1e-4


@pytest.fixture(scope="module")
def worker(default_model_dir):
    cfg = ExecutorConfig(model=default_model_dir, plan_addr="", result_addr="", device="cpu", dtype="float32",
                         num_slots=33, num_kv_blocks=33 * 8, block_size=BLOCK, kernels="torch")
    return build_worker(cfg).worker


def hf_log_softmax(hf_model, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]``: row i is the distribution of the token after position i."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1), logits


def sampling(**kw) -> SlotSampling:
    base = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    base.update(kw)
    return SlotSampling(**base)


class Requests:
    """Hand-built plans for requests in fixed slots: prompts in chunks, then one decode row per step."""

    def __init__(self, worker):
        self.worker = worker
        self.slots: list[int] = []
        self.next_block = 0

    def run(self, prompts: list[list[int]], samplings: list[SlotSampling], new_tokens: int,
            chunk: int = 10**9) -> tuple[list[list[int]], list[dict]]:
        """Admit every prompt (prefilled in ``chunk``-token pieces, all in the same steps), decode
        ``new_tokens`` in all; returns the tokens per request and each step's result fields."""
        slots = list(range(len(prompts)))
        appends, admits = [], []
        for slot, (prompt, s) in zip(slots, zip(prompts, samplings)):
            admits.append(Admit(slot, s, prompt if s.reads_tokens else []))
            for i in range(-(-(len(prompt) + new_tokens) // BLOCK)):
                appends += [slot, i, self.next_block]
                self.next_block = (self.next_block + 1) % (33 * 8)
        tokens: list[list[int]] = [[] for _ in prompts]
        fields: list[dict] = []
        pos = [0] * len(prompts)
        first = True
        while len(tokens[0]) < new_tokens:
            rows, prefill_tokens = [], []
            for slot, prompt in zip(slots, prompts):
                p = pos[slot]
                if p < len(prompt):
                    n = min(chunk, len(prompt) - p)
                    rows.append((slot, n, p, True, p + n == len(prompt)))
                    prefill_tokens += prompt[p:p + n]
                else:
                    rows.append((slot, 1, p, False, True))
                    n = 1
                pos[slot] = p + n
            cols = [list(c) for c in zip(*rows)]
            plan = StepPlan(len(fields), cols[0], cols[1], cols[2], cols[3], cols[4], prefill_tokens=prefill_tokens,
                            block_appends=appends if first else [], admits=admits if first else [],
                            releases=slots if first else [])
            first = False
            step = self.worker.prepare(plan)
            host, _ = self.worker.copy_out(self.worker.launch(step), step)
            out = host if isinstance(host, list) else host.tolist()
            sampled = [r[0] for r in rows if r[4]]
            for slot, tok in zip(sampled, out):
                tokens[slot].append(tok)
            f = step.outputs.result_fields()
            f["sampled_slots"] = sampled
            fields.append(f)
        return tokens, fields


def test_logprobs_and_prompt_logprobs_match_hf(worker, hf_model, chat_prompt_ids):
    prompt = chat_prompt_ids[2]
    s = sampling(logprobs=5, prompt_logprobs=3, num_prompt_tokens=len(prompt))
    tokens, fields = Requests(worker).run([prompt], [s], new_tokens=8, chunk=7)
    lsm, _ = hf_log_softmax(hf_model, prompt + tokens[0])
    P = len(prompt)
    assert tokens[0] == lsm[P - 1:P - 1 + 8].argmax(-1).tolist()
    got = [lp for f in fields for lp in f.get("logprobs", [])]
    assert len(got) == 8
    for k, lp in enumerate(got):
        ref = lsm[P - 1 + k]
        assert abs(lp.logprob - ref[tokens[0][k]].item()) < TOL
        top_v, top_i = ref.topk(5)
        assert lp.top_ids == top_i.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top_v.tolist())) < TOL
    prompt_lps: dict[int, object] = {}
    for f in fields:
        for (row, first), values in zip(f.get("prompt_logprob_rows", []), f.get("prompt_logprobs", [])):
            for j, v in enumerate(values):
                assert first + j not in prompt_lps, "a prompt position reported twice"
                prompt_lps[first + j] = v
    assert sorted(prompt_lps) == list(range(1, P)), "every prompt position but 0, once"
    for t, v in prompt_lps.items():
        ref = lsm[t - 1]
        assert abs(v.logprob - ref[prompt[t]].item()) < TOL
        top_v, top_i = ref.topk(3)
        assert v.top_ids == top_i.tolist()
        assert max(abs(a - b) for a, b in zip(v.top_logprobs, top_v.tolist())) < TOL


def test_rows_that_ask_nothing_get_no_logprobs(worker, chat_prompt_ids):
    prompts = chat_prompt_ids[:2]
    s = [sampling(), sampling(logprobs=0, num_prompt_tokens=len(prompts[1]))]
    _, fields = Requests(worker).run(prompts, s, new_tokens=3)
    for f in fields:
        assert f["logprob_rows"] == [1] and len(f["logprobs"]) == 1
        assert f["logprobs"][0].top_ids == [] and "prompt_logprob_rows" not in f


def test_repetition_penalty_matches_hf_generate(worker, hf_model, chat_prompt_ids):
    prompt = chat_prompt_ids[1]
    s = sampling(repetition_penalty=1.3, num_prompt_tokens=len(prompt))
    tokens, _ = Requests(worker).run([prompt], [s], new_tokens=16)
    with torch.inference_mode():
        x = torch.tensor([prompt])
        ref = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                                repetition_penalty=1.3, eos_token_id=None, pad_token_id=2)[0, len(prompt):]
    assert tokens[0] == ref.tolist()


def test_frequency_and_presence_follow_the_openai_formula(worker, hf_model, chat_prompt_ids):
    prompt = chat_prompt_ids[3]
    freq, pres = 0.9, 0.6
    s = sampling(frequency_penalty=freq, presence_penalty=pres, num_prompt_tokens=len(prompt))
    tokens, _ = Requests(worker).run([prompt], [s], new_tokens=12)
    _, logits = hf_log_softmax(hf_model, prompt + tokens[0])
    counts = torch.zeros(logits.shape[1])
    P = len(prompt)
    for k, tok in enumerate(tokens[0]):
        x = logits[P - 1 + k] - freq * counts - pres * (counts > 0).float()
        assert tok == int(x.argmax()), f"token {k}"
        counts[tok] += 1
    plain, _ = Requests(worker).run([prompt], [sampling()], new_tokens=12)
    assert plain[0] != tokens[0], "the penalties changed nothing: the test proves nothing"


def test_logit_bias_forces_and_bans(worker, hf_model, chat_prompt_ids):
    prompt = chat_prompt_ids[4]
    forced = 1234
    s = sampling(logit_bias_ids=[forced], logit_bias_values=[100.0])
    tokens, _ = Requests(worker).run([prompt], [s], new_tokens=4)
    assert tokens[0] == [forced] * 4
    plain, _ = Requests(worker).run([prompt], [sampling()], new_tokens=1)
    banned = plain[0][0]
    tokens, _ = Requests(worker).run([prompt], [sampling(logit_bias_ids=[banned], logit_bias_values=[-100.0])], 1)
    _, logits = hf_log_softmax(hf_model, prompt)
    second = logits[-1].topk(2).indices[1].item()
    assert tokens[0] == [second] != [banned]


def test_min_tokens_holds_back_eos(worker, chat_prompt_ids, hf_model):
    candidates = [chat_prompt_ids[i] for i in (0, 7, 9)]  # short answers: greedy ends early
    plain, _ = Requests(worker).run(candidates, [sampling()] * len(candidates), new_tokens=12)
    ends = [(out.index(2), i) for i, out in enumerate(plain) if 2 in out]
    assert ends, "no prompt where greedy ends with EOS"
    length, i = min(ends)
    prompt = candidates[i]
    s = sampling(min_tokens=length + 3, min_tokens_stop_ids=[2], num_prompt_tokens=len(prompt))
    tokens, _ = Requests(worker).run([prompt], [s], new_tokens=length + 4)
    assert tokens[0][:length] == plain[i][:length]
    assert 2 not in tokens[0][:length + 3]
    _, logits = hf_log_softmax(hf_model, prompt + tokens[0][:length])
    x = logits[-1].clone()
    assert int(x.argmax()) == 2, "greedy picks EOS here"
    x[2] = float("-inf")
    assert tokens[0][length] == int(x.argmax())


def test_seeded_penalised_sampling_is_batch_independent(worker, chat_prompt_ids):
    prompt = chat_prompt_ids[5]
    s = sampling(temperature=0.8, top_k=40, top_p=0.95, seed=7, repetition_penalty=1.2, frequency_penalty=0.4,
                 presence_penalty=0.2, logprobs=2, num_prompt_tokens=len(prompt))
    alone, _ = Requests(worker).run([prompt], [s], new_tokens=6)
    # 7 others: greedy rows and seeded rows with each repetition penalty (1.1, 1.0, 1.2), other prompts' lengths
    others = [chat_prompt_ids[i] for i in range(7)]
    mixed = [sampling(temperature=1.0, seed=100 + i, repetition_penalty=1.0 + (i % 3) / 10,
                      num_prompt_tokens=len(others[i])) if i % 2 else sampling() for i in range(7)]
    batch, _ = Requests(worker).run([prompt] + others, [s] + mixed, new_tokens=6)
    assert batch[0] == alone[0]


def test_prompt_logprob_layout_without_kept_logits():
    """A chunk with no kept row before it (a prefix-cache hit) reports from its second position;
    positions past the prompt (a resumed request's outputs) are never reported."""
    from executor_proc.step.prompt_logprobs import SavedHidden, plan_prompt_logprobs
    from executor_proc.step.slot_tables import SlotInfo

    info = {3: SlotInfo(prompt_logprobs=2, num_prompt_tokens=10)}
    chunk = list(range(100, 106))
    pl = plan_prompt_logprobs(StepPlan(0, [3], [6], [4], [True], [True], prefill_tokens=chunk), info, SavedHidden())
    assert [(r.row, r.first, r.count, r.n) for r in pl.rows] == [(0, 5, 5, 2)]
    assert pl.targets == chunk[1:] and pl.logits_index == [0, 1, 2, 3, 4] and not pl.saves
    pl = plan_prompt_logprobs(StepPlan(0, [3], [6], [8], [True], [True], prefill_tokens=chunk), info, SavedHidden())
    assert [(r.first, r.count) for r in pl.rows] == [(9, 1)] and pl.targets == [101] and pl.logits_index == [0]
    pl = plan_prompt_logprobs(StepPlan(0, [3], [4], [0], [True], [False], prefill_tokens=chunk[:4]), info,
                              SavedHidden())
    assert [(r.first, r.count) for r in pl.rows] == [(1, 3)] and pl.saves == [(3, 4, 3)]
