#!/usr/bin/env bash
# Install Prometheus and promtool from Debian when they are missing (the rules and end-to-end tests
# need them). Idempotent and quiet: does nothing when both are on PATH. Needs root (or sudo) and
# Debian's package registry. Exits non-zero only when the install was attempted and failed.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

if have prometheus && have promtool; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if have sudo; then
        SUDO="sudo -n"
    else
        echo "install-prometheus: not root and no sudo; install the 'prometheus' package by hand" >&2
        exit 1
    fi
fi
if ! have apt-get; then
    echo "install-prometheus: apt-get not found; install Prometheus (prometheus, promtool) by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! { $SUDO apt-get update -qq && \
       $SUDO apt-get install -y -qq --no-install-recommends prometheus; } >"$log" 2>&1; then
    tail -n 20 "$log" >&2
    echo "install-prometheus: apt-get install prometheus failed" >&2
    exit 1
fi
# The Debian package starts a system service where an init system runs; the tests start their own
# Prometheus on a free port, so a running service is harmless but not needed.
have prometheus && have promtool
