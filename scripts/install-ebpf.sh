#!/usr/bin/env bash
# Set up bcc uprobes for the sidecar's eBPF tests on a Debian 12 machine, as root:
#   scripts/install-ebpf.sh VENV
# - Debian packages bpfcc-tools, python3-bpfcc (the bcc Python bindings; `bcc` on PyPI is an
#   unrelated package) and linux-headers-amd64 (bcc compiles its C at run time);
# - /lib/modules/$(uname -r)/{build,source} pointing at those headers when the running kernel
#   has none of its own (Debian's headers are enough for uprobes);
# - tracefs mounted at /sys/kernel/tracing;
# - `import bcc` made to work in VENV, whose Python is not Debian's, by a symlink to the
#   bindings' folder in VENV's site-packages (pure Python over ctypes + libbcc.so);
# - the real libnccl.so.2 from the nvidia-nccl-cu13 wheel, installed into VENV; pinned to the
#   NCCL that torch 2.11+cu130 loads on the GPU machine (2.28.9), NCCL_VERSION=... to change it
#   (the tests also pass against 2.27.7 and 2.32.3).
# Idempotent; each step is skipped when already done, so a second run takes well under a second.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
VENV=$1
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "$0: $PY is not an executable Python (create the virtualenv first)" >&2
    exit 2
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "$0: must run as root (apt-get, /lib/modules, mount)" >&2
    exit 1
fi

NCCL_VERSION=${NCCL_VERSION:-2.28.9}
DEB_BCC_DIR=/usr/lib/python3/dist-packages/bcc
# gcc + libc6-dev build the tests' C load generator; binutils' objdump checks the ABI finding.
PACKAGES=(bpfcc-tools python3-bpfcc linux-headers-amd64 gcc libc6-dev binutils)

log() { echo "install-ebpf: $*"; }

# 1. Debian packages.
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

# 2. Kernel headers for bcc, when the running kernel ships none (Debian splits them into an
#    -amd64 tree, "build", and a -common tree, "source").
K=$(uname -r)
if [[ ! -d /lib/modules/$K/build/include/generated && ! -d /lib/modules/$K/build/include/linux ]] \
    || [[ ! -e /lib/modules/$K/source ]]; then
    H=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -1)
    if [[ -z "$H" ]]; then
        echo "$0: no /usr/src/linux-headers-*-amd64 after installing linux-headers-amd64" >&2
        exit 1
    fi
    log "linking /lib/modules/$K/{build,source} to $H"
    mkdir -p "/lib/modules/$K"
    ln -sfn "$H" "/lib/modules/$K/build"
    ln -sfn "${H%-amd64}-common" "/lib/modules/$K/source"
fi

# 3. tracefs (uprobe_events lives there).
if ! mountpoint -q /sys/kernel/tracing; then
    log "mounting tracefs"
    mount -t tracefs tracefs /sys/kernel/tracing
fi

# 4. bcc importable from VENV: one symlink, not the whole of Debian's dist-packages, so that no
#    other Debian Python package can shadow or mix with VENV's.
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [[ "$(readlink "$SITE/bcc" 2>/dev/null || true)" != "$DEB_BCC_DIR" ]]; then
    if [[ -e "$SITE/bcc" && ! -L "$SITE/bcc" ]]; then
        echo "$0: $SITE/bcc exists and is not our symlink (PyPI's unrelated 'bcc'?): remove it" >&2
        exit 1
    fi
    log "linking $SITE/bcc -> $DEB_BCC_DIR"
    ln -sfn "$DEB_BCC_DIR" "$SITE/bcc"
fi
"$PY" -c 'import bcc' || { echo "$0: 'import bcc' fails in $VENV" >&2; exit 1; }

# 5. The real libnccl.so.2 (the pip copy torch loads on GPU machines).
have=$("$PY" -c 'import importlib.metadata as m; print(m.version("nvidia-nccl-cu13"))' 2>/dev/null || true)
if [[ "$have" != "$NCCL_VERSION" || ! -e "$SITE/nvidia/nccl/lib/libnccl.so.2" ]]; then
    log "pip install nvidia-nccl-cu13==$NCCL_VERSION (found: ${have:-none})"
    "$PY" -m pip install -q "nvidia-nccl-cu13==$NCCL_VERSION"
fi
log "ready: bcc $("$PY" -c 'import bcc.version as v; print(v.__version__)'), NCCL $NCCL_VERSION at $SITE/nvidia/nccl/lib/libnccl.so.2"
