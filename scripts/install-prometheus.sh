#!/usr/bin/env bash
# Install a real Prometheus server (Debian's `prometheus` package) for the sidecar's metrics tests,
# as root on a Debian 12 machine:
#   scripts/install-prometheus.sh
# - `apt-get install --no-install-recommends prometheus` (the recommended node exporter is a
#   second daemon the tests do not need);
# - no Debian service left running or enabled: the tests start their own server on a free port
#   with their own config, and a packaged one would scrape and listen on :9090 for as long as
#   the machine runs. A policy-rc.d that forbids service starts is put in place for the
#   install when the machine has none, and whatever started anyway is stopped and disabled;
# - prints the path of the binary on its last line.
# Idempotent: an installed package is not reinstalled, so a second run takes well under a second.
set -euo pipefail

if [[ $(id -u) -ne 0 ]]; then
    echo "$0: must run as root (apt-get, services)" >&2
    exit 1
fi
log() { echo "install-prometheus: $*" >&2; }

POLICY=/usr/sbin/policy-rc.d
if ! dpkg-query -W -f='${db:Status-Abbrev}' prometheus 2>/dev/null | grep -q '^ii'; then
    ours=0
    if [[ ! -e "$POLICY" ]]; then
        # 101: "action not allowed" (invoke-rc.d and deb-systemd-invoke both honour it).
        printf '#!/bin/sh\nexit 101\n' >"$POLICY"
        chmod 755 "$POLICY"
        ours=1
        trap 'rm -f "$POLICY"' EXIT
    fi
    log "apt-get install prometheus"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    if [[ $ours -eq 1 ]]; then
        rm -f "$POLICY"
        trap - EXIT
    fi
fi

# Leave no packaged service running or enabled, whichever init the machine has.
if [[ -d /run/systemd/system ]] && command -v systemctl >/dev/null; then
    if systemctl is-enabled --quiet prometheus 2>/dev/null || systemctl is-active --quiet prometheus 2>/dev/null; then
        log "stopping and disabling the prometheus service (systemd)"
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
elif [[ -x /etc/init.d/prometheus ]]; then
    if /etc/init.d/prometheus status >/dev/null 2>&1; then
        log "stopping the prometheus service (init.d)"
        /etc/init.d/prometheus stop >/dev/null 2>&1 || true
    fi
    if ls /etc/rc[2-5].d/S*prometheus >/dev/null 2>&1; then
        log "disabling the prometheus service (init.d)"
        update-rc.d prometheus disable >/dev/null 2>&1 || true
    fi
fi

BIN=$(command -v prometheus || true)
if [[ -z "$BIN" || ! -x "$BIN" ]]; then
    echo "$0: no prometheus binary on PATH after installing the package" >&2
    exit 1
fi
log "ready: $("$BIN" --version 2>&1 | head -1)"
echo "$BIN"
