"""What a request gives back: its result, its streamed chunks and its client-side timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ipc.protocol import TokenLogprobs


@dataclass
class Timings:
    """Client-side latencies of one request, in seconds since its Generate was sent."""

    ttft: Optional[float]  # first token's arrival; None when no token came
    e2e: float  # arrival of the Finished message
    token_times: list[float] = field(default_factory=list)  # arrival of each completion token
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token-bearing messages
    # Speculative decoding: draft tokens the server verified for this completion, and those it accepted (both
    # up to its finish: accepted drafts are completion tokens, each after a token the target sampled itself).
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.ttft is None or len(self.token_times) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.token_times) - 1)


@dataclass
class GenerateResult:
    """A finished request: its tokens, text, finish reason and timings.

    ``text`` ends before the stop string that finished it (``stop_str``), or
    after it with ``include_stop_str_in_output``; ``token_ids`` include the
    token that completed it.  A finish on a stop token (EOS, or one of
    ``stop_token_ids``) leaves that token's text out, unless
    ``include_stop_str_in_output``; the token is still in ``token_ids`` and
    ``logprobs``.  ``logprobs`` has one entry per token when the
    request asked (``logprobs=k``), ``prompt_logprobs`` one per prompt token
    (the first None) when it asked ``prompt_logprobs=k``.

    A request always has ``choices``: one GenerateResult per completion (n of
    them with ``n=...``, each with its ``index``, text, tokens, finish reason
    and timings); the result's own fields are those of ``choices[0]``.
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    message: str = ""  # the server's note on the finish, if any
    index: int = 0  # which completion this is (n > 1)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    stop_str: Optional[str] = None  # the stop string that ended it (finish_reason "stop")
    choices: list["GenerateResult"] = field(default_factory=list, repr=False)


@dataclass
class StreamChunk:
    """New tokens of a streaming request and the text they completed (may be empty).

    ``index`` names the completion (n > 1); ``finish_reason`` is set on a
    completion's last chunk (with n > 1 such a chunk may carry no tokens).
    ``prompt_logprobs`` rides on the first chunk, when the request asked.
    """

    text_delta: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, when asked
    index: int = 0
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    stop_str: Optional[str] = None  # on the last chunk: the stop string that ended it (finish_reason "stop")
