"""Build a ready :class:`executor_proc.step.worker.Worker` from an :class:`ExecutorConfig` (no sockets).

Load the model, choose its backend (:func:`executor_proc.backends.select.select_backend`),
measure what the largest step and the CUDA graphs take (a profile step and a capture against a
provisional KV cache), size the KV cache from what is left of the memory budget
(:mod:`executor_proc.memory_plan`), allocate it, and capture the graphs (decode steps, and steps
with prefill chunks) against it, timing the capture and the device memory it took.  The executor
process and the GPU benchmarks share it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from executor_proc.backends.select import graph_max_batch, mixed_max_tokens, select_backend
from executor_proc.host_memory import check_host_kv, check_host_slots, host_allocation, host_out_of_memory, kv_advice
from executor_proc.memory_plan import (GIB, MemoryPlan, MemoryPlanError, StartupRefused, check_fits, gc_threshold,
                                      plan_memory)
from executor_proc.model.config import ModelConfig
from executor_proc.model.kv_cache import KVCache, kv_cache_bytes_per_block
from executor_proc.model.kv_scales import calibrate_kv_scales
from executor_proc.model.loader import load_model, weights_advice
from executor_proc.model.quantization import is_quantized
from executor_proc.step.draft import DraftModel
from executor_proc.step.grammar import build_grammar_slots
from executor_proc.step.host_kv import HostKV, num_host_blocks
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.speculate import build_speculator
from executor_proc.step.worker import Worker
from ipc.config import ExecutorConfig
from ipc.protocol import Admit, SlotSampling, StepPlan
from kernels.precompile import STAGE as COMPILE_STAGE

CPU_KV_BUDGET_BYTES = 2 * 1024**3
GRAPH_STAGE = "capturing CUDA graphs"
PROFILE_STAGE = "measuring the largest step"
# How much more the final capture may take than the measured one before the KV cache is sized again.
GRAPH_SLACK_BYTES = 256 * 1024**2

ProgressCallback = Callable[[str, int, int], None]


@dataclass
class BuiltWorker:
    """The worker and the capacity it reports to the scheduler (``ExecutorReady``)."""

    worker: Worker
    model_config: ModelConfig
    num_kv_blocks: int
    max_model_len: int
    device: torch.device
    num_host_blocks: int = 0  # the host KV tier's pool (0: off)
    fp8_weights: bool = False  # the layers' weights are FP8 (--quantization fp8, or an FP8 checkpoint)
    num_graphs: int = 0  # CUDA graphs captured at start-up
    graph_capture_s: float = 0.0  # how long capturing them took
    graph_memory_bytes: int = 0  # device memory they took (free memory before - after)
    tp: Optional[object] = None  # executor_proc.parallel.group.TPGroup when tensor_parallel_size > 1
    plan: Optional[MemoryPlan] = None  # the device memory plan the KV cache was sized by
    plan_note: str = ""  # what the start-up line adds to the plan's (a context held to the KV cache's size)


def resolve_device(name: str, ranks: int = 1) -> torch.device:
    """``--device name`` checked for all ``ranks`` tensor-parallel ranks (cuda:i .. cuda:i+ranks-1: every rank
    refuses alike, naming the flags as typed), with an explicit index for CUDA; StartupRefused for GPUs this
    machine lacks.  A rank's own device is :func:`executor_proc.parallel.group.rank_device` of it."""
    device = torch.device(name)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index + ranks > count:
            have = f"{count} visible CUDA device{'s' if count > 1 else ''}" if count else \
                f"no CUDA device torch {torch.__version__} can use"
            needs = (f" with --tensor-parallel-size {ranks} needs cuda:{device.index}..cuda:{device.index + ranks - 1}"
                     if ranks > 1 else "")
            raise StartupRefused(f"--device {name}{needs}: this machine has {have} (--device cpu runs without one)")
    return device


def build_worker(cfg: ExecutorConfig, progress: ProgressCallback = lambda stage, done, total: None) -> BuiltWorker:
    """Everything the executor needs before its first plan; ``progress(stage, done, total)`` reports it.

    With ``tensor_parallel_size > 1`` this is one rank's worker: it joins the group first, loads its
    shard, and sizes its KV cache (its KV heads only) and host pool to the smallest any rank can hold.
    Raises :class:`executor_proc.memory_plan.MemoryPlanError` (a one-line message) when the configuration
    does not fit the device, also for a device that runs out of memory while starting, and for the host: naming
    what was being allocated (:func:`host_allocation`) and the flags that make it smaller.
    """
    try:
        return _build_worker(cfg, progress)
    except torch.OutOfMemoryError as e:
        first = str(e).splitlines()[0] if str(e) else "out of memory"
        raise MemoryPlanError(f"the device ran out of memory while starting ({first}); lower "
                              f"--gpu-memory-utilization (other processes may be using the device), "
                              f"--max-num-seqs or --max-num-batched-tokens") from None
    except (MemoryError, RuntimeError) as e:
        # host memory outside the allocations host_allocation names: the slots' tables and the step machinery's
        # buffers, which the slots and the context length size
        first = host_out_of_memory(e)
        if first is None:
            raise
        raise MemoryPlanError(f"the host ran out of memory while starting ({first}); lower --max-num-seqs or "
                              f"--max-model-len") from None


def _build_worker(cfg: ExecutorConfig, progress: ProgressCallback) -> BuiltWorker:
    tp_size, tp = cfg.tensor_parallel_size, None
    device = resolve_device(cfg.device, tp_size)
    if tp_size > 1:
        from executor_proc.parallel.group import init_group, rank_device

        device = torch.device(rank_device(str(device), cfg.tp_rank))
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if tp_size > 1:
        tp = init_group(cfg.tp_init_method, cfg.tp_rank, tp_size, device, cfg.all_reduce)
    dtype = getattr(torch, cfg.resolved_dtype())
    what = f"--model {cfg.model}" if cfg.model else "the default model"
    with refused_as(what), host_allocation(f"the weights of {what}", weights_advice(dtype)):
        model, mcfg = load_model(model_path(cfg, progress), cfg.load_format, device, dtype, progress_cb=progress,
                                 tp=tp, expert_parallel=cfg.enable_expert_parallel, host_replicas=cfg.host_replicas)
    if cfg.max_model_len and cfg.max_model_len > mcfg.max_model_len:  # positions the model was not made for
        why = "max_position_embeddings" + (", capped at its sliding window" if mcfg.sliding_window else "")
        raise StartupRefused(f"--max-model-len {cfg.max_model_len:,} exceeds the {mcfg.max_model_len:,} positions "
                             f"{what} runs ({why}): use at most {mcfg.max_model_len:,}")
    max_len = cfg.max_model_len or mcfg.max_model_len
    max_blocks = -(-max_len // cfg.block_size)
    with refused_as(what):  # the backend's and the quantization's checks of the model
        backend = select_backend(cfg, device, model, max_len, progress)
    model.use_backend(backend)
    # after the backend: FP8 weights are quantized there
    weights = model.weight_bytes()
    draft, draft_positions = load_draft(cfg, device, dtype, max_len, mcfg.vocab_size, progress)
    kv_dtype = torch.float8_e4m3fn if cfg.kv_cache_dtype == "fp8" else dtype
    kv_scales = None
    if cfg.kv_cache_dtype == "fp8":  # the checkpoint's scales where it has them, else measured now
        kv_scales = model.checkpoint_kv_scales or calibrate_kv_scales(model, device, cfg.block_size)
    per_block = kv_cache_bytes_per_block(model.config, cfg.block_size, kv_dtype)  # the rank's KV heads
    # A host pool costs per_block on every rank: its budget is the whole group's.
    host_blocks = num_host_blocks(cfg, device, per_block * tp_size)
    if not cuda:  # the device's tables are the memory plan's; the host's are checked before they are made
        check_host_slots(cfg.num_slots, max_blocks, mcfg.vocab_size, max_len)
    tables = SlotTables(cfg.num_slots, max_blocks, device, mcfg.vocab_size)
    max_batch = graph_max_batch(cfg, backend)
    capture = cuda and max_batch > 0
    # A provisional KV cache, as large as the profile step needs: the activations and the graphs are
    # measured against it, then it makes way for the planned one.
    probes = ProfileStep.layouts(cfg, max_len, mcfg.vocab_size) if cuda else []
    provisional = max((p.num_blocks for p in probes), default=1)
    with host_allocation("the KV cache", kv_advice(cfg)):
        kv = KVCache(model.config, provisional, cfg.block_size, device=device, dtype=kv_dtype, scales=kv_scales)
    worker = Worker(model, kv, tables, cfg.block_size, device, graph_max_batch=max_batch, capture_graphs=capture,
                    mixed_max_tokens=mixed_max_tokens(cfg, backend))
    worker.enable_speculation(build_speculator(cfg.speculative, cfg.num_slots, max_len, device, draft))
    if draft is not None:
        draft.allocate(provisional)
    if tp_size == 1:  # structured outputs (the scheduler refuses them under tensor parallelism)
        worker.grammar = build_grammar_slots(cfg.tokenizer, mcfg.vocab_size, list(mcfg.eos_token_ids),
                                             cfg.num_slots, device)
        tables.grammar_mask = worker.grammar.table if worker.grammar is not None else None
    graph_progress = lambda done, total: progress(GRAPH_STAGE, done, total)  # noqa: E731
    compile_progress = lambda done, total: progress(COMPILE_STAGE, done, total)  # noqa: E731
    measured = None
    if cuda:
        progress(PROFILE_STAGE, 0, 1)
        transient = max(probe.run(worker, first_step_id=2 * i) for i, probe in enumerate(probes))
        progress(PROFILE_STAGE, 1, 1)
        graphs = 0
        if cfg.num_kv_blocks is None and capture:  # capture once to measure, again against the planned cache
            _, _, graphs = _capture_graphs(worker, device, graph_progress, compile_progress)
            worker.drop_graphs()
        worker.kv_cache = kv = None
        if draft is not None:
            draft.allocate(None)
        measured = _measure(device, weights + (draft.weight_bytes if draft is not None else 0), transient, graphs)
    useful = cfg.num_slots * max_blocks
    plan = _plan(cfg, device, measured, weights, per_block, max_len, useful, tp, draft)
    host_blocks = tp.agree_min(host_blocks) if tp is not None else host_blocks
    for attempt in range(2):
        progress("kv_cache", 0, 1)
        with host_allocation(f"the KV cache ({plan.kv / GIB:.2f} GiB)", kv_advice(cfg)):
            worker.kv_cache = kv = KVCache(model.config, plan.kv_blocks, cfg.block_size, device=device,
                                           dtype=kv_dtype, scales=kv_scales)
            if draft is not None:
                draft.allocate(plan.kv_blocks)
        progress("kv_cache", 1, 1)
        num_graphs, capture_s, graph_bytes = _capture_graphs(
            worker, device, graph_progress, compile_progress, compile_first=measured is None or not measured.graphs)
        if not (cuda and measured.graphs):  # not measured before (a given block count): the plan shows what they took
            plan = dataclasses.replace(plan, graphs=graph_bytes) if cuda else plan
            break
        # The final capture took more than the measured one: once, the KV cache makes way for what it took.
        again = attempt == 0 and graph_bytes > plan.graphs + GRAPH_SLACK_BYTES
        if tp is not None:
            again = tp.agree_min(0 if again else 1) == 0
        if not again:  # the plan shows the larger figure (the cap below holds the allocator to it)
            plan = dataclasses.replace(plan, graphs=max(plan.graphs, graph_bytes))
            break
        worker.drop_graphs()
        worker.kv_cache = kv = None
        if draft is not None:
            draft.allocate(None)
        measured = dataclasses.replace(measured, graphs=max(graph_bytes, measured.graphs))
        plan = _plan(cfg, device, measured, weights, per_block, max_len, useful, tp, draft)
        gc.collect()
        torch.cuda.empty_cache()
    if cuda:
        cap_allocator(worker, plan)
    if host_blocks:  # after the captures: a host pool holds the KV cache's storage, not the graphs'
        progress("host_kv_cache", 0, 1)
        # Only rank 0 reports which backups are done: the other ranks' are ordered before their later steps.
        with host_allocation(f"the host KV tier's pool ({host_blocks * per_block / GIB:.2f} GiB)",
                             "lower --num-host-kv-blocks or --host-kv-gib"):
            worker.host_kv = HostKV(kv, host_blocks, device,
                                    backup_stream=cfg.host_kv_backup_stream and cfg.tp_rank == 0)
        progress("host_kv_cache", 1, 1)
    # A given block count may hold less than one request of max_len (the plan refuses that otherwise): requests
    # are then held to what the cache holds, and the server says so (an OpenAI client's default max_tokens is the
    # rest of the context it is told)
    served_len = min(max_len, plan.kv_tokens)
    note = (f"; a request holds at most {served_len:,} tokens (the KV cache's {plan.kv_blocks:,} blocks, below "
            f"the context length of {max_len:,})" if served_len < max_len else "")
    note += draft_note(cfg, draft, draft_positions, served_len)
    return BuiltWorker(worker, mcfg, plan.kv_blocks, served_len, device, host_blocks, num_graphs=num_graphs,
                       graph_capture_s=capture_s, graph_memory_bytes=graph_bytes, tp=tp, plan=plan, plan_note=note,
                       fp8_weights=is_quantized(model))


def cap_allocator(worker: Worker, plan: MemoryPlan) -> None:
    """Hold torch's allocator to the plan while serving (unless ``PYTORCH_CUDA_ALLOC_CONF`` sets it up otherwise).

    The allocator keeps the blocks a step frees cached for later steps, and a request that no cached block fits
    gets a new segment while the device has any memory left: with steps of varied shapes its reserved memory grew
    past the plan until the device was nearly full (1.1 GiB free at 1,024 slots and 16,384 tokens, on both
    shapes).  Its garbage collection, at a threshold of the plan's share of the device, gives whole cached
    segments back before it asks the device for more.  A soft cap: live memory beyond the plan would still be
    served.  A collection cannot give memory back inside a capture: a graph captured while serving empties the
    cache after its warm-up, before the capture.
    """
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    torch.cuda.set_per_process_memory_fraction(1.0, worker.device)  # the threshold is a fraction of this
    settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    settings(f"garbage_collection_threshold:{gc_threshold(plan):.6f}")
    worker.capturer.empty_cache_before_capture = True


@dataclass
class Measured:
    """The parts of the plan measured on the device (bytes); see :mod:`executor_proc.memory_plan`."""

    total: int
    activations: int  # the step machinery's fixed buffers + the profile step's transient peak
    graphs: int  # the graphs' pool and objects (0: not measured yet)
    other: int  # on the device outside torch's allocator: the CUDA context, libraries, other processes


def _measure(device: torch.device, weights: int, transient: int, graphs: int) -> Measured:
    """What is on the device now (the weights and the step machinery's buffers, no KV cache, no graph)."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)  # the allocator's segments, partly used ones whole
    return Measured(total, max(0, reserved - weights) + transient, graphs, max(0, total - free - reserved))


def _plan(cfg: ExecutorConfig, device: torch.device, measured: Optional[Measured], weights: int, per_block: int,
          max_len: int, useful: int, tp, draft: Optional[DraftModel] = None) -> MemoryPlan:
    """The rank's plan, agreed with the group (the smallest KV block count), or MemoryPlanError; ``draft``: a draft
    model, whose weights and KV bytes per block the plan counts."""
    draft_weights, draft_block = (draft.weight_bytes, draft.block_bytes) if draft is not None else (0, 0)
    if measured is None:  # the cpu: a fixed budget for the host (host memory is not planned like a device's),
        # shared by the processes that each hold a KV cache there: the tensor-parallel ranks of every replica
        processes = cfg.tensor_parallel_size * cfg.host_replicas
        budget = CPU_KV_BUDGET_BYTES // processes
        blocks = cfg.num_kv_blocks or max(1, min(useful, (budget - draft_block) // (per_block + draft_block)))
        check_host_kv(blocks, per_block + draft_block, given=cfg.num_kv_blocks is not None, processes=processes)
        plan = MemoryPlan("cpu", budget, 1.0, weights, 0, 0, 0, blocks, per_block, cfg.block_size,
                          draft_weights, draft_block)
    elif cfg.num_kv_blocks is not None:
        plan = MemoryPlan(str(device), measured.total, cfg.gpu_memory_utilization, weights, measured.activations,
                          measured.graphs, measured.other, cfg.num_kv_blocks, per_block, cfg.block_size,
                          draft_weights, draft_block)
    else:
        plan = plan_memory(device=str(device), total=measured.total, utilization=cfg.gpu_memory_utilization,
                           weights=weights, activations=measured.activations, graphs=measured.graphs,
                           other=measured.other, block_bytes=per_block, block_size=cfg.block_size,
                           max_model_len=0, useful_blocks=useful,  # checked once the group agrees
                           draft_weights=draft_weights, draft_block_bytes=draft_block)
    if tp is not None:
        plan = dataclasses.replace(plan, kv_blocks=tp.agree_min(plan.kv_blocks))
    if cfg.num_kv_blocks is None:  # a given block count is the caller's (tests, restarts of the same server)
        check_fits(plan, max_len)
    return plan


class ProfileStep:
    """The heaviest eager step a server can be sent, run once to measure its transient memory (vLLM's
    profile run): the full token budget in prefill chunks of as many rows as fit, every row sampled with
    top-k/top-p, penalties and logprobs, every prompt position's logprobs (the LM head for every token)."""

    def __init__(self, rows: list[int], block_size: int, vocab: int):
        self.rows = rows  # tokens of each row
        self.block_size = block_size
        self.vocab = vocab

    @classmethod
    def layouts(cls, cfg: ExecutorConfig, max_len: int, vocab: int) -> list["ProfileStep"]:
        """The full token budget in as many short rows as there are slots, and in rows as long as they may be
        (``max_len``: the context length): the peak depends on the layout (a long prompt's logprobs are sliced
        into groups of its own positions, short ones are gathered into groups), so both are measured."""
        tokens = min(cfg.max_num_batched_tokens, cfg.num_slots * max_len)
        # Two tokens a row at least (one prompt logprob each), at most max_len.
        short = min(cfg.num_slots, max(1, tokens // 2, -(-tokens // max_len)))
        long = min(cfg.num_slots, -(-tokens // max_len))
        split = lambda n: cls([tokens // n + (i < tokens % n) for i in range(n)], cfg.block_size, vocab)  # noqa: E731
        return [split(short)] if long == short else [split(short), split(long)]

    @property
    def num_blocks(self) -> int:
        """Blocks its rows write, and block 0 (the padding slot's)."""
        return 1 + sum(-(-t // self.block_size) for t in self.rows)

    def plans(self, first_step_id: int = 0) -> tuple[StepPlan, StepPlan]:
        """The step, then a plan that releases its slots."""
        slots = list(range(len(self.rows)))
        appends, next_block = [], 1
        for slot, t in enumerate(self.rows):
            for i in range(-(-t // self.block_size)):
                appends += [slot, i, next_block]
                next_block += 1
        admits = [Admit(s, SlotSampling(temperature=1.0, top_k=50, top_p=0.9, min_p=0.0, seed=s, logprobs=20,
                                        prompt_logprobs=20, repetition_penalty=1.1, frequency_penalty=0.1,
                                        presence_penalty=0.1, num_prompt_tokens=t))
                  for s, t in zip(slots, self.rows)]
        tokens = [(7 * i + 1) % self.vocab for i in range(sum(self.rows))]
        n = len(slots)
        step = StepPlan(first_step_id, slots, list(self.rows), [0] * n, [True] * n, [True] * n,
                        prefill_tokens=tokens, block_appends=appends, admits=admits)
        return step, StepPlan(first_step_id + 1, [], [], [], [], [], releases=slots)

    def run(self, worker: Worker, first_step_id: int = 0) -> int:
        """Run it on ``worker``; the device memory it reserved beyond what was reserved before (bytes)."""
        device = worker.device
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        for plan in self.plans(first_step_id):
            step = worker.prepare(plan)
            worker.launch(step)
        torch.cuda.synchronize(device)
        worker.saved_hidden.forget(range(len(self.rows)))
        return max(0, torch.cuda.max_memory_reserved(device) - before)


def _capture_graphs(worker: Worker, device: torch.device, progress, compile_progress,
                    compile_first: bool = True) -> tuple[int, float, int]:
    """Compile every graph's kernels (unless ``compile_first`` is false: compiled already), then capture them;
    (how many, seconds, device bytes taken)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()  # what the allocator caches counts as free: the graphs' pool is what they add
    free = torch.cuda.mem_get_info(device)[0] if cuda else 0
    t0 = time.perf_counter()
    worker.capture_graphs(progress, compile_progress=compile_progress, compile_first=compile_first, heaviest=True)
    seconds = time.perf_counter() - t0
    if cuda:
        torch.cuda.empty_cache()  # the compile pass's scratch graphs are gone: their memory goes back
    taken = free - torch.cuda.mem_get_info(device)[0] if cuda else 0
    return worker.num_graphs, seconds, max(0, taken)


def load_draft(cfg: ExecutorConfig, device: torch.device, dtype: torch.dtype, max_len: int, vocab_size: int,
               progress: ProgressCallback) -> tuple[Optional[DraftModel], int]:
    """The draft model of ``--speculative-method draft`` on its backend (None: another method or none), and the
    positions it was made for; its KV cache in ``dtype`` (an FP8 cache's scales are the model's own).  A
    vocabulary other than the model's is refused (:class:`StartupRefused`)."""
    sc = cfg.speculative
    if sc.method != "draft":
        return None, 0
    fmt = sc.draft_load_format or cfg.load_format
    draft_progress = lambda stage, done, total: progress(f"draft model: {stage}", done, total)  # noqa: E731
    what = f"--draft-model {sc.draft_model}"
    with refused_as(what), host_allocation(f"the weights of {what}", weights_advice(dtype)):
        model, dcfg = load_model(sc.draft_model, fmt, device, dtype, progress_cb=draft_progress)
    if dcfg.vocab_size != vocab_size:
        raise StartupRefused(f"--draft-model {sc.draft_model} has a vocabulary of {dcfg.vocab_size:,} tokens, the "
                             f"model {vocab_size:,}: the draft must share the model's tokenizer and vocabulary")
    model.use_backend(select_backend(cfg, device, model, max_len, draft_progress))  # its rotary covers max_len
    return DraftModel(model, sc.num_tokens, cfg.block_size, dtype, device), dcfg.max_model_len


def draft_note(cfg: ExecutorConfig, draft: Optional[DraftModel], positions: int, served_len: int) -> str:
    """What the start-up line says of a draft model made for fewer positions than a request may hold: past them
    its drafts still run and are verified (the output is the model's either way) but are rarely accepted."""
    if draft is None or positions >= served_len:
        return ""
    return (f"; --draft-model {cfg.speculative.draft_model} was made for {positions:,} positions, fewer than the "
            f"{served_len:,} a request may hold: past them its drafts are seldom accepted")


@contextlib.contextmanager
def refused_as(what: str):
    """A ValueError or OSError while reading a model (its files, its architecture, a flag it does not cover) is the
    user's to fix: :class:`StartupRefused`, the error's first line after ``what``, and no traceback."""
    try:
        yield
    except (ValueError, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise StartupRefused(f"{what}: {first}") from None


def model_path(cfg: ExecutorConfig, progress: ProgressCallback) -> str:
    """The folder or file to load; the default model ("") is converted from its GGUF file on first use."""
    if cfg.model:
        return cfg.model
    from executor_proc.model.default_model import ensure_default_model

    progress("preparing the default model", 0, 1)
    folder = ensure_default_model()
    progress("preparing the default model", 1, 1)
    return folder
