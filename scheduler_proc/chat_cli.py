"""``forerun chat``: one prompt to a running server, its answer streamed to stdout; also the answer ``serve --ask``
prints."""

from __future__ import annotations

import re
import sys
from typing import Optional

from scheduler_proc.cli_flags import ADDRESS_FILE
from scheduler_proc.flag_checks import check_chat_flags


ASK_MAX_TOKENS = 256  # serve --ask: at most this many new tokens, fewer where the context has less room


def stream_answer(address: str, prompt: str, *, system=None, max_tokens=256, temperature=0.0,
                  seed=None, timeout=120.0, api_key=None, out=sys.stdout) -> None:
    """Stream the answer to ``prompt`` to ``out``, ended by a newline; after a failure the newline ends only a partial
    answer (the error line must not run on after it), and nothing is written when nothing was answered.
    ``max_tokens=None``: :data:`ASK_MAX_TOKENS`, or what the server's context leaves after the prompt."""
    from ipc.client import Client

    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    written = False
    try:
        with Client(address, timeout=timeout, api_key=api_key) as client:
            prompt_args: dict = {"messages": messages}
            if max_tokens is None:  # the prompt tokenized once: to size the answer, then sent as its ids
                ids = client.encode(messages=messages)
                room = client.server_info.max_model_len - len(ids)
                max_tokens = max(1, min(ASK_MAX_TOKENS, room))  # no room at all: the server says why
                prompt_args = {"prompt_token_ids": ids}
            for chunk in client.stream(**prompt_args, max_tokens=max_tokens, temperature=temperature, seed=seed):
                out.write(chunk.text_delta)
                out.flush()
                written = written or bool(chunk.text_delta)
    except BaseException:
        if written:
            out.write("\n")
            out.flush()
        raise
    out.write("\n")
    out.flush()


NO_TOKENIZER = ("the server has no tokenizer (its model has none), and questions are text: start it with "
                "--tokenizer FILE|DIR")
GGUF_NO_TOKENIZER = ("the server has no tokenizer (a GGUF model's own is not read), and questions are text: start "
                     "it with --tokenizer DIR, the model's HF tokenizer folder")

# The request fields `forerun chat` fills from its flags: a server's error names the field, the user typed the flag.
CHAT_FLAG_OF_FIELD = {"sampling.max_tokens": "--max-tokens", "sampling.temperature": "--temperature",
                      "sampling.seed": "--seed"}


def check_utf8(what: str, text: Optional[str]) -> None:
    """Text from the command line is UTF-8: bytes that are not arrive as lone surrogates (Python decodes argv with
    surrogateescape), which no tokenizer takes; ValueError naming ``what`` and the first such byte."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise ValueError(f"{what} is not valid UTF-8 ({byte} at character {e.start})") from None


def chat(args) -> int:
    """``forerun chat``: stream one answer; every expected failure is one line on stderr and exit 1 (130: Ctrl-C)."""
    try:
        check_chat_flags(args)
        check_utf8("the prompt", args.prompt)
        check_utf8("--system", args.system)
    except ValueError as e:
        raise SystemExit(f"forerun: {e}")
    address = args.address
    if address is None:
        try:
            with open(ADDRESS_FILE) as f:
                address = f.read().strip()
        except FileNotFoundError:
            raise SystemExit("forerun: no --address given and no server has been started here")
    from ipc.client import ForerunError

    try:
        stream_answer(address, args.prompt, system=args.system, max_tokens=args.max_tokens,
                      temperature=args.temperature, seed=args.seed, timeout=args.timeout, api_key=args.api_key)
    except (ForerunError, TimeoutError, ConnectionError, ValueError) as e:
        # Expected failures (no server, server gone, invalid request, timeout, bad address): one line.
        print(f"forerun: {_chat_error(e)}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("forerun: interrupted", file=sys.stderr, flush=True)
        return 130
    return 0


def _chat_error(e: Exception) -> str:
    """An error as `forerun chat`'s user reads it: a request field the server names (``sampling.max_tokens``) as the
    flag that set it (``[invalid_request] --max-tokens must be ...``), the SDK's own words otherwise."""
    from ipc.client import ForerunError

    if isinstance(e, ForerunError) and e.code == "no_tokenizer":  # the SDK's advice (token ids) is not the CLI's
        return f"[{e.code}] {NO_TOKENIZER}"
    flag = CHAT_FLAG_OF_FIELD.get(e.field or "") if isinstance(e, ForerunError) else None
    if flag is None:
        return str(e)
    name = e.field.rpartition(".")[2]  # the messages say sampling.max_tokens or max_tokens
    message = re.sub(rf"(?<![\w.-]){name}(?!\w)", flag, e.message.replace(e.field, flag))
    return f"[{e.code}] " + (message if message.startswith(flag) else f"{flag}: {message}")
