"""Our model + paged attention against HF transformers, float32 on the CPU.

Each architecture gets a tiny random-weight checkpoint written with
``save_pretrained`` and read back by our "hf" loader.  HF runs every row as one
unpadded sequence; we run the same tokens as packed, paged steps (mixed prefill,
chunked prefill, batched decode with scattered block tables) and compare logits.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers

from tests.forward_batch import all_logits, build_forward_batch
from executor_proc.model.kv_cache import KVCache, kv_cache_bytes_per_block
from executor_proc.model.loader import load_model
from executor_proc.model.llama import build_model
from executor_proc.model.config import ModelConfig

RTOL = 1e-4
VOCAB = 97
SHAPE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so the scaling bites at head_dim 16
}

# HF's config and model classes by name: looked up when a test runs, since touching one imports its modeling
# module (seconds of CPU that every pytest-xdist worker would pay at collection, using it or not).
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_ROPE)),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module", params=list(ARCHS))
def models(request, tmp_path_factory):
    """(HF reference model, our model, our config) for one architecture."""
    config_name, model_name, extra = ARCHS[request.param]
    config_cls, model_cls = getattr(transformers, config_name), getattr(transformers, model_name)
    hf_config = config_cls(**SHAPE, **extra)
    torch.manual_seed(0)
    hf = model_cls(hf_config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))  # biases random too, so they are exercised
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    model, config = load_model(str(folder), "hf", "cpu", torch.float32)
    return hf, model, config


class PagedRun:
    """Drive our model step by step, tracking each row's tokens and a scattered block table."""

    def __init__(self, model, config: ModelConfig, num_rows: int, block_size: int, max_len: int, seed: int = 0):
        blocks_per_row = -(-max_len // block_size)
        num_blocks = num_rows * blocks_per_row + 3
        gen = torch.Generator().manual_seed(seed)
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_tables = [pool[r * blocks_per_row : (r + 1) * blocks_per_row] for r in range(num_rows)]
        self.tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self.model = model
        self.block_size = block_size
        self.kv = KVCache(config, num_blocks, block_size, "cpu", torch.float32)

    def step(self, new_tokens: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step (rows in dict order); returns each row's logits for its new tokens."""
        rows = [(r, toks, len(self.tokens[r]), True) for r, toks in new_tokens.items()]
        batch = build_forward_batch(rows, [self.block_tables[r] for r in new_tokens], self.block_size, "cpu")
        logits = all_logits(self.model, batch, self.kv)
        sampled = self.model(batch, self.kv)
        out, start = {}, 0
        for r, toks in new_tokens.items():
            out[r] = logits[start : start + len(toks)]
            start += len(toks)
            self.tokens[r].extend(toks)
        # Same values up to matmul blocking (the LM head sees fewer rows).
        assert rel_err(sampled, torch.stack([out[r][-1] for r in new_tokens])) < 1e-6
        return out


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_batch(models):
    hf, model, config = models
    prompts = {0: random_tokens(7, 1), 1: random_tokens(1, 2), 2: random_tokens(12, 3)}
    run = PagedRun(model, config, num_rows=3, block_size=4, max_len=16)
    out = run.step(prompts)
    for r, toks in prompts.items():
        assert rel_err(out[r], hf_logits(hf, toks)) < RTOL


def test_chunked_prefill(models):
    hf, model, config = models
    a, b, c = random_tokens(13, 4), random_tokens(5, 5), random_tokens(4, 6)
    run = PagedRun(model, config, num_rows=3, block_size=4, max_len=16, seed=1)
    first = run.step({0: a[:6], 1: b[:4], 2: c[:3]})
    # Decode rows on both sides of a chunk row: two decode runs in one step.
    second = run.step({1: b[4:], 0: a[6:], 2: c[3:]})
    for r, toks in ((0, a), (1, b), (2, c)):
        ours = torch.cat([first[r], second[r]])
        assert rel_err(ours, hf_logits(hf, toks)) < RTOL


def test_decode_steps(models):
    hf, model, config = models
    lengths = [5, 8, 11]
    num_decode = 6
    run = PagedRun(model, config, num_rows=3, block_size=3, max_len=max(lengths) + num_decode, seed=2)
    prompts = {r: random_tokens(n, 10 + r) for r, n in enumerate(lengths)}
    step_logits = {r: [run.step({r: toks})[r]] for r, toks in prompts.items()}
    for i in range(num_decode):
        out = run.step({r: random_tokens(1, 100 * i + r) for r in prompts})
        for r in prompts:
            step_logits[r].append(out[r])
    for r in prompts:
        assert len(run.tokens[r]) == lengths[r] + num_decode
        assert rel_err(torch.cat(step_logits[r]), hf_logits(hf, run.tokens[r])) < RTOL


def test_folded_norms_match_hf(models):
    """``CausalLM.fold_norms`` (each layer's norm weights moved into q|k|v and gate|up, the final norm kept, as
    the CUDA path runs it) is the same function: prefill and decode logits still match HF's."""
    hf, model, config = models
    folded = copy.deepcopy(model)
    folded.fold_norms()
    for layer in folded.model.layers:
        assert torch.all(layer.input_layernorm.weight == 1) and torch.all(layer.post_attention_layernorm.weight == 1)
    assert torch.equal(folded.model.norm.weight, model.model.norm.weight)
    assert not torch.all(model.model.norm.weight == 1)  # the fixture's norms are not trivial
    prompts = {0: random_tokens(7, 1), 1: random_tokens(12, 3)}
    run = PagedRun(folded, config, num_rows=2, block_size=4, max_len=20)
    first = run.step(prompts)
    second = run.step({r: random_tokens(1, 50 + r) for r in prompts})
    for r in prompts:
        assert rel_err(torch.cat([first[r], second[r]]), hf_logits(hf, run.tokens[r])) < RTOL


def test_config_round_trip(models):
    hf, _, config = models
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    hf_head_dim = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
    assert config.head_dim == hf_head_dim
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings


def test_transformers_4_layout():
    d = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 10,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [128001, 128009],
    }
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling.factor == 8.0
    assert c.num_kv_heads == 4 and c.head_dim == 16 and c.eos_token_ids == (128001, 128009)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": LLAMA3}, None),  # the values of a real llama3 config pass
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_size": None}, "'hidden_size'"),
        # sizes of the wrong JSON type or sign fail here, named, not later inside the model's build
        ({"num_attention_heads": "4"}, "field 'num_attention_heads' must be a positive integer, got '4'"),
        ({"hidden_size": 64.0}, "field 'hidden_size' must be a positive integer, got 64.0"),
        ({"max_position_embeddings": -1}, "field 'max_position_embeddings' must be a positive integer, got -1"),
        ({"head_dim": 0}, "field 'head_dim' must be a positive integer, got 0"),
        ({"vocab_size": True}, "field 'vocab_size' must be a positive integer, got True"),
        ({"architectures": [7]}, "field 'architectures' must be a list of names, got \\[7\\]"),
        # more heads than hidden values and no head_dim: a head of 0 values
        ({"num_attention_heads": 128, "num_key_value_heads": 128}, "exceeds hidden_size .*give head_dim"),
        ({"rope_theta": "abc"}, "field 'rope_theta' must be a number, got 'abc'"),
        ({"rms_norm_eps": -1}, "field 'rms_norm_eps' must be a finite number >= 0, got -1"),
        # a string "false" would read as true: the embeddings tied and the checkpoint's lm_head dropped
        ({"tie_word_embeddings": "false"}, "field 'tie_word_embeddings' must be true or false, got 'false'"),
        ({"attention_bias": 0}, "field 'attention_bias' must be true or false"),
        ({"rope_parameters": "default"}, "field 'rope_parameters' must be an object, got 'default'"),
        # llama3 rope values that would divide by zero (NaN logits) or are no numbers, named
        ({"rope_scaling": LLAMA3 | {"factor": None}}, "llama3 rope scaling lacks the field 'factor'"),
        ({"rope_scaling": LLAMA3 | {"factor": 0}}, "rope_scaling.factor must be a number above 0, got 0"),
        ({"rope_scaling": LLAMA3 | {"low_freq_factor": 0}}, "rope_scaling.low_freq_factor must be a number above 0"),
        ({"rope_scaling": LLAMA3 | {"factor": "abc"}}, "field 'factor' must be a number, got 'abc'"),
        ({"rope_scaling": LLAMA3 | {"high_freq_factor": 1.0}},
         "high_freq_factor \\(1.0\\) must be above low_freq_factor"),
        ({"rope_scaling": {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"},
          "max_position_embeddings": None}, "original_max_position_embeddings must be a positive integer, got None"),
        ({"rope_scaling": LLAMA3 | {"original_max_position_embeddings": 8192.5}},
         "original_max_position_embeddings must be a positive integer, got 8192.5"),
        ({"eos_token_id": 16.5}, "field 'eos_token_id' must be a token id or a list of them, got 16.5"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": "4096"},
         "field 'sliding_window' must be a positive integer or null, got '4096'"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "'sliding_window' must be a positive integer"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": True},
         "'sliding_window' must be a positive integer or null, got True"),
    ],
)
def test_config_errors(change, message):
    d = {"architectures": ["LlamaForCausalLM"], **SHAPE} | change
    if message is None:
        assert ModelConfig.from_hf_dict(d).rope_scaling.factor == 8.0
        return
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_dict(d)


def test_head_dim_left_out_takes_transformers_default():
    """A config.json without head_dim gets the value transformers gives it: Qwen3's config class defaults to 128,
    the others to hidden_size / heads (a Qwen3 checkpoint of another width was refused as a shape mismatch)."""
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    for arch, model_type, hf, more in (("Qwen3ForCausalLM", "qwen3", Qwen3Config, {}),
                                       ("LlamaForCausalLM", "llama", LlamaConfig, {}),
                                       ("Qwen3MoeForCausalLM", "qwen3_moe", Qwen3MoeConfig, moe)):
        d = SHAPE | more | {"architectures": [arch], "model_type": model_type}
        expect = getattr(hf(**d), "head_dim", None) or d["hidden_size"] // d["num_attention_heads"]
        assert ModelConfig.from_hf_dict(d).head_dim == expect, arch


def test_a_broken_generation_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], **SHAPE}))
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"generation_config.json: not a valid generation config \(JSONDecodeError"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_one_architecture_name_may_stand_for_the_list():
    assert ModelConfig.from_hf_dict({"architectures": "MistralForCausalLM", **SHAPE}).architecture == "MistralForCausalLM"


def test_mistral_sliding_window_caps_context(caplog):
    d = {"architectures": ["MistralForCausalLM"], **SHAPE, "sliding_window": 64}
    c = ModelConfig.from_hf_dict(d)
    assert c.sliding_window == 64 and c.max_model_len == 64 and c.max_position_embeddings == 256
    # the operator's line, as the server's others: Python prints an unconfigured logger's warning bare
    assert caplog.messages[-1].startswith("forerun: sliding_window=64 is not implemented; sequences are capped at 64")


def test_load_weights_reports_mismatches():
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **SHAPE})
    model = build_model(config, "cpu", torch.float32)
    weights = [(n, torch.zeros(p.shape)) for n, p in model.named_parameters() if "layers.1." not in n]
    weights.append(("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(1)))
    with pytest.raises(ValueError, match=r"missing 9 weights: .*layers\.1\..*unexpected 1 weights: .*qkv_proj"):
        model.load_weights(weights)
    # integer tensors where float weights go (copied in, they were whole numbers: an all-zero model that served)
    ints = [(n, torch.zeros(p.shape, dtype=torch.int32)) for n, p in model.named_parameters()]
    with pytest.raises(ValueError, match=r"shape or dtype mismatches: model\.embed_tokens\.weight: checkpoint "
                                         r"\(97, 64\) torch\.int32 vs model \(97, 64\) torch\.float32"):
        model.load_weights(ints)
    # NaN or infinite values (they served token 0 with null logprobs): refused, named
    broken = [(n, torch.zeros(p.shape)) for n, p in model.named_parameters()]
    broken[3][1][0, 1], broken[5][1][-1] = float("nan"), -float("inf")
    with pytest.raises(ValueError, match=rf"2 checkpoint weights hold NaN or infinite values: {broken[3][0]}, "
                                         rf"{broken[5][0]}"):
        model.load_weights(broken)


def test_dummy_weights(tmp_path):
    config = transformers.LlamaConfig(**SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    progress = []
    model, mc = load_model(str(tmp_path), "dummy", "cpu", "float32", lambda *a: progress.append(a))
    again, _ = load_model(str(tmp_path / "config.json"), "dummy", "cpu", "float32")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    assert progress[-1][1] == progress[-1][2] == len(list(model.parameters()))
    run = PagedRun(model, mc, num_rows=1, block_size=4, max_len=8)
    logits = run.step({0: random_tokens(8, 0)})[0]
    assert logits.shape == (8, VOCAB) and torch.isfinite(logits).all()


def test_kv_cache_sizing():
    config = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], **SHAPE})
    kv = KVCache(config, num_blocks=5, block_size=4, device="cpu", dtype=torch.bfloat16)
    assert kv.k[1].shape == (5, 4, 2, 16)
    assert kv.nbytes == 5 * kv_cache_bytes_per_block(config, 4, torch.bfloat16) == 5 * 2 * 2 * 4 * 2 * 16 * 2


def test_hf_progress(models, tmp_path):
    hf, _, _ = models
    folder = tmp_path / "checkpoints[1]"  # glob's brackets in the path: the folder's own name, not a pattern
    hf.save_pretrained(folder)
    calls = []
    load_model(str(folder), "auto", "cpu", torch.float32, lambda *a: calls.append(a))
    total = calls[-1][2]
    assert [c[1] for c in calls] == list(range(1, total + 1))


def test_generation_config_eos_ids_are_merged(tmp_path):
    config = {"architectures": ["LlamaForCausalLM"], **SHAPE, "eos_token_id": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == (5, 7)
