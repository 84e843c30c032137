#!/usr/bin/env bash
# Make sure the services the tests need are there, installing and starting them when not.
# Source it: it exports EDGESPLIT_TEST_POSTGRES_URL for the tests.
#
# PostgreSQL: use the server at 127.0.0.1:5432 (database "test", user postgres, trust auth) when
# one answers; otherwise install Debian's postgresql if needed and start a private cluster on a
# free loopback port (initdb/pg_ctl run as user postgres), stopped when the shell exits.

_pg_ready() {  # host port
    if command -v pg_isready >/dev/null 2>&1; then
        pg_isready -q -h "$1" -p "$2" -t 2
    else
        (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
    fi
}

_pg_bin() {
    local dir
    for dir in /usr/lib/postgresql/*/bin; do
        [ -x "$dir/initdb" ] && { echo "$dir"; return 0; }
    done
    command -v initdb >/dev/null 2>&1 && dirname "$(command -v initdb)"
}

_start_private_postgres() {
    local bin port data
    bin=$(_pg_bin)
    if [ -z "$bin" ]; then
        echo "services: installing PostgreSQL (Debian package postgresql)" >&2
        if [ "$(id -u)" -ne 0 ]; then
            echo "services: cannot install PostgreSQL without root; set EDGESPLIT_TEST_POSTGRES_URL" >&2
            return 1
        fi
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
        bin=$(_pg_bin)
    fi
    id postgres >/dev/null 2>&1 || useradd --system --no-create-home postgres
    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    data=$(mktemp -d /tmp/edgesplit-pg.XXXXXX)
    chown postgres "$data"
    local as_postgres=(runuser -u postgres --)
    [ "$(id -un)" = postgres ] && as_postgres=()
    "${as_postgres[@]}" "$bin/initdb" -D "$data/db" -U postgres --auth=trust >/dev/null
    "${as_postgres[@]}" "$bin/pg_ctl" -D "$data/db" -l "$data/log" -w \
        -o "-p $port -k $data -c listen_addresses=127.0.0.1" start >/dev/null
    "${as_postgres[@]}" "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres test
    trap '"${as_postgres[@]}" "'"$bin"'/pg_ctl" -D "'"$data"'/db" -m fast stop >/dev/null 2>&1; rm -rf "'"$data"'"' EXIT
    export EDGESPLIT_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:$port/test"
    echo "services: started a private PostgreSQL on 127.0.0.1:$port" >&2
}

# mosquitto: the MQTT tests start private brokers on free ports; they only need the binary.
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "services: installing mosquitto (Debian package mosquitto)" >&2
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq mosquitto >/dev/null
    else
        echo "services: mosquitto is missing and cannot be installed without root" >&2
    fi
fi

# The production broker's client-id plugin (deploy/mosquitto/build-plugin.sh) is built by the
# security tests: they need a C compiler and mosquitto's plugin headers.
if [ ! -f /usr/include/mosquitto_plugin.h ] || ! command -v cc >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        echo "services: installing gcc and mosquitto's plugin headers (mosquitto-dev)" >&2
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq gcc mosquitto-dev libmosquitto-dev >/dev/null
    else
        echo "services: mosquitto-dev is missing and cannot be installed without root" >&2
    fi
fi

if [ -z "${EDGESPLIT_TEST_POSTGRES_URL:-}" ]; then
    if _pg_ready 127.0.0.1 5432; then
        export EDGESPLIT_TEST_POSTGRES_URL="postgresql+psycopg://postgres@127.0.0.1:5432/test"
    else
        _start_private_postgres || echo "services: no PostgreSQL; its tests will be skipped" >&2
    fi
fi
