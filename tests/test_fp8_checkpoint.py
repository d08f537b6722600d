"""FP8 checkpoints (compressed-tensors float-quantized, quant_method fp8): detected from config.json, read as they
are (e4m3 values and scales bit for bit), sharded with their weights, and refused by name when not supported."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from executor_proc.model.fp8_checkpoint import fp8_scheme
from executor_proc.model.loader import load_model
from kernels.fp8 import FP8, Fp8Weight, quantize_weight
from tests.test_gpu_fastpath import write_config

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _built(model_dir: str, **kw):
    from executor_proc.build import build_worker
    from ipc.config import ExecutorConfig

    kw.setdefault("kernels", "torch")
    kw.setdefault("device", "cpu")
    return build_worker(ExecutorConfig(model=model_dir, load_format="hf", num_slots=2, num_kv_blocks=16, block_size=4,
                                       **kw)).worker


def _compressed_tensors(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                                "dynamic": False}}}}


def _write_checkpoint(folder, quantization: dict, per_tensor: bool, state: dict = None, float_modules=(),
                      extra: dict = None, **shape) -> tuple[str, str]:
    """A tiny model's random weights (``state``, HF names, beside ``folder``/config.json; default: a dense model's)
    as an FP8 checkpoint (``folder``/fp8; the ``float_modules`` left as they are, ``extra`` tensors added) and the
    same values dequantized as a float32 one (``folder``/ref); returns both folders.  ``shape``: write_config's."""
    if state is None:
        model, _ = load_model(write_config(folder, **shape), "dummy", "cpu", torch.float32)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
    fp8, ref = dict(state), dict(state)
    for name, w in state.items():
        if name.split(".")[-2] not in _PROJ or not name.endswith(".weight") or name[:-7] in float_modules:
            continue  # Qwen2's q|k|v biases stay float, and what the config ignores
        if per_tensor:  # one scale for the projection
            scale = w.abs().max().float() / 448
            q = Fp8Weight((w / scale).clamp(-448, 448).to(FP8), scale.expand(w.shape[0]).contiguous(), w.dtype)
        else:
            q = quantize_weight(w)
        fp8[name] = q.data
        fp8[name + "_scale"] = q.scale[0].reshape(()) if per_tensor else q.scale[:, None]
        fp8[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])
        ref[name] = q.dequantize()
    fp8.update(extra or {})
    config = json.loads((folder / "config.json").read_text())
    out = []
    for sub, tensors, extra in (("fp8", fp8, {"quantization_config": quantization}), ("ref", ref, {})):
        d = folder / sub
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, str(d / "model.safetensors"))
        out.append(str(d))
    return out[0], out[1]


@pytest.mark.parametrize("quantization,per_tensor", [(_compressed_tensors("channel"), False),
                                                     ({"quant_method": "fp8", "activation_scheme": "static"}, True)])
def test_fp8_checkpoint_loads_as_it_is(tmp_path, quantization, per_tensor):
    from tests.forward_batch import all_logits, build_forward_batch

    fp8_dir, ref_dir = _write_checkpoint(tmp_path, quantization, per_tensor)
    ckpt = _built(fp8_dir)
    layer = ckpt.model.model.layers[1]
    written = load_model(fp8_dir, "hf", "cpu", torch.float32)[0]  # as loaded, before the backend
    assert isinstance(layer.mlp.gate_up.weight, Fp8Weight) and layer.self_attn.k_proj.weight.dtype == FP8
    assert ckpt.model.lm_head.weight.dtype == torch.float32
    from safetensors import safe_open
    with safe_open(f"{fp8_dir}/model.safetensors", "pt") as f:  # the checkpoint's values and scales, bit for bit
        q = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        s = f.get_tensor("model.layers.1.self_attn.k_proj.weight_scale")
    got = written.model.layers[1].self_attn.k_proj
    assert torch.equal(got.weight.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got.weight_scale, s.float().reshape(-1).expand(q.shape[0]))
    # The same values, dequantized and quantized at load: per-channel scales come back exactly; per-tensor ones
    # are the checkpoint's own (coarser) scales, so only the per-channel logits match bit for bit.
    ref, plain = _built(ref_dir, quantization="fp8"), _built(ref_dir)
    batch = build_forward_batch([(0, list(range(3, 15)), 0, True)], [[1, 2, 3, 4]], 4, "cpu")
    batch = dataclasses.replace(batch, block_tables=batch.block_tables.int())
    a, b, c = (all_logits(w.model, batch, w.kv_cache) for w in (ckpt, ref, plain))
    if not per_tensor:
        assert torch.equal(a, b)
        tri = _built(fp8_dir, kernels="triton", cuda_graphs=False)  # the norms stay: folding would re-quantize
        assert not tri.model.backend.norms_folded
        norm = written.model.layers[0].input_layernorm.weight
        assert torch.equal(tri.model.model.layers[0].input_layernorm.weight, norm)
    assert (a - c).abs().max() < 0.05 * c.abs().max()  # activations rounded to e4m3 (12 rows: W8A8)


def test_moe_fp8_checkpoint_loads_as_it_is(tmp_path):
    """A Qwen2-MoE FP8 checkpoint (per channel: attention, every routed expert's projections, the shared
    expert's; the router and the shared expert's gate float, as published ones leave them): each expert's e4m3
    values and scales land in its rows of the stacks bit for bit, and the logits equal those of the same values
    dequantized and quantized at load."""
    from safetensors.torch import load_file

    from tests.forward_batch import all_logits, build_forward_batch
    from tests.test_moe import save_family

    save_family("qwen2_moe", tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    fp8_dir, ref_dir = _write_checkpoint(tmp_path, _compressed_tensors("channel"), False, state)
    ckpt = _built(fp8_dir)
    block = load_model(fp8_dir, "hf", "cpu", torch.float32)[0].model.layers[1].mlp  # as loaded, before the backend
    w13, w2 = block.expert_stacks()
    assert w13.data.dtype == FP8 and block.gate.weight.dtype == torch.float32
    from safetensors import safe_open
    with safe_open(f"{fp8_dir}/model.safetensors", "pt") as f:
        up = f.get_tensor("model.layers.1.mlp.experts.2.up_proj.weight")
        scale = f.get_tensor("model.layers.1.mlp.experts.2.up_proj.weight_scale")
    inter = block.intermediate_size
    assert torch.equal(w13.data[2, inter:].view(torch.uint8), up.view(torch.uint8))
    assert torch.equal(w13.scale[2, inter:], scale.float().reshape(-1))
    ref = _built(ref_dir, quantization="fp8")
    batch = build_forward_batch([(0, list(range(3, 15)), 0, True)], [[1, 2, 3, 4]], 4, "cpu")
    batch = dataclasses.replace(batch, block_tables=batch.block_tables.int())
    assert torch.equal(all_logits(ckpt.model, batch, ckpt.kv_cache), all_logits(ref.model, batch, ref.kv_cache))


def test_unsupported_quantization_configs_are_refused_by_name():
    assert fp8_scheme({}) is None
    assert fp8_scheme({"quantization_config": _compressed_tensors("tensor")}) == "compressed-tensors"
    cases = [({"quant_method": "fp8", "weight_block_size": [128, 128]}, "weight_block_size"),
             ({"quant_method": "gptq"}, "quant_method 'gptq'"),
             ({**_compressed_tensors("channel"), "format": "pack-quantized"}, "format 'pack-quantized'"),
             ({**_compressed_tensors("group")}, "weights.strategy 'group'")]
    for q, words in cases:
        with pytest.raises(ValueError, match=words):
            fp8_scheme({"quantization_config": q})


def test_scales_shard_with_their_weights():
    from executor_proc.model.config import ModelConfig
    from executor_proc.parallel.sharding import Shards

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4,
                      max_position_embeddings=512)
    shards = Shards(cfg, 1, 2)
    rows = torch.arange(96.0)[:, None]
    assert torch.equal(shards.take("model.layers.0.mlp.up_proj.weight_scale", rows), rows[48:])
    assert torch.equal(shards.take("model.layers.0.mlp.down_proj.weight_scale", rows[:64]), rows[:64])
    assert torch.equal(shards.take("model.layers.0.self_attn.q_proj.weight_scale", torch.tensor(0.5)),
                       torch.tensor(0.5))
    assert torch.equal(shards.take("model.layers.0.self_attn.o_proj.input_scale", torch.tensor([0.5])),
                       torch.tensor([0.5]))
    assert torch.equal(shards.take("model.layers.1.self_attn.k_scale", torch.tensor([0.5, 0.25])),
                       torch.tensor([0.5, 0.25]))  # a KV-cache scale whole, on every rank
    from executor_proc.model.moe_config import MoEConfig

    moe = dataclasses.replace(cfg, architecture="MixtralForCausalLM", moe=MoEConfig(4, 2, 96, True))
    name = "model.layers.0.block_sparse_moe.experts.3.w1.weight_scale"  # a whole expert's 0-dim (per-tensor) scale
    experts = Shards(moe, 1, 2, expert_parallel=True)
    assert experts.holds(name) and torch.equal(experts.take(name, torch.tensor(0.5)), torch.tensor(0.5))


def _logits(worker, tokens: int = 4, device: str = "cpu"):
    from tests.forward_batch import all_logits, build_forward_batch

    batch = build_forward_batch([(0, list(range(3, 3 + tokens)), 0, True)], [[1, 2, 3, 4]], 4, device)
    batch = dataclasses.replace(batch, block_tables=batch.block_tables.int())
    return all_logits(worker.model, batch, worker.kv_cache)


@pytest.mark.parametrize("names", [("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale"),
                                   ("kv_scale",)])
def test_kv_cache_scales_of_the_checkpoint_serve_an_fp8_cache(tmp_path, names):
    """A checkpoint's KV-cache scales (compressed-tensors' ``kv_cache_scheme`` names, the older output scales,
    AutoFP8's one ``kv_scale``) load, and ``--kv-cache-dtype fp8`` stores under them instead of calibrating;
    without that flag they are kept and unused."""
    values = {(i, n): torch.tensor(0.01 * (i + 1) * (j + 2)) for i in range(2) for j, n in enumerate(names)}
    extra = {f"model.layers.{i}.self_attn.{n}": v for (i, n), v in values.items()}
    q = {**_compressed_tensors("channel"), "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                                "dynamic": False, "symmetric": True}}
    fp8_dir, _ = _write_checkpoint(tmp_path, q, False, extra=extra)
    worker = _built(fp8_dir, kv_cache_dtype="fp8")
    want = [(float(values[i, names[0]]), float(values[i, names[-1]])) for i in range(2)]
    assert worker.model.checkpoint_kv_scales == want
    assert [worker.kv_cache.layer_scale(i) for i in range(2)] == want
    assert torch.isfinite(_logits(worker)).all()
    assert _built(fp8_dir).model.checkpoint_kv_scales == want


def test_kv_cache_scales_of_some_layers_only_are_refused(tmp_path):
    fp8_dir, _ = _write_checkpoint(tmp_path, _compressed_tensors("channel"), False,
                                   extra={"model.layers.0.self_attn.k_scale": torch.tensor(0.1),
                                          "model.layers.0.self_attn.v_scale": torch.tensor(0.1)})
    with pytest.raises(ValueError, match=r"KV cache scales for some layers only: missing "
                                         r"model\.layers\.1\.self_attn\.k_scale"):
        load_model(fp8_dir, "hf", "cpu", torch.float32)


@pytest.mark.parametrize("bad,words", [(float("nan"), "holds a NaN or an infinity"),
                                       (float("inf"), "holds a NaN or an infinity"),
                                       (0.0, "holds a value <= 0"), (-0.5, "holds a value <= 0"),
                                       ("int", "a scale must be a float tensor, got torch.int32"),
                                       ("short", "31 values for 32 rows")])
def test_bad_scales_are_refused_naming_the_tensor(tmp_path, bad, words):
    """NaN, infinite, zero or negative scales, integer ones, or the wrong count: refused, naming the tensor (a NaN
    scale used to load and give silently wrong logits)."""
    fp8_dir, _ = _write_checkpoint(tmp_path, _compressed_tensors("channel"), False)
    from safetensors.torch import load_file

    state = load_file(f"{fp8_dir}/model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    scale = state[name].clone()
    if bad == "int":
        scale = scale.int()
    elif bad == "short":
        scale = scale[:31]
    else:
        scale[3] = bad
    state[name] = scale
    save_file(state, f"{fp8_dir}/model.safetensors")
    with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: {words}"):
        load_model(fp8_dir, "hf", "cpu", torch.float32)


@pytest.mark.parametrize("ignore", [["lm_head", "model.layers.0.mlp.down_proj"],
                                    ["lm_head", r"re:model\.layers\.1\.self_attn\.[qkv]_proj"]])
def test_projections_the_config_ignores_load_in_float(tmp_path, ignore):
    """``ignore`` (names, or ``re:`` patterns): those projections stay float, the rest FP8, and the logits equal
    those of the checkpoint's values dequantized (4 tokens: the FP8 weights' sums are exact in float32)."""
    floats = {"model.layers.0.mlp.down_proj"} if "down" in ignore[1] else {
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv"}
    fp8_dir, ref_dir = _write_checkpoint(tmp_path, {**_compressed_tensors("channel"), "ignore": ignore}, False,
                                         float_modules=floats)
    worker = _built(fp8_dir)
    layers = worker.model.model.layers
    fused = layers[0].mlp.down if "down" in ignore[1] else layers[1].self_attn.qkv
    assert fused.weight.dtype == torch.float32 and isinstance(layers[1].mlp.gate_up.weight, Fp8Weight)
    want = _logits(_built(ref_dir))
    assert torch.allclose(_logits(worker), want, rtol=0, atol=1e-5)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels on both kinds (the interpreter on a CPU)
    triton = _built(fp8_dir, kernels="triton", cuda_graphs=False, device=device, dtype="float32")
    assert torch.allclose(_logits(triton, device=device).cpu(), want, rtol=0, atol=1e-4)


def test_part_of_a_fused_projection_ignored_is_refused(tmp_path):
    q = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["model.layers.0.self_attn.q_proj"]}
    fp8_dir, _ = _write_checkpoint(tmp_path, q, False, float_modules={"model.layers.0.self_attn.q_proj"})
    with pytest.raises(ValueError, match="ignores model.layers.0.self_attn.q_proj but not "
                                         "model.layers.0.self_attn.k_proj: the parts of a fused projection"):
        load_model(fp8_dir, "hf", "cpu", torch.float32)


def test_an_fp8_lm_head_is_refused_by_name(tmp_path):
    head = quantize_weight(torch.randn(97, 64))
    fp8_dir, _ = _write_checkpoint(tmp_path, _compressed_tensors("channel"), False,
                                   extra={"lm_head.weight": head.data, "lm_head.weight_scale": head.scale[:, None]})
    with pytest.raises(ValueError, match="lm_head.weight_scale: the checkpoint's LM head is FP8"):
        load_model(fp8_dir, "hf", "cpu", torch.float32)


@pytest.mark.parametrize("q,words", [("fp8", "quantization_config: an object expected, got str"),
                                     ({**_compressed_tensors("channel"), "config_groups": [{}]},
                                      "quantization_config.config_groups: an object expected, got list"),
                                     ({**_compressed_tensors("channel"), "config_groups": {"g": None}},
                                      "quantization_config.config_groups.g: an object expected"),
                                     ({**_compressed_tensors("channel"), "ignore": "lm_head"},
                                      "quantization_config.ignore: a list of module names expected"),
                                     ({"quant_method": "fp8", "ignored_layers": ["re:("]},
                                      "is not a regular expression")])
def test_malformed_quantization_configs_are_refused_by_field(q, words):
    with pytest.raises(ValueError, match=words):
        fp8_scheme({"quantization_config": q})


def test_heads_the_attention_kernels_cannot_take_are_refused():
    from executor_proc.backends.select import check_head_dim

    check_head_dim(16, "fp8", torch.device("cpu"))  # the interpreter takes them
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs a head_dim of 32 or more on the GPU, this "
                                         "model's is 16"):
        check_head_dim(16, "fp8", torch.device("cuda"))
    with pytest.raises(ValueError, match="head_dim 512: the attention kernels take heads of up to 256 values"):
        check_head_dim(512, "auto", torch.device("cpu"))


def test_an_fp8_checkpoint_refuses_batch_invariance_and_says_fp8_at_start(tmp_path):
    from executor_proc.build import build_worker
    from executor_proc.memory_plan import StartupRefused
    from ipc.config import ExecutorConfig

    fp8_dir, ref_dir = _write_checkpoint(tmp_path, _compressed_tensors("channel"), False)
    cfg = dict(model=fp8_dir, load_format="hf", device="cpu", num_slots=2, num_kv_blocks=16, block_size=4)
    with pytest.raises(StartupRefused, match="an FP8 checkpoint cannot run --batch-invariant"):
        build_worker(ExecutorConfig(**cfg, kernels="triton", cuda_graphs=False, batch_invariant=True))
    assert build_worker(ExecutorConfig(**cfg, kernels="torch")).fp8_weights
    assert not build_worker(ExecutorConfig(**{**cfg, "model": ref_dir}, kernels="torch")).fp8_weights


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the tuner")
def test_fp8_checkpoint_with_float_projections_and_kv_scales_gpu(tmp_path):
    """On the GPU path (tuned kernels, CUDA graphs, an FP8 cache under the checkpoint's scales), a checkpoint that
    leaves one projection float: replayed steps give the eager steps' tokens, and a prefill's logits are the CPU
    torch path's for the same checkpoint."""
    from executor_proc.build import build_worker
    from ipc.config import ExecutorConfig
    from tests.test_gpu_fastpath import run_plans, scenario

    q = {**_compressed_tensors("channel"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}
    extra = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.05) for i in range(2) for w in "kv"}
    fp8_dir, _ = _write_checkpoint(tmp_path, q, False, float_modules={"model.layers.0.mlp.down_proj"}, extra=extra,
                                   heads=2, kv_heads=1)  # heads of 32 values: an FP8 cache's least on the GPU
    cfg = dict(model=fp8_dir, load_format="hf", num_slots=6, num_kv_blocks=256, block_size=4, cuda_graph_max_batch=4,
               kv_cache_dtype="fp8", dtype="float32")
    graphs = build_worker(ExecutorConfig(**cfg, device="cuda", kernels="triton")).worker
    eager = build_worker(ExecutorConfig(**cfg, device="cuda", kernels="triton", cuda_graphs=False)).worker
    eager.model.backend.use_choices_of(graphs.model.backend)
    layers = graphs.model.model.layers
    assert not isinstance(layers[0].mlp.down.weight, Fp8Weight) and isinstance(layers[1].mlp.down.weight, Fp8Weight)
    assert graphs.kv_cache.layer_scale(1) == (float(torch.tensor(0.05)),) * 2
    plans = scenario(vocab=97, steps=10, alone_from=8)
    tokens = [t for _, t in run_plans(graphs, plans)]
    assert tokens == [t for _, t in run_plans(eager, plans)]
    cpu = build_worker(ExecutorConfig(**cfg, device="cpu", kernels="torch")).worker
    want = _logits(cpu)
    got = _logits(eager, device="cuda").cpu()
    assert (got - want).abs().max() < 0.02 * want.abs().max()
