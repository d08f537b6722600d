"""Structured outputs, the executor's half: a matcher per constrained slot, its mask bound at sampling.

A slot admitted with ``SlotSampling.grammar`` gets an llguidance matcher, built from the grammar and
advanced over the request's outputs so far (``Admit.tokens`` past its prompt): a resume after
preemption or an executor restart rebuilds the same state from the tokens it is given.  A grammar
thread builds it (a copy of the grammar's cached prototype, or a compile) while the admitting
step's forward runs; the step's sampling waits for it like for any mask.

The mask of a step's constrained row depends on the slot's previous token, which the executor
does not have on the host when it launches the step (it runs ahead of its own output).  So the
mask binds late, between the step's forward and its sampling::

    main thread                                   output thread
    prepare(N+1): rows that need a mask           ... waits for step N's copy event
    launch(N+1): enqueue the forward              send StepResult(N)
      bind: wait until the rows' slots have       advance N's constrained slots' matchers,
            consumed step N  <------------------  compute their next masks (host, llguidance)
            upload the masks -> table [slot]
      enqueue the sampling (reads the table)

The GPU runs N+1's forward while the output thread works, and waits only when that work is longer
than the forward.  The upload is on the compute stream, after the forward and before the sampling:
stream order binds it; each pinned staging buffer is reused only after its copy's event.  Rows
without a constraint hold all ones in the table; a step with no constrained row runs no mask at all.
Each step's wait rides in its StepResult (``grammar_wait_s``; ServerStats sums them).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from ipc.protocol import StepPlan
from ipc.structured import error_line, load_tokenizer, tokenizer_file

PROTOTYPES = 256  # compiled matchers kept by grammar text: a new slot of a known grammar copies one
WAIT_TIMEOUT_S = 120.0
# From this many masks in one step on, llguidance's thread pool computes them (2-core VM, JSON schema:
# 8 masks 0.8 ms one by one, 2.3 ms pooled; 64 masks 19 ms one by one, 3.5 ms pooled).
PARALLEL_MASKS = 16
_STAGING_BUFFERS = 4


@dataclass(eq=False)
class SlotGrammar:
    """One constrained slot: its matcher, the mask of its next token, and where it is in the step stream."""

    slot: int
    matcher: object = None  # built by the grammar thread
    mask: Optional[np.ndarray] = None  # int32 [W], valid once ``advanced >= awaited`` of the step that reads it
    awaited: int = -1  # the newest step with a sampled row of this slot
    advanced: int = -2  # the newest step whose token the matcher has consumed; -1: built, none yet; -2: building
    error: Optional[BaseException] = None  # the build failed (the scheduler compiled the grammar: not expected)


@dataclass
class GrammarRows:
    """A step's constrained sampled rows: (row among the sampled, state, step whose token it needs first)."""

    step_id: int
    rows: list[tuple[int, SlotGrammar, int]] = field(default_factory=list)
    wait_s: float = 0.0  # how long bind waited for the masks (reported in the StepResult)
    # (row, llguidance's error) of rows whose matcher failed: a dead end, its mask EOS alone (found by bind)
    failed: list[tuple[int, str]] = field(default_factory=list)


class GrammarSlots:
    """The matchers of the constrained slots, the device bitmask table and the late binding of masks."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], num_slots: int,
                 device: torch.device):
        import llguidance

        self._llg = llguidance
        # Loaded by the first grammar's build (off the main thread): parsing tokenizer.json takes ~0.3 s of CPU,
        # which a server that never sees a constraint does not pay at start-up.
        self._tokenizer_args = (tokenizer_path, vocab_size, eos_token_ids)
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.llg_words = 0  # llguidance's mask width, once the tokenizer is loaded
        self.device = device
        self.words = -(-vocab_size // 32)  # the table's width: the logits'
        self.table = torch.full((num_slots + 1, self.words), -1, dtype=torch.int32, device=device)
        self.states: dict[int, SlotGrammar] = {}
        self._reset: set[int] = set()  # slots whose table row must go back to all ones
        self._prototypes: OrderedDict[str, object] = OrderedDict()
        self._cond = threading.Condition()
        self._executor = llguidance.LLExecutor()
        # Matchers are built off the main thread, while the admitting step's forward runs (a new grammar's
        # compile can take tens of milliseconds); one thread, so the prototypes need no lock.
        self._builder = ThreadPoolExecutor(1, thread_name_prefix="forerun-grammar")
        cuda = device.type == "cuda"
        self._staging = [(torch.empty((num_slots + 1, self.words), dtype=torch.int32, pin_memory=cuda),
                          torch.empty(num_slots + 1, dtype=torch.int64, pin_memory=cuda)) for _ in range(_STAGING_BUFFERS)]
        self._staged_events: list[Optional[torch.cuda.Event]] = [None] * _STAGING_BUFFERS
        self._next = 0

    @property
    def tokenizer(self):
        """The llguidance tokenizer, loaded on first use (the first grammar's build, on the grammar thread)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(*self._tokenizer_args)
                self.llg_words = -(-self._tokenizer.vocab_size // 32)
            return self._tokenizer

    # ------------------------------------------------------------- main thread: prepare

    def stage(self, plan: StepPlan, sampled_slots: list[int]) -> Optional[GrammarRows]:
        """Follow the plan's releases and admissions; the step's constrained rows (None: no mask)."""
        for slot in plan.releases:
            if self.states.pop(slot, None) is not None:
                self._reset.add(slot)
        builds = []
        for a in plan.admits:
            if self.states.pop(a.slot, None) is not None:
                self._reset.add(a.slot)
            if a.sampling.grammar:
                st = self.states[a.slot] = SlotGrammar(a.slot)
                builds.append((st, a.sampling.grammar, a.tokens[a.sampling.num_prompt_tokens:]))
                self._reset.discard(a.slot)
        if builds:
            self._builder.submit(self._build, builds)
        if not self.states:
            return None
        rows = GrammarRows(plan.step_id)
        for j, slot in enumerate(sampled_slots):
            st = self.states.get(slot)
            if st is not None:
                rows.rows.append((j, st, st.awaited))
                st.awaited = plan.step_id
        return rows if rows.rows else None

    def _build(self, builds: list[tuple[SlotGrammar, str, list[int]]]) -> None:
        """The grammar thread, for one plan's admissions: each slot's matcher (a copy of the grammar's
        prototype), advanced over the request's outputs so far, then their first masks."""
        states = [st for st, _, _ in builds]
        try:
            for st, grammar, outputs in builds:
                proto = self._prototypes.get(grammar)
                if proto is None:
                    proto = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
                    self._prototypes[grammar] = proto
                    if len(self._prototypes) > PROTOTYPES:
                        self._prototypes.popitem(last=False)
                else:
                    self._prototypes.move_to_end(grammar)
                st.matcher = proto.deep_copy()
                for t in outputs:  # a resumed request: the tokens it has already produced
                    if st.matcher.is_stopped() or not st.matcher.consume_token(t):
                        break
            self._fill_masks(states)
        except BaseException as e:  # raised by the main thread's bind
            for st in states:
                st.error = e
        with self._cond:
            for st in states:
                st.advanced = -1
            self._cond.notify_all()

    # ------------------------------------------------------------- main thread: launch

    def bind(self, rows: GrammarRows) -> None:
        """Between the forward and the sampling: wait for the rows' masks, upload them into the table."""
        pending = [(st, need) for _, st, need in rows.rows]  # need -1: built
        with self._cond:
            if any(st.advanced < need for st, need in pending):
                t0 = time.perf_counter()
                ok = self._cond.wait_for(lambda: all(st.advanced >= need for st, need in pending), WAIT_TIMEOUT_S)
                rows.wait_s = time.perf_counter() - t0
                if not ok:
                    raise RuntimeError(f"step {rows.step_id}: the grammar masks did not arrive in {WAIT_TIMEOUT_S} s")
        for st, _ in pending:
            if st.error is not None:
                raise RuntimeError(f"slot {st.slot}: its grammar failed to build: {st.error}") from st.error
        # A matcher fails where no token continues its output (a grammar whose language ends there): its mask
        # is EOS alone, and the scheduler fails the request rather than finish it with an output the
        # constraint does not match.
        rows.failed = [(j, error_line(st.matcher.get_error())) for j, st, _ in rows.rows if st.matcher.is_error()]
        states = [st for _, st, _ in rows.rows]
        resets = sorted(self._reset)
        self._reset.clear()
        self._upload([st.slot for st in states] + resets, [st.mask for st in states], len(resets))

    def _upload(self, slots: list[int], masks: list[np.ndarray], num_resets: int) -> None:
        k = len(slots)
        i = self._next
        self._next = (i + 1) % _STAGING_BUFFERS
        if self._staged_events[i] is not None:
            self._staged_events[i].synchronize()  # long complete: it is four steps old
        buf, slot_buf = self._staging[i]
        host = buf.numpy()
        for r, m in enumerate(masks):
            host[r] = m
        if num_resets:
            host[len(masks):k] = -1
        slot_buf.numpy()[:k] = slots
        if self.device.type == "cuda":
            rows_dev = buf[:k].to(self.device, non_blocking=True)
            slots_dev = slot_buf[:k].to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._staged_events[i] = event
        else:
            rows_dev, slots_dev = buf[:k].clone(), slot_buf[:k].clone()
        self.table.index_copy_(0, slots_dev, rows_dev)

    # ------------------------------------------------------------- output thread

    def advance(self, rows: GrammarRows, tokens: list[int]) -> None:
        """Consume the step's tokens of its constrained rows and compute their next masks (after the send)."""
        states = []
        for j, st, _ in rows.rows:
            m = st.matcher
            if not m.is_stopped():
                m.consume_token(tokens[j])  # masked to what it allows; an error leaves it stopped (EOS only)
            states.append(st)
        self._fill_masks(states)
        with self._cond:
            for st in states:
                st.advanced = rows.step_id
            self._cond.notify_all()

    def _fill_masks(self, states: list[SlotGrammar]) -> None:
        """Each state's next-token bitmask (llguidance's own thread pool when there are many)."""
        out = np.zeros((len(states), self.llg_words), dtype=np.int32)
        if len(states) < PARALLEL_MASKS:
            for r, st in enumerate(states):
                st.matcher.unsafe_compute_mask_ptr(out[r].ctypes.data, self.llg_words * 4)
        else:
            self._executor.unsafe_compute_mask_ptr([(st.matcher, r) for r, st in enumerate(states)],
                                                   out.ctypes.data, self.llg_words * 4, len(states))
        for r, st in enumerate(states):
            if self.llg_words == self.words:
                st.mask = out[r]
            else:
                mask = np.zeros(self.words, dtype=np.int32)
                n = min(self.words, self.llg_words)
                mask[:n] = out[r, :n]
                st.mask = mask


def build_grammar_slots(tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], num_slots: int,
                        device: torch.device) -> Optional[GrammarSlots]:
    """The executor's grammar state, or None when the model has no tokenizer (no constraint is admitted then)."""
    if not tokenizer_path or tokenizer_file(tokenizer_path) is None:
        return None
    return GrammarSlots(tokenizer_path, vocab_size, eos_token_ids, num_slots, device)
