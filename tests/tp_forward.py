"""Run the model directly as tensor-parallel ranks (gloo on the CPU) and compare its logits with one process.

Tests start ``python -m tests.tp_forward RANK SIZE FORMAT MODELS OUT [LAYOUTS]`` once per rank; rank 0 writes
the logits of a fixed workload (a mixed prefill of two rows, then a decode step of both) to ``OUT`` (.npz, one
array per model: MODELS is one path, or several joined by ``os.pathsep``, run in turn by the one group);
LAYOUTS has a letter per model: ``t`` tensor parallel (the default), ``e`` its MoE layers expert parallel.
:func:`logits` runs the same workload in one process (``tp=None``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import numpy as np
import torch

from executor_proc.model.kv_cache import KVCache
from executor_proc.model.loader import load_model
from tests.forward_batch import all_logits, build_forward_batch
from tests.server_proc import ROOT, python_path

BLOCK_SIZE = 4


def logits(model_path: str, load_format: str, tp=None, expert_parallel: bool = False) -> np.ndarray:
    """Float32 logits ``[T, vocab]``: every token of a two-row prefill, then both rows' decode step."""
    model, _ = load_model(model_path, load_format, "cpu", torch.float32, tp=tp, expert_parallel=expert_parallel)
    vocab = model.full_config.vocab_size if tp is not None else model.config.vocab_size
    kv = KVCache(model.config, 16, BLOCK_SIZE, "cpu", torch.float32)
    tables = [[3, 0, 5], [1, 2]]
    first = [(0, [(7 * i + 1) % vocab for i in range(9)], 0, True), (1, [vocab - 1, 2, 5], 0, True)]
    prefill = all_logits(model, build_forward_batch(first, tables, BLOCK_SIZE, "cpu"), kv)
    decode = model(build_forward_batch([(0, [4], 9, True), (1, [vocab - 2], 3, True)], tables, BLOCK_SIZE, "cpu"), kv)
    return torch.cat([prefill, decode]).numpy()


def write_gguf(hf_folder: str, path: str) -> str:
    """The safetensors model at ``hf_folder`` as a float32 llama GGUF file (q/k rows permuted as llama.cpp does)."""
    from gguf import GGUFWriter

    from executor_proc.model.config import ModelConfig
    from executor_proc.model.gguf_file import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_PARTS
    from executor_proc.model.loader import hf_weights

    cfg = ModelConfig.from_pretrained(hf_folder)
    names = {hf: g for g, hf in _GGUF_GLOBAL_NAMES.items()}
    parts = {hf: g for g, hf in _GGUF_LAYER_PARTS.items()}
    w = GGUFWriter(path, "llama")
    for key, value in (("embedding_length", cfg.hidden_size), ("feed_forward_length", cfg.intermediate_size),
                       ("block_count", cfg.num_layers), ("head_count", cfg.num_heads),
                       ("head_count_kv", cfg.num_kv_heads), ("context_length", cfg.max_position_embeddings),
                       ("vocab_size", cfg.vocab_size)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    for name, t in hf_weights(hf_folder)[1]:
        a = t.float().numpy()
        if name.startswith("model.layers."):
            layer, module, kind = name.split(".")[2], ".".join(name.split(".")[3:-1]), name.split(".")[-1]
            heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}.get(module)
            if heads:  # llama.cpp interleaves each head's rotary halves
                a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
            name = f"blk.{layer}.{parts[module]}.{kind}"
        else:
            name = names[name]
        w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def run_ranks(size: int, load_format: str, model_path: str, out: str, timeout: float = 300) -> np.ndarray:
    """Start ``size`` rank processes, wait for all, return rank 0's logits (raise with their output if one fails)."""
    return run_ranks_each(size, load_format, [model_path], out, timeout)[0]


def run_ranks_each(size: int, load_format: str, model_paths: list[str], out: str,
                   timeout: float = 300, expert_parallel: Sequence[bool] = ()) -> list[np.ndarray]:
    """:func:`run_ranks` for several models in turn, in one group (its processes start once): their logits;
    ``expert_parallel[i]``: model i's MoE layers hold whole experts per rank (none when empty)."""
    env = dict(os.environ, PYTHONPATH=python_path())
    models = os.pathsep.join(model_paths)
    layouts = "".join("e" if ep else "t" for ep in expert_parallel) or "t" * len(model_paths)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_forward", str(r), str(size), load_format, models,
                               out, layouts], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for r in range(size)]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        raise RuntimeError("a rank failed:\n" + "\n".join(outputs))
    with np.load(out) as saved:
        return [saved[f"arr_{i}"] for i in range(len(model_paths))]


def main(argv: list[str]) -> None:
    rank, size, load_format, models, out = int(argv[0]), int(argv[1]), argv[2], argv[3], argv[4]
    paths = models.split(os.pathsep)
    layouts = argv[5] if len(argv) > 5 else "t" * len(paths)
    from executor_proc.parallel.group import init_group

    torch.set_num_threads(1)
    tp = init_group(f"file://{os.path.abspath(out)}.store", rank, size, torch.device("cpu"))
    results = [logits(path, load_format, tp, layout == "e") for path, layout in zip(paths, layouts, strict=True)]
    if rank == 0:
        with open(out, "wb") as f:  # np.savez would add .npz to the name
            np.savez(f, *results)
    tp.barrier()
    tp.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1:])
