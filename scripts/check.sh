#!/usr/bin/env bash
# The one check entry point, for developers and CI alike: set up, lint, type-check, test.
# Extra arguments go to pytest, e.g. `bash scripts/check.sh -m unit`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# shellcheck source=scripts/services.sh
source scripts/services.sh  # PostgreSQL for the store tests (started here if none runs)
export MALLOC_MMAP_THRESHOLD_=65536  # memory measurements in tests track tensor lifetimes

echo "== ruff" >&2
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy" >&2
.venv/bin/mypy
echo "== pytest" >&2
# two workers: much of the suite waits on brokers, databases and child processes; the
# slowest tests are listed, so CI's log shows where its time went (its limit is 30 minutes)
.venv/bin/python -m pytest -n "${EDGESPLIT_TEST_WORKERS:-2}" --dist worksteal --durations=15 "$@"
