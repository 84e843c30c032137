#!/usr/bin/env bash
# Bring the compose deployment up, train a 2-round run to the end, check it, tear it all down:
#   deploy/compose/smoke.sh
# Needs a Docker engine with compose v2; without one it says so and exits 77 (a skip).
# Builds the image (torch's CPU wheel is downloaded the first time), so allow some minutes.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if ! docker info > /dev/null 2>&1 || ! docker compose version > /dev/null 2>&1; then
  echo "skip: no Docker engine with compose v2 here (docker info / docker compose version failed)"
  exit 77
fi
python=${PYTHON:-python3}
project=edgesplit-smoke
compose=(docker compose -p "$project" -f "$here/docker-compose.yml")
cleanup() { "${compose[@]}" down -v --remove-orphans > /dev/null 2>&1 || true; }
trap cleanup EXIT

"$python" "$here/make_data.py"
[ -e "$here/.env" ] || (umask 077; echo "EDGESPLIT_DB_PASSWORD=$(openssl rand -hex 16)" > "$here/.env")
# the shipped run, shortened to 2 rounds under its own id
sed -e 's/^run_id: .*/run_id: compose-smoke/' -e 's/^rounds: .*/rounds: 2/' \
  "$here/run.yaml" > "$here/data/smoke.yaml"
export EDGESPLIT_RUN_FILE=data/smoke.yaml

"${compose[@]}" up -d --build
echo "waiting for the coordinator to finish the run"
code=$(timeout "${SMOKE_TIMEOUT:-900}" "${compose[@]}" wait coordinator) || {
  "${compose[@]}" logs --tail 50
  echo "FAIL: the coordinator did not finish within ${SMOKE_TIMEOUT:-900} s" >&2
  exit 1
}
if [ "$code" != 0 ]; then
  "${compose[@]}" logs --tail 50 coordinator
  echo "FAIL: the coordinator exited $code" >&2
  exit 1
fi
status=$("${compose[@]}" run --rm --no-deps coordinator status \
  --db postgresql+psycopg://edgesplit@postgres/edgesplit --run compose-smoke)
echo "$status"
grep -q "finished" <<< "$status" || { echo "FAIL: the run is not finished" >&2; exit 1; }
echo "OK: compose trained 2 rounds"
