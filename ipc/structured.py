"""The llguidance tokenizer both processes build for structured outputs (torch-free).

The scheduler compiles and checks constraints with it (``scheduler_proc/grammar.py``); the executor
builds its matchers with it (``executor_proc/step/grammar.py``).
"""

from __future__ import annotations

import os


def load_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_ids: list[int]):
    """An llguidance tokenizer from the model's tokenizer.json (None without one): masks ``vocab_size``
    wide (the logits'), EOS ids the model's."""
    path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path or "") else tokenizer_path
    if not path or not os.path.isfile(path):
        return None
    import llguidance

    with open(path, encoding="utf-8") as f:
        text = f.read()
    eos = list(eos_token_ids) or None
    try:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
    except (ValueError, RuntimeError):  # a tokenizer larger than the logits: its own size
        return llguidance.LLTokenizer(text, eos_token=eos)
