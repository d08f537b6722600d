"""The paged KV cache: one K and one V tensor per layer, carved from one allocation.

Layout::

    storage  [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    k[layer] = storage[layer, 0]   -> [num_blocks, block_size, num_kv_heads, head_dim]
    v[layer] = storage[layer, 1]

Block ids are shared by all layers: block b of a request holds its tokens
``b_index * block_size ...`` in every layer.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from executor_proc.model.config import ModelConfig


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers (K and V)."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * item


class KVCache:
    """Per-layer K/V block pools, zero-initialised."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        scales: Optional[list[tuple[float, float]]] = None,
    ) -> None:
        self.num_blocks = num_blocks
        # An FP8 cache's (K, V) scale per layer (stored = value / scale; executor_proc/model/kv_scales.py)
        self.scales = scales
        self.block_size = block_size
        # Zeros, not empty: masked-out keys still multiply their V by 0 in SDPA, and 0 * NaN = NaN.
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.storage = _zeros(shape, dtype, torch.device(device))
        self.k = [self.storage[layer, 0] for layer in range(config.num_layers)]
        self.v = [self.storage[layer, 1] for layer in range(config.num_layers)]

    def layer_scale(self, layer: int) -> tuple[float, float]:
        """The layer's (K, V) scales: what attention multiplies the stored values by."""
        return self.scales[layer] if self.scales is not None else (1.0, 1.0)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros on the device; on the CPU from the OS's zero pages (numpy's calloc), so a pool's memory is
    resident only once its blocks are written: a server's start writes none of it (2 GiB by default)."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(int(np.prod(shape)) * item, dtype=np.uint8))
    return raw.view(dtype).view(shape)
