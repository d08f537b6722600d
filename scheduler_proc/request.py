"""A request as the scheduler sees it: two lengths, one slot, a list of blocks.

Lengths (``P`` = prompt tokens)::

    received   = len(output)          tokens that came back and were applied
    pending    = sampled tokens still in flight (will come back): the steps in flight say how many
    total      = P + received + pending
    num_computed = tokens whose KV is written or being written

At admission ``num_prefill = P + received`` (a recompute after preemption
prefills the received tokens too); while prefilling, ``num_computed < num_prefill``.  Once the last prompt chunk is planned,
``num_computed == total - 1``: the newest token (on the device, in the
last-token table) is the next decode row's input.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from ipc.protocol import SamplingParams

if TYPE_CHECKING:
    from scheduler_proc.extras import RequestExtras


class Status(enum.Enum):
    WAITING = "waiting"  # no slot, no blocks
    RUNNING = "running"  # in future plans
    PREEMPTED = "preempted"  # out of plans; waits for its in-flight steps, then WAITING
    FINISHED = "finished"  # out of plans; its slot and blocks return when in-flight steps do


@dataclass(eq=False)
class Request:
    rid: int  # internal id, unique for the server's life
    client: bytes  # ZeroMQ identity of the client that sent it
    request_id: str  # the client's id
    prompt: list[int]
    sampling: SamplingParams
    seed: int
    max_tokens: int
    stop_ids: frozenset[int]
    output: list[int] = field(default_factory=list)
    grammar: str = ""  # the compiled constraint (scheduler_proc/grammar.py); "" for none
    num_computed: int = 0
    num_prefill: int = 0  # tokens fed from the host since admission (prompt + received at admission)
    slot: Optional[int] = None
    blocks: list[int] = field(default_factory=list)
    # Prefix cache: leading blocks of ``blocks`` it has seen (shared, published, or private copies of published
    # ones), and the place in its tree that stands for their tokens (scheduler_proc.prefix_tree).
    num_published: int = 0
    cache_node: tuple = (None, -1)
    block_bytes: bytearray = field(default_factory=bytearray)  # token ids of known tokens, as bytes (memo)
    block_keys: list[bytes] = field(default_factory=list)  # host-tier keys of full known blocks (memo)
    last_step: int = -1  # the newest step with a row of it: none is in flight once that one is back
    status: Status = Status.WAITING
    finish_reason: Optional[str] = None
    num_sent: int = 0  # output tokens already sent to the client
    num_preemptions: int = 0
    t_readmit: float = 0.0  # perf_counter() at its readmission after a preemption, until its next token
    # Length limits, set by Planner.add: the request finishes by length once it has
    # max_output output tokens, i.e. max_total tokens in all (max_tokens or the context).
    max_output: int = 0
    max_total: int = 0
    index: int = 0  # which completion of an n > 1 request
    held_by: Optional[int] = None  # rid of the completion whose first token this one waits for (n > 1)
    extras: Optional["RequestExtras"] = None  # stop strings, logprobs, min_tokens (scheduler_proc.extras)
    # Speculative decoding (scheduler_proc/speculation.py): drafts per row (0: it does not speculate), and the
    # drafts of its rows in flight, not yet accepted or rejected (num_computed counts them all as accepted).
    spec_k: int = 0
    spec_lag: int = 0
    spec_rate: float = 0.0  # running mean of the drafts its rows accept (speculation.RATE_START at admission)
    spec_resume: int = -1  # paused: the step from which it speculates again
    spec_pauses: int = 0  # pauses since its mean last rose past speculation.RESUME_RATE (the next pause's length)
    spec_drafted: int = 0  # drafts verified for it so far, and those accepted (its Finished reports them)
    spec_accepted: int = 0
    # n-gram drafts: its known tokens' n-grams counted so far (speculation.ends_in_repeat), how many tokens, and
    # whether the last n-gram repeats an earlier one
    spec_grams: Optional[dict] = None
    spec_indexed: int = 0
    spec_repeats: bool = False

    @property
    def num_known(self) -> int:
        """Tokens known on the host: the prompt and every received token."""
        return len(self.prompt) + len(self.output)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.num_prefill

    def known_tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        if start >= p:
            return self.output[start - p : end - p]
        return self.prompt[start:] + self.output[: end - p]
