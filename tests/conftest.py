"""Shared fixtures: the default model, HF reference outputs, real server processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from tests.server_proc import ROOT, ServerProcess, python_path, run_dir


def _set_up_torch() -> None:
    """Triton kernels run on the CPU through the interpreter (set before any kernel module is imported); two
    pytest-xdist workers' torch thread pools on the same cores spin against each other (OpenMP workers busy-wait),
    and every server process the tests start wants a core too."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    from kernels.interpreter_patch import patch_interpreter

    patch_interpreter()


# The files that take longest on 2 cores (about 10 to 60 s each), longest first.  The README runs the suite with
# `-n 2 --dist loadfile`: files go to the workers in collection order as they free up, so the run ends when the last
# file does; starting the long ones first leaves the short ones to even out the workers' ends.  The files that mostly
# wait (killed and silent servers, timeouts, heartbeats: reliability, hostile and extreme clients, replicas) come in
# the first half, where the other worker's CPU-bound file fills the core they leave idle (run last, they leave one
# core idle for about 40 s).  (Three workers on the two cores were slower in fresh clones: 519 s against 480 s of
# pytest with two, and on a slower machine 741 s against 680 s.)
LONGEST_FIRST = (
    "test_gpu_fastpath.py", "test_lifecycle_exhaustive.py", "test_e2e.py", "test_openai_server.py",
    "test_kv_paths.py", "test_scripts.py", "test_reliability.py", "test_tensor_parallel.py", "test_spec_e2e.py",
    "test_mixed_graphs_model.py", "test_structured_outputs.py", "test_host_kv_tier.py", "test_hostile_clients.py",
    "test_spec_draft_e2e.py", "test_lifecycle_model.py", "test_data_parallel.py", "test_sampling_e2e.py",
    "test_client_reliability.py", "test_structured_http.py", "test_extreme_values.py", "test_soak.py",
    "test_gguf.py", "test_prefix_cache.py", "test_output_features_model.py", "test_transfer.py",
    "test_moe_parallel.py", "test_moe.py", "test_mixed_graphs.py", "test_layering.py", "test_sampling_features.py",
    "test_planner.py", "test_host_kv_model.py",
)


def pytest_configure(config):
    """pytest-xdist's loadfile hands out the files with the most tests first unless told not to: keep ours.  The
    process that runs tests sets torch up; pytest-xdist's controller, which only hands out files, never imports it
    (2.5 s before its workers start)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput")):
        _set_up_torch()


def pytest_collection_modifyitems(config, items):
    """Collection order: the files of :data:`LONGEST_FIRST` first, in its order, then the others as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


_converting: list[subprocess.Popen] = []


def pytest_collection_finish(session) -> None:
    """Where the default model is not converted yet (a fresh machine: ~11 s on 2 cores), the first worker starts
    the conversion in a process of its own once the tests are collected, beside the first, longest files (which do
    not need it).  Left to the first test that needs it, the other worker's tests that need it too would wait for it
    with their core idle."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or not any("default_model_dir" in item.fixturenames
                                                                          for item in session.items):
        return
    from executor_proc.model.default_model import is_converted

    if not is_converted():
        path = python_path()
        _converting.append(subprocess.Popen(
            [sys.executable, "-c", "from executor_proc.model.default_model import ensure_default_model as e; e()"],
            cwd=ROOT, env=dict(os.environ, PYTHONPATH=path), stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))  # a failure shows where a test asks for the model itself


def pytest_unconfigure(config):
    for proc in _converting:  # a short run leaves the conversion whole
        proc.wait()


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "What is 12 times 12?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Name a planet with rings.",
    "How many legs does a spider have?",
    "Suggest a name for a pet turtle.",
]


@pytest.fixture
def tiny_model_dir(tmp_path) -> str:
    """A 2-layer model config folder (hidden 64, vocab 300): the benchmark scripts' CPU runs load it with random
    weights."""
    from tests.test_gpu_fastpath import write_config

    folder = tmp_path / "model"
    folder.mkdir()
    return write_config(folder, vocab=300)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from executor_proc.model.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    """The class AutoTokenizer picks, imported alone (AutoTokenizer's own import costs seconds more)."""
    from ipc.client.prompt import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def chat_prompt_ids(tokenizer) -> list[list[int]]:
    out = []
    for text in CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="session")
def hf_model():
    """HF transformers' model read from the default GGUF file, float32: the independent reference.

    Transformers takes tens of seconds to parse and dequantize a GGUF file on 2 cores, so the first test process
    to need it saves what HF made (its config and its own dequantized weights) beside the system's temporary
    files; the other processes (pytest-xdist workers, later runs) load that, under a file lock."""
    import fcntl

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from executor_proc.model.default_model import default_gguf_path
    from executor_proc.model.gguf_file import gguf_parsed_once

    gguf = default_gguf_path()
    st = os.stat(gguf)
    saved = os.path.join(tempfile.gettempdir(), f"forerun-hf-reference-{st.st_size}-{int(st.st_mtime)}-"
                                                f"{transformers.__version__}")
    with open(saved + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(os.path.join(saved, "config.json")):
            with gguf_parsed_once():  # its GGUF parse once, with the faster slicing: 25 -> 10.5 s on 2 cores
                model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                             dtype=torch.float32)
            # save_pretrained refuses a model read from GGUF: its config and weights (tied ones once) instead
            from safetensors.torch import save_model

            os.makedirs(saved + ".part", exist_ok=True)
            model.config.save_pretrained(saved + ".part")
            save_model(model, os.path.join(saved + ".part", "model.safetensors"))
            os.replace(saved + ".part", saved)
            return model.eval()
    return AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(hf_model, chat_prompt_ids) -> list[list[int]]:
    """HF's greedy generate of the chat prompts (each up to its EOS, at most 16 tokens), all in one left-padded batch:
    the same tokens as one prompt at a time (float32; checked when this was written), in an eighth of the steps.

    16 tokens: 9 of the 12 prompts (35 to 40 tokens) decode across a block boundary (position 48), and 5 end with
    EOS (after 8 to 15 tokens), the others by length."""
    import torch

    width = max(map(len, chat_prompt_ids))
    x = torch.tensor([[2] * (width - len(ids)) + ids for ids in chat_prompt_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chat_prompt_ids])
    with torch.inference_mode():
        y = hf_model.generate(x, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=2,
                              pad_token_id=2)
    outs = []
    for row in y[:, width:].tolist():
        outs.append(row[:row.index(2) + 1] if 2 in row else row)
    return outs


def _servers():
    """A factory that starts real `forerun serve` processes, and stops them all when its fixture ends."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        srv = ServerProcess(*args, tmpdir=run_dir())
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


# One factory per lifetime: a server lives only as long as the tests that use it (each real-model server holds
# about 1 GB, and an idle one still answers heartbeats).
server_factory = pytest.fixture(scope="session", name="server_factory")(_servers)  # the servers every module shares (model_server)
module_servers = pytest.fixture(scope="module", name="module_servers")(_servers)  # a module's own servers
servers = pytest.fixture(name="servers")(_servers)  # one test's servers


@pytest.fixture(scope="session")
def model_server(server_factory, default_model_dir):
    """One shared real-model server per pipeline depth, with invariant checks on."""
    cache: dict[int, ServerProcess] = {}

    def get(depth: int) -> ServerProcess:
        if depth not in cache:
            cache[depth] = server_factory("--pipeline-depth", str(depth), "--max-num-seqs", "32",
                                          "--num-kv-blocks", "512", "--debug-checks")
        return cache[depth]

    return get
