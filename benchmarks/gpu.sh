#!/usr/bin/env bash
# The GPU host's figures in one run (issue 18), made to run unchanged the first time a GPU is
# lent: first short simulations with the GPU server and the stacked clients on the GPU, checked
# to learn (benchmarks/gpu_smoke.py), then stacked client segments on the GPU (clients and
# GPU server) against one-by-one and stacked on the CPU for 16, 100 and 1,000 clients
# (benchmarks/batched.py), then the FedAvg job in edgesplit's simulation against
# Flower's own (benchmarks/flower_sim.py, both on the host's CPUs: Flower's rows need Ray,
# whose wheel is larger than a device call can carry; the clients of neither run on the GPU
# there, which is not built yet). One table each; under
# 10 minutes on an H200 host (each step has its own time limit, so a slow one cannot eat the
# rest).
#
#   bash benchmarks/gpu.sh                  # prints "no GPU ... skipped" and exits 0 on a CPU
#
# On a bare GPU machine without this project's dependencies, bring them as wheels (made on a
# machine that reaches PyPI with benchmarks/gpu_wheels.sh, into .whl/) and they are installed
# into a scratch folder first. GPU_OUT: a folder for the tables (default: print only).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ -x .venv/bin/python ]; then PYTHON=${PYTHON:-.venv/bin/python}; else PYTHON=${PYTHON:-python3}; fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu.sh: no GPU (torch.cuda.is_available() is false, or no torch): skipped"
    exit 0
fi
if [ -d .whl ] && ! "$PYTHON" -c 'import flwr, paho, sqlalchemy, alembic' 2>/dev/null; then
    echo "gpu.sh: installing the dependencies carried in .whl/ into /tmp/edgesplit-site" >&2
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/edgesplit-site .whl/*.whl
    export PYTHONPATH=/tmp/edgesplit-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
"$PYTHON" -c 'import flwr, paho, sqlalchemy, alembic' || {
    echo "gpu.sh: edgesplit's dependencies are missing; make .whl/ with benchmarks/gpu_wheels.sh" >&2
    exit 1
}
"$PYTHON" - <<'EOF'
import torch
print(f"gpu.sh: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
EOF
out=()
if [ -n "${GPU_OUT:-}" ]; then mkdir -p "$GPU_OUT"; out=(--out "$GPU_OUT/gpu.md"); fi
# Every step runs, each under its own limit (a slow or failed one cannot eat the rest); the
# exit status is the first failure's.
status=0
step() {
    local limit=$1
    shift
    echo "gpu.sh: $* (limit ${limit} s)"
    timeout "$limit" "$PYTHON" "$@" || { rc=$?; echo "gpu.sh: $* failed ($rc)"; [ $status -ne 0 ] || status=$rc; }
}
step 90 benchmarks/gpu_smoke.py --device cuda
step 330 benchmarks/batched.py --clients 16 100 1000 "${out[@]}"
step 120 benchmarks/flower_sim.py --clients 8 100 "${out[@]}"
exit $status
