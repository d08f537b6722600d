"""The host KV tier end to end on the default model's shape: same greedy tokens, and this workload's helpers.

A server with a tiny device pool (preemption is certain) and a larger host
pool runs prompts concurrently: preempted requests resume from the
copies of their blocks left on the device or on the host (swap) and must
stream exactly what a reference server (ample device pool, no host
tier) streams.  Then a long
prompt is pushed out of the device cache by others and sent again: it hits
the host tier, is onloaded, and gives the same tokens.  Both pools are whole
at the end.

Here on CUDA.  On the CPU, with the default model, this workload runs through the mixed-step runner at depth 1
(tests/test_mixed_graphs_model.py), and tests/test_kv_paths.py's host-tier server (depth 2, plain steps) swaps and
onloads requests with every sampling option, its pools whole at the end.
"""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import torch

from ipc.client import AsyncClient
from tests.server_proc import ROOT, assert_no_leak, wait_idle

pytestmark = pytest.mark.slow

BLOCK = 16
DEVICE_BLOCKS = 14
HOST_BLOCKS = 256
MAX_TOKENS = 12


def assert_tiers_whole(s) -> None:
    assert_no_leak(s)
    assert s.num_host_kv_blocks == HOST_BLOCKS and s.num_free_host_kv_blocks == HOST_BLOCKS, s


async def generate_all(address: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    kw = dict(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    async with AsyncClient(address, timeout=600) as c:
        results = await asyncio.gather(*[c.generate(prompt_token_ids=ids, **kw) for ids in prompts])
    return [r.token_ids for r in results]


def swap_and_hit_prompts(chat_prompt_ids) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Six prompts of 70 to 80 tokens (5 to 6 blocks with the outputs: the 14-block device pool preempts them);
    a long prompt of about 145 tokens (9 full blocks); three more as long, that push it out of the device pool."""
    return ([ids + ids for ids in chat_prompt_ids[:6]], chat_prompt_ids[8] * 4,
            [ids * 4 for ids in chat_prompt_ids[9:12]])


async def push_out(address: str, others: list[list[int]]) -> None:
    """One by one, each taking most of the 14 device blocks: the oldest cached blocks go.  Their own outputs
    are not compared, so one token each (the prompt's blocks are what pushes)."""
    for ids in others:
        await generate_all(address, [ids], max_tokens=1)


DUMMY_135M = ("--load-format", "dummy", "--model", os.path.join(ROOT, "scripts", "configs", "smollm2-135m"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
async def test_cuda_swaps_and_host_hits_match_an_untouched_run(servers):
    """The same on CUDA (float32, Triton kernels, graphs, the copy and backup streams), random weights of the
    default model's shape (the model file does not travel to GPU machines) and random prompts. float32: the
    resumed request's partial last block is recomputed by a prefill, which in bf16 need not give the decode's
    bits (the copied blocks are bit-exact in any dtype: tests/test_host_kv_gpu.py)."""
    cuda = DUMMY_135M + ("--device", "cuda", "--dtype", "float32", "--pipeline-depth", "1", "--max-num-seqs", "8")
    plain = servers(*cuda, "--num-kv-blocks", "512", "--host-kv-gib", "0")
    tier = servers(*cuda, "--num-kv-blocks", str(DEVICE_BLOCKS), "--num-host-kv-blocks", str(HOST_BLOCKS),
                          "--debug-checks")
    rng = random.Random(3)
    ids = [[rng.randrange(10, 49000) for _ in range(rng.randrange(25, 36))] for _ in range(12)]
    prompts = [x + x for x in ids[:8]]  # 50 to 70 tokens: 4 to 5 blocks with the outputs
    long, others = ids[8] * 4, [x * 4 for x in ids[9:12]]
    reference = await generate_all(plain.address, prompts + [long])
    got = await generate_all(tier.address, prompts)
    for x in [long] + others:
        await generate_all(tier.address, [x])
    again = await generate_all(tier.address, [long])
    s = await wait_idle(tier.address)
    assert got + again == reference
    assert s.preemptions > 0 and s.resumes > 0 and s.prefix_cache_host_hit_tokens >= BLOCK * 3
    assert_tiers_whole(s)
