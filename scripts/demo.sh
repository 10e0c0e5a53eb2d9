#!/usr/bin/env bash
# Sets up .venv and runs the demo: a trainer takes cuts, is SIGKILLed mid-run, resumes, finishes,
# then the store is audited with `ckptstore verify` and listed with `ckptstore ls`.
# `--ranks 2`: the same with an FSDP2 job of two ranks (torch.distributed.run, gloo on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/demo.py "$@"
