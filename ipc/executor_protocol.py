"""Scheduler <-> executor messages: step plans and their results, start-up progress, failures.

Trusted peers, still msgspec (never pickle).  Plans are diffs: decode rows carry no token ids, only the slot; the
executor gathers the input token from its last-token table on the device.  Every tensor-parallel rank gets every
plan (``docs/architecture.md``, "Tensor parallelism").
"""

from __future__ import annotations

from typing import Union

import msgspec

from ipc.message import Msg as _Msg
from ipc.message import TokenLogprobs


class SlotSampling(msgspec.Struct, array_like=True, omit_defaults=True):
    """Sampling parameters of one slot, as the executor stores them on the device."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: int = -1  # top alternatives to report for each sampled token; -1: none
    prompt_logprobs: int = -1  # likewise for prompt positions
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    # The request's tokens before num_prompt_tokens are its prompt, the rest outputs (a resumed request's).
    num_prompt_tokens: int = 0
    min_tokens_stop_ids: list[int] = []  # masked while fewer than min_tokens outputs exist
    logit_bias_ids: list[int] = []
    logit_bias_values: list[float] = []
    # A compiled llguidance grammar (scheduler_proc/grammar.py): the executor keeps a matcher for the slot,
    # built from it and the request's outputs in Admit.tokens.
    grammar: str = ""

    @property
    def reads_tokens(self) -> bool:
        """Whether the slot's device state counts the request's tokens: the repetition penalty's prompt mask,
        the output counts of every penalty, min_tokens' count of outputs, a grammar's matcher."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or (self.min_tokens > 0 and bool(self.min_tokens_stop_ids)) or bool(self.grammar))


class Admit(msgspec.Struct, array_like=True):
    """A slot's new request.  ``tokens``: every token it has (prompt, then outputs received before a
    preemption or restart) when its sampling reads them (or it speculates), whatever part of its KV is cached."""

    slot: int
    sampling: SlotSampling
    tokens: list[int] = []


class LoadProgress(_Msg, tag="load_progress"):
    stage: str
    done: int
    total: int


class ExecutorReady(_Msg, tag="executor_ready"):
    """What the executor decided while loading; the scheduler plans within it."""

    num_kv_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    fp8_weights: bool = False  # the layers' weights are FP8 (--quantization fp8, or an FP8 checkpoint)
    num_host_blocks: int = 0  # the host KV tier's pool (0: no tier)
    num_graphs: int = 0  # CUDA graphs captured at start-up
    graph_capture_s: float = 0.0  # seconds they took to capture
    graph_memory_bytes: int = 0  # device memory they took
    # The device memory plan (executor_proc/memory_plan.py): one line for the user, and its parts in bytes
    # (total, budget, weights, activations, graphs, other, kv, planned, kv_tokens, ...).
    memory_plan: str = ""
    memory_plan_bytes: dict[str, float] = {}


class StepPlan(_Msg, tag="step_plan"):
    """One forward step, as a diff against the executor's slot tables.

    Row ``i`` is ``slots[i]`` with ``num_tokens[i]`` query tokens starting at position ``positions[i]``.  Rows
    with ``num_tokens == 1`` and no prompt tokens are decode rows: their input is ``last_token[slot]`` on the
    device.  Prefill-chunk rows take their tokens, in row order, from ``prefill_tokens`` (``is_prefill[i]`` says
    which rows those are).  ``sample[i]`` says whether the row's last position is sampled (false for a prompt
    chunk that does not reach the end of the prompt).  Speculative rows (``num_drafts[i] >= 0``) start at the
    slot's length on the device, ``positions[i]`` being only its upper bound (executor_proc/step/speculate.py).

    Block-table appends are flat triples ``(slot, index, block_id)``.

    Host KV tier (docs/architecture.md), flat pairs: ``onloads`` ``(host_block, device_block)`` are copied to the
    device before this step's rows run (after the previous step, its appends and writes); ``backups``
    ``(device_block, host_block)`` to the host once every earlier step has run, without delaying this one.
    """

    step_id: int
    slots: list[int]
    num_tokens: list[int]
    positions: list[int]
    is_prefill: list[bool]
    sample: list[bool]
    prefill_tokens: list[int] = []
    block_appends: list[int] = []
    admits: list[Admit] = []
    releases: list[int] = []
    onloads: list[int] = []
    backups: list[int] = []
    num_drafts: list[int] = []  # per row (empty: none speculative): -1 plain, else its K drafts (num_tokens K + 1)


class StepResult(_Msg, tag="step_result"):
    """Sampled tokens of a step, one per row with ``sample[i]`` true, in row order.

    Timestamps are ``time.perf_counter()`` of the executor process (seconds): ``t_start``/``t_end`` bracket the
    step's work, ``idle_s`` is how long the executor waited for this step's plan after finishing the previous one.
    """

    step_id: int
    token_ids: list[int]
    t_start: float = 0.0
    t_end: float = 0.0
    idle_s: float = 0.0
    # On CUDA, from timing events on the compute stream: the step's GPU time, and how long the
    # GPU sat idle between the previous step's end and this step's start (0 when it was queued).
    gpu_busy_s: float = 0.0
    gpu_gap_s: float = 0.0
    # The executor's host time on the step: decoding the plan and staging its inputs (prepare), then
    # enqueueing its kernels or graph replays (launch).  The GPU waits for them when nothing is queued.
    prepare_s: float = 0.0
    launch_s: float = 0.0
    # Sampled rows that asked for logprobs: indices into token_ids, and their values.
    logprob_rows: list[int] = []
    logprobs: list[TokenLogprobs] = []
    # Prefill rows that asked for prompt logprobs: (row index, first position) and one entry per
    # prompt position from that first position (the logprob of the token at that position).
    prompt_logprob_rows: list[tuple[int, int]] = []
    prompt_logprobs: list[list[TokenLogprobs]] = []
    # Host KV tier: every backup of the plans up to this step id has completed (read without
    # waiting: the newest such step when the result was sent; -1: none known yet).
    backups_done_step_id: int = -1
    # Seconds the executor's garbage collector ran (any thread) between this plan's arrival and the end of
    # its launch: a collection there holds the GIL and delays the launch (the step log's jitter).
    gc_s: float = 0.0
    # The executor's device memory (CUDA), sampled at most once a second (0: not sampled with this result):
    # the allocator's peak reserved bytes since start-up, and the device's free bytes.
    device_peak_bytes: int = 0
    device_free_bytes: int = 0
    # Structured outputs: the step's constrained rows, and how long its sampling waited for their masks
    # (executor_proc/step/grammar.py: the output thread advancing the previous step's matchers).
    grammar_rows: int = 0
    grammar_wait_s: float = 0.0
    # Constrained rows whose matcher failed (no token continues the output; their token is EOS), with
    # llguidance's error: the scheduler fails those requests.
    grammar_failed_rows: list[int] = []
    grammar_errors: list[str] = []
    spec_tokens: list[int] = []  # speculative rows' K further tokens, flat (the first in token_ids)
    num_accepted: list[int] = []  # per speculative row: its first num_accepted further tokens count
    spec_logprobs: list[TokenLogprobs] = []  # parallel to spec_tokens when a speculative row asked for logprobs


class ExecutorFatal(_Msg, tag="executor_fatal"):
    message: str
    # The executor refuses the configuration (it does not fit the device): ``message`` is one line for
    # the user, with no traceback.
    refused: bool = False


class Shutdown(_Msg, tag="shutdown"):
    pass


SchedulerToExecutor = Union[StepPlan, Shutdown]
ExecutorToScheduler = Union[LoadProgress, ExecutorReady, StepResult, ExecutorFatal]


executor_input_decoder = msgspec.msgpack.Decoder(SchedulerToExecutor)
executor_output_decoder = msgspec.msgpack.Decoder(ExecutorToScheduler)
