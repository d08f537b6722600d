"""Every script in scripts/ answers --help and runs a tiny case on the CPU: a benchmark no test runs rots.

The tiny cases run concurrently (three at a time) from one module fixture, so the file costs about
the slowest few of them; the --help checks share one Python process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from tests.server_proc import ROOT, python_path

SCRIPTS = os.path.join(ROOT, "scripts")
PY_SCRIPTS = sorted(f for f in os.listdir(SCRIPTS) if f.endswith(".py") and not f.startswith("_"))
SUBCOMMANDS = {"bench_kernels.py": ["check", "gemv", "w8a8", "decode-attention", "prefill-attention", "mixed-step",
                                    "transfer", "sampling", "sampling-step", "spec", "moe"],
               "bench_reliability.py": ["flood", "restart"]}
# Scripts whose CPU run lives in another test file.
COVERED_ELSEWHERE = {"bench_memory.py": "tests/test_bench_memory.py",
                     "bench_reliability.py": "tests/test_reliability.py (flood)",
                     "bench_serve.py": "tests/test_client_unit.py (SDK), tests/test_openai_server.py (HTTP, 2 processes)"}


def _tiny_cases(model: str, out: str, vocab_model: str = "v", tokenizer: str = "t") -> dict[str, list[str]]:
    """script -> the arguments of its tiny CPU run (``{out}``: a JSON path the test reads back; ``vocab_model``: a
    tiny config with the default model's vocabulary, ``tokenizer``: the default model's folder)."""
    return {  # the slowest first: they start first
        "bench_host_kv.py": ["--device", "cpu", "--model", model, "--tiny", "--mode", "prefix", "--json", out],
        "bench_tp.py": ["--device", "cpu", "--parts", "tp,dp,allreduce", "--model", model, "--sizes", "2",
                        "--max-num-seqs", "4", "--input-len", "8", "--decode-tokens", "12", "--idle-batch", "2",
                        "--idle-tokens", "12", "--requests", "4", "--output-len", "4", "--dp-model", model,
                        "--dp-sizes", "1", "2", "--dp-requests", "4", "--dp-warmup", "1", "--prefixes", "2",
                        "--prefix-len", "32", "--prefix-requests", "3", "--prefix-waves", "1",
                        "--prefix-output-len", "2", "--server-flag=--num-kv-blocks=64", "--json", out],
        "bench_startup.py": ["--device", "cpu", "--model", model, "--num-slots", "4", "--cases", "off=0",
                             "--json", out],
        "bench_decode.py": ["--device", "cpu", "--models", model, "--steps", "4", "--warmup", "1", "--context", "16",
                            "--json", out],
        "bench_kernels.py": ["transfer", "--dry", "--json", out],
        "bench_hf_baseline.py": ["--device", "cpu", "--engines", "forerun", "--model", model, "--requests", "4",
                                 "--prompt-len", "8", "--new-tokens", "4", "--slots", "4", "--json", out],
        "bench_overlap.py": ["--executor", "scripted", "--depths", "1", "--step-ms", "2", "--running", "16",
                             "--window-s", "0.3", "--client-nice", "0", "--json", out],
        "bench_scheduler.py": ["--running", "16", "--modes", "decode", "mixed", "--steps", "60",
                               "--prefix-caching", "both", "--json", out],
        # random weights under the default model's tokenizer (the script's documented use), not the default model:
        # the constraints, masks and compiles are the tokenizer's; the default model's steps cost 4 s more
        "bench_structured.py": ["--model", vocab_model, "--load-format", "dummy", "--tokenizer", tokenizer,
                                "--batches", "2", "--new-tokens", "4", "--repeats", "1", "--json", out],
        "bench_spec.py": ["--parts", "verify", "--device", "cpu", "--model", model, "--batches", "1,2",
                          "--context", "32", "--json", out],
    }


def _check_output(script: str, result: dict) -> None:
    """What each tiny run must report, beyond exiting 0."""
    if script == "bench_scheduler.py":
        assert {(r["mode"], r["prefix"]) for r in result} == {
            (m, c) for m in ("decode", "mixed") for c in ("off", "on")}, result
    elif script == "bench_structured.py":
        assert [r["mode"] for r in result["rows"]] == ["unconstrained", "json_schema"], result
        compiles = result["compile"]["schemas"].values()
        assert compiles and all(c["cache_hit"] == 1 and c["compile_cold_ms"] > 0 for c in compiles), result
    elif script == "bench_overlap.py":
        (row,) = result
        assert row["executor"] == "scripted" and row["steps"] >= 3 and 0 <= row["idle_fraction"] < 1
    elif script == "bench_decode.py":
        (row,) = result["rows"]
        assert row["step_ms"] > 0 and row["tokens_valid"]
    elif script == "bench_kernels.py":
        assert result["rows"] and all(r["bit_exact"] for r in result["rows"]), result
    elif script == "bench_host_kv.py":
        prefix = result["prefix"]
        assert prefix["off"]["query_tokens"] == 0 and prefix["on"]["query_tokens"] > 0
        assert prefix["on"]["output_tok_per_s"] > 0
    elif script == "bench_tp.py":
        (row,) = result["rows"]
        assert row["tp"] == 2 and row["decode_steps"] >= 10 and row["decode_period_us_p50"] > 0
        assert row["all_reduce"] == "auto" and result["allreduce_rows"] == []  # the all-reduce timing: CUDA only
        dp1, dp2 = result["dp_rows"]
        assert (dp1["dp"], dp2["dp"]) == (1, 2) and dp1["output_tokens_per_s"] > 0 and dp2["vs_first"] > 0, result
        prefix = dp2["prefix"]  # 2 prefixes x 3 requests: the 4 after each prefix's first can find it
        assert prefix["waves"] == [2, 4] and prefix["reachable_hit_tokens"] == 2 * 2 * 32, prefix
        assert 0 < prefix["hit_tokens"] <= prefix["query_tokens"], prefix
        assert sorted(r["replica"] for r in prefix["replicas"]) == [0, 1], prefix
        assert sum(r["hit_tokens"] for r in prefix["replicas"]) == prefix["hit_tokens"], prefix
    elif script == "bench_startup.py":
        (case,) = result["cases"]
        stages = [stage for stage, _ in case["stages"]]
        assert stages[:2] == ["importing", "building"] and "initialising weights" in stages, stages
    elif script == "bench_spec.py":
        rows = result["runs"]["verify"]["rows"]
        assert [r["batch"] for r in rows] == [1, 2] and all(r["verify_step_ms"] > 0 for r in rows), result
    elif script == "bench_hf_baseline.py":
        (row,) = result["rows"]
        assert row["engine"] == "forerun" and row["tokens"] == 16


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=python_path())


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, default_model_dir) -> dict[str, tuple[Future, str]]:
    """Every tiny case started at once, three at a time: script -> (its CompletedProcess future, JSON path)."""
    from tests.test_gpu_fastpath import write_config

    tmp = tmp_path_factory.mktemp("scripts")
    (tmp / "model").mkdir()
    (tmp / "vocab_model").mkdir()
    model = str(write_config(tmp / "model", vocab=300))
    vocab_model = str(write_config(tmp / "vocab_model", vocab=49152))
    pool = ThreadPoolExecutor(3)
    runs = {}
    for script, args in _tiny_cases(model, "", vocab_model, default_model_dir).items():
        out = str(tmp / f"{script}.json")
        args = [out if a == "" else a for a in args]
        runs[script] = (pool.submit(subprocess.run, [sys.executable, os.path.join(SCRIPTS, script), *args],
                                    cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240), out)
    yield runs
    pool.shutdown(wait=True)


def test_every_script_has_a_tiny_case():
    missing = set(PY_SCRIPTS) - set(_tiny_cases("m", "o")) - set(COVERED_ELSEWHERE)
    assert not missing, f"scripts without a CPU smoke test: {sorted(missing)}"


@pytest.mark.parametrize("script", sorted(_tiny_cases("m", "o")))
def test_tiny_cpu_run(script, tiny_runs):
    future, out = tiny_runs[script]
    run = future.result()
    assert run.returncode == 0, f"{script}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    with open(out) as f:
        _check_output(script, json.load(f))


_HELP = r"""
import contextlib, io, json, os, runpy, sys
folder, names = sys.argv[1], json.loads(sys.argv[2])
path = [folder, os.path.dirname(folder), *sys.path]
results = {}
for name in names:
    script, _, sub = name.partition(" ")
    sys.argv, sys.path[:] = [script, *([sub] if sub else []), "--help"], path  # as if run on its own
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(os.path.join(folder, script), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:  # reported, not raised: the other scripts still get checked
        code, buf = repr(e), io.StringIO(repr(e))
    results[name] = [code, buf.getvalue()[:400]]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    """Every script's (and sub-command's) --help, in one Python process: name -> [exit code, output start]."""
    names = PY_SCRIPTS + [f"{s} {sub}" for s, subs in SUBCOMMANDS.items() for sub in subs]
    run = subprocess.run([sys.executable, "-c", _HELP, SCRIPTS, json.dumps(names)], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", PY_SCRIPTS + [f"{s} {sub}" for s, subs in SUBCOMMANDS.items() for sub in subs])
def test_help(name, helps):
    code, text = helps[name]
    assert code == 0 and "usage" in text.lower(), (name, code, text)


@pytest.mark.parametrize("script", ["gpu_suite.sh", "setup.sh"])
def test_shell_script_help(script):
    run = subprocess.run(["bash", os.path.join(SCRIPTS, script), "--help"], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr


def test_gpu_suite_names_only_scripts_and_tests_that_exist(tmp_path):
    """Every part's commands (--dry-run runs nothing) name scripts and test files that are there."""
    run = subprocess.run(["bash", os.path.join(SCRIPTS, "gpu_suite.sh"), "--dry-run", "all"], capture_output=True,
                         text=True, timeout=30, env=dict(os.environ, OUT=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    words = {w for line in run.stdout.splitlines() if line.startswith("+ ") for w in line.split()}
    named = {w for w in words if w.startswith(("scripts/", "tests/")) and w.endswith((".py", ".sh"))}
    assert {"scripts/bench_decode.py", "scripts/bench_serve.py", "tests/test_gpu_fastpath.py"} <= named
    assert all(os.path.exists(os.path.join(ROOT, w)) for w in named), sorted(
        w for w in named if not os.path.exists(os.path.join(ROOT, w)))


def test_the_longest_first_order_names_test_files_that_exist():
    from tests.conftest import LONGEST_FIRST

    missing = [name for name in LONGEST_FIRST if not os.path.exists(os.path.join(ROOT, "tests", name))]
    assert not missing and len(set(LONGEST_FIRST)) == len(LONGEST_FIRST), missing


def test_shapes_of_reads_the_model_configs(monkeypatch):
    """``benchlib.shapes_of`` (the skinny matmul benchmarks' weights) finds ``scripts/configs/<name>``."""
    monkeypatch.syspath_prepend(SCRIPTS)
    from benchlib import shapes_of

    assert shapes_of("llama-3-8b") == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                       "down": (4096, 14336), "lm_head": (128256, 4096)}


def test_bench_spec_side_by_side_rounds_alternate_and_keep_the_median(monkeypatch):
    """``bench_spec.py --repeats``: both servers up at once, each round's loads against each server in turn with the
    order reversed every other round, and per server and load the run of median output tokens/s kept (servers and
    runs faked: the real ones need a GPU)."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import bench_spec

    calls, started, stopped = [], [], []
    monkeypatch.setattr(bench_spec, "start_server", lambda address, *flags, **kw: started.append(flags) or address)
    monkeypatch.setattr(bench_spec, "stop_server", stopped.append)

    def run_script(args, script, *flags):
        address, load = flags[1], flags[-1]
        calls.append((address, load))
        return {"output_throughput": float(len(calls)), "load": load}

    monkeypatch.setattr(bench_spec, "run_script", run_script)
    args = bench_spec.parse_args(["--parts", "serve", "--repeats", "3"])
    servers = {"off": ("plain", []), "on": ("n-gram", ["--speculative-method", "ngram"])}
    out = bench_spec.served_side_by_side(args, servers, {"a": ["--x", "a"], "b": ["--x", "b"]})
    assert len(started) == len(stopped) == 2 and "ngram" in started[1] and "--num-kv-blocks" in started[0]
    servers = [address for address, _ in calls]
    off, on = servers[0], servers[1]
    assert servers == [off, on, off, on, on, off, on, off, off, on, off, on]  # round 2 reversed
    assert out["off"]["repeats"] == {"a": [1.0, 6.0, 9.0], "b": [3.0, 8.0, 11.0]}
    assert out["off"]["a"]["output_throughput"] == 6.0 and out["on"]["b"]["output_throughput"] == 7.0


def test_bench_spec_step_medians_pair_steps_within_each_window(tmp_path, monkeypatch):
    """Under ``--repeats`` a load has several time windows: its steps are those of every window, and a step's period
    is taken from the step before it in the same window only (never across the time between two runs)."""
    monkeypatch.syspath_prepend(SCRIPTS)
    import bench_spec

    step = dict(num_rows=1, num_prefill=0, idle_s=0.001, gpu_busy_s=0.0005, prepare_s=0.0002, launch_s=0.0001,
                plan_s=0.00001)
    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join(json.dumps(dict(step, t_end=t, num_drafts=4 if t == 1.002 else 0))
                             for t in (1.0, 1.001, 1.002, 5.0, 5.002, 9.0)))
    got = bench_spec.step_medians(str(log), {"one": (0.9, 1.1), "two": [(0.9, 1.1), (4.9, 5.1)]})
    assert (got["one"]["steps"], got["one"]["one_row_steps"]) == (3, 2)
    assert (got["two"]["steps"], got["two"]["one_row_steps"]) == (5, 3)
    assert abs(got["two"]["period_ms"] - 1.0) < 1e-6 and abs(got["two"]["window_ms"] - 400.0) < 1e-6
    assert (got["two"]["drafting_steps"], got["two"]["plain_steps"]) == (1, 2)  # the step at 1.002 verified drafts
    assert abs(got["two"]["drafting_period_ms"] - 1.0) < 1e-6 and abs(got["two"]["plain_period_ms"] - 2.0) < 1e-6
