#!/usr/bin/env bash
# Creates .venv with the pinned CPU torch and ckptstore installed editable with its test extras.
# Idempotent: a second run only re-checks the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# torch is pinned here (not in pyproject) so a fresh machine takes the local CPU wheel
# instead of downloading a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test,bench]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import ckptstore, ckptstore.writer, ckptstore.integrations, torch, blake3, zstandard, safetensors, moto, s3fs, lightning, transformers, accelerate" \
  || { echo "setup failed: dependencies missing in .venv" >&2; exit 1; }
