"""Schedule-independent sampling in pure torch (the CPU executor's sampler and the
reference for :mod:`kernels.sampling`).

The function, exactly
---------------------
For row ``i`` with logits ``x`` (float32, ``[V]``):

1. **Greedy** if ``temperature < 1e-5``: ``argmax(x)`` (first index on ties).
2. Otherwise ``s = x * (1 / temperature)`` (reciprocal rounded once, then one
   float32 multiply per element, so both implementations get the same bits).
3. **top-k** (``0 < top_k < V``; else off): ``tau_k`` = the ``top_k``-th largest ``s``;
   keep ``s >= tau_k`` (tied values at the threshold are all kept).
4. **top-p** (``top_p < 1``; else off), on the top-k survivors renormalised:
   ``w = exp(s - max(s))`` (float32, summed in float64), ``Z = sum of w over survivors``;
   a survivor ``x`` stays iff the mass of survivors with *strictly larger* ``s`` is
   ``< top_p * Z``.  This always keeps the maximum, and keeps or drops tied values
   together.
5. **min-p** (``min_p > 0``): keep ``s - max(s) >= log(min_p)``.  (Relative to the
   maximum, so its own survivors are the same before or after 3-4; top-p's are not:
   min-p first would take the nucleus of a smaller mass.  The order above is HF's and
   SGLang's: top-k, top-p, min-p; vLLM's V1 engine applies min-p before top-k/top-p.)
6. **Gumbel-max** over the survivors: ``argmax(s + g)`` with
   ``g = -log(-log(u))`` and ``u = uniform(seed, position, vocab index)`` below
   (first index on ties).  This samples exactly ``softmax(s)`` restricted to the
   survivors, and the token depends only on the row's logits, seed and position.

Random numbers (bit-exact in torch and Triton)
----------------------------------------------
``mix32`` is Chris Wellons' *lowbias32* integer hash on 32-bit words::

    x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16   (mod 2**32)

Torch has no uint32 arithmetic, so here words live in int64 in ``[0, 2**32)``;
the second constant is used as ``0x846CA68B - 2**32`` (congruent mod 2**32, and
``|c| < 2**31`` keeps every product inside int64), followed by ``& 0xFFFFFFFF``.
The Triton kernel uses native wrapping uint32 multiplies: same bits.

Per row: ``k = mix32(mix32(mix32(mix32(lo(seed) ^ 0x243F6A88) ^ hi(seed)) ^ lo(pos)) ^ hi(pos))``
where ``lo``/``hi`` are the low/high 32 bits of the int64 (two's complement).
Per vocab index ``j``: ``h = mix32(mix32(j ^ 0x6A09E667) ^ k)`` and
``u = ((h >> 9) + 0.5) * 2**-23``, a float32 in ``(0, 1)`` computed exactly.

Nothing here reads a device value on the host and every shape is static, so the
function is capturable in a CUDA graph and never synchronises.
"""

from __future__ import annotations

import torch

__all__ = ["sample", "hash_uniform", "row_keys", "mix32", "GREEDY_EPS", "is_greedy"]

# The one greedy rule: a row whose temperature is below GREEDY_EPS takes the argmax.  The
# kernels apply it per row on the device; the executor's slot tables apply is_greedy on the
# host to run an all-greedy step as a plain argmax.
GREEDY_EPS = 1e-5


def is_greedy(temperature: float) -> bool:
    """Whether a request with this temperature samples greedily (the argmax)."""
    return temperature < GREEDY_EPS

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B - (1 << 32)  # negative, |c| < 2**31: x * c stays inside int64
_SEED_SALT = 0x243F6A88
_IDX_SALT = 0x6A09E667


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    x = x ^ (x >> 16)
    return x


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """32-bit key per row (int64 tensor) from int64 seed and position."""
    seed = seed.long()
    position = position.long()
    k = mix32((seed & _M32) ^ _SEED_SALT)
    k = mix32(k ^ ((seed >> 32) & _M32))
    k = mix32(k ^ (position & _M32))
    k = mix32(k ^ ((position >> 32) & _M32))
    return k


def _index_hash(vocab: int, device) -> torch.Tensor:
    return mix32(torch.arange(vocab, dtype=torch.int64, device=device) ^ _IDX_SALT)


def hash_uniform(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[S, V]`` float32 uniforms in (0, 1), a pure function of (seed, position, index)."""
    k = row_keys(seed, position)
    h = mix32(_index_hash(vocab, seed.device)[None, :] ^ k[:, None])
    return ((h >> 9).to(torch.float32) + 0.5) * (2.0 ** -23)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Tokens ``[S]`` int64 for logits ``[S, V]`` (see the module docstring for the exact rule).

    temperature/top_p/min_p ``[S]`` float, top_k ``[S]`` int (0 = off), seed/position
    ``[S]`` int64.  Fully vectorised; no host synchronisation, static shapes.
    """
    assert logits.dim() == 2, logits.shape
    S, V = logits.shape
    for t in (temperature, top_k, top_p, min_p, seed, position):
        assert t.shape == (S,), (t.shape, S)
    x = logits.float()
    temp = temperature.float()
    greedy = temp < GREEDY_EPS
    inv_t = 1.0 / torch.where(greedy, torch.ones_like(temp), temp)
    s = x * inv_t[:, None]
    smax = s.max(dim=-1, keepdim=True).values
    neg_inf = x.new_full((1,), float("-inf"))  # no host-to-device copy

    sorted_s = torch.sort(s, dim=-1, descending=True).values
    # top-k
    k = top_k.long()
    k_on = (k > 0) & (k < V)
    kk = torch.where(k_on, k, torch.full_like(k, V)).clamp(1, V)
    tau_k = sorted_s.gather(1, (kk - 1)[:, None])
    tau_k = torch.where(k_on[:, None], tau_k, neg_inf)
    # top-p over the top-k survivors
    in_k = sorted_s >= tau_k
    w = torch.exp(sorted_s - smax).double() * in_k
    z = w.sum(dim=-1, keepdim=True)
    excl = torch.cumsum(w, dim=-1) - w  # mass strictly before (ties: see tau below)
    keep = (excl < top_p.double()[:, None] * z) & in_k
    n = keep.sum(dim=-1).clamp(min=1)
    tau_p = sorted_s.gather(1, (n - 1)[:, None])
    p_on = top_p < 1.0
    tau_p = torch.where(p_on[:, None], tau_p, neg_inf)
    tau = torch.maximum(tau_k, tau_p)
    # min-p
    mp = min_p.float()
    log_mp = torch.where(mp > 0, torch.log(torch.where(mp > 0, mp, torch.ones_like(mp))), neg_inf)
    survive = (s >= tau) & ((s - smax) >= log_mp[:, None])

    u = hash_uniform(seed, position, V)
    g = -torch.log(-torch.log(u))
    score = torch.where(survive, s + g, neg_inf)
    tok = torch.argmax(score, dim=-1)
    return torch.where(greedy, torch.argmax(x, dim=-1), tok)
