"""Prompts to token ids: the tokenizer the client loads and how text and chat become tokens.

Every local failure (a malformed message, a chat-template or tokenizer
exception, a text too long to be worth tokenizing) becomes an
:class:`~ipc.client.errors.InvalidRequestError` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
import weakref
from typing import Any, Optional

from ipc.client.errors import InvalidRequestError
from ipc.sockets import process_alive

# Roles the chat templates of the supported models know; the templates themselves take any
# string (it is pasted between the template's own markers), so the check is ours.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# A text prompt longer than max_model_len x (the most characters one token stands for) cannot fit in
# the context, so it is refused before tokenizing (10 MB of text takes seconds and gigabytes to
# tokenize).  That many is the tokenizer's longest token (:func:`chars_per_token`): English averages
# about 4 characters per token, but vocabularies hold long runs of one character (SmolLM2's: 80 '#').
# Never less than this floor, so a small vocabulary's cap is not tight to the character:
MIN_CHARS_PER_TOKEN = 32
# ...and this many for a tokenizer whose vocabulary cannot be read (longer than any token of common vocabularies).
UNKNOWN_CHARS_PER_TOKEN = 256
# A normalizer (Unicode NFC, say) may fold a few characters into one before the text is split into tokens (a
# Hangul syllable from its 3 jamo; a letter with its 3 accents): a token may then stand for this many times its
# own length.  Byte-level vocabularies (Llama 3, SmolLM2) have no normalizer.
NORMALIZER_FOLD = 4

# transformers imports its submodules lazily and not thread-safely: two threads loading their
# first tokenizer at once can see a half-imported module (ImportError). One load at a time.
_load_lock = threading.Lock()


# Tokenizers built from servers' files, by the files' digest: the clients of one process that talk to servers of one
# model share one (building it parses a few MB of JSON: about 0.3 s of CPU a client otherwise).  Nothing here changes
# a tokenizer after it is built; encoding and decoding only read it.
_from_files: dict[str, Any] = {}
_FROM_FILES_KEPT = 8
# The temporary folder a tokenizer is built in: forerun-tokenizer-PID-XXXX, the PID so that a process killed while
# it builds one leaves a folder the next one can tell is stale (remove_stale_tokenizer_folders).
_FOLDER_PREFIX = "forerun-tokenizer-"


def load_tokenizer_files(files: dict[str, bytes]) -> Any:
    """A tokenizer built from the files a server sent (written to a temporary folder, removed after loading); the one
    already built in this process from the same files, if any."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(b"%d:%s:%d:" % (len(name), name.encode(), len(files[name])))
        digest.update(files[name])
    key = digest.hexdigest()
    if (cached := _from_files.get(key)) is not None:
        return cached
    remove_stale_tokenizer_folders()
    with tempfile.TemporaryDirectory(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-") as folder:
        for name, data in files.items():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                continue  # a file name, never a path: the server cannot write outside the folder
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        tokenizer = load_tokenizer(folder)
    with _load_lock:
        while len(_from_files) >= _FROM_FILES_KEPT:
            _from_files.pop(next(iter(_from_files)))
        return _from_files.setdefault(key, tokenizer)


def remove_stale_tokenizer_folders() -> None:
    """Remove the tokenizer folders of processes that died before removing their own (a gateway worker killed
    while it loads: SIGTERM at shutdown, SIGKILL, an OOM kill): each folder's name carries its process id, and a
    folder of this user whose process is gone is no one's."""
    base = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(base) if n.startswith(_FOLDER_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_FOLDER_PREFIX):].partition("-")[0]
        path = os.path.join(base, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or process_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def load_tokenizer(path: str) -> Any:
    """The HuggingFace tokenizer in a local folder (or a hub name); safe to call from several threads.  Its
    :func:`chars_per_token` is found here, once, off the caller's event loop (clients load in a thread)."""
    with _load_lock:
        tokenizer = tokenizer_class(path).from_pretrained(path)
    chars_per_token(tokenizer)
    return tokenizer


# chars_per_token's answers, by tokenizer (a tokenizer lives as long as its clients: weak keys).
_chars_per_token: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def chars_per_token(tokenizer: Any) -> int:
    """The most characters of text one token of ``tokenizer`` can stand for: its longest vocabulary entry (added
    and special tokens included; a byte-level or SentencePiece entry is at least as long as the text it stands for),
    times :data:`NORMALIZER_FOLD` when the tokenizer normalizes text first, at least :data:`MIN_CHARS_PER_TOKEN`;
    :data:`UNKNOWN_CHARS_PER_TOKEN` when the vocabulary cannot be read.  So no text longer than ``max_model_len``
    times this fits in the context.  Found once per tokenizer (60 ms for a 49k vocabulary)."""
    try:
        return _chars_per_token[tokenizer]
    except (KeyError, TypeError):  # not seen yet, or an object that takes no weak reference
        pass
    found = _longest_token(tokenizer)
    try:
        _chars_per_token[tokenizer] = found
    except TypeError:
        pass
    return found


def _longest_token(tokenizer: Any) -> int:
    """:func:`chars_per_token`, found (a pass over the vocabulary)."""
    try:
        longest = max(map(len, tokenizer.get_vocab()))
    except Exception:  # no get_vocab, an empty or odd vocabulary: whatever a tokenizer object raises
        return UNKNOWN_CHARS_PER_TOKEN
    # a fast tokenizer says whether it normalizes; any other may (a slow SentencePiece one does, inside the library)
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", "unknown")
    fold = 1 if normalizer is None else NORMALIZER_FOLD
    return max(longest * fold, MIN_CHARS_PER_TOKEN)


def tokenizer_class(path: str) -> Any:
    """The class ``AutoTokenizer`` picks for the folder (``tokenizer_config.json``'s ``tokenizer_class``, its fast
    variant first), imported alone; ``AutoTokenizer`` itself where the folder does not name one or transformers
    does not export it.  ``AutoTokenizer``'s own import brings torch and every model family's configuration in:
    the default model's tokenizer loads in 1.4 s of CPU this way against 5.3 (each API worker, each SDK process
    that tokenizes).  Imported here: token-id clients never need transformers."""
    import transformers

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    if isinstance(name, str) and name.isidentifier():
        for candidate in (name,) if name.endswith("Fast") else (name + "Fast", name):
            try:
                cls = getattr(transformers, candidate)
            except Exception:  # not exported, or its backend (sentencepiece, ...) is missing
                continue
            if isinstance(cls, type) and hasattr(cls, "from_pretrained"):
                return cls
    return transformers.AutoTokenizer


def check_messages(messages: Any) -> None:
    """Refuse chat messages the template would mangle or fail on, naming the field."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequestError("invalid_request", "messages", "messages must be a non-empty list of dicts")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequestError("invalid_request", where, f"a message must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError("invalid_request", f"{where}.role",
                                      f"role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        if not isinstance(m.get("content"), (str, list)):
            raise InvalidRequestError("invalid_request", f"{where}.content",
                                      f"content must be a string or a list of parts, got {type(m.get('content')).__name__}")


def flatten_content(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each list of content parts joined into its text, a part a line, as the HTTP gateway (and
    vLLM) reads them (OpenAI's ``[{"type": "text", "text": ...}]``; a ``refusal`` part in an assistant's message);
    InvalidRequestError naming the first part that is not text.  Chat templates mostly render a string content only."""
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                field = "refusal" if kind == "refusal" and m["role"] == "assistant" else "text"
                if kind != field:
                    raise InvalidRequestError("invalid_request", f"{where}.type", f"a content part must be a dict of "
                                              f"type 'text' (or 'refusal' in an assistant's message); got {kind!r}")
                if not isinstance(part.get(field), str):
                    raise InvalidRequestError("invalid_request", f"{where}.{field}",
                                              f"a {field} part's {field} must be a string")
                texts.append(part[field])
            m = dict(m, content="\n".join(texts))
        out.append(m)
    return out


def text_size_problem(num_chars: int, max_model_len: int, per_token: int) -> Optional[str]:
    """Why ``num_chars`` characters of text cannot fit in the context (``per_token``: :func:`chars_per_token`), or
    None when they may."""
    limit = max_model_len * per_token
    if num_chars <= limit:
        return None
    return (f"the prompt has {num_chars} characters; the model's context is {max_model_len} tokens, and no text over "
            f"{limit} characters ({per_token} per token at most, for this tokenizer) fits in it")


def check_text_size(field: str, text: str, max_model_len: Optional[int], tokenizer: Any) -> None:
    """Refuse text that cannot fit in the context before spending time tokenizing it."""
    if max_model_len is None:
        return
    problem = text_size_problem(len(text), max_model_len, chars_per_token(tokenizer))
    if problem is not None:
        raise InvalidRequestError("invalid_request", field, problem)


def encode_prompt(tokenizer: Any, prompt: Optional[str] = None, *,
                  messages: Optional[list[dict[str, Any]]] = None,
                  max_model_len: Optional[int] = None) -> list[int]:
    """Token ids of a text prompt, or of chat messages through the chat template.

    Plain text gets the tokenizer's default special tokens (as ``tokenizer(prompt)``
    before HF ``generate``); a rendered chat template already holds them, so it is
    tokenized without adding more (as ``apply_chat_template(tokenize=True)`` does).
    ``max_model_len`` (when given) bounds the text's length before it is tokenized.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt or messages")
    if messages is not None:
        check_messages(messages)
        try:
            text = tokenizer.apply_chat_template(flatten_content(messages), tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # jinja2 and transformers raise many types; the caller sees one
            raise InvalidRequestError("invalid_request", "messages",
                                      f"the chat template failed: {type(exc).__name__}: {exc}") from None
        field, special = "messages", False
    else:
        if not isinstance(prompt, str):
            raise InvalidRequestError("invalid_request", "prompt", f"prompt must be a str, got {type(prompt).__name__}")
        text, field, special = prompt, "prompt", True
    check_text_size(field, text, max_model_len, tokenizer)
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=special))
    except Exception as exc:  # e.g. a lone surrogate: the tokenizer raises TypeError
        raise InvalidRequestError("invalid_request", field,
                                  f"the text could not be tokenized: {type(exc).__name__}: {exc}") from None
    if max_model_len is not None and len(ids) >= max_model_len:  # the server's limit, named by the caller's field
        raise InvalidRequestError("invalid_request", field, f"the prompt has {len(ids)} tokens; the model's context "
                                  f"length is {max_model_len}, so a prompt may hold at most {max_model_len - 1}")
    return ids
