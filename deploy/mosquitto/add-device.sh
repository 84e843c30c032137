#!/usr/bin/env bash
# Add (or change) a device's broker password: add-device.sh PASSWORD_FILE NAME
# The password is read from standard input so it never appears in the process list.
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PASSWORD_FILE DEVICE_NAME  (password on stdin)" >&2; exit 2; }
read -r password
umask 077  # the password file is the broker's alone (0600)
touch "$1"
chmod 600 "$1"
# mosquitto_passwd takes the password on its argv for an instant (-b); run this script on the
# broker host only, where no untrusted user can list processes.
mosquitto_passwd -b "$1" "$2" "$password"
