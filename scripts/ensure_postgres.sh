#!/usr/bin/env bash
# Start the machine's PostgreSQL cluster if it is not accepting connections,
# then make sure the test database exists. Used by `make test` and CI.
set -euo pipefail
if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    if command -v pg_ctlcluster >/dev/null 2>&1; then
        ver=$(ls /etc/postgresql | sort -V | tail -n1)
        pg_ctlcluster --skip-systemctl-redirect "$ver" main start || true
    fi
    for _ in $(seq 1 50); do
        pg_isready -q -h 127.0.0.1 -p 5432 && break
        sleep 0.2
    done
fi
if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    echo "PostgreSQL is not reachable on 127.0.0.1:5432" >&2
    exit 1
fi
if ! psql -h 127.0.0.1 -U postgres -tAc "select 1 from pg_database where datname='tide_test'" | grep -q 1; then
    psql -h 127.0.0.1 -U postgres -qc "create database tide_test"
fi
