"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) against HF transformers,
the routing by hand, and the fused MoE kernels (Triton's interpreter on the CPU) against the torch reference.

Kept small: every test here runs on the CPU in a few seconds altogether.
"""

from __future__ import annotations

import copy
import math
import os
import re

import pytest
import torch
import transformers

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from executor_proc.backends.torch_backend import TorchBackend  # noqa: E402
from executor_proc.backends.triton_backend import TritonBackend  # noqa: E402
from executor_proc.model.config import ModelConfig  # noqa: E402
from executor_proc.model.llama import CausalLM, build_model  # noqa: E402
from executor_proc.model.loader import load_model  # noqa: E402
from executor_proc.model.moe import MoEBlock, checkpoint_name, mixtral_name  # noqa: E402
from kernels.moe import (SMALL_CONFIG, MoEConfig, SmallConfig, align_by_expert, fused_moe_grouped,  # noqa: E402
                         fused_moe_small)
from kernels.fp8 import quantize_weight  # noqa: E402
from kernels.moe_align import MAX_PAIRS  # noqa: E402
from kernels.moe_route import norm_route, route  # noqa: E402
from kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kernels.moe_ref import align_by_expert_ref, moe_ref, route_held, route_ref  # noqa: E402
from tests.test_model_parity import RTOL, SHAPE, VOCAB, PagedRun, hf_logits, random_tokens, rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {  # HF's config and model classes by name: transformers imports a family's modules when one is used
    # layer 1 dense (mlp_only_layers): a model of MoE and MLP layers
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(MOE, num_experts=4, norm_topk_prob=True, mlp_only_layers=[1], head_dim=32)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(MOE, num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=48)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}


def save_family(name: str, folder, **changes) -> torch.nn.Module:
    """The family's tiny HF model (``changes``: config fields over SHAPE and its own), random weights scaled to
    keep activations O(1), saved as safetensors in ``folder``."""
    config_name, model_name, extra = FAMILIES[name]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(0)
    hf = model_cls(config_cls(**(SHAPE | extra | changes))).float().eval()
    with torch.no_grad():
        for param_name, p in hf.named_parameters():
            if "norm" in param_name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    hf.save_pretrained(folder)
    return hf


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (name, HF model, our model, our config, folder): random weights saved as safetensors, read back
    (each family built once per module)."""
    cache = {}

    def build(name: str):
        if name not in cache:
            folder = tmp_path_factory.mktemp(name)
            hf = save_family(name, folder)
            model, config = load_model(str(folder), "hf", "cpu", torch.float32)
            cache[name] = (name, hf, model, config, str(folder))
        return cache[name]

    return build


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, built):
    return built(request.param)[:4]


def test_logits_match_hf(family):
    """A prefill step of three rows, then a decode step: every token's logits within 1e-4 of HF's."""
    name, hf, model, config = family
    assert config.moe is not None and config.moe.num_experts == 4 and config.moe.top_k == 2
    sparse = [isinstance(layer.mlp, MoEBlock) for layer in model.model.layers]
    assert sparse == ([True, False] if name == "qwen3_moe" else [True, True])
    assert (model.model.layers[0].mlp.shared_expert is not None) == (name == "qwen2_moe")
    prompts = {0: random_tokens(7, 1), 1: random_tokens(1, 2), 2: random_tokens(12, 3)}
    run = PagedRun(model, config, num_rows=3, block_size=4, max_len=16)
    first = run.step(prompts)
    second = run.step({r: random_tokens(1, 20 + r) for r in prompts})
    for r in prompts:
        assert rel_err(torch.cat([first[r], second[r]]), hf_logits(hf, run.tokens[r])) < RTOL
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


def test_transformers_5_stacked_experts_load_as_the_per_expert_tensors(built, tmp_path):
    """transformers 5's own layout (``save_original_format=False``: ``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``) loads into the same stacks as one tensor per expert, whole and as a tensor-
    and an expert-parallel rank's slices."""
    from executor_proc.model.loader import hf_weights
    from executor_proc.parallel.sharding import Shards

    for name in FAMILIES:
        _, hf, model, config, folder = built(name)
        stacked = tmp_path / name
        hf.save_pretrained(stacked, save_original_format=False)
        names = [n for n, _ in hf_weights(str(stacked))[1]]
        assert any(n.endswith("mlp.experts.gate_up_proj") for n in names), names  # the layout under test
        again, _ = load_model(str(stacked), "hf", "cpu", torch.float32)
        for key, value in model.state_dict().items():
            assert torch.equal(again.state_dict()[key], value), (name, key)
        for expert_parallel in (False, True):
            shards = Shards(config, 1, 2, expert_parallel)
            per_expert = {checkpoint_name(n): t for n, t in hf_weights(folder, shards)[1]}
            for n, t in hf_weights(str(stacked), shards)[1]:
                if checkpoint_name(n).endswith(".mlp.w13"):
                    layer = checkpoint_name(n)[:-len("w13")]
                    experts = range(config.moe.num_experts) if shards.experts is None else shards.experts
                    want = torch.stack([torch.cat([per_expert[f"{layer}experts.{e}.gate_proj.weight"],
                                                   per_expert[f"{layer}experts.{e}.up_proj.weight"]])
                                        for e in experts])
                    assert torch.equal(t, want), (name, n, expert_parallel)
    # a misshapen stack is named once, as the mismatch, not as its experts' tensors missing
    weights = [(n, t[:, :-2] if n.endswith("experts.gate_up_proj") else t) for n, t in hf_weights(str(stacked))[1]]
    mismatch = r"shape or dtype mismatches: model\.layers\.\d\.mlp\.experts\.gate_up_proj"
    with pytest.raises(ValueError, match=mismatch) as e:
        build_model(config, "cpu", torch.float32).load_weights(weights)
    assert "missing" not in str(e.value)
    # a stack left out is named as the layout names it, not as its experts' tensors
    weights = [(n, t) for n, t in hf_weights(str(stacked))[1] if not n.endswith("layers.1.mlp.experts.down_proj")]
    with pytest.raises(ValueError, match=r"missing 1 weights: model\.layers\.1\.mlp\.experts\.down_proj$"):
        build_model(config, "cpu", torch.float32).load_weights(weights)


def test_folded_norms_match_hf(family):
    """``fold_norms`` (as the CUDA path runs it) folds the input norms and the dense layers' post-attention
    norms; an MoE layer keeps its own (router, experts and shared expert all read the normalised input)."""
    _, hf, model, config = family
    folded = copy.deepcopy(model)
    folded.fold_norms()
    for layer in folded.model.layers:
        assert torch.all(layer.input_layernorm.weight == 1)
        assert torch.all(layer.post_attention_layernorm.weight == 1) != isinstance(layer.mlp, MoEBlock)
    prompts = {0: random_tokens(9, 7), 1: random_tokens(4, 8)}
    out = PagedRun(folded, config, num_rows=2, block_size=4, max_len=12).step(prompts)
    for r, toks in prompts.items():
        assert rel_err(out[r], hf_logits(hf, toks)) < RTOL


class FusedMoETorchBackend(TorchBackend):
    """The torch backend with the Triton backend's MoE ops (the norm, router and routing in one launch at 1-4
    tokens, the fused experts): the rest stays torch."""

    batch_invariant = False
    moe_small_choice: dict = {}  # untuned: the default tiles
    moe_grouped_choice: dict = {}
    route_arrivals = torch.zeros(4, dtype=torch.int32)
    moe_front = TritonBackend.moe_front
    moe = TritonBackend.moe


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model's kernels need the interpreter")
def test_fused_kernels_in_the_model_match_hf(built):
    """The Triton MoE ops in the model (Qwen2-MoE: routed and shared experts): 21 tokens (42 pairs: grouped by
    expert), then 3 (the per-pair form, after the one-launch norm and routing)."""
    _, hf, model, config, _ = built("qwen2_moe")
    model.use_backend(FusedMoETorchBackend(model.rope_inv_freq))
    try:
        prompts = {0: random_tokens(7, 4), 1: random_tokens(12, 5), 2: random_tokens(2, 6)}
        run = PagedRun(model, config, num_rows=3, block_size=4, max_len=16)
        first = run.step(prompts)
        second = run.step({r: random_tokens(1, 30 + r) for r in prompts})
    finally:
        model.use_backend(TorchBackend(model.rope_inv_freq))
    for r in prompts:
        assert rel_err(torch.cat([first[r], second[r]]), hf_logits(hf, run.tokens[r])) < RTOL


# --------------------------------------------------------------------------- routing by hand

PLANTED_PROBS = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.05, 0.05, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25]])


def test_planted_routing():
    """Router logits ``log p`` give softmax ``p``: the top-2 experts and their weights are read off ``p``."""
    logits = PLANTED_PROBS.log()
    weights, ids = route_ref(logits, 2, renormalize=False)
    assert ids[:2].tolist() == [[1, 3], [2, 3]]
    assert torch.allclose(weights[:2], torch.tensor([[0.4, 0.3], [0.6, 0.3]]), atol=1e-6)
    weights, ids = route_ref(logits, 2, renormalize=True)  # norm_topk_prob, Mixtral
    assert torch.allclose(weights[:2], torch.tensor([[4 / 7, 3 / 7], [2 / 3, 1 / 3]]), atol=1e-6)
    assert torch.allclose(weights[2], torch.tensor([0.5, 0.5])) and len(set(ids[2].tolist())) == 2
    # the router's logits come in the model dtype; the softmax is float32 whatever they are
    w16, ids16 = route_ref(logits.to(torch.bfloat16), 2, renormalize=True)
    assert w16.dtype == torch.float32 and ids16[:2].tolist() == [[1, 3], [2, 3]]


@pytest.mark.parametrize("tokens,experts,k,renormalize,held", [
    (3, 128, 8, True, None), (5, 60, 4, False, None), (4, 8, 2, True, None), (6, 128, 8, True, range(64, 128)),
    (2, 5, 2, False, range(3, 5))])
def test_route_kernel_matches_torch(tokens, experts, k, renormalize, held):
    """The one-launch routing (:mod:`kernels.moe_route`) against the torch ops: the same experts in the same
    order and the same weights (float32 logits; bfloat16 logits may tie, and then the order among equals is
    the lower id first here and unspecified in torch: the same experts and weights as sets), ids made local
    to a holder of some experts."""
    g = torch.Generator().manual_seed(tokens)
    first, num_held = (held.start, len(held)) if held else (0, experts)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(tokens, experts, generator=g) * 2).to(dtype)
        if dtype == torch.bfloat16:
            logits[0, :2] = logits[0].max() + 1  # two equal largest: both chosen, in either order
        ours = route(logits.to(DEV), k, renormalize, first, num_held)
        want = route_held(logits, k, renormalize, first, num_held)
        (w, i), (w_ref, i_ref) = [(a.cpu(), b.cpu()) for a, b in (ours, want)]
        if dtype == torch.float32:
            assert torch.equal(i, i_ref)
            assert torch.allclose(w, w_ref, rtol=1e-5, atol=1e-7)
        so, sr = i.sort(dim=1), i_ref.sort(dim=1)
        assert torch.equal(so.values, sr.values)
        assert torch.allclose(w.gather(1, so.indices), w_ref.gather(1, sr.indices), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tokens,hidden,experts,k,add,held,dtype", [
    (1, 64, 128, 8, True, None, torch.float32), (4, 96, 60, 4, False, None, torch.bfloat16),
    (3, 64, 8, 2, True, range(4, 8), torch.bfloat16), (2, 32, 5, 1, True, None, torch.float32)])
def test_norm_route_matches_unfused(tokens, hidden, experts, k, add, held, dtype):
    """The MoE layer's front in one launch (:func:`kernels.moe_route.norm_route`): the stream and the normed row
    as the norm kernel writes them (the row to its last bit), the router's logits as the linear's (rounded to the
    model dtype), the routing of them as :func:`route_held` makes it, and every arrival counter back at zero
    (twice: the counter re-arms)."""
    g = torch.Generator().manual_seed(tokens + hidden)
    x, residual = (torch.randn(tokens, hidden, generator=g).to(dtype) for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    gate = (torch.randn(experts, hidden, generator=g) / hidden ** 0.5).to(dtype)
    first, num_held = (held.start, len(held)) if held else (0, experts)
    arrivals = torch.zeros(4, dtype=torch.int32, device=DEV)
    want_h, want_stream = (fused_add_rms_norm(x.to(DEV), residual.to(DEV), norm_w.to(DEV), 1e-6) if add
                           else (rms_norm(x.to(DEV), norm_w.to(DEV), 1e-6), x.to(DEV)))
    for _ in range(2):
        h, stream, logits, w, ids = norm_route(x.to(DEV), residual.to(DEV) if add else None, norm_w.to(DEV), 1e-6,
                                               gate.to(DEV), k, True, arrivals, first, num_held)
        assert torch.equal(stream, want_stream)  # the norm's sum of squares may be summed in another order:
        assert rel_err(h.cpu(), want_h.cpu()) < (1e-6 if dtype == torch.float32 else 4e-3)  # a last bit apart
        want_logits = (h.float() @ gate.to(DEV).float().t()).to(dtype).float()
        assert rel_err(logits.cpu(), want_logits.cpu()) < (1e-6 if dtype == torch.float32 else 1e-2)
        w_ref, ids_ref = route_held(logits.cpu(), k, True, first, num_held)
        assert torch.equal(ids.cpu(), ids_ref) and torch.allclose(w.cpu(), w_ref, rtol=1e-5, atol=1e-7)
        assert not arrivals.any()


def test_planted_experts_weighted_sum():
    """Expert e computes ``silu(g_e x) * (u_e x)`` then ``d_e``; each token's output is its two experts' outputs
    times the planted weights, on the torch reference and the fused kernels' both forms (the per-pair form's down
    launch both ways: a token's experts in turn and side by side)."""
    g = torch.Generator().manual_seed(3)
    E, H, I = 4, 16, 16
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 4
    x = torch.randn(3, H, generator=g)
    weights, ids = route_ref(PLANTED_PROBS.log(), 2, renormalize=True)

    def expert(e: int, v: torch.Tensor) -> torch.Tensor:
        gate, up = w13[e, :I] @ v, w13[e, I:] @ v
        return w2[e] @ (gate * torch.sigmoid(gate) * up)

    want = torch.stack([4 / 7 * expert(1, x[0]) + 3 / 7 * expert(3, x[0]),
                        2 / 3 * expert(2, x[1]) + 1 / 3 * expert(3, x[1]),
                        0.5 * expert(ids[2, 0].item(), x[2]) + 0.5 * expert(ids[2, 1].item(), x[2])])
    on_dev = [t.to(DEV) for t in (x, w13, w2, weights, ids)]
    at_once = SmallConfig(MoEConfig(1, 4, 16), MoEConfig(1, 4, 16, experts_at_once=True))  # k experts side by side
    for out in (moe_ref(x, w13, w2, weights, ids), fused_moe_small(*on_dev), fused_moe_small(*on_dev, at_once),
                fused_moe_grouped(*on_dev, MoEConfig(16, 16, 16))):
        assert torch.allclose(out.cpu(), want, atol=1e-5), (out.cpu() - want).abs().max()


# --------------------------------------------------------------------------- the kernels (interpreter on the CPU)


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEV)  # pairs 0..5 = (token, slot) in order
    pairs, block_expert = align_by_expert(ids, num_experts=5, block_m=4)
    pad = 6
    assert pairs.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert block_expert.tolist() == [0, 2, 3, 5, 5, 5]  # blocks past the last group: expert id E
    # sized from the shapes alone: 6 pairs + up to 3 of padding for each of (at most) 5 experts, in blocks of 4
    assert pairs.shape[0] == 6 * 4 and (pairs[12:] == pad).all()


@pytest.mark.parametrize("E,k,block_m", [(3, 2, 4), (8, 2, 16), (60, 4, 16), (128, 8, 16), (128, 8, 64)])
def test_align_by_expert_kernel_equals_torch(E, k, block_m):
    """The one-launch kernel against the torch reference: random routings of 1 to 33 tokens (on a GPU up to 1,024,
    the grouped form's chunk: the interpreter sorts slowly; 4,096 pairs, the kernel's largest, and past them the
    torch form through the same call), some pairs held elsewhere (id E), every slot and block the same."""
    g = torch.Generator().manual_seed(E * block_m)
    sizes = [1, 2, 5, 33] + ([64, 300, MAX_PAIRS // k, 1024] if DEV.type == "cuda" else [])
    for T in sizes:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[torch.rand(T, k, generator=g) < 0.1] = E
        want = align_by_expert_ref(ids, E, block_m)
        got = align_by_expert(ids.to(DEV), E, block_m)
        for a, b in zip(got, want):
            assert a.cpu().tolist() == b.tolist(), (T, E, k, block_m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_fused_moe_matches_reference(tokens, dtype):
    """Both forms at 1 and 7 tokens and the grouped one at 64 (on a GPU the per-pair one's default tiles there
    too), 6 experts of top-3 (an expert at 1 token used by no pair), against the torch reference; float32
    exactly up to summation order, bfloat16 within rounding."""
    g = torch.Generator().manual_seed(tokens)
    E, H, I, k = 6, 48, 40, 3  # H, I not multiples of the blocks: masked edges
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype).to(DEV)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype).to(DEV)
    x = torch.randn(tokens, H, generator=g).to(dtype).to(DEV)
    weights, ids = route_ref(torch.randn(tokens, E, generator=g).to(DEV), k, renormalize=dtype == torch.float32)
    want = moe_ref(x, w13, w2, weights, ids).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    forms = [lambda: fused_moe_grouped(x, w13, w2, weights, ids, MoEConfig(16, 32, 32))]
    if tokens < 64:  # narrow tiles: many programs, slow in the interpreter at 64 tokens
        forms.append(lambda: fused_moe_small(x, w13, w2, weights, ids, SmallConfig(MoEConfig(1, 16, 32),
                                                                                   MoEConfig(1, 8, 64))))
    # the default tiles; on the CPU the interpreter's wide ones at 7 tokens (a program per pair and tile: the same
    # programs as at 64 tokens, a ninth as many)
    if dtype == torch.float32 and tokens == (64 if torch.cuda.is_available() else 7):
        forms.append(lambda: fused_moe_small(x, w13, w2, weights, ids))
    if tokens == 1:  # the GPU's default tiles
        forms.append(lambda: fused_moe_small(x, w13, w2, weights, ids, SMALL_CONFIG))
    for form in forms:
        out = form()
        assert out.dtype == dtype and out.shape == (tokens, H)
        assert rel_err(out.double(), want) < tol


@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_fused_moe_fp8_experts_match_reference(tokens):
    """FP8 expert stacks (e4m3 values, a scale per expert and row): both forms (the per-pair one's down launch
    both ways; at 40 tokens the grouped one), some pairs held elsewhere, against :func:`moe_ref` on the same
    stacks (W8A16: x as it is, each row's float32 sum scaled once) up to summation order, and within FP8's
    rounding of the unquantized experts."""
    g = torch.Generator().manual_seed(tokens + 5)
    E, H, I, k = 6, 48, 40, 2
    act = torch.bfloat16 if DEV.type == "cuda" else torch.float32
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(act).to(DEV)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(act).to(DEV)
    q13, q2 = quantize_weight(w13), quantize_weight(w2)
    assert q13.data.shape == w13.shape and q13.scale.shape == (E, 2 * I) and q2.scale.shape == (E, H)
    x = torch.randn(tokens, H, generator=g).to(act).to(DEV)
    weights, ids = route_ref(torch.randn(tokens, E, generator=g).to(DEV), k, renormalize=True)
    ids[0, 1] = E  # held by another rank: adds nothing (the grouped form's rows start at zero: partial)
    want = moe_ref(x, q13, q2, weights, ids).double()
    assert rel_err(want, moe_ref(x, w13, w2, weights, ids).double()) < 0.1  # e4m3: 3 mantissa bits
    tol = 1e-5 if act == torch.float32 else 1e-2
    forms = [fused_moe_grouped(x, q13, q2, weights, ids, MoEConfig(16, 32, 32), partial=True)]
    if tokens < 40:  # the per-pair form's narrow tiles: a program per pair and tile, slow in the interpreter
        forms += [fused_moe_small(x, q13, q2, weights, ids, SmallConfig(MoEConfig(1, 16, 32), MoEConfig(1, 8, 64))),
                  fused_moe_small(x, q13, q2, weights, ids, SmallConfig(MoEConfig(1, 16, 32),
                                                                        MoEConfig(1, 8, 64, experts_at_once=True)))]
    for out in forms:
        assert out.dtype == act and out.shape == (tokens, H)
        assert rel_err(out.double(), want) < tol


def test_triton_backend_moe_picks_a_form_by_size():
    """``TritonBackend.moe`` routes and runs the fused op: 4 tokens x top-2 (per pair) and 20 tokens (grouped);
    batch-invariant, the per-pair form at 20 too."""
    g = torch.Generator().manual_seed(1)
    E, H, I = 4, 32, 16
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 6, torch.randn(E, H, I, generator=g) / 4
    w13, w2 = w13.to(DEV), w2.to(DEV)
    x, logits = torch.randn(20, H, generator=g).to(DEV), torch.randn(20, E, generator=g).to(DEV)
    default, invariant = FusedMoETorchBackend(torch.ones(1)), FusedMoETorchBackend(torch.ones(1))
    invariant.batch_invariant = True
    for tokens in (4, 20):
        ours = default.moe(x[:tokens], logits[:tokens], w13, w2, 2, True).cpu()
        want = TorchBackend.moe(x[:tokens].cpu(), logits[:tokens].cpu(), w13.cpu(), w2.cpu(), 2, True)
        assert rel_err(ours, want) < 1e-5
    # batch-invariant: a token's output is the same bits alone and among 20 (the per-pair form at every size)
    alone, among = invariant.moe(x[:1], logits[:1], w13, w2, 2, True), invariant.moe(x, logits, w13, w2, 2, True)
    assert torch.equal(alone[0], among[0]) and rel_err(among.cpu(), TorchBackend.moe(
        x.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), 2, True)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("tokens", [3, 96])
@pytest.mark.parametrize("held", [range(64), range(16, 40)], ids=["all", "a-rank's"])
def test_fused_moe_no_sync_and_cuda_graph(tokens, held):
    """Routing and both forms (3 tokens x top-8: 24 pairs, per pair; 96 tokens: grouped) read nothing back to
    the host, and one captured graph replays new inputs and new routings correctly; also when the weights are
    one rank's experts (expert parallelism: 24 of the 64)."""
    g = torch.Generator().manual_seed(tokens)
    E, H, I, k = 64, 256, 128, 8
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16().to(DEV)[held.start:held.stop]
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16().to(DEV)[held.start:held.stop]
    x = torch.randn(tokens, H, generator=g).bfloat16().to(DEV)
    logits = torch.randn(tokens, E, generator=g).to(DEV)
    backend = FusedMoETorchBackend(torch.ones(1))
    backend.moe(x, logits, w13, w2, k, True, held.start)  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        backend.moe(x, logits, w13, w2, k, True, held.start)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.moe(x, logits, w13, w2, k, True, held.start)
    for _ in range(2):
        x.copy_(torch.randn(tokens, H, generator=g).bfloat16())
        logits.copy_(torch.randn(tokens, E, generator=g) * 4)
        graph.replay()
        want = TorchBackend.moe(x, logits, w13, w2, k, True, held.start).float()
        assert rel_err(out.float(), want) < 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model's kernels need the interpreter")
def test_moe_tuner_runs_and_picks(built):
    """The start-up tuner's MoE runs (:mod:`executor_proc.backends.moe_tuning`) on a model's stacks: per size, the
    per-pair form's two launches while the pairs fit it, else the grouped form; every candidate gives the
    default tiles' result; the picks land in the keys ``TritonBackend.moe`` reads, the other launch's default
    kept.  The router and the shared expert are tuned with the dense linears."""
    from executor_proc.backends.moe_tuning import moe_choices, moe_runs
    from kernels import moe as fused

    _, _, model, _, _ = built("mixtral")  # both layers MoE: 4 experts of 64 x 32, top-2
    runs = moe_runs(model, [1, 32])
    kinds = sorted({key[0] for key, *_ in runs})
    assert kinds == ["moe_down", "moe_grouped", "moe_up"]
    for key, (_, default), candidates, layers in runs:
        assert len(layers) == 2 and key[1:4] == (4, 32, 64)
        assert (key[0] == "moe_grouped") == (key[4] == 32)
        want = default(layers[0])
        for config, fn in candidates[:2]:  # the interpreter is slow: two of each
            assert rel_err(fn(layers[0]).double(), want.double()) < 1e-5, (key, config)
    # the dense linears' tuner takes the routers and the shared experts' matmuls (not the one-row shared gate)
    from executor_proc.backends.gemv_tuning import _weight_groups

    _, _, qwen2, config, _ = built("qwen2_moe")
    groups = _weight_groups(qwen2)
    h, shared = config.hidden_size, config.moe.shared_intermediate_size
    assert len(groups[(4, h)]) == 2 and len(groups[(2 * shared, h)]) == 2 and len(groups[(h, shared)]) == 2
    assert (1, h) not in groups
    up, grouped = fused.UP_CANDIDATES[1], fused.GROUPED_CANDIDATES[1]
    small, wide = moe_choices({("moe_up", 4, 32, 64, 1): up, ("moe_grouped", 4, 32, 64, 32): grouped})
    assert small == {(4, 32, 64, 1): fused.SmallConfig(up, fused.SMALL_CONFIG.down)}
    assert wide == {(4, 32, 64, 32): grouped}


def test_long_steps_run_in_chunks(monkeypatch):
    """Past CHUNK_TOKENS tokens the op runs chunk by chunk (here 16, 16, 8 tokens: two grouped, one per-pair)."""
    import kernels.moe as moe

    monkeypatch.setattr(moe, "CHUNK_TOKENS", 16)
    g = torch.Generator().manual_seed(2)
    E, H, I, k = 4, 32, 16, 3
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 6, torch.randn(E, H, I, generator=g) / 4
    x = torch.randn(40, H, generator=g)
    weights, ids = route_ref(torch.randn(40, E, generator=g), k, False)
    ours = moe.fused_moe(x.to(DEV), w13.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV)).cpu()
    assert rel_err(ours, moe_ref(x, w13, w2, weights, ids)) < 1e-5


def test_align_by_expert_leaves_out_pairs_held_elsewhere():
    """Id E (here 3) marks a pair whose expert another rank holds: it joins no group and takes no block."""
    ids = torch.tensor([[2, 3], [3, 0], [0, 2]], device=DEV)
    pairs, block_expert = align_by_expert(ids, num_experts=3, block_m=4)
    pad = 6
    assert pairs.tolist() == [3, 4, pad, pad, 0, 5, pad, pad] + [pad] * 8  # sized as if every pair were here
    assert block_expert.tolist() == [0, 2, 3, 3]


@pytest.mark.parametrize("tokens", [3, 40])
def test_fused_moe_on_a_ranks_experts(tokens):
    """Expert parallelism: 6 experts (top-3) held by 4 ranks as 0-1, 2-3, 4, 5.  Each rank's output, through the
    Triton backend's op (3 tokens: per pair; 40: grouped, and per pair when batch-invariant), equals the torch
    reference on the same experts, and the ranks' outputs add up to the whole layer's."""
    g = torch.Generator().manual_seed(tokens)
    E, H, I, k = 6, 32, 16, 3
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / 6, torch.randn(E, H, I, generator=g) / 4
    x, logits = torch.randn(tokens, H, generator=g), torch.randn(tokens, E, generator=g)
    fused, invariant = FusedMoETorchBackend(torch.ones(1)), FusedMoETorchBackend(torch.ones(1))
    invariant.batch_invariant = True
    total = torch.zeros(tokens, H)
    for rank, held in enumerate([range(0, 2), range(2, 4), range(4, 5), range(5, 6)]):
        part = (w13[held.start:held.stop], w2[held.start:held.stop])
        want = TorchBackend.moe(x, logits, *part, k, True, held.start)
        backends = (fused, invariant) if tokens < 40 or rank == 3 else (fused,)  # the interpreter is slow per pair
        for backend in backends:
            ours = backend.moe(x.to(DEV), logits.to(DEV), part[0].to(DEV), part[1].to(DEV), k, True, held.start)
            assert rel_err(ours.cpu(), want) < 1e-5
        total += want
    assert rel_err(total, TorchBackend.moe(x, logits, w13, w2, k, True)) < 1e-5


# --------------------------------------------------------------------------- GGUF files


def write_gguf(name: str, folder: str, path: str, quantize_experts: bool = False) -> None:
    """The family's tiny model (its safetensors ``folder``) as llama.cpp's converter writes it: ``{arch}.expert_*``
    keys, each layer's experts stacked in ``blk.N.ffn_{gate,up,down}_exps``, the router as ``ffn_gate_inp``, a
    "llama" (Mixtral) file's q and k rows permuted; float32, or the expert stacks in Q8_0."""
    import re
    from collections import defaultdict

    import gguf
    import numpy as np

    from executor_proc.model.gguf_file import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_PARTS
    from executor_proc.model.loader import hf_weights

    config = ModelConfig.from_pretrained(folder)
    moe = config.moe
    arch = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}[name]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(config.num_layers)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(moe.intermediate_size if arch == "llama" else config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_theta)
    w.add_context_length(config.max_position_embeddings)
    w.add_vocab_size(config.vocab_size)
    w.add_expert_count(moe.num_experts)
    w.add_expert_used_count(moe.top_k)
    if arch != "llama":
        w.add_expert_feed_forward_length(moe.intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(moe.shared_intermediate_size)
    names = {hf: g for g, hf in _GGUF_GLOBAL_NAMES.items()}
    parts = {hf: g for g, hf in _GGUF_LAYER_PARTS.items()}
    stacks: dict = defaultdict(dict)
    for hf_name, t in hf_weights(folder)[1]:
        hf_name, t = checkpoint_name(hf_name), t.numpy()
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", hf_name)
        if expert:
            stacks[int(expert[1]), expert[3]][int(expert[2])] = t
            continue
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
        gguf_name = f"blk.{layer[1]}.{parts[layer[2]]}.{layer[3]}" if layer else names[hf_name]
        heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}.get(gguf_name.split(".")[-2])
        if arch == "llama" and heads:  # llama.cpp's rotary interleaving (gguf_file.unpermute_qk undoes it)
            t = t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(gguf_name, np.ascontiguousarray(t))
    for (layer, proj), experts in sorted(stacks.items()):
        stack = np.stack([experts[e] for e in range(moe.num_experts)])
        gguf_name = f"blk.{layer}.ffn_{proj}_exps.weight"
        if quantize_experts:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name, gguf.quants.quantize(stack, q8), raw_dtype=q8)
        else:
            w.add_tensor(gguf_name, stack)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gguf_file_loads_as_the_safetensors_folder(name, built, tmp_path):
    """Each family written as a GGUF file (stacked experts, routers, Qwen2-MoE's shared expert, Qwen3-MoE's dense
    layer, Mixtral's permuted q/k) reads back as the same config and, bit for bit, the same weights as its
    safetensors folder; Q8_0 expert stacks within their quantisation error."""
    _, _, want, want_config, folder = built(name)
    path = str(tmp_path / f"{name}.gguf")
    write_gguf(name, folder, path)
    model, config = load_model(path, "gguf", "cpu", torch.float32)
    fields = ("architecture", "moe", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
              "head_dim", "qk_norm", "qkv_bias")
    assert {f: getattr(config, f) for f in fields} == {f: getattr(want_config, f) for f in fields}
    ours, theirs = model.state_dict(), want.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    if name == "qwen3_moe":
        write_gguf(name, folder, path, quantize_experts=True)
        q8 = load_model(path, "gguf", "cpu", torch.float32)[0].state_dict()
        for k in (k for k in ours if k.endswith(("w13", "w2"))):
            assert 0 < rel_err(q8[k], ours[k]) < 1e-2, k


# --------------------------------------------------------------------------- configs, names, errors

REAL_CONFIGS = {  # folder: (architecture, experts, top-k, renormalised, shared expert, total parameters)
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", 128, 8, True, 0, 30.53e9),
    "qwen1.5-moe-a2.7b": ("Qwen2MoeForCausalLM", 60, 4, False, 5632, 14.32e9),
    "mixtral-8x7b": ("MixtralForCausalLM", 8, 2, True, 0, 46.70e9),
}


@pytest.mark.parametrize("folder", list(REAL_CONFIGS))
def test_real_configs_parse_and_count_their_parameters(folder):
    """The shipped configs of the real models parse, and a model built on the meta device (no memory) holds
    the published parameter count (within 0.5%): every expert, shared expert and router has its shape."""
    arch, experts, top_k, renorm, shared, total = REAL_CONFIGS[folder]
    config = ModelConfig.from_pretrained(os.path.join(ROOT, "scripts", "configs", folder))
    moe = config.moe
    assert (config.architecture, moe.num_experts, moe.top_k, moe.renormalize) == (arch, experts, top_k, renorm)
    assert moe.shared_intermediate_size == shared
    with torch.device("meta"):
        model = CausalLM(config, torch.bfloat16)
    count = sum(p.numel() for p in model.parameters())
    assert abs(count - total) / total < 5e-3, count


def test_dummy_weights_of_each_family(tmp_path):
    """``--load-format dummy``: every family's stacked experts, routers and shared expert drawn, logits finite."""
    for name, (config_name, model_name, extra) in FAMILIES.items():
        folder = tmp_path / name
        hf_config = getattr(transformers, config_name)(**(SHAPE | extra))
        hf_config.architectures = [model_name]
        hf_config.save_pretrained(folder)
        model, config = load_model(str(folder), "dummy", "cpu", "float32")
        block = model.model.layers[0].mlp
        assert block.w13.std() > 0.01 and block.w2.std() > 0.01 and block.gate.weight.std() > 0.01
        logits = PagedRun(model, config, num_rows=1, block_size=4, max_len=8).step({0: random_tokens(8, 0)})[0]
        assert logits.shape == (8, VOCAB) and torch.isfinite(logits).all()


def test_mixtral_names_map_to_the_stacked_experts():
    assert checkpoint_name("model.layers.3.block_sparse_moe.experts.7.w1.weight") == \
        "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert checkpoint_name("model.layers.3.block_sparse_moe.experts.7.w3.weight") == \
        "model.layers.3.mlp.experts.7.up_proj.weight"
    assert checkpoint_name("model.layers.0.block_sparse_moe.experts.12.w2.weight") == \
        "model.layers.0.mlp.experts.12.down_proj.weight"
    assert checkpoint_name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert checkpoint_name("model.layers.0.mlp.gate_proj.weight") == "model.layers.0.mlp.gate_proj.weight"
    for name in ("model.layers.3.block_sparse_moe.experts.7.w1.weight", "model.layers.0.block_sparse_moe.gate.weight",
                 "model.layers.3.block_sparse_moe.experts.7.w3.weight_scale", "model.norm.weight"):
        assert mixtral_name(checkpoint_name(name)) == name


def test_mixtral_checkpoint_errors_name_its_own_tensors():
    """A Mixtral checkpoint that lacks its router and an expert's w3: the error names them as its files do."""
    config = ModelConfig.from_hf_dict({"architectures": ["MixtralForCausalLM"], **SHAPE, "num_local_experts": 4,
                                       "num_experts_per_tok": 2})
    model = CausalLM(config)
    model.fuse_projections()
    ours = {n: p.shape for n, p in model.named_parameters() if not n.endswith(("w13", "w2"))}
    for i in range(config.num_layers):
        ours.update((n, v.shape) for n, v in model.model.layers[i].mlp.expert_views(f"model.layers.{i}.mlp.").items())
    weights = [(mixtral_name(n), torch.zeros(shape)) for n, shape in ours.items()
               if n not in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.2.up_proj.weight")]
    with pytest.raises(ValueError, match=r"missing 2 weights: model\.layers\.0\.block_sparse_moe\.gate\.weight, "
                                         r"model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight$"):
        model.load_weights(weights)
    name = "model.layers.1.block_sparse_moe.gate.weight"
    with pytest.raises(ValueError, match=rf"1 shape or dtype mismatches: {re.escape(name)}: checkpoint \(2, 64\)"):
        left_out = ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.2.up_proj.weight")
        model.load_weights([(n, t[:2] if n == name else t) for n, t in weights]
                           + [(mixtral_name(n), torch.zeros(ours[n])) for n in left_out])


def test_missing_expert_is_named():
    config = ModelConfig.from_hf_dict({"architectures": ["Qwen3MoeForCausalLM"], **SHAPE, **MOE, "num_experts": 4})
    model = CausalLM(config)
    model.fuse_projections()
    views = model.model.layers[1].mlp.expert_views("model.layers.1.mlp.")
    weights = [(n, torch.zeros(p.shape)) for n, p in model.named_parameters() if not n.endswith(("w13", "w2"))]
    weights += [(n, torch.zeros(v.shape)) for n, v in views.items() if ".experts.2.up_proj" not in n]
    with pytest.raises(ValueError, match=r"missing \d+ weights: .*model\.layers\.0\.mlp\.experts\.0\.down_proj"):
        model.load_weights(weights)  # layer 0's experts absent, and layer 1's expert 2 up_proj
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight"):
        model.load_weights(weights + [(n, torch.zeros(v.shape)) for n, v in
                                      model.model.layers[0].mlp.expert_views("model.layers.0.mlp.").items()])
    # a transposed expert tensor is named once, as a shape mismatch, not also as missing
    whole = weights + [(n, torch.zeros(v.shape)) for n, v in views.items() if ".experts.2.up_proj" in n]
    layer0 = model.model.layers[0].mlp.expert_views("model.layers.0.mlp.")
    whole += [(n, torch.zeros(v.shape)) for n, v in layer0.items()]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    whole = [(n, t.T if n == name else t) for n, t in whole]
    with pytest.raises(ValueError) as e:
        model.load_weights(whole)
    message = str(e.value)
    assert "missing" not in message and message.count(name) == 1 and "1 shape or dtype mismatches" in message


BASE = {"architectures": ["Qwen2MoeForCausalLM"], **SHAPE, **MOE, "num_experts": 4,
        "shared_expert_intermediate_size": 48}


@pytest.mark.parametrize("change, message", [
    ({"num_experts": None}, "'num_experts'"),
    ({"num_experts": 0}, "'num_experts' must be a positive integer"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) is more than the model's 4 experts"),
    ({"moe_intermediate_size": None}, "'moe_intermediate_size'"),
    ({"shared_expert_intermediate_size": 0}, "'shared_expert_intermediate_size'"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step'"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be true or false"),
    ({"mlp_only_layers": "1"}, "'mlp_only_layers' must be a list"),
    ({"architectures": ["MixtralForCausalLM"], "num_experts": None}, "'num_local_experts'"),
    ({"num_local_experts": 8}, r"'num_experts' \(4\) and 'num_local_experts' \(8\) disagree"),
])
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(BASE | change)


def test_absent_fields_take_the_familys_defaults():
    """Where a config leaves rope_theta or rms_norm_eps out, each family's HF default (Mixtral's differ from the
    others': a 10,000 theta there gave logits 0.6 off HF's)."""
    from transformers import AutoConfig

    for arch, model_type in (("MixtralForCausalLM", "mixtral"), ("Qwen2MoeForCausalLM", "qwen2_moe"),
                             ("Qwen3MoeForCausalLM", "qwen3_moe"), ("LlamaForCausalLM", "llama")):
        d = {k: v for k, v in (BASE | {"architectures": [arch], "num_local_experts": 4}).items()
             if k not in ("rope_theta", "rope_parameters", "rms_norm_eps")}
        if model_type != "mixtral":
            d.pop("num_local_experts")
        ours, hf = ModelConfig.from_hf_dict(d), AutoConfig.for_model(model_type)
        theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
        assert (ours.rope_theta, ours.rms_norm_eps) == (theta, hf.rms_norm_eps), arch


def test_fp8_experts_stay_within_fp8_rounding_of_the_float_model(built):
    """--quantization fp8 of Qwen2-MoE (routed experts, a shared expert, the router): the stacks become e4m3 with
    a scale per expert and row, the router stays float, the weights' bytes shrink; the logits of 3 prompts stay
    within FP8's rounding of the float model's, and the fused kernels (the interpreter on the CPU) give the torch
    reference's."""
    from executor_proc.model.quantization import quantize_model
    from kernels.fp8 import FP8

    _, _, ref, config, folder = built("qwen2_moe")
    model, _ = load_model(folder, "hf", "cpu", torch.float32)
    before = model.weight_bytes()
    quantize_model(model)
    block = model.model.layers[0].mlp
    w13, w2 = block.expert_stacks()
    assert w13.data.dtype == FP8 and w13.scale.shape == block.w13.shape[:2] and w2.scale.shape == block.w2.shape[:2]
    assert block.gate.weight.dtype == torch.float32 and block.shared_expert.gate_up.weight.data.dtype == FP8
    assert model.weight_bytes() < 0.6 * before
    prompts = {0: random_tokens(7, 4), 1: random_tokens(12, 5), 2: random_tokens(2, 6)}

    def logits(m, backend=None):
        if backend is not None:
            m.use_backend(backend)
        run = PagedRun(m, config, num_rows=3, block_size=4, max_len=16)
        return run.step(prompts)

    want, got = logits(ref), logits(model)
    for r in prompts:  # this 64-wide random model moves by ~9% with FP8 (the dense layers' alone ~8%, the experts' ~3%)
        assert rel_err(got[r], want[r]) < 0.15, rel_err(got[r], want[r])
    if DEV.type == "cpu":  # the CPU model under the interpreter; on a GPU: test_fused_moe_fp8_experts_match_reference
        fused = logits(model, FusedMoETorchBackend(model.rope_inv_freq))
        for r in prompts:
            assert rel_err(fused[r], got[r]) < 1e-4


def test_unsupported_paths_say_so(tmp_path, monkeypatch):
    """A GGUF MoE file that lacks a key its experts need stops with a clear error naming it (not a crash
    mid-load); tensor parallelism: tests/test_moe_parallel.py."""
    import numpy as np
    from gguf import GGUFWriter

    from executor_proc.model.gguf_file import gguf_config

    path = str(tmp_path / "qwen3moe.gguf")
    w = GGUFWriter(path, "qwen3moe")
    w.add_block_count(2)
    w.add_embedding_length(4)
    w.add_head_count(1)
    w.add_vocab_size(4)
    w.add_expert_count(8)  # and no expert_used_count
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF file lacks the metadata key qwen3moe.expert_used_count"):
        gguf_config(path)


def test_sparse_step_and_dense_layers():
    config = ModelConfig.from_hf_dict(BASE | {"num_hidden_layers": 6, "decoder_sparse_step": 2,
                                              "mlp_only_layers": [3]})
    assert [config.moe.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


# --------------------------------------------------------------------------- a real server


def test_server_greedy_tokens_match_hf(built):
    """``forerun serve`` on each family's tiny model (CPU, float32): greedy tokens of two prompts as HF generates
    them.  The three servers start together, at pipeline depths 0, 1 and 1 (a depth is the scheduler's: the MoE
    layer runs the same steps at either; every depth of the default model: tests/test_lifecycle_model.py)."""
    import asyncio
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from ipc.client import AsyncClient
    from tests.server_proc import ServerProcess, run_dir

    prompts = [random_tokens(6, 40), random_tokens(9, 41)]
    want = {}
    for name in FAMILIES:
        hf = built(name)[1]
        with torch.no_grad():
            # the mask given: without one HF takes every prompt token equal to pad_token_id for padding
            want[name] = [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=8, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist() for ids in prompts]
    cases = [(name, min(i, 1)) for i, name in enumerate(FAMILIES)] + [("qwen2_moe", "fp8")]
    tmp = run_dir()

    def start(case):
        name, depth = case
        flags = ["--quantization", "fp8"] if depth == "fp8" else ["--pipeline-depth", str(depth)]
        return ServerProcess("--model", built(name)[4], "--device", "cpu", "--dtype", "float32", "--max-num-seqs",
                             "4", "--num-kv-blocks", "32", "--block-size", "4", *flags, tmpdir=tmp, timeout=120)

    async def run(srv):
        async with AsyncClient(srv.address, timeout=60) as c:
            return [r.token_ids for r in await asyncio.gather(*[
                c.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)
                for ids in prompts])]

    with ThreadPoolExecutor(len(cases)) as pool:
        started = [pool.submit(start, case) for case in cases]
    servers = [f.result() for f in started if f.exception() is None]
    try:
        assert len(servers) == len(cases), [f.exception() for f in started]
        got = {case: asyncio.run(run(srv)) for case, srv in zip(cases, servers)}
    finally:
        for srv in servers:
            srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for name, depth in cases:
        if depth == "fp8":  # FP8 experts served end to end (their logits: test_fp8_experts_stay_within_...)
            assert [len(t) for t in got[name, depth]] == [8, 8], got[name, depth]
        else:
            assert got[name, depth] == want[name], (name, depth)
