"""Mixture-of-experts layers under tensor parallelism (CPU, gloo), and ``--moe-expert-counts``.

- each expert's slices (stacked as dummy weights draw them, or per checkpoint tensor, Mixtral's names too)
  reassemble the whole, and agree with each other; the router and the shared expert's gate are replicated;
- a size that does not divide an expert's MLP is refused in one line naming the sizes;
- two ranks' logits of each family (tests/test_moe.py's tiny random models, read by slice from safetensors)
  within 1e-4 of one process, the three models run by one group;
- ``forerun serve --tensor-parallel-size 2 --load-format dummy`` of a tiny Qwen2-MoE (shared expert) gives one
  process's greedy tokens, and its ``--moe-expert-counts`` totals, printed at shutdown, add up to the tokens
  run times top-k times the MoE layers.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import tempfile
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
from executor_proc.parallel.sharding import NotDivisible, Shards, check_divisible
from ipc.config import ExecutorConfig
from tests.forward_batch import build_forward_batch
from tests.test_moe import BASE, FAMILIES, built  # noqa: F401  (built: the families' tiny models, a fixture)
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
                        r"4 experts of an MLP of 34, a shared expert of 48\); sizes that do: 1, 2", message), message
    assert isinstance(refused.value, StartupRefused)  # the executor reports it as this one line, no traceback
    qwen3 = {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 90}
    with pytest.raises(ValueError, match=r"\), an MLP of 90, 4 experts of an MLP of 32\); sizes that do: 1, 2$"):
        check_divisible(ModelConfig.from_hf_dict(qwen3 | {"mlp_only_layers": [1]}), 4)  # a dense layer: its MLP too
    check_divisible(ModelConfig.from_hf_dict(qwen3), 4)  # every layer sparse: the dense size is never split


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL * max(1.0, np.abs(ref).max()), np.abs(ours - ref).max()
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_two_ranks_logits_of_each_family_match_one_process(built, tmp_path):  # noqa: F811
    """Qwen3-MoE (a dense layer among the MoE ones), Qwen2-MoE (shared expert), Mixtral (its names), by slice."""
    folders = [built(name)[4] for name in FAMILIES]
    ours = run_ranks_each(2, "hf", folders, str(tmp_path / "logits.npz"))
    for folder, got in zip(folders, ours):
        _assert_close(got, logits(folder, "hf"))


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


def test_two_ranks_serve_a_moe_model_as_one_process_does(tmp_path):
    """Dummy Qwen2-MoE weights (drawn whole, sliced per rank): the same greedy tokens at 1 and 2 ranks."""
    from ipc.client import AsyncClient
    from tests.server_proc import ServerProcess

    (tmp_path / "config.json").write_text(json.dumps(ModelConfig.from_hf_dict(BASE).to_hf_dict()))
    flags = ("--model", str(tmp_path), "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
             "--max-num-seqs", "4", "--num-kv-blocks", "32", "--block-size", "4")
    sizes = {1: (), 2: ("--tensor-parallel-size", "2", "--moe-expert-counts")}
    tmp = tempfile.mkdtemp(prefix="fr", dir="/tmp")  # short: ipc paths are limited to 107 bytes

    async def greedy(srv):
        async with AsyncClient(srv.address, timeout=60) as c:
            return [r.token_ids for r in await asyncio.gather(*[
                c.generate(prompt_token_ids=ids, max_tokens=MAX_TOKENS, temperature=0.0, detokenize=False,
                           ignore_eos=True) for ids in PROMPTS])]

    with ThreadPoolExecutor(2) as pool:
        started = {n: pool.submit(ServerProcess, *flags, *extra, tmpdir=tmp, timeout=120) for n, extra in sizes.items()}
    servers = {n: f.result() for n, f in started.items() if f.exception() is None}
    try:
        assert len(servers) == 2, [f.exception() for f in started.values()]
        got = {n: asyncio.run(greedy(srv)) for n, srv in servers.items()}
    finally:
        for srv in servers.values():
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    assert got[2] == got[1] and all(len(t) == MAX_TOKENS for t in got[1])
    log = servers[2].proc.stdout.read()
    rows = [list(map(int, m[1].split())) for m in re.finditer(r"moe expert counts layer \d+: ([\d ]+)", log)]
    tokens_run = sum(map(len, PROMPTS)) + len(PROMPTS) * (MAX_TOKENS - 1)  # the last token is sampled, not run
    assert len(rows) == 2 and all(len(r) == 4 for r in rows), log
    assert [sum(r) for r in rows] == [tokens_run * 2] * 2, log  # top-2, in each of the 2 MoE layers
