"""Per-request output features the scheduler handles: stop strings, logprob routing, min_tokens.

Only requests that ask for one of them carry a :class:`RequestExtras` (``req.extras``,
``scheduler_proc/extras.py``); the planner's reconcile takes its plain fast path while no live
request does, and its other path (``Reconciler._reconcile_extras``) applies the rules below.

* Stop strings are matched on the detokenized output, incrementally: each new token's
  text is appended to a window that keeps the last ``max(len(stop)) - 1`` characters, so a
  match across token boundaries is found in the token that completes it, at a cost
  independent of the output's length.
* Logprobs of sampled tokens come back in ``StepResult.logprobs`` (rows that asked) and
  ride on the request's Output, one per new token.
* Prompt logprobs come back per prefill chunk and are gathered by position until every
  prompt position 1..P-1 is there; a recomputed chunk (after preemption or an executor
  restart) reports positions again and those are dropped.  The whole list goes out once.
"""

from __future__ import annotations

import os
from typing import Optional

from ipc.protocol import SlotSampling
from scheduler_proc.extras import Detokenize, PromptLogprobs, RequestExtras, StopMatcher

__all__ = ["Detokenize", "PromptLogprobs", "RequestExtras", "StopMatcher", "load_detokenizer", "request_extras",
           "slot_sampling"]

def request_extras(sampling, num_prompt_tokens: int, detokenize: Optional[Detokenize],
                   resumed: list[int] = ()) -> Optional[RequestExtras]:
    """The extras a request needs, or None when it asked for nothing the scheduler must track.  ``resumed``: the
    outputs a resumed request already has; the stop-string matcher reads them (a match there is not a finish: the
    client has those tokens, so a stop string completed in them would have ended the request already)."""
    stop = sampling.stop
    if not (stop or sampling.min_tokens or sampling.logprobs is not None or sampling.prompt_logprobs is not None):
        return None
    if stop and detokenize is None:
        raise ValueError("stop strings need a tokenizer; this server has none")
    matcher = StopMatcher(list(stop), detokenize) if stop else None
    for token in resumed if matcher is not None else ():
        matcher.feed(token)
    return RequestExtras(matcher, sampling.min_tokens, sampling.logprobs is not None,
                         PromptLogprobs(num_prompt_tokens) if sampling.prompt_logprobs is not None else None)


def slot_sampling(req, eos_token_ids, vocab_size: int) -> SlotSampling:
    """Everything the executor keeps per slot for ``req`` (see SlotSampling); a top_k of the whole vocabulary or
    more is no top-k (0), as vLLM reads it."""
    s = req.sampling
    stop_ids = sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_token_ids))) if s.min_tokens else []
    bias = sorted(s.logit_bias.items())
    return SlotSampling(
        s.temperature, s.top_k if 0 < s.top_k < vocab_size else 0, s.top_p, s.min_p, req.seed,
        logprobs=-1 if s.logprobs is None else s.logprobs,
        prompt_logprobs=-1 if s.prompt_logprobs is None else s.prompt_logprobs,
        repetition_penalty=s.repetition_penalty, frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty, min_tokens=s.min_tokens, num_prompt_tokens=len(req.prompt),
        min_tokens_stop_ids=stop_ids, logit_bias_ids=[t for t, _ in bias], logit_bias_values=[v for _, v in bias],
        grammar=req.grammar)


def tokenizer_vocab_size(tokenizer_path: str) -> Optional[int]:
    """The tokens a tokenizer.json knows, added ones included (None: no tokenizer.json, or one that does not load)."""
    path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
    if not tokenizer_path or not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path).get_vocab_size(with_added_tokens=True)
    except Exception:  # load_detokenizer says why, at start-up
        return None


def load_detokenizer(tokenizer_path: str) -> Optional[Detokenize]:
    """``ids -> text`` from the model's tokenizer.json (the ``tokenizers`` library, no torch); None if absent;
    ValueError, one line, for a file the library cannot read (a text file, a malformed or foreign JSON)."""
    path = os.path.join(tokenizer_path, "tokenizer.json") if os.path.isdir(tokenizer_path) else tokenizer_path
    if not tokenizer_path or not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the library raises a bare Exception ("expected value at line 1 column 1")
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not a tokenizer.json the tokenizers library reads ({why})") from None
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
