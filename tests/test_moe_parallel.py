"""Mixture-of-experts layers under tensor and expert parallelism (CPU, gloo), and ``--moe-expert-counts``.

- each expert's slices (stacked as dummy weights draw them, or per checkpoint tensor, Mixtral's names too)
  reassemble the whole, and agree with each other; the router and the shared expert's gate are replicated;
- a size that does not divide an expert's MLP is refused in one line naming the sizes;
- expert parallelism: the ranks' expert ranges (uneven too) cover every expert once; a rank reads and holds only
  its experts (safetensors and dummy weights); its refusals (a dense model, one rank, more ranks than experts);
- two ranks' logits of each family (tests/test_moe.py's tiny random models, read from safetensors) within 1e-4
  of one process, by slice and expert parallel (an uneven split too: 5 experts as 3 and 2), one group running all;
- ``forerun serve --load-format dummy`` of a tiny Qwen2-MoE (shared expert) at two tensor-parallel ranks and at
  two expert-parallel ranks, and of a tiny Qwen3-MoE of 5 experts at two expert-parallel ranks, give one
  process's greedy tokens, and the ``--moe-expert-counts`` totals, printed at shutdown, are one process's per
  expert (they add up to the tokens run times top-k times the MoE layers).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from executor_proc.backends.select import graph_max_batch, mixed_max_tokens
from executor_proc.memory_plan import StartupRefused
from executor_proc.model.config import ModelConfig
from executor_proc.model.expert_counts import ExpertCounts
from executor_proc.model.kv_cache import KVCache
from executor_proc.model.llama import CausalLM
from executor_proc.model.loader import load_model
from executor_proc.parallel.sharding import NotDivisible, Shards, check_divisible, expert_range
from ipc.config import ExecutorConfig
from tests.forward_batch import build_forward_batch
from tests.test_moe import BASE, FAMILIES, built, save_family  # noqa: F401  (built: the families' tiny models)
from tests.tp_forward import logits, run_ranks_each

TOL = 1e-4


def test_expert_slices_reassemble_and_agree_with_the_stacks():
    """Rank r holds rows r*I/N.. of each expert's gate and up, those columns of its down, in the checkpoint's
    tensors and in the stacked ``w13``/``w2`` alike; the router and the shared expert's gate whole."""
    config = ModelConfig.from_hf_dict(BASE)
    E, H, I, S = 4, config.hidden_size, config.moe.intermediate_size, config.moe.shared_intermediate_size
    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I,
                                                                                                        generator=g)
    shared, router = torch.randn(S, H, generator=g), torch.randn(E, H, generator=g)
    ranks = [Shards(config, r, 2) for r in range(2)]
    L = "model.layers.0."
    for s in ranks:
        assert (s.config.moe.intermediate_size, s.config.moe.shared_intermediate_size) == (I // 2, S // 2)
        w13, w2 = s.take(L + "mlp.w13", torch.cat([gate, up], dim=1)), s.take(L + "mlp.w2", down)
        for e in range(E):
            at = f"{L}mlp.experts.{e}."
            mine = torch.cat([s.take(at + "gate_proj.weight", gate[e]), s.take(at + "up_proj.weight", up[e])])
            assert torch.equal(w13[e], mine)
            assert torch.equal(w2[e], s.take(at + "down_proj.weight", down[e]))
            assert torch.equal(w2[e], s.take(f"{L}block_sparse_moe.experts.{e}.w2.weight", down[e]))  # Mixtral
        assert torch.equal(s.take(L + "mlp.gate.weight", router), router)
        assert torch.equal(s.take(L + "mlp.shared_expert_gate.weight", router[:1]), router[:1])
    take = lambda name, t: [s.take(name, t) for s in ranks]  # noqa: E731
    assert torch.equal(torch.cat(take(L + "mlp.experts.1.gate_proj.weight", gate[1])), gate[1])
    assert torch.equal(torch.cat(take(L + "mlp.experts.1.down_proj.weight", down[1]), dim=1), down[1])
    assert torch.equal(torch.cat(take(L + "mlp.shared_expert.up_proj.weight", shared)), shared)
    assert torch.equal(torch.cat(take(L + "mlp.shared_expert.down_proj.weight", shared.T), dim=1), shared.T)


def test_sizes_that_do_not_divide_an_expert_are_refused_in_one_line():
    config = ModelConfig.from_hf_dict(BASE | {"moe_intermediate_size": 34})
    check_divisible(config, 2)
    with pytest.raises(NotDivisible) as refused:
        check_divisible(config, 4)  # the heads, the KV heads and the shared expert would split
    message = str(refused.value)
    assert re.fullmatch(r"tensor_parallel_size 4 does not divide the model \(4 attention heads, 2 KV heads \(.*\), "
                        r"4 experts of an MLP of 34, a shared expert of 48\); sizes that do: 1, 2; or "
                        r"enable_expert_parallel \(whole experts a rank\)", message), message  # then they need not
    assert isinstance(refused.value, StartupRefused)  # the executor reports it as this one line, no traceback
    qwen3 = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 90}
    with pytest.raises(ValueError, match=r"\), an MLP of 90, 4 experts of an MLP of 32\); sizes that do: 1, 2$"):
        check_divisible(ModelConfig.from_hf_dict(qwen3 | {"mlp_only_layers": [1]}), 4)  # a dense layer: its MLP too
    check_divisible(ModelConfig.from_hf_dict(qwen3), 4)  # every layer sparse: the dense size is never split


def test_expert_ranges_cover_every_expert_once():
    """Contiguous ranges in rank order, the remainder on the first ranks (as vLLM places them)."""
    assert [expert_range(8, r, 3) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 8)]
    assert [expert_range(4, r, 3) for r in range(3)] == [range(0, 2), range(2, 3), range(3, 4)]
    for experts in range(1, 20):
        for size in range(1, experts + 1):
            ranges = [expert_range(experts, r, size) for r in range(size)]
            assert [e for held in ranges for e in held] == list(range(experts))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1 and len(ranges[-1]) >= 1


def test_expert_parallel_shards_hold_whole_experts():
    """Rank 1 of 2 over 4 experts holds experts 2 and 3 whole (per checkpoint tensor, Mixtral's names, and the
    stacks), reads no other expert's tensor, and splits the shared expert as tensor parallelism does; an expert
    size the ranks do not divide is no obstacle."""
    config = ModelConfig.from_hf_dict(BASE | {"moe_intermediate_size": 34})
    E, H, I, S = 4, config.hidden_size, 34, config.moe.shared_intermediate_size
    s = Shards(config, 1, 2, expert_parallel=True)
    assert s.experts == range(2, 4)
    assert (s.config.moe.num_experts, s.config.moe.intermediate_size, s.config.moe.shared_intermediate_size) == (
        E, I, S // 2)
    L = "model.layers.0."
    assert [s.holds(f"{L}mlp.experts.{e}.up_proj.weight") for e in range(E)] == [False, False, True, True]
    assert not s.holds(f"{L}block_sparse_moe.experts.1.w2.weight")  # Mixtral's names
    assert s.holds(f"{L}block_sparse_moe.experts.3.w1.weight")
    assert s.holds(L + "mlp.gate.weight") and s.holds(L + "mlp.shared_expert.up_proj.weight")
    g = torch.Generator().manual_seed(1)
    gate, down, shared = torch.randn(I, H, generator=g), torch.randn(H, I, generator=g), torch.randn(S, H, generator=g)
    assert torch.equal(s.take(f"{L}mlp.experts.3.gate_proj.weight", gate), gate)
    assert torch.equal(s.take(f"{L}block_sparse_moe.experts.2.w2.weight", down), down)
    assert torch.equal(s.take(L + "mlp.shared_expert.up_proj.weight", shared), shared[S // 2:])
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    assert torch.equal(s.take(L + "mlp.w13", w13), w13[2:]) and torch.equal(s.take(L + "mlp.w2", w2), w2[2:])


def test_a_rank_loads_only_its_experts(built, monkeypatch):  # noqa: F811
    """Rank 1 of 2, expert parallel, over Qwen2-MoE's 4 experts: its stacks are one process's experts 2 and 3,
    from safetensors (never reading experts 0 and 1) and from dummy weights (drawn as one process draws them)."""
    _, _, whole, _, folder = built("qwen2_moe")
    taken = []
    take = Shards.take
    monkeypatch.setattr(Shards, "take", lambda self, name, t: taken.append(name) or take(self, name, t))
    rank = SimpleNamespace(rank=1, size=2)  # the group is used by the forward only
    ours, _ = load_model(folder, "hf", "cpu", torch.float32, tp=rank, expert_parallel=True)
    assert not [n for n in taken if ".experts.0." in n or ".experts.1." in n] and any(".experts.3." in n for n in taken)
    dummy_whole, _ = load_model(folder, "dummy", "cpu", torch.float32)
    dummy_ours, _ = load_model(folder, "dummy", "cpu", torch.float32, tp=rank, expert_parallel=True)
    for one, rank_model in ((whole, ours), (dummy_whole, dummy_ours)):
        for i, layer in enumerate(rank_model.model.layers):
            block, full = layer.mlp, one.model.layers[i].mlp
            assert block.experts == range(2, 4) and block.w13.shape[0] == 2
            assert torch.equal(block.w13, full.w13[2:]) and torch.equal(block.w2, full.w2[2:])
            assert torch.equal(block.gate.weight, full.gate.weight)


def test_expert_parallel_refusals_name_the_flag():
    """A dense model, more ranks than experts (the executor's one line), one rank (the config's, before start)."""
    from scheduler_proc.launch import build_parser, main, server_config

    dense = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(StartupRefused, match="^--enable-expert-parallel needs a mixture-of-experts model; "
                                             "Qwen2ForCausalLM has none$"):
        Shards(dense, 0, 2, expert_parallel=True)
    all_dense = ModelConfig.from_hf_dict({**BASE, "mlp_only_layers": [0, 1]})  # an MoE architecture, no MoE layer
    with pytest.raises(StartupRefused, match=r"^--enable-expert-parallel needs a mixture-of-experts model; "
                                             r"Qwen2MoeForCausalLM has no MoE layer \(decoder_sparse_step, "
                                             r"mlp_only_layers\)$"):
        Shards(all_dense, 0, 2, expert_parallel=True)
    too_many = (r"^--enable-expert-parallel gives each of the 8 tensor-parallel ranks whole experts, but the model "
                r"has 4: use --tensor-parallel-size 4 or fewer, or leave the flag off \(tensor parallelism splits "
                r"every expert\)$")
    with pytest.raises(StartupRefused, match=too_many):
        Shards(ModelConfig.from_hf_dict(BASE), 0, 8, expert_parallel=True)
    with pytest.raises(NotDivisible, match=r"^tensor_parallel_size 3 does not divide the model \(4 attention heads, "
                                           r".*, a shared expert of 48\); sizes that do: 1, 2, 4$"):
        Shards(ModelConfig.from_hf_dict(BASE | {"moe_intermediate_size": 34}), 0, 3, True)  # experts: not split
    with pytest.raises(SystemExit, match="^forerun: --enable-expert-parallel needs --tensor-parallel-size 2 or "
                                         "more: it spreads the experts over the tensor-parallel ranks$"):
        main(["serve", "--enable-expert-parallel", "--load-format", "dummy"])
    args = build_parser().parse_args(["serve", "-tp", "2", "--enable-expert-parallel"])
    assert server_config(args).executor.enable_expert_parallel


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL * max(1.0, np.abs(ref).max()), np.abs(ours - ref).max()
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_two_ranks_logits_of_each_family_match_one_process_in_either_layout(built, tmp_path):  # noqa: F811
    """Qwen3-MoE (a dense layer among the MoE ones), Qwen2-MoE (shared expert), Mixtral (its names), read from
    safetensors: by slice, then expert parallel (2 and 2 of the 4 experts), and a Qwen3-MoE of 5 experts expert
    parallel (3 and 2): seven runs of one group."""
    folders = [built(name)[4] for name in FAMILIES]
    five = str(tmp_path / "five_experts")
    save_family("qwen3_moe", five, num_experts=5)
    runs = [(folder, False) for folder in folders] + [(folder, True) for folder in folders + [five]]
    ours = run_ranks_each(2, "hf", [f for f, _ in runs], str(tmp_path / "logits.npz"),
                          expert_parallel=[ep for _, ep in runs])
    one_process = {folder: logits(folder, "hf") for folder in folders + [five]}
    for (folder, _), got in zip(runs, ours):
        _assert_close(got, one_process[folder])


def test_expert_counts_add_up_and_need_experts(tmp_path):
    """One step of 12 tokens through Qwen3-MoE's one MoE layer (top-2): 24 routings, each to an expert."""
    folder = tmp_path / "qwen3_moe"
    folder.mkdir()
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen3MoeForCausalLM"], "mlp_only_layers": [1]})
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict()))
    model, config = load_model(str(folder), "dummy", "cpu", torch.float32)
    counts = ExpertCounts(model, torch.device("cpu"))
    kv = KVCache(model.config, 8, 4, "cpu", torch.float32)
    model(build_forward_batch([(0, list(range(7)), 0, True), (1, list(range(50, 55)), 0, True)], [[0, 1], [2, 3]],
                              4, "cpu"), kv)
    assert counts.counts.shape == (1, 4) and counts.counts.sum().item() == 12 * 2
    assert counts.report()[1].startswith("moe expert counts layer 0: ")
    # a data-parallel replica names itself on every line (replicas print to one stream)
    replica = ExpertCounts(model, torch.device("cpu"), replica=1).report()
    assert replica[0].startswith("moe expert counts, replica 1: tokens routed")
    assert replica[1].startswith("moe expert counts, replica 1, layer 0: ")
    with torch.device("meta"):
        dense = CausalLM(ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(StartupRefused, match="--moe-expert-counts needs a mixture-of-experts model; "
                                             "Qwen2ForCausalLM has none"):
        ExpertCounts(dense, torch.device("cpu"))
    cfg, backend = ExecutorConfig(moe_expert_counts=True, mixed_graphs="on"), SimpleNamespace(supports_graphs=True)
    assert graph_max_batch(cfg, backend) == 0 and mixed_max_tokens(cfg, backend) == 0  # padded rows would count
    with pytest.raises(ValueError, match="--moe-expert-counts needs a model"):
        ExecutorConfig(moe_expert_counts=True, load_format="scripted")


PROMPTS = [[5, 17, 29, 41, 53, 65], [88, 3, 14, 15, 92, 65, 35, 89, 79]]
MAX_TOKENS = 6


MODELS = {"qwen2": BASE, "qwen3": {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 5}}
SERVED = {  # case: flags; every server tallies its experts
    "qwen2 tp2": ("--tensor-parallel-size", "2"),
    "qwen2 ep2": ("--tensor-parallel-size", "2", "--enable-expert-parallel"),  # experts 0-1, 2-3
    "qwen3 ep2": ("--tensor-parallel-size", "2", "--enable-expert-parallel"),  # experts 0-2, 3-4
}


def _one_process(folder: str) -> tuple[list[list[int]], list[list[int]]]:
    """One process's greedy tokens of PROMPTS and its expert counts: the whole model (dummy weights, as a server
    draws them) run in this process, both prompts in one step and then a decode step of both at a time."""
    model, _ = load_model(folder, "dummy", "cpu", torch.float32)
    counts = ExpertCounts(model, torch.device("cpu"))
    kv = KVCache(model.config, 16, 4, "cpu", torch.float32)
    tables, tokens = [list(range(8)), list(range(8, 16))], [[] for _ in PROMPTS]
    rows = [(r, ids, 0, True) for r, ids in enumerate(PROMPTS)]
    for _ in range(MAX_TOKENS):
        sampled = model(build_forward_batch(rows, tables, 4, "cpu"), kv).argmax(-1).tolist()
        rows = [(r, [t], start + len(ids), True) for (r, ids, start, _), t in zip(rows, sampled)]
        for row, t in zip(tokens, sampled):
            row.append(t)
    return tokens, counts.counts.tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """case -> (greedy tokens of PROMPTS, expert counts printed at shutdown, the server's output), the cases of
    SERVED through ``forerun serve --load-format dummy`` (drawn whole, sliced per rank; every server started at
    once), and one process's (``qwen2``, ``qwen3``)."""
    from ipc.client import AsyncClient
    from tests.server_proc import ServerProcess, run_dir

    folders = {}
    for name, config in MODELS.items():
        folders[name] = tmp_path_factory.mktemp(name)
        (folders[name] / "config.json").write_text(json.dumps(ModelConfig.from_hf_dict(config).to_hf_dict()))
    flags = ("--load-format", "dummy", "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "4",
             "--num-kv-blocks", "32", "--block-size", "4", "--moe-expert-counts")
    tmp = run_dir()

    def start(case):
        return ServerProcess("--model", str(folders[case.split()[0]]), *flags, *SERVED[case], tmpdir=tmp,
                             timeout=120)

    async def greedy(srv):
        async with AsyncClient(srv.address, timeout=60) as c:
            return [r.token_ids for r in await asyncio.gather(*[
                c.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False,
                           ignore_eos=True) for ids in PROMPTS])]

    with ThreadPoolExecutor(len(SERVED)) as pool:
        started = {case: pool.submit(start, case) for case in SERVED}
        results = {name: _one_process(str(folder)) for name, folder in folders.items()}  # while they start
    servers = {case: f.result() for case, f in started.items() if f.exception() is None}
    try:
        assert len(servers) == len(SERVED), [f.exception() for f in started.values()]
        tokens = {case: asyncio.run(greedy(srv)) for case, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for case, srv in servers.items():
        log = "".join(srv.log) + srv.proc.stdout.read()
        results[case] = (tokens[case], _expert_counts(log), log)
    return results


def _expert_counts(log: str) -> list[list[int]]:
    return [list(map(int, m[1].split())) for m in re.finditer(r"moe expert counts layer \d+: ([\d ]+)", log)]


def test_tensor_and_expert_parallel_ranks_serve_as_one_process_runs(served):
    """Qwen2-MoE (shared expert) at two tensor-parallel and two expert-parallel ranks, a Qwen3-MoE of 5 experts
    at two expert-parallel ranks (3 and 2): one process's greedy tokens."""
    assert all(len(t) == MAX_TOKENS for t in served["qwen2"][0] + served["qwen3"][0])
    for case in SERVED:
        assert served[case][0] == served[case.split()[0]][0], case
    assert "x 2 ranks (tensor parallel, expert parallel)" in served["qwen2 ep2"][2]


def test_expert_counts_are_one_process_counts_under_tensor_and_expert_parallelism(served):
    """Rank 0 routes every token under either layout: its per-expert totals, printed at shutdown, are one
    process's, which add up to the tokens run times top-2 in each of the two MoE layers."""
    tokens_run = sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)  # the last token is sampled, not run
    for name, experts in (("qwen2", 4), ("qwen3", 5)):
        rows = served[name][1]
        assert len(rows) == 2 and all(len(r) == experts for r in rows)
        assert [sum(r) for r in rows] == [tokens_run * 2] * 2
    for case in SERVED:
        assert served[case][1] == served[case.split()[0]][1], (case, served[case][2])
