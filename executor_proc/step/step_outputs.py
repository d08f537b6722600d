"""A step's logprob outputs, from the device tensors to the fields of its StepResult.

After ``launch`` the tensors are on the device; ``Worker.copy_out`` replaces them by
host tensors whose copy the step's copy event covers; the output thread then calls
:meth:`StepOutputs.result_fields` (after that event) for the StepResult's
``logprob_rows``/``logprobs`` and ``prompt_logprob_rows``/``prompt_logprobs``.
Each row's top ids and logprobs are cut to the n its request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from executor_proc.step.prompt_logprobs import PromptLogprobPlan
from ipc.protocol import TokenLogprobs


def _token_logprobs(ids: list, lps: list, n: int) -> TokenLogprobs:
    """One row of the fixed ``[.., 21]`` layout: column 0 the token's rank and logprob, then the top n."""
    return TokenLogprobs(lps[0], ids[1:1 + n], lps[1:1 + n], ids[0])


@dataclass
class StepOutputs:
    """What a step returns besides its tokens (empty for a step whose rows ask for nothing)."""

    logprob_rows: list[tuple[int, int]] = field(default_factory=list)  # (sampled row, n) of rows that asked
    prompt: Optional[PromptLogprobPlan] = None
    logprobs: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # ids, logprobs [S, 21]
    prompt_logprobs: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # ids, logprobs [M, 21]
    # The step's constrained rows (executor_proc/step/grammar.py): the output thread advances their matchers.
    grammar: Optional[object] = None
    # The step's speculative rows (executor_proc/step/speculate.py SpecStep): they cut its token list.
    spec: Optional[object] = None

    def result_fields(self) -> dict:
        """StepResult keyword arguments (read the host tensors: only once the copy has completed)."""
        fields: dict = {}
        if self.grammar is not None:
            fields["grammar_rows"], fields["grammar_wait_s"] = len(self.grammar.rows), self.grammar.wait_s
            if self.grammar.failed:
                fields["grammar_failed_rows"] = [r for r, _ in self.grammar.failed]
                fields["grammar_errors"] = [e for _, e in self.grammar.failed]
        if self.logprob_rows and self.logprobs is not None:
            ids, lps = self.logprobs[0].tolist(), self.logprobs[1].tolist()
            fields["logprob_rows"] = [r for r, _ in self.logprob_rows]
            fields["logprobs"] = [_token_logprobs(ids[r], lps[r], n) for r, n in self.logprob_rows]
            extra = getattr(self.spec, "extra_logprobs", None)
            if extra is not None:  # speculative rows' further tokens, after the sampled rows
                s = self.spec.num_sampled
                fields["spec_logprobs"] = [_token_logprobs(ids[s + i], lps[s + i], max(n, 0))
                                           for i, n in enumerate(extra)]
        if self.prompt is not None and self.prompt.rows and self.prompt_logprobs is not None:
            ids, lps = self.prompt_logprobs[0].tolist(), self.prompt_logprobs[1].tolist()
            order = self.prompt.order or range(len(ids))  # the input row of each reported position
            rows, values, k = [], [], 0
            for r in self.prompt.rows:
                rows.append((r.row, r.first))
                values.append([_token_logprobs(ids[j], lps[j], r.n) for j in order[k:k + r.count]])
                k += r.count
            fields["prompt_logprob_rows"] = rows
            fields["prompt_logprobs"] = values
        return fields
