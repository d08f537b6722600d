"""The one-shot all-reduce (``executor_proc/parallel/one_shot.py``, ``forerun serve --all-reduce``).

On the CPU: which all-reduces go one shot (a pure function of mode, ranks, bytes and dtype), the flag's parsing, and
its refusals in one line naming it (one-shot on the cpu, or at a size torch's kernel has no variant for).

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
def test_what_torchs_kernel_cannot_do_goes_to_nccl(mode):
    assert not takes_one_shot(mode, 3, 4096, BF16)  # no kernel variant for 3, 5, 6, 7 ranks
    assert not takes_one_shot(mode, 2, 4096, torch.float16)  # float32 and bfloat16 only
    assert not takes_one_shot(mode, 2, 6, BF16)  # 3 bfloat16 values: not a whole number of 4-byte words


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
