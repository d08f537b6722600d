"""Tensor parallelism: Megatron sharding of the Llama decoder over ranks that all run the same plan.

- :mod:`executor_proc.parallel.sharding`: which part of every weight a rank holds (pure, no torch.distributed);
- :mod:`executor_proc.parallel.group`: the torch.distributed group (NCCL on CUDA, gloo on the CPU);
- :mod:`executor_proc.parallel.one_shot`: the one-shot all-reduce of small tensors over peer-to-peer buffers (CUDA);
- :mod:`executor_proc.parallel.model`: the sharded model (all-reduces, vocabulary-parallel embedding and LM head).
"""
