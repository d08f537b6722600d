"""The executor's step: plan -> device inputs -> forward -> sample -> tokens.

Nothing here reads a device value on the host.  Decode rows take their input
token from ``last_token[slot]`` by a gather on the device, the KV write
location of every token is computed on the device from the block table, and
sampled tokens are written back to ``last_token`` on the device before they
are copied to the host.  So step N+1 can be enqueued before step N's tokens
have reached the CPU.

A step's host inputs (and the plan's table diffs) go to the device in one
pinned, non-blocking upload (:mod:`executor_proc.step.staging`).  A pure-decode step
that fits a bucket runs as :func:`executor_proc.step.decode_step.decode_step`
through :class:`executor_proc.step.graphs.DecodeGraphs`; a step with prefill
chunks runs padded to a bucket through :class:`executor_proc.step.mixed_graphs.MixedGraphs`
(:mod:`executor_proc.step.mixed_step`); a step of greedy speculative (and plain) decode rows, as decode rows through
:class:`executor_proc.step.spec_graphs.SpecGraphs`; all are replayed graphs on CUDA.  The
rest run the model eagerly with the same kernels: steps that need prompt
logprobs, plans with no rows, and everything when graphs are off.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from executor_proc.step.decode_step import decode_step
from executor_proc.step.draft_graphs import DraftGraphs
from executor_proc.step.grammar import GrammarSlots
from executor_proc.step.graphs import DecodeGraphs, GraphCapture, run_captures
from executor_proc.step.host_kv import HostKV
from executor_proc.step.mixed_graphs import MixedGraphs
from executor_proc.step.mixed_step import MixedShape, mixed_body, mixed_head, mixed_inputs
from executor_proc.step.plan_rows import PlanRows, plan_rows
from executor_proc.step.prompt_logprobs import (PromptLogprobPlan, SavedHidden, compute_prompt_logprobs,
                                                plan_prompt_logprobs)
from executor_proc.step.sample import GREEDY, Sampled, SamplingMode, sample_rows, sampling_mode
from executor_proc.step.slot_tables import SlotTables
from executor_proc.step.split_decode import SplitDecode
from executor_proc.step.spec_graphs import SpecGraphs
from executor_proc.step.speculate import Speculator
from executor_proc.step.staging import PinnedStaging, TokenRing
from executor_proc.step.step_inputs import decode_rows, eager_batch, eager_rows
from executor_proc.step.step_kinds import GraphStep, MixedStep, SpecDecodeStep, Step
from executor_proc.step.step_outputs import StepOutputs
from ipc.protocol import StepPlan


class Worker:
    def __init__(self, model, kv_cache, tables: SlotTables, block_size: int, device: torch.device,
                 graph_max_batch: int = 0, capture_graphs: bool = False, host_kv: Optional[HostKV] = None,
                 mixed_max_tokens: int = 0):
        """``model`` runs on its backend (forward and sampler); ``graph_max_batch > 0`` runs pure-decode
        steps of up to that many rows through :class:`DecodeGraphs`, ``mixed_max_tokens > 0`` steps with
        prefill chunks of up to that many tokens through :class:`MixedGraphs` (both captured when
        ``capture_graphs``, else run eagerly); ``host_kv``: the host KV tier's pool, which plans' onloads
        and backups use."""
        self.model = model
        self.kv_cache = kv_cache
        self.tables = tables
        self.block_size = block_size
        self.device = device
        self.capture = capture_graphs
        self.staging = PinnedStaging(device)
        self.tokens_out = TokenRing(device, tables.num_slots + 1) if device.type == "cuda" else None
        self.saved_hidden = SavedHidden()
        self.host_kv = host_kv
        self.capturer = GraphCapture(device)  # one memory pool for every graph
        self.graphs = None
        if graph_max_batch > 0:
            self.graphs = DecodeGraphs(self._decode_step, min(graph_max_batch, tables.num_slots), tables.pad_slot,
                                       device, capture=capture_graphs, capturer=self.capturer)
        # pure-decode steps with grammar masks: the decode forward, the masks bound, then the sampling
        self.split = (SplitDecode(self.graphs, self, model.config.hidden_size, model.lm_head.weight.dtype)
                      if self.graphs is not None else None)
        self.mixed = None
        self.grammar: Optional[GrammarSlots] = None  # structured outputs' matchers (set by build_worker)
        self.spec: Optional[Speculator] = None  # speculative decoding (enable_speculation)
        self.spec_graphs: Optional[SpecGraphs] = None  # steps of greedy speculative rows: one graph of decode rows
        if mixed_max_tokens > 0:
            self.mixed = self._mixed_graphs(mixed_max_tokens, tables.num_slots)

    def _mixed_graphs(self, max_tokens: int, max_rows: int) -> MixedGraphs:
        """The mixed-step runner: steps of up to ``max_tokens`` tokens whose bodies give up to ``max_rows`` hidden
        rows (a row per slot, sampled; speculative rows' drafted positions beside them)."""
        config = self.model.config
        return MixedGraphs(self._mixed_body, self._mixed_head, max_tokens, max_rows, self.tables.pad_slot,
                           config.hidden_size, self.model.lm_head.weight.dtype, self.device, capture=self.capture,
                           capturer=self.capturer, group=config.num_heads // config.num_kv_heads,
                           max_sampled=self.tables.num_slots)

    def _decode_step(self, inputs, mode: SamplingMode) -> Sampled:
        with torch.inference_mode():
            return decode_step(self.model, self.kv_cache, self.tables, inputs, self.block_size, mode)

    def _mixed_body(self, inputs, hidden, host) -> None:
        with torch.inference_mode():
            mixed_body(self.model, self.kv_cache, self.tables, inputs, self.block_size, hidden, host)

    def _mixed_head(self, hidden, slots, positions, mode: SamplingMode) -> Sampled:
        with torch.inference_mode():
            return mixed_head(self.model, self.tables, hidden, slots, positions, mode)

    def enable_speculation(self, spec: Optional[Speculator]) -> None:
        """Run plans' speculative rows; a step then returns up to K + 2 values per row.  A draft model's passes
        get graphs wherever the mixed-step graphs run (:mod:`executor_proc.step.draft_graphs`)."""
        self.spec = spec
        if spec is not None and self.mixed is not None:  # a hidden row per sampled row and per speculative position
            self.mixed = self._mixed_graphs(self.mixed.token_buckets[-1], self.tables.num_slots * spec.values_per_slot)
        # a rank's lazy captures would need every rank's at once: tensor-parallel steps keep the mixed-step path
        if spec is not None and spec.draft is None and not self.model.tensor_parallel:
            # as many rows as the decode graphs take, each K + 1 positions (the memory plan measures the captures)
            max_rows = self.graphs.buckets[-1] if self.graphs is not None else self.tables.num_slots
            max_rows = min(max_rows, self.model.backend.max_decode_rows // (spec.k + 1))
            self.spec_graphs = SpecGraphs(spec, lambda batch: self.model(batch, self.kv_cache), self.model.backend,
                                          self.tables, self.block_size, max_rows, self.capture, self.capturer,
                                          self.device)
        if spec is not None and self.tokens_out is not None:
            self.tokens_out = TokenRing(self.device, (self.tables.num_slots + 1) * spec.values_per_slot)
        if spec is not None and spec.draft is not None and self.mixed is not None:
            spec.draft.graphs = DraftGraphs(spec.draft, self.tables, spec.tokens, self.tables.num_slots, self.device,
                                            self.capture, self.capturer)

    def capture_graphs(self, progress: Optional[Callable[[int, int], None]] = None, modes=None,
                       compile_progress: Optional[Callable[[int, int], None]] = None, compile_first: bool = True,
                       heaviest: bool = False) -> None:
        """Capture every graph, the mixed runner's (the largest) first (start-up; no-op without graphs);
        ``modes``: the sampling modes captured ahead, default the plain two; ``compile_progress``: the compiles
        of their kernels, before the captures (:func:`executor_proc.step.graphs.run_captures`; not with
        ``compile_first=False``: the kernels are compiled already); ``heaviest``: also the largest decode graph
        and head of :data:`executor_proc.step.graphs.HEAVIEST_MODE` (so that the memory plan holds it)."""
        extra = () if modes is None else (modes,)
        runners = [runner for runner in (self.mixed, self.graphs) if runner is not None]
        jobs = [job for runner in runners for job in runner.capture_jobs(*extra)]
        if heaviest:
            jobs += [job for runner in runners for job in runner.heaviest_jobs()]
        if self._draft_graphs is not None:
            jobs += self._draft_graphs.capture_jobs()
        if self.spec_graphs is not None:
            jobs += self.spec_graphs.capture_jobs()
        # A rank's steps hold collectives: not captured into scratch graphs (not yet run on several GPUs).
        run_captures(jobs, self.capturer, progress, compile_first=compile_first and not self.model.tensor_parallel,
                     compile_progress=compile_progress)

    def drop_graphs(self) -> None:
        """Forget every captured graph and their pool (start-up measures them, then captures them again
        against the final KV cache)."""
        for runner in (self.mixed, self.graphs, self.split, self._draft_graphs, self.spec_graphs):
            if runner is not None:
                runner.drop()
        self.capturer.reset()

    @property
    def _draft_graphs(self) -> Optional[DraftGraphs]:
        return self.spec.draft.graphs if self.spec is not None and self.spec.draft is not None else None

    @property
    def num_graphs(self) -> int:
        """CUDA graphs captured so far."""
        return self.capturer.count

    def prepare(self, plan: StepPlan) -> Step:
        """Apply the plan's diffs to the slot tables and put the step's inputs on the device."""
        upload = self.staging.upload()
        self.saved_hidden.forget(plan.releases)
        self.saved_hidden.forget(a.slot for a in plan.admits)
        diff = self.tables.stage(plan, upload)
        sampled_slots = [s for s, sampled in zip(plan.slots, plan.sample) if sampled]
        mode = sampling_mode(self.tables, sampled_slots)
        grammar = self.grammar.stage(plan, sampled_slots) if self.grammar is not None else None
        outputs = StepOutputs()
        if mode.logprobs:
            info = self.tables.info
            outputs.logprob_rows = [(j, info[s].num_logprobs) for j, s in enumerate(sampled_slots)
                                    if info[s].num_logprobs >= 0]
        host = self.host_kv.stage(plan, upload) if self.host_kv is not None else None
        if grammar is not None:  # the mask binds between forward and sampling: no whole-step graph
            mode, outputs.grammar = mode._replace(masked=True), grammar
        spec = self.spec.stage_admits(plan, upload) if self.spec is not None else None
        speculative = bool(plan.num_drafts)  # its rows' positions are the device's: no decode graph
        bucket = self._graph_bucket(plan) if (grammar is None or self.split is not None) and not speculative else None
        if bucket is not None:
            part = upload.add(decode_rows(plan, bucket, self.tables.pad_slot), torch.int64)
            sent = upload.send()
            self._host_copies(plan, host, sent)
            self.tables.apply(diff, sent)
            if spec is not None:
                self.spec.apply(spec, sent)
            self.graphs.inputs[:, :bucket].copy_(sent[part].view(3, bucket))
            return GraphStep(bucket, len(plan.slots), mode, outputs)
        featured = bool(self.tables.featured)
        outputs.prompt = plan_prompt_logprobs(plan, self.tables.info, self.saved_hidden) if featured else None
        if speculative and spec is None and mode == GREEDY and outputs.prompt is None and self.spec_graphs is not None:
            again = self.spec_graphs.again(plan, self.spec.live)
            if again is not None:  # the last speculative graph step's rows: their arrays are on the device already
                outputs.spec = again
                sent = upload.send()
                self._host_copies(plan, host, sent)
                self.tables.apply(diff, sent)
                return SpecDecodeStep(self.spec_graphs.bind(again, None, np.asarray(plan.positions)), outputs)
        rows = plan_rows(plan)
        if speculative:
            spec = outputs.spec = self.spec.stage_rows(plan, rows, spec, self.tables.info)
            if self.spec_graphs is not None and outputs.prompt is None and self.spec_graphs.takes(rows, mode):
                part = self.spec_graphs.stage(spec, rows, upload)
                sent = upload.send()
                self._host_copies(plan, host, sent)
                self.tables.apply(diff, sent)
                self.spec.apply(spec, sent)
                return SpecDecodeStep(self.spec_graphs.bind(spec, sent[part], rows.starts), outputs)
            self.spec.stage_tokens(spec, rows, upload)
        packed_rows = self.spec.mixed_rows(rows, spec) if speculative else rows
        draft = self.spec.draft if self.spec is not None else None
        drafting = None
        if draft is not None:
            drafting = draft.stage(rows, spec.spec_rows if speculative else None,
                                   self.tables.max_blocks * self.block_size, upload)
        # a draft model's pass over prefill chunks reads them from an eager step's batch
        shape = None if drafting is not None and drafting.num_prefill else self._mixed_shape(
            packed_rows, outputs.prompt, spec.num_sampled + spec.num_tokens if speculative else 0)
        if shape is not None:
            packed = self.mixed.pack(packed_rows, shape)
            part = upload.add(self.spec.mixed_pack(packed, shape, spec) if speculative else packed, torch.int64)
        else:
            parts = eager_rows(rows, upload, outputs.prompt, spec.logits_index if speculative else None)
        sent = upload.send()
        self._host_copies(plan, host, sent)
        self.tables.apply(diff, sent)
        if spec is not None:
            self.spec.apply(spec, sent)
        if shape is not None:
            self.mixed.load(sent[part])
            if speculative:
                if drafting is not None:
                    draft.apply(drafting, sent, None)
                    spec.draft = drafting
                self.spec.bind_mixed(spec, mixed_inputs(self.mixed.inputs, shape), self.tables)
            return MixedStep(shape, len(sampled_slots), mode, packed_rows, outputs, spec if speculative else None)
        step = eager_batch(self.tables, self.block_size, plan, sent, parts, mode)
        step.num_sampled, step.outputs = len(sampled_slots), outputs
        if drafting is not None:
            draft.apply(drafting, sent, step.batch)
        if speculative:
            step.spec, spec.draft = spec, drafting
            self.spec.bind(spec, step.batch, self.tables)  # with a draft model: its passes give the drafts
        elif drafting is not None:  # prefill chunks only: the draft's KV takes the prompts
            draft.run(drafting, self.tables)
        if outputs.prompt is not None and outputs.prompt.targets:
            step.prompt_parts = (sent[outputs.prompt.targets_part], sent[outputs.prompt.nums_part])
        return step

    def _host_copies(self, plan: StepPlan, parts, sent: list[torch.Tensor]) -> None:
        """The plan's host-tier copies: onloads before this step's rows; backups beside it (started by
        :meth:`launch`)."""
        if parts is not None:
            self.host_kv.copy(plan.step_id, parts, sent)

    def backups_done_through(self, step_id: int) -> int:
        """For the output thread: the newest step up to ``step_id`` whose backups have all completed."""
        return self.host_kv.backups_done_through(step_id) if self.host_kv is not None else step_id

    def _graph_bucket(self, plan: StepPlan) -> Optional[int]:
        pure_decode = bool(plan.slots) and not any(plan.is_prefill) and all(plan.sample)
        return self.graphs.bucket_for(len(plan.slots)) if self.graphs is not None and pure_decode else None

    def _mixed_shape(self, rows: PlanRows, prompt: Optional[PromptLogprobPlan],
                     min_rows: int = 0) -> Optional[MixedShape]:
        """The mixed runner's bucket for the step, or None: eager (prompt logprobs need every chunk's
        logits, a table-only plan has no rows); ``min_rows``: hidden rows the step reads (speculative positions)."""
        if self.mixed is None or prompt is not None or rows.num_rows == 0 or not rows.decode_rows_first():
            return None
        return self.mixed.shape_for(rows, min_rows)

    def launch(self, step: Step) -> torch.Tensor:
        """Enqueue forward + sampling + last-token update, then the plan's host-tier backups (their launch
        is host time the GPU need not wait for); returns the device tensor of tokens.

        Logprobs (sampled and prompt) land in ``step.outputs`` as device tensors.
        """
        tokens = self._launch_step(step)
        if self.host_kv is not None:
            self.host_kv.start_backups()
        return tokens

    @torch.inference_mode()
    def _launch_step(self, step: Step) -> torch.Tensor:
        if isinstance(step, GraphStep):
            if step.outputs.grammar is not None:  # the decode forward, the masks bound, then the sampling
                return self._keep(step, self.split.run(step.bucket, step.rows, step.mode, self._binder(step)))
            return self._keep(step, self.graphs.run(step.bucket, step.mode).head(step.rows))
        if isinstance(step, SpecDecodeStep):
            return self.spec_graphs.run(step.graph)
        if isinstance(step, MixedStep):
            tokens = self._keep(step, self.mixed.run(step.shape, step.num_sampled, step.mode, step.rows,
                                                     before_head=self._binder(step)))
            if step.spec is None:
                return tokens
            s = step.num_sampled  # the speculative positions' hidden states follow the sampled rows'
            logits = self.model.logits(self.mixed.hidden[s:s + step.spec.num_tokens])
            return self.spec.verify(step.spec, logits, tokens, self.tables, self.model.backend, step.outputs,
                                    counted=step.mode.penalised)
        batch = step.batch
        if batch.num_rows == 0:  # a plan of table diffs only
            return batch.sample_slots
        s = step.num_sampled
        prompt = step.outputs.prompt
        nt = step.spec.num_tokens if step.spec is not None else 0  # speculative rows' logits come last
        if prompt is None:
            logits = self.model(batch, self.kv_cache)  # a prompt chunk that samples nothing still writes KV
            spec_logits = logits[logits.shape[0] - nt:]
        else:  # the prompt positions' LM head runs a slice at a time (prompt_logprobs.LOGITS_ROWS)
            hidden = self.model.final_hidden(batch, self.kv_cache)
            logits = self.model.logits(hidden[:s]) if s else None
            spec_logits = self.model.logits(hidden[hidden.shape[0] - nt:]) if nt else None
            step.outputs.prompt_logprobs = compute_prompt_logprobs(
                self.model.backend, lambda a, b: hidden[s + a:s + b], self.model.logits, prompt, self.saved_hidden,
                *(step.prompt_parts or (None, None)))
        if s == 0:
            return batch.sample_slots
        if step.outputs.grammar is not None:
            self.grammar.bind(step.outputs.grammar)
        sampled = sample_rows(self.model.backend, logits[:s], self.tables, batch.sample_slots,
                              step.sample_positions, step.mode)
        tokens = self._keep(step, sampled)
        if nt:  # after sample_rows: the speculative rows' last_token is the verify's
            tokens = self.spec.verify(step.spec, spec_logits, tokens, self.tables, self.model.backend, step.outputs,
                                      counted=step.mode.penalised)
        return tokens

    def _binder(self, step: Step) -> Optional[Callable[[], None]]:
        """What binds the step's grammar masks before its sampling (None: no constrained row)."""
        rows = step.outputs.grammar
        return None if rows is None else (lambda: self.grammar.bind(rows))

    @staticmethod
    def _keep(step: Step, sampled: Sampled) -> torch.Tensor:
        if sampled.logprob_ids is not None:
            step.outputs.logprobs = (sampled.logprob_ids, sampled.logprobs)
        return sampled.tokens

    def copy_out(self, tokens: torch.Tensor, step: Optional[Step] = None):
        """Start the device->host copy of the tokens (and of ``step``'s logprobs, replaced in its
        ``outputs`` by host tensors); returns (host tensor or list, copy event or None)."""
        outputs = step.outputs if step is not None else None
        if self.tokens_out is None:
            if outputs is not None:
                outputs.logprobs = outputs.logprobs and tuple(t.cpu() for t in outputs.logprobs)
                outputs.prompt_logprobs = outputs.prompt_logprobs and tuple(t.cpu() for t in outputs.prompt_logprobs)
            return tokens, None
        if tokens.numel() == 0 and (outputs is None or outputs.prompt_logprobs is None):
            return [], None
        return self.tokens_out.copy_out(tokens, outputs)
