#!/usr/bin/env bash
# Sets up .venv and runs the demo: a trainer takes cuts into a local directory and its mirror (a second
# directory standing for the durable tier), is SIGKILLed mid-run, resumes, finishes; then the local tier
# is deleted, the same command restores from the mirror, and `ckptstore verify --mirror` audits both.
# `--ranks 2`: the local part with an FSDP2 job of two ranks (torch.distributed.run, gloo on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
