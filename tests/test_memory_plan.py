"""The device memory plan: its arithmetic (a pure function), and a server that refuses a configuration that
does not fit, with one line and no traceback."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest

from executor_proc.memory_plan import GIB, MemoryPlan, MemoryPlanError, StartupRefused, gc_threshold, plan_memory
from ipc.protocol import StepPlan
from tests.server_proc import ROOT, python_path

MIB = 1024**2
# The 8B shape's KV: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB a token, 2 MiB a block of 16.
BLOCK = 16 * 128 * 1024


def plan(**kw):
    args = dict(device="cuda:0", total=80 * GIB, utilization=0.9, weights=15 * GIB, activations=2 * GIB,
                graphs=1 * GIB, other=GIB // 2, block_bytes=BLOCK, block_size=16, max_model_len=8192)
    args.update(kw)
    return plan_memory(**args)


def test_the_kv_cache_gets_what_the_budget_leaves_in_whole_blocks():
    p = plan()
    left = int(80 * GIB * 0.9) - 15 * GIB - 2 * GIB - 1 * GIB - GIB // 2
    assert p.kv_blocks == left // BLOCK and p.kv_tokens == p.kv_blocks * 16
    assert p.kv <= left < p.kv + BLOCK
    assert p.planned + p.other <= p.budget == int(80 * GIB * 0.9)
    assert "weights 15.00 + activations 2.00 + graphs 1.00 + other 0.50 + KV" in p.line()
    assert f"KV {p.kv_tokens:,} tokens" in p.line() and "0.9 x 80.00 GiB" in p.line()


def test_the_allocator_is_held_to_the_plans_share_of_the_device():
    p = plan()
    assert abs(gc_threshold(p) * p.total - p.planned) < 1024
    assert gc_threshold(plan(utilization=1.0, other=0)) < 1.0  # torch takes (0, 1) only


def test_each_part_and_the_utilization_move_the_kv_cache():
    base = plan().kv_blocks
    assert plan(graphs=3 * GIB).kv_blocks == base - 2 * GIB // BLOCK
    assert plan(activations=3 * GIB).kv_blocks == base - GIB // BLOCK
    assert plan(utilization=0.95).kv_blocks > base
    assert plan(useful_blocks=600).kv_blocks == 600  # no more than the slots can fill


def test_a_plan_that_cannot_hold_one_request_is_refused_with_the_numbers_and_the_flags():
    # 14.5 GiB of parts leave 0.5 GiB of a 15 GiB budget: 4,096 tokens of 128 KiB, short of 8,192.
    with pytest.raises(MemoryPlanError) as e:
        plan(total=20 * GIB, utilization=0.75, weights=12 * GIB, activations=GIB, graphs=GIB, other=GIB // 2)
    msg = str(e.value)
    assert "\n" not in msg
    assert "--max-model-len 8,192" in msg and "needs 1.00 GiB" in msg and "leaves 0.50 GiB" in msg
    assert "raise --gpu-memory-utilization to 0.78" in msg  # (14.5 + 1) / 20 = 0.775, rounded up
    assert "lower --max-model-len to 4,096" in msg
    assert "--max-num-seqs" in msg and "--max-num-batched-tokens" in msg
    # Exactly one request fits: no refusal.
    assert plan(total=20 * GIB, utilization=0.775, weights=12 * GIB, activations=GIB, graphs=GIB,
                other=GIB // 2).kv_tokens == 8192


def test_nothing_left_refuses_without_suggesting_a_length_or_an_impossible_utilization():
    with pytest.raises(MemoryPlanError) as e:
        plan(weights=75 * GIB)
    msg = str(e.value)
    assert "--gpu-memory-utilization to" not in msg and "--max-model-len to" not in msg
    assert "lower --max-num-seqs" in msg


def test_the_cpu_plan_says_host_memory_is_not_planned():
    p = MemoryPlan("cpu", 2 * GIB, 1.0, 10 * MIB, 0, 0, 0, kv_blocks=8, block_bytes=BLOCK, block_size=16)
    assert "host memory is not planned" in p.line() and "at most a fixed 2.00 GiB" in p.line()
    assert "KV 0.02 GiB = 128 tokens" in p.line()


def test_serve_refuses_a_context_the_kv_budget_cannot_hold(tmp_path):
    """A real `forerun serve`: the cpu's fixed 2 GiB KV budget against a 16M-token context (a tiny model of
    2 layers x 2 KV heads x 16 x 2 (K, V) x 4 bytes = 512 bytes a token: 8 GiB a request)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
        max_position_embeddings=1 << 24, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)))
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "serve", "--quiet", "--device", "cpu",
                          "--load-format", "dummy", "--model", str(tmp_path), "--max-model-len", str(1 << 24),
                          "--max-num-seqs", "1", "--address", f"ipc://{tmp_path}/s.sock"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out
    assert "Traceback" not in out and "Error" not in out, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("forerun: the KV cache cannot hold one request"), out
    assert "--max-model-len 16,777,216" in lines[0] and "lower --max-model-len to" in lines[0]


def test_prompt_logprobs_in_slices_equal_one_pass(monkeypatch):
    """The eager step's prompt logprobs, computed LOGITS_ROWS positions at a time, equal one pass over every
    position, the kept hidden row of a slot's previous chunk included; one slice of logits is alive at a time,
    whatever the rows' lengths (a short row after a long one is not joined to its last slice: the start-up
    profile's one long row bounds it), and a chunk keeps its last hidden row, not its logits."""
    import weakref

    import torch

    from executor_proc.backends.torch_backend import TorchBackend
    from executor_proc.step import prompt_logprobs as pl_mod
    from executor_proc.step.prompt_logprobs import SavedHidden, compute_prompt_logprobs, plan_prompt_logprobs
    from executor_proc.step.slot_tables import SlotInfo

    torch.manual_seed(0)
    # small integers: the LM head's sums are exact, whatever rows a matrix product groups
    weight = torch.randint(-3, 4, (8, 50)).float()
    extra, kept3 = torch.randint(-3, 4, (23, 8)).float(), torch.randint(-3, 4, (8,)).float()
    # slot 3 continues its prompt at 7 (its kept row reports position 7); slot 5's first chunk keeps its last
    info = {3: SlotInfo(prompt_logprobs=4, num_prompt_tokens=17), 5: SlotInfo(prompt_logprobs=2, num_prompt_tokens=40)}
    chunk3, chunk5 = list(range(30, 40)), list(range(10, 24))
    step = StepPlan(0, [3, 5], [10, 14], [7, 0], [True, True], [True, False], prefill_tokens=chunk3 + chunk5)
    saved = SavedHidden()
    saved.by_slot[3] = (7, kept3)
    plan = plan_prompt_logprobs(step, info, saved)
    assert [(r.row, r.first, r.count, r.n) for r in plan.rows] == [(0, 7, 10, 4), (1, 1, 13, 2)]
    assert plan.saved == [3] and plan.saves == [(5, 14, 22)] and len(plan.targets) == 1 + 23
    targets, nums = torch.tensor(plan.targets), torch.tensor(plan.nums, dtype=torch.int32)
    # the reference: one pass over the reported positions' logits, in order
    want = TorchBackend.token_logprobs(torch.cat([kept3[None], extra[:22]]) @ weight,
                                       torch.tensor(chunk3 + chunk5[1:]),
                                       torch.tensor([4] * 10 + [2] * 13, dtype=torch.int32))
    calls, live = [], [0, 0]  # rows of logits alive now, and the most alive at once

    def head(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        out = x @ weight
        live[0] += len(x)
        live[1] = max(live)
        weakref.finalize(out, lambda n=len(x): live.__setitem__(0, live[0] - n))
        return out

    for rows in (1, 4, 8, 1024):
        monkeypatch.setattr(pl_mod, "LOGITS_ROWS", rows)
        calls.clear()
        live[:] = [0, 0]
        saved.by_slot = {3: (7, kept3)}
        ids, lps = compute_prompt_logprobs(TorchBackend, lambda a, b: extra[a:b], head, plan, saved, targets, nums)
        assert torch.equal(ids[plan.order], want[0]) and torch.equal(lps[plan.order], want[1]), rows
        assert saved.by_slot[5][0] == 14 and torch.equal(saved.by_slot[5][1], extra[22])
        assert max(calls) <= rows and live[1] <= rows, (rows, calls, live)


def test_kv_memory_fraction_is_a_deprecated_alias(capsys):
    from scheduler_proc.launch import build_parser, server_config

    def utilization(*flags):
        return server_config(build_parser().parse_args(["serve", *flags])).executor.gpu_memory_utilization

    assert utilization() == 0.9 and capsys.readouterr().err == ""
    assert utilization("--gpu-memory-utilization", "0.8") == 0.8
    assert utilization("--kv-memory-fraction", "0.7") == 0.7
    assert "--kv-memory-fraction is deprecated" in capsys.readouterr().err
    assert utilization("--kv-memory-fraction", "0.7", "--gpu-memory-utilization", "0.85") == 0.85
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        utilization("--gpu-memory-utilization", "1.5")


def test_the_profile_steps_run_the_full_budget_in_short_and_long_rows(tmp_path):
    """The start-up profile (vLLM's profile run): the full token budget with prompt logprobs, sampling and penalties,
    in as many short rows as there are slots and in rows as long as the context; both run on a real worker."""
    from executor_proc.build import ProfileStep, build_worker
    from ipc.config import ExecutorConfig
    from tests.test_gpu_fastpath import write_config

    cfg = ExecutorConfig(model=write_config(tmp_path), plan_addr="", result_addr="", load_format="dummy",
                         device="cpu", dtype="float32", num_slots=8, num_kv_blocks=64, block_size=4,
                         max_num_batched_tokens=150, kernels="torch")
    short, long = ProfileStep.layouts(cfg, max_len=64, vocab=97)
    assert short.rows == [19] * 6 + [18] * 2 and long.rows == [50] * 3  # 150 tokens both ways, rows <= 64
    assert short.num_blocks == 1 + 8 * 5 and long.num_blocks == 1 + 3 * 13
    worker = build_worker(cfg).worker
    for i, probe in enumerate((short, long)):
        for plan in probe.plans(first_step_id=2 * i):
            worker.launch(worker.prepare(plan))
        assert len(worker.saved_hidden.by_slot) == 0  # whole prompts: no chunk's last hidden row kept
    # a budget the slots cannot fill in long rows is one layout
    assert len(ProfileStep.layouts(cfg, max_len=16, vocab=97)) == 1


def test_a_draft_model_adds_its_weights_and_its_kv_bytes_to_every_block():
    draft_block = BLOCK // 8  # a draft of a quarter of the layers and half the KV heads
    p = plan(draft_weights=GIB, draft_block_bytes=draft_block)
    left = int(80 * GIB * 0.9) - 15 * GIB - GIB - 2 * GIB - 1 * GIB - GIB // 2
    assert p.kv_blocks == (left - draft_block) // (BLOCK + draft_block)  # and the draft's scratch block
    assert p.draft_kv == (p.kv_blocks + 1) * draft_block and p.kv == p.kv_blocks * BLOCK + p.draft_kv
    assert p.planned == 15 * GIB + GIB + 2 * GIB + GIB + p.kv and p.planned + p.other <= p.budget
    assert "weights 15.00 + draft weights 1.00 + activations 2.00" in p.line()
    assert f"(draft {p.draft_kv / GIB:.2f})" in p.line() and "the model's and the draft's KV" in p.line()
    assert p.as_dict()["draft_kv"] == p.draft_kv
    # one request of 8,192 tokens fits exactly without a draft; with one, it is refused, the draft counted
    fits = dict(total=20 * GIB, utilization=0.775, weights=12 * GIB, activations=GIB, graphs=GIB, other=GIB // 2)
    assert plan(**fits).kv_tokens == 8192
    with pytest.raises(MemoryPlanError) as e:
        plan(**fits, draft_weights=GIB // 4, draft_block_bytes=draft_block)
    assert "weights 12.25 + activations" in str(e.value) and "needs 1.13 GiB" in str(e.value)
    cpu = MemoryPlan("cpu", 2 * GIB, 1.0, 10 * MIB, 0, 0, 0, 8, BLOCK, 16, draft_weights=5 * MIB,
                     draft_block_bytes=BLOCK)
    assert "weights 0.01 + draft 0.00 GiB, KV 0.03 (draft 0.02) GiB = 128 tokens" in cpu.line()


def test_serve_refuses_a_model_it_cannot_run_in_one_line(tmp_path):
    """An architecture forerun does not serve: `forerun serve` ends with the loader's reason in one line naming
    --model, no traceback (the other refusals of a model take the same path: the next test)."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(dict(architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "serve", "--quiet", "--device", "cpu",
                          "--load-format", "dummy", "--model", str(tmp_path), "--address", f"ipc://{tmp_path}/s.sock"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert run.returncode == 1 and "Traceback" not in out, out
    assert len(lines) == 1 and lines[0].startswith(f"forerun: --model {tmp_path}: unsupported architecture "
                                                   f"'GPT2LMHeadModel'; forerun supports LlamaForCausalLM"), out


@contextlib.contextmanager
def address_space_headroom(extra: int):
    """While it runs this process may map at most ``extra`` bytes more than it has mapped (RLIMIT_AS): an allocation
    that a check should have refused, or that is meant to fail, fails there and never takes the host's memory."""
    import resource

    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(hard, mapped + extra)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("case", ["no such GPU", "host memory", "past the address space", "context past the model's"])
def test_startup_refusals_name_the_flag(tmp_path, case):
    """A GPU the machine lacks, a KV cache larger than the host's memory (the allocation that failed, and the flag
    that sizes it), a context past the model's positions: the executor's start-up raises StartupRefused (one line to
    the user) naming the flag to change."""
    import json

    import msgspec
    import torch

    from executor_proc.build import build_worker
    from scheduler_proc.launch import build_parser, server_config

    if case == "no such GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)))
    flags, expect = {
        "no such GPU": (["--device", "cuda"], "--device cuda: this machine has no CUDA device"),
        "host memory": (["--num-kv-blocks", str(10 ** 9)], "--num-kv-blocks 1,000,000,000: the KV cache would take "
                                                            "7,629.4 GiB, more than the "),
        "past the address space": (["--num-kv-blocks", str(10 ** 14)], "--num-kv-blocks 100,000,000,000,000: the KV "
                                                                       "cache would take 762,939,453.1 GiB"),
        "context past the model's": (["--max-model-len", "300"], f"--max-model-len 300 exceeds the 256 positions "
                                     f"--model {tmp_path} runs (max_position_embeddings): use at most 256"),
    }[case]
    cfg = server_config(build_parser().parse_args(["serve", "--device", "cpu", "--load-format", "dummy", *flags]))
    # the model as the launcher hands it to the executor
    with pytest.raises(StartupRefused) as refused, address_space_headroom(8 * GIB):
        build_worker(msgspec.structs.replace(cfg.executor, model=str(tmp_path)))
    assert str(refused.value).startswith(expect) and "\n" not in str(refused.value), refused.value
    if case in ("host memory", "past the address space"):  # before any allocation: the flag that sizes it
        assert str(refused.value).endswith("GiB of host memory available; lower --num-kv-blocks"), refused.value


@pytest.mark.parametrize("flags, expect", [
    (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
    (["--executor-threads", "0"], "--executor-threads must be at least 1, got 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be at least 0"),
    (["--executor-hang-timeout", "0"], "--executor-hang-timeout must be positive"),
    (["--batch-invariant", "--kernels", "torch"], "--batch-invariant needs the Triton kernels: --kernels triton"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in (0, 1], got 2"),
    (["--max-model-len", "1"], "--max-model-len must be at least 2, got 1"),  # a prompt token and an output one
])
def test_config_refusals_say_the_flag_not_the_config_field(flags, expect):
    """``forerun serve`` with a value its config refuses: one line naming the flag the user typed (the config's own
    field names, ``num_slots`` or ``kernels='triton'``, mean nothing on the command line)."""
    from scheduler_proc.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--device", "cpu", "--load-format", "dummy", *flags])
    assert str(exit_.value).startswith(f"forerun: {expect}"), exit_.value


def test_a_model_path_that_is_no_config_says_so(tmp_path):
    """``--load-format hf`` or ``dummy`` on a file that is not a JSON config (a GGUF file, a text file): what it is
    not, in one line (the bare decode error once was the whole message)."""
    from executor_proc.model.config import ModelConfig

    (tmp_path / "m.gguf").write_bytes(b"GGUF\x03\x00\xc3\x28" * 8)
    (tmp_path / "notes.txt").write_text("not a config")
    for name, hint in (("m.gguf", ": a .gguf file loads with --load-format gguf (or auto)"), ("notes.txt", "")):
        with pytest.raises(ValueError) as e:
            ModelConfig.from_pretrained(str(tmp_path / name))
        assert str(e.value).startswith("not a folder with config.json nor a JSON model config (")
        assert str(e.value).endswith(hint) and "\n" not in str(e.value)


def test_the_hang_timeout_waits_longer_for_triton_s_interpreter():
    """``--kernels triton`` on the CPU runs Triton's interpreter, whose first steps take minutes: the hang timeout's
    floor is 600 s there unless the flag says otherwise (at 30 s every request was given up as a hang)."""
    from scheduler_proc.launch import build_parser, server_config

    def hang(*flags: str) -> float:
        return server_config(build_parser().parse_args(["serve", "--device", "cpu", *flags])).executor_hang_timeout_s

    assert hang() == 30.0 and hang("--kernels", "triton") == 600.0
    assert hang("--kernels", "triton", "--executor-hang-timeout", "45") == 45.0
    assert hang("--executor-hang-timeout", "5") == 5.0


def test_slots_past_half_the_host_memory_are_refused_naming_the_flag():
    """On the CPU the slots' tables live in host memory, whose overcommitted allocations succeed until the kernel
    kills a process (100,000 slots of the default model: ~23 GiB, the whole VM): more than half of what the host
    has available is refused in one line naming --max-num-seqs and a count that fits."""
    from executor_proc.host_memory import check_host_slots

    vocab, max_len, blocks = 49152, 8192, 512
    check_host_slots(256, blocks, vocab, max_len, available=1 << 30)  # 256 slots: ~62 MiB
    with pytest.raises(StartupRefused) as refused:
        check_host_slots(100_000, blocks, vocab, max_len, available=8 << 30)
    message = str(refused.value)
    assert message.startswith("--max-num-seqs 100,000: the slots' tables take 23.") and "\n" not in message, message
    fit = int(message.rsplit("use --max-num-seqs ", 1)[1].split()[0].replace(",", ""))
    assert 15_300 < fit < 15_700  # 90% of 4 GiB of 0.237 MiB slots
    check_host_slots(fit, blocks, vocab, max_len, available=int(0.95 * (8 << 30)))  # taken with a little less free


def test_weights_past_the_host_memory_available_are_refused_before_they_are_allocated():
    """On the cpu the weights live in host memory: weights (parameters x dtype size, from the config alone) past
    what the host has available are refused in one line with the two figures and what makes them smaller; the
    model is never built (Llama 3 8B in float32: 29.9 GiB, in bfloat16 half)."""
    import torch

    from executor_proc.model.config import ModelConfig
    from executor_proc.model.loader import check_host_memory

    config = ModelConfig.from_pretrained(os.path.join(ROOT, "scripts", "configs", "llama-3-8b"))
    with pytest.raises(ValueError) as refused:
        check_host_memory(config, torch.float32, available=20 * GIB)
    assert str(refused.value) == ("its weights take 29.9 GiB in float32, more than the 20.0 GiB of host memory "
                                  "available; use dtype='bfloat16' or a smaller model"), refused.value
    check_host_memory(config, torch.bfloat16, available=20 * GIB)
    with pytest.raises(ValueError, match=r"^its weights take 15.0 GiB in bfloat16, more than the 10.0 GiB .*; use a "
                                         r"smaller model$"):
        check_host_memory(config, torch.bfloat16, available=10 * GIB)
    with pytest.raises(ValueError) as refused:  # bfloat16 offered only where half the bytes fit
        check_host_memory(config, torch.float32, available=10 * GIB)
    assert str(refused.value).endswith("; use a smaller model"), refused.value
    # data-parallel replicas on the cpu load a copy each, at once: two of 15 GiB do not fit 20
    with pytest.raises(ValueError) as refused:
        check_host_memory(config, torch.bfloat16, available=20 * GIB, replicas=2)
    assert str(refused.value) == ("its weights take 2 replicas of 15.0 GiB in bfloat16, more than the 20.0 GiB of "
                                  "host memory available; use fewer replicas (--data-parallel-size) or a smaller "
                                  "model"), refused.value


def test_cpu_replicas_share_the_hosts_memory():
    from ipc.config import ExecutorConfig
    from scheduler_proc.config import ServerConfig
    from scheduler_proc.replica import replica_config

    cfg = ServerConfig(executor=ExecutorConfig(device="cpu"))
    assert replica_config(cfg, 1, "ipc:///tmp/r1.sock", None, 3).executor.host_replicas == 3
    assert replica_config(cfg, 1, "ipc:///tmp/r1.sock", "1", 3).executor.host_replicas == 1  # a GPU each


def _huge_model(folder) -> str:
    """A config of a model no host holds (a vocabulary of 16M tokens, 16,384 wide: 2 TiB of float32 weights)."""
    import json

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=16384, intermediate_size=256,
        num_hidden_layers=1, num_attention_heads=128, num_key_value_heads=8, vocab_size=1 << 24,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)))
    return str(folder)


def _limit_address_space(limit: int) -> None:
    """RLIMIT_AS for a child: an allocation a check should have refused fails there, it never takes the host's
    memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))


def test_serve_refuses_weights_the_host_cannot_hold_in_one_line(tmp_path):
    """A real `forerun serve` of weights larger than the host's memory: refused before they are allocated, in one
    line naming --model, the figures and --dtype (under a 16 GiB address-space limit: without the check, the
    allocation fails there, as "the host ran out of memory")."""
    model = _huge_model(tmp_path / "huge")
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "scheduler_proc.launch", "serve", "--quiet", "--device", "cpu",
                          "--load-format", "dummy", "--model", model, "--address", f"ipc://{tmp_path}/s.sock"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: _limit_address_space(16 * GIB))
    out = run.stdout + run.stderr
    lines = [line for line in out.splitlines() if line.strip()]
    assert run.returncode == 1 and "Traceback" not in out, out
    assert len(lines) == 1 and lines[0].startswith(f"forerun: --model {model}: its weights take 2050.2 GiB in "
                                                   f"float32, more than the "), out
    assert lines[0].endswith(" GiB of host memory available; use a smaller model"), out  # bfloat16 would not fit


def test_weights_the_host_fails_to_allocate_are_named_with_their_advice(tmp_path, monkeypatch):
    """Weights that pass the host-memory check but whose allocation fails anyway (a ulimit, memory taken since): the
    refusal names the weights and what makes them smaller, not the KV cache's flags."""
    import msgspec

    from executor_proc.build import build_worker
    from executor_proc.model import loader
    from scheduler_proc.launch import build_parser, server_config

    model = _huge_model(tmp_path / "huge")
    monkeypatch.setattr(loader, "available_host_bytes", lambda: 1 << 60)  # the check passes
    cfg = server_config(build_parser().parse_args(["serve", "--device", "cpu", "--load-format", "dummy"]))
    with pytest.raises(StartupRefused) as refused, address_space_headroom(8 * GIB):
        build_worker(msgspec.structs.replace(cfg.executor, model=model))
    message = str(refused.value)
    assert message.startswith(f"the host ran out of memory while allocating the weights of --model {model} ("), message
    assert message.endswith("; use dtype='bfloat16' or a smaller model") and "\n" not in message, message


def test_a_host_tier_size_without_prefix_caching_is_refused():
    """The host KV tier keeps prefix-cache blocks: a size given with --no-prefix-caching did nothing, silently."""
    from scheduler_proc.launch import build_parser, server_config

    with pytest.raises(ValueError, match="^--num-host-kv-blocks sizes the host KV tier, which keeps prefix-cache"):
        server_config(build_parser().parse_args(["serve", "--no-prefix-caching", "--num-host-kv-blocks", "64"]))
    cfg = server_config(build_parser().parse_args(["serve", "--no-prefix-caching"]))
    assert cfg.executor.host_kv_gib == 0.0 and not cfg.enable_prefix_caching


def test_the_cpu_kv_cache_counts_every_process_on_the_host():
    """On the cpu every tensor-parallel rank of every data-parallel replica holds a KV cache in the same host
    memory: the default budget is shared among them, and a --num-kv-blocks that fits one process but not all of
    them is refused (three ranks of 18 GiB each started on a 22 GiB host)."""
    import msgspec
    import torch

    from executor_proc.build import CPU_KV_BUDGET_BYTES, _plan
    from executor_proc.host_memory import check_host_kv
    from scheduler_proc.launch import build_parser, server_config

    check_host_kv(100, GIB // 2, given=True, processes=3, available=200 * GIB)
    with pytest.raises(MemoryPlanError, match=r"^--num-kv-blocks 100: the KV cache would take 3 x 100.0 GiB \(one "
                                              r"a process\), more than the 250.0 GiB of host memory available"):
        check_host_kv(100, GIB, given=True, processes=3, available=250 * GIB)
    cfg = server_config(build_parser().parse_args(["serve", "--device", "cpu", "--load-format", "dummy"])).executor
    per_block = 2**20
    for tp, replicas in ((1, 1), (2, 1), (2, 3)):
        shared = msgspec.structs.replace(cfg, tensor_parallel_size=tp, host_replicas=replicas)
        plan = _plan(shared, torch.device("cpu"), None, 0, per_block, 0, 10**9, None)
        assert plan.kv_blocks == CPU_KV_BUDGET_BYTES // (tp * replicas) // per_block, (tp, replicas)
