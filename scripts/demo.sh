#!/usr/bin/env bash
# The main job on embedded defaults: set up, then plan the bundled example fleet.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/edgesplit plan --model cnn --devices coordinator/examples/devices.yaml --batch-size 32 "$@"
