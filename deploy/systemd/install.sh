#!/usr/bin/env bash
# Install an edgesplit role as a systemd service on this machine. From the repository root, as root:
#   deploy/systemd/install.sh edge|gpu-server|coordinator
# It creates the system user `edgesplit` (no login, home /var/lib/edgesplit), a virtual
# environment in /opt/edgesplit/venv with the pinned CPU torch and edgesplit, the folder
# /etc/edgesplit (0750, group edgesplit) with the role's settings from the example (an existing
# file is kept), and the unit in /etc/systemd/system; it starts nothing: edit the settings,
# write the password file, then `systemctl enable --now edgesplit-<role>` (it prints the steps).
#
# DESTDIR=DIR stages every file under DIR instead (for packagers and the tests): no user is
# created, nothing is chowned, systemd is not reloaded. EDGESPLIT_SKIP_PIP=1 creates the venv
# without installing into it; EDGESPLIT_TORCH_INDEX overrides where torch comes from (a GPU
# server wants the CUDA build: EDGESPLIT_TORCH_INDEX=https://download.pytorch.org/whl/cu126).
set -euo pipefail
role=${1:-}
case "$role" in
  edge | gpu-server | coordinator) ;;
  *) echo "usage: $0 edge|gpu-server|coordinator" >&2; exit 2 ;;
esac
source_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
root=${DESTDIR:-}
python=${PYTHON:-python3}
torch_index=${EDGESPLIT_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

if [ -z "$root" ]; then
  if [ "$(id -u)" != 0 ]; then echo "run as root (or set DESTDIR to stage the files)" >&2; exit 2; fi
  getent group edgesplit > /dev/null || groupadd --system edgesplit
  getent passwd edgesplit > /dev/null \
    || useradd --system --gid edgesplit --home-dir /var/lib/edgesplit --no-create-home \
      --shell /usr/sbin/nologin edgesplit
fi

venv="$root/opt/edgesplit/venv"
if [ "${EDGESPLIT_SKIP_PIP:-0}" = 1 ]; then
  "$python" -m venv --without-pip "$venv"
else
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --index-url "$torch_index" torch==2.13.0
  "$venv/bin/pip" install --quiet "$source_dir"
fi

install -d -m 0750 "$root/etc/edgesplit"
settings="$root/etc/edgesplit/$role.env"
[ -e "$settings" ] || install -m 0640 "$source_dir/deploy/systemd/edgesplit-$role.env.example" "$settings"
install -d -m 0755 "$root/etc/systemd/system"
install -m 0644 "$source_dir/deploy/systemd/edgesplit-$role.service" "$root/etc/systemd/system/"
if [ -z "$root" ]; then
  chgrp edgesplit /etc/edgesplit "$settings"
  install -d -m 0700 -o edgesplit -g edgesplit /var/lib/edgesplit
  systemctl daemon-reload
fi

cat <<STEPS
installed edgesplit-$role. Next:
  1. edit $settings
  2. write the broker password (first line; only the edgesplit user can read it):
       install -m 0600 -o edgesplit -g edgesplit /dev/stdin /etc/edgesplit/broker-password
STEPS
[ "$role" != coordinator ] || echo "     and the database password the same way, to /etc/edgesplit/db-password"
[ "$role" != edge ] || echo "     and put the device's data where DATA names it, readable by edgesplit"
echo "  3. systemctl enable --now edgesplit-$role; journalctl -u edgesplit-$role -f"
