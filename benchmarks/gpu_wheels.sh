#!/usr/bin/env bash
# Wheels of what benchmarks/gpu.sh needs beyond a GPU image's PyTorch stack (Python 3.12,
# x86_64 Linux), into .whl/ (git-ignored): run on a machine that reaches PyPI, then carry
# .whl/ with the checkout to the GPU machine. The image is assumed to hold torch, numpy,
# protobuf, grpcio, click, typer, rich, httpx, pyyaml, safetensors, onnx, onnxruntime,
# scikit-learn and matplotlib; the rest of edgesplit's imports are below.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$tag")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl \
    'flwr==1.42.*' sqlalchemy alembic mako paho-mqtt cryptography cffi pycparser pycryptodome \
    grpcio-health-checking iterators
du -sh .whl
