#!/usr/bin/env bash
# Installs what fabric needs on a fresh Debian machine (as root) and builds it:
# system packages, a venv in .venv, Python packages, the Cython extensions.
# Idempotent: a second run only rebuilds what changed. Usage: tools/setup.sh [MODE]
#   test (default)  everything the test suite needs, the Soft-RoCE guest's packages included
#   perf            what fabric-perf needs (tools/perf.sh): the build, matplotlib; no QEMU,
#                   kernel, clang, openssl, iproute2, Debian's UCX or torch
#   other words     pip extras (e.g. grpc), with test's system packages
# At its end it writes .venv/.fabric-setup-stamp (tools/perf.sh skips set-up while no
# build input is newer).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-test}"
# test also brings what the suite's docs and wheel checks run (the docs and release extras)
if [ "$MODE" = perf ]; then EXTRAS=perf; LEAN=1
elif [ "$MODE" = test ]; then EXTRAS=test,docs,release; LEAN=0
else EXTRAS="$MODE"; LEAN=0; fi
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
rm -f .venv/.fabric-setup-stamp

need=()
command -v gcc >/dev/null || need+=(build-essential)
command -v pkg-config >/dev/null || need+=(pkg-config)
if [ "$LEAN" = 0 ]; then
    command -v ip >/dev/null || need+=(iproute2)
    # clang builds the sanitizer-instrumented copy the fuzz tests run (tools/fuzz.py)
    command -v clang >/dev/null || command -v clang-14 >/dev/null || need+=(clang)
    # the openssl command: the TLS tests make their certificates with it
    command -v openssl >/dev/null || need+=(openssl)
    # h2load: an HTTP/2 load generator not ours, against fabric.grpc's servers
    command -v h2load >/dev/null || need+=(nghttp2-client)
    # OpenSSL's headers: TLS on the tcp fabric (fabric/backends/tls.pyx)
    dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
fi
# Debian's UCX (1.13): a second UCX for the soname-clash test and for
# FABRIC_UCX=system builds.
if [ "$LEAN" = 0 ] || [ "${FABRIC_UCX:-auto}" = system ]; then
    dpkg -s libucx-dev >/dev/null 2>&1 || need+=(libucx-dev)
fi
# perf: the verbs backend's headers only (fabric-perf measures verbs where an RDMA
# device exists); FABRIC_VERBS=off skips them.
if [ "$LEAN" = 1 ] && [ "${FABRIC_VERBS:-auto}" != off ]; then
    dpkg -s libibverbs-dev >/dev/null 2>&1 || need+=(libibverbs-dev)
fi
# Soft-RoCE: Debian's kernel (it has rdma_rxe) booted under QEMU by
# tools/softroce.py, rdma-core and perftest; FABRIC_SOFTROCE=0 skips them.
if [ "$LEAN" = 0 ] && [ "${FABRIC_SOFTROCE:-1}" != 0 ]; then
    for p in qemu-system-x86 linux-image-amd64 busybox-static rdma-core ibverbs-utils perftest libibverbs-dev \
             python3-pyverbs; do
        dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
    done
fi
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3 || true)}"
if [ -z "$PYTHON" ]; then need+=(python3 python3-venv python3-dev); fi
if [ -n "$PYTHON" ] && ! "$PYTHON" -c "import venv, ensurepip" 2>/dev/null; then need+=(python3-venv); fi
if [ -n "$PYTHON" ] && ! "$PYTHON" -c "import sysconfig,os,sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'],'Python.h')))"; then
    need+=(python3-dev)
fi
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
    else
        echo "setup: missing ${need[*]}; run as root or install them" >&2; exit 1
    fi
    PYTHON="${PYTHON:-$(command -v python3)}"
fi

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel "Cython>=3.0" 2>&1 | grep -v "^WARNING: Location" || true
# UCX for the ucx backend: the libucx-cu12 wheel (UCX 1.22, CPU transports);
# it must be importable before the build finds it. FABRIC_UCX=off skips it,
# FABRIC_UCX=system builds against Debian's libucx-dev instead (README).
if [ "${FABRIC_UCX:-auto}" != off ] && [ "${FABRIC_UCX:-auto}" != system ]; then
    .venv/bin/python -c "import libucx" 2>/dev/null || \
        .venv/bin/python -m pip install -q "libucx-cu12>=1.18" 2>&1 | grep -v "^WARNING: Location" || true
fi
# Editable install: the Cython build runs here and rebuilds changed modules.
.venv/bin/python -m pip install -q --no-build-isolation -e ".[${EXTRAS}]" 2>&1 | grep -v "^WARNING: Location" || true
# torch CPU tensors are part of the test suite where a local CPU wheel exists
# (never a multi-GB download); elsewhere those tests skip and say why.
torch_wheel=$(ls /opt/wheels/torch-*+cpu-cp3*.whl 2>/dev/null | head -n 1 || true)
if [ "$LEAN" = 0 ] && [ -n "$torch_wheel" ] && [ "${FABRIC_SKIP_TORCH:-0}" != 1 ] && \
        ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q "$torch_wheel" 2>&1 | grep -v "^WARNING: Location" || true
fi
.venv/bin/python -c "import fabric; print('fabric', fabric.__version__, 'backends:', {k: v[0] for k, v in fabric.available_backends().items()})"
echo "$MODE $(date -u +%Y-%m-%dT%H:%M:%SZ)" > .venv/.fabric-setup-stamp
