#!/bin/sh
# Run the variants one after another (one survivor + one peer at a time),
# appending RESULT lines to results.txt. N per variant: $N (default 200).
cd "$(dirname "$0")"
./build.sh >/dev/null 2>&1
export UCX_TLS=tcp UCX_NET_DEVICES=lo UCX_HANDLE_ERRORS=bt
N=${N:-200}
run() {
    name=$1; shift
    echo "== $name: ./repro -n $N $*" >> results.txt
    ./repro -n "$N" -L "logs/$name" "$@" 2>&1 | grep -v "UCX  ERROR\|UCX  WARN" | grep "RESULT\|CRASH\|HANG\|exit\|signal\|runtime" >> results.txt
}
if [ $# -gt 0 ]; then run "$@"; exit; fi
# first batch (results above the "second batch" line in results.txt)
#run A_after_cb        -c after_cb -p 50
#run B_in_cb           -c in_cb -p 50
#run C_on_eof          -c on_eof -p 50
#run D_at_kill         -c at_kill -p 50
#run E_never_close     -c never -p 50
#run F_destroy_at_once -c after_cb -p 0
# second batch (peers forked before UCX init; jitter; fabric-like event wait)
run G_rounds4_healthy -c on_eof -p 20 -r 4 -H
run H_self_after_ep   -k self_after_ep -S 1 -d 300 -c on_eof -p 50
run H2_self_after_ep_ev -k self_after_ep -d 300 -c on_eof -p 50 -e
run K_jitter_on_eof   -j 200 -c on_eof -p 50
run L_fabriclike      -j 200 -e -r 4 -H -c on_eof -p 20 -d 5000
run M_jitter_after_cb -j 200 -c after_cb -p 50 -d 5000
run N_jitter_in_cb    -j 200 -c in_cb -p 50 -d 5000
run J_long_delay      -d 20000 -c on_eof -p 50 -j 100
