#!/usr/bin/env bash
# A Debian base image made locally, for machines where no image registry is reachable:
#   scripts/make-base-image.sh NAME [SUITE]      e.g. fsdp-replay-base bookworm (the default)
#
# debootstrap --variant=minbase of SUITE from the Debian mirror apt uses here, imported with
# `docker import` as NAME (a tag such as fsdp-replay-base or fsdp-replay-base:trixie; without one,
# :latest). The Dockerfile's BASE argument names it:
#   docker build --build-arg BASE=fsdp-replay-base ...
# Idempotent and fast when NAME exists already (delete it with `docker rmi NAME` to rebuild).
# The image carries labels saying what it is, so a rebuild can be told from a registry image.
# Environment: MIRROR (default: the first deb.debian.org-style URI in apt's sources),
# DOCKER (default /usr/bin/docker).
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 NAME [SUITE]" >&2
    exit 2
fi
NAME=$1
SUITE=${2:-bookworm}
DOCKER=${DOCKER:-/usr/bin/docker}

log() { echo "make-base-image: $*"; }

if "$DOCKER" image inspect "$NAME" >/dev/null 2>&1; then
    log "$NAME exists ($("$DOCKER" image inspect -f '{{index .Config.Labels "org.opencontainers.image.version"}}' "$NAME"))"
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "$0: must run as root (debootstrap)" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "$0: no debootstrap (scripts/install-docker.sh installs it)" >&2; exit 1; }

if [[ -z ${MIRROR:-} ]]; then
    MIRROR=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
        | awk '{print $2}' | head -1 || true)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

ROOTFS=$(mktemp -d /var/tmp/fsdp-replay-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
log "debootstrap --variant=minbase $SUITE from $MIRROR"
start=$(date +%s)
if ! debootstrap --variant=minbase "$SUITE" "$ROOTFS" "$MIRROR" >"$ROOTFS.log" 2>&1; then
    echo "$0: debootstrap failed; its log ends with:" >&2
    tail -20 "$ROOTFS.log" >&2
    rm -f "$ROOTFS.log"
    exit 1
fi
rm -f "$ROOTFS.log"
# What a registry's debian:SUITE-slim also drops: package caches and lists (apt-get update in a
# build stage fetches them again), and logs that would differ between two otherwise equal builds.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
version=$(cat "$ROOTFS/etc/debian_version")
tar -C "$ROOTFS" --numeric-owner -c . | "$DOCKER" import \
    --change 'CMD ["bash"]' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL org.opencontainers.image.title=\"debian $SUITE minbase (local debootstrap)\"" \
    --change "LABEL org.opencontainers.image.version=\"debian $version\"" \
    --change "LABEL io.fsdp-replay.base.suite=\"$SUITE\"" \
    - "$NAME" >/dev/null
log "$NAME: debian $version ($SUITE), $(( $(date +%s) - start )) s, $("$DOCKER" image inspect -f '{{.Size}}' "$NAME" | awk '{printf "%.0f MB", $1 / 1e6}')"
