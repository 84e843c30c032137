#!/usr/bin/env bash
# Build the broker plugin that binds client ids to accounts: build-plugin.sh [OUTPUT.so]
# Needs a C compiler and mosquitto's plugin headers (Debian: mosquitto-dev libmosquitto-dev;
# Alpine: mosquitto-dev). Default output: clientid_bind.so beside this script.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-$here/clientid_bind.so}
${CC:-cc} -shared -fPIC -O2 -Wall -Wextra -o "$out" "$here/clientid_bind.c"
echo "$out"
