"""Which part of every weight a tensor-parallel rank holds (Megatron's scheme); pure, no torch.distributed.

Rank ``r`` of ``N``, for HF parameter names::

    q_proj, gate_proj, up_proj   column-parallel: output rows of heads / MLP columns r*n/N .. (r+1)*n/N
                                 (an expert's and the shared expert's by their own intermediate sizes)
    k_proj, v_proj               the rank's KV heads: a split when N divides them, else (N a multiple of
                                 them) the one KV head its query heads read, replicated on N/KV ranks
    o_proj, down_proj            row-parallel: the matching input columns; the partial outputs are
                                 all-reduced, so a bias is added once: rank 0 holds it, the others zeros
    *.weight_scale (FP8)         with their weight's rows: column-parallel sliced, row-parallel and
                                 per-tensor ones (and input_scale) whole
    embed_tokens, lm_head        vocabulary-parallel: rows r*Vp .. (r+1)*Vp, Vp = ceil(V/N), rows past V zero
    norms, the MoE router        replicated (every rank routes every token the same way, in float32),
    and shared_expert_gate       so each rank runs every chosen expert on its slice of that expert
    w13 [E, 2I, H], w2 [E, H, I] the stacked experts (dummy weights are drawn stacked): each expert's gate
                                 and up rows, and its down columns, of the rank's slice of I

With expert parallelism (``--enable-expert-parallel``) the routed experts are not split: rank r holds whole
experts, a contiguous range of them (:func:`expert_range`), and never reads the others' tensors
(:meth:`Shards.holds`); everything else, the shared expert included, is split as above.

Fused q|k|v and gate|up are built from the sliced parts, so each rank's fused matmul is its own
column slice.  A model whose head, MLP or expert sizes ``N`` does not divide is refused at start-up
(:func:`check_divisible`), naming the counts and the sizes that would work.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Optional

import torch

from executor_proc.memory_plan import StartupRefused
from executor_proc.model.config import ModelConfig
from executor_proc.model.fp8_checkpoint import kv_scale_name
from executor_proc.model.moe import checkpoint_name
from ipc.config import MAX_TENSOR_PARALLEL

_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
_VOCAB = ("embed_tokens", "lm_head")
_STACKED = ("w13", "w2")  # an MoE layer's stacked experts (executor_proc.model.moe.MoEBlock)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")  # a routed expert's checkpoint tensor (Qwen-MoE naming)


class NotDivisible(StartupRefused, ValueError):
    """A tensor-parallel size that does not split the model evenly: one line for the user."""


def _has_dense_mlp(config: ModelConfig) -> bool:
    return config.moe is None or not all(config.moe.is_sparse(i) for i in range(config.num_layers))


def _split_sizes(config: ModelConfig, expert_parallel: bool = False) -> list[int]:
    """Every intermediate size the ranks split: the dense MLP's (where a layer has one), the experts' (not
    under expert parallelism: whole experts), the shared expert's."""
    moe = config.moe
    sizes = [config.intermediate_size] if _has_dense_mlp(config) else []
    if moe is not None:
        sizes += [] if expert_parallel else [moe.intermediate_size]
        sizes += [moe.shared_intermediate_size] if moe.shared_intermediate_size else []
    return sizes


def divides(config: ModelConfig, size: int, expert_parallel: bool = False) -> bool:
    """Whether ``size`` ranks can split the model's heads, MLP columns and experts' columns evenly (with
    ``expert_parallel``: hold at least one whole expert each instead of splitting the experts)."""
    heads, kv = config.num_heads, config.num_kv_heads
    if expert_parallel and (config.moe is None or size > config.moe.num_experts):
        return False
    return heads % size == 0 and all(n % size == 0 for n in _split_sizes(config, expert_parallel)) and (
        kv % size == 0 or size % kv == 0)


def expert_range(num_experts: int, rank: int, size: int) -> range:
    """The experts rank ``rank`` of ``size`` holds under expert parallelism: contiguous ranges in rank order,
    the first ``num_experts % size`` ranks one more than the rest (8 over 3: 0-2, 3-5, 6-7), as vLLM places
    them."""
    base, extra = divmod(num_experts, size)
    first = rank * base + min(rank, extra)
    return range(first, first + base + (rank < extra))


def check_expert_parallel(config: ModelConfig, size: int) -> None:
    """Refuse ``--enable-expert-parallel`` in one line for a dense model (an MoE architecture whose layers are all
    dense too), or more ranks than experts."""
    if config.moe is None or not any(config.moe.is_sparse(i) for i in range(config.num_layers)):
        none = "has none" if config.moe is None else "has no MoE layer (decoder_sparse_step, mlp_only_layers)"
        raise StartupRefused(f"--enable-expert-parallel needs a mixture-of-experts model; {config.architecture} "
                             f"{none}")
    experts = config.moe.num_experts
    if size > experts:
        fewer = f"use --tensor-parallel-size {experts} or fewer, or leave" if experts > 1 else "leave"
        raise StartupRefused(f"--enable-expert-parallel gives each of the {size} tensor-parallel ranks whole "
                             f"experts, but the model has {experts}: {fewer} the flag off (tensor parallelism "
                             f"splits every expert)")


def check_divisible(config: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise :class:`NotDivisible` naming the counts ``size`` does not divide and the sizes that would work."""
    if divides(config, size, expert_parallel):
        return
    counts = [f"{config.num_heads} attention heads", f"{config.num_kv_heads} KV heads (it must divide them "
              f"or be a multiple of them)"]
    if _has_dense_mlp(config):
        counts.append(f"an MLP of {config.intermediate_size}")
    moe = config.moe
    if moe is not None:
        if not expert_parallel:
            counts.append(f"{moe.num_experts} experts of an MLP of {moe.intermediate_size}")
        if moe.shared_intermediate_size:
            counts.append(f"a shared expert of {moe.shared_intermediate_size}")
    good = [n for n in range(1, MAX_TENSOR_PARALLEL + 1) if divides(config, n, expert_parallel)]
    # whole experts a rank need not split the experts' MLP: say so where that is what stood in the way
    whole = "; or enable_expert_parallel (whole experts a rank)" if (
        moe is not None and not expert_parallel and divides(config, size, expert_parallel=True)) else ""
    raise NotDivisible(f"tensor_parallel_size {size} does not divide the model ({', '.join(counts)}); "
                       f"sizes that do: {', '.join(map(str, good))}{whole}")


def _numel(t) -> int:
    n = 1
    for d in _shape(t):
        n *= d
    return n


def _shape(t) -> tuple[int, ...]:
    """A tensor's shape, or a safetensors slice's."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t.get_shape())


class Shards:
    """Rank ``rank`` of ``size``: its model shape (:attr:`config`), its slice of each full weight (:meth:`take`)
    and, with ``expert_parallel``, the whole experts it holds (:attr:`experts`; None: a slice of every one)."""

    def __init__(self, full: ModelConfig, rank: int, size: int, expert_parallel: bool = False):
        if not 0 <= rank < size:
            raise ValueError(f"tensor parallel rank {rank} is outside 0..{size - 1}")
        if expert_parallel:
            check_expert_parallel(full, size)
        check_divisible(full, size, expert_parallel)
        self.full, self.rank, self.size = full, rank, size
        d = full.head_dim
        heads = full.num_heads // size
        self.vocab_per_rank = -(-full.vocab_size // size)
        if full.num_kv_heads >= size:
            kv = full.num_kv_heads // size
            kv_first = rank * kv
        else:  # fewer KV heads than ranks: each rank keeps the one its query heads read
            kv, kv_first = 1, rank // (size // full.num_kv_heads)
        inter = full.intermediate_size // size
        self.rows = {"q": (rank * heads * d, (rank + 1) * heads * d),
                     "kv": (kv_first * d, (kv_first + kv) * d),
                     "mlp": (rank * inter, (rank + 1) * inter)}
        moe = full.moe
        self.experts: Optional[range] = None
        if moe is not None:
            shared = moe.shared_intermediate_size // size
            self.rows["shared"] = (rank * shared, (rank + 1) * shared)
            if expert_parallel:
                self.experts = expert_range(moe.num_experts, rank, size)
                moe = replace(moe, shared_intermediate_size=shared)
            else:
                expert = moe.intermediate_size // size
                self.rows["expert"] = (rank * expert, (rank + 1) * expert)
                moe = replace(moe, intermediate_size=expert, shared_intermediate_size=shared)
        self.vocab_start = rank * self.vocab_per_rank
        self.config = replace(full, num_heads=heads, num_kv_heads=kv, intermediate_size=inter,
                              vocab_size=self.vocab_per_rank, moe=moe)

    def holds(self, name: str) -> bool:
        """Whether this rank keeps any of the full weight ``name``: under expert parallelism another rank's
        experts are skipped, never read."""
        if self.experts is None:
            return True
        expert = _EXPERT.search(checkpoint_name(name))
        return expert is None or int(expert[1]) in self.experts

    def take(self, name: str, t) -> torch.Tensor:
        """This rank's part of the full weight ``name`` (HF naming, Mixtral's expert names too; one it
        :meth:`holds`); ``t`` is a tensor or a safetensors slice."""
        name = checkpoint_name(name)
        parts = name.split(".")
        module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if kind in _STACKED:
            return self._stacked_experts(kind, t)
        if self.experts is not None and _EXPERT.search(name):  # a whole expert of the rank's (a 0-dim scale too)
            return t[...]
        if kv_scale_name(name) is not None:  # an FP8 KV cache's scale: one a layer (its largest, where per head)
            return t[...]
        if kind.endswith("_scale") and (module in _ROW or _numel(t) == 1):  # FP8 scales: per output row, or per tensor
            return t[...]
        if module in _COLUMN:
            a, b = self.rows[self._split(name, _COLUMN[module])]
            return t[a:b]
        if module in _ROW:
            if kind == "bias":  # added once, after the all-reduce
                full = t[:]
                return full if self.rank == 0 else torch.zeros_like(full)
            a, b = self.rows[self._split(name, _ROW[module])]
            return t[:, a:b]
        if module in _VOCAB:
            return self._vocab_rows(t)
        return t[:]

    @staticmethod
    def _split(name: str, split: str) -> str:
        """Which slice an MLP projection takes: a routed expert's, the shared expert's or the dense MLP's."""
        if split != "mlp":
            return split
        return "expert" if ".mlp.experts." in name else "shared" if ".mlp.shared_expert." in name else "mlp"

    def _stacked_experts(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        """``w13 [E, 2I, H]``: each expert's gate rows and up rows of the rank's slice; ``w2 [E, H, I]``: its
        down columns (expert parallelism: the rank's experts whole)."""
        if self.experts is not None:
            return t[self.experts.start:self.experts.stop]
        a, b = self.rows["expert"]
        if kind == "w2":
            return t[:, :, a:b]
        inter = _shape(t)[1] // 2
        return torch.cat([t[:, a:b], t[:, inter + a:inter + b]], dim=1)

    def _vocab_rows(self, t) -> torch.Tensor:
        vocab = _shape(t)[0]
        start = min(self.vocab_start, vocab)
        stop = min(self.vocab_start + self.vocab_per_rank, vocab)
        rows = t[start:stop] if stop > start else t[0:1][:0]
        missing = self.vocab_per_rank - rows.shape[0]
        if missing:  # the padding rows of the last rank: their logits are cut off after the gather
            rows = torch.cat([rows, rows.new_zeros((missing, *rows.shape[1:]))])
        return rows
