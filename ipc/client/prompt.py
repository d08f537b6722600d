"""Prompts to token ids: the tokenizer the client loads and how text and chat become tokens."""

from __future__ import annotations

from typing import Any, Optional


def load_tokenizer(path: str) -> Any:
    """The HuggingFace tokenizer in a local folder (or a hub name)."""
    # Imported here: transformers takes seconds to import and token-id clients never need it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer: Any, prompt: Optional[str] = None, *,
                  messages: Optional[list[dict[str, Any]]] = None) -> list[int]:
    """Token ids of a text prompt, or of chat messages through the chat template.

    Plain text gets the tokenizer's default special tokens (as ``tokenizer(prompt)``
    before HF ``generate``); a rendered chat template already holds them, so it is
    tokenized without adding more (as ``apply_chat_template(tokenize=True)`` does).
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if messages is not None:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(prompt))
