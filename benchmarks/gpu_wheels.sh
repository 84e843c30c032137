#!/usr/bin/env bash
# Wheels of what benchmarks/gpu.sh needs beyond a GPU image's PyTorch stack (Python 3.12,
# x86_64 Linux), into .whl/ (git-ignored): run on a machine that reaches PyPI, then carry
# .whl/ with the checkout to the GPU machine. The image is assumed to hold torch, numpy,
# click, httpx, pyyaml, safetensors, onnx, onnxruntime, scikit-learn and matplotlib; the rest
# of edgesplit's imports are below. Flower's own pins (typer < 0.21, iterators < 0.0.3,
# pycryptodome < 4, protobuf and grpcio of one generation) are not guaranteed by an image, so
# those come too, at the versions this project's environment (.venv) resolved, where it exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
names=(flwr sqlalchemy alembic mako paho-mqtt cryptography cffi pycparser pycryptodome
    grpcio grpcio-health-checking protobuf iterators typer rich)
pins=()
if [ -x .venv/bin/python ]; then
    frozen=$(.venv/bin/python -m pip freeze 2>/dev/null)
    for name in "${names[@]}"; do
        pin=$(grep -i -E "^${name//-/[-_]}==" <<<"$frozen" || true)
        pins+=("${pin:-$name}")
    done
else
    pins=('flwr==1.42.*' sqlalchemy alembic mako paho-mqtt 'cryptography<51' cffi pycparser
        'pycryptodome<4' 'grpcio<2' 'grpcio-health-checking<1.82' 'protobuf<7'
        'iterators<0.0.3' 'typer<0.21' 'rich<15')
fi
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$tag")
done
rm -rf .whl
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
du -sh .whl
