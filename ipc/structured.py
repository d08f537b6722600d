"""The llguidance tokenizer both processes build for structured outputs (torch-free).

The scheduler compiles and checks constraints with it (``scheduler_proc/grammar.py``); the executor
builds its matchers with it (``executor_proc/step/grammar.py``).  Both word a matcher's errors with
:func:`matcher_error`.
"""

from __future__ import annotations

import os


def load_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_ids: list[int]):
    """An llguidance tokenizer from the model's tokenizer.json (None without one): masks ``vocab_size``
    wide (the logits'), EOS ids the model's; a constraint's text is tokenized with special tokens' strings read
    as text (:class:`_TextTokenizer`).

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
            base = llguidance.LLTokenizer(text, **kw)
            break
        except (ValueError, RuntimeError):
            continue
    else:
        base = llguidance.LLTokenizer(text)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TextTokenizer(base, text)), n_vocab=base.vocab_size,
                                  eos_token=base.eos_tokens)


class _TextTokenizer:
    """``base``'s tokens, its special ones marked, for :class:`llguidance.TokenizerWrapper`, with a tokenize that
    reads special tokens' strings as text.  llguidance tokenizes the text a grammar forces (a literal of a
    ``choice``, a JSON key) with the tokenizer.json's own rules, which turn ``<|im_end|>`` in a literal into the
    special token: the mask then allows that token alone, whose consumption the grammar refuses (an error) or which
    is EOS (the output ends short of its constraint).  Here the literal comes out of ordinary tokens, as a model
    would write it; a special token is only ever allowed where the grammar names it (or EOS where it may end)."""

    def __init__(self, base, tokenizer_json: str):
        import tokenizers

        self.eos_token_id = base.eos_token
        self.bos_token_id = None
        self.tokens = [base.decode_bytes([i]) for i in range(base.vocab_size)]
        self.special_token_ids = [i for i in range(base.vocab_size) if base.is_special_token(i)]
        self._hf = tokenizers.Tokenizer.from_str(tokenizer_json)
        self._hf.encode_special_tokens = True

    def __call__(self, text: bytes) -> list[int]:
        return self._hf.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids


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
