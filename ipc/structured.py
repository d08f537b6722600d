"""The llguidance tokenizer both processes build for structured outputs (torch-free).

The scheduler compiles and checks constraints with it (``scheduler_proc/grammar.py``); the executor
builds its matchers with it (``executor_proc/step/grammar.py``).  Both word a matcher's errors with
:func:`matcher_error`.
"""

from __future__ import annotations

import os


def load_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_ids: list[int]):
    """An llguidance tokenizer from the model's tokenizer.json (None without one): masks ``vocab_size``
    wide (the logits'), EOS ids the model's.

    A tokenizer that is not the model's (a random-weight model's stand-in) may be smaller than the
    logits and not hold the model's EOS ids: then its own EOS ends a constrained output (one the
    scheduler does not stop at: such an output finishes with ``length``), or its own size when it is
    the larger one."""
    path = tokenizer_file(tokenizer_path)
    if path is None:
        return None
    import llguidance

    with open(path, encoding="utf-8") as f:
        text = f.read()
    eos = list(eos_token_ids) or None
    for kw in (dict(n_vocab=vocab_size, eos_token=eos), dict(n_vocab=vocab_size), dict(eos_token=eos)):
        try:
            return llguidance.LLTokenizer(text, **kw)
        except (ValueError, RuntimeError):
            continue
    return llguidance.LLTokenizer(text)


def tokenizer_file(tokenizer_path: str):
    """The tokenizer.json that ``tokenizer_path`` names (a folder holding it, or the file), or None."""
    path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path or "") else tokenizer_path
    return path if path and os.path.isfile(path) else None


def error_line(message: str) -> str:
    """An llguidance matcher's error without its dump of the parser state."""
    return message.split("\n<state>")[0].strip()


def matcher_error(message: str, num_tokens: int = 0) -> str:
    """:func:`error_line` after ``num_tokens`` tokens of output, in words where llguidance gives only a name."""
    first = error_line(message)
    if first != "NoExtensionBias":
        return first
    if not num_tokens:  # the first mask: the constraint's language is empty
        return "the constraint matches no text: no token can start an output it allows (llguidance: NoExtensionBias)"
    return (f"the constraint allows no continuation of the output's first {num_tokens} tokens: no text it matches "
            "starts with them (llguidance: NoExtensionBias)")
