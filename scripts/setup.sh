#!/usr/bin/env bash
# Set up moeferry on a fresh machine: a virtual environment in .venv with the CPU build of
# torch (the one this machine keeps on disk; a bare `torch` would pull a multi-GB CUDA
# build), then moeferry with its server and test extras. Idempotent: a second run is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[serve,test]"
.venv/bin/python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
