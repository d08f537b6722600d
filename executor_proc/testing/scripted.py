"""A scripted step runner: the real plan/result protocol, tokens from a script (a test double).

It keeps the same slot tables the real executor keeps (last token, block
table per slot) and a KV cache of token ids (``kv[block][offset]``: the input
token whose KV a row wrote there).  It checks, for every step, what the real
one would silently get wrong: a decode row whose input token is unknown, a row
whose positions are not covered by its block table, a write into a block that
sits in two slots' tables (prefix caching shares only full blocks, written
once by the step that computed them and only read afterwards), a read of KV
that was never written.  A prefill row that starts past what its slot has
seen (a prefix-cache hit) reads its context from the KV cache: the tokens it
found there are kept in ``reads`` for the caller to check against the prompt.

With ``num_host_blocks`` it models the host KV tier too (``host_kv[block]``: the
tokens a completed backup copied there).  Onloads apply before the step's rows
(the step waits for them); a backup completes ``backup_lag`` steps after the
one that carried it, and each result reports ``backups_done_step_id``.  It
asserts what the real tier must never do: back up a device block not fully
written, onload a host block whose backup has not completed (or is being
overwritten), write or hand out a device block whose backup is pending, and
back up into a host block that the same plan onloads from.

The token sampled for a row depends only on the slot's seed and the position,
like the real executor's seeded sampling, so outputs must not depend on the
pipeline depth (or on preemption and recompute).  ``eos_at[seed] = p`` makes
the token sampled at position ``p`` (prompt length + k for the k-th generated
token) EOS; ``tokens_at[seed] = {p: token}`` places any token (a stop token)
at chosen positions.  :func:`expected_output` is the oracle: what a correct
scheduler streams for a request under this script.

``step_latency_s`` makes each ``execute`` last that long (in-process use).  In
the executor process the latency is spent on a :class:`ScriptedDevice`
instead, as a GPU would: the main thread launches the next step while this one
"runs", and the output thread waits for the step's end (sleeping most of it,
so the core stays free for the scheduler, and spinning the last ``SPIN_S``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from ipc.protocol import SlotSampling, StepPlan, StepResult, TokenLogprobs

# time.sleep() overshoots by ~50-100 us; the last stretch of a step is spun instead.
SPIN_S = 200e-6


def default_token(seed: int, position: int, vocab: int) -> int:
    """A deterministic pseudo-random token that is never 0..3 (kept for EOS/stops)."""
    x = (seed * 0x9E3779B1 + position * 0x85EBCA77) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    x ^= x >> 12
    return 4 + x % (vocab - 4)


def masked(token: int, stop_ids, vocab: int) -> int:
    """What min_tokens makes of a sampled EOS/stop token: the next id (above 3) that is not one."""
    while token in stop_ids:
        token = 4 + (token - 3) % (vocab - 4)
    return token


def fake_logprobs(token: int, position: int, top: int, vocab: int) -> TokenLogprobs:
    """Deterministic logprobs for ``token`` at ``position`` (tests check that each lands where it belongs)."""
    lp = -(token % 7) / 10 - position / 1000
    return TokenLogprobs(lp, [(token + j) % vocab for j in range(top)], [lp - j for j in range(top)])


@dataclass
class ScriptedRunner:
    num_slots: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int = 1000
    eos_token_id: int = 2
    # eos_at[seed] = p: the token at absolute position p of that seed is EOS.
    eos_at: dict[int, int] = field(default_factory=dict)
    # tokens_at[seed] = {p: token}: the token at absolute position p of that seed.
    tokens_at: dict[int, dict[int, int]] = field(default_factory=dict)
    token_fn: Optional[Callable[[int, int], int]] = None
    step_latency_s: float = 0.0
    seqs: dict[int, list[int]] = field(default_factory=dict)  # slot -> tokens by position
    seed: dict[int, int] = field(default_factory=dict)
    sampling: dict[int, SlotSampling] = field(default_factory=dict)
    admitted_tokens: dict[int, list[int]] = field(default_factory=dict)  # slot -> its Admit's tokens
    tables: dict[int, list[int]] = field(default_factory=dict)
    block_slots: dict[int, set[int]] = field(default_factory=dict)  # block -> slots whose tables hold it
    kv: dict[int, list[Optional[int]]] = field(default_factory=dict)  # block -> token written at each offset
    reads: list[tuple[int, int, list[int]]] = field(default_factory=list)  # last step's (slot, start, tokens)
    steps_run: int = 0
    num_host_blocks: int = 0
    backup_lag: int = 0  # a backup completes this many steps after the step that carried it
    host_kv: dict[int, list[int]] = field(default_factory=dict)  # host block -> tokens (completed backups)
    # Backups in flight: device block -> (host block, step id, the tokens being copied).
    backing_up: dict[int, tuple[int, int, list[int]]] = field(default_factory=dict)
    num_backups: int = 0
    num_onloads: int = 0
    # Speculative rows (drafts per row; 0: off): accept(seed, position, k) is how many of the k drafts of a row
    # starting at that position the "model" accepts (default: a hash of both); the rest are wrong guesses.
    num_speculative_tokens: int = 0
    accept: Optional[Callable[[int, int, int], int]] = None

    def execute(self, plan: StepPlan) -> StepResult:
        t0 = time.perf_counter()
        self._apply_diffs(plan)
        tokens: list[int] = []
        cursor = 0
        self.reads = []
        result = StepResult(plan.step_id, tokens)
        if plan.onloads or plan.backups:
            self._host_diffs(plan)
        for row, (slot, n, start, prefill, sample) in enumerate(zip(
            plan.slots, plan.num_tokens, plan.positions, plan.is_prefill, plan.sample
        )):
            seq = self.seqs[slot]
            sp = self.sampling[slot]
            if plan.num_drafts and plan.num_drafts[row] >= 0:
                tokens.append(self._speculative_row(slot, n - 1, start, result))
                continue
            if prefill:
                chunk = plan.prefill_tokens[cursor : cursor + n]
                cursor += n
                if start > len(seq):  # a prefix-cache hit: the context is in shared blocks
                    found = self._read(slot, len(seq), start)
                    self.reads.append((slot, len(seq), found))
                    seq.extend(found)
                del seq[start:]
                seq.extend(chunk)
                known = self.admitted_tokens[slot]
                assert not known or seq == known[:len(seq)], f"slot {slot}: admitted with tokens not its own"
            else:
                assert n == 1, f"slot {slot}: decode row with {n} tokens"
                assert start == len(seq) - 1, f"slot {slot}: decode at {start}, last known token at {len(seq) - 1}"
            assert len(self.tables[slot]) * self.block_size >= start + n, f"slot {slot}: KV beyond its blocks"
            self._write(slot, start, seq[start : start + n])
            if prefill and sp.prompt_logprobs >= 0 and max(start, 1) < min(start + n, sp.num_prompt_tokens):
                first = max(start, 1)
                result.prompt_logprob_rows.append((row, first))
                result.prompt_logprobs.append([fake_logprobs(seq[q], q, sp.prompt_logprobs, self.vocab_size)
                                               for q in range(first, min(start + n, sp.num_prompt_tokens))])
            if sample:
                tok = self.token_at(self.seed[slot], start + n)
                if start + n - sp.num_prompt_tokens < sp.min_tokens:
                    tok = masked(tok, sp.min_tokens_stop_ids, self.vocab_size)
                seq.append(tok)
                tokens.append(tok)
                if sp.logprobs >= 0:
                    result.logprob_rows.append(len(tokens) - 1)
                    result.logprobs.append(fake_logprobs(tok, start + n, sp.logprobs, self.vocab_size))
        assert cursor == len(plan.prefill_tokens), "prefill tokens left over"
        if not any(self.sampling[s].logprobs >= 0 for s, d in zip(plan.slots, plan.num_drafts) if d >= 0):
            result.spec_logprobs = []
        result.backups_done_step_id = self._complete_backups(plan.step_id - self.backup_lag)
        if self.step_latency_s:
            wait_until(t0 + self.step_latency_s)
        self.steps_run += 1
        result.t_start, result.t_end = t0, time.perf_counter()
        return result

    def _speculative_row(self, slot: int, k: int, bound: int, result: StepResult) -> int:
        """A verify row of ``k`` drafts from the slot's length (``bound``: the planner's upper bound of it): the
        accepted drafts are the script's tokens, a rejected one a wrong guess whose KV the next row overwrites.
        Returns the row's first token; its further tokens and accepted count go into ``result``."""
        seq, sp, seed = self.seqs[slot], self.sampling[slot], self.seed[slot]
        assert 0 <= k <= self.num_speculative_tokens and _speculates(sp), f"slot {slot}: a row of {k} drafts"
        last = len(seq) - 1  # the input token's position: the slot's length on the device
        assert last <= bound, f"slot {slot}: speculative row at {last}, above the planner's bound {bound}"
        assert len(self.tables[slot]) * self.block_size >= last + k + 1, f"slot {slot}: KV beyond its blocks"
        accepted = (self.accept or _hash_accept)(seed, last, k)
        assert 0 <= accepted <= k
        true = []
        for p in range(last + 1, last + k + 2):
            tok = self.token_at(seed, p)
            true.append(masked(tok, sp.min_tokens_stop_ids, self.vocab_size)
                        if p - sp.num_prompt_tokens < sp.min_tokens else tok)
        drafts = true[:accepted] + [-1 - j for j in range(k - accepted)]  # -1...: never a real token
        self._write(slot, last, [seq[last]] + drafts)
        seq.extend(true[:accepted + 1])
        result.spec_tokens += true[1:]
        result.num_accepted.append(accepted)
        if sp.logprobs >= 0:  # each token's own, at its position (the first one's in the row's place)
            result.logprob_rows.append(len(result.token_ids))
            result.logprobs.append(fake_logprobs(true[0], last + 1, sp.logprobs, self.vocab_size))
        # parallel to spec_tokens (the executor sends them when any speculative row of the step asked)
        result.spec_logprobs += [fake_logprobs(t, last + 2 + j, max(sp.logprobs, 0), self.vocab_size)
                                 for j, t in enumerate(true[1:])]
        return true[0]

    def token_at(self, seed: int, position: int) -> int:
        """The token this script samples at absolute ``position`` for ``seed``."""
        if self.eos_at.get(seed) == position:
            return self.eos_token_id
        placed = self.tokens_at.get(seed)
        if placed is not None and position in placed:
            return placed[position]
        if self.token_fn is not None:
            return self.token_fn(seed, position)
        return default_token(seed, position, self.vocab_size)

    def _host_diffs(self, plan: StepPlan) -> None:
        """Onloads (the step waits for them), then backups (they start after the previous step)."""
        o, b = plan.onloads, plan.backups
        onload_src, onload_dst = set(o[0::2]), set(o[1::2])
        pending_hosts = {h for h, _, _ in self.backing_up.values()}
        for i in range(0, len(o), 2):
            host, block = o[i], o[i + 1]
            assert 0 <= host < self.num_host_blocks and 0 <= block < self.num_kv_blocks
            assert host in self.host_kv and host not in pending_hosts, f"onload from host block {host}: not backed up"
            assert block not in self.backing_up, f"onload into device block {block} while it is backed up"
            assert len(self.block_slots.get(block, ())) == 1, f"onload into device block {block}: not one new table's"
            self.kv[block] = list(self.host_kv[host])
            self.num_onloads += 1
        for i in range(0, len(b), 2):
            block, host = b[i], b[i + 1]
            assert 0 <= host < self.num_host_blocks and 0 <= block < self.num_kv_blocks
            content = self.kv.get(block)
            assert content is not None and None not in content, f"backup of device block {block}: not fully written"
            assert block not in self.backing_up, f"device block {block} backed up twice at once"
            assert block not in onload_dst, f"backup of device block {block} while this step onloads it"
            assert host not in pending_hosts, f"host block {host} is the target of two backups at once"
            assert host not in onload_src, f"backup into host block {host} while this step onloads from it"
            self.host_kv.pop(host, None)  # being overwritten: not a valid copy until the backup completes
            self.backing_up[block] = (host, plan.step_id, list(content))
            pending_hosts.add(host)

    def _complete_backups(self, done: int) -> int:
        """Complete the backups of steps up to ``done``; returns it (the result's backups_done_step_id)."""
        for block, (host, step_id, content) in list(self.backing_up.items()):
            if step_id <= done:
                assert self.kv[block] == content, f"device block {block} rewritten while backed up"
                self.host_kv[host] = content
                del self.backing_up[block]
                self.num_backups += 1
        return done

    def _write(self, slot: int, start: int, tokens: list[int]) -> None:
        table, bs, kv = self.tables[slot], self.block_size, self.kv
        for p, tok in enumerate(tokens, start):
            block = table[p // bs]
            assert block not in self.backing_up, f"slot {slot} writes device block {block} while it is backed up"
            holders = self.block_slots[block]
            assert len(holders) == 1, f"slot {slot} writes position {p} into block {block}, shared by slots {holders}"
            content = kv.get(block)
            if content is None:
                content = kv[block] = [None] * bs
            content[p % bs] = tok

    def _read(self, slot: int, start: int, end: int) -> list[int]:
        table, bs, unwritten = self.tables[slot], self.block_size, [None] * self.block_size
        out = []
        for p in range(start, end):
            tok = self.kv.get(table[p // bs], unwritten)[p % bs]
            assert tok is not None, f"slot {slot} reads position {p} of block {table[p // bs]}: never written"
            out.append(tok)
        return out

    def _apply_diffs(self, plan: StepPlan) -> None:
        for slot in plan.releases:
            assert slot in self.tables, f"release of free slot {slot}"
            for b in self.tables.pop(slot):
                self.block_slots[b].discard(slot)
            del self.seqs[slot], self.seed[slot], self.sampling[slot], self.admitted_tokens[slot]
        for admit in plan.admits:
            assert 0 <= admit.slot < self.num_slots
            assert admit.slot not in self.tables, f"slot {admit.slot} admitted while still in use"
            self.tables[admit.slot] = []
            self.seqs[admit.slot] = []
            self.seed[admit.slot] = admit.sampling.seed
            self.sampling[admit.slot] = admit.sampling
            # the request's every token when its penalties read them: the prompt and any earlier outputs
            speculates = self.num_speculative_tokens > 0 and _speculates(admit.sampling)
            assert bool(admit.tokens) == (admit.sampling.reads_tokens or speculates), \
                f"slot {admit.slot}: admission tokens"
            assert len(admit.tokens) >= admit.sampling.num_prompt_tokens or not admit.tokens
            self.admitted_tokens[admit.slot] = admit.tokens
        a = plan.block_appends
        for i in range(0, len(a), 3):
            slot, index, block = a[i], a[i + 1], a[i + 2]
            assert 0 <= block < self.num_kv_blocks
            assert index == len(self.tables[slot]), f"slot {slot}: append at {index}, table has {len(self.tables[slot])}"
            holders = self.block_slots.setdefault(block, set())
            assert slot not in holders, f"block {block} twice in the table of slot {slot}"
            holders.add(slot)
            self.tables[slot].append(block)


def _speculates(s: SlotSampling) -> bool:
    """The planner's rule for who speculates (``scheduler_proc.speculation.verifiable``), checked from the plans."""
    return s.prompt_logprobs < 0 and not s.grammar


def _hash_accept(seed: int, position: int, k: int) -> int:
    """The default accepted count: anything from 0 to ``k``, from the seed and position."""
    return default_token(seed, position * 31 + 7, k + 5) - 4


def wait_until(deadline: float) -> None:
    """Sleep until ``SPIN_S`` before ``deadline`` (perf_counter), then spin: precise and mostly idle."""
    ahead = deadline - time.perf_counter() - SPIN_S
    if ahead > 0:
        time.sleep(ahead)
    while time.perf_counter() < deadline:
        pass


def expected_output(
    token_at: Callable[[int, int], int], *, seed: int, prompt_len: int, max_tokens: int, max_model_len: int,
    eos_token_ids: Iterable[int], stop_token_ids: Iterable[int] = (), ignore_eos: bool = False,
    min_tokens: int = 0, vocab: int = 1000, stop_strings: Iterable[str] = (),
    detokenize: Optional[Callable[[list[int]], str]] = None,
) -> tuple[list[int], str]:
    """The tokens and finish reason a correct scheduler streams for one request (no abort).

    The k-th generated token is ``token_at(seed, prompt_len + k)``, whatever the
    batch, the pipeline depth or any preemption: the rules of
    ``Planner._finish_reason`` applied to that sequence.
    """
    stops = frozenset(stop_token_ids)
    eos = frozenset(() if ignore_eos else eos_token_ids)
    out: list[int] = []
    text = ""
    while True:
        tok = token_at(seed, prompt_len + len(out))
        if len(out) < min_tokens:
            tok = masked(tok, stops | eos, vocab)
        out.append(tok)
        before, text = text, detokenize(out) if stop_strings else ""
        # A stop string counts in the token that completes it (none before min_tokens outputs).
        if len(out) >= min_tokens and any(text.count(s) > before.count(s) for s in stop_strings):
            return out, "stop"
        if tok in stops or tok in eos:
            return out, "stop"
        if len(out) >= max_tokens or prompt_len + len(out) >= max_model_len:
            return out, "length"


class StepTiming:
    """When a step ran on the scripted device; the output thread waits on it like on a CUDA event."""

    __slots__ = ("t_start", "t_end", "idle_s")

    def __init__(self, t_start: float, t_end: float, idle_s: float):
        self.t_start, self.t_end, self.idle_s = t_start, t_end, idle_s

    def synchronize(self) -> None:
        wait_until(self.t_end)

    @property
    def timing(self) -> tuple[float, float, float]:
        return self.t_start, self.t_end, self.idle_s


class ScriptedDevice:
    """A device that runs launched steps in order, ``step_latency_s`` each, while the host goes on.

    A step starts when it is launched or when the previous one ends, whichever
    is later; the gap between the two is the device's idle time.  So, as with
    a GPU, the executor's main thread never waits for a step: it receives and
    launches the next plan while this one "runs", and only a plan that comes
    after the device has run dry costs idle time.
    """

    def __init__(self, step_latency_s: float):
        self.step_latency_s = step_latency_s
        self.free_at: Optional[float] = None  # end of the last launched step

    def launch(self) -> StepTiming:
        now = time.perf_counter()
        start = now if self.free_at is None else max(now, self.free_at)
        idle = 0.0 if self.free_at is None else start - self.free_at
        self.free_at = start + self.step_latency_s
        return StepTiming(start, self.free_at, idle)


class ScriptedOutputs:
    """The scripted step's logprob fields, in the shape the output thread reads (``result_fields``)."""

    __slots__ = ("result",)

    def __init__(self, result: StepResult):
        self.result = result

    def result_fields(self) -> dict:
        r = self.result
        spec = {"spec_tokens": r.spec_tokens, "num_accepted": r.num_accepted, "spec_logprobs": r.spec_logprobs} \
            if r.num_accepted else {}
        if not (r.logprob_rows or r.prompt_logprob_rows):
            return {"backups_done_step_id": r.backups_done_step_id, **spec}
        return {**spec, "logprob_rows": r.logprob_rows, "logprobs": r.logprobs,
                "backups_done_step_id": r.backups_done_step_id, "prompt_logprob_rows": r.prompt_logprob_rows,
                "prompt_logprobs": r.prompt_logprobs}


class ScriptedStep:
    __slots__ = ("plan", "outputs")

    def __init__(self, plan: StepPlan):
        self.plan = plan
        self.outputs: Optional[ScriptedOutputs] = None


class ScriptedWorker:
    """Adapts a ScriptedRunner to the executor process's prepare/launch/copy_out steps.

    The executor's checks and tokens are computed at launch (host work); the
    step's latency is spent on a :class:`ScriptedDevice`, whose timing rides
    to the scheduler in the StepResult.
    """

    def __init__(self, runner: ScriptedRunner, step_latency_s: float = 0.0):
        self.runner = runner
        self.device = ScriptedDevice(step_latency_s)
        self._timing: Optional[StepTiming] = None

    def prepare(self, plan: StepPlan) -> "ScriptedStep":
        return ScriptedStep(plan)

    def launch(self, step: "ScriptedStep") -> list[int]:
        result = self.runner.execute(step.plan)
        step.outputs = ScriptedOutputs(result)
        self._timing = self.device.launch()
        return result.token_ids

    def copy_out(self, tokens: list[int], step=None):
        return tokens, self._timing
