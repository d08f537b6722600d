"""Per-layer scales of an FP8 KV cache (``--kv-cache-dtype fp8``): an FP8 checkpoint's own (``k_scale`` /
``v_scale``: :func:`executor_proc.model.fp8_checkpoint.kv_scale_name`), else measured once at start-up; then fixed.

e4m3 keeps 3 mantissa bits from 2^-6 to 448; below, values lose bits.  A layer's keys and values span
very different ranges (SmolLM2-135M: largest magnitude 0.6 in some layers, 19 in others), so stored as
they are (scale 1) the small layers' values fall into that range: +1.9% perplexity on the default model.
Each layer's K and V therefore get their own scale, ``stored = value / scale``, with ``scale`` the largest
magnitude seen divided by 448, times :data:`HEADROOM` for values past what the calibration saw (those
are clamped to +-448).  The calibration is one prefill of :data:`CALIBRATION_TOKENS` fixed token ids
through the model itself, into a cache of the model dtype, before the graphs are captured: every rank of
a tensor-parallel group runs it (its own KV heads), and a restarted executor finds the same scales.
The kernels take the scales as plain numbers (:class:`executor_proc.backends.base.KVScale`), so blocks
written under them stay valid for the server's life (prefix cache, host tier).
"""

from __future__ import annotations

from typing import Optional

import torch

from executor_proc.model.kv_cache import KVCache
from executor_proc.step.batch import ForwardBatch

CALIBRATION_TOKENS = 512
HEADROOM = 2.0
_E4M3_MAX = 448.0
_TINY = 1e-8


@torch.no_grad()
def calibrate_kv_scales(model, device: torch.device, block_size: int,
                        tokens: Optional[int] = None) -> list[tuple[float, float]]:
    """``[(k_scale, v_scale)]`` per layer of ``model`` (its backend in place), from one prefill of ``tokens``
    (default :data:`CALIBRATION_TOKENS`) fixed ids (``(7 i + 1) mod vocab``, as the start-up's profile step uses)."""
    cfg = model.config
    n = max(1, min(tokens or CALIBRATION_TOKENS, cfg.max_position_embeddings))
    blocks = -(-n // block_size)
    cache = KVCache(cfg, 1 + blocks, block_size, device, model.lm_head.weight.dtype)  # block 0: the padding slot's
    pos = torch.arange(n, device=device)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    batch = ForwardBatch(input_ids=(7 * pos + 1) % cfg.vocab_size, positions=pos, kv_index=block_size + pos,
                         query_start=i32([0, n]), context_lens=i32([n]),
                         block_tables=(1 + torch.arange(blocks, device=device)).int()[None, :],
                         sample_index=torch.tensor([n - 1], device=device),
                         sample_slots=torch.zeros(1, dtype=torch.long, device=device),
                         host_query_lens=[n], host_context_lens=[n], block_size=block_size)
    model.final_hidden(batch, cache)
    amax = torch.stack([torch.stack([cache.k[layer].abs().amax(), cache.v[layer].abs().amax()])
                        for layer in range(cfg.num_layers)]).float()
    scales = (amax.clamp_min(_TINY) * HEADROOM / _E4M3_MAX).tolist()  # one device read, at start-up
    return [(float(k), float(v)) for k, v in scales]
