"""The host KV tier's copies: bit-exact round trips (CPU and CUDA), and a pipelined loop with no sync (CUDA).

``HostKV`` moves whole blocks between the device KV storage
``[layers, 2, blocks, E]`` and the pinned host pool ``[host_blocks, layers, 2, E]``
with one ``copy_items`` call per direction per plan.  The round trip backs up
device blocks, onloads them into other device blocks and compares bytes, for
item sizes that are not multiples of 2, 8 or 16 bytes.  On CUDA a worker runs
200 pipelined steps whose plans carry backups and onloads under
``torch.cuda.set_sync_debug_mode("error")``: no host wait, no host read; the
output thread's poll (``backups_done_through``) reaches the last step once the
device is idle.
"""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest
import torch

from executor_proc.model.kv_cache import KVCache
from executor_proc.step.host_kv import HostKV
from executor_proc.step.staging import PinnedStaging
from executor_proc.testing.synthetic import GREEDY, SyntheticPlanner
from ipc.protocol import StepPlan
from tests.test_gpu_fastpath import built, write_config

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def diff_plan(step_id: int, onloads=(), backups=()) -> StepPlan:
    """A plan of host-tier copies only (no rows)."""
    return StepPlan(step_id, [], [], [], [], [], onloads=list(onloads), backups=list(backups))


def run_copies(hk: HostKV, staging: PinnedStaging, plan: StepPlan) -> None:
    upload = staging.upload()
    parts = hk.stage(plan, upload)
    hk.copy(plan.step_id, parts, upload.send())
    hk.start_backups()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,block_size,heads,dim", [
    (torch.float16, 1, 1, 3),  # 6-byte items
    (torch.float32, 4, 3, 5),  # 240
    (torch.bfloat16, 2, 1, 7),  # 28
    (torch.float16, 16, 2, 64),  # 4 KiB: an aligned body
])
def test_backup_then_onload_round_trip_is_bit_exact(device, dtype, block_size, heads, dim):
    config = SimpleNamespace(num_layers=3, num_kv_heads=heads, head_dim=dim)
    kv = KVCache(config, num_blocks=10, block_size=block_size, device=device, dtype=dtype)
    g = torch.Generator(device=device).manual_seed(0)
    kv.storage.copy_(torch.randn(kv.storage.shape, generator=g, device=device, dtype=torch.float32).to(dtype))
    original = kv.storage.clone()
    hk = HostKV(kv, num_blocks=6, device=torch.device(device))
    staging = PinnedStaging(torch.device(device))
    run_copies(hk, staging, diff_plan(0, backups=[7, 5, 2, 0, 3, 4]))  # device 7 -> host 5, 2 -> 0, 3 -> 4
    if CUDA and device == "cuda":
        torch.cuda.synchronize()
    assert hk.backups_done_through(0) == 0
    assert torch.equal(hk.pool[5].to(device), kv.storage[:, :, 7].reshape(hk.pool[5].shape))
    run_copies(hk, staging, diff_plan(1, onloads=[5, 1, 0, 8, 4, 9]))  # host 5 -> device 1, 0 -> 8, 4 -> 9
    if CUDA and device == "cuda":
        torch.cuda.synchronize()
    s = kv.storage
    for src, dst in ((7, 1), (2, 8), (3, 9)):
        assert torch.equal(s[:, :, dst].view(torch.uint8), original[:, :, src].view(torch.uint8)), (src, dst)
    untouched = [b for b in range(10) if b not in (1, 8, 9)]
    assert torch.equal(s[:, :, untouched].view(torch.uint8), original[:, :, untouched].view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("backup_stream", [True, False])
def test_pipelined_steps_with_backups_and_onloads_do_not_synchronize(tmp_path, backup_stream):
    """200 decode steps at depth 2, each plan backing up 4 blocks and onloading 2, under sync debug mode."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    worker = built(model_dir, "cuda", "bfloat16", num_slots=16, max_batch=16, num_blocks=2048,
                   num_host_kv_blocks=64, host_kv_backup_stream=backup_stream).worker
    assert worker.host_kv is not None and worker.host_kv.num_blocks == 64
    # 12 requests x 240 positions take 720 blocks of the planner's 1,024; blocks 1024.. are onload targets.
    planner = SyntheticPlanner(num_slots=16, block_size=4, num_blocks=1024)
    for r in range(12):
        planner.add(list(range(r, r + 8)), GREEDY)
    in_flight: deque = deque()

    def step(backups, onloads=()):
        plan = planner.step()
        plan.backups, plan.onloads = list(backups), list(onloads)
        host, copy = worker.copy_out(worker.launch(worker.prepare(plan)))
        in_flight.append((plan.step_id, host, copy))
        while len(in_flight) > 2:  # the output thread's part
            step_id, old_host, old_copy = in_flight.popleft()
            old_copy.synchronize()
            assert len(old_host.tolist()) > 0
            old_copy.release()
            assert worker.backups_done_through(step_id) <= step_id

    # Blocks 0..23 hold the 12 prompts (written by the first step, never rewritten): backup sources.
    # Host blocks 32..63 are filled first, so that onloads read backed-up blocks; blocks 1024.. are in no table.
    for k in range(32):
        step([k % 12, 32 + k])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(200):
            step([x for k in range(4) for x in ((i + k) % 12, (4 * i + k) % 32)],
                 [x for k in range(2) for x in (32 + (2 * i + k) % 32, 1024 + (2 * i + k) % 1024)])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    last = planner.step_id - 1
    assert worker.backups_done_through(last) == last


def swap_scenario(worker, swap: str, first_step_id: int, releases: list[int]) -> tuple[list[list[int]], list[int], int]:
    """8 greedy requests decode 24 steps; ``swap``: "none"; "copy": request 0's full blocks are backed up at
    step 8, their device blocks clobbered, and onloaded into other device blocks (its table remapped) at
    step 10; "clobber": the same without the onload (the control: its tokens must change).
    Returns (tokens per step, slots used, next step id)."""
    planner = SyntheticPlanner(num_slots=8, block_size=4, num_blocks=200)
    planner.step_id = first_step_id  # step ids only grow for the worker (its backup events)
    g = torch.Generator().manual_seed(5)
    for r in range(8):
        planner.add(torch.randint(0, 1000, (9 + 2 * r,), generator=g).tolist(), GREEDY)
    out, moved = [], []
    for i in range(24):
        plan = planner.step()
        if i == 0:
            plan.releases = list(releases)
        victim = planner.running[0] if planner.running else None
        if swap != "none" and i == 8:
            full = victim.computed // 4 - 1  # its blocks fully written by the steps before this one
            moved = victim.blocks[:full]
            plan.backups = [x for h, b in enumerate(moved) for x in (b, h)]
        if swap != "none" and i == 10:
            if worker.host_kv.cuda:
                torch.cuda.synchronize()  # the backups are done (the scheduler would wait for their report)
            assert worker.backups_done_through(plan.step_id - 1) == plan.step_id - 1
            worker.kv_cache.storage[:, :, moved] = torch.randn_like(worker.kv_cache.storage[:, :, moved])
            if swap == "copy":
                new = [planner.free_blocks.pop() for _ in moved]
                plan.onloads = [x for h, b in enumerate(new) for x in (h, b)]
                plan.block_appends = list(plan.block_appends) + [x for k, b in enumerate(new)
                                                                 for x in (victim.slot, k, b)]
                victim.blocks[:len(new)] = new
        host, copy = worker.copy_out(worker.launch(worker.prepare(plan)))
        if copy is not None:
            copy.synchronize()
        out.append(host if isinstance(host, list) else host.tolist())
        if copy is not None:
            copy.release()
    return out, [r.slot for r in planner.running], planner.step_id


@pytest.mark.parametrize("device", DEVICES)
def test_swap_out_and_in_is_bit_exact_in_bf16(tmp_path, device):
    """bf16: KV backed up, clobbered on the device and onloaded into other blocks gives bit-identical tokens
    (same batch, so no other difference); without the onload the tokens change."""
    model_dir = write_config(tmp_path, hidden=256, layers=2, heads=8, kv_heads=2, vocab=1000, intermediate=512)
    worker = built(model_dir, device, "bfloat16", num_slots=8, max_batch=8, num_blocks=256,
                   num_host_kv_blocks=64).worker
    step_id, slots, runs = 0, [], {}
    for swap in ("none", "copy", "none", "clobber"):
        tokens, slots, step_id = swap_scenario(worker, swap, step_id, slots)
        runs.setdefault(swap, []).append(tokens)
    assert runs["none"][0] == runs["none"][1], "the scenario is not deterministic: nothing to compare"
    assert runs["copy"][0] == runs["none"][0]
    assert runs["clobber"][0] != runs["none"][0], "clobbering the blocks must change the tokens"
