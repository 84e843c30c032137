#!/usr/bin/env bash
# Add (or change) a device's broker password: add-device.sh PASSWORD_FILE NAME
# The password is read from standard input and handed to mosquitto_passwd on its standard input
# (twice: it asks again to confirm), so it is on no command line (any local user can list
# every process's arguments).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 PASSWORD_FILE DEVICE_NAME  (password on stdin)" >&2; exit 2; }
case "$2" in
    *:*|"") echo "$0: a device name can hold no ':' and cannot be empty" >&2; exit 2 ;;
esac
if [ -t 0 ]; then
    IFS= read -r -s -p "password for $2: " password
    echo >&2
else
    IFS= read -r password || [ -n "$password" ]  # a last line without a newline counts
fi
[ -n "$password" ] || { echo "$0: empty password on stdin" >&2; exit 2; }
umask 077  # the password file is the broker's alone (0600)
touch "$1"
chmod 600 "$1"
# printf is a bash builtin: the password goes through a pipe, never into an argv. Prompts
# go to /dev/null; errors (e.g. "Passwords do not match") to stderr.
printf '%s\n%s\n' "$password" "$password" | mosquitto_passwd "$1" "$2" >/dev/null
