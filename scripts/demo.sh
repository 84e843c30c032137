#!/usr/bin/env bash
# The main job on embedded defaults: set up, then simulate a federated split run in this
# process (coordinator, GPU server and 4 heterogeneous clients; in-process transport; SQLite
# store; scikit-learn's bundled digits, offline). Outputs go to sim-out/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
.venv/bin/edgesplit simulate "$@"  # --out defaults to sim-out
