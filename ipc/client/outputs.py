"""One completion's output as it arrives: tokens, logprobs, and text cut at a stop string.

The scheduler finishes a request at the token that completes the first
occurrence of one of its stop strings in the output text, and names that
string in ``Finished.stop_str``.  The text returned ends right before that
occurrence (or right after it, with ``include_stop_str_in_output``).  While
streaming, :class:`StopStringText` holds back any tail of the text that could
still become a stop string, and releases it as soon as it cannot, so no
character past the cut ever reaches the user.  Under ``min_tokens`` the
scheduler counts only a stop string that a token past the first
``min_tokens - 1`` completes (as vLLM does); so is it cut here: an occurrence
ending in the text of those first tokens stays in the text.

A request that finishes on a stop token (EOS, or one of ``stop_token_ids``:
reason ``stop`` without a ``stop_str``) does not show that token's text unless
``include_stop_str_in_output``, as in vLLM; the token stays in ``token_ids``,
the usage and the logprobs (vLLM keeps its logprobs entry too).  The scheduler
sends the finishing token in the Finished, so no text of it ever went out.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ipc.client.detokenizer import IncrementalDetokenizer
from ipc.client.results import GenerateResult, StreamChunk, Timings
from ipc.protocol import Finished, TokenLogprobs


class StopStringText:
    """Text deltas of one completion with the stop-string rule applied."""

    def __init__(self, stop: Sequence[str] = (), include_stop_str: bool = False, armed: bool = True) -> None:
        self._stops = [s for s in stop if s]
        self._include = include_stop_str
        self._text = ""  # everything detokenized so far
        self._released = 0  # characters of _text handed out
        self._cut: Optional[int] = None  # where the text ends, once a stop string was seen
        # A stop string counts only if it ends past _from, once armed (min_tokens: see :meth:`arm`).
        self._armed = armed
        self._from = 0

    def arm(self) -> None:
        """From here on stop strings count: one must end in text pushed after this call (the text of the
        ``min_tokens - 1`` first tokens holds none that ends the output)."""
        if not self._armed:
            self._armed = True
            self._from = len(self._text)

    @property
    def text(self) -> str:
        """The text released so far."""
        return self._text[:self._released]

    def push(self, delta: str) -> str:
        """Append detokenized text; return what can be released now."""
        if self._cut is not None or not delta:
            return ""
        self._text += delta
        if not self._stops:
            return self._release(len(self._text))
        found = self._first_stop(self._text) if self._armed else None
        if found is not None:
            pos, stop = found
            self._cut = pos + len(stop) if self._include else pos
            return self._release(self._cut)
        return self._release(len(self._text) - self._held_back())

    def finish(self, stop_str: Optional[str]) -> str:
        """The rest of the text at the end; ``stop_str`` is the string the scheduler matched, if any."""
        if self._cut is None:
            pos = self._text.find(stop_str, max(0, self._from - len(stop_str) + 1)) if stop_str else -1
            if pos < 0:
                self._cut = len(self._text)
            else:
                self._cut = pos + len(stop_str) if self._include else pos
        return self._release(self._cut)

    def _release(self, end: int) -> str:
        if end <= self._released:
            return ""
        out = self._text[self._released:end]
        self._released = end
        return out

    def _first_stop(self, text: str) -> Optional[tuple[int, str]]:
        # Released text holds no stop string and no start of one that reaches past it; one counts if it ends
        # past _from.
        start = max(self._released - max(len(s) for s in self._stops) + 1, 0)
        best: Optional[tuple[int, str]] = None
        for s in self._stops:
            pos = text.find(s, max(start, self._from - len(s) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held_back(self) -> int:
        """Length of the longest unreleased tail that is the start of some stop string."""
        text, free = self._text, len(self._text) - self._released
        hold = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, free), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return hold


class CompletionOutput:
    """One of a request's n completions: tokens, logprobs, text and arrival times."""

    def __init__(self, index: int, detokenizer: Optional[IncrementalDetokenizer], stop: Sequence[str] = (),
                 include_stop_str: bool = False, min_tokens: int = 0) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self._include_stop = include_stop_str
        self._arm_at = max(min_tokens - 1, 0)  # tokens after which a stop string counts
        self.text = StopStringText(stop, include_stop_str, armed=self._arm_at == 0)
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.token_times: list[float] = []
        self.chunk_times: list[float] = []
        self.finished: Optional[Finished] = None
        self.t_finish = 0.0

    def add(self, since_send: float, token_ids: list[int], logprobs: list[TokenLogprobs],
            fin: Optional[Finished] = None) -> Optional[StreamChunk]:
        """Take new tokens (and the Finished, if this is the end); the chunk to hand out, if any."""
        if token_ids:
            self.token_ids.extend(token_ids)
            self.token_times.extend([since_send] * len(token_ids))
            self.chunk_times.append(since_send)
        self.logprobs.extend(logprobs)
        text = ""
        if self.detokenizer is not None:
            before = len(self.token_ids) - len(token_ids)
            shown = token_ids[:-1] if self._hides_last_token(fin) else token_ids
            if before < self._arm_at <= len(self.token_ids):  # min_tokens: the text of the first tokens, then arm
                text = self.text.push(self.detokenizer.add(shown[:self._arm_at - before]))
                self.text.arm()
                shown_left = shown[self._arm_at - before:]
            else:
                shown_left = shown
            text += self.text.push(self.detokenizer.add(shown_left))
            if fin is not None:
                text += self.text.push(self.detokenizer.flush())
        if fin is not None:
            self.finished = fin
            self.t_finish = since_send
            if self.detokenizer is not None:
                text += self.text.finish(fin.stop_str)
        if not token_ids and not text and fin is None:
            return None
        return StreamChunk(text, list(token_ids), logprobs=list(logprobs), index=self.index,
                           finish_reason=fin.reason if fin is not None else None,
                           stop_str=fin.stop_str if fin is not None else None)

    def _hides_last_token(self, fin: Optional[Finished]) -> bool:
        """Whether ``fin`` ends this completion on a stop token whose text is left out (vLLM's rule): a finish
        "stop" that no stop string made is one on EOS or a stop token id, the last token of the Finished."""
        return fin is not None and fin.reason == "stop" and fin.stop_str is None and not self._include_stop

    def end_with(self, since_send: float, like: Finished) -> StreamChunk:
        """End this completion because a sibling ended the whole request (abort or error)."""
        fin = Finished(request_id=like.request_id, reason=like.reason, prompt_tokens=like.prompt_tokens,
                       completion_tokens=len(self.token_ids), message=like.message, index=self.index)
        return self.add(since_send, [], [], fin)

    def result(self, request_id: str) -> GenerateResult:
        """This completion as a GenerateResult (needs its Finished)."""
        fin = self.finished
        times = self.chunk_times
        timings = Timings(
            ttft=times[0] if times else None,
            e2e=self.t_finish,
            token_times=self.token_times,
            itl=[b - a for a, b in zip(times, times[1:])],
            draft_tokens=fin.draft_tokens, accepted_tokens=fin.accepted_tokens,
        )
        return GenerateResult(
            request_id=request_id,
            text=self.text.text,
            token_ids=self.token_ids,
            finish_reason=fin.reason,
            prompt_tokens=fin.prompt_tokens,
            completion_tokens=fin.completion_tokens,
            timings=timings,
            message=fin.message,
            index=self.index,
            logprobs=self.logprobs,
            stop_str=fin.stop_str,
        )
