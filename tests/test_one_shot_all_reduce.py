"""The one-shot all-reduce (``executor_proc/parallel/one_shot.py``, ``forerun serve --all-reduce``).

On the CPU: which all-reduces go one shot (a pure function of mode, ranks, bytes and dtype), the kernel's grid, the
kernel itself under the interpreter with its peers played by hand, the flag's parsing, and its refusals in one
line naming it (one-shot on the cpu, or at a size the kernel has no variant for).

Given two CUDA devices (marked gpu): the ranks of ``tests/all_reduce_ranks.py`` check it against NCCL eagerly and
inside a captured graph replayed with new inputs (float32 NCCL's bits at 2 ranks, bfloat16 within its rounding);
and a TP=2 server with ``--all-reduce one-shot`` serves the tokens (and logprobs) of ``--all-reduce nccl``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

from executor_proc.parallel.one_shot import AUTO_MAX_BYTES, takes_one_shot
from ipc.config import ONE_SHOT_MAX_BYTES, ONE_SHOT_RANKS
from scheduler_proc.executor_process import NO_MULTICAST_ENV
from tests.server_proc import ROOT, ServerProcess, python_path, run_dir
from tests.test_tensor_parallel import PROMPTS, _assert_same_outputs, _workload, tiny_model  # noqa: F401 (a fixture)

BF16, F32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------------- routing (pure)


def test_nccl_takes_everything_and_one_shot_takes_what_fits_its_buffer():
    assert not any(takes_one_shot("nccl", n, 4096, BF16) for n in ONE_SHOT_RANKS)
    for n in ONE_SHOT_RANKS:
        assert takes_one_shot("one-shot", n, 4, F32) and takes_one_shot("one-shot", n, ONE_SHOT_MAX_BYTES, BF16)
        assert not takes_one_shot("one-shot", n, ONE_SHOT_MAX_BYTES + 4, BF16)  # past the buffer: NCCL
    assert not takes_one_shot("one-shot", 2, 0, F32)  # nothing to sum


def test_auto_goes_one_shot_up_to_its_size_only():
    for n, most in AUTO_MAX_BYTES.items():
        assert takes_one_shot("auto", n, most, BF16) and not takes_one_shot("auto", n, most + 4, BF16)
        assert most <= ONE_SHOT_MAX_BYTES
    assert sorted(AUTO_MAX_BYTES) == sorted(ONE_SHOT_RANKS)


@pytest.mark.parametrize("mode", ["one-shot", "auto"])
def test_what_the_kernel_cannot_do_goes_to_nccl(mode):
    assert not takes_one_shot(mode, 3, 4096, BF16)  # no kernel variant for 3, 5, 6, 7 ranks
    assert not takes_one_shot(mode, 2, 4096, torch.float16)  # float32 and bfloat16 only
    assert takes_one_shot(mode, 2, 6, BF16)  # any number of values: the Triton kernel (2 ranks) masks its last block
    assert not takes_one_shot(mode, 4, 6, BF16)  # torch's (4 and 8): a whole number of 4-byte words only


# --------------------------------------------------------------------------- the kernel, one rank played by hand


def test_the_grid_follows_the_size_alone_and_covers_it():
    from kernels.all_reduce import BLOCK, MAX_PROGRAMS, MIN_CHUNK, plan

    for n in (1, 6, MIN_CHUNK, MIN_CHUNK + 1, 4096, 7 * 4096, 256 * 4096, ONE_SHOT_MAX_BYTES // 2):
        programs, chunk = plan(n)
        assert 1 <= programs <= MAX_PROGRAMS and chunk % BLOCK == 0, n
        assert (programs - 1) * chunk < n <= programs * chunk, n  # every program has elements, and all are covered
    assert plan(4096)[0] == 2 and plan(ONE_SHOT_MAX_BYTES // 2)[0] == MAX_PROGRAMS  # a decode row; the whole buffer


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_the_kernel_sums_in_rank_order_signals_its_peers_and_alternates_halves(rank):
    """Rank ``rank`` of 4 under the interpreter, its peers played by hand: each call their inputs are already in
    the half in use and their signals already in this rank's flags.  The sum is float32 from rank 0 up; this
    rank's own input lands in its buffer; its flags are consumed, each peer's slot of each program set once; the
    half flips after every call."""
    from kernels.all_reduce import MAX_PROGRAMS, STATE_WORDS, one_shot_all_reduce, plan

    world, n, half_bytes = 4, 4096 + 40, 8192 * 2
    bufs = [torch.zeros(2 * half_bytes // 2, dtype=BF16) for _ in range(world)]
    flags = [torch.zeros(MAX_PROGRAMS, world, dtype=torch.int32) for _ in range(world)]
    state = torch.zeros(STATE_WORDS, dtype=torch.int32)
    addresses = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    programs = plan(n)[0]
    g = torch.Generator().manual_seed(rank)
    for call, half in enumerate((0, 1, 0)):
        xs = [(torch.randn(n, generator=g) * 100).to(BF16) for _ in range(world)]
        for q in range(world):
            if q != rank:
                bufs[q][half * half_bytes // 2:][:n] = xs[q]
                flags[rank][:programs, q] = 1
                flags[q].zero_()
        x = xs[rank].clone()
        one_shot_all_reduce(x, addresses(bufs), addresses(flags), state, half_bytes, rank, world)
        exact = sum((t.float() for t in xs[1:]), xs[0].float()).to(BF16)  # float32 from rank 0 up, rounded once
        assert torch.equal(x, exact), call
        assert torch.equal(bufs[rank][half * half_bytes // 2:][:n], xs[rank]), call  # its input, in the half
        assert not flags[rank].any(), call  # every signal consumed
        for q in set(range(world)) - {rank}:
            assert flags[q][:programs, rank].eq(1).all() and flags[q].sum() == programs, call  # signalled once
        assert state.tolist() == [1 - half, 0], call  # the next call takes the other half; arrivals back to 0


# --------------------------------------------------------------------------- the flag


def test_the_flag_parses_and_defaults_to_auto():
    from scheduler_proc.launch import build_parser, server_config

    parse = lambda *flags: server_config(build_parser().parse_args(["serve", *flags])).executor  # noqa: E731
    assert parse().all_reduce == "auto"  # one shot for small tensors where it can run, NCCL (gloo) for the rest
    assert parse("-tp", "2", "--all-reduce", "nccl").all_reduce == "nccl"
    assert parse("--device", "cuda", "-tp", "2", "--all-reduce", "one-shot").all_reduce == "one-shot"
    assert parse("-tp", "2", "--all-reduce", "auto").all_reduce == "auto"  # on the cpu: gloo, as with nccl
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--all-reduce", "two-shot"])


def test_one_shot_is_refused_on_the_cpu_and_at_three_ranks_in_one_line():
    from scheduler_proc.launch import main

    with pytest.raises(SystemExit, match=r"^forerun: --all-reduce one-shot needs CUDA devices \(peer-to-peer GPU "
                                         r"buffers\), got --device cpu: on the cpu the ranks all-reduce over gloo "
                                         r"\(--all-reduce nccl or auto\)$"):
        main(["serve", "-tp", "2", "--all-reduce", "one-shot", "--load-format", "dummy"])
    with pytest.raises(SystemExit, match=r"^forerun: --all-reduce one-shot runs on 2, 4 or 8 ranks, got "
                                         r"--tensor-parallel-size 3: use --all-reduce nccl or auto$"):
        main(["serve", "--device", "cuda", "-tp", "3", "--all-reduce", "one-shot", "--load-format", "dummy"])


# --------------------------------------------------------------------------- on two GPUs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_one_shot_against_nccl_eager_and_in_a_replayed_graph(tmp_path):
    path = python_path()  # keeps a --target site
    env = dict(os.environ, PYTHONPATH=path, **NO_MULTICAST_ENV)
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, "-m", "tests.all_reduce_ranks", str(r), "2", store], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        outputs = [proc.communicate(timeout=300)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_one_shot_server_serves_what_an_nccl_server_serves(tiny_model):  # noqa: F811
    """float32, two ranks: one-shot adds a + b as NCCL does, so the tokens and logprobs are the same."""
    flags = ("--model", tiny_model, "--device", "cuda", "--dtype", "float32", "--tensor-parallel-size", "2",
             "--max-num-seqs", "8", "--num-kv-blocks", "96", "--block-size", "4", "--debug-checks")
    servers = {}
    try:
        for mode in ("nccl", "one-shot"):
            servers[mode] = ServerProcess(*flags, "--all-reduce", mode, tmpdir=run_dir(), timeout=180)
        ref = asyncio.run(_workload(servers["nccl"].address, PROMPTS))
        ours = asyncio.run(_workload(servers["one-shot"].address, PROMPTS))
        _assert_same_outputs(ours, ref)
    finally:
        for srv in servers.values():
            srv.stop()
