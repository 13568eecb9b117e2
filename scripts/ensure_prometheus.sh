#!/usr/bin/env bash
# Install Prometheus and promtool from Debian's package if they are missing (used by
# `make test`; the observability tests run their own Prometheus on a free port with
# its own config and data dir). The package's own service is never started: a
# policy-rc.d refuses it during the install, and none is left running on 9090.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus/promtool missing and no apt-get to install them" >&2
    exit 1
fi
sudo_=""
if [ "$(id -u)" -ne 0 ]; then sudo_="sudo"; fi
policy=/usr/sbin/policy-rc.d
had_policy=0
if [ -e "$policy" ]; then had_policy=1; fi
if [ "$had_policy" -eq 0 ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo_ tee "$policy" >/dev/null
    $sudo_ chmod +x "$policy"
fi
cleanup() { if [ "$had_policy" -eq 0 ]; then $sudo_ rm -f "$policy"; fi; }
trap cleanup EXIT
$sudo_ apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null && command -v promtool >/dev/null
