#!/bin/sh
# Build and run the reproducer. Default variant: the peer SIGKILLs itself
# 0-300 us after its ucp_ep_create (fabric's die@hello); the survivor posts a
# HELLO active message after its own ucp_ep_create, force-closes its endpoint on
# bootstrap EOF (or after the error callback), keeps progressing 50 ms, then
# destroys worker and context. ITERS (default 1000) takes about 60 s on 2 cores;
# expect 0.6-8 % crashes on UCX 1.22 (it moves with the load), 0 with UCX_TCP_CONN_NB=y.
# Extra arguments replace the default variant's options (see ./repro -h),
# e.g. ./run.sh -k survivor -c after_cb -p 200
set -e
cd "$(dirname "$0")"
./build.sh >/dev/null 2>&1 || ./build.sh
export UCX_TLS=${UCX_TLS:-tcp}
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}        # loopback only
export UCX_HANDLE_ERRORS=${UCX_HANDLE_ERRORS:-bt}    # UCX prints a backtrace on a crash
LOGDIR=${LOGDIR:-logs/run}
ITERS=${ITERS:-1000}
[ $# -gt 0 ] || set -- -k self_after_ep -d 300 -c on_eof -p 50
set +e
./repro -n "$ITERS" -L "$LOGDIR" "$@" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN"
echo "UCX_TCP_CONN_NB=${UCX_TCP_CONN_NB:-(unset: blocking connect)}; crashed iterations keep their stderr, with UCX's backtrace, in $LOGDIR/"
