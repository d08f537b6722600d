"""A request's output-feature state: the stop-string matcher, prompt logprobs gathered by position,
and :class:`RequestExtras`, which a request carries only when it asked for one of them.

Plain data the request (``scheduler_proc/request.py``), the admission (``scheduler_proc/outputs.py``)
and reconcile (``scheduler_proc/planner_reconcile.py``) share; it imports nothing of the planner.
"""

from __future__ import annotations

from typing import Callable, Optional

from ipc.protocol import TokenLogprobs

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
