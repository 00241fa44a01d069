#!/bin/sh
# Run a crashing variant with core dumps on (UCX's handler off) until a survivor
# dumps core, then print gdb's backtrace of it (to stdout; run.sh-style env).
# usage: ./gdb_bt.sh [repro options]   (default: -k self_after_ep -d 300 -c on_eof -p 50)
cd "$(dirname "$0")"
./build.sh >/dev/null 2>&1
HERE=$(pwd)
W=${WORKDIR:-/tmp/ucx_wireup_core.$$}
mkdir -p "$W" && cd "$W" || exit 1
rm -f core core.*
ulimit -c unlimited
export UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_HANDLE_ERRORS=none
[ $# -gt 0 ] || set -- -k self_after_ep -d 300 -c on_eof -p 50
"$HERE/repro" -n ${N:-600} -X -L "$W/logs" "$@" 2>&1 | grep "CRASH\|RESULT" | head -3
C=$(ls -t core* 2>/dev/null | head -1)
[ -n "$C" ] || { echo "no core in $W"; exit 1; }
gdb -q -batch -ex "set pagination off" -ex "info signals SIGABRT" -ex "bt" -ex "echo \n--- full ---\n" -ex "bt full 12" "$HERE/repro" "$C" 2>&1 | grep -v "^Missing\|debuginfod\|^warning: Can't\|^\[New LWP"
echo "(core: $W/$C)"
