"""Per-request output features the scheduler handles: stop strings, logprob routing, min_tokens.

Only requests that ask for one of them carry a :class:`RequestExtras` (``req.extras``);
the planner's reconcile takes its plain fast path while no live request does.

* Stop strings are matched on the detokenized output, incrementally: each new token's
  text is appended to a window that keeps the last ``max(len(stop)) - 1`` characters, so a
  match across token boundaries is found in the token that completes it, at a cost
  independent of the output's length.
* Logprobs of sampled tokens come back in ``StepResult.logprobs`` (rows that asked) and
  ride on the request's Output, one per new token.
* Prompt logprobs come back per prefill chunk and are gathered by position until every
  prompt position 1..P-1 is there; a recomputed chunk (after preemption or an executor
  restart) reports positions again and those are dropped.  The whole list goes out once.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable, Optional

from ipc.protocol import SlotSampling, StepResult, TokenLogprobs
from scheduler_proc.request import Status
from scheduler_proc.steps import InflightStep, Output

if TYPE_CHECKING:
    from scheduler_proc.planner import Planner

Detokenize = Callable[[list[int]], str]


class StopMatcher:
    """Finds the first stop string that the output's text completes, token by token.

    Incremental detokenization (as vLLM's): the text of ``tokens[prefix:]`` minus that of
    ``tokens[prefix:read]`` is the new text, so a token's leading space or a multi-byte
    character split over tokens decodes as in the whole text; a decode ending in U+FFFD
    (an unfinished character) waits for the next token.
    """

    __slots__ = ("stops", "detokenize", "tokens", "prefix", "read", "window", "keep")

    def __init__(self, stops: list[str], detokenize: Detokenize):
        self.stops = stops
        self.detokenize = detokenize
        self.tokens: list[int] = []
        self.prefix = 0
        self.read = 0
        self.window = ""  # the end of the text so far: long enough to hold all but the last char of a stop
        self.keep = max(len(s) for s in stops) - 1

    def feed(self, token: int) -> Optional[str]:
        """Append one output token; the stop string it completes (earliest end first), or None."""
        tokens = self.tokens
        tokens.append(token)
        before = self.detokenize(tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        text = self.detokenize(tokens[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return None
        self.prefix, self.read = self.read, len(tokens)
        old = len(self.window)
        window = self.window + text[len(before):]
        best, best_end = None, None
        for stop in self.stops:
            i = window.find(stop, max(0, old - len(stop) + 1))
            if i >= 0 and (best_end is None or i + len(stop) < best_end):
                best, best_end = stop, i + len(stop)
        self.window = window[-self.keep:] if self.keep else ""
        if self.prefix > 64:  # older tokens no longer change the new text's decoding
            del tokens[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
        return best


class PromptLogprobs:
    """Prompt logprobs gathered by position; complete once positions 1..P-1 are all in."""

    __slots__ = ("entries", "missing", "sent")

    def __init__(self, num_prompt_tokens: int):
        self.entries: list[Optional[TokenLogprobs]] = [None] * num_prompt_tokens
        self.missing = num_prompt_tokens - 1
        self.sent = False

    def add(self, first: int, values: list[TokenLogprobs]) -> None:
        """Entries for positions first, first+1, ...; positions past the prompt or already in are dropped."""
        entries = self.entries
        for pos in range(max(first, 1), min(first + len(values), len(entries))):
            if entries[pos] is None:
                entries[pos] = values[pos - first]
                self.missing -= 1

    @property
    def complete(self) -> bool:
        return self.missing <= 0


class RequestExtras:
    """What one request asked beyond the plain stream: see the module docstring."""

    __slots__ = ("stop", "min_tokens", "logprobs", "prompt", "stop_str")

    def __init__(self, stop: Optional[StopMatcher], min_tokens: int, logprobs: bool,
                 prompt: Optional[PromptLogprobs]):
        self.stop = stop
        self.min_tokens = min_tokens
        self.logprobs = logprobs
        self.prompt = prompt
        self.stop_str: Optional[str] = None

    def take_prompt_logprobs(self) -> Optional[list[Optional[TokenLogprobs]]]:
        """The prompt logprobs, once complete, the first time they are asked for."""
        prompt = self.prompt
        if prompt is None or prompt.sent or not prompt.complete:
            return None
        prompt.sent = True
        return prompt.entries


def request_extras(sampling, num_prompt_tokens: int, detokenize: Optional[Detokenize]) -> Optional[RequestExtras]:
    """The extras a request needs, or None when it asked for nothing the scheduler must track."""
    stop = sampling.stop
    if not (stop or sampling.min_tokens or sampling.logprobs is not None or sampling.prompt_logprobs is not None):
        return None
    if stop and detokenize is None:
        raise ValueError("stop strings need a tokenizer; this server has none")
    return RequestExtras(
        StopMatcher(list(stop), detokenize) if stop else None, sampling.min_tokens, sampling.logprobs is not None,
        PromptLogprobs(num_prompt_tokens) if sampling.prompt_logprobs is not None else None)


def reconcile_extras(planner: "Planner", step: InflightStep, result: StepResult) -> list[Output]:
    """Reconcile's path while some live request has extras: the fast path's rules plus stop strings,
    min_tokens, and logprobs routed to the token (or prompt position) they belong to."""
    finished = Status.FINISHED
    for (row, first), values in zip(result.prompt_logprob_rows, result.prompt_logprobs):
        req = step.requests[row]
        if req.status is not finished and req.extras is not None and req.extras.prompt is not None:
            req.extras.prompt.add(first, values)
    by_row = dict(zip(result.logprob_rows, result.logprobs))
    stop_tokens = planner._stop_tokens
    outputs: list[Output] = []
    for row, (req, token) in enumerate(zip(step.samplers, result.token_ids)):
        if req.status is finished:
            continue  # the ledger: a request that has left gets nothing more
        req.output.append(token)
        out = Output(req, [token])
        extras = req.extras
        if extras is not None:
            if extras.logprobs:
                if row not in by_row:
                    raise RuntimeError(f"step {step.step_id}: sampled row {row} asked for logprobs, none came back")
                out.logprobs = [by_row[row]]
            out.prompt_logprobs = extras.take_prompt_logprobs()
            if extras.stop is not None:
                matched = extras.stop.feed(token)
                if matched is not None and len(req.output) >= extras.min_tokens:
                    out.finish_reason = "stop"
                    out.stop_str = extras.stop_str = matched
        if out.finish_reason is None and (token in stop_tokens or len(req.output) >= req.max_output):
            out.finish_reason = planner._finish_reason(req, token)
        if out.finish_reason is not None:
            planner._finish(req, out.finish_reason)
        outputs.append(out)
    return outputs


def slot_sampling(req, eos_token_ids) -> SlotSampling:
    """Everything the executor keeps per slot for ``req`` (see SlotSampling)."""
    s = req.sampling
    stop_ids = sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))) if s.min_tokens else []
    bias = sorted(s.logit_bias.items())
    return SlotSampling(
        s.temperature, s.top_k if s.top_k > 0 else 0, s.top_p, s.min_p, req.seed,
        logprobs=-1 if s.logprobs is None else s.logprobs,
        prompt_logprobs=-1 if s.prompt_logprobs is None else s.prompt_logprobs,
        repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty, min_tokens=s.min_tokens, num_prompt_tokens=len(req.prompt),
        min_tokens_stop_ids=stop_ids, logit_bias_ids=[t for t, _ in bias], logit_bias_values=[v for _, v in bias])


def load_detokenizer(tokenizer_path: str) -> Optional[Detokenize]:
    """``ids -> text`` from the model's tokenizer.json (the ``tokenizers`` library, no torch); None if absent."""
    path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
    if not tokenizer_path or not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(path)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
