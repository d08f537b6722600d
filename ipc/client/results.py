"""What a request gives back: its result, its streamed chunks and its client-side timings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Timings:
    """Client-side latencies of one request, in seconds since its Generate was sent."""

    ttft: Optional[float]  # first token's arrival; None when no token came
    e2e: float  # arrival of the Finished message
    token_times: list[float] = field(default_factory=list)  # arrival of each completion token
    itl: list[float] = field(default_factory=list)  # gaps between consecutive token-bearing messages

    @property
    def tpot(self) -> Optional[float]:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.ttft is None or len(self.token_times) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.token_times) - 1)


@dataclass
class GenerateResult:
    """A finished request: its tokens, text, finish reason and timings."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop", "length", "abort" or "error"
    prompt_tokens: int
    completion_tokens: int
    timings: Timings
    message: str = ""  # the server's note on the finish, if any


@dataclass
class StreamChunk:
    """New tokens of a streaming request and the text they completed (may be empty)."""

    text_delta: str
    token_ids: list[int]
