"""`forerun serve` and `forerun chat` refuse a bad command line in one line naming the flag and its limit: exit 1, no
traceback, nothing left in the run directory's parent; and what they print for help and for the server's errors.

Real processes where the exit and the leftovers are the point (each refusal about 0.5 s: it comes before the model
loads), the functions themselves otherwise.  About 15 s on 2 cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from scheduler_proc.cli_flags import MAX_API_WORKERS, PER_CPU, usable_cpus
from tests.server_proc import ROOT, python_path, run_dir

CPU_LIMIT = PER_CPU * usable_cpus()
SCRIPTED = ("--load-format", "scripted")


def _run(*args: str, folder: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """``forerun ARGS`` with its run directories under ``folder`` (FORERUN_RUN_DIR)."""
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=folder, **(env or {}))
    env.pop("FORERUN_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "scheduler_proc.launch", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _assert_refused(run: subprocess.CompletedProcess, *expect: str) -> None:
    """Exit 1, one line on stderr holding each of ``expect``, nothing on stdout, no traceback."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 1, (run.returncode, run.stderr)
    assert len(lines) == 1 and lines[0].startswith("forerun: "), run.stderr
    assert all(e in lines[0] for e in expect), (expect, lines[0])
    assert "Traceback" not in run.stderr and run.stdout == "", (run.stdout, run.stderr)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Things that are not tokenizers, a folder that is not a file."""
    base = tmp_path_factory.mktemp("not_tokenizers")
    (base / "notes.txt").write_text("hello\n")
    (base / "hello").mkdir()
    (base / "hello" / "tokenizer.json").write_text("hello\n")
    (base / "config").mkdir()
    (base / "config" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": '
                                                    '{"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"}}')
    (base / "config" / "tokenizer_config.json").write_text("{")
    (base / "empty").mkdir()
    return {"text": str(base / "notes.txt"), "hello": str(base / "hello"), "config": str(base / "config"),
            "empty": str(base / "empty"), "folder": str(base)}


SERVE_REFUSALS = [
    # (flags, what the line says)
    (["--api-workers", "100"], ["--api-workers must be in [1, ", "per CPU", "got 100"]),
    (["--api-workers", "0"], ["--api-workers must be at least 1, got 0"]),  # without --port too
    (["--api-workers", str(min(MAX_API_WORKERS, CPU_LIMIT) + 1), "--port", "0"], ["--api-workers must be in"]),
    (["--data-parallel-size", "99999"], ["--data-parallel-size must be in [1, 64], got 99999"]),
    (["--data-parallel-size", str(CPU_LIMIT + 1)], [f"--data-parallel-size must be in [1, {CPU_LIMIT}] on the cpu"]),
    (["--data-parallel-size", "0"], ["--data-parallel-size must be at least 1, got 0"]),
    (["--executor-threads", "100000"], [f"--executor-threads must be in [1, {CPU_LIMIT}]", "got 100000"]),
    (["--address", "tcp://127.0.0.1:99999"], ["--address tcp://127.0.0.1:99999: the port must be in [1, 65535]"]),
    (["--address", "tcp://127.0.0.1"], ["--address tcp://127.0.0.1: the port must be in [1, 65535], got none"]),
    (["--port", "70000"], ["--port must be in [0, 65535], got 70000"]),
    (["--step-log", "/nonexistent-dir/x.jsonl"], ["--step-log /nonexistent-dir/x.jsonl: No such file or directory"]),
    (["--step-log", "{folder}"], ["--step-log ", ": Is a directory"]),
    (["--restart-window", "0"], ["--restart-window must be positive, got 0.0"]),
    (["--grammar-compile-timeout", "0"], ["--grammar-compile-timeout must be positive, got 0.0"]),
    (["--scripted-step-ms", "-5"], ["--scripted-step-ms must be a finite number of milliseconds >= 0, got -5"]),
    (["--scripted-eos-at", "1:-3"], ["--scripted-eos-at 1:-3: POS must be in [0, 2^63-1], got -3"]),
    (["--num-speculative-tokens", "3"], ["--num-speculative-tokens needs --speculative-method"]),
    (["--ngram-min", "2"], ["--ngram-min needs --speculative-method ngram (got --speculative-method off)"]),
    (["--ngram-max", "3"], ["--ngram-max needs --speculative-method ngram"]),
    (["--api-key", ""], ["--api-key is an empty key"]),
    (["--model", ""], ["--model is empty"]),
    (["--host", "0.0.0.0"], ["--host needs --port (the HTTP API's address; the SDK's is --address)"]),
    (["--port", "0", "--host", " "], ["--host is empty"]),
    (["--api-tokenizer-threads", "100000"], ["--api-tokenizer-threads must be in [1, 64] (each a thread of every "
                                             "gateway worker), got 100000"]),
    (["--port", "0", "--host", "0.0.0.0"], ["--host 0.0.0.0 makes the HTTP API reachable from other machines and no "
                                            "API key is set", "--allow-unauthenticated"]),
    (["--tokenizer", "/nonexistent-dir"], ["--tokenizer '/nonexistent-dir' does not exist"]),
    (["--tokenizer", "{empty}"], ["--tokenizer ", "has none of tokenizer.json"]),
    (["--tokenizer", "{text}"], ["--tokenizer ", "notes.txt: not a tokenizer.json", "expected value"]),
    (["--tokenizer", "{hello}"], ["--tokenizer ", "tokenizer.json: not a tokenizer.json"]),
    (["--tokenizer", "{config}"], ["--tokenizer ", "tokenizer_config.json: not valid JSON"]),
]


@pytest.mark.parametrize("flags, expect", SERVE_REFUSALS, ids=[" ".join(f) for f, _ in SERVE_REFUSALS])
def test_serve_refuses_in_one_line_and_leaves_no_run_directory(flags, expect, files, tmp_path):
    flags = [f.format(**files) for f in flags]
    run = _run("serve", *SCRIPTED, "--quiet", *flags, folder=str(tmp_path))
    _assert_refused(run, *expect)
    assert os.listdir(tmp_path) == []  # no forerun-XXXX run directory, no sockets


@pytest.mark.parametrize("flags, expect", [
    (["-tp", str(CPU_LIMIT + 1)], f"--tensor-parallel-size {CPU_LIMIT + 1} starts {CPU_LIMIT + 1} executor processes "
                                  f"on the cpu; at most {CPU_LIMIT} run there"),
    (["-tp", "2", "-dp", str(CPU_LIMIT // 2 + 1)], f"--tensor-parallel-size 2 x --data-parallel-size "
                                                   f"{CPU_LIMIT // 2 + 1} starts {2 * (CPU_LIMIT // 2 + 1)} executor")])
def test_executor_ranks_past_what_the_cpu_runs_are_refused_before_any_starts(flags, expect, tmp_path):
    """Each rank imports torch before its shard is checked (~2 s and ~100 MB apiece): the count is refused first."""
    from tests.test_gpu_fastpath import write_config

    (tmp_path / "m").mkdir()
    run = _run("serve", "--quiet", "--device", "cpu", "--load-format", "dummy", "--model", write_config(tmp_path / "m"),
               *flags, folder=str(tmp_path / "m"))
    _assert_refused(run, expect)


@pytest.mark.parametrize("flags, expect", [
    (["--scripted-step-ms", "3"], "--scripted-step-ms needs --load-format scripted (got --load-format dummy)"),
    (["--scripted-eos-at", "1:3"], "--scripted-eos-at needs --load-format scripted (got --load-format dummy)"),
    (["--speculative-method", "draft", "--ngram-min", "2"], "--ngram-min needs --speculative-method ngram (got "
                                                             "--speculative-method draft)"),
])
def test_flags_that_would_be_ignored_are_refused(flags, expect):
    """In process: each refusal is a SystemExit with the line, before any model is read."""
    from scheduler_proc.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--load-format", "dummy", *flags])
    assert str(exit_.value) == f"forerun: {expect}"


def test_flags_given_with_what_they_need_take_effect_and_defaults_stay():
    from ipc.config import ScriptedOptions, SpeculativeConfig, default_of
    from scheduler_proc.launch import build_parser, server_config

    def executor(*flags):
        return server_config(build_parser().parse_args(["serve", *flags])).executor

    sc = executor("--speculative-method", "ngram", "--ngram-min", "2", "--ngram-max", "5",
                  "--num-speculative-tokens", "3").speculative
    assert (sc.ngram_min, sc.ngram_max, sc.num_tokens) == (2, 5, 3)
    sc = executor("--speculative-method", "ngram").speculative
    assert (sc.ngram_min, sc.ngram_max, sc.num_tokens) == tuple(
        default_of(SpeculativeConfig, n) for n in ("ngram_min", "ngram_max", "num_tokens"))
    scripted = executor(*SCRIPTED, "--scripted-step-ms", "5", "--scripted-eos-at", "7:12").scripted
    assert (scripted.step_latency_s, scripted.eos_at) == (0.005, {7: 12})
    assert executor(*SCRIPTED).scripted.step_latency_s == default_of(ScriptedOptions, "step_latency_s")


def test_config_errors_name_the_flag():
    from scheduler_proc.cli_flags import in_flag_names

    assert in_flag_names("restart_window_s must be positive, got 0.0") == "--restart-window must be positive, got 0.0"
    assert (in_flag_names("grammar_compile_timeout_s must be positive, got 0.0")
            == "--grammar-compile-timeout must be positive, got 0.0")
    # A draft model that cannot be read: the hint is the draft's own flag, not --load-format.
    draft = in_flag_names("--draft-model /d: cannot tell the weight format of '/d': expected a .gguf file (use "
                          "load_format='dummy' for random weights from a config.json)")
    assert "use --draft-load-format dummy for random weights" in draft, draft
    model = in_flag_names("--model /m: cannot tell the weight format of '/m': expected a .gguf file (use "
                          "load_format='dummy' for random weights from a config.json)")
    assert "use --load-format dummy for random weights" in model, model


def test_flag_names_leave_a_traceback_as_it_is():
    """An executor's failure quotes its traceback: the message before it names flags, the source lines after it stay
    as they are (``load_format == "gguf"`` in a quoted line once read ``--load-format == "gguf"``)."""
    from scheduler_proc.cli_flags import in_flag_names

    trace = ('Traceback (most recent call last):\n  File "/x/loader.py", line 98, in load_model\n'
             '    reader = open_gguf(path) if load_format == "gguf" else None\nIndexError: num_slots')
    message = f"the executor failed while loading:\nIndexError: bad num_slots\n{trace}"
    assert in_flag_names(message) == f"the executor failed while loading:\nIndexError: bad --max-num-seqs\n{trace}"


def _tiny_hf_folder(folder) -> str:
    """A config.json of a tiny Llama and its weights in model.safetensors (not the config's: only the file's header
    is read before a refusal)."""
    import json

    import torch
    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)))
    save_file({f"t{i}": torch.zeros(64, 64) for i in range(4)}, str(folder / "model.safetensors"))
    return str(folder)


def _spoil(file: str, how: str) -> None:
    """Cut ``file`` in half, fill it with bytes of no format, or empty it."""
    with open(file, "rb") as f:
        content = f.read()
    content = {"truncated": content[:len(content) // 2], "garbage": bytes(range(256)) * 8, "empty": b""}[how]
    with open(file, "wb") as f:
        f.write(content)


SAFETENSORS_REFUSALS = {
    "truncated": "(incomplete metadata, file not fully covered: truncated?)",
    "garbage": "(header too large: another format, or a damaged file?)",
    "empty": "(header too small: an empty file)",
}


@pytest.mark.parametrize("how", SAFETENSORS_REFUSALS)
def test_an_unreadable_safetensors_file_is_named_in_one_line(tmp_path, how):
    """The loader's error for a safetensors file it cannot read names the file and what is wrong, as a ValueError
    (what the executor's start-up turns into a refusal naming --model), not safetensors' own error type."""
    import torch

    from executor_proc.model.loader import load_model

    folder = _tiny_hf_folder(tmp_path / "m")
    _spoil(os.path.join(folder, "model.safetensors"), how)
    with pytest.raises(ValueError) as refused:
        load_model(folder, "auto", "cpu", torch.float32)
    expect = f"model.safetensors is not a readable safetensors file {SAFETENSORS_REFUSALS[how]}"
    assert str(refused.value) == expect, refused.value


@pytest.mark.parametrize("index, expect", [
    ('{"metadata": {}}', '"weight_map" must map tensor names to the folder\'s .safetensors files, got None'),
    ('{"weight_map": [1]}', '"weight_map" must map tensor names .* got \\[1\\]'),
    ('{"weight_map": {}}', '"weight_map" must map tensor names .* got {}'),
    ('[1, 2]', "cannot be read as a safetensors index .*'list' object has no attribute 'get'"),
    ('{"weight_map": ', "cannot be read as a safetensors index .*Expecting value"),
])
def test_a_broken_safetensors_index_is_named_in_one_line(tmp_path, index, expect):
    """A model.safetensors.index.json that is no JSON, or no map of tensor names to files, is refused naming the
    index file (it was a KeyError / AttributeError traceback)."""
    import torch

    from executor_proc.model.loader import load_model

    folder = _tiny_hf_folder(tmp_path / "m")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(index)
    with pytest.raises(ValueError, match=f"model.safetensors.index.json.*{expect}"):
        load_model(folder, "auto", "cpu", torch.float32)


def test_a_config_file_given_as_the_model_is_served_under_its_folders_name(tmp_path):
    from ipc.models import resolve_model

    folder = _tiny_hf_folder(tmp_path / "tiny-llama")
    assert resolve_model(os.path.join(folder, "config.json"), "dummy").name == "tiny-llama"
    assert resolve_model(folder, "dummy").name == "tiny-llama"


@pytest.mark.parametrize("case", ["a truncated model.safetensors", "a GGUF file cut in its metadata"])
def test_serve_refuses_an_unreadable_model_file_in_one_line(tmp_path, case):
    """``forerun serve --model`` of a model file cut short: one line naming the flag and what is wrong with the file,
    no traceback (each about 5 s: the executor starts and refuses before allocating)."""
    if case == "a truncated model.safetensors":
        model = _tiny_hf_folder(tmp_path / "m")
        _spoil(os.path.join(model, "model.safetensors"), "truncated")
        expect = "model.safetensors is not a readable safetensors file (incomplete metadata, file not fully covered"
    else:
        from executor_proc.model.default_model import default_gguf_path

        try:
            source = default_gguf_path()
        except RuntimeError as e:  # the default model's package is not installed
            pytest.skip(str(e))
        model = str(tmp_path / "cut.gguf")
        with open(source, "rb") as f, open(model, "wb") as out:
            out.write(f.read(1000))
        expect = "not a complete GGUF file (its header runs past the file's end at byte 1,000: truncated?)"
    run = _run("serve", "--quiet", "--device", "cpu", "--model", model, folder=str(tmp_path), timeout=120)
    _assert_refused(run, f"forerun: --model {model}: {expect}")


def _helps(parser) -> dict[str, str]:
    """Each flag's help text as ``--help`` shows it (defaults expanded), unwrapped."""
    formatter = parser._get_formatter()
    return {a.option_strings[0]: formatter._expand_help(a) for a in parser._actions if a.option_strings}


def test_help_shows_every_default():
    from scheduler_proc.cli_flags import build_parser

    subs = build_parser()._subparsers._group_actions[0].choices
    serve, chat = _helps(subs["serve"]), _helps(subs["chat"])
    for flag, default in (("--block-size", 16), ("--max-num-batched-tokens", 1024), ("--max-num-seqs", 64),
                          ("--max-restarts", 5), ("--restart-window", 60.0), ("--pipeline-depth", 1),
                          ("--api-workers", 1), ("--num-speculative-tokens", 4), ("--ngram-max", 4),
                          ("--scripted-step-ms", 0), ("--prefill-ahead", "on")):
        assert serve[flag].endswith(f"default: {default})"), (flag, serve[flag])
    for flag, default in (("--max-tokens", 256), ("--temperature", 0.0), ("--timeout", 120.0)):
        assert chat[flag].endswith(f"(default: {default})"), (flag, chat[flag])
    every = " ".join([*serve.values(), *chat.values()])
    assert "default: None" not in every and "default: False" not in every and "default: []" not in every
    assert "(default: $FORERUN_API_KEY)" in chat["--api-key"]
    depth = serve["--pipeline-depth"]
    assert all(f"{n} " in depth for n in ("0 waits", "1 sends", "2 also")), depth


@pytest.mark.parametrize("flags, expect", [
    (["--api-key", "   "], "--api-key is an empty key, which would mean no key (or a blank one, which no HTTP client "
                            "can send: header values are trimmed): leave --api-key out to serve without one"),
    (["--api-key-file", "{blank}"], "--api-key-file {blank}: its first line holds no key"),
    (["--client-send-hwm", str(2**31)], f"--client-send-hwm must be in [1, {2**31 - 1}] (ZeroMQ's limit), got {2**31}"),
    (["--executor-hang-timeout", "0.001"], "--executor-hang-timeout must be at least 1 s (a step may take that long), "
                                           "got 0.001"),
    # the HTTP API's settings without --port: there is no HTTP API to set
    (["--api-workers", "2"], "--api-workers needs --port (it sets the HTTP API, which runs only with a --port)"),
    (["--max-request-bytes", "2048"], "--max-request-bytes needs --port (it sets the HTTP API, which runs only with "
                                      "a --port)"),
    (["--api-tokenizer-threads", "4"], "--api-tokenizer-threads needs --port (it sets the HTTP API, which runs only "
                                       "with a --port)"),
    (["--host-kv-backup-on-compute-stream"], "--host-kv-backup-on-compute-stream needs --device cuda (the host KV "
                                             "tier keeps copies of GPU blocks in host memory; on --device cpu there "
                                             "is none)"),
    (["--allow-unauthenticated"], "--allow-unauthenticated has nothing to allow: it lets a tcp:// --address or the "
                                  "HTTP API (--port) reach other machines without a key, and this server has neither"),
])
def test_values_the_server_could_not_use_are_refused_before_it_starts(flags, expect, tmp_path):
    from scheduler_proc.launch import main

    blank = tmp_path / "key.txt"
    blank.write_text("\n\nkey-on-line-3\n")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *SCRIPTED, *(f.format(blank=blank) for f in flags)])
    assert str(exit_.value) == f"forerun: {expect.format(blank=blank)}"


@pytest.mark.parametrize("flags, expect", [
    (["--ask", "hi"], "--ask: the server has no tokenizer (its model has none), and questions are text: start it "
                      "with --tokenizer FILE|DIR"),
    (["--ask", "\udcff\udcfe hi"], "--ask is not valid UTF-8 (byte 0xff at character 0)"),  # argv's bytes as decoded
])
def test_an_ask_that_cannot_be_answered_is_refused_before_the_model_loads(flags, expect):
    from scheduler_proc.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", *SCRIPTED, *flags])
    assert str(exit_.value) == f"forerun: {expect}"


def test_a_gguf_files_tokenizer_is_not_taken_for_one_it_reads():
    """A GGUF model's own tokenizer is not read: --ask says so (not that the model has none), and a GGUF file given
    as --tokenizer is refused by name (it was read as a tokenizer.json: "stream did not contain valid UTF-8")."""
    from ipc.models import default_gguf_path
    from scheduler_proc.launch import main

    gguf = default_gguf_path()
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", gguf, "--ask", "hi"])
    assert "a GGUF model's own is not read" in str(exit_.value) and "--tokenizer DIR" in str(exit_.value)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *SCRIPTED, "--tokenizer", gguf])
    assert str(exit_.value) == (f"forerun: --tokenizer {gguf!r} is a GGUF file, whose tokenizer is not read: give "
                                f"the model's HF tokenizer folder or its tokenizer.json")


def test_the_start_up_says_what_a_tokenizer_without_chat_template_or_no_tokenizer_means(tmp_path, capsys):
    from scheduler_proc.launch import _tokenizer_notes
    from scheduler_proc.serve_config import chat_template_error, has_chat_template

    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert has_chat_template(str(tmp_path)) is True
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert has_chat_template(str(tmp_path)) is False
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(str(tmp_path)) is True
    assert has_chat_template(str(tmp_path / "tokenizer.json")) is False and has_chat_template("/x/m.gguf") is None
    assert chat_template_error(str(tmp_path)) is None
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}"
                                                  "{% endgeneration %}{% if loop.last %}{% break %}{% endif %}"
                                                  "{% endfor %}")  # transformers' tags: it compiles
    assert chat_template_error(str(tmp_path)) is None
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content ")
    assert chat_template_error(str(tmp_path)).startswith("TemplateSyntaxError: unexpected end of template")
    _tokenizer_notes(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink()
    _tokenizer_notes(str(tmp_path))
    _tokenizer_notes("")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0, '
                                             '"[UNK]": 1}, "unk_token": "[UNK]"}}')
    _tokenizer_notes(str(tmp_path), 2)  # the model's own size: nothing to say but the missing template
    _tokenizer_notes(str(tmp_path), 49152)
    _tokenizer_notes(str(tmp_path), 1)
    out = capsys.readouterr().out.splitlines()
    no_template = "forerun: the tokenizer has no chat template: chat requests are refused; completions are served"
    assert out[0].startswith("forerun: the tokenizer's chat template does not compile (TemplateSyntaxError: "
                             "unexpected end of template") and out[0].endswith("(line 1)): chat requests are refused; "
                                                                             "completions are served"), out[0]
    assert out[1:] == [no_template,
                   "forerun: no tokenizer: clients send token ids and get token ids back (--tokenizer FILE|DIR gives "
                   "the server one)",
                   no_template,
                   "forerun: the tokenizer knows 2 tokens and the model 49,152: generated ids past 2 have no text (is "
                   "the tokenizer the model's?)", no_template,
                   "forerun: the tokenizer knows 2 tokens and the model 1: prompts holding ids past the model's are "
                   "refused (is the tokenizer the model's?)", no_template]


CHAT_REFUSALS = [
    (["--timeout", "-1"], "--timeout must be a positive number of seconds, got -1"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds, got nan"),
    (["--seed", str(2**64)], f"--seed must be in [0, 2^63-1], got {2**64}"),
    (["--api-key", ""], "--api-key is an empty key"),
]


@pytest.mark.parametrize("flags, expect", CHAT_REFUSALS, ids=[" ".join(f) for f, _ in CHAT_REFUSALS])
def test_chat_refuses_bad_flags_before_connecting(flags, expect, capsys):
    from scheduler_proc.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(["chat", "hi", "--address", "ipc:///nonexistent/none.sock", *flags])
    assert str(exit_.value).startswith(f"forerun: {expect}"), exit_.value
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, expect", [
    (["\udcff hi"], "the prompt is not valid UTF-8 (byte 0xff at character 0)"),
    (["hi", "--system", "ok \udce9"], "--system is not valid UTF-8 (byte 0xe9 at character 3)"),
])
def test_chat_refuses_text_that_is_not_utf8(argv, expect, capsys):
    """Bytes that are not UTF-8 reach Python's argv as lone surrogates, which no tokenizer takes."""
    from scheduler_proc.launch import main

    with pytest.raises(SystemExit) as exit_:
        main(["chat", *argv, "--address", "ipc:///nonexistent/none.sock"])
    assert str(exit_.value) == f"forerun: {expect}"


def test_chat_failure_prints_nothing_on_stdout(capsys):
    """A failure before any answer: the one error line on stderr, not an empty line on stdout before it."""
    from scheduler_proc.launch import main

    assert main(["chat", "hi", "--address", "udp://nowhere"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err == "forerun: address 'udp://nowhere' must start with ipc:// or tcp://\n"


def test_chat_ends_a_partial_answer_with_a_newline_and_writes_nothing_else(monkeypatch):
    import io
    import types

    import ipc.client
    from ipc.client.errors import ServerGoneError
    from scheduler_proc.chat_cli import stream_answer

    class FakeClient:
        """Streams ``deltas``, then fails as a server that died would."""

        def __init__(self, address, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream(self, **kwargs):
            yield from (types.SimpleNamespace(text_delta=d) for d in deltas)
            raise ServerGoneError("gone")

    monkeypatch.setattr(ipc.client, "Client", FakeClient)
    for deltas, written in ((["Hel", "lo"], "Hello\n"), ([], ""), ([""], "")):
        out = io.StringIO()
        with pytest.raises(ServerGoneError):
            stream_answer("ipc:///x", "hi", out=out)
        assert out.getvalue() == written, deltas


def test_chat_names_the_flag_of_a_refused_field():
    from ipc.client.errors import ForerunError, InvalidRequestError, ServerGoneError
    from scheduler_proc.chat_cli import _chat_error

    def said(field: str, message: str) -> str:
        return _chat_error(InvalidRequestError("invalid_request", field, message))

    assert (said("sampling.max_tokens", "max_tokens must be at least 1, got 0")
            == "[invalid_request] --max-tokens must be at least 1, got 0")
    assert (said("sampling.max_tokens", "the request asks for 100031 (31 in the prompt, 100000 in max_tokens)")
            == "[invalid_request] --max-tokens: the request asks for 100031 (31 in the prompt, 100000 in "
               "--max-tokens)")
    assert (said("sampling.temperature", "sampling.temperature must be a finite number, got nan")
            == "[invalid_request] --temperature must be a finite number, got nan")
    assert said("sampling.top_p", "top_p must be in (0, 1]").endswith("top_p must be in (0, 1]")  # not a chat flag
    assert _chat_error(ServerGoneError("no server")) == "[server_gone] no server"
    no_tokenizer = _chat_error(ForerunError("no_tokenizer", "tokenizer", "... send prompt_token_ids ..."))
    assert no_tokenizer.startswith("[no_tokenizer] the server has no tokenizer") and "--tokenizer" in no_tokenizer


def test_stale_tokenizer_folders_of_dead_processes_are_removed(tmp_path, monkeypatch):
    from ipc.client import prompt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"forerun-tokenizer-{dead.pid}-abc").mkdir()
    (tmp_path / f"forerun-tokenizer-{dead.pid}-abc" / "tokenizer.json").write_text("{}")
    (tmp_path / f"forerun-tokenizer-{os.getpid()}-def").mkdir()  # a live process's: in use
    (tmp_path / "forerun-tokenizer-x1y2z3").mkdir()  # no process id: not ours to judge
    prompt.remove_stale_tokenizer_folders()
    assert sorted(os.listdir(tmp_path)) == [f"forerun-tokenizer-{os.getpid()}-def", "forerun-tokenizer-x1y2z3"]


def test_run_directories_of_dead_servers_are_removed_by_the_next(tmp_path, monkeypatch):
    """A server killed with SIGKILL leaves its run directory (sockets, metric files); the next server's start
    removes those whose lock no process holds, and only those: not a live one's (a process id alone misjudged a
    server in another PID namespace sharing the folder), not one being made (no lock file yet), not other folders."""
    import fcntl

    from ipc.sockets import ALIVE_FILE, new_run_dir

    monkeypatch.setenv("FORERUN_RUN_DIR", str(tmp_path))
    dead = tmp_path / "forerun-4242-0123"
    (dead / "prometheus").mkdir(parents=True)
    (dead / ALIVE_FILE).write_text("")  # its process died: nobody holds the lock
    live = tmp_path / "forerun-1-ba98"  # a server in another PID namespace: its process id means nothing here
    live.mkdir()
    held = os.open(live / ALIVE_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    others = [live.name, "forerun-4243-0aa1", "forerun-tokenizer-4242-abc", "forerun-0123456789ab"]
    for name in others[1:]:
        (tmp_path / name).mkdir()
    try:
        mine = os.path.basename(new_run_dir())
        assert mine.startswith(f"forerun-{os.getpid()}-")
        assert sorted(os.listdir(tmp_path)) == sorted(others + [mine])
        assert os.path.basename(new_run_dir()) in os.listdir(tmp_path) and mine in os.listdir(tmp_path)  # held
    finally:
        os.close(held)


def _interrupt_when(proc: subprocess.Popen, ready, timeout: float = 60) -> float:
    """SIGINT ``proc`` once ``ready()``; the seconds it then took to exit."""
    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    proc.wait(timeout=30)
    return time.monotonic() - t0


def test_a_gateway_worker_killed_while_it_loads_its_tokenizer_leaves_nothing(default_model_dir):
    """A worker SIGKILLed while it builds its tokenizer (in a folder of TMPDIR named by its pid): the server says so
    in one line and stops, exit 1, no traceback; neither the folder (removed by the server once its workers are
    stopped: with one worker no other load sweeps it) nor the run directory is left."""
    runs, tmp = run_dir(), run_dir()
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=runs, TMPDIR=tmp)
    cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", *SCRIPTED, "--quiet", "--tokenizer",
           default_model_dir, "--address", f"ipc://{runs}/c.sock", "--port", "0", "--api-workers", "1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (folders := [n for n in os.listdir(tmp) if n.startswith("forerun-tokenizer-")]):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.kill(int(folders[0].split("-")[2]), signal.SIGKILL)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "Traceback" not in err, (proc.returncode, err)
    assert err.splitlines()[0].startswith("forerun: gateway worker ") and "while starting; stopping" in err, err
    assert os.listdir(tmp) == [] and os.listdir(runs) == [], (os.listdir(tmp), os.listdir(runs))


def test_ctrl_c_while_replicas_start_stops_at_once():
    """Replicas that miss the router's SIGTERM while they import would make it wait out --shutdown-timeout + 5 s."""
    runs = run_dir()
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=runs)
    cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", *SCRIPTED, "--quiet", "-dp", "2",
           "--address", f"ipc://{runs}/c.sock"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    replicas = lambda: subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True).stdout  # noqa: E731
    took = _interrupt_when(proc, lambda: replicas().count(b"\n") == 2)  # both spawned, still importing
    out, err = proc.communicate()
    assert took < 10 and "Traceback" not in err, (took, err)
    assert os.listdir(runs) == []


def test_model_json_files_are_read_as_python_reads_them(tmp_path):
    """The start-up check of a model folder's JSON files takes what Python's json (the loader's, transformers')
    takes, Infinity included; a file that is not a JSON object is refused naming it."""
    from scheduler_proc.serve_config import check_json_files

    (tmp_path / "config.json").write_text('{"hidden_size": 8, "unused": Infinity}')
    check_json_files(str(tmp_path))
    (tmp_path / "config.json").write_text("hello")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        check_json_files(str(tmp_path))


def test_ask_gives_the_servers_key_on_a_tcp_address(default_model_dir, tmp_path):
    """``--ask`` on a tcp:// address with a key (--api-key-file): the question's Hello carries the key, so the
    server takes the question (the scripted executor's 1,000-token vocabulary then refuses the chat's ids: a request
    error, not ``unauthorized``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = tmp_path / "key.txt"
    key.write_text("s3cret\n")
    runs = run_dir()
    env = dict(os.environ, PYTHONPATH=python_path(), FORERUN_RUN_DIR=runs)
    cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", *SCRIPTED, "--tokenizer", default_model_dir,
           "--address", f"tcp://127.0.0.1:{port}", "--api-key-file", str(key), "--ask", "hi"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 90
        while not any("still serving" in line or "failed" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, lines
            lines.append(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    answer = "".join(lines)
    assert "unauthorized" not in answer and ("still serving" in answer or "[invalid_request]" in answer), lines


def test_a_default_that_another_flag_puts_out_of_range_is_said_to_be_the_default():
    """--ngram-min 6 alone: the --ngram-max the user did not type (4) is out of range; the line says it is the
    default, so that the user knows which flag to add."""
    from ipc.config import SpeculativeConfig, _check_speculative

    with pytest.raises(ValueError, match=r"got 4 \(its default\)"):
        _check_speculative(SpeculativeConfig(method="ngram", ngram_min=6))


def test_a_replica_stopped_while_it_reports_its_failure_exits_quietly(monkeypatch):
    """A data-parallel replica that cannot start says why; a SIGTERM (the router stopping it, a Ctrl-C) while it
    does must not cut the report short with a KeyboardInterrupt traceback."""
    import signal

    import msgspec

    from scheduler_proc import cli_flags, replica
    from scheduler_proc import server as server_module
    from scheduler_proc.cli_flags import build_parser
    from scheduler_proc.serve_config import server_config

    cfg = server_config(build_parser().parse_args(["serve", "--device", "cpu"]))
    cfg = msgspec.structs.replace(cfg, model="/nonexistent/model", replica=0)
    rewrite = cli_flags.in_flag_names

    def stopped_while_reporting(message: str) -> str:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at once, in this (the main) thread
        return rewrite(message)

    monkeypatch.setattr(cli_flags, "in_flag_names", stopped_while_reporting)
    monkeypatch.setattr(server_module, "SPEAKER", server_module.SPEAKER)  # main names itself "replica 0" there
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert replica.main([msgspec.json.encode(cfg).decode()]) == 1
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_ask_asks_for_what_the_context_leaves(monkeypatch):
    """``serve --ask`` asks for up to 256 new tokens, fewer where the server's context leaves less room after the
    question (a --max-model-len of 200 made it ask for more than fit, and the server refused); ``forerun chat``
    keeps the --max-tokens its user typed."""
    import io
    from types import SimpleNamespace

    import ipc.client
    from scheduler_proc.chat_cli import stream_answer

    asked = []

    class Client:
        def __init__(self, address, **kw):
            self.server_info = SimpleNamespace(max_model_len=limit)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def encode(self, messages):
            return list(range(30))

        def stream(self, max_tokens, **kw):
            asked.append(max_tokens)
            return [SimpleNamespace(text_delta="ok")]

    monkeypatch.setattr(ipc.client, "Client", Client)
    for limit, given, want in ((200, None, 170), (4096, None, 256), (30, None, 1), (200, 500, 500)):
        stream_answer("ipc:///nowhere", "hi", max_tokens=given, out=io.StringIO())
        assert asked[-1] == want, (limit, given, asked)


def test_an_address_on_a_host_that_does_not_resolve_is_refused_as_such():
    """A tcp:// --address whose host resolves nowhere: said so (it was first called reachable from other machines,
    asking for an API key, then 'No such device')."""
    from types import SimpleNamespace

    import zmq

    from scheduler_proc.frontend import StartupError, _resolves, bind_frontend

    cfg = SimpleNamespace(api_key=None, allow_unauthenticated=False, client_send_hwm=1000)
    with pytest.raises(StartupError, match=r"^cannot listen on tcp://nosuchhost\.invalid:18621: 'nosuchhost\.invalid' "
                                           r"is neither an address, a host name that resolves nor a network interface"):
        bind_frontend(zmq.Context.instance(), "tcp://nosuchhost.invalid:18621", cfg, 1 << 20)
    assert _resolves("127.0.0.1") and _resolves("localhost") and _resolves("lo")  # an interface's name binds too


def test_ctrl_c_while_the_tokenizer_is_checked_is_one_line(monkeypatch):
    """A Ctrl-C in the first moments of a start (the tokenizer being parsed, before the server takes the signals)
    is the start's one line, not a KeyboardInterrupt traceback."""
    from scheduler_proc import launch
    from scheduler_proc.cli_flags import build_parser

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "check_tokenizer", interrupted)
    with pytest.raises(SystemExit) as ended:
        launch.serve(build_parser().parse_args(["serve", "--load-format", "scripted"]))
    assert ended.value.code == "forerun: interrupted while starting"
