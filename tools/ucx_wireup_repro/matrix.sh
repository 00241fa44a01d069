#!/bin/sh
# Third batch: the peer kills itself right after its ucp_ep_create (fabric's
# die@hello), N iterations per variant (default 300), one at a time.
cd "$(dirname "$0")"
./build.sh >/dev/null 2>&1
export UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_HANDLE_ERRORS=bt
N=${N:-300}
run() {
    name=$1; shift
    echo "== $name: ./repro -n $N $*" >> results.txt
    ./repro -n "$N" -L "logs/$name" "$@" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN" | grep "RESULT\|CRASH\|HANG\|exit\|signal\|clean iterations" >> results.txt
}
if [ $# -gt 0 ]; then run "$@"; exit; fi
run P1_eof        -k self_after_ep -d 300 -c on_eof -p 50
run P2_after_cb   -k self_after_ep -d 300 -c after_cb -p 50
run P3_in_cb      -k self_after_ep -d 300 -c in_cb -p 50
run P4_never      -k self_after_ep -d 300 -c never -p 50
run P5_no_am      -k self_after_ep -d 300 -c on_eof -p 50 -s 0
run P6_d0         -k self_after_ep -d 0 -c on_eof -p 50
run P7_d1000      -k self_after_ep -d 1000 -c on_eof -p 50
run P8_ev_after_cb -k self_after_ep -d 300 -c after_cb -p 50 -e
run P9_before_ep  -k self_before_ep -d 300 -c on_eof -p 50
