"""Logprobs in OpenAI's (and vLLM's) shapes, from the SDK's TokenLogprobs.

* chat: ``choices[i].logprobs.content``: ``{token, logprob, bytes, top_logprobs:
  [{token, logprob, bytes}]}`` per output token;
* completions (legacy): ``{tokens, token_logprobs, top_logprobs (dicts),
  text_offset}``, the prompt's positions first with ``echo`` (the first
  position has no logprob: None);
* ``prompt_logprobs`` (vLLM's extra): per prompt position None (the first) or
  ``{token_id: {logprob, rank, decoded_token}}`` with the prompt token and its
  top alternatives.

A token's text is ``tokenizer.decode([id])`` with special tokens kept (cached);
``bytes`` are the token's own bytes (:meth:`TokenTexts.bytes_of`), so that a
character split over tokens, whose parts each decode to U+FFFD, joins back from
them as OpenAI means ``bytes`` to.  Logprobs are the model's raw distribution
(before temperature and penalties), as OpenAI and vLLM report them.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import msgspec

from ipc.protocol import TokenLogprobs


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: Optional[list[int]]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: Optional[list[ChatTokenLogprob]] = None


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[Optional[float]]
    tokens: list[str]
    top_logprobs: list[Optional[dict[str, float]]]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: Optional[int] = None  # 1 for the most likely token (None: not known)
    decoded_token: Optional[str] = None


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte in a token's piece."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenTexts:
    """Token id -> its text and its bytes, each found once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = "" if self._tokenizer is None else self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's bytes: its piece's under a byte-level BPE (every character one byte), a SentencePiece byte
        token's (``<0xE3>``) or piece (``▁`` a space); else its text's UTF-8."""
        out = self._bytes.get(token_id)
        if out is None:
            out = self._bytes[token_id] = self._find_bytes(token_id)
        return out

    def _find_bytes(self, token_id: int) -> list[int]:
        text = self(token_id)
        if "\ufffd" not in text or self._tokenizer is None:
            return list(text.encode())
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return list(text.encode())
        byte = _BYTE_PIECE.fullmatch(piece)  # first: "<0xE6>" is also spelt in the byte-level alphabet
        if byte:
            return [int(byte.group(1), 16)]
        if all(c in _BYTE_OF for c in piece):
            return [_BYTE_OF[c] for c in piece]
        return list(piece.replace("▁", " ").encode())


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs],
                  top_n: int) -> ChatLogprobs:
    """``choices[i].logprobs`` of a chat answer (or of one streamed chunk)."""
    content = []
    for tid, lp in zip(token_ids, logprobs):
        token = texts(tid)
        tops = [TopLogprob(texts(t), v, texts.bytes_of(t)) for t, v in zip(lp.top_ids[:top_n], lp.top_logprobs[:top_n])]
        content.append(ChatTokenLogprob(token, lp.logprob, texts.bytes_of(tid), tops))
    return ChatLogprobs(content)


def _top_dict(texts: TokenTexts, token_id: int, lp: TokenLogprobs, top_n: int) -> dict[str, float]:
    """The top alternatives as {text: logprob}, the chosen token included (as OpenAI does)."""
    top = {texts(t): v for t, v in zip(lp.top_ids[:top_n], lp.top_logprobs[:top_n])}
    top.setdefault(texts(token_id), lp.logprob)
    return top


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[Optional[TokenLogprobs]],
                        top_n: int, offset: int = 0) -> CompletionLogprobs:
    """The legacy ``logprobs`` object; ``offset`` is the text offset of the first token."""
    out = CompletionLogprobs([], [], [], [])
    for tid, lp in zip(token_ids, logprobs):
        token = texts(tid)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        out.token_logprobs.append(None if lp is None else lp.logprob)
        out.top_logprobs.append(None if lp is None else _top_dict(texts, tid, lp, top_n))
    return out


def join_completion_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    """``a`` then ``b`` (echoed prompt, then output)."""
    return CompletionLogprobs(a.text_offset + b.text_offset, a.token_logprobs + b.token_logprobs,
                              a.tokens + b.tokens, a.top_logprobs + b.top_logprobs)


def prompt_logprobs(texts: TokenTexts, prompt_ids: Sequence[int],
                    logprobs: Optional[Sequence[Optional[TokenLogprobs]]], top_n: int) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: None for the first position, then {token_id: PromptLogprob} of the prompt token
    and its ``top_n`` alternatives (the server may have sent more: ``echo`` with a larger ``logprobs`` widens
    them)."""
    if logprobs is None:
        return None
    out: list[Optional[dict[int, PromptLogprob]]] = []
    for tid, lp in zip(prompt_ids, logprobs):
        if lp is None:
            out.append(None)
            continue
        entry = {t: PromptLogprob(v, rank + 1, texts(t))
                 for rank, (t, v) in enumerate(zip(lp.top_ids[:top_n], lp.top_logprobs[:top_n]))}
        if tid not in entry:  # the prompt token outside the reported top: its own rank
            entry = {tid: PromptLogprob(lp.logprob, lp.rank or None, texts(tid)), **entry}
        out.append(entry)
    return out
