# fsdp-replay's four images, built from one shared stage (docs/kubernetes.md):
#
#   agent-payload  the in-process agent, copied into training pods by the injector's init container:
#                  /fsdp-replay/lib/fsdp_replay (compiled, world-readable) and a static `cp`; uid 65532
#   replay-payload the same, plus per CPython version the libraries a replay reads a trace with
#                  (/fsdp-replay/deps/cp311 ...), copied into replay Jobs' pods (`fsdp-replay job`)
#   sidecar        `fsdp-replay sidecar`: the package with its dependencies but no torch, and Debian's
#                  bcc bindings (python3-bpfcc) for the eBPF uprobes on libnccl
#   webhook        `fsdp-replay webhook`: the package on the standard library alone; uid 65532
#
#   DOCKER_BUILDKIT=1 docker build --target webhook -t fsdp-replay/webhook:0.1.0 .
#
# BASE is any Debian image with apt: a registry's `debian:bookworm-slim`, or one made locally where
# no registry is reachable (scripts/make-base-image.sh fsdp-replay-base; --build-arg
# BASE=fsdp-replay-base). In production pin it by digest (BASE=debian:bookworm-slim@sha256:...) and
# deploy the images by digest too (docs/kubernetes.md, "Image pinning").
#
# Behind a TLS-intercepting proxy, give pip the proxy's CA bundle as a build secret (it is never
# stored in a layer): --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
#
# No `# syntax=` line on purpose: it would make BuildKit pull a frontend image from a registry.
# Docker 20.10's built-in frontend knows RUN --mount (cache and secret mounts).

ARG BASE=debian:bookworm-slim

# ---- python: the runtime every Python image shares (Debian's python3, nothing else) ----------
FROM ${BASE} AS python
ARG DEBIAN_FRONTEND=noninteractive
RUN --mount=type=cache,id=fsdp-replay-apt-archives,target=/var/cache/apt/archives,sharing=locked \
    apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
# Read-only root filesystems: never try to write bytecode next to the sources.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

# ---- tools: what building needs (a compiler for the native core, a virtualenv with setuptools) --
FROM python AS tools
ARG DEBIAN_FRONTEND=noninteractive
RUN --mount=type=cache,id=fsdp-replay-apt-archives,target=/var/cache/apt/archives,sharing=locked \
    apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends python3-venv gcc libc6-dev busybox-static \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=cache,id=fsdp-replay-pip,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python3 -m venv /opt/build \
    && /opt/build/bin/pip install -q --disable-pip-version-check "setuptools>=77" wheel

# ---- wheel: the one build of the package that every image installs --------------------------
FROM tools AS wheel
COPY pyproject.toml setup.py README.md /src/
COPY fsdp_replay /src/fsdp_replay
# _fpcore is optional in setup.py (an install without a compiler still succeeds): an image must
# not silently lack it, so the build fails when the wheel does not hold it.
RUN /opt/build/bin/pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
        -w /wheels /src \
    && python3 -c 'import sys, zipfile, glob; (w,) = glob.glob("/wheels/*.whl"); \
names = zipfile.ZipFile(w).namelist(); \
sys.exit(0 if any(n.startswith("fsdp_replay/agent/fingerprint/_fpcore") and n.endswith(".so") for n in names) \
else "the wheel lacks the native fingerprint core (_fpcore*.so)")'

# ---- agent-payload ---------------------------------------------------------------------------
FROM tools AS payload-build
COPY --from=wheel /wheels /wheels
# Only the package: no console script (its shebang names this stage's Python) and no dist-info
# (in a trainer, `pip list`/`pip check` would report an fsdp-replay whose dependencies are absent).
# Bytecode: unchecked-hash, because the init container's copy gives every file a new mtime and
# the mount is read-only, so timestamp-checked .pyc files would be recompiled in memory on every
# start. It is for this image's Python; another Python version compiles in memory (docs).
RUN /opt/build/bin/pip install -q --disable-pip-version-check --no-deps --no-compile \
        --target /fsdp-replay/lib /wheels/*.whl \
    && rm -rf /fsdp-replay/lib/bin /fsdp-replay/lib/*.dist-info \
    && python3 -m compileall -q -j 0 --invalidation-mode unchecked-hash /fsdp-replay/lib \
    && chmod -R u=rwX,go=rX /fsdp-replay \
    && test -f /fsdp-replay/lib/fsdp_replay/boot/site/sitecustomize.py \
    && mkdir -p /payload-root/bin \
    && cp /bin/busybox /payload-root/bin/busybox \
    && ln -s busybox /payload-root/bin/cp \
    && ln -s busybox /payload-root/bin/ls

FROM scratch AS agent-payload
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="fsdp-replay agent payload" \
      org.opencontainers.image.description="The fsdp-replay agent, copied into training pods by the injector's init container" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# busybox-static: the init container runs `cp -R /fsdp-replay/. /fsdp-replay-target/`; `ls` is
# there to look inside (`docker run IMAGE` lists the payload). No shell, nothing else.
COPY --from=payload-build /payload-root/ /
COPY --from=payload-build /fsdp-replay/ /fsdp-replay/
ENV PATH=/bin
USER 65532:65532
CMD ["ls", "-lR", "/fsdp-replay"]

# ---- replay-payload --------------------------------------------------------------------------
FROM tools AS replay-build
# A replay runs in the recorded image, whose Python has torch but rarely zarr. The libraries a
# replay needs beyond the package (REPLAY_DEPENDENCIES, with pyproject.toml's version bounds, plus
# REPLAY_EXTRA: fsspec and s3fs for s3:// stores, psutil for the replay's watchdog) are installed
# from wheels, for each CPython of REPLAY_PYTHONS, into /fsdp-replay/deps/cpXY. The replay's
# sitecustomize appends the trainer's own version's folder *after* its site-packages
# (FSDP_REPLAY_DEPS), so the image's numpy and anything else it has win. Wheels only, for
# manylinux up to glibc REPLAY_GLIBC and the build's architecture: no compiler, nothing built.
# zarr 3 needs Python 3.11 or later: a trainer on 3.10 can be recorded, not replayed in its image.
ARG REPLAY_PYTHONS="3.11 3.12 3.13"
ARG REPLAY_DEPENDENCIES="numpy zarr numcodecs psutil"
ARG REPLAY_EXTRA="fsspec s3fs"
ARG REPLAY_GLIBC="2.28"
ARG TARGETARCH
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=cache,id=fsdp-replay-pip,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python3 -c 'import re, sys, tomllib; \
wanted = sys.argv[1].split(); \
deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; \
pick = [d for d in deps if re.split(r"[^A-Za-z0-9_.-]", d, maxsplit=1)[0].lower() in wanted]; \
missing = set(wanted) - {re.split(r"[^A-Za-z0-9_.-]", d, maxsplit=1)[0].lower() for d in pick}; \
sys.exit("pyproject.toml does not list " + ", ".join(sorted(missing))) if missing else None; \
print("\n".join(pick + sys.argv[2].split()))' "$REPLAY_DEPENDENCIES" "$REPLAY_EXTRA" > /tmp/replay-requirements.txt \
    && case "${TARGETARCH:-amd64}" in amd64) arch=x86_64 ;; arm64) arch=aarch64 ;; *) arch=$TARGETARCH ;; esac \
    && platforms="--platform manylinux2014_$arch" \
    && minor=17; while [ "$minor" -le "${REPLAY_GLIBC#2.}" ]; do \
         platforms="$platforms --platform manylinux_2_${minor}_$arch"; minor=$((minor + 1)); done \
    && for version in $REPLAY_PYTHONS; do \
         /opt/build/bin/pip install -q --disable-pip-version-check --no-compile --only-binary=:all: \
             --implementation cp --python-version "$version" $platforms \
             --target "/fsdp-replay/deps/cp$(echo "$version" | tr -d .)" -r /tmp/replay-requirements.txt \
         || exit 1; done \
    && rm -rf /fsdp-replay/deps/*/bin \
    && chmod -R u=rwX,go=rX /fsdp-replay/deps

FROM scratch AS replay-payload
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="fsdp-replay replay payload" \
      org.opencontainers.image.description="The fsdp-replay package and, per Python version, the libraries a replay reads its trace with; copied into replay Jobs by their init container" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=payload-build /payload-root/ /
COPY --from=payload-build /fsdp-replay/ /fsdp-replay/
COPY --from=replay-build /fsdp-replay/deps/ /fsdp-replay/deps/
ENV PATH=/bin
USER 65532:65532
CMD ["ls", "/fsdp-replay", "/fsdp-replay/deps"]

# ---- webhook ---------------------------------------------------------------------------------
FROM tools AS webhook-build
COPY --from=wheel /wheels /wheels
# A virtualenv of the runtime's Python holding only the package: the webhook needs the standard
# library alone (fsdp_replay/injector never imports torch, numpy or yaml).
RUN python3 -m venv --without-pip /opt/fsdp-replay \
    && /opt/build/bin/pip --python /opt/fsdp-replay/bin/python install -q --disable-pip-version-check \
        --no-deps --no-compile /wheels/*.whl \
    && /opt/fsdp-replay/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/fsdp-replay/lib \
    && /opt/fsdp-replay/bin/python -c "import fsdp_replay.injector.server, fsdp_replay.cli"

FROM python AS webhook
ARG VERSION=0.1.0
ARG DEBIAN_FRONTEND=noninteractive
LABEL org.opencontainers.image.title="fsdp-replay webhook" \
      org.opencontainers.image.description="fsdp-replay's Kubernetes mutating admission webhook (the injector)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# openssl: the chart's certgen hook Jobs run this image (helm/fsdp-replay/files/certgen.py), so
# that the self-signed TLS needs no other image to mirror and pin.
RUN --mount=type=cache,id=fsdp-replay-apt-archives,target=/var/cache/apt/archives,sharing=locked \
    apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends openssl \
    && rm -rf /var/lib/apt/lists/*
COPY --from=webhook-build /opt/fsdp-replay /opt/fsdp-replay
ENV PATH=/opt/fsdp-replay/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["fsdp-replay", "webhook"]

# ---- sidecar ---------------------------------------------------------------------------------
FROM tools AS sidecar-build
# --system-site-packages: Debian's bcc bindings (python3-bpfcc, /usr/lib/python3/dist-packages)
# in the final stage; `bcc` on PyPI is an unrelated package and never installed.
# The package goes in with --no-deps, then exactly the dependencies the sidecar uses (not torch,
# not rich or matplotlib): the ones pyproject.toml lists for them, read from it so the two
# cannot drift, plus fsspec and s3fs for remote trace stores (add gcsfs for gs://).
ARG SIDECAR_DEPENDENCIES="numpy zarr numcodecs psutil prometheus-client detect-secrets"
ARG SIDECAR_EXTRA="fsspec s3fs"
COPY pyproject.toml /src/pyproject.toml
RUN --mount=type=cache,id=fsdp-replay-pip,target=/root/.cache/pip \
    --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
    && python3 -m venv --without-pip --system-site-packages /opt/fsdp-replay \
    && python3 -c 'import re, sys, tomllib; \
wanted = sys.argv[1].split(); \
deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; \
pick = [d for d in deps if re.split(r"[^A-Za-z0-9_.-]", d, maxsplit=1)[0].lower() in wanted]; \
missing = set(wanted) - {re.split(r"[^A-Za-z0-9_.-]", d, maxsplit=1)[0].lower() for d in pick}; \
sys.exit("pyproject.toml does not list " + ", ".join(sorted(missing))) if missing else None; \
print("\n".join(pick + sys.argv[2].split()))' "$SIDECAR_DEPENDENCIES" "$SIDECAR_EXTRA" > /tmp/sidecar-requirements.txt \
    && /opt/build/bin/pip --python /opt/fsdp-replay/bin/python install -q --disable-pip-version-check \
        -r /tmp/sidecar-requirements.txt
# The package last, so that a change to the sources leaves the dependency layer cached.
COPY --from=wheel /wheels /wheels
RUN /opt/build/bin/pip --python /opt/fsdp-replay/bin/python install -q --disable-pip-version-check \
        --no-deps --no-compile /wheels/*.whl \
    && /opt/fsdp-replay/bin/python -m compileall -q -j 0 --invalidation-mode unchecked-hash \
        /opt/fsdp-replay/lib/python3*/site-packages/fsdp_replay \
    && if /opt/fsdp-replay/bin/python -c "import torch" 2>/dev/null; then echo "torch must not be in the sidecar" >&2; exit 1; fi

FROM python AS sidecar
ARG VERSION=0.1.0
ARG DEBIAN_FRONTEND=noninteractive
LABEL org.opencontainers.image.title="fsdp-replay sidecar" \
      org.opencontainers.image.description="fsdp-replay's sidecar: spool to trace, eBPF uprobes on libnccl, Prometheus metrics" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN --mount=type=cache,id=fsdp-replay-apt-archives,target=/var/cache/apt/archives,sharing=locked \
    apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends python3-bpfcc \
    && rm -rf /var/lib/apt/lists/*
COPY --from=sidecar-build /opt/fsdp-replay /opt/fsdp-replay
ENV PATH=/opt/fsdp-replay/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# uid 0 with every capability dropped but BPF, PERFMON and SYS_PTRACE: the injector's security
# context (docs/injector.md, "Privileges"); Kubernetes gives added capabilities to root only.
USER 0:0
EXPOSE 9464
ENTRYPOINT ["fsdp-replay", "sidecar"]
