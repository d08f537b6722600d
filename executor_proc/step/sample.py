"""Sampling a step's rows: the one function both the graph and the eager paths call.

:func:`sample_rows` runs, all on the device, for the sampled rows' logits:

1. penalties (only when some row is penalised: repetition, frequency, presence,
   logit_bias, min_tokens), in place unless the raw logits are still needed;
   then the grammar mask (only when some row has a constraint): tokens the slot's grammar does not
   allow get -inf, from the bitmask table :mod:`executor_proc.step.grammar` fills just before;
2. the token: the backend's argmax when every row is greedy (the rule is
   :func:`kernels.sampling_ref.is_greedy`), else the backend's sampler with the
   rows' parameters gathered from the slot tables (its top-k/top-p window only
   when some row filters);
3. logprobs of the *raw* logits (the model's distribution before temperature and
   penalties; only when some row asks): fixed ``[S, 21]`` ids and logprobs;
4. the penalty tables' counts of the sampled tokens (when penalised), so the
   next step, queued behind this one, sees them;
5. ``last_token[slot] = token``, where the next decode row reads its input.

Which of these run is the step's :class:`SamplingMode`, decided on the host from
the slot tables' mirrors: each mode is its own CUDA graph, and a step whose rows
ask for nothing runs exactly what it ran before these features existed.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from executor_proc.backends.base import Backend
from executor_proc.step.slot_tables import SlotTables
from kernels.grammar_mask_ref import apply_grammar_mask_ref


def apply_grammar_mask(logits: torch.Tensor, table: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """-inf where the slot's bitmask lacks the token (in place): the Triton kernel on CUDA, torch elsewhere."""
    if logits.is_cuda:
        from kernels.grammar_mask import apply_grammar_mask as kernel

        return kernel(logits, table, slots)
    return apply_grammar_mask_ref(logits, table, slots)


class SamplingMode(NamedTuple):
    """What a step's sampling runs (host flags; one CUDA graph per mode and bucket)."""

    greedy: bool  # every row greedy: argmax
    filtered: bool = False  # some row has top-k or top-p
    penalised: bool = False  # some row has a penalty, logit_bias or min_tokens
    logprobs: bool = False  # some row asks for logprobs
    masked: bool = False  # some row has a grammar (structured output)


GREEDY = SamplingMode(True)
SAMPLED = SamplingMode(False, filtered=True)  # the sampler's general path


def sampling_mode(tables: SlotTables, slots) -> SamplingMode:
    """The mode of a step whose sampled rows are ``slots`` (host ints), from the tables' host mirrors."""
    infos = [tables.info[s] for s in slots]
    greedy = all(i.greedy for i in infos)
    filtered = not greedy and any(i.filtered for i in infos)
    if not tables.featured:  # the common case: nobody asks for penalties or logprobs
        return SamplingMode(greedy, filtered)
    return SamplingMode(greedy, filtered, penalised=any(i.penalised for i in infos),
                        logprobs=any(i.num_logprobs >= 0 for i in infos))


class Sampled(NamedTuple):
    """A step's sampled tokens ``[S]`` and, in a logprobs mode, ids / logprobs ``[S, 21]``."""

    tokens: torch.Tensor
    logprob_ids: Optional[torch.Tensor] = None
    logprobs: Optional[torch.Tensor] = None

    def head(self, n: int) -> "Sampled":
        """The first ``n`` rows (a graph bucket's real rows)."""
        return Sampled(*(None if t is None else t[:n] for t in self))


def sample_rows(backend: Backend, logits: torch.Tensor, tables: SlotTables, slots: torch.Tensor,
                positions: torch.Tensor, mode: SamplingMode) -> Sampled:
    """Tokens for ``logits [S, vocab]`` of the rows of ``slots`` (module docstring); ``last_token`` updated.

    ``positions [S]`` is where each sampled token goes (its row's context length):
    with the slot's seed it keys the random stream, so the same seed gives the same
    token in any batch, at any pipeline depth.
    """
    x = logits
    if mode.penalised:
        x = backend.apply_penalties(logits, tables.penalties, slots, in_place=not mode.logprobs)
    if mode.masked:
        x = apply_grammar_mask(x.clone() if x is logits and mode.logprobs else x, tables.grammar_mask, slots)
    if mode.greedy:
        tokens = backend.argmax(x, tables.last_token, slots)  # writes last_token[slots] as well
    else:
        tokens = backend.sample(x, tables.sampling_rows(slots, positions, mode.filtered))
        tables.last_token[slots] = tokens
    out = Sampled(tokens)
    if mode.logprobs:
        out = Sampled(tokens, *backend.token_logprobs(logits, tokens, tables.num_logprobs[slots]))
    if mode.penalised:
        backend.count_sampled(tables.penalties, slots, tokens)
    return out
