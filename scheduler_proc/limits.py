"""What the scheduler plans and validates within: one struct, built once the executor is ready."""

from __future__ import annotations

from dataclasses import dataclass

from ipc.config import ExecutorConfig
from ipc.protocol import ExecutorReady


@dataclass(frozen=True)
class Limits:
    num_slots: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    vocab_size: int = 2**31 - 1
    num_host_blocks: int = 0  # the host KV tier's pool (0: no tier)
    num_speculative_tokens: int = 0  # drafts per speculative row (0: no speculative decoding)
    # A request whose drafts keep being rejected pauses (n-gram drafts); a draft model's never do: its KV cache
    # must follow every position, and a plain row does not run it (scheduler_proc/speculation.py).
    spec_pauses: bool = True
    # n-gram drafts: their shortest match (--ngram-min); a row gets drafts only where its request's known tokens end
    # in an earlier n-gram of that many (0: drafts in every row: a draft model's, or the scripted executor's, whose
    # script decides what is accepted; scheduler_proc/speculation.py).
    spec_lookup_ngram: int = 0

    def __post_init__(self):
        for name in ("num_slots", "num_kv_blocks", "block_size", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def of(cls, cfg: ExecutorConfig, ready: ExecutorReady) -> "Limits":
        """What the scheduler asked for (slots, block size, token budget) and what the executor decided."""
        return cls(num_slots=cfg.num_slots, num_kv_blocks=ready.num_kv_blocks, block_size=cfg.block_size,
                   max_model_len=ready.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                   eos_token_ids=frozenset(ready.eos_token_ids), vocab_size=ready.vocab_size,
                   num_host_blocks=ready.num_host_blocks,
                   num_speculative_tokens=cfg.speculative.num_tokens if cfg.speculative.method else 0,
                   spec_pauses=cfg.speculative.method != "draft",
                   spec_lookup_ngram=cfg.speculative.ngram_min
                   if cfg.speculative.method == "ngram" and cfg.load_format != "scripted" else 0)
