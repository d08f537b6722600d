"""Configuration that crosses the process boundary: declared once, typed, validated once.

The scheduler builds an :class:`ExecutorConfig` (from the CLI, whose defaults are
read from here) and hands it to the executor process as msgspec JSON.  Every
default of an executor setting lives in this file and nowhere else.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

import msgspec

LoadFormat = Literal["auto", "hf", "gguf", "dummy", "scripted"]
Kernels = Literal["auto", "triton", "torch"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["none", "fp8"]
KVCacheDtype = Literal["auto", "fp8"]
# How tensor-parallel ranks sum their partial results (executor_proc/parallel/one_shot.py): NCCL's ring, a
# one-shot kernel over peer-to-peer buffers (small tensors, CUDA, 2, 4 or 8 ranks), or auto (one-shot up to a
# measured size, NCCL above).
AllReduce = Literal["nccl", "one-shot", "auto"]
# Tensor-parallel sizes the one-shot all-reduce runs at (the groups of one host; others go to NCCL), and the largest
# tensor it takes (half its buffer on every rank; larger ones go to NCCL).
ONE_SHOT_RANKS = (2, 4, 8)
ONE_SHOT_MAX_BYTES = 2 * 1024**2
# Steps with prefill chunks through the bucketed mixed-step runner: auto = where decode graphs are
# captured (CUDA, Triton kernels, graphs on); on = also where it runs uncaptured (tests); off = eager.
MixedGraphs = Literal["auto", "on", "off"]

# The paged attention kernels index a block with shifts and masks: a power of two up to this.
MAX_BLOCK_SIZE = 256
# The host KV tier's default pool on cuda, and the largest one accepted (pinned memory is not swappable).
DEFAULT_HOST_KV_GIB = 4.0
MAX_HOST_KV_GIB = 4096.0
# Executor processes of one tensor-parallel group (one GPU each); 64 is far past any host's GPUs.
MAX_TENSOR_PARALLEL = 64


class _Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


class ScriptedOptions(_Config):
    """The scripted executor (``load_format="scripted"``): no model, tokens from a seeded script."""

    vocab_size: int = 1000
    step_latency_s: float = 0.0  # how long each simulated step takes
    eos_at: dict[int, int] = {}  # seed -> absolute position whose token is EOS
    tokens_at: dict[int, dict[int, int]] = {}  # seed -> {position: token} (e.g. stop tokens)
    backup_lag_steps: int = 0  # a host KV backup completes this many steps after the step that carried it


# Speculative decoding: drafts per speculative row, and the n-gram (prompt lookup) match lengths.
MAX_SPECULATIVE_TOKENS = 8
MAX_NGRAM = 16
# ngram: drafts by prompt lookup; draft: a smaller model's greedy tokens (executor_proc/step/draft.py).
SpeculativeMethod = Literal["ngram", "draft"]


class SpeculativeConfig(_Config):
    """Speculative decoding (``method`` None: off); see executor_proc/step/speculate.py."""

    method: Optional[SpeculativeMethod] = None
    num_tokens: int = 4  # drafts proposed (and verified) per speculative row per step
    ngram_min: int = 1  # shortest suffix matched against the slot's earlier tokens
    ngram_max: int = 4  # longest (tried first)
    draft_model: str = ""  # method "draft": the draft model (HF folder, .gguf file, config.json for dummy weights)
    draft_load_format: Optional[LoadFormat] = None  # how to read it; None: the model's load_format

    def banner(self) -> str:
        """What the start-up line says of it: '' when off."""
        if self.method is None:
            return ""
        source = f"n-grams of {self.ngram_min}-{self.ngram_max} tokens" if self.method == "ngram" else "a draft model"
        tokens = "token" if self.num_tokens == 1 else "tokens"
        return f", speculation: {self.num_tokens} {tokens} a step from {source}"

    def values_per_slot(self) -> int:
        """Values a slot's row of one step may give, each a one-token row of a forward or an output: its first
        token, ``K`` drafted positions and the bonus (K + 2); 1 without speculation.  The decode attention's
        workspace, the mixed-step body's hidden rows and the output ring are sized by it."""
        return self.num_tokens + 2 if self.method is not None else 1


class ExecutorConfig(_Config):
    """Everything the executor needs to build itself; the scheduler fills in the addresses."""

    model: str = ""  # HF folder, .gguf file, config.json for dummy weights; "" = the default model
    # The tokenizer's folder or tokenizer.json (structured outputs' matchers need it; the scheduler fills it in).
    tokenizer: str = ""
    load_format: LoadFormat = "auto"
    device: str = "cpu"
    dtype: Dtype = "auto"  # auto: float32 on cpu, bfloat16 on cuda
    kernels: Kernels = "auto"  # auto: Triton on cuda, torch on cpu
    cuda_graphs: bool = True  # capture pure-decode steps (with Triton kernels on cuda)
    # One kernel, tile and split per op whatever the batch: a row's logits do not depend on its step's
    # other rows (Triton kernels only; costs speed: docs/performance.md).
    batch_invariant: bool = False
    # fp8: every layer's linear weights in float8 e4m3 with per-output-channel scales, quantized at load
    # (executor_proc/model/quantization.py); the embedding and the LM head stay in dtype.
    quantization: Quantization = "none"
    # fp8: the paged KV cache in float8 e4m3 with per-layer K and V scales measured at start-up
    # (executor_proc/model/kv_scales.py); half the bytes per token. auto: the model dtype.
    kv_cache_dtype: KVCacheDtype = "auto"
    cuda_graph_max_batch: Optional[int] = None  # largest graph bucket; None: num_slots
    mixed_graphs: MixedGraphs = "auto"  # graphs of steps with prefill chunks (see MixedGraphs above)
    cuda_graph_max_tokens: Optional[int] = None  # largest mixed-step token bucket; None: max_num_batched_tokens
    num_slots: int = 64  # most requests running at once
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: Optional[int] = None  # None: sized from free memory
    # Fraction of the device's total memory the whole server may use (cuda): the KV cache gets what the
    # weights, the largest step's activations and the CUDA graphs leave of it (executor_proc/memory_plan.py).
    gpu_memory_utilization: float = 0.90
    max_model_len: Optional[int] = None  # None: the model's context length
    # Token budget of one step. 1024, not 2048: a step holding two or three arriving prompts stalls every
    # running request for its duration (ITL p99 at 40 req/s, 1B shape, H100: 5.4-6.05 ms at 2048, 4.57 at 1024).
    max_num_batched_tokens: int = 1024
    # torch CPU threads; None: all cores but one, and on cuda one once loaded (serving does no CPU math there,
    # and OpenMP workers that spin after any stray parallel op would take the cores the host relay needs).
    threads: Optional[int] = None
    # Host KV tier (a pinned host copy of published KV blocks): GiB of host memory for it; None:
    # DEFAULT_HOST_KV_GIB on cuda (at most a quarter of available host memory), off on the cpu; 0: off.
    host_kv_gib: Optional[float] = None
    num_host_kv_blocks: Optional[int] = None  # exact host pool size (tests, restarts); overrides host_kv_gib
    host_kv_backup_stream: bool = True  # backups on their own CUDA stream (False: on the compute stream)
    # Executor processes sharing the model (Megatron tensor parallelism): rank r on cuda:(i + r) for
    # --device cuda:i, or N ranks on the CPU (gloo); they run the same plans, rank 0 reports.
    tensor_parallel_size: int = 1
    # Mixture-of-experts layers under tensor parallelism: each rank holds whole experts, a contiguous range,
    # instead of a slice of every expert (executor_proc/parallel/sharding.py); attention stays split by heads.
    enable_expert_parallel: bool = False
    # The ranks' all-reduce (see AllReduce above): auto, one shot for the small tensors of decode steps where it
    # can run (executor_proc/parallel/one_shot.py AUTO_MAX_BYTES), NCCL (gloo on the cpu) for the rest.
    all_reduce: AllReduce = "auto"
    # Debug: tally the tokens each MoE layer routes to each expert and print the totals at shutdown
    # (executor_proc/model/expert_counts.py); steps run without CUDA graphs.
    moe_expert_counts: bool = False
    scripted: ScriptedOptions = ScriptedOptions()
    speculative: SpeculativeConfig = SpeculativeConfig()
    # Filled in by the scheduler when it starts the executor.
    plan_addr: str = ""  # the executor PULLs plans here (the scheduler binds)
    result_addr: str = ""  # the executor PUSHes results here (the scheduler binds)
    parent_pid: int = 0  # the executor exits when this process goes away
    tp_rank: int = 0  # this process's rank in the tensor-parallel group
    replica: Optional[int] = None  # its data-parallel replica's index (what its reports name), None when alone
    host_replicas: int = 1  # replicas whose weights share this host's memory (data parallelism on the cpu)
    tp_init_method: str = ""  # the group's torch.distributed rendezvous (file:// in the run directory)

    def __post_init__(self) -> None:
        check_executor_config(self)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device.startswith("cuda") else "float32"


def check_executor_config(cfg: ExecutorConfig) -> None:
    """Raise ValueError naming the field and its limit for anything the executor cannot run."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", cfg.device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {cfg.device!r}")
    bs = cfg.block_size
    if bs < 1 or bs > MAX_BLOCK_SIZE or bs & (bs - 1):
        raise ValueError(f"block_size must be a power of two between 1 and {MAX_BLOCK_SIZE}, got {bs}")
    _at_least("num_slots", cfg.num_slots, 1)
    tp = cfg.tensor_parallel_size
    if not 1 <= tp <= MAX_TENSOR_PARALLEL:
        raise ValueError(f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL}], got {tp}")
    if not 0 <= cfg.tp_rank < tp:
        raise ValueError(f"tp_rank must be in [0, {tp - 1}], got {cfg.tp_rank}")
    if tp > 1 and cfg.load_format == "scripted":
        raise ValueError("tensor_parallel_size must be 1 with load_format 'scripted' (it has no model to shard)")
    if cfg.enable_expert_parallel and tp == 1:
        raise ValueError("--enable-expert-parallel needs --tensor-parallel-size 2 or more: it spreads the experts "
                         "over the tensor-parallel ranks")
    _check_all_reduce(cfg)
    _at_least("max_num_batched_tokens", cfg.max_num_batched_tokens, 1)
    for name in ("num_kv_blocks", "threads", "cuda_graph_max_batch", "cuda_graph_max_tokens"):
        value = getattr(cfg, name)
        if value is not None:
            _at_least(name, value, 1)
    if cfg.max_model_len is not None:  # one prompt token and one output token
        _at_least("max_model_len", cfg.max_model_len, 2)
    if cfg.num_host_kv_blocks is not None:
        _at_least("num_host_kv_blocks", cfg.num_host_kv_blocks, 0)
    if cfg.host_kv_gib is not None and not 0 <= cfg.host_kv_gib <= MAX_HOST_KV_GIB:
        raise ValueError(f"host_kv_gib must be in [0, {MAX_HOST_KV_GIB}], got {cfg.host_kv_gib}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    if cfg.batch_invariant and cfg.load_format != "scripted" and not (
            cfg.kernels == "triton" or (cfg.kernels == "auto" and cfg.device.startswith("cuda"))):
        raise ValueError("batch_invariant needs the Triton kernels: kernels='triton' (the default on cuda), "
                         f"got kernels={cfg.kernels!r} on device {cfg.device!r}")
    _check_speculative(cfg.speculative)
    if cfg.speculative.method == "draft" and tp > 1:
        raise ValueError(f"--speculative-method draft runs with --tensor-parallel-size 1, got {tp}")
    if cfg.moe_expert_counts and cfg.load_format == "scripted":
        raise ValueError("--moe-expert-counts needs a model: not with --load-format scripted")
    if cfg.speculative.method == "draft" and cfg.load_format == "scripted":
        raise ValueError("--speculative-method draft needs a model: not with --load-format scripted")
    for flag, on in (("--quantization fp8", cfg.quantization == "fp8"),
                     ("--kv-cache-dtype fp8", cfg.kv_cache_dtype == "fp8")):
        if on and cfg.load_format == "scripted":
            raise ValueError(f"{flag} needs a model: not with --load-format scripted")
    if cfg.quantization == "fp8" and cfg.batch_invariant:
        raise ValueError("quantization 'fp8' cannot run batch_invariant: its linears change kernel (and "
                         "activation rounding) between 8 and 9 rows")
    if cfg.scripted.vocab_size < 3:
        raise ValueError(f"scripted.vocab_size must be at least 3, got {cfg.scripted.vocab_size}")
    _at_least("scripted.backup_lag_steps", cfg.scripted.backup_lag_steps, 0)
    if cfg.scripted.step_latency_s < 0:
        raise ValueError(f"scripted.step_latency_s must be >= 0, got {cfg.scripted.step_latency_s}")


def _check_all_reduce(cfg: ExecutorConfig) -> None:
    """``one-shot`` needs GPUs (its buffers are device memory every rank maps) and 2, 4 or 8 ranks; ``auto`` falls
    back to NCCL (gloo on the cpu) where one-shot cannot run."""
    if cfg.all_reduce != "one-shot":
        return
    if not cfg.device.startswith("cuda"):
        raise ValueError(f"--all-reduce one-shot needs CUDA devices (peer-to-peer GPU buffers), got --device "
                         f"{cfg.device}: on the cpu the ranks all-reduce over gloo (--all-reduce nccl or auto)")
    tp = cfg.tensor_parallel_size
    if tp > 1 and tp not in ONE_SHOT_RANKS:
        sizes = f"{', '.join(map(str, ONE_SHOT_RANKS[:-1]))} or {ONE_SHOT_RANKS[-1]}"
        raise ValueError(f"--all-reduce one-shot runs on {sizes} ranks, got --tensor-parallel-size {tp}: use "
                         "--all-reduce nccl or auto")


def _check_speculative(sc: SpeculativeConfig) -> None:
    if sc.method == "draft" and not sc.draft_model:
        raise ValueError("--speculative-method draft needs --draft-model PATH (a smaller model with the same "
                         "vocabulary)")
    if sc.method != "draft" and (sc.draft_model or sc.draft_load_format is not None):
        flag = "--draft-model" if sc.draft_model else "--draft-load-format"
        raise ValueError(f"{flag} needs --speculative-method draft (got --speculative-method {sc.method or 'off'})")
    if sc.draft_load_format == "scripted":
        raise ValueError("--draft-load-format must be auto, hf, gguf or dummy, got 'scripted'")
    if not 1 <= sc.num_tokens <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {sc.num_tokens}")
    if not 1 <= sc.ngram_min <= MAX_NGRAM:
        raise ValueError(f"ngram_min must be in [1, {MAX_NGRAM}], got {sc.ngram_min}")
    if not sc.ngram_min <= sc.ngram_max <= MAX_NGRAM:
        default = " (its default)" if sc.ngram_max == default_of(SpeculativeConfig, "ngram_max") else ""
        raise ValueError(f"ngram_max must be in [ngram_min={sc.ngram_min}, {MAX_NGRAM}], got {sc.ngram_max}{default}")


def _at_least(name: str, value: int, low: int) -> None:
    if value < low:
        raise ValueError(f"{name} must be at least {low}, got {value}")


def default_of(struct: type, name: str):
    """The declared default of a config field: the CLI's defaults come from here, never written twice."""
    for f in msgspec.structs.fields(struct):
        if f.name == name:
            return f.default
    raise KeyError(name)
