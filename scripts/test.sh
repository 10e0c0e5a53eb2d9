#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers, each taking whole files (module fixtures and a file's ordering stay within one worker):
# most tests wait on subprocesses, sockets and disks, so two cores run two files at once. Pass -n 0 to
# run serially (a later -n wins), or set CKPTSTORE_TEST_WORKERS.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${CKPTSTORE_TEST_WORKERS:-2}" --dist loadfile "$@"
