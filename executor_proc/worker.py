"""The executor's step: plan -> device inputs -> forward -> sample -> tokens.

Nothing here reads a device value on the host.  Decode rows take their input
token from ``last_token[slot]`` by a gather on the device, the KV write
location of every token is computed on the device from the block table, and
sampled tokens are written back to ``last_token`` on the device before they
are copied to the host.  So step N+1 can be enqueued before step N's tokens
have reached the CPU.
"""

from __future__ import annotations

import itertools
import torch

from executor_proc.batch import ForwardBatch
from executor_proc.slot_tables import SlotTables, to_device
from ipc.protocol import StepPlan
from kernels.sampling_ref import sample


class Worker:
    def __init__(self, model, kv_cache, tables: SlotTables, block_size: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.tables = tables
        self.block_size = block_size
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def prepare(self, plan: StepPlan) -> ForwardBatch:
        """Apply the plan's diffs to the slot tables and build the step's device inputs."""
        self.tables.apply(plan)
        dev, bs = self.device, self.block_size
        row_slots, qlens, starts = plan.slots, plan.num_tokens, plan.positions
        token_rows = list(itertools.chain.from_iterable(itertools.repeat(r, n) for r, n in enumerate(qlens)))
        positions = list(itertools.chain.from_iterable(range(s, s + n) for s, n in zip(starts, qlens)))
        query_start = [0, *itertools.accumulate(qlens)]
        prefill_idx = [i for i, r in enumerate(token_rows) if plan.is_prefill[r]]
        decode_rows = [r for r, pre in enumerate(plan.is_prefill) if not pre]
        sample_rows = [r for r, s in enumerate(plan.sample) if s]

        slots_d = to_device(row_slots, torch.int64, dev)
        pos_d = to_device(positions, torch.int64, dev)
        tok_rows_d = to_device(token_rows, torch.int64, dev)
        tok_slots = slots_d[tok_rows_d]
        input_ids = torch.zeros(len(positions), dtype=torch.int64, device=dev)
        if prefill_idx:
            input_ids[to_device(prefill_idx, torch.int64, dev)] = to_device(plan.prefill_tokens, torch.int64, dev)
        if decode_rows:
            # A decode row is one token at query_start[r]; its input is the slot's last sampled token.
            idx = to_device([query_start[r] for r in decode_rows], torch.int64, dev)
            input_ids[idx] = self.tables.last_token[slots_d[to_device(decode_rows, torch.int64, dev)]]
        block_ids = self.tables.block_table[tok_slots, pos_d // bs].to(torch.int64)
        return ForwardBatch(
            input_ids=input_ids,
            positions=pos_d,
            slot_mapping=block_ids * bs + pos_d % bs,
            query_start=to_device(query_start, torch.int32, dev),
            context_lens=to_device([s + n for s, n in zip(starts, qlens)], torch.int32, dev),
            block_tables=self.tables.block_table[slots_d],
            sample_index=to_device([query_start[r + 1] - 1 for r in sample_rows], torch.int64, dev),
            sample_slots=to_device([row_slots[r] for r in sample_rows], torch.int64, dev),
            host_query_lens=list(qlens),
            host_context_lens=[s + n for s, n in zip(starts, qlens)],
            block_size=bs,
        )

    @torch.inference_mode()
    def launch(self, plan: StepPlan, batch: ForwardBatch) -> torch.Tensor:
        """Enqueue forward + sampling + last-token update; returns the device tensor of tokens."""
        if batch.sample_slots.numel() == 0:
            self.model(batch, self.kv_cache)  # a prompt chunk that samples nothing still writes KV
            return batch.sample_slots
        logits = self.model(batch, self.kv_cache)
        slots = batch.sample_slots
        t = self.tables
        if all(t.greedy[plan.slots[r]] for r, s in enumerate(plan.sample) if s):
            tokens = torch.argmax(logits, dim=-1)
        else:
            # The new token's position keys the random stream: the same seed gives the same token anywhere.
            token_pos = batch.positions[batch.sample_index] + 1
            tokens = sample(logits, t.temperature[slots], t.top_k[slots], t.top_p[slots], t.min_p[slots],
                            t.seed[slots], token_pos)
        t.last_token[slots] = tokens
        return tokens

    def copy_out(self, tokens: torch.Tensor):
        """Start the device->host copy of the tokens; returns (host tensor, event or None)."""
        if self.copy_stream is None:
            return tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            host.copy_(tokens, non_blocking=True)
            tokens.record_stream(self.copy_stream)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return host, event
