"""Two-stage (chunked) top-k over the vocabulary: the candidate windows of the sampler and of logprobs.

``torch.topk(logits, k)`` over a whole 128k row costs ~150 us at batch 64 on an H100 (one
radix select per row, then a sort of the ``k`` results).  Splitting each row into chunks
of ~4k entries (a view, no copy), taking the top ``per_chunk`` of every chunk, and keeping
those candidates is far cheaper (thousands of short, independent selections).

What the candidates guarantee, per row: every entry *not* among them is ``<= bound``
(``bound`` = the largest of the chunks' ``per_chunk``-th values; ``-inf`` when no chunk
dropped anything).  So the candidates hold every entry ``> bound``, and the global top
``per_chunk`` is always among them (each chunk's top ``per_chunk`` is).  Ties at ``bound``
may be split (some kept, some dropped); callers treat ``bound`` as "anything outside may
equal it".
"""

from __future__ import annotations

import torch

__all__ = ["chunk_layout", "chunk_candidates", "DEFAULT_CHUNK"]

DEFAULT_CHUNK = 4096


def chunk_layout(vocab: int, chunk: int = DEFAULT_CHUNK) -> tuple[int, int]:
    """``(num_chunks, chunk_len)`` of the equal chunks; a tail ``vocab - n * len`` (< len) is its own chunk.

    Prefers a divisor of ``vocab`` within 25% of ``chunk`` (128256 -> 32 x 4008) so there is no tail.
    """
    if vocab <= chunk:
        return 1, vocab
    for d in sorted(range(chunk * 3 // 4, chunk * 5 // 4 + 1), key=lambda d: abs(d - chunk)):
        if vocab % d == 0:
            return vocab // d, d
    return vocab // chunk, chunk


def chunk_candidates(x: torch.Tensor, per_chunk: int, chunk: int = DEFAULT_CHUNK, *, with_bound: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(values [S, M], ids int64 [S, M], bound float32 [S])`` for ``x`` ``[S, V]`` (unsorted candidates).

    No host sync, static shapes (capturable).  ``M = num_chunks * min(per_chunk, len) + tail part``.
    ``with_bound=False`` skips the bound (returned as None).
    """
    S, V = x.shape
    nch, ln = chunk_layout(V, chunk)
    main = nch * ln
    k = min(per_chunk, ln)
    vals, ids, bounds = [], [], []
    v, i = torch.topk(x[:, :main].unflatten(1, (nch, ln)), k, dim=-1, sorted=False)
    vals.append(v.reshape(S, nch * k))
    ids.append((i + torch.arange(0, main, ln, device=x.device)[:, None]).reshape(S, nch * k))
    if k < ln and with_bound:
        bounds.append(v.amin(dim=-1).amax(dim=-1))
    if main < V:
        kt = min(per_chunk, V - main)
        v, i = torch.topk(x[:, main:], kt, dim=-1, sorted=False)
        vals.append(v)
        ids.append(i + main)
        if kt < V - main and with_bound:
            bounds.append(v.amin(dim=-1))
    cat = (lambda ts: ts[0]) if len(vals) == 1 else (lambda ts: torch.cat(ts, dim=1))
    if not with_bound:
        bound = None
    elif bounds:
        bound = bounds[0] if len(bounds) == 1 else torch.maximum(bounds[0], bounds[1])
        bound = bound.float()
    else:
        bound = torch.full((S,), float("-inf"), device=x.device)
    return cat(vals), cat(ids), bound
