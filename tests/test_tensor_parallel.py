"""Tensor parallelism on the CPU (gloo): sharding, logits against one process, real servers, rank deaths.

- the sharding rules, reassembled from every rank's slices, and the refusal of sizes that do not divide;
- ranks run the model directly (``tests/tp_forward.py``): logits within 1e-4 of one process, for
  safetensors (biases, an odd vocabulary: padded shards), dummy weights with fewer KV heads than ranks
  (replicated), GGUF (dequantised whole, then sliced) and the default model (9 heads over 3 ranks);
- ``forerun serve --tensor-parallel-size N`` against N = 1: greedy and seeded tokens identical, logprobs
  within 1e-4 (a random 2-layer model at N = 2); the default model's 9 heads and 3 KV heads do not split
  in 2, which the server refuses at start-up;
- a killed rank is the executor's death: the whole group restarts and the streams go on exactly
  (docs/reliability.md's promise), or with no restart left (``--max-restarts 1``, spent) every client gets an
  error within 2 s and the server exits; no rank is left behind either way.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from executor_proc.model.config import ModelConfig
from executor_proc.parallel.group import rank_device
from executor_proc.parallel.sharding import Shards, check_divisible
from ipc.client import AsyncClient, ExecutorFailedError
from ipc.config import ExecutorConfig
from tests.server_proc import ROOT, ServerProcess, assert_no_leak, python_path, run_dir, server_stats, wait_idle
from tests.tp_forward import logits, run_ranks, run_ranks_each, write_gguf

TOL = 1e-4
VOCAB = 1001  # odd: the last rank's vocabulary shard is padded


def _config(heads=4, kv_heads=2, inter=96, vocab=VOCAB, **kw) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=inter, num_layers=2,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=16, vocab_size=vocab, rms_norm_eps=1e-5,
                       rope_theta=1e4, max_position_embeddings=256, **kw)


# --------------------------------------------------------------------------- sharding rules


@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_weight_reassembles_from_the_ranks_slices(size):
    """Column slices stack, row slices concatenate, row biases sum, vocab rows stack (padding zero),
    and with fewer KV heads than ranks each rank holds the KV head its query heads read."""
    cfg = _config()
    d, g = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    gen = torch.Generator().manual_seed(0)
    full = {
        "q": torch.randn(cfg.num_heads * d, 64, generator=gen),
        "k": torch.randn(cfg.num_kv_heads * d, 64, generator=gen),
        "gate": torch.randn(96, 64, generator=gen), "o": torch.randn(64, cfg.num_heads * d, generator=gen),
        "down": torch.randn(64, 96, generator=gen), "bias": torch.randn(64, generator=gen),
        "embed": torch.randn(VOCAB, 64, generator=gen), "norm": torch.randn(64, generator=gen),
    }
    ranks = [Shards(cfg, r, size) for r in range(size)]
    take = lambda name, t: [s.take(name, t) for s in ranks]  # noqa: E731
    L = "model.layers.1."
    assert torch.equal(torch.cat(take(L + "self_attn.q_proj.weight", full["q"])), full["q"])
    assert torch.equal(torch.cat(take(L + "mlp.gate_proj.weight", full["gate"])), full["gate"])
    assert torch.equal(torch.cat(take(L + "self_attn.o_proj.weight", full["o"]), dim=1), full["o"])
    assert torch.equal(torch.cat(take(L + "mlp.down_proj.weight", full["down"]), dim=1), full["down"])
    assert torch.equal(sum(take(L + "mlp.down_proj.bias", full["bias"])), full["bias"])
    assert all(torch.equal(t, full["norm"]) for t in take(L + "post_attention_layernorm.weight", full["norm"]))
    embed = take("model.embed_tokens.weight", full["embed"])
    assert all(t.shape == (-(-VOCAB // size), 64) for t in embed)
    stacked = torch.cat(embed)
    assert torch.equal(stacked[:VOCAB], full["embed"]) and not stacked[VOCAB:].any()
    for s, k in zip(ranks, take(L + "self_attn.k_proj.weight", full["k"])):
        first_q_head = s.rank * cfg.num_heads // size
        kv_heads = range(first_q_head // g, first_q_head // g + s.config.num_kv_heads)
        assert torch.equal(k, torch.cat([full["k"][h * d:(h + 1) * d] for h in kv_heads]))
        assert s.config.num_heads == cfg.num_heads // size and s.config.num_kv_heads == max(1, 2 // size)


def test_sizes_that_do_not_divide_are_refused_naming_the_counts():
    smollm2 = _config(heads=9, kv_heads=3, inter=1536, vocab=49152)
    check_divisible(smollm2, 3)
    check_divisible(_config(heads=8, kv_heads=2, inter=96), 8)  # more ranks than KV heads: each on 4 ranks
    for size in (2, 4, 6, 9):
        with pytest.raises(ValueError, match=rf"tensor_parallel_size {size} does not divide the model \(9 attention "
                                             r"heads, 3 KV heads.*MLP of 1536\); sizes that do: 1, 3$"):
            check_divisible(smollm2, size)
    with pytest.raises(ValueError, match="2 KV heads"):
        check_divisible(_config(heads=6, kv_heads=2, inter=96), 3)  # 3 neither divides 2 nor is a multiple of it


def test_config_limits_and_devices():
    for bad, field in ((0, "tensor_parallel_size"), (65, "tensor_parallel_size")):
        with pytest.raises(ValueError, match=field):
            ExecutorConfig(tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="tp_rank"):
        ExecutorConfig(tensor_parallel_size=2, tp_rank=2)
    with pytest.raises(ValueError, match="scripted"):
        ExecutorConfig(tensor_parallel_size=2, load_format="scripted")
    assert [rank_device("cuda", r) for r in (0, 1)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:2", 1) == "cuda:3" and rank_device("cpu", 3) == "cpu"


def test_missing_gpus_are_named_as_the_flags_say_them_on_every_rank():
    """Each rank checks the whole range --device cuda:i and --tensor-parallel-size N need, so that whichever rank
    refuses first, the line is the same and names the flags as typed (not a rank's own cuda:i+r)."""
    from executor_proc.build import StartupRefused, resolve_device

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(StartupRefused, match=rf"^--device cuda:{count} with --tensor-parallel-size 2 needs "
                                             rf"cuda:{count}..cuda:{count + 1}: this machine has "):
        resolve_device(f"cuda:{count}", 2)
    assert resolve_device("cpu", 4) == torch.device("cpu")


def test_a_gap_in_the_step_ids_fails_the_executor_loudly(tmp_path):
    """Every rank checks that plans arrive with consecutive step ids (here one process, the scripted executor)."""
    import zmq

    from ipc import protocol as p
    from ipc.sockets import make_socket
    from scheduler_proc.executor_process import spawn_executor, wait_ready

    d = run_dir()
    ctx = zmq.Context()
    plans = make_socket(ctx, zmq.PUSH, f"ipc://{d}/p.sock", bind=True)
    results = make_socket(ctx, zmq.PULL, f"ipc://{d}/r.sock", bind=True)
    proc = spawn_executor(ExecutorConfig(load_format="scripted", num_slots=4, num_kv_blocks=16,
                                         plan_addr=f"ipc://{d}/p.sock", result_addr=f"ipc://{d}/r.sock",
                                         parent_pid=os.getpid()))
    try:
        wait_ready([proc], results, 120)
        for step_id in (7, 8, 10):
            plans.send(p.encode(p.StepPlan(step_id, [], [], [], [], [])))
        msgs = []
        while not (msgs and isinstance(msgs[-1], p.ExecutorFatal)):
            assert results.poll(30_000), msgs
            msgs.append(p.executor_output_decoder.decode(results.recv()))
        assert [m.step_id for m in msgs[:-1]] == [7, 8]
        assert "plan 10 arrived after plan 8; a plan is missing" in msgs[-1].message
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- the model, rank by rank


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A random 2-layer Llama with every bias, an untied LM head and an odd vocabulary, as safetensors."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512,
                                   attention_bias=True, mlp_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    folder = tmp_path_factory.mktemp("tiny_tp")
    model.save_pretrained(folder)
    return str(folder)


def _assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL * max(1.0, np.abs(ref).max()), np.abs(ours - ref).max()
    assert (ours.argmax(1) == ref.argmax(1)).all()


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory) -> dict:
    """One group of two ranks runs the tiny model from its safetensors and from a GGUF file written from them
    (load format "auto": "hf" for the folder, "gguf" for the file): each one's logits, and the GGUF file."""
    folder = tmp_path_factory.mktemp("two_ranks")
    gguf = write_gguf(tiny_model, str(folder / "tiny.gguf"))
    hf, from_gguf = run_ranks_each(2, "auto", [tiny_model, gguf], str(folder / "logits.npz"))
    return dict(hf=hf, gguf=from_gguf, gguf_file=gguf)


def test_safetensors_read_by_slice_match_one_process(tiny_model, two_ranks):
    _assert_close(two_ranks["hf"], logits(tiny_model, "hf"))


def test_dummy_weights_over_four_ranks_match_one_process(tiny_model, tmp_path):
    """Dummy weights drawn whole then sliced at 4 ranks (2 KV heads: replicated)."""
    _assert_close(run_ranks(4, "dummy", tiny_model, str(tmp_path / "logits.npy")), logits(tiny_model, "dummy"))


def test_gguf_sharded_after_dequantising(tiny_model, two_ranks):
    """GGUF is dequantised whole, then sliced; first, the file written loads as the safetensors do."""
    ref = logits(two_ranks["gguf_file"], "gguf")
    _assert_close(ref, logits(tiny_model, "hf"))  # the file round-trips
    _assert_close(two_ranks["gguf"], ref)


# --------------------------------------------------------------------------- real servers

PROMPTS = [[(31 * i + 7 * j) % VOCAB for j in range(5 + 3 * i)] for i in range(6)]
SHARED = list(range(40, 90))  # a prefix longer than 3 blocks: prefix-cache and host-tier hits



def _rank_pids(srv: ServerProcess) -> dict[int, int]:
    """The server's executor ranks (its children with an executor command line), by rank."""
    out = subprocess.run(["pgrep", "-P", str(srv.proc.pid)], capture_output=True, text=True).stdout.split()
    ranks = {}
    for pid in map(int, out):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read()
        except FileNotFoundError:
            continue
        if "executor_proc.main" in cmd:
            ranks[int(cmd.split('"tp_rank":')[1].split(",")[0])] = pid
    return ranks


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


# The server tests run on the CPU (gloo) and, given two GPUs, on CUDA (NCCL, Triton kernels, CUDA graphs
# capturing the all-reduces); float32 both ways, so TP=2 must give TP=1's tokens.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices")])]


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tiny_servers(tiny_model, device):
    """The tiny model served by one process and by two ranks, same flags (host KV tier on; prompts longer than a
    step's 32 tokens, whose first chunks sample no row); one executor restart allowed (the rank-death tests spend
    it, then go past it)."""
    flags = ("--model", tiny_model, "--device", device, "--dtype", "float32", "--max-num-seqs", "8",
             "--num-kv-blocks", "96", "--block-size", "4", "--num-host-kv-blocks", "64", "--debug-checks",
             "--max-num-batched-tokens", "32",
             "--max-restarts", "1", "--restart-window", "3600")
    servers = {}
    try:
        for size in (1, 2):
            servers[size] = ServerProcess(*flags, "--tensor-parallel-size", str(size), tmpdir=run_dir(), timeout=120)
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()


async def _workload(address: str, prompts, max_tokens: int = 24, shared: bool = True):
    """Greedy and seeded-sampled requests at once, with logprobs; then (``shared``) one prefix twice (cache hits)."""
    async with AsyncClient(address, timeout=120) as c:
        gen = lambda ids, **kw: c.generate(prompt_token_ids=ids, max_tokens=max_tokens, detokenize=False,  # noqa
                                           logprobs=3, **kw)
        first = await asyncio.gather(*[gen(ids, temperature=0.0) for ids in prompts],
                                     gen(prompts[0], temperature=0.8, top_p=0.9, seed=11))
        again = [await gen(SHARED + [i], temperature=0.0) for i in range(2 if shared else 0)]
        return first + again


def _assert_same_outputs(ours, ref) -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.token_ids == b.token_ids, f"request {i}"
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la.logprob - lb.logprob) <= TOL, f"request {i}"
            assert max(abs(x - y) for x, y in zip(la.top_logprobs, lb.top_logprobs)) <= TOL, f"request {i}"


def test_two_ranks_serve_what_one_process_serves(tiny_servers):
    ref = asyncio.run(_workload(tiny_servers[1].address, PROMPTS))
    ours = asyncio.run(_workload(tiny_servers[2].address, PROMPTS))
    _assert_same_outputs(ours, ref)
    assert sorted(_rank_pids(tiny_servers[2])) == [0, 1]
    assert "x 2 ranks (tensor parallel)" in "".join(tiny_servers[2].log)
    stats = asyncio.run(wait_idle(tiny_servers[2].address))
    assert_no_leak(stats)
    assert stats.prefix_cache_hit_tokens > 0


def test_a_killed_rank_restarts_the_whole_group_and_streams_go_on_exactly(tiny_servers):
    """docs/reliability.md: an executor death is a delay, not an error; with ranks, any rank's death."""
    srv = tiny_servers[2]
    ref = asyncio.run(_workload(tiny_servers[1].address, PROMPTS[:4], max_tokens=48))
    old = _rank_pids(srv)

    async def killed_midway():
        work = asyncio.create_task(_workload(srv.address, PROMPTS[:4], max_tokens=48))
        await _steps_later(srv.address, 10)
        os.kill(old[1], signal.SIGKILL)
        return await asyncio.wait_for(work, 240)

    _assert_same_outputs(asyncio.run(killed_midway()), ref)
    new = _rank_pids(srv)
    assert sorted(new) == [0, 1] and not set(new.values()) & set(old.values())
    assert not any(_alive(pid) for pid in old.values()), "a rank of the old group was left behind"
    log = "".join(srv.log) + _read_available(srv)
    assert f"the executor rank 1 (pid {old[1]}) was killed by signal SIGKILL" in log or "rank 0:" in log, log
    assert_no_leak(asyncio.run(wait_idle(srv.address)))


async def _steps_later(address: str, n: int) -> None:
    """Return once the server has reconciled ``n`` more steps (requests are running mid-stream then)."""
    first = (await server_stats(address)).steps
    while (await server_stats(address)).steps < first + n:
        await asyncio.sleep(0.01)


def _read_available(srv: ServerProcess) -> str:
    """What the server printed since start-up, without blocking (its stdout is a pipe)."""
    os.set_blocking(srv.proc.stdout.fileno(), False)
    try:
        return srv.proc.stdout.read() or ""
    finally:
        os.set_blocking(srv.proc.stdout.fileno(), True)


def test_a_killed_rank_without_restarts_fails_every_client_within_2s(tiny_servers):
    """The two-rank server's one restart spent (by the test before; here first when run alone), a rank's death is
    the server's, as with --max-restarts 0."""
    srv = tiny_servers[2]
    if asyncio.run(server_stats(srv.address)).executor_restarts == 0:
        old = set(_rank_pids(srv).values())
        os.kill(max(old), signal.SIGKILL)
        while len(set(_rank_pids(srv).values()) - old) < 2:  # the new group's two ranks
            time.sleep(0.1)
    tmp = os.path.dirname(srv.address.removeprefix("ipc://"))
    ranks = _rank_pids(srv)

    async def one_client(prompt) -> float:  # three of them at 100 tokens fit the 96 blocks of 4: all running
        async with AsyncClient(srv.address, timeout=60) as c:
            with pytest.raises(ExecutorFailedError) as e:
                async for _ in c.stream(prompt_token_ids=prompt, max_tokens=100, temperature=0.0, detokenize=False):
                    pass
            # the killed rank is named, whichever rank reported first (a survivor's error about its lost peer)
            assert f"rank 1 (pid {ranks[1]}) was killed by signal SIGKILL" in str(e.value), e.value
            return time.monotonic()

    async def scenario() -> list[float]:
        clients = [asyncio.create_task(one_client(p)) for p in PROMPTS[:3]]
        await _steps_later(srv.address, 5)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        return [t - killed for t in await asyncio.wait_for(asyncio.gather(*clients), 60)]

    delays = asyncio.run(scenario())
    assert max(delays) < 10.0, delays  # the rank's death noticed, not the clients' 60 s timeout
    assert srv.proc.wait(timeout=30) == 1
    assert not any(_alive(pid) for pid in ranks.values()), "a rank was left behind"
    assert os.listdir(tmp) == [], os.listdir(tmp)


# --------------------------------------------------------------------------- the default model


@pytest.mark.slow
def test_default_model_over_three_ranks_matches_one_process(default_model_dir, tmp_path):
    """SmolLM2-135M as the server loads it (its safetensors, read by slice): 9 heads and 3 KV heads over 3 ranks
    (1 KV head each), its tied embeddings and LM head split by vocabulary; a prefill's and a decode step's logits
    over the ranks' KV heads within 1e-4 of one process.  The serving path over ranks is the tiny model's (N = 2)."""
    _assert_close(run_ranks(3, "hf", default_model_dir, str(tmp_path / "logits.npy")),
                  logits(default_model_dir, "hf"))


@pytest.mark.slow
def test_default_model_refuses_two_ranks_at_start_up():
    tmp = run_dir()
    env = dict(os.environ, PYTHONPATH=python_path(),
               FORERUN_RUN_DIR=tmp)
    run = subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "serve", "--quiet", "--tensor-parallel-size",
                          "2", "--address", f"ipc://{tmp}/c.sock"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 1
    assert ("--tensor-parallel-size 2 does not divide the model (9 attention heads, 3 KV heads (it must divide them "
            "or be a multiple of them), an MLP of 1536); sizes that do: 1, 3") in run.stderr, run.stderr
    assert os.listdir(tmp) == []
