"""Incremental detokenization: turn a stream of token ids into text deltas.

The vLLM/TGI scheme with two offsets into the token list:

    ids:  [ ...context... | ...already emitted... | ...not yet emitted... ]
           ^prefix         ^read

``decode(ids[prefix:read])`` is text that was already emitted (kept as context
so that tokenizers which strip or merge leading spaces decode the next tokens
as they would inside the full sequence); ``decode(ids[prefix:])`` minus that
text is the new delta.  A delta that ends in U+FFFD is an incomplete UTF-8
sequence (a multi-byte character split across byte tokens) and is held back
until the following tokens complete it; :meth:`flush` emits whatever is left
at the end of the request.

Only ``tokenizer.decode(ids, skip_special_tokens=...)`` is used, so any
HuggingFace tokenizer (or an object with the same ``decode``) works.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first generated tokens (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas for one request's generated tokens."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Only the window from ``prefix`` on is kept: older ids never matter again.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._prefix = 0
        self._read = len(self._ids)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the text that is now complete."""
        parts = []
        for token_id in token_ids:
            self._ids.append(token_id)
            parts.append(self._advance(final=False))
        return "".join(parts)

    def flush(self) -> str:
        """Return the text still held back (an incomplete character included)."""
        return self._advance(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _advance(self, *, final: bool) -> str:
        if self._read >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full_text = self._decode(self._ids[self._prefix:])
        if len(full_text) <= len(prefix_text):
            # Nothing visible yet (a skipped special token, or a partial character).
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        delta = full_text[len(prefix_text):]
        del self._ids[:self._read]
        self._prefix, self._read = 0, len(self._ids)
        return delta
