"""The dense feed-forward layer, and the fused projections every layer's matmuls go through.

:class:`FusedLinear` holds several ``nn.Linear`` of one input as one matmul (q|k|v, gate|up); :class:`MLP` is
the SiLU-gated MLP (gate|up, SiLU-mul, down) of the dense layers, and of Qwen2-MoE's shared expert.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from executor_proc.backends.base import Backend, NormInput, Stream, unfused_silu_linear
from executor_proc.model.config import ModelConfig


class FusedLinear:
    """Several ``nn.Linear`` of one input as one matmul (or one alone); the originals become views of its weight
    (``sizes`` splits the fused output back into the projections).  ``weight`` is what the backend receives: a
    tensor, or an FP8 weight with its scales (:mod:`executor_proc.model.quantization`).

    A model is fused as it is built, before its weights load into the views (``build_model``): the fused storage
    is new and uninitialised, not a copy of the linears' (a copy of every weight at each start, for nothing)."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight = _joined([lin.weight for lin in linears])
        has_bias = linears[0].bias is not None
        self.bias = _joined([lin.bias for lin in linears]) if has_bias else None
        for lin, w, b in zip(linears, self.weight.split(self.sizes), self._bias_parts()):
            lin.weight = nn.Parameter(w, requires_grad=False)  # frees the separate copy
            if b is not None:
                lin.bias = nn.Parameter(b, requires_grad=False)

    def _bias_parts(self) -> list[Optional[torch.Tensor]]:
        return list(self.bias.split(self.sizes)) if self.bias is not None else [None] * len(self.sizes)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Storage for ``parts`` stacked along dim 0: the one part's own, or a new uninitialised tensor."""
    if len(parts) == 1:
        return parts[0].data
    first = parts[0]
    return torch.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), dtype=first.dtype, device=first.device)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, intermediate_size or config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=bias, dtype=dtype)
        self.gate_up: Optional[FusedLinear] = None  # set by CausalLM.fuse_projections
        self.down: Optional[FusedLinear] = None  # down_proj alone (its weight may become FP8)

    def forward(self, pre: NormInput, backend: Backend) -> Stream:
        """The MLP output and the residual stream, for the un-normalised input."""
        return backend.mlp(pre, (self.gate_up.weight, self.gate_up.bias), (self.down.weight, self.down.bias))

    def fuse(self) -> None:
        """gate|up becomes one matmul (the two linears views of it); down stands alone in the same holder."""
        self.gate_up = FusedLinear([self.gate_proj, self.up_proj])
        self.down = FusedLinear([self.down_proj])

    def normed_forward(self, h: torch.Tensor, backend: Backend) -> torch.Tensor:
        """The MLP of an input already normalised (a shared expert beside the routed ones)."""
        return unfused_silu_linear(backend, backend.linear(h, self.gate_up.weight, self.gate_up.bias),
                                   self.down.weight, self.down.bias)
