#!/usr/bin/env bash
# A real Docker engine for the deploy tests (tests/deploy/) on a Debian 12 machine, as root:
#   scripts/install-docker.sh [start]   install docker.io + debootstrap if missing, start dockerd
#                                       if no engine answers, return once `docker info` works
#   scripts/install-docker.sh stop      stop the dockerd that `start` started (by its pid), if any
#   scripts/install-docker.sh status    say whether an engine answers and who started it
#
# - Debian's docker.io (20.10) and its client /usr/bin/docker, which has BuildKit
#   (DOCKER_BUILDKIT=1); another client earlier on PATH may lack buildx, so use /usr/bin/docker.
# - debootstrap makes the local base images (scripts/make-base-image.sh): no image registry is
#   reachable here.
# - dockerd runs without a bridge, iptables or masquerading: the VM's network is not ours to
#   change, and builds and test containers use `--network host`.
# - `start` is idempotent: an engine that already answers (started by anyone) is left alone and
#   its pid is not recorded, so `stop` never stops a daemon it did not start.
# Environment: DOCKERD_LOG (default /tmp/fsdp-replay-dockerd.log), DOCKERD_PIDFILE (default
# /run/fsdp-replay-dockerd.pid), DOCKERD_WAIT_S (default 60).
set -euo pipefail

MODE=${1:-start}
DOCKER=/usr/bin/docker
LOG=${DOCKERD_LOG:-/tmp/fsdp-replay-dockerd.log}
PIDFILE=${DOCKERD_PIDFILE:-/run/fsdp-replay-dockerd.pid}
WAIT_S=${DOCKERD_WAIT_S:-60}
SOCKET=/var/run/docker.sock
PACKAGES=(docker.io debootstrap)

log() { echo "install-docker: $*"; }

engine_answers() { [[ -x $DOCKER ]] && "$DOCKER" -H "unix://$SOCKET" info >/dev/null 2>&1; }

our_pid() {
    # The pid in our pidfile, if that process is still a dockerd (a reused pid is not ours).
    [[ -r $PIDFILE ]] || return 1
    local pid
    pid=$(<"$PIDFILE")
    [[ $pid =~ ^[0-9]+$ ]] && [[ $(cat "/proc/$pid/comm" 2>/dev/null || true) == dockerd ]] || return 1
    echo "$pid"
}

case $MODE in
start)
    if [[ $(id -u) -ne 0 ]]; then
        echo "$0: must run as root (apt-get, dockerd)" >&2
        exit 1
    fi
    installed=$(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' "${PACKAGES[@]}" 2>/dev/null | awk '$2 == "ii" {print $1}' || true)
    missing=()
    for p in "${PACKAGES[@]}"; do
        grep -qx "$p" <<<"$installed" || missing+=("$p")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        log "apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    if engine_answers; then
        log "an engine already answers on $SOCKET"
        exit 0
    fi
    if pid=$(our_pid); then
        log "dockerd $pid (ours) does not answer yet; waiting"
    else
        # Detached from this shell's session, so that it outlives the caller (make, pytest).
        setsid dockerd --host="unix://$SOCKET" --bridge=none --iptables=false --ip6tables=false \
            --ip-masq=false >"$LOG" 2>&1 </dev/null &
        pid=$!
        echo "$pid" >"$PIDFILE"
        log "started dockerd $pid (log: $LOG)"
    fi
    for ((i = 0; i < WAIT_S * 4; i++)); do
        if engine_answers; then
            log "ready: $("$DOCKER" version --format 'engine {{.Server.Version}}, client {{.Client.Version}}')"
            exit 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            rm -f "$PIDFILE"
            echo "$0: dockerd exited; its log ($LOG) ends with:" >&2
            tail -20 "$LOG" >&2
            exit 1
        fi
        sleep 0.25
    done
    echo "$0: dockerd $pid did not answer within ${WAIT_S}s (log: $LOG)" >&2
    exit 1
    ;;
stop)
    if ! pid=$(our_pid); then
        rm -f "$PIDFILE"
        log "no dockerd started by this script is running; nothing to stop"
        exit 0
    fi
    kill -TERM "$pid"
    for ((i = 0; i < 120; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.25
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "dockerd $pid ignored SIGTERM for 30 s; sending SIGKILL"
        kill -KILL "$pid"
    fi
    rm -f "$PIDFILE"
    log "stopped dockerd $pid"
    ;;
status)
    if engine_answers; then
        if pid=$(our_pid); then log "running: dockerd $pid, started by this script"; else log "running, not started by this script"; fi
    else
        log "no engine answers on $SOCKET"
        exit 1
    fi
    ;;
*)
    echo "usage: $0 [start|stop|status]" >&2
    exit 2
    ;;
esac
