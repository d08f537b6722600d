"""The seam between the model and its kernels: one :class:`Backend` protocol.

A backend is everything a step launches besides the model's own weights:

- attention: ``plan(batch)`` once per step (views and host numbers only, no device
  reads, so a plan is the same inside and outside a CUDA graph), then per layer
  ``rotate_and_store`` (rotary on q and k, after their per-head norms where the model has them, k and v into
  the paged cache; returns the rotated q) and ``attend``, each with the layer's ``kv_scale`` for an FP8 cache;
- decode rows: ``decode_rows`` (a graph decode step's per-row inputs from the slot
  tables: input tokens, KV write indices, block tables; :mod:`kernels.decode_rows`);
- ops: ``linear``, ``rms_norm``, ``add_rms_norm`` (residual add fused into the
  norm), ``silu_and_mul`` (on the fused gate|up projection), and the chains the
  model asks for whole so that a backend may fuse them around the matmul:
  ``norm_linear`` (a layer's :class:`NormInput` -> its first projection),
  ``mlp`` (norm -> gate|up -> SiLU-mul -> down), ``qkv_rotate_store`` (the
  attention input: norm -> q|k|v -> ``rotate_and_store``) and ``project_out``
  (attention's output projection, and the residual stream after it: a :class:`Stream`);
  the ``unfused_*`` functions here are those chains op by op;
- mixture of experts: ``moe(x, router_logits, w13, w2, top_k, renormalize)`` (routing, then each token's
  top-k experts weighted and summed: :mod:`kernels.moe_ref`, :mod:`kernels.moe`);
- LM head and sampler: ``logits(hidden, weight)`` (float32 logits), then
  ``argmax(logits, last_token, slots)`` when every row is greedy (it also writes the
  tokens to ``last_token[slots]``), else ``sample(logits, rows)`` (the caller is
  :func:`executor_proc.step.sample.sample_rows`).  :class:`SamplingRows` carries the per-row
  parameters gathered from the slot tables;
- sampling features: ``apply_penalties`` (repetition, frequency, presence,
  logit_bias, min_tokens from :class:`kernels.penalties_ref.PenaltyTables`),
  ``count_sampled`` (the tables' token counts, right after sampling) and
  ``token_logprobs`` (fixed ``[S, 1 + 20]`` ids / logprobs of the raw logits).

Implementations: :mod:`executor_proc.backends.torch_backend` (plain torch, the
CPU path) and :mod:`executor_proc.backends.triton_backend` (the CUDA fast path).
:func:`executor_proc.backends.select.select_backend` is the one place that chooses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional, Protocol, TypeVar

import torch

from executor_proc.step.batch import ForwardBatch
from kernels.penalties_ref import PenaltyTables
from kernels.reference import DecodeRows

PlanT = TypeVar("PlanT")
# An FP8 KV cache layer's (K, V) scales (stored = value / scale): executor_proc/model/kv_scales.py
KVScale = tuple[float, float]
NO_SCALE: KVScale = (1.0, 1.0)
QKNorm = tuple[torch.Tensor, torch.Tensor, float]  # per-head q and k RMSNorm weights [D] and eps (Qwen3)


@dataclass
class SamplingRows:
    """The sampled rows' parameters, gathered from the slot tables on the device (``[S]`` each).

    ``position`` is the position of the token being sampled (its row's context
    length): with the seed it keys the random stream, so the same seed gives the
    same token whatever the batch.
    """

    slots: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    filtered: bool = True  # host-side: some row has top-k or top-p (False skips the sampler's window)


@dataclass
class NormInput:
    """A layer's input before its RMSNorm: ``rms_norm(x + residual) * weight`` (the first layer has no
    residual yet: ``x`` is the embedding).  ``sumsq``: see :class:`Stream`."""

    x: torch.Tensor
    residual: Optional[torch.Tensor]
    weight: torch.Tensor
    eps: float
    sumsq: Optional[torch.Tensor] = None


@dataclass
class Stream:
    """The residual stream after a sublayer: ``x + residual``, the add left to the next norm; or, where the
    sublayer's last matmul added the residual in its epilogue (:meth:`Backend.project_out`), ``x`` itself
    with ``residual`` None and ``sumsq``, that matmul's per-program partial sums of x's squares ``[P, T]``
    (float32), from which the next matmul may apply the norm itself (:func:`kernels.gemv.gemv_residual`)."""

    x: torch.Tensor
    residual: Optional[torch.Tensor] = None
    sumsq: Optional[torch.Tensor] = None

    def before(self, weight: torch.Tensor, eps: float) -> NormInput:
        """The next norm's input."""
        return NormInput(self.x, self.residual, weight, eps, self.sumsq)

    def rows(self, index: torch.Tensor) -> "Stream":
        """Only the rows ``index`` (the sampled tokens before the final norm; partial sums dropped)."""
        return Stream(self.x[index], None if self.residual is None else self.residual[index])


def normed(backend: "Backend", pre: NormInput) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(pre), the residual stream after the add)``: one launch."""
    if pre.residual is None:
        return backend.rms_norm(pre.x, pre.weight, pre.eps), pre.x
    return backend.add_rms_norm(pre.x, pre.residual, pre.weight, pre.eps)


def unfused_norm_linear(backend: "Backend", pre: NormInput, weight: torch.Tensor,
                        bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(norm(pre)), the residual stream after the add)``, one op at a time."""
    h, residual = normed(backend, pre)
    return backend.linear(h, weight, bias), residual


def unfused_qkv_rotate_store(backend: "Backend", pre: NormInput, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             k_cache: torch.Tensor, v_cache: torch.Tensor, plan,
                             kv_scale: KVScale = NO_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rotated q [T, H, D], the residual stream)``: the q|k|v matmul of the normed input, then rotary
    on q and k and k, v into the cache (head counts from the cache's shape and the weight's)."""
    qkv, residual = backend.norm_linear(pre, weight, bias)
    q, k, v = split_heads(qkv, k_cache.shape[2], k_cache.shape[3])
    return backend.rotate_and_store(q, k, v, k_cache, v_cache, plan, kv_scale), residual


def split_heads(qkv: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """``[T, (H + 2 Hkv) D]`` -> views q ``[T, H, D]``, k and v ``[T, Hkv, D]``."""
    t, kv = qkv.shape[0], num_kv_heads * head_dim
    q, k, v = qkv.split([qkv.shape[1] - 2 * kv, kv, kv], dim=-1)
    return q.view(t, -1, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


def argmax_store(logits: torch.Tensor, last_token: Optional[torch.Tensor] = None,
                 slots: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.argmax(logits, -1)``, with ``last_token`` also written to ``last_token[slots]`` (two torch
    launches)."""
    tokens = torch.argmax(logits, dim=-1)
    if last_token is not None:
        last_token[slots] = tokens
    return tokens


def unfused_silu_linear(backend: "Backend", gate_up: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``linear(silu(gate) * up)``, one op at a time."""
    return backend.linear(backend.silu_and_mul(gate_up), weight, bias)


def unfused_project_out(backend: "Backend", x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                        residual: torch.Tensor) -> Stream:
    """``Stream(linear(x), residual)``: the residual add is left to the next norm."""
    return Stream(backend.linear(x, weight, bias), residual)


def unfused_mlp(backend: "Backend", pre: NormInput, gate_up: tuple, down: tuple) -> Stream:
    """``down(silu_and_mul(gate_up(norm(pre))))`` and the residual stream, one op at a time; ``gate_up`` and
    ``down`` are (weight, bias) pairs."""
    h, residual = unfused_norm_linear(backend, pre, *gate_up)
    return Stream(unfused_silu_linear(backend, h, *down), residual)


class MoEFront(NamedTuple):
    """An MoE layer's input side: the normed input ``h``, the residual stream, the router's logits ``[T, E]``,
    and, where the backend routed in the same launch, ``routing`` (weights ``[T, k]`` float32, ids ``[T, k]``
    local to the holder, as :func:`kernels.moe_ref.route_held`); None: :meth:`Backend.moe` routes."""

    h: torch.Tensor
    residual: torch.Tensor
    router_logits: torch.Tensor
    routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None


def unfused_moe_front(backend: "Backend", pre: NormInput, gate: torch.Tensor) -> MoEFront:
    """The norm, then the router's linear (the routing left to :meth:`Backend.moe`)."""
    h, residual = normed(backend, pre)
    return MoEFront(h, residual, backend.linear(h, gate, None))


class Backend(Protocol[PlanT]):
    """Attention + ops + sampler (see the module docstring)."""

    # Whether a pure-decode step may be captured in a CUDA graph: every shape the
    # backend needs comes from the device or from the batch size, none from host lists.
    supports_graphs: bool
    # The most rows of one decode forward (a speculative step runs its positions as decode rows).
    max_decode_rows: int

    def plan(self, batch: ForwardBatch) -> PlanT: ...

    def decode_rows(self, slots: torch.Tensor, positions: torch.Tensor, context_lens: torch.Tensor,
                    last_token: torch.Tensor, block_table: torch.Tensor, pad_slot: int,
                    block_size: int) -> DecodeRows: ...

    def rotate_and_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, plan: PlanT, kv_scale: KVScale = NO_SCALE,
                         qk_norm: Optional[QKNorm] = None) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PlanT,
               scale: float, kv_scale: KVScale = NO_SCALE) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor: ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def norm_linear(self, pre: NormInput, weight: torch.Tensor,
                    bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]: ...

    def mlp(self, pre: NormInput, gate_up: tuple, down: tuple) -> Stream:
        """``down(silu_and_mul(gate_up(norm(pre))))`` and the residual stream; (weight, bias) pairs."""
        ...

    def moe_front(self, pre: NormInput, gate: torch.Tensor, top_k: int, renormalize: bool, first_expert: int,
                  num_held: int) -> MoEFront:
        """The norm and the router's logits (``linear(h, gate)``), and maybe the routing (:class:`MoEFront`)."""
        ...

    def moe(self, x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool, first_expert: int = 0,
            routing: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """``[T, H]`` in x's dtype: softmax of the router logits in float32, the top-k experts (weights divided by
        their sum if ``renormalize``), and the sum of their SiLU-gated MLPs (``w13 [E, 2I, H]`` gate|up, ``w2
        [E, H, I]``) weighted by them (:func:`kernels.moe_ref.route_ref`, :func:`kernels.moe_ref.moe_ref`).
        Expert parallelism: ``w13``/``w2`` may hold fewer experts than the router scores, experts
        ``first_expert ..``; the pairs routed to the others add nothing (:func:`kernels.moe_ref.route_held`).
        ``routing``: that routing, already made (:meth:`moe_front`)."""
        ...

    def project_out(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    residual: torch.Tensor) -> Stream:
        """A sublayer's output projection and the residual stream: ``Stream(linear(x), residual)``, or the
        residual added in the matmul's epilogue (``Stream(linear(x) + residual, sumsq=...)``)."""
        ...

    def qkv_rotate_store(self, pre: NormInput, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PlanT,
                         kv_scale: KVScale = NO_SCALE) -> tuple[torch.Tensor, torch.Tensor]: ...

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``linear(hidden, weight).float()``: the LM head's float32 logits, rounded as the model's dtype."""
        ...

    def argmax(self, logits: torch.Tensor, last_token: Optional[torch.Tensor] = None,
               slots: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Greedy tokens ``torch.argmax(logits, -1)``, with ``last_token`` also written to ``last_token[slots]``."""
        ...

    def sample(self, logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor: ...

    def apply_penalties(self, logits: torch.Tensor, tables: PenaltyTables, slots: torch.Tensor,
                        in_place: bool) -> torch.Tensor: ...

    def count_sampled(self, tables: PenaltyTables, slots: torch.Tensor, tokens: torch.Tensor) -> None: ...

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                       num_logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
