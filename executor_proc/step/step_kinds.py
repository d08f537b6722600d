"""The four kinds of step a plan becomes (:meth:`executor_proc.step.worker.Worker.prepare`), each holding what its
launch needs: a pure-decode step replayed from the decode graphs, a step with prefill chunks through the mixed-step
graphs, a step of greedy speculative rows through the speculative graphs, and an eager forward for the rest."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from executor_proc.step.batch import ForwardBatch
from executor_proc.step.mixed_step import MixedShape
from executor_proc.step.plan_rows import PlanRows
from executor_proc.step.sample import SamplingMode
from executor_proc.step.spec_graphs import SpecGraph
from executor_proc.step.speculate import SpecStep
from executor_proc.step.step_outputs import StepOutputs

__all__ = ["EagerStep", "GraphStep", "MixedStep", "SpecDecodeStep", "Step"]


@dataclass
class GraphStep:
    """A pure-decode step whose inputs are in the graph runner's buffer: ``rows`` real rows of ``bucket``."""

    bucket: int
    rows: int
    mode: SamplingMode
    outputs: StepOutputs = field(default_factory=StepOutputs)


@dataclass
class MixedStep:
    """A step with prefill chunks whose packed inputs are in the mixed runner's buffer, padded to ``shape``."""

    shape: MixedShape
    num_sampled: int
    mode: SamplingMode
    rows: PlanRows  # the real rows (an eager call of the runner on the torch backend attends them)
    outputs: StepOutputs = field(default_factory=StepOutputs)
    spec: Optional[SpecStep] = None  # speculative rows: their positions' hidden states follow the sampled rows'


@dataclass
class EagerStep:
    batch: ForwardBatch
    sample_positions: torch.Tensor  # [S] position of each sampled token: its row's context length
    mode: SamplingMode
    num_sampled: int = 0
    prompt_parts: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # prompt-logprob targets, top-n
    outputs: StepOutputs = field(default_factory=StepOutputs)
    spec: Optional[SpecStep] = None  # speculative rows (executor_proc/step/speculate.py)


@dataclass
class SpecDecodeStep:
    """A step of greedy decode rows, speculative or plain, its positions run as decode rows in one graph."""

    graph: SpecGraph
    outputs: StepOutputs


Step = Union[GraphStep, MixedStep, EagerStep, SpecDecodeStep]
