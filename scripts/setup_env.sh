#!/usr/bin/env bash
# Create .venv (if missing) and install dsv4ref with what it needs. Used by `make`.
# Where torch and Triton are already importable (a GPU machine, or an Intel XPU machine whose torch
# brings its own Triton), the venv sees them (--system-site-packages) and they are not replaced.
set -euo pipefail
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch, triton" 2>/dev/null; then
    echo "setup: using the torch and triton already installed for $PY"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
V=.venv/bin/python
if ! $V -c "import torch" 2>/dev/null; then
  echo "setup: installing the CPU build of torch (torch==2.13.0) and triton==3.9.0"
  $V -m pip install -q "torch==2.13.0" "triton==3.9.0"
elif ! $V -c "import triton" 2>/dev/null; then
  $V -m pip install -q "triton==3.9.0"
fi
$V -m pip install -q -e ".[dev]"
